"""``hdccl``: the test device's ``torch.distributed`` backend (docs/backends.md, "Testing your backend
before hardware arrives").

What a vendor's collective library is to its device (hccl to npu, nccl to cuda), ``hdccl`` is to
``hdev``: registered with ``torch.distributed.Backend.register_backend("hdccl", ..., devices=["hdev"])``,
so ``init_process_group("hdccl")`` and ``init_device_mesh("hdev", ...)`` reach it. It is a Python
``ProcessGroup`` (torch's own way for an out-of-tree backend written in Python: the pybind trampoline
routes every C++ call - ``dist.*``, the functional collectives DTensor issues, DDP's reducer, FSDP2 -
to the methods below). Each collective copies its ``hdev`` tensors to host memory, runs the same
collective of an inner gloo group on the copies, and copies the results back into the ``hdev``
tensors; tensors already on the CPU go to gloo as they are (exactly gloo's behaviour). Every call is
counted per kind (``collective_counts()``; host-tensor calls under ``"<kind>[cpu]"``), and with
``$TESTDEV_FALLBACK_LOG`` the counts join the process's line at exit.

Collectives complete before they return (their ``Work`` is already done, with a future holding the
outputs, as DDP's comm hooks want); ``send`` is gloo's own asynchronous send of a host copy, ``recv``
a gloo receive into a host buffer copied into the device tensor by ``wait()``, so pipeline stages that
post their sends before their receives do not deadlock.
"""

from __future__ import annotations

import threading
from collections import Counter
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future

NAME = "hdccl"
DEVICE_TYPE = "hdev"

_COUNTS: Counter = Counter()
_LOCK = threading.Lock()  # DDP's reducer calls from autograd's thread


def collective_counts() -> dict[str, int]:
    """``{kind: calls}`` of this process since the last reset: ``all_reduce``, ``all_gather``,
    ``all_gather_into_tensor``, ``reduce_scatter``, ``reduce_scatter_tensor``, ``all_to_all_single``,
    ``all_to_all``, ``broadcast``, ``barrier``, ``send``, ``recv``, ``reduce``, ``gather``,
    ``scatter`` on ``hdev`` tensors; ``"<kind>[cpu]"`` for calls whose tensors were on the host."""
    with _LOCK:
        return dict(_COUNTS)


def reset_collective_counts() -> None:
    with _LOCK:
        _COUNTS.clear()


def _count(kind: str, tensors) -> bool:
    """Counts the call; True when any tensor is on the device (else the call is plain gloo)."""
    on_device = any(t.device.type != "cpu" for t in tensors)
    with _LOCK:
        _COUNTS[kind if on_device else f"{kind}[cpu]"] += 1
    return on_device


def _flat(*groups):
    out = []
    for g in groups:
        for x in g:
            if isinstance(x, torch.Tensor):
                out.append(x)
            else:
                out.extend(_flat(x))
    return out


def _host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of a device tensor (the same tensor when it is on the CPU)."""
    return t if t.device.type == "cpu" else t.detach().to("cpu")


def _back(dev: list[torch.Tensor], host: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for d, h in zip(dev, host, strict=True):
            if d is not h:
                d.copy_(h)


def _done(value) -> dist.Work:
    fut = torch.futures.Future()
    fut.set_result(value)
    return _create_work_from_future(fut)


class _RecvWork(dist.Work):
    """gloo's receive into host buffers; ``wait()`` copies them into the device tensors."""

    def __init__(self, inner: dist.Work, dev: list[torch.Tensor], host: list[torch.Tensor]):
        super().__init__()
        self._inner, self._dev, self._host, self._copied = inner, dev, host, False

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        ok = self._inner.wait(timeout) if timeout else self._inner.wait()
        if not self._copied:
            _back(self._dev, self._host)
            self._copied = True
        return ok

    def get_future(self):
        self.wait()
        return _done(self._dev).get_future()


class HdcclProcessGroup(dist.ProcessGroup):
    """One group of ranks: an inner gloo group on the same store does the moving of bytes."""

    def __init__(self, store, rank: int, size: int, timeout: timedelta):
        super().__init__(rank, size)
        gloo = dist.ProcessGroupGloo(dist.PrefixStore(f"{NAME}-gloo/", store), rank, size, timeout)
        # The host copies go through a C++ ProcessGroup over gloo: its methods dispatch the c10d ops
        # (c10d::allreduce_, ...), so dispatch modes - harness's CommCounter, MemTracker - see every
        # collective as they do under gloo (this Python group's own methods are reached by the pybind
        # trampoline, past the dispatcher).
        self._gloo = dist.ProcessGroup(store, rank, size)
        self._gloo._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        self._gloo._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
        # A Python ProcessGroup has no C++ backend of its own, and the group's name (which the
        # functional collectives resolve it by) is kept on its backends: gloo is registered as the CPU
        # one. Every collective still reaches the methods below first.
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)

    def getBackendName(self) -> str:
        return NAME

    def __repr__(self) -> str:
        return f"HdcclProcessGroup(rank={self.rank()}, size={self.size()})"

    # --- the pattern: host copies in, gloo, host results back ---------------------------------
    def _run(self, kind: str, inputs: list, outputs: list, call, value):
        """``call(host_inputs, host_outputs)`` issues the gloo collective on host copies (the device
        tensors themselves when on the CPU: then gloo's own Work is returned); results are copied back
        into ``outputs``; the returned Work is complete, its future holding ``value``."""
        if not _count(kind, _flat(inputs, outputs)):
            return call(inputs, outputs)
        h_in = [_host(t) for t in inputs]
        # an output that is also an input (in place: all_reduce, broadcast) shares its host copy
        ids = {id(t): h for t, h in zip(inputs, h_in, strict=True)}
        h_out = [ids[id(t)] if id(t) in ids else t if t.device.type == "cpu" else torch.empty_like(t, device="cpu")
                 for t in outputs]
        call(h_in, h_out).wait()
        _back(outputs, h_out)
        return _done(value)

    # --- all-reduce ---------------------------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        opts = opts or dist.AllreduceOptions()
        return self._run("all_reduce", tensors, tensors, lambda i, _o: self._gloo.allreduce(i, opts), tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        opts = opts or dist.AllreduceCoalescedOptions()
        return self._run("all_reduce", tensors, tensors, lambda i, _o: self._gloo.allreduce_coalesced(i, opts),
                         tensors)

    # --- all-gather ---------------------------------------------------------------------------
    def allgather(self, output_lists, inputs, opts=None):
        opts = opts or dist.AllgatherOptions()
        shape = [len(x) for x in output_lists]

        def call(i, o):
            it = iter(o)
            return self._gloo.allgather([[next(it) for _ in range(n)] for n in shape], i, opts)

        return self._run("all_gather", inputs, _flat(output_lists), call, output_lists)

    def all_gather_single(self, output, input, opts=None):
        opts = opts or dist.AllgatherOptions()
        return self._run("all_gather_into_tensor", [input], [output],
                         lambda i, o: self._gloo._allgather_base(o[0], i[0], opts), [output])

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        for o, i in zip(outputs, inputs, strict=True):
            self.all_gather_single(o, i, opts)
        return _done(outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    # --- reduce-scatter -----------------------------------------------------------------------
    def reduce_scatter(self, outputs, input_lists, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        shape = [len(x) for x in input_lists]

        def call(i, o):
            it = iter(i)
            return self._gloo.reduce_scatter(o, [[next(it) for _ in range(n)] for n in shape], opts)

        return self._run("reduce_scatter", _flat(input_lists), outputs, call, outputs)

    def reduce_scatter_single(self, output, input, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        return self._run("reduce_scatter_tensor", [input], [output],
                         lambda i, o: self._gloo._reduce_scatter_base(o[0], i[0], opts), [output])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        for o, i in zip(outputs, inputs, strict=True):
            self.reduce_scatter_single(o, i, opts)
        return _done(outputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # --- all-to-all ---------------------------------------------------------------------------
    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        opts = opts or dist.AllToAllOptions()
        return self._run("all_to_all_single", [input], [output],
                         lambda i, o: self._gloo.alltoall_base(o[0], i[0], output_split_sizes, input_split_sizes,
                                                               opts), [output])

    alltoall_base = all_to_all_single

    def alltoall(self, outputs, inputs, opts=None):
        opts = opts or dist.AllToAllOptions()
        return self._run("all_to_all", inputs, outputs, lambda i, o: self._gloo.alltoall(o, i, opts), outputs)

    # --- rooted -------------------------------------------------------------------------------
    def broadcast(self, tensors, opts=None):
        opts = opts or dist.BroadcastOptions()
        return self._run("broadcast", tensors, tensors, lambda i, _o: self._gloo.broadcast(i, opts), tensors)

    def reduce(self, tensors, opts=None):
        opts = opts or dist.ReduceOptions()
        return self._run("reduce", tensors, tensors, lambda i, _o: self._gloo.reduce(i, opts), tensors)

    def gather(self, output_lists, inputs, opts=None):
        opts = opts or dist.GatherOptions()
        shape = [len(x) for x in output_lists]

        def call(i, o):
            it = iter(o)
            return self._gloo.gather([[next(it) for _ in range(n)] for n in shape], i, opts)

        return self._run("gather", inputs, _flat(output_lists), call, output_lists)

    def scatter(self, outputs, input_lists, opts=None):
        opts = opts or dist.ScatterOptions()
        shape = [len(x) for x in input_lists]

        def call(i, o):
            it = iter(i)
            return self._gloo.scatter(o, [[next(it) for _ in range(n)] for n in shape], opts)

        return self._run("scatter", _flat(input_lists), outputs, call, outputs)

    def barrier(self, opts=None):
        with _LOCK:
            _COUNTS["barrier"] += 1
        return self._gloo.barrier(opts or dist.BarrierOptions())

    # --- point to point -----------------------------------------------------------------------
    def send(self, tensors, dst: int, tag: int = 0):
        _count("send", tensors)
        return self._gloo.send([_host(t) for t in tensors], dst, tag)  # the copy lives in gloo's Work

    def recv(self, tensors, src: int, tag: int = 0):
        if not _count("recv", tensors):
            return self._gloo.recv(tensors, src, tag)
        host = [torch.empty_like(t, device="cpu") for t in tensors]
        return _RecvWork(self._gloo.recv(host, src, tag), list(tensors), host)


def _create(store, rank: int, size: int, timeout: timedelta) -> HdcclProcessGroup:
    return HdcclProcessGroup(store, rank, size, timeout)


def register() -> None:
    if NAME not in dist.Backend.backend_list:
        dist.Backend.register_backend(NAME, _create, extended_api=False, devices=[DEVICE_TYPE])


register()
