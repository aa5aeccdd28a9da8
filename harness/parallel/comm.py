"""Collectives issued by one rank: counts and bytes per kind, and a live status.

``CommDebugMode`` (torch.distributed.tensor.debug) counts the c10d and functional collectives a
rank issues, DTensor's redistributions included (it lets DTensor desugar first). Used as is, it
also installs a module tracker whose multi-grad hooks break the pipeline schedule's partial
backward ("A leaf node was passed to _will_engine_execute_node"), and it does not size what it
counts. So ``CommCounter`` is a dispatch mode of its own over CommDebugMode's tables of collective
ops, with CommDebugMode's DTensor rule; it adds the bytes of every collective's input and, for the
hang report, writes the collective a rank is in to its status file (cleared by the next compute
op: a rank stuck in ``work.wait()`` issues none). Point-to-point ``send``/``recv`` (pipeline
stages) are not collectives and are not counted.
DDP's bucketed all-reduces run in its C++ reducer, outside Python: registering the default
all-reduce as a Python comm hook (``ddp_counting_hook``) routes them through the dispatcher, where
the mode sees them like any other collective.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug._comm_mode import NATIVE_TO_PY_MAPPING, c10d_collective_ops
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

_COMM = set(c10d_collective_ops) | set(NATIVE_TO_PY_MAPPING) | set(NATIVE_TO_PY_MAPPING.values())


def _kind(packet) -> str:
    """allreduce_ / all_reduce -> all_reduce; the names a reader knows."""
    n = packet.__name__.strip("_")
    return {"allreduce": "all_reduce", "allgather": "all_gather", "allgather_into_tensor_coalesced":
            "all_gather", "allgather_base": "all_gather", "all_gather_into_tensor": "all_gather",
            "all_gather_into_tensor_coalesced": "all_gather", "reduce_scatter_base": "reduce_scatter",
            "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
            "alltoall_base": "all_to_all", "all_to_all_single": "all_to_all", "alltoall": "all_to_all",
            "allreduce_coalesced": "all_reduce", "all_reduce_coalesced": "all_reduce"}.get(n, n)


class CommCounter(TorchDispatchMode):
    """Counts and bytes per collective kind; ``on_collective(name or '')``."""

    def __init__(self, on_collective: Callable[[str], None] | None = None):
        super().__init__()
        self.bytes: dict[str, int] = defaultdict(int)
        self.counts: dict[str, int] = defaultdict(int)
        self._on = on_collective
        self._in = ""

    def add(self, kind: str, nbytes: int) -> None:
        self.counts[kind] += 1
        self.bytes[kind] += nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t == DTensor for t in types):
            return NotImplemented  # let DTensor desugar into collectives first (CommDebugMode's rule)
        packet = getattr(func, "_overloadpacket", None)
        if packet in _COMM:
            kind = _kind(packet)
            # Input bytes: what this rank contributes (for all_gather: its shard).
            first = next((t for t in tree_leaves(args) if isinstance(t, torch.Tensor)), None)
            nbytes = sum(t.numel() * t.element_size() for t in tree_leaves(args[:1]) if isinstance(t, torch.Tensor))
            if first is not None:
                self.add(kind, nbytes)
            if self._on:
                self._in = kind
                self._on(kind)
        elif self._in and packet is not None and packet.__name__ != "wait_tensor":
            self._in = ""
            if self._on:
                self._on("")
        return func(*args, **(kwargs or {}))

    def summary(self) -> dict[str, dict[str, int]]:
        return {k: {"count": self.counts[k], "bytes": self.bytes[k]} for k in sorted(self.counts)}


def ddp_counting_hook(counter: CommCounter):
    """DDP's default all-reduce (average) as a Python comm hook, so that ``counter`` sees it."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    return allreduce_hook
