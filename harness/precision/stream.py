"""Streamed full-size precision: the target's hidden states at every decoder-layer boundary against a
float64 reference recomputed on the host one layer at a time.

Target side (:func:`capture_layers`): the full model runs a few prompts once; hooks on each decoder
layer keep its input hidden states [B, S, H], every other input it was given but the cache (attention
mask, position ids, rotary tables, a per-layer input, the K/V dict layers share) and its output
[B, S, H], all moved to the host; a hook on each rotary module records the call that made the tables
each layer got (positions, and the layer type where tables differ per type), so the reference
recomputes the same tables in float64.

Reference side (:func:`stream_reference`): for layer i, the layer's module is built on the meta device
and materialized in float64 (``to_empty``: pages nobody writes are never committed), its tensors are
read from the shards (dequantized exactly when quantized), and it is run on the *target's own input to
that layer*. So layer i's error is layer i's alone (errors do not accumulate from earlier layers) and a
fault is localized to the layer that has it. For MoE layers the routed experts are filled only once
the router has chosen them: a pre-hook on the experts module reads the experts the tokens route to,
and no other expert's bytes are read. That holds both for checkpoints with one tensor per expert and
for those that keep a layer's experts fused in one tensor indexed by expert along dim 0 (gpt-oss:
``experts.gate_up_proj_blocks`` [E, ...]): only the routed rows are read (safetensors ``get_slice``),
dequantized and copied into their rows of the model's parameter. The layer is freed before the next one, so host memory stays
near one layer's float64 weights whatever the model's size.
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch

from harness.anatomy.layers import decoder_layers
from harness.weights import quant, rename
from harness.weights.layout import Checkpoint, WeightsError
from harness.weights.reader import ShardReader


@dataclass
class RotaryCall:
    """How the target computed the rotary tables one layer was given: which rotary module, on which
    positions, with which other arguments (Gemma-4 / MiMo: the layer type, each with its own
    frequencies), so the reference recomputes the same tables in float64."""

    module: str
    position_ids: torch.Tensor
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)


@dataclass
class LayerIO:
    """What one decoder layer saw and produced in the target run (host tensors)."""

    hidden_in: torch.Tensor  # [B, S, H]
    kwargs: dict  # attention_mask, position_ids, position_embeddings (cos, sin), ...
    hidden_out: torch.Tensor | None = None  # [B, S, H]
    rotary: RotaryCall | dict[str, RotaryCall] | None = None
    args: tuple = ()  # positional inputs after the hidden states
    routes: dict[str, torch.Tensor] = field(default_factory=dict)  # router (name in the layer) -> experts [T, k]
    router_logits: dict[str, torch.Tensor] = field(default_factory=dict)  # the target's, [T, E]


@dataclass
class LayerResult:
    layer: int
    metrics: dict[str, float]
    ok: bool
    bytes_read: int = 0
    experts_read: int | None = None
    near_tie_flips: int = 0  # tokens the target routed otherwise than the reference would, at a near tie
    routing: list[str] = field(default_factory=list)  # wide flips (a routing fault), one line per router


@dataclass
class StreamReport:
    layers: list[LayerResult] = field(default_factory=list)
    tolerance: dict[str, float] = field(default_factory=dict)
    bytes_read: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def first_divergent(self) -> int | None:
        return next((r.layer for r in self.layers if not r.ok), None)

    def render(self) -> str:
        """The per-layer table, in the precision check's terms."""
        head = (f"{'layer':>5}  {'rel_rmse':>10}  {'max_abs_err':>11}  {'cosine':>10}  {'experts':>7}  "
                f"{'flips':>5}  status")
        rows = [head]
        for r in self.layers:
            m = r.metrics
            status = "ok" if r.ok else ("ROUTING" if r.routing else "DIVERGES")
            rows.append(f"{r.layer:>5}  {m['rel_rmse']:>10.3g}  {m['max_abs_err']:>11.3g}  {m['cosine']:>10.6f}  "
                        f"{'' if r.experts_read is None else r.experts_read:>7}  {r.near_tie_flips:>5}  {status}")
        rows += [f"layer {r.layer}: {w}" for r in self.layers for w in r.routing]
        return "\n".join(rows)


# Keyword inputs that are not data: the KV cache (use_cache=False: none) and flags.
DROP_KWARGS = ("past_key_values", "past_key_value", "cache", "use_cache", "output_attentions", "hidden_states")


def _snap(x):
    """A host copy of one layer input: tensors, and containers of them (Gemma-4's ``shared_kv_states``
    dict, which later layers of the same forward fill: copied as it stood when this layer ran). Other
    objects (a cache) are dropped: ``_DROPPED``."""
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu")
    if isinstance(x, (tuple, list)):
        return type(x)(_snap(v) for v in x)
    if isinstance(x, Mapping):  # dict, or transformers' KVSharingDict (a UserDict)
        return {k: _snap(v) for k, v in x.items()}
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return _DROPPED


_DROPPED = object()


def _rotary_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Model-level rotary embeddings (outside the decoder layers), by name."""
    return {n: m for n, m in model.named_modules()
            if "RotaryEmbedding" in type(m).__name__ and ".layers." not in f".{n}."}


def _first(x):
    return x[0] if isinstance(x, (tuple, list)) and x else x


def _rotary_of(pe, calls: dict[int, RotaryCall]):
    """The call(s) that made a layer's tables: one, or one per key where the layer gets a dict of them
    (DeepSeek-V4: ``{"main": (cos, sin), "compress": (cos, sin)}``); None if any is unknown."""
    if isinstance(pe, Mapping):
        got = {k: calls.get(id(_first(v))) for k, v in pe.items()}
        return got if got and all(v is not None for v in got.values()) else None
    return calls.get(id(_first(pe))) if pe is not None else None


def capture_layers(model: torch.nn.Module, ids: torch.Tensor) -> list[LayerIO]:
    """Run ``model`` once on ``ids`` [B, S] and keep every decoder layer's input, kwargs and output,
    and which rotary call made the tables it was given."""
    prefix, layers = decoder_layers(model)
    got: list[LayerIO | None] = [None] * len(layers)
    handles = []
    # Rotary calls by the identity of their first output tensor (cos, or Llama-4's complex freqs_cis).
    calls: dict[int, RotaryCall] = {}
    for name, rot in _rotary_modules(model).items():
        def on_rotary(mod, args, kwargs, out, name=name):
            a = list(args)
            pos = a[1] if len(a) > 1 else kwargs.get("position_ids")
            if isinstance(pos, torch.Tensor):
                calls[id(_first(out))] = RotaryCall(name, _snap(pos), tuple(a[2:]),
                                                    {k: v for k, v in kwargs.items() if k != "position_ids"})
        handles.append(rot.register_forward_hook(on_rotary, with_kwargs=True))
    for i, layer in enumerate(layers):
        def pre(mod, args, kwargs, i=i):
            h = args[0] if args else kwargs["hidden_states"]
            # Every input but the cache: masks, positions, rotary tables, and whatever else a layer takes
            # (Gemma-4: a per-layer input as second positional argument, the shared K/V dict).
            kw = {k: _snap(v) for k, v in kwargs.items() if k not in DROP_KWARGS}
            got[i] = LayerIO(_snap(h), {k: v for k, v in kw.items() if v is not _DROPPED},
                             rotary=_rotary_of(kwargs.get("position_embeddings"), calls),
                             args=tuple(_snap(a) for a in args[1:]))

        def post(mod, args, kwargs, out, i=i):
            o = out[0] if isinstance(out, (tuple, list)) else out
            got[i].hidden_out = _snap(o)

        handles.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(layer.register_forward_hook(post, with_kwargs=True))
    from harness.precision.routing import RouterCapture

    # Every router's chosen experts: the reference follows them (see StreamedReference.run_layer).
    routers = RouterCapture(model)
    routers.phase = "step"
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
        routers.remove()
    for name, router_calls in routers.calls["step"].items():
        m = re.match(re.escape(prefix) + r"\.(\d+)\.(.+)$", name)
        io = got[int(m.group(1))] if m else None
        if io is not None and len(router_calls) == 1:
            io.routes[m.group(2)], io.router_logits[m.group(2)] = router_calls[0]
    return [g for g in got if g is not None]


def _f64(x):
    if isinstance(x, torch.Tensor):
        if x.is_complex():
            return x.to(torch.complex128)
        return x.double() if x.is_floating_point() else x
    if isinstance(x, (tuple, list)):
        return type(x)(_f64(v) for v in x)
    if isinstance(x, Mapping):  # a fresh dict: the layer may write into it (Gemma-4's shared K/V)
        return {k: _f64(v) for k, v in x.items()}
    return x


def _experts_modules(layer: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {n: m for n, m in layer.named_modules()
            if type(m).__name__.endswith("Experts") and any(p.dim() == 3 for p in m.parameters(recurse=False))}


def _fused_expert_params(layer: torch.nn.Module) -> set[str]:
    """Names (relative to the layer) of the experts modules' parameters indexed by expert along dim 0:
    the 3-D stacks [E, ...] and their biases [E, out]. A checkpoint that stores them fused is read for the
    routed experts' rows only."""
    out = set()
    for name, mod in _experts_modules(layer).items():
        ps = dict(mod.named_parameters(recurse=False))
        n = next(p.shape[0] for p in ps.values() if p.dim() == 3)
        out.update(f"{name}.{k}" for k, p in ps.items() if p.dim() >= 2 and p.shape[0] == n)
    return out


class StreamedReference:
    """Per-layer float64 reference from the checkpoint's shards (one layer in memory at a time)."""

    def __init__(self, meta_model: torch.nn.Module, ckpt: Checkpoint):
        from harness.models.config import use_eager_experts

        self.ckpt = ckpt
        self.meta = meta_model
        self._host_buffers: torch.nn.ModuleList | None = None  # see _computed_buffers
        use_eager_experts(meta_model.config)  # per-expert loop: float64 on CPU, and only hit experts run
        self.prefix, self.layers = decoder_layers(meta_model)
        self.entries: dict[int, list[rename.Entry]] = {}
        for e in rename.plan(meta_model, rename.whole(len(self.layers))).entries:
            m = rename.LAYER_RE.search(e.param)
            if m and e.param.startswith(self.prefix + "."):
                self.entries.setdefault(int(m.group(2)), []).append(e)
        self.block = quant.block_size(ckpt)
        self.reader = ShardReader(ckpt)

    def _fill(self, sd: dict[str, torch.Tensor], entries: Iterable[rename.Entry], strip: str,
              rows: list[int] | None = None) -> None:
        """Copy each entry's tensor into its view of the layer's parameter; with ``rows``, only those
        rows along dim 0 of a fused-experts tensor (read alone where the format allows)."""
        for e in entries:
            st = quant.locate(self.ckpt, e.source)
            if st is None:
                raise WeightsError(f"{e.source} is missing from the checkpoint")
            dest = e.view(sd[e.param[len(strip):]])
            src = e.adapt(quant.read_dequantized(self.reader, st, self.block, rows),
                          dest.shape if rows is None else (len(rows), *dest.shape[1:]))
            if rows is not None:
                if tuple(src.shape[1:]) != tuple(dest.shape[1:]):
                    raise WeightsError(f"{e.source} in {self.ckpt.tensors[st.keys[0]].shard}: rows of shape "
                                       f"{list(src.shape[1:])}, the model expects {list(dest.shape[1:])}")
                dest.index_copy_(0, torch.tensor(rows), src.to(dest.dtype))
                del src
                continue
            if tuple(src.shape) != tuple(dest.shape):
                raise WeightsError(f"{e.source} in {self.ckpt.tensors[st.keys[0]].shard}: shape {list(src.shape)}, "
                                   f"the model expects {list(dest.shape)}")
            dest.copy_(src)
            del src

    def _computed_buffers(self, i: int, layer: torch.nn.Module) -> None:
        """Non-persistent buffers of layer i (a rotary module inside the layer: DeepSeek-V4's attention),
        which the checkpoint does not hold and ``to_empty`` left unset: computed by the model's own
        ``__init__`` on the host, parameters on meta (free), once, and copied in (floating ones in float64)."""
        names = [(mn, bn) for mn, m in layer.named_modules() for bn in m._non_persistent_buffers_set
                 if m._buffers.get(bn) is not None]
        if not names:
            return
        if self._host_buffers is None:
            from harness.weights.load import parameters_on_meta

            with parameters_on_meta():
                self._host_buffers = decoder_layers(type(self.meta)(self.meta.config))[1]
        src = self._host_buffers[i]
        for mn, bn in names:
            t = src.get_submodule(mn)._buffers[bn] if mn else src._buffers[bn]
            dest = layer.get_submodule(mn) if mn else layer
            dest._buffers[bn] = t.double() if t.is_floating_point() else t.clone()

    def layer(self, i: int) -> tuple[torch.nn.Module, list[rename.Entry], dict[str, torch.Tensor]]:
        """Layer i in float64 with every non-expert tensor filled; the routed-expert entries and the
        layer's state dict are returned so the caller fills them once routing is known."""
        # A copy of the meta layer (free), materialized: the meta model itself stays on meta.
        layer = copy.deepcopy(self.layers[i]).to(torch.float64).to_empty(device="cpu")
        self._computed_buffers(i, layer)
        strip = f"{self.prefix}.{i}."
        sd = {k: v.data for k, v in layer.state_dict(keep_vars=True).items()}
        fused = _fused_expert_params(layer)
        now, later = [], []
        for e in self.entries.get(i, []):
            (later if e.expert is not None or e.param[len(strip):] in fused else now).append(e)
        with torch.no_grad():
            self._fill(sd, now, strip)
        return layer, later, sd

    def run_layer(self, i: int, io: LayerIO, rotary: Callable | None = None, router_tol: float = 0.0,
                  logits_tol: float | None = None) -> tuple[torch.Tensor, int | None, Routing]:
        """Layer i on the target's input, following the target's routing (docs/weights.md): returns the
        output, the experts read, and how the target's routing compares with the reference's own."""
        from harness.precision.routing import ForcedRouting

        layer, later, sd = self.layer(i)
        # Under a holder, so that the routers are named as in a model (``layer.mlp.gate``): the router
        # rule (harness.anatomy.capture.ROUTER_SUFFIXES) needs the dot.
        holder = torch.nn.ModuleDict({"layer": layer})
        trace = ForcedRouting({"step": {f"layer.{r}": idx for r, idx in io.routes.items()}}, phase="step")
        forced = trace.attach(holder) if io.routes else []
        strip = f"{self.prefix}.{i}."
        handles, hit_count = [], []
        for _name, mod in _experts_modules(layer).items():
            def pre(mod, args, kwargs, mod_n=next(p.shape[0] for p in mod.parameters(recurse=False) if p.dim() == 3)):
                idx = args[1] if len(args) > 1 else kwargs.get("top_k_index")
                # Experts called without the routed indices (Llama-4: every expert runs on every token,
                # weighted by its score) read them all.
                hit = sorted(set(idx.reshape(-1).tolist())) if isinstance(idx, torch.Tensor) else list(range(mod_n))
                hit_count.append(len(hit))
                with torch.no_grad():
                    self._fill(sd, [e for e in later if e.expert in hit], strip)
                    # Fused experts [E, ...]: the routed rows only. Rows of experts no token routes to
                    # stay unwritten; the eager experts loop never reads them.
                    self._fill(sd, [e for e in later if e.expert is None], strip, rows=hit)
            handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
        kwargs = _f64(io.kwargs)
        if rotary is not None and (io.rotary is not None or "position_ids" in io.kwargs):
            x = io.hidden_in.double()
            if isinstance(io.rotary, dict):
                pe = {k: rotary(x, c) for k, c in io.rotary.items()}
                pe = None if any(v is None for v in pe.values()) else pe
            else:
                pe = rotary(x, io.rotary or io.kwargs["position_ids"])
            if pe is not None:
                kwargs["position_embeddings"] = pe
        try:
            with torch.no_grad():
                out = layer(io.hidden_in.double(), *_f64(io.args), **kwargs)
        finally:
            for h in [*handles, *forced]:
                h.remove()
        out = out[0] if isinstance(out, (tuple, list)) else out
        routing = judge_routing(trace, io.routes, router_tol, io.hidden_in.dtype, io.router_logits, logits_tol)
        del layer, holder, trace  # frees the layer's float64 tensors (the trace holds router copies)
        return out, (sum(hit_count) if hit_count else None), routing


@dataclass
class Routing:
    near_tie: int = 0
    wide: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def judge_routing(trace, routes: dict[str, torch.Tensor], tol: float, dtype: torch.dtype | None = None,
                  target_logits: dict[str, torch.Tensor] | None = None, logits_tol: float | None = None) -> Routing:
    """Each router's choice by the target against what the float64 reference router would choose itself
    on the same input. A token routed otherwise is a near tie - rounding of the target's dtype can flip
    it - when the reference's margin between an expert dropped and one added is within ``2 x tol x``
    the router's largest logit, or, for a router that selects by something other than its logits
    (bias-corrected, group-limited), when the precision check's selection judge finds it a tie where it
    selects - including a correct router computed in the target's ``dtype`` on inputs moved within the
    noise, since such a router's selection rounds (DeepSeek-V3/V4 in bf16); the parallel check's rule
    (harness.precision.routing) with the precision check's run-dtype witness. Wider: a routing fault."""
    from harness.precision.compare import tensor_metrics
    from harness.precision.routing import legit_flips, router_limits

    r = Routing()
    lims = router_limits(trace, tol)
    for gate, call in trace.calls["step"].items():
        name = gate.removeprefix("layer.")
        got = routes[name]
        lim = lims[gate]
        tl = (target_logits or {}).get(name)
        if tl is not None and tl.numel() == call.logits.numel():
            # The noise measured at this router, token by token: the target's logits against the float64
            # router's on the same layer input. The router's input carries the target's rounding of
            # everything before it in the layer (attention, norms), which a fixed fraction of the largest
            # logit does not bound (DeepSeek-V3 bf16: a flip at margin 0.0145 against 0.0128). The
            # logits themselves must stay within the layer tolerance, or the router is the fault.
            tl = tl.reshape(call.logits.shape).double()
            m = tensor_metrics(tl, call.logits.double())
            if logits_tol is not None and not (m["rel_rmse"] <= logits_tol):
                # Beyond the layer's own tolerance: something before the router or the router itself is
                # off, and the layer's output comparison says which; its noise is no allowance.
                r.notes.append(f"router {name}: logits differ from the float64 router's by rel_rmse "
                               f"{m['rel_rmse']:.3g} > {logits_tol:.3g}; flips judged on the fixed limit only")
            else:
                noise = (tl - call.logits.double()).abs().amax(-1).reshape(-1)
                lim = torch.clamp(2 * noise, min=lim)
        flipped, ok, margin = legit_flips(gate, call, slice(None), got.to(call.natural.dtype), lim, dtype)
        r.near_tie += int((flipped & ok).sum())
        bad = flipped & ~ok
        if bad.any():
            t = int(bad.nonzero()[0, 0])
            lt = lim[t].item() if isinstance(lim, torch.Tensor) else lim
            r.wide.append(f"router {name}: {int(bad.sum())} token(s) routed to other experts "
                          f"than the float64 reference at a wide margin (token {t}: margin {margin[t].item():.3g} > "
                          f"near-tie limit {lt:.3g})")
    for gate in sorted(set(trace.unforced)):
        r.notes.append(f"router {gate.removeprefix('layer.')}: its top-k could not be made to follow the target's; "
                       "the reference used its own routing")
    return r


def stream_reference(meta_model: torch.nn.Module, ckpt: Checkpoint, captured: list[LayerIO], tol: float,
                     rotary: Callable | None = None, on_layer: Callable[[int], None] | None = None,
                     router_tol: float = 2**-6) -> StreamReport:
    from harness.precision.compare import tensor_metrics

    ref = StreamedReference(meta_model, ckpt)
    rep = StreamReport(tolerance={"rel_rmse": tol, "router": router_tol})
    for i, io in enumerate(captured):
        before = ref.reader.bytes_read
        out, experts, routing = ref.run_layer(i, io, rotary, router_tol, logits_tol=tol)
        m = tensor_metrics(io.hidden_out, out)
        ok = math.isfinite(m["rel_rmse"]) and m["rel_rmse"] <= tol and not routing.wide
        rep.layers.append(LayerResult(i, m, ok, ref.reader.bytes_read - before, experts, routing.near_tie,
                                      routing.wide))
        rep.notes.extend(f"layer {i}: {n}" for n in routing.notes)
        del out
        # Unmap the shards after each layer: pages safe_open touched stay resident (and counted in
        # RSS) for as long as the file is mapped; a layer's shards are reopened in microseconds.
        ref.reader.close()
        if on_layer is not None:
            on_layer(i)
    rep.bytes_read = ref.reader.bytes_read
    ref.reader.close()
    return rep


def float64_rotary(meta_model: torch.nn.Module) -> Callable | None:
    """The model's rotary embeddings rebuilt on the host, called as the target called them: ``rot(x,
    call)`` with a :class:`RotaryCall` (or bare position ids, for the model's one rotary module) gives
    the tables in float64 (complex128 for Llama-4's ``freqs_cis``). transformers computes them in
    float32 inside, as the model does. None when the model has no rotary module at model level (then the
    captured tables are used)."""
    mods = _rotary_modules(meta_model)
    if not mods:
        return None
    built: dict[str, torch.nn.Module] = {}

    def host(name: str) -> torch.nn.Module:
        if name not in built:
            rot = mods[name]
            # A wrapper's rotary takes its own sub-config (Gemma-4's text config); the module keeps it.
            built[name] = type(rot)(config=getattr(rot, "config", None) or meta_model.config)
        return built[name]

    # Bare position ids (no call recorded): the language model's own table, not a vision tower's.
    default = min((n for n in mods if n.endswith("rotary_emb")), key=lambda n: n.count("."), default=next(iter(mods)))

    def rotary(x: torch.Tensor, call) -> tuple | torch.Tensor | None:
        if not isinstance(call, RotaryCall):
            call = RotaryCall(default, call)
        try:
            mod = host(call.module)
        except TypeError:  # a rotary module that cannot be rebuilt from its config: the captured tables
            return None
        return _f64(mod(x, call.position_ids, *call.args, **call.kwargs))

    return rotary
