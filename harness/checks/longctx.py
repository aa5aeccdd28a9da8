"""Long context (``longctx``): prefill and cached decode at thousands of positions, compared position
by position with the float64 reference (issue #47 item 3; docs/precision.md "Long context").

The precision and decode checks compare 16-token goldens: an attention kernel that takes another
path past a sequence length (a KV-block or split count chosen by length, chunked prefill through the
cache, a sliding-window edge, yarn/llama3 rope scaling past ``original_max_position_embeddings``)
is never reached there. This check builds the suite's pruned model (precision seed, the realistic
numerics gains the golden uses) cut to its first decoder layers - through the first layer of each
layer kind (``layer_types``) unless ``layers`` says how many - with ``max_position_embeddings`` and
the rope scaling of the config, and runs ``positions`` seeded tokens three ways on the backend in the
run dtype:

* ``prefill``: one forward over every position (no cache);
* ``chunked``: the same tokens fed ``chunk`` at a time through a ``DynamicCache`` (the boundaries at
  chunk, 2 x chunk, ...);
* ``decode``: ``steps`` more tokens one at a time from that cache (positions ``positions`` ...).

The reference is the same weights in float64 on the CPU with eager attention, fed in chunks through
its own cache (float64: the chunking costs nothing in accuracy and keeps eager attention's score
matrix to chunk x positions). A MoE model's routers are forced to the reference's choices (a
near-tie flip moves a token by far more than rounding; routers are the precision check's business).
Each position's error is max |log-softmax difference| over the vocabulary and the last hidden state's
relative error, judged per position and, in the two prefills, as a mean over each ``bucket`` of
positions (a systematic error under one position's rounding noise). The detail ``longctx_buckets``
holds the worst per bucket and phase (error against position). A failure names the phase, the first
position and bucket over the dtype's budget, and the boundary it is at or past (chunk, sliding
window, rope's original length).
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from harness import metrics
from harness.checks import Check, CheckConfig, CheckContext, CheckFailure, CheckRegistry, NotApplicable
from harness.messages import first_line

PHASES = ("prefill", "chunked", "decode")

metrics.declare("longctx_worst_budget_use", "", "lower", "largest per-position error / the dtype's budget over the "
                "long prefill, the chunked prefill and the cached decode (fails > 1)")
metrics.declare("longctx_prefill_max_diff", "nats", "lower", "largest max |log-softmax diff| of a position of the "
                "one-pass long prefill against float64")
metrics.declare("longctx_chunked_max_diff", "nats", "lower", "the same for the chunked prefill through the KV cache")
metrics.declare("longctx_decode_max_diff", "nats", "lower", "the same for the cached decode steps after the prefix")
metrics.declare("longctx_hidden_max_rel_err", "", "lower", "largest relative error of the last hidden state at a "
                "position, over the three phases")
metrics.declare("longctx_positions", "", "none", "positions compared (prefix + decode steps)")

# Budgets per dtype: (position log-softmax, position hidden, bucket-mean log-softmax, bucket-mean hidden).
# Measured on the CPU (2026-12-06; 4096 positions, chunk 512, 8 steps, default layers; all six bundled
# suites; the CPU is deterministic: reruns give the same numbers to the bit). Worst clean values:
#   float32  position 1.05e-6 / 1.5e-6    bucket mean 3.8e-7 / 4.7e-7   -> 2e-5 / 3e-5, 2e-6 / 3e-6 (>5x)
#   bfloat16 position 0.0135 / 0.0185     bucket mean 0.0057 / 0.0081   -> 0.05 / 0.06, 0.009 / 0.012 (1.5x)
#   float16  position 0.0019 / 0.0023     bucket mean 0.00073 / 0.00103 -> 0.01 / 0.012, 0.0011 / 0.0016
# The position budgets catch a fault at a few positions; the bucket means, stable to a few % from
# bucket to bucket, a systematic one below the rounding noise of single positions (bfloat16: SDPA
# 3 % high past 2048 moves the bucket mean 0.0056 -> 0.0106, one position's worst stays in its noise).
BUDGETS = {"float32": (2e-5, 3e-5, 2e-6, 3e-6), "bfloat16": (0.05, 0.06, 0.009, 0.012),
           "float16": (0.01, 0.012, 0.0011, 0.0016), "float64": (1e-10, 1e-10, 1e-10, 1e-10)}
_FIELDS = ("position_logprob", "position_hidden", "bucket_logprob", "bucket_hidden")


class LongctxBudget(BaseModel):
    """One dtype's budgets; unset fields keep the measured defaults."""

    model_config = ConfigDict(extra="forbid", strict=True)
    position_logprob: float | None = Field(None, gt=0, description="max |log-softmax diff| of one position.")
    position_hidden: float | None = Field(None, gt=0, description="Last hidden state rel error of one position.")
    bucket_logprob: float | None = Field(None, gt=0, description="Mean over a bucket of the positions' "
                                         "max |log-softmax diff| (a systematic error below the position budget).")
    bucket_hidden: float | None = Field(None, gt=0, description="Mean over a bucket of the hidden rel errors.")


class LongctxConfig(CheckConfig):
    """Long prefill, chunked prefill and cached decode at thousands of positions against float64."""

    enabled: bool = Field(True, description="5-7 s per bundled suite in float32 on a 2-core CPU, the float64 "
                          "reference included (computed once per process), 0.3-1.5 s per further dtype.")
    scope: Literal["commit", "nightly"] = Field("nightly", description="Nightly unless the suite says commit.")
    positions: int = Field(4096, ge=16, le=2**20, description="Prefix length: positions 0 .. positions-1 are "
                           "prefilled (bounded by the config's max_position_embeddings with the decode steps).")
    chunk: int = Field(512, ge=1, description="Chunked prefill: tokens per forward through the KV cache.")
    steps: int = Field(8, ge=1, le=1024, description="Cached decode steps after the prefix.")
    bucket: int = Field(256, ge=1, description="Positions per error bucket of the error-against-position detail.")
    layers: int | None = Field(None, ge=1, description="Decoder layers kept (a prefix of the model); unset: through "
                               "the first layer of each layer kind (layer_types: sliding / full attention).")
    budgets: dict[str, LongctxBudget] = Field(default_factory=dict, description="Per-dtype overrides of the "
                                              "measured budgets (harness/checks/longctx.py BUDGETS).")
    seed: int = Field(2, ge=0, description="Seed of the token ids.")


class LongctxCheck(Check):
    cpu_threads = 1  # the pruned model's matmuls are small; attention over 4k keys is the cost
    name = "longctx"
    order = 24
    config_model = LongctxConfig
    description = "long prefill, chunked prefill and cached decode at thousands of positions against float64"
    headline = ("longctx_worst_budget_use", "longctx_decode_max_diff")
    steps = ("build", "reference", "prefill", "chunked", "decode", "record", "verdict")
    setup_steps = ("build", "reference")

    def build(self, ctx: CheckContext, st) -> None:
        """The truncated model: the float64 reference (eager) on the CPU and the target on the backend."""
        from harness.anatomy.moe import text_config
        from harness.models.build import model_config

        st.cfg, transform = ctx.config, getattr(st, "transform", None)
        mc = model_config(ctx.suite)
        tc = text_config(mc.config)
        st.n_layers, kinds = _layers(tc, st.cfg.layers)
        st.positions = _positions(ctx, st.cfg, tc)
        st.budget = _budget(st.cfg, ctx.dtype)
        if st.budget is None:
            raise NotApplicable(f"no longctx budget for {ctx.dtype} (set [checks.longctx] budgets.{ctx.dtype})")
        if st.positions * tc.vocab_size > 2**28:
            raise NotApplicable(f"vocabulary {tc.vocab_size} x {st.positions} positions: the reference's "
                                "log-probabilities would not fit the host")
        st.bounds = _bounds(tc)
        st.ref, st.gains = _model(ctx.suite, st.n_layers, "float64", "cpu", "eager")
        st.model, _ = _model(ctx.suite, st.n_layers, ctx.dtype, ctx.device, None)
        if transform is not None:
            st.model = transform(st.model)
        ctx.detail("longctx_layers", f"{st.n_layers} decoder layer(s): {kinds}")
        ctx.detail("longctx_layout", f"{st.positions} positions, chunk {st.cfg.chunk}, {st.cfg.steps} decode steps; "
                   + (", ".join(f"{k} {v}" for k, v in st.bounds.items()) or "no length boundaries in the config"))
        ctx.metric("longctx_positions", st.positions + st.cfg.steps)

    def reference(self, ctx: CheckContext, st) -> None:
        """float64 log-probabilities at every position and each router's choices (once per process)."""
        from harness.models.build import seeded_tokens

        st.ids = seeded_tokens(st.ref.config.vocab_size, 1, st.positions + st.cfg.steps, st.cfg.seed)
        key = (str(ctx.suite.path), st.n_layers, st.positions, st.cfg.chunk, st.cfg.steps, st.cfg.seed,
               json.dumps(st.gains, sort_keys=True), st.ref.config.to_json_string())
        if key not in _REFERENCE:
            _REFERENCE.clear()  # one at a time: a suite's reference is reused by its other dtypes
            try:
                _REFERENCE[key] = _reference_run(st.ref, st.ids, st.cfg.chunk)
            except (TypeError, ValueError, NotImplementedError) as e:  # the architecture, not the backend
                raise NotApplicable(f"the float64 reference cannot prefill through a DynamicCache on the CPU: "
                                    f"{type(e).__name__}: {first_line(e)}") from None
        st.lp, st.routes = _REFERENCE[key]
        st.ref, st.errs = None, {}

    def prefill(self, ctx: CheckContext, st) -> None:
        n = st.positions
        with _Forced(st.model, st.routes, {"full": slice(0, n)}) as f:
            f.at("full")
            st.errs["prefill"] = _err(_forward(st.model, st.ids[:, :n], ctx.device, None), st.lp, slice(0, n))

    def chunked(self, ctx: CheckContext, st) -> None:
        from transformers import DynamicCache

        n, c = st.positions, st.cfg.chunk
        st.cache = DynamicCache(config=st.model.config)
        spans = {f"c{s}": slice(s, min(s + c, n)) for s in range(0, n, c)}
        st.errs["chunked"], _ = _through_cache(st, spans, ctx.device)

    def decode(self, ctx: CheckContext, st) -> None:
        n = st.positions
        spans = {f"d{i}": slice(n + i, n + i + 1) for i in range(st.cfg.steps)}
        st.errs["decode"], f = _through_cache(st, spans, ctx.device)
        st.model = st.cache = None
        if f.unforced:
            ctx.notes.append(f"routers not forced to the reference's choices: {', '.join(f.unforced)}")

    def record(self, ctx: CheckContext, st) -> None:
        b = st.budget
        st.use = {ph: (st.errs[ph] / b[:2]).amax(-1) for ph in PHASES}  # per position
        st.bucket_use = {ph: (_means(st.errs[ph], st.cfg.bucket) / b[2:]).amax(-1) for ph in PHASES[:2]}
        for ph in PHASES:
            ctx.metric(f"longctx_{ph}_max_diff", float(st.errs[ph][:, 0].max()))
        ctx.metric("longctx_hidden_max_rel_err", max(float(st.errs[ph][:, 1].max()) for ph in PHASES))
        ctx.metric("longctx_worst_budget_use", max(float(u.max()) for u in [*st.use.values(), *st.bucket_use.values()]))
        ctx.tolerance("longctx_worst_budget_use", 1.0)
        ctx.detail("longctx_budget", f"{ctx.dtype}: per position max |log-softmax diff| {float(b[0]):.3g} nats, "
                   f"hidden rel error {float(b[1]):.3g}; mean over a bucket {float(b[2]):.3g}, {float(b[3]):.3g}")
        ctx.detail("longctx_buckets", json.dumps(_buckets(st.errs, st.positions, st.cfg.bucket),
                                                 separators=(",", ":")))

    def verdict(self, ctx: CheckContext, st) -> None:
        bad = [f for f in (_first(st, ph) for ph in PHASES) if f is not None]
        if not bad:
            return
        ph, i, k, val = bad[0]
        pos, lim = i + (st.positions if ph == "decode" else 0), float(st.budget[k])
        b0 = pos // st.cfg.bucket * st.cfg.bucket
        where = (f"step {i} (position {pos})" if ph == "decode" else
                 f"position {pos} (bucket {b0}-{b0 + st.cfg.bucket - 1})")
        before = (f"worst budget use {_before(st, ph, i):.2g} before it" if i else "from its first position")
        others = [f"{p} from position {j + (st.positions if p == 'decode' else 0)}" for p, j, *_ in bad[1:]]
        ctx.detail("longctx_first_position", str(pos))
        raise CheckFailure(
            f"long context, {_PHASE_TEXT[ph]}: {where} over budget: {_WHAT[k]} {val:.3g} > {lim:.3g} "
            f"({ctx.dtype}); {_boundary(ph, pos, st)}; error starts there ({before})"
            + (f"; also over budget: {', '.join(others)}" if others else ""),
            metric=f"longctx.{ph}.{pos}", expected=f"<= {lim:.3g}", observed=f"{val:.4g}", tolerance=lim,
            details=_table(st.errs, st.positions, st.cfg.bucket, st.budget))


def _before(st, ph: str, i: int) -> float:
    """The worst budget use before position index ``i`` (its positions, and its whole buckets)."""
    use = float(st.use[ph][:i].max())
    nb = i // st.cfg.bucket
    return max(use, float(st.bucket_use[ph][:nb].max())) if ph in st.bucket_use and nb else use


def _means(e, bucket: int):
    """Each bucket's mean of the positions' errors [buckets, 2] (a last partial bucket included)."""
    import torch

    return torch.stack([e[s:s + bucket].mean(0) for s in range(0, len(e), bucket)])


def _first(st, ph: str) -> tuple | None:
    """(phase, first position index over budget, which budget, value): a position over its own budget,
    or the first position of a bucket whose mean is over the bucket budget, whichever comes first."""
    pos = (st.use[ph] > 1).nonzero().flatten()[:1].tolist()
    got = [(pos[0], 0)] if pos else []
    if ph in st.bucket_use:
        bk = (st.bucket_use[ph] > 1).nonzero().flatten()[:1].tolist()
        got += [(bk[0] * st.cfg.bucket, 1)] if bk else []
    if not got:
        return None
    i, by_bucket = min(got)
    if by_bucket:
        m = _means(st.errs[ph], st.cfg.bucket)[i // st.cfg.bucket]
        k = int((m / st.budget[2:]).argmax())
        return ph, i, 2 + k, float(m[k])
    k = int((st.errs[ph][i] / st.budget[:2]).argmax())
    return ph, i, k, float(st.errs[ph][i, k])


_WHAT = ("max |log-softmax diff|", "last hidden state rel error", "the bucket's mean max |log-softmax diff|",
         "the bucket's mean hidden rel error")
_PHASE_TEXT = {"prefill": "one-pass prefill", "chunked": "chunked prefill through the KV cache",
               "decode": "cached decode"}
_REFERENCE: dict[tuple, tuple] = {}


def _budget(cfg: LongctxConfig, dtype: str):
    """The dtype's budgets [4] (the table's overrides first), or None where one is unknown."""
    import torch

    own = cfg.budgets.get(dtype)
    got = [getattr(own, f, None) if own else None for f in _FIELDS]
    got = [g if g is not None else (BUDGETS[dtype][i] if dtype in BUDGETS else None) for i, g in enumerate(got)]
    return None if None in got else torch.tensor(got, dtype=torch.float64)


def _layers(tc, want: int | None) -> tuple[int, str]:
    """Layers kept and their kinds: ``want``, else through the first layer of each kind."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    lt = list(getattr(tc, "layer_types", None) or get_layer_types_and_kwargs(tc)[0])[:tc.num_hidden_layers]
    n = want or (max(lt.index(k) for k in set(lt)) + 1 if lt else 1)
    n = min(n, tc.num_hidden_layers)
    return n, ", ".join(f"layer {i} {k}" for i, k in enumerate(lt[:n])) or "one layer"


def _positions(ctx: CheckContext, cfg: LongctxConfig, tc) -> int:
    top = getattr(tc, "max_position_embeddings", None)
    if top is not None and cfg.positions + cfg.steps > top:
        if top - cfg.steps < 16:
            raise NotApplicable(f"max_position_embeddings {top} leaves no room for a long prefix")
        ctx.notes.append(f"positions cut to {top - cfg.steps}: max_position_embeddings {top}")
        return top - cfg.steps
    return cfg.positions


def _bounds(tc) -> dict[str, int]:
    """The config's lengths at which a kernel or rope changes behaviour."""
    out = {}
    if isinstance(getattr(tc, "sliding_window", None), int):
        out["sliding_window"] = tc.sliding_window
    rope = getattr(tc, "rope_parameters", None) or getattr(tc, "rope_scaling", None) or {}
    if isinstance(rope, dict) and rope.get("original_max_position_embeddings"):
        out[f"{rope.get('rope_type') or rope.get('type')} rope original_max_position_embeddings"] = int(
            rope["original_max_position_embeddings"])
    return out


def _boundary(ph: str, pos: int, st) -> str:
    c = st.cfg.chunk
    said = []
    if ph == "chunked":
        s = pos // c * c
        said.append(f"at the chunk boundary {pos} (chunk {c})" if pos == s else
                    f"in the chunk {s}-{min(s + c, st.positions) - 1}, {pos - s} past its boundary (chunk {c})")
    elif ph == "decode":
        said.append(f"after a {st.positions}-position prefix in chunks of {c}")
    for what, at in st.bounds.items():
        if pos >= at:
            said.append(f"{'at' if pos == at else 'past'} the {what} {at}")
    return "; ".join(said) or "no chunk, window or rope boundary there"


def _model(ls, n_layers: int, dtype: str, device, attn: str | None):
    """The suite's pruned model cut to ``n_layers``, seeded and rescaled as the precision check's."""
    from harness.anatomy.moe import text_config
    from harness.inspect.trace import numerics_gains, trace_numerics
    from harness.models import numerics
    from harness.models.build import build_model, model_config

    mc = model_config(ls)
    tc = text_config(mc.config)
    tc.num_hidden_layers = n_layers
    if isinstance(getattr(tc, "layer_types", None), list):
        tc.layer_types = tc.layer_types[:n_layers]
    gains = numerics_gains(ls, trace_numerics(ls, realistic=True)) if ls.weights_path is None else None
    model, _ = build_model(ls, dtype, device, seed=ls.suite.checks.precision.seed, mc=mc)
    numerics.apply(model, gains)
    if attn is not None:
        try:
            model.set_attn_implementation(attn)
        except (ValueError, AttributeError) as e:
            raise NotApplicable(f"no {attn} attention for the float64 reference: {first_line(e)}") from None
    return model.eval(), gains


def _forward(model, ids, device, cache):
    """(log-probabilities [S, V], the last hidden state [S, H]) in float64 on the CPU."""
    import torch

    with torch.no_grad():
        out = model(input_ids=ids.to(device), cache=cache, use_cache=cache is not None, output_hidden_states=True)
    return (out.logits[0].to("cpu", torch.float64).log_softmax(-1),
            out.hidden_states[-1][0].to("cpu", torch.float64))


def _reference_run(ref, ids, chunk: int):
    """float64 log-probabilities [S, V] of every position, chunk by chunk through the cache, and each
    router's choices {router: [S, k]}."""
    import torch
    from transformers import DynamicCache

    from harness.precision.routing import RouterCapture

    cap = RouterCapture(ref)
    cap.calls, cap.phase = {"ref": {}}, "ref"
    cache, out = DynamicCache(config=ref.config), []
    try:
        for s in range(0, ids.shape[1], chunk):
            out.append(_forward(ref, ids[:, s:s + chunk], "cpu", cache))
    finally:
        cap.remove()
    return (torch.cat([o[0] for o in out]), torch.cat([o[1] for o in out])), {r: torch.cat([c[0] for c in calls]) for r, calls in cap.calls["ref"].items()}


class _Forced:
    """Routers forced to the reference's choices at the positions of each call (no routers: nothing)."""

    def __init__(self, model, routes: dict, spans: dict):
        from harness.precision.routing import ForcedRouting

        self.trace = ForcedRouting({p: {r: t[sl] for r, t in routes.items()} for p, sl in spans.items()},
                                   calls={p: {} for p in spans}) if routes else None
        self.model, self.handles, self.unforced = model, [], []

    def __enter__(self):
        if self.trace is not None:
            self.handles = self.trace.attach(self.model)
        return self

    def at(self, phase: str) -> None:
        if self.trace is not None:
            self.trace.phase = phase
            self.trace.calls[phase] = {}  # only the last call's view is kept: free the copies

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()
        if self.trace is not None:
            self.unforced = sorted(set(self.trace.unforced))


def _err(got, ref, sl: slice):
    """Each position's error [S, 2]: max |log-softmax difference| over the vocabulary, and the last
    hidden state's relative error (||h - h_ref|| / ||h_ref||: the logits' own rounding, position by
    position noise, is not in it - what makes a 1 % attention fault visible in bfloat16). Non-finite: inf."""
    import torch

    lp, h = got
    e = torch.stack([(lp - ref[0][sl]).abs().amax(-1),
                     (h - ref[1][sl]).norm(dim=-1) / ref[1][sl].norm(dim=-1).clamp_min(1e-300)], -1)
    return torch.where(torch.isfinite(e), e, torch.full_like(e, float("inf")))


def _cat(errs):
    import torch

    return torch.cat(errs)


def _buckets(errs: dict, positions: int, bucket: int) -> dict[str, list]:
    """{phase: [[first position, worst log-softmax diff, worst hidden rel error], ...]} per bucket;
    decode: per step."""
    out = {}
    for ph in PHASES:
        e, size, at = errs[ph], 1 if ph == "decode" else bucket, positions if ph == "decode" else 0
        out[ph] = [[at + s, *(float(f"{float(v):.3g}") for v in e[s:s + size].amax(0))] for s in range(0, len(e), size)]
    return out


def _table(errs: dict, positions: int, bucket: int, budget) -> str:
    b = [f"{float(v):.3g}" for v in budget]
    lines = [f"phase     positions    worst |lsm diff|  worst hidden  mean |lsm diff|  mean hidden   (budgets {', '.join(b)})"]
    for ph, rows in _buckets(errs, positions, bucket).items():
        step = bucket if ph != "decode" else 1
        means = _means(errs[ph], step)
        for (s, v, h), m in zip(rows, means, strict=True):
            vals = [v, h, float(m[0]), float(m[1])]
            over = any(x > float(lim) for x, lim in zip(vals, budget, strict=True)) if ph != "decode" else \
                v > float(budget[0]) or h > float(budget[1])
            lines.append(f"{ph:<9} {s:>5}-{s + step - 1:<6} " + "  ".join(f"{x:<14.4g}" for x in vals)
                         + ("  over" if over else ""))
    return "\n".join(lines)



def _through_cache(st, spans: dict[str, slice], device):
    """Each span of ``st.ids`` fed in order through ``st.cache``, its routers forced to the reference's
    choices for that span: the errors against the reference's log-softmax, and the forcing (its
    ``unforced`` routers)."""
    errs = []
    with _Forced(st.model, st.routes, spans) as f:
        for name, sl in spans.items():
            f.at(name)
            errs.append(_err(_forward(st.model, st.ids[:, sl], device, st.cache), st.lp, sl))
    return _cat(errs), f

def register(registry: CheckRegistry) -> None:
    registry.add(LongctxCheck())
