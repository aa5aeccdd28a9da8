"""The suite schema: one TOML file per model under ``suites/``, data only.

A suite names a real Hugging Face ``config.json`` and says how to prune it, which checks to run
with which settings, on which backends and dtypes. Every key is declared here with its type,
default and description (the ``description`` doubles as documentation: ``harness validate
--schema`` prints the full reference as a markdown table, see docs/suites.md).

Later checks add their own section under ``[checks]`` by adding a field to ``Checks``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

DTYPES = ("float64", "float32", "bfloat16", "float16")


class _Strict(BaseModel):
    # extra="forbid": a misspelt key is an error that names the key, never silently ignored.
    model_config = ConfigDict(extra="forbid", validate_default=True)


class ModelSection(_Strict):
    name: str = Field("", description="Display name; defaults to the suite file's stem.")
    config: str = Field(description="Path to the model's real HF config.json, relative to the suite file.")
    weights: str | None = Field(
        None, description="Optional local safetensors file or directory (relative to the suite file). "
        "Absent: random weights seeded from [checks] seeds.")
    adapter: str = Field(
        "hf", description="'hf' builds with transformers; 'package.module:callable' calls a vendor's "
        "own builder as callable(config, dtype=..., device=...) -> torch.nn.Module.")
    trust_remote_code: bool = Field(
        False, description="Keep the config's auto_map (code shipped beside config.json) instead of dropping it. "
        "harness never imports remote code itself; off unless the suite says so.")
    architecture: str | None = Field(
        None, description="Override config.json's architectures[0] (class name in transformers).")

    @field_validator("adapter")
    @classmethod
    def _adapter_form(cls, v: str) -> str:
        if v != "hf" and (":" not in v or not all(v.split(":", 1))):
            raise ValueError(f"must be 'hf' or 'package.module:callable', got {v!r}")
        return v


class PruneSection(_Strict):
    """Shrinks the real config so that a smoke run takes seconds, while keeping the architecture's
    distinctive parts. Unset keys keep the config's value. ``num_experts`` is mapped onto whatever
    the config calls it (num_local_experts, n_routed_experts, num_experts)."""

    num_hidden_layers: int | None = Field(None, ge=1, description="Decoder layers to keep.")
    hidden_size: int | None = Field(None, ge=1, description="Model width.")
    intermediate_size: int | None = Field(None, ge=1, description="Dense MLP width.")
    moe_intermediate_size: int | None = Field(None, ge=1, description="Per-expert MLP width.")
    num_attention_heads: int | None = Field(None, ge=1, description="Query heads.")
    num_key_value_heads: int | None = Field(None, ge=1, description="KV heads (GQA groups).")
    head_dim: int | None = Field(None, ge=1, description="Explicit head dim (Qwen3 sets it).")
    num_experts: int | None = Field(None, ge=1, description="Routed experts.")
    num_experts_per_tok: int | None = Field(None, ge=1, description="Top-k routed experts per token.")
    n_shared_experts: int | None = Field(None, ge=0, description="Shared experts (DeepSeek family).")
    first_k_dense_replace: int | None = Field(None, ge=0, description="Dense layers before the MoE ones.")
    n_group: int | None = Field(None, ge=1, description="Expert groups for group-limited routing.")
    topk_group: int | None = Field(None, ge=1, description="Groups each token may route to.")
    q_lora_rank: int | None = Field(None, ge=1, description="MLA query compression rank.")
    kv_lora_rank: int | None = Field(None, ge=1, description="MLA KV compression rank.")
    qk_nope_head_dim: int | None = Field(None, ge=1, description="MLA non-rotary head dim.")
    qk_rope_head_dim: int | None = Field(None, ge=1, description="MLA rotary head dim.")
    v_head_dim: int | None = Field(None, ge=1, description="MLA value head dim.")
    vocab_size: int | None = Field(None, ge=2, description="Vocabulary; token ids in the config are remapped into it.")
    max_position_embeddings: int | None = Field(None, ge=1, description="Context length.")
    overrides: dict[str, bool | int | float | str | list | None] = Field(
        default_factory=dict, description="Any other config.json key to set verbatim.")

    @model_validator(mode="after")
    def _consistent(self) -> PruneSection:
        h, q, kv = self.hidden_size, self.num_attention_heads, self.num_key_value_heads
        if q is not None and kv is not None and q % kv:
            raise ValueError(f"num_attention_heads ({q}) must be a multiple of num_key_value_heads ({kv})")
        if h is not None and q is not None and self.head_dim is None and self.qk_nope_head_dim is None and h % q:
            raise ValueError(f"hidden_size ({h}) must be divisible by num_attention_heads ({q}) "
                             "when head_dim is not set")
        e, k = self.num_experts, self.num_experts_per_tok
        if e is not None and k is not None and k > e:
            raise ValueError(f"num_experts_per_tok ({k}) must be <= num_experts ({e})")
        if self.n_group is not None and self.topk_group is not None and self.topk_group > self.n_group:
            raise ValueError(f"topk_group ({self.topk_group}) must be <= n_group ({self.n_group})")
        if e is not None and self.n_group is not None and e % self.n_group:
            raise ValueError(f"num_experts ({e}) must be divisible by n_group ({self.n_group})")
        return self


class SmokeCheck(_Strict):
    enabled: bool = Field(True, description="Run the pruned-model smoke check.")
    batch_size: int = Field(2, ge=1, description="Sequences per batch.")
    seq_len: int = Field(16, ge=2, description="Tokens per sequence.")
    steps: int = Field(3, ge=1, description="Optimizer steps on a fixed batch; the loss must fall.")
    lr: float = Field(1e-2, gt=0, description="AdamW learning rate for the steps.")
    generate_tokens: int = Field(4, ge=0, description="Greedy tokens generated with and without KV cache.")
    seed: int = Field(0, description="Seed for weights and inputs.")
    tie_margin: dict[str, float] = Field(
        default_factory=lambda: {"float64": 1e-9, "float32": 1e-4, "bfloat16": 0.1, "float16": 0.02},
        description="A cached/uncached generation mismatch is accepted only where the uncached "
        "logits' top-2 gap is below this (a near tie), per dtype.")


class Tolerance(_Strict):
    """Precision tolerances. Unset fields fall back to the next less specific entry, then to the
    built-in defaults for the dtype (harness/precision/tolerance.py)."""

    rel_rmse: float | None = Field(None, ge=0, description="Max relative RMSE (||a-r||/||r||) of every "
                                   "captured module output and of the logits.")
    min_cosine: float | None = Field(None, le=1, description="Min cosine similarity of every captured output.")
    max_abs_err: float | None = Field(None, ge=0, description="Max absolute error of the logits (unset: recorded only).")
    min_within_1e3: float | None = Field(None, ge=0, le=1, description="Min share of logits within 1e-3 "
                                         "relative error (unset: recorded only).")
    logprob_atol: float | None = Field(None, ge=0, description="Max |logprob difference| of greedy tokens "
                                       "where target and reference agree.")
    tie_margin: float | None = Field(None, ge=0, description="A greedy token mismatch is accepted only where "
                                     "the reference's logprob gap between the two tokens is below this.")


class ToleranceOverride(Tolerance):
    dtype: str | None = Field(None, description="Applies to this run dtype (unset: any).")
    backend: str | None = Field(None, description="Applies to this backend (unset: any).")
    device: str | None = Field(None, description="Applies to device names matching this glob, e.g. "
                               "'NVIDIA H100*' (a device generation; unset: any).")


class QuantizationBudget(_Strict):
    scheme: Literal["auto", "fp8", "int8", "none"] = Field(
        "auto", description="'auto': fp8 when config.json declares an fp8 quantization_config; "
        "'fp8' (e4m3, block scales) or 'int8' (per-channel) forces it; 'none' disables the check.")
    block_size: list[int] = Field(default_factory=lambda: [128, 128], description="FP8 weight block (rows, cols).")
    compute_dtype: Literal["float32", "bfloat16"] | None = Field(
        None, description="Dtype activations run in (unset: the item's dtype).")
    rel_rmse: float = Field(0.08, ge=0, description="Budget: max relative RMSE of the logits vs the golden.")
    min_cosine: float = Field(0.995, le=1, description="Budget: min cosine similarity of the logits.")
    min_top1_agreement: float = Field(0.8, ge=0, le=1, description="Budget: min share of positions whose "
                                      "argmax token equals the golden's.")


class PrecisionCheck(_Strict):
    enabled: bool = Field(True, description="Compare against the golden (harness golden generate).")
    batch_size: int = Field(2, ge=1, description="Sequences in the golden input.")
    seq_len: int = Field(16, ge=2, description="Tokens per sequence in the golden input.")
    seed: int = Field(0, description="Weight seed (the golden input ids are stored, not regenerated).")
    generate_tokens: int = Field(4, ge=0, description="Greedy tokens stored with their logprobs.")
    reference: str = Field("cpu:float64", description="BACKEND:DTYPE the golden is made with.")
    capture: list[str] | None = Field(None, description="Regexes of module names to capture (unset: "
                                      "embeddings, rotary, each layer, norms, attention, MLP/MoE, router, final norm).")
    golden_mode: Literal["full", "sampled"] = Field(
        "full", description="'sampled' stores per-tensor statistics and a fixed sample of elements instead "
        "of whole tensors (for large models).")
    sample_size: int = Field(4096, ge=16, description="Elements kept per tensor in 'sampled' mode.")
    layer_report: Literal["on_failure", "always"] = Field("on_failure", description="When to write the "
                                                          "layer table and error plot.")
    tolerances: dict[str, Tolerance] = Field(default_factory=dict, description="Per dtype overrides of the defaults.")
    overrides: list[ToleranceOverride] = Field(default_factory=list, description="Per backend / device "
                                               "generation overrides; the most specific match wins, field by field.")
    quantization: QuantizationBudget = Field(default_factory=QuantizationBudget,
                                             description="Quantized-weights error budget.")

    @field_validator("tolerances")
    @classmethod
    def _dtype_keys(cls, v: dict) -> dict:
        bad = [k for k in v if k not in DTYPES]
        if bad:
            raise ValueError(f"keys must be dtypes {DTYPES}, got {bad}")
        return v


class OpsCheck(_Strict):
    enabled: bool = Field(
        False, description="Generate one conformance item per aten op of the pruned model (opt-in: the "
        "op inventory is traced once per suite and cached on disk).")
    examples: int = Field(6, ge=0, description="Hypothesis examples per op beyond the model's own inputs "
                          "(zeros, large magnitudes, negatives, denormals).")
    tolerance: dict[str, float] = Field(
        default_factory=lambda: {"float64": 1e-10, "float32": 1e-5, "bfloat16": 3e-2, "float16": 3e-3},
        description="Max |out - ref| / max(|ref|, 1) per dtype against the CPU float64 reference.")
    skip: list[str] = Field(default_factory=list, description="Ops not to generate items for (aten.x.overload).")


class Checks(_Strict):
    smoke: SmokeCheck = Field(default_factory=SmokeCheck, description="Pruned-model smoke check.")
    ops: OpsCheck = Field(default_factory=OpsCheck, description="Per-op conformance against CPU float64.")
    precision: PrecisionCheck = Field(default_factory=PrecisionCheck, description="Golden-output precision check.")


class Suite(_Strict):
    model: ModelSection = Field(description="Which model, from which real config.")
    prune: PruneSection = Field(default_factory=PruneSection, description="How to shrink it.")
    checks: Checks = Field(default_factory=Checks, description="Checks and their settings.")
    backends: list[str] = Field(
        default_factory=lambda: ["*"],
        description="Backends to run on; '*' means every registered backend (absent ones skip).")
    dtypes: list[Literal["float64", "float32", "bfloat16", "float16"]] = Field(
        default_factory=lambda: ["float32", "bfloat16"], description="Run dtypes.")
    thresholds: dict[str, float] = Field(
        default_factory=dict,
        description="Per metric, the relative change `harness compare` calls a regression for this suite "
        "(e.g. wall_time_s = 0.25); unset metrics use compare's --threshold.")
    known_gaps: dict[str, list[str]] = Field(
        default_factory=dict, description="Per backend, operators known to be missing (tracked, not silent).")

    @field_validator("backends", "dtypes")
    @classmethod
    def _non_empty_unique(cls, v: list) -> list:
        if not v:
            raise ValueError("must list at least one entry")
        if len(set(v)) != len(v):
            raise ValueError(f"has duplicates: {v}")
        return v
