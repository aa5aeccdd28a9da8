"""Tensor parallelism inside fused MoE experts (transformers' ``moe_tp_experts`` / ``packed_colwise`` /
``rowwise`` entries of a tp plan), Megatron-style: every tp rank holds every expert, each with a slice
of its intermediate dimension.

transformers 5 keeps a layer's experts as two 3-D parameters::

    gate_up_proj [E, 2I, H]   gate rows [:, :I], up rows [:, I:]   (the forward does .chunk(2, dim=-1))
    down_proj    [E, H, I]

Rank r of tp keeps ``gate[:, rI/tp:(r+1)I/tp]`` and the same rows of ``up``, packed again as
[E, 2I/tp, H] (so the module's own ``chunk(2)`` still splits gate from up), and the matching columns of
``down_proj`` [E, H, I/tp]. Each rank's experts output is then a partial sum over the intermediate
dimension: one all-reduce after the experts module (Megatron's "g"), and an all-reduce of the
gradient flowing back into each differentiable input of the experts (Megatron's "f": the hidden
states and the routing weights), since every rank's slice contributes to them. The router and the shared experts are untouched (the router stays replicated; shared experts
are ordinary Linear layers the tp plan already splits).

DTensor is not used for these: the experts' forward indexes an expert (``gate_up_proj[e]``) and feeds
the slice to ``F.linear`` with a plain activation, which a sharded DTensor does not mix with. The
parameters are plain local tensors and :func:`gather_full` rebuilds the full tensor for comparison.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from harness.parallel.apply import _GradAllReduce, _match
from harness.parallel.reference import clean_name


class _AllReduceSum(torch.autograd.Function):
    """Forward: sum over ``group`` (the partial outputs of the experts' slices); backward: identity."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _f(x, group):
    """Megatron's "f" on a differentiable input of the experts: each rank's slice contributes part of its
    gradient (hidden states [T, H] and the routing weights [T, k] both), so it is summed over tp."""
    if isinstance(x, torch.Tensor) and x.is_floating_point() and x.requires_grad:
        return _GradAllReduce.apply(x, group)
    return x


def _fused(mod: torch.nn.Module) -> bool:
    gu, dn = getattr(mod, "gate_up_proj", None), getattr(mod, "down_proj", None)
    return (isinstance(gu, torch.nn.Parameter) and isinstance(dn, torch.nn.Parameter) and gu.dim() == 3
            and dn.dim() == 3 and gu.shape[0] == dn.shape[0] and gu.shape[2] == dn.shape[1]
            and gu.shape[1] == 2 * dn.shape[2])


def splits(mod: torch.nn.Module) -> bool:
    """Whether :func:`shard_fused_experts` splits this experts module (the plan counts by the same
    rule: Nemotron-H's ungated ``up_proj`` experts stay whole on every tp rank)."""
    return _fused(mod) and not getattr(mod, "is_transposed", False) and not getattr(mod, "has_bias", False)


def shard_fused_experts(model: torch.nn.Module, names: list[str], tp_group) -> tuple[dict[str, tuple[int, bool]],
                                                                                      list[str]]:
    """Split the fused experts modules ``names`` over ``tp_group``. Returns {clean parameter name: (dim,
    packed)} for :func:`gather_full`, and notes for modules left replicated (with why)."""
    n, r = dist.get_world_size(tp_group), dist.get_rank(tp_group)
    sharded: dict[str, tuple[int, bool]] = {}
    notes: list[str] = []
    for name in names:
        mod = model.get_submodule(name)
        if not splits(mod):
            notes.append(f"{name}: not the [E, 2I, H] / [E, H, I] fused layout without biases; kept replicated "
                         "on the tp ranks")
            continue
        inter = mod.down_proj.shape[2]
        if inter % n:
            notes.append(f"{name}: intermediate size {inter} does not split over tp{n}; kept replicated")
            continue
        k = inter // n
        with torch.no_grad():
            gu = mod.gate_up_proj.data
            local_gu = torch.cat([gu[:, r * k:(r + 1) * k], gu[:, inter + r * k: inter + (r + 1) * k]], dim=1)
            local_dn = mod.down_proj.data[:, :, r * k:(r + 1) * k]
        mod.gate_up_proj = torch.nn.Parameter(local_gu.clone())  # [E, 2I/tp, H]
        mod.down_proj = torch.nn.Parameter(local_dn.clone())  # [E, H, I/tp]
        mod.register_forward_pre_hook(lambda _m, args, g=tp_group: tuple(_f(a, g) for a in args))
        mod.register_forward_hook(lambda _m, _a, out, g=tp_group: _AllReduceSum.apply(out, g))
        sharded[clean_name(f"{name}.gate_up_proj")] = (1, True)
        sharded[clean_name(f"{name}.down_proj")] = (2, False)
    if sharded:
        notes.append(f"fused experts split over tp{n} in {len(sharded) // 2} module(s): gate_up_proj [E, 2I/{n}, H], "
                     f"down_proj [E, H, I/{n}], outputs all-reduced")
    return sharded, notes


def gather_full(t: torch.Tensor, dim: int, packed: bool, tp_group) -> torch.Tensor:
    """The full tensor from every tp rank's slice (``packed``: gate and up slices reassembled as
    [gate_0..gate_n, up_0..up_n] along ``dim``)."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(tp_group))]
    dist.all_gather(parts, t.contiguous(), group=tp_group)
    if not packed:
        return torch.cat(parts, dim)
    halves = [p.chunk(2, dim) for p in parts]
    return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim)


def fused_experts_in_plan(model: torch.nn.Module, plan: dict[str, str]) -> list[str]:
    """Module names the plan marks ``moe_tp_experts`` (relative keys with ``*`` for a layer index)."""
    return list(_match({k: v for k, v in plan.items() if v == "moe_tp_experts"}, model))
