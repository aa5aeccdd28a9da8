"""Streamed full-size precision: the target's hidden states at every decoder-layer boundary against a
float64 reference recomputed on the host one layer at a time.

Target side (:func:`capture_layers`): the full model runs a few prompts once; hooks on each decoder
layer keep its input hidden states [B, S, H], the keyword inputs it was given (attention mask, position
ids, rotary tables) and its output [B, S, H], all moved to the host.

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
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from harness.weights import quant, rename
from harness.weights.layout import Checkpoint, WeightsError
from harness.weights.reader import ShardReader


@dataclass
class LayerIO:
    """What one decoder layer saw and produced in the target run (host tensors)."""

    hidden_in: torch.Tensor  # [B, S, H]
    kwargs: dict  # attention_mask, position_ids, position_embeddings (cos, sin), ...
    hidden_out: torch.Tensor | None = None  # [B, S, H]


@dataclass
class LayerResult:
    layer: int
    metrics: dict[str, float]
    ok: bool
    bytes_read: int = 0
    experts_read: int | None = None


@dataclass
class StreamReport:
    layers: list[LayerResult] = field(default_factory=list)
    tolerance: dict[str, float] = field(default_factory=dict)
    bytes_read: int = 0

    @property
    def first_divergent(self) -> int | None:
        return next((r.layer for r in self.layers if not r.ok), None)

    def render(self) -> str:
        """The per-layer table, in the precision check's terms."""
        head = f"{'layer':>5}  {'rel_rmse':>10}  {'max_abs_err':>11}  {'cosine':>10}  {'experts':>7}  status"
        rows = [head]
        for r in self.layers:
            m = r.metrics
            rows.append(f"{r.layer:>5}  {m['rel_rmse']:>10.3g}  {m['max_abs_err']:>11.3g}  {m['cosine']:>10.6f}  "
                        f"{'' if r.experts_read is None else r.experts_read:>7}  {'ok' if r.ok else 'DIVERGES'}")
        return "\n".join(rows)


def decoder_layers(model: torch.nn.Module) -> tuple[str, torch.nn.ModuleList]:
    """The ModuleList of decoder layers (``model.layers``), found by name and length."""
    n = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    best = None
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.ModuleList) and name.split(".")[-1] == "layers" and (n is None or len(mod) == n):
            if best is None or name.count(".") < best[0].count("."):
                best = (name, mod)
    if best is None:
        raise WeightsError("no decoder-layer list (<...>.layers) found in the model")
    return best


def _host(x):
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu")
    if isinstance(x, (tuple, list)):
        return type(x)(_host(v) for v in x)
    return x


KEEP_KWARGS = ("attention_mask", "position_ids", "position_embeddings", "cache_position")


def capture_layers(model: torch.nn.Module, ids: torch.Tensor) -> list[LayerIO]:
    """Run ``model`` once on ``ids`` [B, S] and keep every decoder layer's input, kwargs and output."""
    _, layers = decoder_layers(model)
    got: list[LayerIO | None] = [None] * len(layers)
    handles = []
    for i, layer in enumerate(layers):
        def pre(mod, args, kwargs, i=i):
            h = args[0] if args else kwargs["hidden_states"]
            got[i] = LayerIO(_host(h), {k: _host(kwargs[k]) for k in KEEP_KWARGS if kwargs.get(k) is not None})

        def post(mod, args, kwargs, out, i=i):
            o = out[0] if isinstance(out, (tuple, list)) else out
            got[i].hidden_out = _host(o)

        handles.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(layer.register_forward_hook(post, with_kwargs=True))
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return [g for g in got if g is not None]


def _f64(x):
    if isinstance(x, torch.Tensor):
        return x.double() if x.is_floating_point() else x
    if isinstance(x, (tuple, list)):
        return type(x)(_f64(v) for v in x)
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
        use_eager_experts(meta_model.config)  # per-expert loop: float64 on CPU, and only hit experts run
        self.prefix, self.layers = decoder_layers(meta_model)
        n = len(self.layers)
        sel = rename.Selection(list(range(n)), None, n, None)
        self.entries: dict[int, list[rename.Entry]] = {}
        for e in rename.plan(meta_model, sel).entries:
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
            src = quant.read_dequantized(self.reader, st, self.block, rows)
            dest = e.view(sd[e.param[len(strip):]])
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

    def layer(self, i: int) -> tuple[torch.nn.Module, list[rename.Entry]]:
        """Layer i in float64 with every non-expert tensor filled; the routed-expert entries are returned
        so the caller fills them once routing is known."""
        # A copy of the meta layer (free), materialized: the meta model itself stays on meta.
        layer = copy.deepcopy(self.layers[i]).to(torch.float64).to_empty(device="cpu")
        strip = f"{self.prefix}.{i}."
        sd = layer.state_dict(keep_vars=True)
        sd = {k: v.data for k, v in sd.items()}
        fused = _fused_expert_params(layer)
        entries = self.entries.get(i, [])
        later = [e for e in entries if e.expert is not None or e.param[len(strip):] in fused]
        now = [e for e in entries if not (e.expert is not None or e.param[len(strip):] in fused)]
        with torch.no_grad():
            self._fill(sd, now, strip)
        return layer, later

    def run_layer(self, i: int, io: LayerIO, rotary: Callable | None = None) -> tuple[torch.Tensor, int | None]:
        layer, later = self.layer(i)
        strip = f"{self.prefix}.{i}."
        sd = {k: v.data for k, v in layer.state_dict(keep_vars=True).items()}
        handles, hit_count = [], []
        for _name, mod in _experts_modules(layer).items():
            def pre(mod, args, kwargs):
                idx = args[1] if len(args) > 1 else kwargs["top_k_index"]
                hit = sorted(set(idx.reshape(-1).tolist()))
                hit_count.append(len(hit))
                with torch.no_grad():
                    self._fill(sd, [e for e in later if e.expert in hit], strip)
                    # Fused experts [E, ...]: the routed rows only. Rows of experts no token routes to
                    # stay unwritten; the eager experts loop never reads them.
                    self._fill(sd, [e for e in later if e.expert is None], strip, rows=hit)
            handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
        kwargs = _f64(io.kwargs)
        if rotary is not None and "position_ids" in io.kwargs:
            kwargs["position_embeddings"] = rotary(io.hidden_in.double(), io.kwargs["position_ids"])
        try:
            with torch.no_grad():
                out = layer(io.hidden_in.double(), **kwargs)
        finally:
            for h in handles:
                h.remove()
        out = out[0] if isinstance(out, (tuple, list)) else out
        del layer  # reference counting frees the layer's float64 tensors here (no cycles: no gc pass)
        return out, (sum(hit_count) if hit_count else None)


def layer_tolerance(dtype: str) -> float:
    """Default rel_rmse bound per target dtype for one layer fed its exact input."""
    return {"float64": 1e-10, "float32": 1e-4, "bfloat16": 3e-2, "float16": 5e-3}.get(dtype, 3e-2)


def stream_reference(meta_model: torch.nn.Module, ckpt: Checkpoint, captured: list[LayerIO], tol: float,
                     rotary: Callable | None = None, on_layer: Callable[[int], None] | None = None) -> StreamReport:
    from harness.precision.compare import tensor_metrics

    ref = StreamedReference(meta_model, ckpt)
    rep = StreamReport(tolerance={"rel_rmse": tol})
    for i, io in enumerate(captured):
        before = ref.reader.bytes_read
        out, experts = ref.run_layer(i, io, rotary)
        m = tensor_metrics(io.hidden_out, out)
        ok = math.isfinite(m["rel_rmse"]) and m["rel_rmse"] <= tol
        rep.layers.append(LayerResult(i, m, ok, ref.reader.bytes_read - before, experts))
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
    """The model's rotary embedding built on the host (float32 tables inside transformers, as the model
    computes them), or None when it has none at model level (then the captured tables are used)."""
    rot = next((m for n, m in meta_model.named_modules() if n.endswith("rotary_emb")), None)
    if rot is None:
        return None
    try:
        host = type(rot)(config=meta_model.config)
    except TypeError:
        return None
    return lambda x, pos: tuple(t.double() for t in host(x, pos))
