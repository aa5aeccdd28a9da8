"""The suite schema: one TOML file per model under ``suites/``, data only.

A suite names a real Hugging Face ``config.json`` and says how to prune it, which checks to run
with which settings, on which backends and dtypes. Every key is declared here with its type,
default and description (the ``description`` doubles as documentation: ``harness validate
--schema`` prints the full reference as a markdown table, see docs/suites.md).

The ``[checks]`` table is not declared here: each registered check declares its own
``[checks.<name>]`` table (``Check.config_model``, see harness/checks/base.py) and
:func:`suite_model` assembles the schema from the check registry, so a vendor's check is validated
like the built-ins.
"""

from __future__ import annotations

import functools
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator, model_validator

from harness.registry import of_group

DTYPES = ("float64", "float32", "bfloat16", "float16")


class _Strict(BaseModel):
    # extra="forbid": a misspelt key is an error that names the key, never silently ignored.
    # strict: a TOML `true` is no integer, a string no number; every value has the type the key declares.
    # allow_inf_nan=False: TOML has `nan` and `inf`; no knob means either (an infinite time limit is
    # no limit, a NaN tolerance passes everything).
    model_config = ConfigDict(extra="forbid", validate_default=True, strict=True, allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _bounded(cls, v, info):
        """Every number of every check's table within a ceiling (issue #49: `decode.steps = 10**9`
        passed `validate` and `golden generate` allocated until MemoryError): a key that declares its
        own upper bound (``le``/``lt``) keeps it; any other count is at most ``KNOB_INT_MAX`` and any
        other real number at most ``KNOB_FLOAT_MAX`` in size, in lists and tables too."""
        field = cls.model_fields.get(info.field_name)
        if field is None or any(hasattr(m, "le") or hasattr(m, "lt") for m in field.metadata):
            return v
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        int_max = int(extra.get("max", KNOB_INT_MAX))  # a list's own ceiling: Field(json_schema_extra={"max": N})
        for x in _numbers(v):
            if isinstance(x, int) and abs(x) > int_max:
                raise ValueError(f"{x} is beyond what any count here may be (at most {int_max:,})")
            if isinstance(x, float) and abs(x) > KNOB_FLOAT_MAX:
                raise ValueError(f"{x:g} is beyond what any amount here may be (at most {KNOB_FLOAT_MAX:g})")
        return v


class ModelSection(_Strict):
    name: str = Field("", description="Display name; defaults to the suite file's stem.")
    config: str = Field(description="Path to the model's real HF config.json, relative to the suite file.")
    weights: str | None = Field(
        None, description="Optional local checkpoint in the Hugging Face layout (directory with model.safetensors "
        "or model-XXXXX-of-YYYYY.safetensors + model.safetensors.index.json, or one .safetensors file), relative "
        "to the suite file; or '$VAR' to read the path from an environment variable (same as weights_env). "
        "Absent: random weights seeded from [checks] seeds. docs/weights.md")
    weights_env: str | None = Field(
        None, description="Environment variable holding the checkpoint path (CI runners differ); unset or "
        "missing: the weight checks skip with that reason, the others run on random weights.")
    weights_layers: list[int] = Field(
        default_factory=list, description="Source layer of each pruned layer (empty: for each pruned layer the "
        "first unused checkpoint layer of the same kind, e.g. first dense and first MoE layer).")
    weights_experts: list[int] = Field(
        default_factory=list, description="Source expert of each pruned expert (empty: the first prune.num_experts).")
    weights_quantized: Literal["dequantize", "native"] = Field(
        "dequantize", description="Quantized checkpoints (FP8 block, INT4 pack-quantized, MXFP4): dequantize "
        "exactly, or keep quantized on a backend that runs the format natively.")
    weights_allow_pickle: bool = Field(
        False, description="Read a checkpoint that has only pickle files (.bin/.pt) with "
        "torch.load(weights_only=True); off: such a checkpoint is refused.")

    @model_validator(mode="before")
    @classmethod
    def _weights_from_env(cls, data):
        # weights = "$VAR" / "${VAR}" is weights_env = "VAR": the path is resolved at run time, so a
        # runner without the checkpoint skips the weight checks instead of failing the suite.
        w = data.get("weights") if isinstance(data, dict) else None
        if isinstance(w, str) and w.startswith("$") and not data.get("weights_env"):
            data = {**data, "weights": None, "weights_env": w.strip("${}")}
        return data
    adapter: str = Field(
        "hf", description="The model builder: the name of a registered one ('hf', transformers' class for the "
        "architecture; a vendor's, through the harness.models entry point), or 'package.module:callable', "
        "called as callable(config, dtype=..., device=...) -> torch.nn.Module.")
    trust_remote_code: bool = Field(
        False, description="Keep the config's auto_map (code shipped beside config.json) instead of dropping it. "
        "harness never imports remote code itself; off unless the suite says so.")
    architecture: str | None = Field(
        None, description="Override config.json's architectures[0] (class name in transformers).")

    @field_validator("name")
    @classmethod
    def _plain_name(cls, v: str) -> str:
        # the name becomes golden/<name>/, results/perf/<name>/, ...: a plain name (harness.files.paths)
        from harness.files.paths import problem

        why = problem(v) if v else None
        if why:
            raise ValueError(why)
        return v

    @field_validator("adapter")
    @classmethod
    def _adapter_form(cls, v: str) -> str:
        if ":" in v:
            if not all(v.split(":", 1)):
                raise ValueError(f"must be a model builder's name or 'package.module:callable', got {v!r}")
            return v
        builders = of_group("harness.models")  # the model builders' registry (an extension point)
        if v not in builders:
            raise ValueError(f"unknown model builder {v!r} (registered: {', '.join(builders.names())}); "
                             f"or name one as 'package.module:callable'")
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


class PlanSection(_Strict):
    """The cluster the full-size model is meant for: ``harness plan SUITE`` (and ``--rehearse``)
    defaults its --devices / --device-memory / --nodes / --mode to these (docs/parallel.md)."""

    devices: int = Field(ge=1, le=1024, description="Devices per node.")
    device_memory_gib: float = Field(gt=0, le=2**20, allow_inf_nan=False, description="Memory of one device in GiB.")
    nodes: int = Field(1, ge=1, le=2**20, description="Nodes.")
    mode: Literal["inference", "training"] = Field("inference", description="What the cluster runs.")


class Suite(_Strict):
    """The suite-level keys. The full schema, ``[checks]`` included, is :func:`suite_model`."""

    plan: PlanSection | None = Field(None, description="The production cluster for `harness plan` "
                                     "(devices per node, device memory, nodes, mode).")

    model: ModelSection = Field(description="Which model, from which real config.")
    prune: PruneSection = Field(default_factory=PruneSection, description="How to shrink it.")
    backends: list[str] = Field(
        default_factory=lambda: ["*"],
        description="Backends to run on; '*' means every registered backend (absent ones skip).")
    dtypes: list[Literal["float64", "float32", "bfloat16", "float16"]] = Field(
        default_factory=lambda: ["float32", "bfloat16"], description="Run dtypes.")
    timeout_s: float | None = Field(
        None, gt=0, allow_inf_nan=False, description="Wall-clock limit of one item in seconds, build included: "
        "the backstop for an item that keeps spinning (unset: 30x its recorded duration and at least 900 s, else "
        "1800 s; --harness-timeout wins). A hung item is killed and reported with its phase.")
    stall_s: float | None = Field(
        None, gt=0, allow_inf_nan=False, description="An isolated item whose processes use no CPU and enter no "
        "phase or module for this long is hung: killed and reported with its phase and last module (unset: 60 s). "
        "Raise it for a model that legitimately waits longer, e.g. on a device kernel with blocking sync.")
    memory_limit_gib: float | None = Field(
        None, gt=0, description="Host RSS limit of one isolated item in GiB (unset: none; "
        "--harness-memory-limit wins).")
    thresholds: dict[str, float] = Field(
        default_factory=dict,
        description="Per metric, the relative change `harness compare` calls a regression for this suite "
        "(e.g. wall_time_s = 0.25); unset metrics use compare's --threshold.")
    known_gaps: dict[str, list[str | dict[str, str]]] = Field(
        default_factory=dict, description="Per backend, operators known to be missing (tracked, not silent): "
        "\"aten::histc\", or { op = \"aten::histc\", versions = \"<2.6\" } for the backend versions it applies to "
        "(packaging specifiers against the installed plugin's version, else the op list's).")

    @field_validator("known_gaps")
    @classmethod
    def _gap_entries(cls, v: dict) -> dict:
        from packaging.specifiers import InvalidSpecifier, SpecifierSet

        for backend, entries in v.items():
            for e in entries:
                if isinstance(e, str):
                    continue
                if "op" not in e or set(e) - {"op", "versions"}:
                    raise ValueError(f"{backend}: an entry is \"aten::op\" or {{ op = ..., versions = ... }}, got {e}")
                try:
                    SpecifierSet(e.get("versions", ""))
                except InvalidSpecifier:
                    raise ValueError(f"{backend}: {e['op']}: versions {e['versions']!r} is not a version specifier "
                                     "(e.g. \"<2.6\" or \">=2.4,<2.6\")") from None
        return v

    @field_validator("backends", "dtypes")
    @classmethod
    def _non_empty_unique(cls, v: list) -> list:
        if not v:
            raise ValueError("must list at least one entry")
        if len(set(v)) != len(v):
            raise ValueError(f"has duplicates: {v}")
        return v


KNOB_INT_MAX = 1_000_000  # steps, tokens, repeats, sizes of a check: a million is already hours or GiBs
KNOB_FLOAT_MAX = 1e9  # seconds, rates, factors, tolerances: past this it is a typo, not a setting


def _numbers(v) -> list:
    """The numbers in a knob's value (itself, a list's items, a table's values); booleans are not."""
    if isinstance(v, bool):
        return []
    if isinstance(v, (int, float)):
        return [v]
    if isinstance(v, (list, tuple)):
        return [x for item in v for x in _numbers(item)]
    if isinstance(v, dict):
        return [x for item in v.values() for x in _numbers(item)]
    return []


class CheckConfig(_Strict):
    """Base of every ``[checks.<name>]`` table. Subclasses add their own keys (each with type,
    default and description) and may change the defaults of these two."""
    # _Strict: misspelt keys, wrong types, NaN/inf and unbounded numbers refused, naming the key.

    enabled: bool = Field(True, description="Generate this check's items for the suite.")
    variants: list[str] = Field(
        default_factory=list, description="Only these variants of the check (empty: every variant the "
        "check generates, e.g. every op for `ops`). An unknown name is an error listing the known ones.")
    scope: Literal["commit", "nightly"] = Field(
        "commit", description="Which runs generate this check's items: 'commit' (every run) or 'nightly' "
        "(only `--scope nightly`, which also runs every commit item).")


CHECKS_DESCRIPTION = "Checks and their settings: one table per registered check."


def suite_model() -> type[Suite]:
    """The suite schema with one ``[checks.<name>]`` table per registered check (built-in or a
    vendor's, through the ``harness.checks`` entry point), each the check's own ``config_model``."""
    return _assemble(tuple((c.name, c.config_model, c.description) for c in of_group("harness.checks")))


@functools.cache
def _assemble(checks: tuple[tuple[str, type[BaseModel] | None, str], ...]) -> type[Suite]:
    fields = {}
    for name, model, description in checks:
        model = model or CheckConfig
        doc = description or (model.__doc__ or "").strip().splitlines()[0] if (description or model.__doc__) else ""
        fields[name] = (model, Field(default_factory=model, description=doc or f"the {name} check"))
    checks_model = create_model("Checks", __base__=_Strict, **fields)
    return create_model("Suite", __base__=Suite,
                        checks=(checks_model, Field(default_factory=checks_model, description=CHECKS_DESCRIPTION)))
