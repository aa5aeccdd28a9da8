"""Check ``decode``: the decode path a server runs - prefill into a KV cache, then one token per
step from the cache - compared step by step and layer by layer with the golden's float64 reference
decoding with its own cache (harness/precision/decode.py; docs/decode.md).

One item per suite x backend x dtype x cache (``decode[cpu-bfloat16-static]``): ``dynamic`` (the
default cache; transformers builds full, sliding-window, linear-attention/Mamba or no-cache layers
per layer from the model's config), ``static`` (the graph-capture path), ``offloaded``,
``quantized-fp8|quanto|hqq`` and ``padded`` (a left-padded batch with an attention mask: each row
must decode as it does alone). A cache the model or this install does not offer is skipped with
the reason.

Each step is held to two measured budgets: against the golden (the float64 cached decode of the same
teacher-forced tokens) and against the target's own uncached forward of the same sequence in the
same dtype (the witness: on the reference backend a clean cache reproduces it to the bit in bf16,
so a cache fault stands out even where the dtype's own error is large). A failure names the first
step and decoder layer over budget and says whether the prefill (against the forward golden's
logits) agrees. Beside their size, the direction of the differences from the witness is judged
(issue #51): a sign test over the decoded positions of their scale and offset (each the mean over the
position's attention and layer outputs), so that a decode
kernel whose output is a few float32 ulps high at every step - inside every budget - fails with its
step and module named (docs/decode.md, "One-signed errors").

Steps: ``golden`` -> ``budgets`` -> ``cache`` -> ``build`` -> ``decode`` -> ``compare`` -> ``record``
-> ``verdict``.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

from pydantic import Field

from harness import metrics
from harness.checks import (
    Check,
    CheckConfig,
    CheckContext,
    CheckFailure,
    CheckRegistry,
    NotApplicable,
)
from harness.golden.sections import GoldenSection, load_golden_for

WHAT_ORDER = {"attn": 0, "hidden": 1, "logits": 2, "logprob": 3}
VARIANTS = ("dynamic", "static", "offloaded", "quantized-fp8", "quantized-quanto", "quantized-hqq", "padded")


def _section_spec(ls) -> dict | None:
    # deferred, as in every step: registering the check stays cheap
    from harness.precision import decode as dec

    return dec.spec(ls)


def _section_build(ref) -> tuple[dict, dict]:
    from harness.precision import decode as dec

    return dec.build(ref)


# The golden's decode section: the float64 reference's cached decode, step by step (its producer is
# harness/precision/decode.py; `harness golden generate` makes it for every suite that enables this check).
SECTION = GoldenSection("decode", _section_spec, _section_build,
                        values=(("tokens", "ids"), ("padded.ids", "ids"), ("padded.mask", "mask")))

metrics.declare("decode_worst_budget_use", "", "lower", "largest decode error / its budget over steps, layers "
                "and both comparisons (fails > 1)")
metrics.declare("decode_logits_rel_rmse", "", "lower", "largest per-step logits rel_rmse of the cached decode "
                "against the golden's float64 cached decode")
metrics.declare("decode_hidden_worst_rel_rmse", "", "lower", "largest rel_rmse of a decoder layer's output at a "
                "decoded position against the golden")
metrics.declare("decode_logprob_max_abs_diff", "nats", "lower", "largest |log-prob difference| at the golden's "
                "argmax over the decode steps")
metrics.declare("decode_uncached_worst_rel_rmse", "", "lower", "largest rel_rmse of the cached decode against the "
                "target's own uncached forward of the same tokens (layers and logits)")
metrics.declare("decode_prefill_logits_rel_rmse", "", "lower", "rel_rmse of the cached prefill's logits against "
                "the forward golden's")
metrics.declare("decode_rows_over_budget", "", "lower", "(step, layer or logits) rows over their budget")
metrics.declare("decode_signed_min_p", "", "higher", "smallest sign-test p of the cached decode's per-row scale and "
                "offset against its own uncached forward, per decoded position over its attention and layer outputs "
                "(harness.precision.signed.pooled_tests; fails below 1e-4 / 2 with an effect above the dtype's floor)")
metrics.declare("decode_signed_max_effect", "", "lower", "largest |mean per-row scale or offset| of the cached decode "
                "against its own uncached forward")
metrics.declare("decode_steps", "", "none", "decode steps compared after the prefill")
metrics.declare("decode_router_flips", "", "lower", "tokens of the cached decode (prefill and steps) whose router chose other "
                "experts than the golden's (forced to the golden's: a near-tie flip is not a cache fault)")


class DecodeConfig(CheckConfig):
    """Cached decode against the golden's float64 cached decode, step by step and layer by layer."""

    steps: int = Field(8, ge=1, le=4096, description="Decode steps after the prefill (positions seq_len .. seq_len+steps-1), "
                       "teacher-forced on the reference's greedy tokens.")
    topk: int = Field(64, ge=1, description="Logits kept per step at the reference's top-k ids when the "
                      "vocabulary is larger than full_vocab_max.")
    full_vocab_max: int = Field(4096, ge=1, description="Vocabularies up to this size keep every logit per step.")
    padded: bool = Field(True, description="Also store and check a left-padded batch (the `padded` variant).")
    pad: int = Field(4, ge=1, description="Tokens odd rows lose and are left-padded by in the padded batch "
                     "(must be below checks.precision.seq_len).")
    quantized_residual_length: int = Field(8, ge=1, description="quanto/hqq quantized caches: positions kept "
                                           "unquantized (transformers' default 128 would never quantize the "
                                           "golden's seq_len + steps positions).")
    budget_k: float = Field(1.5, ge=1, description="A row fails when its error exceeds budget_k x its measured clean "
                            "error (max over draws) + the dtype's floor (as checks.precision.budget_k).")
    witness_share: float = Field(0.25, gt=0, le=1, description="Budget of the comparison with the target's own "
                                 "uncached forward, at least this share of the row's golden budget (room for a "
                                 "backend whose decode kernel rounds otherwise than its prefill kernel).")


@dataclass
class Row:
    """One compared value: a step's layer output (``layer`` = index), logits or logprob."""

    step: int
    what: str  # "attn" | "hidden" | "logits" | "logprob"
    layer: int | None  # decoder layer index (attn and hidden rows)
    against: str  # "reference" | "uncached"
    value: float
    budget: float
    row: int  # batch row with the largest error

    @property
    def ok(self) -> bool:
        return self.value <= self.budget

    @property
    def order(self) -> tuple:
        # a step's layers in order, each layer's attention before its output, then logits, logprob
        return (self.step, self.layer if self.layer is not None else 10**6, WHAT_ORDER[self.what],
                self.against != "reference")


def run_decode(ctx: CheckContext, *, transform=None, context=None, golden_root=None, results_dir=None):
    """The check with options: ``transform`` (model -> model) / ``context`` (() -> context manager
    around the decode) inject faults (tests); ``golden_root``/``results_dir`` redirect files.
    Returns the compared rows when it passes."""
    return DecodeCheck().run(ctx, transform=transform, context=context, golden_root=golden_root,
                             results_dir=results_dir).rows


def _budget(k: float, measured: float, floor: float, ceiling: float | None) -> float:
    """k x measured + floor, capped by the ceiling where the measurement is within it (a row whose
    clean error already exceeds the ceiling / k keeps its measured budget: the cap would fail a clean run)."""
    b = k * measured + floor
    return b if ceiling is None or k * measured > ceiling else min(b, ceiling)


def budget_tables(measured: dict | None, dtype: str, tol: dict, k: float, share: float,
                  capped: bool = True) -> dict:
    """{"reference" | "uncached": {"hidden" | "attn": [[budget per layer] per step], "logits": [...],
    "logprob": [...]}, "prefill": float | None} from a variant's measurement; without one (a dtype
    the golden did not measure), the tolerance for every golden row and ``share`` of it for the witness."""
    from harness.precision.budgets import FLOORS

    f = FLOORS.get(dtype, 0.0)
    rel = tol["rel_rmse"] if capped else None
    lp = tol["logprob_atol"] if capped else None
    if measured is None:
        r, lp = tol["rel_rmse"], tol["logprob_atol"]
        return {"reference": {"hidden": r, "attn": r, "logits": r, "logprob": lp},
                "uncached": {"hidden": share * r, "attn": share * r, "logits": share * r, "logprob": share * lp},
                "prefill": r}
    ref = measured["reference"]
    out = {"reference": {key: [[_budget(k, v, f, rel) for v in step] for step in ref[key]] for key in ("hidden", "attn")}}
    out["reference"].update({
                             "logits": [_budget(k, v, f, rel) for v in ref["logits"]],
                             # nats: +0.01 as the precision check's greedy logprob budget
                             "logprob": [_budget(k, v, 0.01, lp) for v in ref["logprob"]]})
    wit = measured["uncached"]
    out["uncached"] = {key: _witness(k, f, share, wit[key], out["reference"][key]) for key in wit}
    pre = ref.get("prefill")
    out["prefill"] = None if pre is None else _budget(k, pre, f, rel)
    return out


def _witness(k: float, floor: float, share: float, measured, ref_budget):
    if isinstance(measured, list):
        return [_witness(k, floor, share, m, b) for m, b in zip(measured, ref_budget, strict=True)]
    return max(k * measured + floor, share * ref_budget)


def _at(table, s: int, layer: int | None = None) -> float:
    """A budget table's entry (a number where the whole table is one tolerance)."""
    if isinstance(table, (int, float)):
        return float(table)
    return float(table[s][layer] if layer is not None else table[s])


def rows_of(errs: dict, budgets: dict, against: str, attention_layers: list[int]) -> list[Row]:
    """Every (step, attention | layer | logits | logprob) value of one comparison with its budget;
    ``errs`` are per batch row ([B, N, L] / [B, N, A] / [B, N]), the row with the largest error is named."""
    out = []
    h, a = errs["hidden"], errs["attn"]
    for s in range(h.shape[1]):
        for layer in range(h.shape[2]):
            v, b = h[:, s, layer].max(0)
            out.append(Row(s, "hidden", layer, against, v.item(), _at(budgets["hidden"], s, layer), b.item()))
        for j, layer in enumerate(attention_layers):
            v, b = a[:, s, j].max(0)
            out.append(Row(s, "attn", layer, against, v.item(), _at(budgets["attn"], s, j), b.item()))
        for what in ("logits", "logprob"):
            v, b = errs[what][:, s].max(0)
            out.append(Row(s, what, None, against, v.item(), _at(budgets[what], s), b.item()))
    return out


class DecodeCheck(Check):
    cpu_threads = 1  # the pruned test models: one intra-op thread (harness.models.build.cpu_threads)
    name = "decode"
    order = 22
    config_model = DecodeConfig
    description = "cached decode (dynamic/static/offloaded/quantized caches, left-padded batch) against the golden"
    headline = ("decode_worst_budget_use", "decode_logits_rel_rmse")
    steps = ("golden", "budgets", "cache", "build", "decode", "compare", "record", "verdict")
    setup_steps = ("golden", "budgets", "build")
    golden_sections = (SECTION,)

    def variants(self, suite, backend) -> list[str | None]:
        return list(VARIANTS)

    def new_state(self, ctx: CheckContext):
        return SimpleNamespace(transform=None, context=None, golden_root=None, results_dir=None, rows=None)

    def golden(self, ctx: CheckContext, st) -> None:
        st.g = load_golden_for(ctx, st.golden_root)
        st.section = SECTION.read(st.g, ctx.suite)
        st.variant = ctx.variant or "dynamic"
        ctx.metric("decode_steps", st.section.tensors["tokens"].shape[1])

    def budgets(self, ctx: CheckContext, st) -> None:
        """This variant's budgets from the golden's measurement in this dtype (k x clean + floor, the
        precision tolerance as ceiling; the quantized caches' own error is their budget, uncapped)."""
        from harness.precision.decode import BUDGET_OF, QUANTIZED
        from harness.precision.runner import tolerances_for

        cfg, entry = ctx.config, st.section.entry
        if st.variant == "padded" and "padded.ids" not in st.section.tensors:
            raise NotApplicable("the golden has no padded layout ([checks.decode] padded = false, or pad >= seq_len)")
        tol, _ = tolerances_for(ctx.suite, ctx.backend, ctx.dtype)
        by_dtype = (entry.get("budgets") or {}).get(ctx.dtype)
        measured = (by_dtype or {}).get(BUDGET_OF.get(st.variant, st.variant))
        if by_dtype is not None and measured is None:
            raise NotApplicable(self._not_offered(ctx, st))
        st.budgets = budget_tables(measured, ctx.dtype, tol, cfg.budget_k, cfg.witness_share,
                                   capped=st.variant not in QUANTIZED)
        ctx.detail("budget_source", f"measured clean error x {cfg.budget_k:g} + floor over {entry.get('draws')} draws"
                   if measured else f"no measurement for {ctx.dtype} in the golden: tolerance {tol['rel_rmse']:.3g}")
        ctx.detail("decode_layer_kinds", layer_kinds(entry))
        if measured:
            high = _above_ceiling(measured, tol, cfg.budget_k) if st.variant not in QUANTIZED else 0
            if high:
                ctx.notes.append(f"{high} decode row(s) of {ctx.dtype} measure a clean error above the precision "
                                 f"tolerance {tol['rel_rmse']:.3g} / k: their budget is the measurement")

    def _not_offered(self, ctx: CheckContext, st) -> str:
        """Why the golden has no measurement for this cache (it did not exist for the model or install)."""
        from harness.precision.decode import make_cache

        try:
            model = SimpleNamespace(config=_config(ctx.suite))
            make_cache(st.variant, model, 2, ctx.config.quantized_residual_length)
        except (ValueError, ImportError) as e:
            return f"{st.variant} cache not offered here: {type(e).__name__}: {e}"
        return (f"the golden has no {st.variant} measurement (made where that cache was not offered); "
                f"regenerate with `harness golden generate {ctx.suite.name} --update`")

    def cache(self, ctx: CheckContext, st) -> None:
        """The variant's cache for the target, built lazily in ``decode`` (it needs the model's config)."""
        from harness.precision.decode import make_cache

        n = st.section.tensors["tokens"].shape[1]
        s = st.g.inputs.shape[1]
        st.make = lambda model: make_cache(st.variant, model, s + n, ctx.config.quantized_residual_length)

    def build(self, ctx: CheckContext, st) -> None:
        from harness.precision.runner import build_target

        st.model, mc = build_target(ctx.suite, ctx.backend, ctx.dtype, st.transform, st.g)
        ctx.notes.extend(mc.notes)

    def decode(self, ctx: CheckContext, st) -> None:
        """The target's cached decode of the golden's ids, teacher-forced on the golden's tokens, and
        its own uncached forward of the same sequence (the witness)."""
        import contextlib

        from harness.precision.decode import decode_run, routes_of, uncached_view

        t = st.section.tensors
        # routers forced to the golden's choices (the padded layout: each row's alone, in the batch's layout)
        routes = routes_of(t, t["tokens"].shape[1] + 1, "padded." if st.variant == "padded" else "")
        dev = ctx.backend.device()
        ids, mask = (t["padded.ids"], t["padded.mask"]) if st.variant == "padded" else (st.g.inputs, None)
        ids, mask = ids.to(dev), None if mask is None else mask.to(dev)
        with st.context() if st.context is not None else contextlib.nullcontext():
            try:  # inside the context: a fault may be in how the cache is built
                cache = st.make(st.model)
            except (ValueError, ImportError) as e:
                raise NotApplicable(f"{st.variant} cache not offered here: {type(e).__name__}: {e}") from None
            try:
                st.run = decode_run(st.model, ids, t["tokens"].shape[1], cache, mask=mask, tokens=t["tokens"],
                                    routes=routes)
            except (RuntimeError, AssertionError) as e:
                if st.variant == "offloaded" and ctx.backend.device().type != "cuda":
                    # transformers' offloading prefetches on torch.cuda streams (a PrivateUse1
                    # device crashed here before: the test device, issue #28)
                    raise NotApplicable(f"offloaded cache needs a CUDA device: {type(e).__name__}: {e}") from None
                raise
            st.witness = uncached_view(st.model, ids, t["tokens"], mask, routes)
        st.model = None  # free the target before comparing
        routers = st.section.entry.get("routers") or []
        if routes is not None:
            flips = sum(st.run.flips.values())
            ctx.metric("decode_router_flips", flips)
            if flips:
                ctx.notes.append(f"{flips} token(s) of the prefill or the steps whose own expert choice differs from the golden's, forced to "
                                 f"the golden's: " + ", ".join(f"{r} {n}" for r, n in sorted(st.run.flips.items()) if n))
            if st.run.unforced:
                ctx.notes.append(f"routers not forced to the golden's choices: {', '.join(st.run.unforced)}")
        elif routers:
            ctx.notes.append("the golden stores no decode routes (made before they were): routers not forced; "
                             f"regenerate with `harness golden generate {ctx.suite.name} --update`")

    def compare(self, ctx: CheckContext, st) -> None:
        from harness.precision.decode import errors, prefill_error, signed_tests

        t = st.section.tensors
        pre = "padded." if st.variant == "padded" else ""
        view = {k: t[pre + k] for k in ("hidden", "attn", "logits", "lse", "top_ids") if pre + k in t}
        st.errs = errors(st.run, view)
        at = st.section.entry.get("attention_layers") or []
        st.rows = rows_of(st.errs, st.budgets["reference"], "reference", at)
        st.rows += rows_of(errors(st.run, st.witness), st.budgets["uncached"], "uncached", at)
        st.rows.sort(key=lambda r: r.order)
        # the forward golden's logits: whole only in a full golden (a sampled one keeps a sample)
        st.prefill = None if pre or st.g.sampled else prefill_error(st.run, st.g.modules["logits"])
        st.signed, st.signed_cols, why = signed_tests(st.run, st.witness, ctx.dtype, st.variant, at)
        if why:
            ctx.notes.append(f"one-signed decode error not tested: {why}")
        ctx.detail("decode_cache_layers", ", ".join(st.run.cache_layers))

    def record(self, ctx: CheckContext, st) -> None:
        ref = [r for r in st.rows if r.against == "reference"]
        wit = [r for r in st.rows if r.against == "uncached" and r.what != "logprob"]
        ctx.metric("decode_worst_budget_use", max(r.value / r.budget for r in st.rows))  # budgets > 0: floors
        ctx.metric("decode_logits_rel_rmse", max(r.value for r in ref if r.what == "logits"))
        ctx.metric("decode_hidden_worst_rel_rmse", max(r.value for r in ref if r.what == "hidden"))
        ctx.metric("decode_logprob_max_abs_diff", max(r.value for r in ref if r.what == "logprob"))
        ctx.metric("decode_uncached_worst_rel_rmse", max(r.value for r in wit))
        if st.prefill is not None:
            ctx.metric("decode_prefill_logits_rel_rmse", st.prefill)
            if st.budgets["prefill"] is not None:
                ctx.tolerance("decode_prefill_logits_rel_rmse", st.budgets["prefill"])
        ctx.metric("decode_rows_over_budget", sum(not r.ok for r in st.rows))
        if st.signed:
            ctx.metric("decode_signed_min_p", min(t.p for t in st.signed))
            ctx.metric("decode_signed_max_effect", max(abs(t.effect) for t in st.signed))
        ctx.detail("decode_kind_budget_use", _kind_use(st.rows, st.section.entry))
        # each step's worst budget use, compact: `harness report` plots the decode step by step
        steps: dict[int, float] = {}
        for r in st.rows:
            steps[r.step] = max(steps.get(r.step, 0.0), r.value / r.budget)
        ctx.detail("step_budget_use", metrics.budget_use_json((f"step {s}", u) for s, u in sorted(steps.items())))

    def verdict(self, ctx: CheckContext, st) -> None:
        bad = [r for r in st.rows if not r.ok]
        if not bad:
            failure = _signed_failure(ctx, st)
            if failure is not None:
                raise failure
            return
        first = bad[0]
        entry = st.section.entry
        where = _where(first, entry)
        ctx.detail("first_divergent_step", str(first.step))
        ctx.detail("first_divergent_layer", where)
        raise CheckFailure(f"{_lead(ctx, st, first)}: step {first.step} (position {entry['positions'][0] + first.step}), "
                           f"{where}: {_said(first)}; first of {len(bad)} row(s) over budget",
                           metric=f"decode.step{first.step}.{first.what}", expected=f"<= {first.budget:.3g}",
                           observed=f"{first.value:.4g}", tolerance=first.budget, details=_table(bad))


def _signed_failure(ctx: CheckContext, st) -> CheckFailure | None:
    """Every row inside its budget, but the cache path's error against the uncached witness one-signed:
    what failed first (the step, the layer's module and cache), then the sign test's figures."""
    from harness.precision import signed

    t = signed.pooled_failure(st.signed, ctx.dtype)
    if t is None:
        return None
    entry = st.section.entry
    p_lim, floor = signed.pooled_limit(st.signed, ctx.dtype)
    what, layer = st.signed_cols[t.column]
    where = _where(Row(t.step, what, layer, "uncached", 0.0, 0.0, 0), entry)
    ctx.detail("first_divergent_step", str(t.step))
    ctx.detail("first_divergent_layer", where)
    names = [f"{layer}{' attention' if w == 'attn' else ''}" for w, layer in st.signed_cols]
    table = ["step  " + "  ".join(f"{n:>12}" for n in names)] + [
        f"{s:<5} " + "  ".join(f"{v:>+12.3e}" for v in row) for s, row in enumerate(t.per)]
    return CheckFailure(
        f"cached decode: one-signed {t.kind} error from step {t.step} (position {entry['positions'][0] + t.step}), "
        f"{where}, against the target's own uncached forward: {t.words(p_lim)}; inside every magnitude budget "
        f"(worst use {max(r.value / r.budget for r in st.rows):.2g})",
        metric=f"decode.signed.{t.kind}", expected=f"p >= {p_lim:.2g} or |effect| <= {floor:.3g}",
        observed=f"p={t.p:.2g}, effect {t.effect:+.3g}", tolerance=p_lim,
        details=f"mean {t.kind} error per step and layer (attention output, layer output) against the uncached "
                "forward:\n" + "\n".join(table))


def _config(ls):
    from harness.models.build import model_config

    return model_config(ls).config


def layer_kinds(entry: dict) -> str:
    """'model.layers.0-4 sliding_attention (DynamicSlidingWindowLayer), model.layers.5 full_attention (DynamicLayer)'."""
    names, types = entry["layers"], entry["layer_types"]
    caches = entry.get("cache_layers") or [""] * len(names)
    groups: list[list] = []
    for i, (lt, c) in enumerate(zip(types, caches + [""] * (len(names) - len(caches)), strict=False)):
        if groups and groups[-1][1:] == [lt, c] and groups[-1][0][-1] == i - 1:
            groups[-1][0].append(i)
        else:
            groups.append([[i], lt, c])
    prefix = names[0].rsplit(".", 1)[0] if names else "layers"
    return ", ".join(f"{prefix}.{ix[0]}{'-' + str(ix[-1]) if len(ix) > 1 else ''} {lt}" + (f" ({c})" if c else "")
                     for ix, lt, c in groups)


def _kind_use(rows: list[Row], entry: dict) -> str:
    """Worst budget use per layer kind: a hybrid model is covered layer kind by layer kind."""
    use: dict[str, float] = {}
    for r in rows:
        if r.layer is not None:
            k = entry["layer_types"][r.layer]
            use[k] = max(use.get(k, 0.0), r.value / r.budget if r.budget else float("inf"))
    return ", ".join(f"{k} {v:.3g}" for k, v in use.items())


def _above_ceiling(measured: dict, tol: dict, k: float) -> int:
    ref = measured["reference"]
    vals = [v for key in ("hidden", "attn") for step in ref[key] for v in step] + list(ref["logits"])
    return sum(k * v > tol["rel_rmse"] for v in vals)


def _where(r: Row, entry: dict) -> str:
    if r.layer is None:
        return "logits" if r.what == "logits" else "log-probabilities"
    kind = entry["layer_types"][r.layer]
    cache = (entry.get("cache_layers") or [])[r.layer:r.layer + 1]
    name = entry["layers"][r.layer]
    if r.what == "attn":
        name = entry["attention"][entry["attention_layers"].index(r.layer)]
    return f"{name} ({kind}{', ' + cache[0] if cache else ''})"


def _said(r: Row) -> str:
    what = "|logprob diff|" if r.what == "logprob" else "rel_rmse"
    vs = "the golden" if r.against == "reference" else "the target's own uncached forward"
    return f"{what} {r.value:.3g} > budget {r.budget:.3g} against {vs} (batch row {r.row})"


def _lead(ctx: CheckContext, st, first: Row) -> str:
    """The failure's opening: what differs, and whether the prefill agrees (the padded batch: whether
    the pads matter)."""
    if st.variant == "padded":
        return _padded_lead(st)
    b = st.budgets["prefill"]
    if st.prefill is not None and b is not None and st.prefill <= b:
        return "cached decode differs from the reference while the prefill agrees"
    return (f"cached decode differs from the reference; the prefill already differs (logits rel_rmse "
            f"{st.prefill:.3g} > {b:.3g})" if st.prefill is not None and b is not None else
            "cached decode differs from the reference")


def _padded_lead(st) -> str:
    """The padded-batch framing only where the pads matter: the rows with pads differ from themselves
    alone while every pad-free row matches. A fault a pad-free row shows too (a value cache stored
    wrong) is the cache's, and the lead says so; the step and module follow it either way."""
    pads = (st.section.tensors["padded.mask"] == 0).sum(1).tolist()
    at = st.section.entry.get("attention_layers") or []
    bad = [b for b in range(len(pads)) if not all(
        r.ok for r in rows_of({k: v[b:b + 1] for k, v in st.errs.items()}, st.budgets["reference"], "reference", at))]
    free = [b for b, p in enumerate(pads) if p == 0]
    if bad and free and all(pads[b] for b in bad):
        return (f"left-padded batch: row {bad[0]} ({pads[bad[0]]} pads) decodes otherwise than alone with its cache "
                f"while the pad-free row(s) {free} match")
    shown = [b for b in bad if pads[b] == 0]
    return "cached decode differs from the reference" + (
        f" in pad-free row(s) {shown} of the left-padded batch too: the cache, not the padding" if shown else "")


def _table(bad: list[Row]) -> str:
    lines = ["step  layer/what             against     value      budget"]
    for r in bad[:40]:
        w = f"layer {r.layer}{' attention' if r.what == 'attn' else ''}" if r.layer is not None else r.what
        lines.append(f"{r.step:<5} {w:<22} {r.against:<11} {r.value:<10.4g} {r.budget:.4g}")
    if len(bad) > 40:
        lines.append(f"... {len(bad) - 40} more")
    return "\n".join(lines)


def register(registry: CheckRegistry) -> None:
    registry.add(DecodeCheck())
