"""Measurement discipline: what makes one timing sample worth keeping.

* **warm-up** repeats first (allocator pools, lazy kernel selection, page faults), never recorded;
* the backend's **synchronize** before the clock starts and before it stops: device work is
  asynchronous, and without it a timing measures the launch, not the work. A backend whose
  synchronize is not timer-safe (no ``synchronize`` in its torch device module, so
  ``Backend.synchronize`` would silently do nothing) gets no timings at all: :func:`timer_safety`
  says why, and the check reports that instead of a wrong number;
* **repeats within a time budget**: at least ``min_repeats``, then more until ``budget_s`` is spent
  or ``max_repeats`` are taken, so a slow machine still yields enough samples and a fast one does
  not waste the budget;
* the garbage collector is **off** while timing (a collection in the middle of one sample is noise,
  the same choice as timeit and pyperf);
* **CPU affinity and thread count fixed** for the whole measurement (:func:`pinned`) and recorded,
  so two runs use the same cores and the same number of intra-op threads;
* the **host allocator's thresholds fixed** (:func:`steady_allocator`), so a sample's cost does not
  depend on what the process ran before (see there).
"""

from __future__ import annotations

import ctypes
import gc
import os
import resource
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


def timer_safety(backend) -> tuple[bool, str]:
    """(safe, why): can wall-clock timings of this backend's work be trusted?"""
    if backend.device_type == "cpu":
        return True, "cpu: work is synchronous"
    mod = getattr(torch, backend.device_type, None)
    if mod is None or not callable(getattr(mod, "synchronize", None)):
        return False, (f"backend {backend.name}: torch.{backend.device_type} has no synchronize(); "
                       "timings would measure kernel launches, not the work")
    return True, f"torch.{backend.device_type}.synchronize()"


def memory_support(backend) -> tuple[bool, str]:
    """(supported, why): does the backend report a peak-memory figure?"""
    if backend.device_type == "cpu":
        return True, "process peak RSS (VmHWM), reset per phase"
    mod = getattr(torch, backend.device_type, None)
    if mod is None or not callable(getattr(mod, "max_memory_allocated", None)):
        return False, f"backend {backend.name}: torch.{backend.device_type} has no max_memory_allocated()"
    return True, f"torch.{backend.device_type}.max_memory_allocated()"


@dataclass
class Pinning:
    threads: int
    cpus: list[int] = field(default_factory=list)
    note: str = ""
    allocator: str = ""  # what steady_allocator did

    def to_dict(self) -> dict:
        return {"threads": self.threads, "cpus": self.cpus, "note": self.note, "allocator": self.allocator}


@contextmanager
def pinned(threads: int = 0, cpus: list[int] | None = None) -> Iterator[Pinning]:
    """Fix CPU affinity and the intra-op thread count for the block, then restore both.

    ``cpus`` empty: keep the process's current affinity (under pytest-xdist each worker already has
    its share); ``threads`` 0: one thread per CPU in the affinity set."""
    has_aff = hasattr(os, "sched_getaffinity")
    before_aff = sorted(os.sched_getaffinity(0)) if has_aff else []
    before_threads = torch.get_num_threads()
    note = ""
    if cpus and has_aff:
        try:
            os.sched_setaffinity(0, cpus)
        except OSError as e:
            note = f"could not set affinity {cpus}: {e.strerror}"
    elif cpus:
        note = "this OS has no sched_setaffinity; affinity not fixed"
    now = sorted(os.sched_getaffinity(0)) if has_aff else []
    n = threads or max(1, len(now) or (os.cpu_count() or 1))
    torch.set_num_threads(n)
    try:
        yield Pinning(torch.get_num_threads(), now, note)
    finally:
        torch.set_num_threads(before_threads)
        if cpus and has_aff and before_aff:
            try:
                os.sched_setaffinity(0, before_aff)
            except OSError:
                pass


# glibc's mallopt parameters (malloc.h).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 * 2**20  # glibc's own ceiling for the dynamic threshold (64-bit)
TRIM_THRESHOLD = 128 * 2**20


def _glibc():
    try:
        libc = ctypes.CDLL(None)
        version = libc.gnu_get_libc_version
        version.restype = ctypes.c_char_p
        return libc, version().decode()
    except (OSError, AttributeError):
        return None, ""


@contextmanager
def steady_allocator(mode: str = "fixed") -> Iterator[str]:
    """Fix glibc malloc's mmap and trim thresholds for the block; yields what was done, in words.

    Why: glibc serves a block above its *dynamic* mmap threshold (128 KiB at process start) with a
    fresh ``mmap`` and returns it to the kernel on ``free``, so every sample faults its activations'
    pages in again; the threshold only rises when such a block is freed, and the heap's top is
    trimmed back above twice that. Which regime a measurement gets therefore depends on what the
    process ran before. Measured on the llama-3.1-8b perf model (hidden 1024, 1 x 128 tokens, one
    thread): a prefill sample in the first check of a process took ~850 minor page faults and
    2-4% more CPU time than the same sample after another check had run in that process (0 faults),
    and a baseline recorded by a fresh process then read every later process as 4% faster. With
    both thresholds fixed (32 MiB, glibc's ceiling; trim 128 MiB) every process gets the
    warm regime from its first sample. mallopt cannot hand the thresholds back to glibc's dynamic
    rule, so they stay fixed in this worker process; ``malloc_trim(0)`` at the end returns the
    freed heap to the kernel, so the item leaves no extra RSS behind.

    ``mode`` "as-is" leaves the allocator alone. Not glibc (musl, macOS): nothing to fix, said so."""
    if mode != "fixed":
        yield "as-is (not fixed)"
        return
    libc, version = _glibc()
    if libc is None:
        yield "not glibc: allocator thresholds not fixed"
        return
    ok = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    try:
        yield (f"glibc {version}: mmap threshold {MMAP_THRESHOLD >> 20} MiB, trim threshold {TRIM_THRESHOLD >> 20} MiB"
               if ok else f"glibc {version}: mallopt refused; allocator thresholds not fixed")
    finally:
        if ok:
            libc.malloc_trim(0)


def minor_faults() -> int:
    """Minor page faults of this process so far (a diagnostic of the allocator's regime)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


@contextmanager
def gc_off() -> Iterator[None]:
    # Disable only: a full gc.collect() first costs ~1 s with transformers imported, per phase.
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@dataclass
class Budget:
    warmup: int = 2
    min_repeats: int = 5
    max_repeats: int = 50
    budget_s: float = 2.0
    # The clock the budget is spent on: the decision's clock. On the CPU clock a loaded machine
    # still yields the same number of samples (more wall time), instead of 5 samples at load 25
    # where Mann-Whitney's smallest p (1/252) is barely under 0.01.
    clock: Callable[[], float] = time.perf_counter


# A sample function does one repeat of the workload and returns the timings it took (seconds),
# by metric name: one repeat of prefill gives {"prefill_s": ..., "ttft_s": ...}.
SampleFn = Callable[[], dict[str, float]]


def timed(fn: Callable[[], object], sync: Callable[[], None]) -> float:
    """Wall time of ``fn`` with the device drained before and after."""
    sync()
    t = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t


def timed_both(fn: Callable[[], object], sync: Callable[[], None]) -> tuple[float, float]:
    """(wall, process CPU) time of ``fn`` with the device drained before and after.

    The CPU clock counts only the time this process was on a core: on a shared CPU runner, where
    the run queue is 5x longer than the cores, a 140 ms wall-clock prefill varies by 5-7% between
    repeats and by 30% between runs, while its 56 ms of CPU time varies by 0.5% (measured on this
    project's 2-core machine under load 9). With one intra-op thread it is exactly the work done."""
    sync()
    c, t = time.process_time(), time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t, time.process_time() - c


def cpu_key(metric: str) -> str:
    """``prefill_s`` -> ``prefill_cpu_s``: the CPU-clock twin of a wall-clock timing."""
    return metric[:-2] + "_cpu_s"


def collect(sample: SampleFn, budget: Budget, reference: SampleFn | None = None) -> dict[str, list[float]]:
    """Warm up, then repeat ``sample`` within the budget; returns every metric's samples.

    ``reference`` (a calibration kernel) is sampled right before each repeat: its samples come
    back beside the workload's and say how fast the machine was *while* the workload ran, which on
    a shared machine changes within seconds (calibrate.py, decide.py)."""
    out: dict[str, list[float]] = {}
    with gc_off():
        for _ in range(budget.warmup):
            if reference is not None:
                reference()
            sample()
        clock = budget.clock
        start = clock()
        n = 0
        while n < budget.max_repeats and (n < budget.min_repeats or clock() - start < budget.budget_s):
            for fn in (reference, sample):
                if fn is not None:
                    for k, v in fn().items():
                        out.setdefault(k, []).append(v)
            n += 1
    return out


def interleaved(samples: list[SampleFn], repeats: int) -> list[dict[str, list[float]]]:
    """``repeats`` rounds of one sample of each function in turn (a-b-a-b...): slow phases of a
    shared machine then hit every measurement alike. One warm-up round first."""
    outs: list[dict[str, list[float]]] = [{} for _ in samples]
    with gc_off():
        for fn in samples:
            fn()
        for _ in range(repeats):
            for fn, out in zip(samples, outs, strict=True):
                for k, v in fn().items():
                    out.setdefault(k, []).append(v)
    return outs
