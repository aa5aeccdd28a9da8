"""The golden's ``decode`` section: the float64 reference decoding **with** its KV cache.

A server prefills the prompt once and then decodes one token at a time from its cache; a Day-0 port
typically breaks there (cache layout, sliding/hybrid caches, positions after the prefill) while the
prefill stays right. The forward golden never sees that path (its greedy generation recomputes the
whole sequence), so this section records it:

* the float64 reference prefills the golden ids [B, S] into a cache, then runs ``steps`` decode
  steps at positions S..S+N-1, **teacher-forced** on the reference's greedy tokens
  (``ref.generation["tokens"]``, extended by the cached reference's own argmax when ``steps`` is
  longer), so that one early flip in a target does not make every later step incomparable;
* per step it stores each decoder layer's output at the new position (``hidden`` [B, N, L, H]) and
  the logits (``logits`` [B, N, V], or the reference's top-k ids and their logits when the vocabulary
  is large) with the log-normaliser ``lse`` [B, N], so the target's log-probabilities follow;
* optionally a left-padded layout of the same ids (``padded.*``): every odd row loses its first
  ``pad`` tokens and is left-padded with an attention mask; its reference is each row decoded
  **alone**, unpadded;
* budgets per low-precision dtype, measured on the budget draws: the same weights in the dtype,
  decoded with each cache the model supports, against the float64 reference's cached decode of the
  same draw (rel_rmse per row, max over rows and draws, per step and layer).

The comparison (:func:`errors`) and the decode itself (:func:`decode_run`) are shared by the
golden's measurement and the ``decode`` check, so both measure exactly the same thing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from harness.anatomy.capture import first_tensor
from harness.anatomy.layers import decoder_layers

# Caches measured at golden generate. "offloaded" is the dynamic cache's storage moved off the device
# between layers (same arithmetic): it is held to the dynamic budget. quanto/hqq are measured only
# where their package is installed.
MEASURED = ("dynamic", "static", "quantized-fp8", "quantized-quanto", "quantized-hqq", "padded")
QUANTIZED = ("quantized-fp8", "quantized-quanto", "quantized-hqq")
QUANT_PACKAGES = {"quantized-quanto": "optimum.quanto", "quantized-hqq": "hqq"}
# Where a variant's budget comes from when it has none of its own.
BUDGET_OF = {"offloaded": "dynamic"}


def spec(ls) -> dict | None:
    """The suite's knobs that change what the section holds; None when the suite does not want it
    (``[checks.decode] enabled = false``, or a harness without the decode check)."""
    cfg = getattr(ls.suite.checks, "decode", None)
    if cfg is None or not cfg.enabled:
        return None
    padded = cfg.padded and cfg.pad < ls.suite.checks.precision.seq_len  # a row keeps at least one token
    return {"steps": cfg.steps, "topk": cfg.topk, "full_vocab_max": cfg.full_vocab_max,
            "pad": cfg.pad if padded else 0, "quantized_residual_length": cfg.quantized_residual_length}


@dataclass
class Decoded:
    """One cached decode, float64 on CPU."""

    prefill_logits: torch.Tensor  # [B, S, V]
    hidden: torch.Tensor  # [B, N, L, H]: each decoder layer's output at the step's new position
    attn: torch.Tensor  # [B, N, A, H]: each attention module's output there (A: layers with attention)
    logits: torch.Tensor  # [B, N, V]: the step's next-token logits
    tokens: torch.Tensor  # [B, N] int64: the token each step fed
    cache_layers: list[str] = field(default_factory=list)  # the cache's layer class per decoder layer
    # per forward call (0: the prefill, 1 + s: step s), each router's chosen experts [T, k] int64: what
    # it chose itself (nothing forced) or was forced to
    routes: list[dict[str, torch.Tensor]] = field(default_factory=list)
    flips: dict[str, int] = field(default_factory=dict)  # router -> tokens whose own choice was another
    unforced: list[str] = field(default_factory=list)  # routers whose choice could not be forced


class _Routing:
    """Every router of ``model`` over the forward calls of one decode: with ``force`` (one
    {router: [T, k]} per call, the reference's choices) each router's top-k returns those experts
    (``harness.precision.routing.ForcedRouting``: the experts' weights and outputs are still the
    target's own arithmetic), and the tokens whose own choice differed are counted; without, each
    router's choice is recorded. Forcing is what makes a correct backend comparable at all at a
    near-tie: a flip sends one token through other experts and moves its hidden state by far more
    than rounding, though nothing is wrong - the routers themselves are judged by the precision
    check, on the forward, with its routing-aware judgement."""

    def __init__(self, model, calls: int, force: list[dict[str, torch.Tensor]] | None,
                 real: list[torch.Tensor | None] | None = None):
        from harness.precision.routing import ForcedRouting, RouterCapture

        phases = [f"c{i}" for i in range(calls)]
        self.force = force
        self.real = real or []  # per call, which tokens are real [T] bool (None: all): flips count those
        if force:
            self.trace = ForcedRouting({p: f for p, f in zip(phases, force, strict=False)},
                                       calls={p: {} for p in phases})
            self.handles = self.trace.attach(model)
        else:
            self.trace = RouterCapture(model)
            self.trace.calls = {p: {} for p in phases}
            self.handles = [self.trace]

    def call(self, i: int) -> None:
        self.trace.phase = f"c{i}"

    def close(self) -> None:
        for h in self.handles:
            h.remove()

    def result(self, dec: Decoded) -> None:
        from harness.precision.routing import same_sets

        if not self.force:
            dec.routes = [{r: cs[0][0] for r, cs in self.trace.calls[f"c{i}"].items()}
                          for i in range(len(self.trace.calls))]
            return
        dec.routes = self.force
        dec.unforced = sorted(set(self.trace.unforced))
        for i, forced in enumerate(self.force):
            real = self.real[i] if i < len(self.real) else None
            for r, call in self.trace.calls.get(f"c{i}", {}).items():
                want = forced[r].to(call.natural.device)
                n = sum(not same_sets(a[None], b[None]) for j, (a, b) in enumerate(zip(call.natural, want, strict=True))
                        if real is None or bool(real[j]))
                dec.flips[r] = dec.flips.get(r, 0) + n


def stacked_routes(routes: list[dict[str, torch.Tensor]], b: int) -> dict[str, torch.Tensor]:
    """The per-call routes of a decode (prefill [B x S, k], then each step [B x 1, k]) in the token
    order of one forward of the whole sequence [B, S + N]; a router whose calls do not split by row
    (another token layout) is left out (not forced)."""
    out = {}
    for r in routes[0] if routes else {}:
        parts = [c.get(r) for c in routes]
        if any(p is None or p.shape[0] % b for p in parts):
            continue
        out[r] = torch.cat([p.reshape(b, -1, p.shape[-1]) for p in parts], 1).reshape(-1, parts[0].shape[-1])
    return out


def make_cache(kind: str, model, max_len: int, residual_length: int = 8):
    """The cache a server would build for ``model``; transformers picks each layer's kind (full,
    sliding window, linear attention / Mamba, none) from the config itself. Raises ValueError or
    ImportError where this cache does not exist for this model or install."""
    try:
        return _make_cache(kind, model, max_len, residual_length)
    except KeyError as e:
        # transformers' cache classes map each layer type to a cache layer class; a layer type
        # they do not know (DeepSeek-V4's compressed_sparse_attention in StaticCache) is a cache
        # this install cannot build for the model, not a fault of the model
        import transformers

        raise ValueError(f"transformers {transformers.__version__} has no {kind} cache layer for layer type "
                         f"{e}") from None


def _make_cache(kind: str, model, max_len: int, residual_length: int):
    from transformers import DynamicCache, QuantizedCache, StaticCache

    cfg = model.config
    if kind in ("dynamic", "padded"):
        return DynamicCache(config=cfg)
    if kind == "static":
        return StaticCache(config=cfg, max_cache_len=max_len)
    if kind == "offloaded":
        return DynamicCache(config=cfg, offloading=True)
    if kind == "quantized-fp8":
        return QuantizedCache("fp8", cfg)
    if kind in QUANT_PACKAGES:
        import importlib

        importlib.import_module(QUANT_PACKAGES[kind])  # ImportError names the missing package
        # a short residual: the golden's S + N positions must reach the quantized storage at all
        return QuantizedCache(kind.split("-")[1], cfg, residual_length=residual_length)
    raise ValueError(f"unknown cache {kind!r}")


def layer_types(model) -> list[str]:
    """Each decoder layer's kind as the config names it (``layer_types``), else as transformers'
    caches infer it from the config."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    from harness.anatomy.moe import text_config

    cfg = text_config(model.config)
    n = len(decoder_layers(model)[1])
    lt = getattr(cfg, "layer_types", None)
    if not lt:  # what the caches infer (Mixtral's sliding_window without layer_types is sliding)
        lt = get_layer_types_and_kwargs(model.config.get_text_config(decoder=True))[0]
    return list(lt)[:n]


def _positions(mask: torch.Tensor) -> torch.Tensor:
    # left padding: a row's first real token is position 0, pads sit at 0 too (masked out)
    return (mask.cumsum(-1) - 1).clamp(min=0)


def _step_input(tokens, s: int, logits: torch.Tensor) -> torch.Tensor:
    """Teacher forcing: the given token of step s, else the argmax of the previous logits."""
    if tokens is not None and s < tokens.shape[1]:
        return tokens[:, s].to(logits.device)
    return logits.argmax(-1)


def attention_modules(model) -> list[tuple[int, str, torch.nn.Module]]:
    """``[(layer index, name, module)]`` of the decoder layers' attention: where a KV cache is read.
    A layer's attention output is compared besides the layer's: the residual stream carries every
    earlier layer's error, the attention output is where a cache fault is born (a key one position
    off moves it by tens of percent, the layer output by about one percent)."""
    from harness.anatomy.layers import attention

    prefix, layers = decoder_layers(model)
    out = []
    for i, layer in enumerate(layers):
        # Nemotron-H keeps its attention as `mixer`: any direct child with a softmax scaling
        a = attention(layer) or next((m for m in layer.children() if hasattr(m, "scaling")), None)
        if a is not None:
            name = next(n for n, m in layer.named_children() if m is a)
            out.append((i, f"{prefix}.{i}.{name}", a))
    return out


class _Watch:
    """Forward hooks on every decoder layer and attention module keeping ``positions`` of their output."""

    def __init__(self, model, positions: slice):
        self.layers: list[torch.Tensor] = []
        self.attn: list[torch.Tensor] = []
        _, layers = decoder_layers(model)
        # [B, P, H]; a layer carrying several residual streams (DeepSeek-V4's hyper-connections,
        # [B, S, hc, H]) is flattened to [B, P, hc x H], so every comparison sees one row per position
        keep = lambda into: lambda _m, _a, out: into.append(first_tensor(out)[:, positions].flatten(2).detach())  # noqa: E731
        self.hooks = [m.register_forward_hook(keep(self.layers)) for m in layers]
        self.hooks += [m.register_forward_hook(keep(self.attn)) for _, _, m in attention_modules(model)]

    def clear(self) -> None:
        self.layers.clear()
        self.attn.clear()

    def close(self) -> None:
        for h in self.hooks:
            h.remove()


def decode_run(model, ids: torch.Tensor, steps: int, cache, mask: torch.Tensor | None = None,
               tokens: torch.Tensor | None = None, routes: list[dict[str, torch.Tensor]] | None = None) -> Decoded:
    """Prefill ``ids`` [B, S] into ``cache``, then ``steps`` decode steps of one token each, as a
    server runs them: attention mask grown by one per step, positions from the mask (so a left-padded
    row continues where its own tokens end). Each step feeds ``tokens[:, s]`` (teacher forcing).
    ``routes`` (one {router: [T, k]} per forward call, a reference's ``Decoded.routes``): every router
    forced to them; without, each router's choices are recorded in the result."""
    mask = torch.ones_like(ids) if mask is None else mask.to(ids.device)
    w = _Watch(model, slice(-1, None))
    rt = _Routing(model, steps + 1, routes, real=[mask.reshape(-1).bool().cpu()])  # prefill [B x S]: pads are not real
    hidden, attn, logits, fed = [], [], [], []
    cpu = lambda xs: torch.cat(xs, 1).to("cpu", torch.float64) if xs else None  # noqa: E731 - [B, L|A, H]
    try:
        with torch.no_grad():
            rt.call(0)
            out = model(input_ids=ids, attention_mask=mask, position_ids=_positions(mask), cache=cache, use_cache=True)
            prefill = out.logits.detach()
            last, pos = prefill[:, -1], _positions(mask)[:, -1:]
            for s in range(steps):
                tok = _step_input(tokens, s, last)
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
                w.clear()
                rt.call(1 + s)
                out = model(input_ids=tok[:, None], attention_mask=mask, position_ids=pos + 1 + s,
                            cache=cache, use_cache=True)
                last = out.logits[:, -1].detach()
                hidden.append(cpu(w.layers))
                attn.append(cpu(w.attn))
                logits.append(last.to("cpu", torch.float64))
                fed.append(tok.to("cpu", torch.int64))
    finally:
        w.close()
        rt.close()
    kinds = [type(x).__name__ for x in getattr(cache, "layers", [])]
    b = ids.shape[0]
    dec = Decoded(prefill.to("cpu", torch.float64), torch.stack(hidden, 1),
                  torch.stack(attn, 1) if attn[0] is not None else torch.zeros(b, steps, 0, 1, dtype=torch.float64),
                  torch.stack(logits, 1), torch.stack(fed, 1), kinds)
    rt.result(dec)
    return dec


def reference_view(dec: Decoded, topk: int | None) -> dict[str, torch.Tensor]:
    """What the golden keeps of a reference decode: hidden, logits (all, or at the top-k ids), lse."""
    view = {"hidden": dec.hidden, "attn": dec.attn, "lse": torch.logsumexp(dec.logits, -1)}
    if topk is None:
        view["logits"] = dec.logits
    else:
        view["logits"], view["top_ids"] = dec.logits.topk(min(topk, dec.logits.shape[-1]), dim=-1)
    return view


def _row_rel_rmse(a: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """rel_rmse over the last dimension, one value per leading index; a NaN/inf target is inf."""
    a, r = a.double(), r.double()
    err = torch.linalg.vector_norm(a - r, dim=-1) / torch.linalg.vector_norm(r, dim=-1).clamp_min(1e-300)
    return torch.where(torch.isfinite(err), err, torch.full_like(err, float("inf")))


def errors(dec: Decoded, view: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per row, step (and layer): ``hidden`` [B, N, L] rel_rmse of each layer's output at the new
    position; ``attn`` [B, N, A] the same of each attention module's output; ``logits`` [B, N] rel_rmse of the logits (at the reference's top-k ids where only
    those are stored); ``logprob`` [B, N] |log-prob difference| at the reference's argmax."""
    ids = view.get("top_ids")
    got = dec.logits if ids is None else dec.logits.gather(-1, ids.to(torch.int64))
    ref = view["logits"].double()
    best = ref.argmax(-1, keepdim=True)  # the reference's argmax, as an index into what is stored
    lp_got = got.gather(-1, best).squeeze(-1) - torch.logsumexp(dec.logits, -1)
    lp_ref = ref.gather(-1, best).squeeze(-1) - view["lse"].double()
    lp = (lp_got - lp_ref).abs()
    return {"hidden": _row_rel_rmse(dec.hidden, view["hidden"]), "attn": _row_rel_rmse(dec.attn, view["attn"]),
            "logits": _row_rel_rmse(got, ref),
            "logprob": torch.where(torch.isfinite(lp), lp, torch.full_like(lp, float("inf")))}


def prefill_error(dec: Decoded, logits: torch.Tensor) -> float:
    """Largest per-row rel_rmse of the cached prefill's logits [B, S, V] against ``logits``."""
    return _row_rel_rmse(dec.prefill_logits.flatten(1), logits.flatten(1)).max().item()


def padded_layout(ids: torch.Tensor, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask) [B, S]: every odd row loses its first ``pad`` tokens and is left-padded (pad id 0)."""
    ids, mask = ids.clone(), torch.ones_like(ids)
    for b in range(1, ids.shape[0], 2):
        ids[b] = torch.cat([torch.zeros_like(ids[b, :pad]), ids[b, pad:]])
        mask[b, :pad] = 0
    return ids, mask


def decode_rows_alone(model, ids: torch.Tensor, mask: torch.Tensor, steps: int, tokens: torch.Tensor,
                      max_len: int) -> Decoded:
    """Each row of a padded batch decoded by itself, without its pads: the padded run's reference."""
    rows = []
    for b in range(ids.shape[0]):
        real = ids[b : b + 1, mask[b].bool()]
        rows.append(decode_run(model, real, steps, make_cache("dynamic", model, max_len), tokens=tokens[b : b + 1]))
    s = ids.shape[1]  # prefill logits are left-padded back to [1, S, V] with zeros where the pads are
    pre = [torch.cat([torch.zeros(1, s - r.prefill_logits.shape[1], r.prefill_logits.shape[2],
                                  dtype=torch.float64), r.prefill_logits], 1) for r in rows]
    return Decoded(torch.cat(pre), torch.cat([r.hidden for r in rows]), torch.cat([r.attn for r in rows]),
                   torch.cat([r.logits for r in rows]), torch.cat([r.tokens for r in rows]), rows[0].cache_layers,
                   routes=padded_routes([r.routes for r in rows], mask.to("cpu")))


def padded_routes(rows: list[list[dict[str, torch.Tensor]]], mask: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    """Each row's own routes decoded alone (per call: prefill [S_b, k], step [1, k]) in the token
    layout of the left-padded batch (prefill [B x S, k] with ``mask`` [B, S], steps [B, k]): what the
    padded run is forced to, so that a near-tie flip in the batch does not make a correct backend
    differ from the rows alone. A pad takes its row's first real token's experts: it is masked out of
    every real token's attention and its own output is never compared (its flips are not counted).
    Empty for a model without routers."""
    if not rows or not rows[0] or not any(rows[0]):
        return []
    b, s = mask.shape
    out = []
    for call in range(len(rows[0])):
        routers = {}
        for r in rows[0][call]:
            if call == 0:  # prefill: row b's real positions take its alone prefill's routes, in order
                k = rows[0][0][r].shape[-1]
                full = torch.empty(b, s, k, dtype=rows[0][0][r].dtype)
                for i in range(b):
                    own, real = rows[i][0][r], mask[i].bool()
                    full[i, real] = own
                    full[i, ~real] = own[:1]
                routers[r] = full.reshape(b * s, k)
            else:
                routers[r] = torch.cat([rows[i][call][r] for i in range(b)])
        out.append(routers)
    return out


@dataclass
class _RefDraw:
    """The float64 reference on one draw: its cached decode and (with padding) the rows alone."""

    dec: Decoded
    view: dict[str, torch.Tensor]
    padded: tuple[torch.Tensor, torch.Tensor] | None = None  # (ids, mask)
    padded_view: dict[str, torch.Tensor] | None = None
    padded_routes: list[dict[str, torch.Tensor]] | None = None  # the rows alone's, in the padded layout


def _reference_draw(model, dev, ids, sp: dict, tokens, topk) -> _RefDraw:
    n = sp["steps"]
    max_len = ids.shape[1] + n
    dec = decode_run(model, ids.to(dev), n, make_cache("dynamic", model, max_len), tokens=tokens)
    out = _RefDraw(dec, reference_view(dec, topk))
    if sp["pad"]:
        pids, pmask = padded_layout(ids, sp["pad"])
        alone = decode_rows_alone(model, pids.to(dev), pmask.to(dev), n, dec.tokens, max_len)
        out.padded, out.padded_view = (pids, pmask), reference_view(alone, topk)
        out.padded_routes = alone.routes or None
    return out


def _topk(sp: dict, vocab: int) -> int | None:
    return None if vocab <= sp["full_vocab_max"] else sp["topk"]


def uncached_view(model, ids: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor | None = None,
                  routes: list[dict[str, torch.Tensor]] | None = None) -> dict[str, torch.Tensor]:
    """The witness without a cache: one forward of the whole teacher-forced sequence [ids, tokens]
    [B, S + N] in the model's own dtype; its outputs at positions S..S+N-1 are what each cached step
    must reproduce (causal: position p sees only positions <= p). Same keys as :func:`reference_view`.
    ``routes``: the cached decode's per-call routes, forced here in the whole sequence's token order."""
    dev = ids.device
    mask = torch.ones_like(ids) if mask is None else mask.to(dev)
    seq = torch.cat([ids, tokens.to(dev)], 1)
    full = torch.cat([mask, torch.ones_like(tokens).to(dev)], 1)
    s, n = ids.shape[1], tokens.shape[1]
    w = _Watch(model, slice(s, None))
    whole = stacked_routes(routes, ids.shape[0]) if routes else None
    rt = _Routing(model, 1, [whole] if whole else None)
    try:
        with torch.no_grad():
            rt.call(0)
            out = model(input_ids=seq, attention_mask=full, position_ids=_positions(full), use_cache=False)
    finally:
        w.close()
        rt.close()
    logits = out.logits[:, s : s + n].to("cpu", torch.float64)
    stack = lambda xs: torch.stack(xs, 2).to("cpu", torch.float64) if xs else torch.zeros(  # noqa: E731
        ids.shape[0], n, 0, 1, dtype=torch.float64)
    return {"hidden": stack(w.layers), "attn": stack(w.attn), "logits": logits, "lse": torch.logsumexp(logits, -1)}


def _reduce(e: dict) -> dict:
    return {k: v.amax(0) for k, v in e.items()}  # max over rows


def _variant_errors(model, kind: str, r: _RefDraw, ids, sp: dict, dev, witness: dict) -> dict | None:
    """One variant on one draw, max over rows: {"reference": errors against the float64 cached decode
    (+ "prefill"), "uncached": errors against the model's own uncached forward}; None where this
    cache does not exist for the model or install. ``witness``: layout -> uncached view, filled lazily."""
    n = sp["steps"]
    try:
        cache = make_cache(kind, model, ids.shape[1] + n, sp["quantized_residual_length"])
    except (ValueError, ImportError):
        return None
    layout = "padded" if kind == "padded" else "plain"
    pids, pmask = r.padded if layout == "padded" else (ids, None)
    # routers forced to the reference's choices as the check forces them (the padded layout: each
    # row's own choices decoded alone, in the batch's token layout)
    routes = r.padded_routes if layout == "padded" else forced_routes(r.dec)
    dec = decode_run(model, pids.to(dev), n, cache, mask=pmask, tokens=r.dec.tokens, routes=routes)
    if layout not in witness:
        witness[layout] = uncached_view(model, pids.to(dev), r.dec.tokens, pmask, routes)
    ref = _reduce(errors(dec, r.padded_view if layout == "padded" else r.view))
    ref["prefill"] = None if layout == "padded" else prefill_error(dec, r.dec.prefill_logits)
    return {"reference": ref, "uncached": _reduce(errors(dec, witness[layout]))}


def forced_routes(dec: Decoded) -> list[dict[str, torch.Tensor]] | None:
    """A reference decode's per-call routes, or None for a model without routers."""
    return dec.routes if dec.routes and any(dec.routes) else None


def routes_tensors(routes: list[dict[str, torch.Tensor]], prefix: str = "") -> dict[str, torch.Tensor]:
    """``<prefix>route/<call>/<router>`` of the section (call 0 the prefill, 1 + s step s); prefix
    ``padded.`` for the left-padded layout's."""
    return {f"{prefix}route/{i}/{r}": t for i, c in enumerate(routes or []) for r, t in c.items()}


def routes_of(tensors: dict[str, torch.Tensor], calls: int, prefix: str = "") -> list[dict[str, torch.Tensor]] | None:
    """The per-call routes back from a section's tensors (``prefix``: ``padded.`` for the padded
    layout's); None where it stores none."""
    out = [{} for _ in range(calls)]
    for k, t in tensors.items():
        if k.startswith(prefix + "route/"):
            k = k[len(prefix):]
            _, i, r = k.split("/", 2)
            out[int(i)][r] = t
    return out if any(out) else None


def _fold(acc: dict | None, e: dict) -> dict:
    """Elementwise max of two draws' errors ({"reference": {...}, "uncached": {...}})."""
    if acc is None:
        return e
    return {part: {k: (None if v is None else max(acc[part][k], v)) if k == "prefill"
                   else torch.maximum(acc[part][k], v) for k, v in vals.items()} for part, vals in e.items()}


def _listed(acc: dict) -> dict:
    return {part: {k: (v if v is None or isinstance(v, float) else v.tolist()) for k, v in vals.items()}
            for part, vals in acc.items()}


def _measure_dtype(ref, dtype: str, refs: list[_RefDraw], sp: dict) -> dict:
    """{variant: {"reference" | "uncached": {"hidden" | "attn": [[max per layer] per step], "logits": [...],
    "logprob": [...]}, ...}} of the same weights in ``dtype``, max over rows and draws."""
    from harness.models import numerics
    from harness.models.build import build_model

    ls = ref.ls
    model, _ = build_model(ls, dtype, "cpu", seed=ls.suite.checks.precision.seed)
    numerics.apply(model, ref.numerics)
    model.eval()
    accs: dict[str, dict | None] = {k: None for k in MEASURED if k != "padded" or sp["pad"]}
    for r, ids in zip(refs, ref.draws, strict=True):
        witness: dict = {}  # the uncached forward of this draw, shared by the variants
        for kind in list(accs):
            e = _variant_errors(model, kind, r, ids, sp, "cpu", witness)
            if e is None:
                del accs[kind]  # this cache does not exist here: no budget, the check says why
            else:
                accs[kind] = _fold(accs[kind], e)
    return {k: _listed(v) for k, v in accs.items()}


def build(ref) -> tuple[dict, dict[str, torch.Tensor]]:
    """(manifest entry, tensors) of the decode section for one ReferenceRun (harness.precision.generate)."""
    sp = spec(ref.ls)
    model, dev = ref.model, ref.device
    vocab = ref.outputs["logits"].shape[-1]
    topk = _topk(sp, vocab)
    refs = [_reference_draw(model, dev, ids, sp, ref.generation["tokens"] if d == 0 else None, topk)
            for d, ids in enumerate(ref.draws)]
    r0 = refs[0]
    tensors = {"tokens": r0.dec.tokens, **r0.view, **routes_tensors(r0.dec.routes)}
    if r0.padded is not None:
        tensors.update({"padded.ids": r0.padded[0], "padded.mask": r0.padded[1]})
        tensors.update({f"padded.{k}": v for k, v in r0.padded_view.items()})
        tensors.update(routes_tensors(r0.padded_routes, "padded."))
    prefix, layers = decoder_layers(model)
    s = ref.ids.shape[1]
    attn = attention_modules(model)
    entry = {"positions": [s, s + sp["steps"] - 1], "layers": [f"{prefix}.{i}" for i in range(len(layers))],
             "attention": [name for _, name, _ in attn], "attention_layers": [i for i, _, _ in attn],
             "layer_types": layer_types(model), "cache_layers": r0.dec.cache_layers,
             "vocab": "full" if topk is None else f"top{topk}", "draws": len(ref.draws),
             "routers": sorted(r0.dec.routes[0]) if r0.dec.routes else [],
             "budgets": {dt: _measure_dtype(ref, dt, refs, sp) for dt in ref.dtypes}}
    return entry, tensors


# --- the direction of the cache path's error (issue #51) --------------------------------------------
# Compared with the target's own uncached forward (same backend and dtype: the clean difference is
# rounding, either sign), per decoded position over its attention outputs (where a cache fault is
# born) and decoder layers' outputs (a Mamba or linear-attention layer's cache shows only there). The
# logits are not tested: one more row per position, with nothing a layer output does not show.


def signed_tests(dec: Decoded, witness: dict[str, torch.Tensor], dtype: str, variant: str,
                 attention_layers: list[int]) -> tuple[list, list[tuple[str, int]], str | None]:
    """(the sign tests of the cached decode against its uncached witness (harness.precision.signed.
    pooled_tests), their columns in order as ("attn" | "hidden", decoder layer index), why none were
    made or None). A quantized cache's own error is its format's, one-signed by design (fp8 e4m3
    values: llama's bf16 attention outputs 0.6 % small, 24 of 32 rows): judged by its size alone."""
    from harness.precision import signed

    if variant in QUANTIZED:
        return [], [], f"{variant}: a quantized cache's error is its format's (one-signed by design), judged by size only"
    cols: list[tuple[tuple[int, int], tuple[str, int], dict]] = []
    for what, layers in (("attn", attention_layers), ("hidden", range(dec.hidden.shape[2]))):
        e = signed.layer_position_errors(getattr(dec, what), witness[what])
        if e is not None:  # a layer's attention before its output
            cols += [((layer, what == "hidden"), (what, layer), {k: v[:, :, j] for k, v in e.items()})
                     for j, layer in enumerate(layers)]
    if not cols:
        return [], [], "no finite decoded outputs to test"
    cols.sort(key=lambda c: c[0])
    errs = {k: torch.stack([c[2][k] for c in cols], -1) for k in cols[0][2]}
    tests = signed.pooled_tests(errs)
    positions = dec.hidden.shape[0] * dec.hidden.shape[1]
    why = None if signed.reachable(positions, len(tests)) else (
        f"{positions} decoded positions cannot reach the sign test's limit {signed.ALPHA / len(tests):.2g}")
    return tests, [c[1] for c in cols], why
