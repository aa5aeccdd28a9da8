"""Step time, time inside collectives and *exposed* communication of a layout, on its ranks.

Measured after the numerics step on the same parallelized model, in repeats of its own
(``warm-up -> timed repeats -> one profiled repeat``), so the timed samples carry no profiler:

* **step time**: forward, backward and the gradient reductions (a training step before its
  optimizer), each repeat started together on every rank (a barrier); the layout's time of a repeat
  is its slowest rank's (the host takes the max over ranks);
* **time inside collectives**: the union of the collective library's own intervals in the profiled
  repeat - on the host its work records (``gloo:all_reduce`` on gloo's threads, issue to completion),
  on a device its kernels (nccl / rccl / hccl / mccl / cncl / xccl);
* **exposed communication**: the part of that union during which the rank computes nothing - no
  other kernel on the device, or, on the host, no operator on the thread that runs the step (a
  collective's own wait, ``wait_tensor``, is not compute). Communication overlapped with compute
  costs nothing until it outlasts the compute beside it, so this is what a faster link would save.
  On the host, Python between two operators counts as not computing: an upper bound there.

Beside them, once per launch: the same global batch's step on one rank (``single_step``; the
others wait in a barrier) for the scaling efficiency ``T1 / (world x Tn)``, and the bus bandwidth
of a 1 MiB all-reduce over the launch's ranks (``probe_busbw``) and the latency of a one-element
all-reduce (``probe_latency``), which with T1 calibrate ``harness plan``'s step model to this machine
(the check compares its estimate with the measured step).
"""

from __future__ import annotations

import re
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

# Device kernels of a collective library (the vendors' names for their NCCL).
COMM_KERNEL = re.compile(r"nccl|rccl|hccl|mccl|cncl|xccl|bkcl|ccl_", re.IGNORECASE)
# Host-side records of communication that are not compute: the issue and the waits.
HOST_COMM = re.compile(r"^(c10d::|_c10d_functional::|c10d_functional::|record_param_comms|"
                       r"(gloo|nccl|hccl|mpi|ucc|xccl|mccl|cncl):)")
PROBE_BYTES = 1 << 20


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def time_steps(one: Callable[[], None], device: torch.device, *, repeats: int, barrier: bool = True) -> list[float]:
    """``repeats`` calls of ``one`` after a warm-up, each started together with the other ranks
    (``barrier``; off for a step one rank runs alone); this rank's seconds each."""
    one()  # warm: first-call costs (DTensor dispatch caches, allocator) are not the step's
    _sync(device)
    out = []
    for _ in range(repeats):
        if barrier:
            dist.barrier()
        t = time.perf_counter()
        one()
        _sync(device)
        out.append(time.perf_counter() - t)
    return out


def profile_step(one: Callable[[], None], device: torch.device, collective: str) -> dict:
    """One barrier-aligned call of ``one`` under torch.profiler: its wall time, the time inside
    collectives and the exposed part (module docstring), in seconds."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    dev = {"cuda": "CUDA", "xpu": "XPU"}.get(device.type, "PrivateUse1" if device.type != "cpu" else None)
    if dev is not None and hasattr(ProfilerActivity, dev):
        activities.append(getattr(ProfilerActivity, dev))
    dist.barrier()
    with profile(activities=activities) as prof:
        t = time.perf_counter()
        one()
        _sync(device)
        wall = time.perf_counter() - t
    comm, exposed, where = comm_intervals(prof.events(), collective)
    return {"wall_s": wall, "comm_s": comm, "exposed_s": exposed, "measured_on": where}


def comm_intervals(events, collective: str) -> tuple[float, float, str]:
    """(time inside collectives, exposed part, "device" | "host" | "host waits") from profiler
    events, seconds. Device kernels where the profiler reports them; else the host's records."""
    kernels = [e for e in events if _on_device(e)]
    if kernels:
        comm = [_span(e) for e in kernels if COMM_KERNEL.search(e.name)]
        busy = [_span(e) for e in kernels if not COMM_KERNEL.search(e.name)]
        return _length(comm) / 1e6, _minus(comm, busy) / 1e6, "device"
    host = [e for e in events if not _on_device(e)]
    work = [_span(e) for e in host if e.name.startswith(f"{collective}:")]
    main = _main_thread(host)
    # The step's thread computes while it runs an operator. Not while inside a record that encloses
    # waits as well as operators (FSDP::all_gather, autograd's per-node records, module ranges), nor
    # inside its communication records (the issue, wait_tensor).
    ops = [_span(e) for e in host if e.thread == main and _is_operator(e.name)]
    waits = [_span(e) for e in host if e.thread == main and HOST_COMM.match(e.name)]
    busy = _subtract_intervals(ops, waits)
    if work:
        return _length(work) / 1e6, _minus(work, busy) / 1e6, "host"
    # A collective library that records nothing of its own work: its waits are what is known.
    return _length(waits) / 1e6, _minus(waits, busy) / 1e6, "host waits"


_NOT_OPERATORS = ("autograd::", "FSDP::", "fsdp::", "DDP::", "Optimizer.", "ProfilerStep", "nn.Module", "PipelineStage",
                  "## ", "[memory]")


def _is_operator(name: str) -> bool:
    """A dispatcher operator (``aten::mm``, a vendor's ``npu::...``), not an annotation."""
    return "::" in name and not HOST_COMM.match(name) and not name.startswith(_NOT_OPERATORS)


def _on_device(e) -> bool:
    return getattr(e, "device_type", None) is not None and str(e.device_type) != "DeviceType.CPU"


def _span(e) -> tuple[float, float]:
    return float(e.time_range.start), float(e.time_range.end)


def _main_thread(host) -> int | None:
    """The thread that ran the step: the one with the most operator time (gloo's work runs on its
    own threads)."""
    per: dict = {}
    for e in host:
        if _is_operator(e.name):
            per[e.thread] = per.get(e.thread, 0.0) + (e.time_range.end - e.time_range.start)
    return max(per, key=per.get) if per else None


def _union(iv: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(x for x in iv if x[1] > x[0]):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(iv) -> float:
    return sum(b - a for a, b in _union(iv))


def _subtract_intervals(a, b) -> list[tuple[float, float]]:
    """union(a) less union(b), as intervals."""
    out, bs = [], _union(b)
    for s, e in _union(a):
        cur = s
        for bs_, be in bs:
            if be <= cur or bs_ >= e:
                continue
            if bs_ > cur:
                out.append((cur, bs_))
            cur = max(cur, be)
            if cur >= e:
                break
        if cur < e:
            out.append((cur, e))
    return out


def _minus(a, b) -> float:
    """Length of union(a) outside union(b)."""
    return sum(e - s for s, e in _subtract_intervals(a, b))


def _all_reduce_s(numel: int, device: torch.device, repeats: int) -> float:
    """Median seconds of an all-reduce of ``numel`` float32 over every rank of the launch, each
    repeat started at a barrier, after a warm-up."""
    x = torch.ones(numel, dtype=torch.float32, device=device)
    dist.all_reduce(x)
    times = []
    for _ in range(repeats):
        dist.barrier()
        t = time.perf_counter()
        dist.all_reduce(x)
        _sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def probe_busbw(device: torch.device, world: int, repeats: int = 5) -> float:
    """Bus bandwidth (bytes/s, nccl-tests' definition: algbw x 2 (n-1) / n) of a 1 MiB all-reduce
    over every rank of the launch, median of ``repeats`` after a warm-up."""
    return PROBE_BYTES / _all_reduce_s(PROBE_BYTES // 4, device, repeats) * 2 * (world - 1) / world


def probe_latency(device: torch.device, repeats: int = 20) -> float:
    """Seconds of a one-element all-reduce over every rank of the launch (the alpha of the
    alpha-beta model: what a collective costs before its bytes), median of ``repeats`` after a
    warm-up. Measured here with gloo on a 2-core CPU: 0.1-0.3 ms at 2 ranks."""
    return _all_reduce_s(1, device, repeats)


def summarize(ranks: list[dict]) -> dict:
    """The layout's figures from every rank's ``timing`` record: per repeat the slowest rank, median
    over repeats; comm and exposed of the worst rank."""
    steps = [max(r["step_s"][i] for r in ranks) for i in range(min(len(r["step_s"]) for r in ranks))]
    out = {"step_s": statistics.median(steps), "steps_s": steps,
           "comm_s": max(r["profile"]["comm_s"] for r in ranks),
           "exposed_s": max(r["profile"]["exposed_s"] for r in ranks),
           "profiled_wall_s": max(r["profile"]["wall_s"] for r in ranks),
           "measured_on": ranks[0]["profile"]["measured_on"]}
    single = [r["single_step_s"] for r in ranks if r.get("single_step_s")]
    if single:
        out["single_step_s"] = single[0]
    bw = [r["probe_busbw"] for r in ranks if r.get("probe_busbw")]
    if bw:
        out["probe_busbw"] = min(bw)
    lat = [r["probe_latency_s"] for r in ranks if r.get("probe_latency_s")]
    if lat:
        out["probe_latency_s"] = max(lat)
    return out
