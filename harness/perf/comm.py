"""Collective bandwidth of a backend's communication library, as nccl-tests measures it (issue #30).

One launch of ``world`` ranks (``torch.distributed.run``, the backend's collective library: gloo on
CPU, nccl, hccl, ...; on the CPU each rank pinned to a core of its own where there are enough) times
each collective at each message size: ``warmup`` untimed rounds, then ``repeats`` timed ones, a round
being one call of every collective at every size, each call started together (a barrier) and ended
when the backend has finished (``synchronize``); a call's time is the slowest rank's (one all-reduce of the per-rank times after
the loop, so the timing itself has no extra collective inside it).

Bandwidths follow nccl-tests' PERFORMANCE.md: ``size`` is the buffer nccl-tests names (all-reduce and
broadcast: the tensor; all-gather: the gathered output; reduce-scatter: the input; all-to-all: one
rank's send buffer; send/recv: the message), ``algbw = size / time`` and ``busbw = algbw x factor``
with factor 2(n-1)/n for all-reduce, (n-1)/n for all-gather, reduce-scatter and all-to-all, 1 for
broadcast and send/recv: the rate each link carries, comparable across world sizes and collectives.

With ``pair_bytes``, every pair of ranks also times round trips of that many bytes (``pair/<i>-<j>``,
one pair at a time): a slow link between two nodes shows there, named by the ranks and their hosts.

Run as ``python -m torch.distributed.run ... -m harness.perf.comm SPEC.json``; rank 0 writes the
samples (and every rank's host) to the spec's ``out`` before the process group is torn down (a teardown abort after that is
told apart from a failure by the caller).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv")


def bus_factor(collective: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factor for ``n`` ranks."""
    if collective == "all_reduce":
        return 2 * (n - 1) / n
    if collective in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0


def bandwidths(collective: str, size_bytes: int, seconds: float, n: int) -> tuple[float, float]:
    """(algbw, busbw) in bytes/s."""
    alg = size_bytes / seconds if seconds > 0 else float("nan")
    return alg, alg * bus_factor(collective, n)


def _op(collective: str, size_bytes: int, dtype, device, rank: int, n: int):
    """A zero-argument function doing one call of ``collective`` on ``size_bytes`` (nccl-tests' size)."""
    import torch
    import torch.distributed as dist

    elem = torch.empty((), dtype=dtype).element_size()
    count = max(n, size_bytes // elem // n * n)  # divisible by the world size
    if collective == "all_reduce":
        x = torch.ones(count, dtype=dtype, device=device)
        return lambda: dist.all_reduce(x)
    if collective == "all_gather":
        out = torch.empty(count, dtype=dtype, device=device)
        x = torch.ones(count // n, dtype=dtype, device=device)
        return lambda: dist.all_gather_into_tensor(out, x)
    if collective == "reduce_scatter":
        x = torch.ones(count, dtype=dtype, device=device)
        out = torch.empty(count // n, dtype=dtype, device=device)
        if dist.get_backend() == "gloo":  # gloo has no reduce_scatter_tensor: all-reduce, keep this rank's part
            return lambda: (dist.all_reduce(x), out.copy_(x[rank * (count // n):(rank + 1) * (count // n)]))
        return lambda: dist.reduce_scatter_tensor(out, x)
    if collective == "all_to_all":
        x = torch.ones(count, dtype=dtype, device=device)
        out = torch.empty(count, dtype=dtype, device=device)
        return lambda: dist.all_to_all_single(out, x)
    if collective == "broadcast":
        x = torch.ones(count, dtype=dtype, device=device)
        return lambda: dist.broadcast(x, src=0)
    if collective == "send_recv":  # rank 0 -> 1; the others wait at the barrier
        x = torch.ones(count, dtype=dtype, device=device)
        if rank == 0:
            return lambda: dist.send(x, dst=1)
        if rank == 1:
            return lambda: dist.recv(x, src=0)
        return lambda: None
    raise ValueError(f"unknown collective {collective!r}; known: {', '.join(COLLECTIVES)}")


# the torch.distributed call behind each collective (comm.py ``_op``)
LIBRARY_CALL = {"all_reduce": ("all_reduce",), "all_gather": ("all_gather_into_tensor",),
                "reduce_scatter": ("reduce_scatter_tensor",), "all_to_all": ("all_to_all_single",),
                "broadcast": ("broadcast",), "send_recv": ("send", "recv")}


def _slow_library(delay: dict) -> None:
    """Tests: ``{collective: "50%"}`` makes the library's call of that collective so much slower
    (a sleep of that share of each call's own time), ``{collective: "0.01s"}`` that many seconds
    slower per call, in this rank: whatever is built on the call slows with it, as a slower library
    would (on gloo, reduce_scatter is measured as an all_reduce)."""
    import torch.distributed as dist

    for coll, v in delay.items():
        if not (isinstance(v, str) and v.endswith(("%", "s"))):
            continue
        share, fixed = (float(v[:-1]) / 100, 0.0) if v.endswith("%") else (0.0, float(v[:-1]))
        for name in LIBRARY_CALL[coll]:
            def slowed(*a, _fn=getattr(dist, name), _share=share, _fixed=fixed, **k):
                t0 = time.perf_counter()
                out = _fn(*a, **k)
                time.sleep((time.perf_counter() - t0) * _share + _fixed)
                return out

            setattr(dist, name, slowed)


def _pin(device_type: str, local_rank: int, n: int) -> int | None:
    """On the CPU, rank r on its own core when there are cores enough (as nccl-tests binds ranks):
    left to the scheduler, two ranks sometimes share a core and a small message's latency doubles
    for that whole launch. The core, or None where not pinned."""
    if device_type != "cpu" or not hasattr(os, "sched_setaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    if n > len(cores):
        return None
    os.sched_setaffinity(0, {cores[local_rank]})
    return cores[local_rank]


def _pairs(nbytes: int, warmup: int, repeats: int, dtype, device, sync, rank: int, n: int) -> dict[str, list[float]]:
    """Round trips of ``nbytes`` between every pair of ranks (``pair/<i>-<j>``), one pair at a time (the
    others wait at the barrier): a slow link shows in the pairs that cross it, which the collectives,
    each over every rank, average away. Times are the first rank's; the others record zeros (the
    caller's MAX over ranks keeps the first's)."""
    import torch
    import torch.distributed as dist

    elem = torch.empty((), dtype=dtype).element_size()
    x = torch.ones(max(1, nbytes // elem), dtype=dtype, device=device)
    out: dict[str, list[float]] = {}
    for i in range(n):
        for j in range(i + 1, n):
            ts = []
            for k in range(warmup + repeats):
                dist.barrier()
                sync()
                t0 = time.perf_counter()
                if rank == i:
                    dist.send(x, dst=j)
                    dist.recv(x, src=j)
                elif rank == j:
                    dist.recv(x, src=i)
                    dist.send(x, dst=i)
                sync()
                if k >= warmup:
                    ts.append(time.perf_counter() - t0 if rank == i else 0.0)
            out[f"pair/{i}-{j}"] = ts
    return out


def worker(spec: dict) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group(spec["backend"])
    rank, n = dist.get_rank(), dist.get_world_size()
    device_type = spec.get("device_type", "cpu")
    mod = getattr(torch, device_type, None) if device_type != "cpu" else None
    if mod is not None and hasattr(mod, "set_device"):
        mod.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    device = torch.device(device_type, int(os.environ.get("LOCAL_RANK", rank))) if mod is not None else "cpu"
    sync = (lambda: mod.synchronize()) if mod is not None and hasattr(mod, "synchronize") else (lambda: None)
    dtype = getattr(torch, spec.get("dtype", "float32"))
    # tests: {collective: seconds} of extra time inside that collective's timed call, or {collective:
    # "50%"}: the library's call itself that much slower (_slow_library)
    delay = spec.get("delay") or {}
    out: dict = {"world": n, "backend": spec["backend"], "dtype": spec.get("dtype", "float32"), "samples": {},
                 "pinned": _pin(device_type, int(os.environ.get("LOCAL_RANK", rank)), n)}
    calls = {f"{coll}/{int(size)}": (_op(coll, int(size), dtype, device, rank, n), delay.get(coll, 0.0))
             for coll in spec["collectives"] for size in spec["sizes"]}
    calls = {k: (fn, float(v) if isinstance(v, int | float) else 0.0) for k, (fn, v) in calls.items()}
    times: dict[str, list[float]] = {k: [] for k in calls}
    _slow_library(delay)  # after the ops are built, before anything is timed
    # Rounds: every collective and size once per round, round after round. A disturbance of the
    # machine (another process, a frequency step) then lands on every key's samples alike instead of
    # on all the repeats of the one key measured at that moment (measured: 5 of 10 clean launches
    # flagged one collective when each key's repeats ran back to back).
    for i in range(spec["warmup"] + spec["repeats"]):
        for key, (fn, extra) in calls.items():
            dist.barrier()
            sync()
            t0 = time.perf_counter()
            fn()
            if extra:
                time.sleep(extra)
            sync()
            if i >= spec["warmup"]:
                times[key].append(time.perf_counter() - t0)
    if spec.get("pair_bytes"):
        times.update(_pairs(int(spec["pair_bytes"]), spec["warmup"], spec["repeats"], dtype, device, sync, rank, n))
    for key, ts in times.items():
        t = torch.tensor(ts, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a call lasts as long as its slowest rank
        out["samples"][key] = t.tolist()
    hosts: list = [None] * n
    dist.all_gather_object(hosts, socket.gethostname())
    out["hosts"] = hosts
    if rank == 0:
        from harness.files import atomic

        # whole or absent: the caller reads it as the verdict; a relative path is in the launch's folder
        # (on a multi-node launch, this node's own: the launch layer brings rank 0's files back)
        path = os.path.join(os.path.dirname(os.path.abspath(sys.argv[1])), spec["out"])
        os.makedirs(os.path.dirname(path), exist_ok=True)
        atomic.write_json(path, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    worker(json.loads(Path(sys.argv[1]).read_text()))
