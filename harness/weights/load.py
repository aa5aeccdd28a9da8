"""Fill a pruned model with the real tensors of the layers and experts it keeps.

Called by ``harness.models.build.build_model`` when the suite has weights. The model is built by
:func:`instantiate_empty` (parameters allocated, never initialised: the seeded random init was most
of a pruned build's time and the load overwrites all of it; buffers computed exactly as the random
build computes them) and then every parameter and persistent buffer is written from the checkpoint
through the :mod:`rename` plan, tensor by tensor, straight into its place; :func:`fill` refuses a
plan that would leave any of them (or any part of a fused one) unwritten. Quantized
tensors are dequantized exactly (:mod:`quant`) before the copy. A tensor the plan needs that the
checkpoint lacks, or one whose shape differs, is an error naming the tensor and its shard: a pruned
model half made of random weights is not a real-weight model.
"""

from __future__ import annotations

import contextlib
import time

import torch

from harness.messages import display
from harness.suite.loader import LoadedSuite
from harness.weights import quant, rename
from harness.weights.layout import Checkpoint, WeightsError, open_checkpoint
from harness.weights.reader import ShardReader


def _meta(ls: LoadedSuite, mc) -> torch.nn.Module:
    from harness.models.build import instantiate

    with torch.device("meta"):
        return instantiate(ls, mc, torch.float32)


@contextlib.contextmanager
def parameters_on_meta():
    """Every parameter registered in this block goes to the meta device; buffers stay where they are made.

    What ``accelerate.init_empty_weights(include_buffers=False)`` does (accelerate is not a dependency:
    eight lines here). A whole-model ``torch.device("meta")`` would also put the non-persistent buffers
    (rotary ``inv_freq``, ``original_inv_freq``, anything a model computes in ``__init__``) on meta, and
    recomputing them afterwards means knowing every model's formula; here the model's own ``__init__``
    and ``post_init`` compute them on the CPU in float32, the same code on the same device as the random
    build, so they are bit-identical to it. The random init functions then run on meta tensors: free.
    The patch is process-wide while the block runs; harness builds models on one thread (the parallel
    launcher's thread only waits on torchrun processes)."""
    register = torch.nn.Module.register_parameter

    def on_meta(self, name, param):
        if param is not None and param.device.type != "meta":
            param = type(param)(param.to("meta"), requires_grad=param.requires_grad)
        register(self, name, param)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def instantiate_empty(ls: LoadedSuite, mc, dtype: torch.dtype) -> torch.nn.Module:
    """The pruned model on the CPU with uninitialised parameters, for :func:`load_pruned` to fill.

    Parameters are allocated in the dtype the random build would hold them in before the load (float32,
    or float64 for a float64 build, which :func:`load_pruned` casts to first), so the values loaded are
    rounded exactly as before. Tied parameters stay one tensor. A buffer left on meta was computed from
    a parameter (no model in transformers does that): a persistent one is loaded like a parameter, a
    non-persistent one has no source and the build is refused naming it."""
    from harness.models.build import instantiate

    with parameters_on_meta():
        model = instantiate(ls, mc, dtype)
    materialize_empty(model, lambda _m: "cpu",
                      lambda _m, _n, p: torch.float64 if dtype == torch.float64 and p.is_floating_point() else p.dtype)
    return model


def materialize_empty(model: torch.nn.Module, device_of, dtype_of) -> None:
    """Give every meta parameter and persistent meta buffer of ``model`` uninitialised memory: parameter
    ``name`` of module ``m`` on ``device_of(m)`` in ``dtype_of(m, name, p)``, a buffer in its own dtype.
    Tied parameters stay one tensor. A non-persistent buffer left on meta has no source (the checkpoint
    does not hold it): refused, naming it."""
    made: dict[int, torch.nn.Parameter] = {}
    keep = []  # the meta originals stay referenced, so their ids cannot be reused while mapping
    for mname, mod in model.named_modules():
        for name, p in mod._parameters.items():
            if p is None or p.device.type != "meta":
                continue
            q = made.get(id(p))
            if q is None:
                q = made[id(p)] = type(p)(torch.empty(p.shape, dtype=dtype_of(mod, name, p), device=device_of(mod)),
                                          requires_grad=p.requires_grad)
                keep.append(p)
            mod._parameters[name] = q
        for name, b in mod._buffers.items():
            if b is None or b.device.type != "meta":
                continue
            if name in mod._non_persistent_buffers_set:
                raise WeightsError(f"{mname + '.' if mname else ''}{name}: a non-persistent buffer computed from the "
                                   "parameters at build time; the checkpoint does not hold it, so a real-weight build "
                                   "cannot fill it")
            mod._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device=device_of(mod))


def _where(ckpt: Checkpoint, key: str) -> str:
    """The shard a missing key would be in: the one holding its layer's other tensors."""
    m = rename.LAYER_RE.search(key)
    prefix = key[: m.end()] if m else key.rsplit(".", 1)[0]
    shards = sorted({i.shard for n, i in ckpt.tensors.items() if n.startswith(prefix)})
    return f"shard {shards[0]}" if shards else f"any of the {len(ckpt.shards)} shards"


def build_plan(model: torch.nn.Module, ls: LoadedSuite, mc, ckpt: Checkpoint) -> rename.Plan:
    from harness.models.build import model_config

    m = ls.suite.model
    full_mc = model_config(ls, pruned=False)
    sel = rename.select(_meta(ls, full_mc), full_mc.config, _meta(ls, mc), mc.config,
                        layers=list(m.weights_layers) or None, experts=list(m.weights_experts) or None)
    return rename.plan(model, sel)


def fill(model: torch.nn.Module, p: rename.Plan, ckpt: Checkpoint, reader: ShardReader) -> dict[str, int]:
    """Copy every planned tensor into the model. Returns counts by storage format."""
    sd = model.state_dict(keep_vars=True)
    # The model was built without initialising anything (instantiate_empty): every element of every
    # parameter and persistent buffer must be written, or it would run on whatever memory held.
    covered: dict[str, int] = {}
    for e in p.entries:
        covered[e.param] = covered.get(e.param, 0) + e.view(sd[e.param]).numel()
    unwritten = [n for n, t in sd.items() if n not in p.skipped and covered.get(n, 0) != t.numel()]
    if unwritten:
        raise WeightsError(f"{len(unwritten)} tensor(s) of the pruned model would not be filled from the checkpoint, "
                           f"first {unwritten[0]} ({covered.get(unwritten[0], 0)} of {sd[unwritten[0]].numel()} "
                           "elements mapped)")
    located = [(e, quant.locate(ckpt, e.source)) for e in p.entries]
    missing = [e.source for e, st in located if st is None]
    if missing:
        raise WeightsError(f"{len(missing)} tensor(s) the pruned model needs are missing from the checkpoint, first "
                           f"{missing[0]} (expected in {_where(ckpt, missing[0])})"
                           + (f"; also {', '.join(missing[1:3])}" if len(missing) > 1 else ""))
    block = quant.block_size(ckpt)
    kinds: dict[str, int] = {}
    # Entries in shard order, each shard unmapped after its last tensor: resident memory stays near the
    # model plus one shard, not the model plus every page of every shard it read.
    located.sort(key=lambda x: ckpt.tensors[x[1].keys[0]].shard)
    last = {ckpt.tensors[st.keys[0]].shard: i for i, (_, st) in enumerate(located)}
    for i, (e, st) in enumerate(located):
        shard = ckpt.tensors[st.keys[0]].shard
        dest = e.view(sd[e.param].data)
        src = e.adapt(quant.read_dequantized(reader, st, block, e.rows), dest.shape)
        what = f"{e.param}" + (f"[{e.expert}]" if e.expert is not None else "")
        if tuple(src.shape) != tuple(dest.shape):
            raise WeightsError(f"{e.source} in {shard}: shape {list(src.shape)}, but the pruned model's {what} expects "
                               f"{list(dest.shape)} (prune only layers and experts when the suite has weights)")
        if src.is_floating_point() != dest.is_floating_point():
            raise WeightsError(f"{e.source} in {shard}: dtype {src.dtype}, but the pruned model's {what} is "
                               f"{dest.dtype}")
        with torch.no_grad():
            dest.copy_(src)
        del src
        kinds[st.kind] = kinds.get(st.kind, 0) + 1
        if last[shard] == i and all(ckpt.tensors[k].shard == shard for k in st.keys):
            reader.release(shard)
    return kinds


def load_pruned(model: torch.nn.Module, ls: LoadedSuite, mc, dtype: torch.dtype | None = None) -> list[str]:
    """Load the suite's real weights into ``model`` (pruned numbering). Returns notes for the run.

    With ``dtype`` float64 the model is cast first (in place), so that dequantized values, which need
    more than float32's 24 bits (an e4m3 or int4 value times a float32 scale), stay exact."""
    path = ls.weights_path
    if dtype == torch.float64:
        from harness.models.build import cast_model

        cast_model(model, torch.float64)  # in place; complex buffers stay complex (complex128)
    m = ls.suite.model
    t0 = time.perf_counter()
    ckpt = open_checkpoint(path, allow_pickle=m.weights_allow_pickle)
    p = build_plan(model, ls, mc, ckpt)
    reader = ShardReader(ckpt)
    swapped: list[str] = []
    why = kernel = ""
    # The float64 build is the reference a native run is compared with: dequantized, exact (and no FP8 or
    # INT4 kernel takes float64 activations).
    native = m.weights_quantized == "native" and dtype != torch.float64
    try:
        kinds = fill(model, p, ckpt, reader)
        if native and kinds.get("fp8_block"):
            from harness.weights.native import native_fp8, swap_fp8_linears

            ok, why = native_fp8("cpu")  # the host builds; a device without FP8 fails at its first forward
            if ok:
                swapped = swap_fp8_linears(model, ckpt, p, reader, quant.block_size(ckpt))
                kernel = "FP8 (torch._scaled_mm)"
        if native and kinds.get("int4_pack"):
            from harness.weights.native import native_int4, swap_int4_linears

            ok, why = native_int4("cpu")  # the kernel is CPU's; another device fails at its first forward
            if ok:
                swapped = swap_int4_linears(model, ckpt, p, reader)
                kernel = "INT4 group-wise (aten._weight_int4pack_mm_for_cpu)"
    finally:
        reader.close()
    notes = [f"real weights from {display(path)}: {p.selection.describe()}; read {reader.bytes_read / 2**20:.1f} MiB "
             f"of {ckpt.total_bytes / 2**20:.1f} MiB in {time.perf_counter() - t0:.2f} s"]
    q = {k: v for k, v in kinds.items() if k != "plain"}
    if q:
        notes.append("dequantized exactly: " + ", ".join(f"{v} {k} tensors" for k, v in sorted(q.items())))
        if m.weights_quantized == "native":
            why = why or ("the float64 build is the dequantized reference" if not native
                          else "no FP8 or INT4 Linear layers the kernels take")
            notes.append(f"weights_quantized = 'native': {len(swapped)} Linear layers kept in {kernel}"
                         if swapped else f"weights_quantized = 'native': nothing runs natively ({why}), ran dequantized")
    if ckpt.pickle:
        notes.append("weights read from pickle files with torch.load(weights_only=True) (model.weights_allow_pickle)")
    return notes


def provenance(ls: LoadedSuite) -> dict | None:
    """What a golden made from real weights should record (None for random weights): the checkpoint,
    the selection, and the manifest's digest when one is recorded."""
    from harness.weights.manifest import manifest_digest
    from harness.weights.source import locate

    loc = locate(ls)
    if loc.path is None:
        return None
    return {"weights": "real", "checkpoint": str(loc.path), "layers": list(ls.suite.model.weights_layers) or "default",
            "experts": list(ls.suite.model.weights_experts) or "default",
            "manifest_sha256": manifest_digest(loc.path)}




def weights_provenance(ls: LoadedSuite) -> dict:
    """What the golden's weights were: the checkpoint, the kept layers/experts and the checkpoint
    manifest's digest for real weights (``harness.weights.provenance``), else the seed of the random
    ones. ``load_golden`` refuses a golden whose weights are not the run's."""
    return provenance(ls) or {"weights": "random", "seed": ls.suite.checks.precision.seed}


def register(registry) -> None:
    """harness's own weights loader (the ``harness.weights`` entry point in its pyproject.toml)."""
    from harness.models.loaders import WeightsLoader

    registry.add(WeightsLoader("safetensors", instantiate_empty, load_pruned,
                               description="safetensors checkpoints, pruned layers/experts renamed (docs/weights.md)"))
