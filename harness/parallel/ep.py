"""Expert parallelism: the experts of each MoE block partitioned over the ranks of one group.

transformers 5 keeps a block's experts in one module with fused ``[E, ...]`` parameters and calls
it as ``experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k])``. ``shard_experts`` keeps
rank r's ``E / ep`` experts (``[r*E/ep, (r+1)*E/ep)``) and replaces the module's forward with
``ep_forward``: every (token, choice) pair is sent to the rank owning its expert
(``all_to_all_single``, differentiable), the owner runs the architecture's *own* expert code on
what it received (the module's forward as it was, an instance's own included, with local expert ids
and unit weights), the outputs come back by the inverse ``all_to_all_single`` and are combined with
the routing weights where the reference combines them.

``capacity_factor`` > 0 caps every expert at ``ceil(cf * T * k / E)`` assignments per rank (the
rest are dropped, as capacity-bounded MoE training does); 0 is dropless. Dropped and received
counts are kept per module for the metrics.
"""

from __future__ import annotations

import math
import types
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.nn.functional import all_to_all_single as a2a_autograd


@dataclass
class EPStats:
    assignments: int = 0  # (token, expert) pairs routed by this rank
    dropped: int = 0  # of those, dropped at capacity
    max_expert_load: int = 0  # most pairs any local expert received in one call
    calls: int = 0
    per_module: dict = field(default_factory=dict)


STATS = EPStats()


def is_experts(mod: torch.nn.Module, num_experts: int) -> bool:
    return type(mod).__name__.endswith("Experts") and any(
        p.dim() == 3 and p.shape[0] == num_experts for p in mod.parameters(recurse=False))


def plan_dispatch(flat_e: torch.Tensor, num_experts: int, ep: int, capacity: int | None):
    """Which (token, choice) pairs go where. ``flat_e`` [T*k] expert ids. Returns (order, kept mask
    over order, send counts [ep]); ``order`` sorts the pairs by expert, hence by owning rank."""
    order = torch.argsort(flat_e, stable=True)
    e_sorted = flat_e[order]
    keep = torch.ones_like(e_sorted, dtype=torch.bool)
    if capacity is not None:
        # Position of each pair within its expert's queue (pairs arrive sorted by expert).
        first = torch.searchsorted(e_sorted, e_sorted, right=False)
        keep = (torch.arange(len(e_sorted), device=flat_e.device) - first) < capacity
    owner = e_sorted // (num_experts // ep)
    counts = torch.bincount(owner[keep], minlength=ep)
    return order, keep, counts


def ep_forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
    cfg = self._harness_ep
    group, ep, E, e_local = cfg["group"], cfg["ep"], cfg["num_experts"], cfg["local"]
    T, k = top_k_index.shape
    flat_e = top_k_index.reshape(-1)
    flat_t = torch.arange(T, device=hidden.device).repeat_interleave(k)
    flat_w = top_k_weights.reshape(-1)
    cap = math.ceil(cfg["capacity_factor"] * T * k / E) if cfg["capacity_factor"] > 0 else None
    order, keep, send_counts = plan_dispatch(flat_e, E, ep, cap)
    sel = order[keep]
    STATS.assignments += int(flat_e.numel())
    STATS.dropped += int((~keep).sum())
    STATS.calls += 1
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send_l, recv_l = send_counts.tolist(), recv_counts.tolist()
    x_send = hidden[flat_t[sel]]  # [N_send, H]
    local_ids = (flat_e[sel] % e_local).to(torch.int64)
    ids_recv = torch.empty(sum(recv_l), dtype=torch.int64, device=hidden.device)
    dist.all_to_all_single(ids_recv, local_ids, recv_l, send_l, group=group)
    x_recv = a2a_autograd(hidden.new_empty(sum(recv_l), hidden.shape[1]), x_send, recv_l, send_l, group=group)
    if len(ids_recv):
        STATS.max_expert_load = max(STATS.max_expert_load, int(torch.bincount(ids_recv).max()))
    ones = torch.ones(len(ids_recv), 1, dtype=top_k_weights.dtype, device=hidden.device)
    y_recv = cfg["forward"](x_recv, ids_recv[:, None], ones)  # the module's own expert code, as it was
    y_back = a2a_autograd(hidden.new_empty(len(sel), hidden.shape[1]), y_recv, send_l, recv_l, group=group)
    y_back = y_back * flat_w[sel, None]  # promoted as the reference promotes it
    return torch.zeros_like(hidden).index_add(0, flat_t[sel], y_back.to(hidden.dtype))


def shard_experts(model: torch.nn.Module, num_experts: int, group, capacity_factor: float = 0.0) -> list[str]:
    """Keep this rank's experts of every experts module; returns the modules' names."""
    ep, rank = dist.get_world_size(group), dist.get_rank(group)
    e_local = num_experts // ep
    lo = rank * e_local
    names = []
    for name, mod in model.named_modules():
        if not is_experts(mod, num_experts):
            continue
        for pname, p in list(mod.named_parameters(recurse=False)):
            if p.shape[0] == num_experts:
                setattr(mod, pname, torch.nn.Parameter(p.detach()[lo:lo + e_local].clone(),
                                                       requires_grad=p.requires_grad))
        # The forward the module had, not its class's: a forward set on the instance (a vendor's fused-MoE
        # kernel swapped in) is what the reference runs, and what each owner rank must run on its experts.
        # The class's, until 2026-12-07: an EP layout then ran other kernels than the reference, silently.
        mod._harness_ep = {"group": group, "ep": ep, "num_experts": num_experts, "local": e_local,
                           "capacity_factor": capacity_factor, "forward": mod.forward, "offset": lo}
        mod.num_experts = e_local
        mod.forward = types.MethodType(ep_forward, mod)
        names.append(name)
    return names
