"""The full-size target of the streamed precision run, built straight onto its device(s).

A full model is never built on the host first: a 671B-parameter model would need 2.7 TB of host
memory in float32 (as the pruned builds are made). Instead the model's own ``__init__`` runs with its
parameters on the meta device (:func:`harness.weights.load.parameters_on_meta`: free; the buffers it
computes, rotary ``inv_freq`` and the like, are computed on the host exactly as in every other build),
each parameter is then allocated, uninitialised, on the device its module is placed on, in the run
dtype, and every tensor is written from the shards one at a time (dequantized where stored
quantized). Host memory stays near the largest single tensor.

Where the model does not fit one device, its decoder layers are split over several devices of the
backend in order (pipeline placement: ``harness plan``'s inference layout with ``pp`` = the devices
used, one prompt batch going through the stages in turn). Everything outside the decoder layers
(embeddings, rotary tables, final norm, LM head) stays on the first device. A forward pre-hook on each
placed module moves its tensor inputs to its device: what ``accelerate``'s ``dispatch_model`` does
(its ``AlignDevicesHook``), in a few lines here because accelerate is not a dependency of harness and
its loaders know nothing of the renamings and quantized formats harness reads.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from harness.proc import available_memory_bytes
from harness.weights.layout import WeightsError


@dataclass
class Placement:
    """Which device holds what: ``rest`` = everything outside the decoder layers."""

    rest: str
    layers: list[str]
    bytes_per_device: dict[str, int] = field(default_factory=dict)

    @property
    def devices(self) -> list[str]:
        return list(dict.fromkeys([self.rest, *self.layers]))

    def describe(self) -> str:
        """``cuda:0 (embeddings, head, layers 0-29), cuda:1 (layers 30-60)``."""
        parts = []
        for d in self.devices:
            idx = [i for i, x in enumerate(self.layers) if x == d]
            what = ["embeddings, head"] if d == self.rest else []
            if idx:
                what.append(f"layers {idx[0]}-{idx[-1]}" if len(idx) > 1 else f"layer {idx[0]}")
            parts.append(f"{d} ({', '.join(what)}, {self.bytes_per_device.get(d, 0) / 2**30:.2f} GiB)")
        return ", ".join(parts)


def _tensor_bytes(mod: torch.nn.Module, dtype: torch.dtype, seen: set[int]) -> int:
    n = 0
    for t in [*mod.parameters(), *mod.buffers()]:
        if id(t) in seen:  # tied (lm_head = embed_tokens): one tensor
            continue
        seen.add(id(t))
        n += t.numel() * (dtype.itemsize if t.is_floating_point() else t.element_size())
    return n


def plan_placement(meta: torch.nn.Module, dtype: torch.dtype, budgets: list[tuple[str, int]]) -> Placement | str:
    """Place ``meta`` (the full model on the meta device) over ``budgets`` [(device, usable bytes)], in
    order: the non-layer modules and then the decoder layers on the first device while they fit, the
    next layers on the next device, and so on. Returns the placement, or why the model does not fit."""
    from harness.anatomy.layers import decoder_layers

    _, layers = decoder_layers(meta)
    seen: set[int] = set()
    layer_bytes = [_tensor_bytes(layer, dtype, seen) for layer in layers]
    rest_bytes = _tensor_bytes(meta, dtype, seen)  # what is left once the layers are counted
    total = rest_bytes + sum(layer_bytes)
    if not budgets:
        return "no device to place the model on"
    free = [b for _, b in budgets]
    if rest_bytes > free[0]:
        return (f"the embeddings and head alone need {rest_bytes / 2**30:.1f} GiB, {budgets[0][0]} has "
                f"{free[0] / 2**30:.1f} GiB usable")
    used = {budgets[0][0]: rest_bytes}
    d, left, out = 0, free[0] - rest_bytes, []
    for i, b in enumerate(layer_bytes):
        while b > left:
            d += 1
            if d == len(budgets):
                return (f"the full model needs {total / 2**30:.1f} GiB in {str(dtype).removeprefix('torch.')}; "
                        f"{len(budgets)} device(s) have {sum(free) / 2**30:.1f} GiB usable and layer {i} does not fit "
                        "in what is left")
            left = free[d]
        out.append(budgets[d][0])
        used[budgets[d][0]] = used.get(budgets[d][0], 0) + b
        left -= b
    return Placement(budgets[0][0], out, used)


def _to_device(x, dev: torch.device):
    if isinstance(x, torch.Tensor):
        return x.to(dev) if x.device != dev else x
    if isinstance(x, (tuple, list)):
        return type(x)(_to_device(v, dev) for v in x)
    if isinstance(x, dict):
        return {k: _to_device(v, dev) for k, v in x.items()}
    if isinstance(x, Mapping) and callable(getattr(x, "to", None)):
        # transformers' KVSharingDict (Gemma-4's K/V shared between layers): a UserDict the layers
        # write into, moved in place by its own .to (as accelerate's send_to_device calls it).
        return x.to(dev)
    return x


def _align_inputs(mod: torch.nn.Module, dev: str) -> torch.utils.hooks.RemovableHandle:
    device = torch.device(dev)
    return mod.register_forward_pre_hook(lambda _m, args, kwargs: (_to_device(args, device),
                                                                   _to_device(kwargs, device)), with_kwargs=True)


def build_placed(ls, mc, dtype: torch.dtype, placement: Placement, ckpt) -> tuple[torch.nn.Module, dict[str, int]]:
    """The full model for ``ls`` in ``dtype``, each module allocated on its device and filled from ``ckpt``.
    Returns the model and the count of tensors read per storage format."""
    from harness.anatomy.layers import decoder_layers
    from harness.models.build import creation_dtype_buffers, instantiate, keep_in_fp32
    from harness.weights import rename
    from harness.weights.load import fill, materialize_empty, parameters_on_meta
    from harness.weights.reader import ShardReader

    with parameters_on_meta():
        model = instantiate(ls, mc, dtype)
    _, layers = decoder_layers(model)
    if len(layers) != len(placement.layers):
        raise WeightsError(f"placement for {len(placement.layers)} layers, the model has {len(layers)}")
    dev_of = {id(m): placement.layers[i] for i, layer in enumerate(layers) for m in layer.modules()}
    # What the deployed model keeps in float32 in a bf16 build (DeepSeek-V3's router), and the float32
    # buffers a checkpoint does not hold (rotary inv_freq) or complex ones: the rules of
    # harness.models.build.cast_model, which every build follows.
    fp32 = {(id(m), n) for m, n, _ in keep_in_fp32(model, dtype)}
    kept = {(id(m), n) for m, n, _ in creation_dtype_buffers(model, dtype)}

    def dtype_of(m, name, t):
        if not t.is_floating_point() or (id(m), name) in kept:
            return t.dtype
        return torch.float32 if (id(m), name) in fp32 else dtype

    materialize_empty(model, lambda m: dev_of.get(id(m), placement.rest), dtype_of)
    hooks = [_align_inputs(layer, placement.layers[i]) for i, layer in enumerate(layers)]
    for m in model.modules():
        dev = dev_of.get(id(m), placement.rest)
        for name, b in m._buffers.items():
            if b is not None:  # buffers the model's __init__ computed on the host
                m._buffers[name] = b.to(device=dev, dtype=dtype_of(m, name, b))
        if id(m) not in dev_of and any(t is not None for t in [*m._parameters.values(), *m._buffers.values()]):
            # A module outside the layers that holds tensors (embeddings, norm, head, rotary): its inputs
            # may come from the last layer's device.
            hooks.append(_align_inputs(m, placement.rest))
    p = rename.plan(model, rename.whole(len(layers)))
    reader = ShardReader(ckpt)
    try:
        kinds = fill(model, p, ckpt, reader)
    finally:
        reader.close()
    model._harness_placement_hooks = hooks  # kept alive with the model
    return model, kinds


def device_budgets(backend, fraction: float, limit: int | None = None, first=None) -> list[tuple[str, int]]:
    """[(device, usable bytes)] for the devices of ``backend``: ``fraction`` of what each reports free,
    the device ``first`` first (an item's own device: a sharded CI gives each worker its own), at most
    ``limit`` of them. The CPU backend is one device: the host's available memory."""
    t = backend.device_type
    if t == "cpu":
        avail = available_memory_bytes()  # psutil: MemAvailable on Linux, the platform's own elsewhere
        return [("cpu", int(fraction * avail))] if avail else []
    mod = getattr(torch, t, None)
    order = list(range(int(getattr(mod, "device_count", lambda: 1)())))
    own = torch.device(first).index if first is not None else None
    if own in order:
        order.remove(own)
        order.insert(0, own)
    if not callable(getattr(mod, "mem_get_info", None)):
        # not "does not fit": the backend cannot say how much memory is free (torch.cuda, torch_npu,
        # torch_musa and torch.xpu have it)
        raise PlacementUnknown(f"torch.{t} has no mem_get_info(device) -> (free, total): the free memory of its "
                               "devices is unknown, so the full model cannot be placed")
    out = []
    for i in order[:limit]:
        try:
            free = int(mod.mem_get_info(i)[0])
        except Exception:  # noqa: BLE001 - this device cannot be queried (lost, busy): not counted
            continue
        out.append((f"{t}:{i}", int(fraction * free)))
    return out


class PlacementUnknown(Exception):
    """The backend's devices cannot be measured for a placement (the message says what is missing)."""
