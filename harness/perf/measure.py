"""The perf check's measuring steps as library functions (harness/checks/perf.py calls them): the
decision's clock, the perf model and its workload, one timed phase, the profiled repeats and the
roofline figures. What they measure comes back as values; the check records them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from harness.models.build import torch_dtype
from harness.perf import calibrate as calib
from harness.perf import roofline, stats
from harness.perf.timing import Budget, collect, cpu_key, interleaved, minor_faults, pinned, timed_both
from harness.perf.workload import Workload, perf_model_config

# The timings the check decides, per phase (harness/compare/perfverdict.py keeps the same table).
TIMED = {"prefill": ("prefill_s", "ttft_s"), "decode": ("decode_token_s",), "train": ("train_step_s",)}
PHASE_OF = {m: ph for ph, ms in TIMED.items() for m in ms}
CLOCK_NOTE = "perf: clock = 'cpu' needs the cpu backend; wall clock used"


def samples_key(clock: str, metric: str) -> str:
    """The samples the decision reads for a metric: its CPU-clock twin when the clock is cpu."""
    return cpu_key(metric) if clock == "cpu" else metric


def decision_clock(clock: str, device_type: str, threads: int) -> tuple[str, str | None]:
    """The clock the decision (and the roofline) uses, and a note where the configured one cannot
    be: process CPU time on a CPU backend with one intra-op thread (timing.timed_both says why),
    wall time everywhere else."""
    cpu_ok = device_type == "cpu" and threads == 1
    chosen = clock if clock != "auto" else ("cpu" if cpu_ok else "wall")
    if chosen == "cpu" and device_type != "cpu":
        return "wall", CLOCK_NOTE
    return chosen, None


def phase_budget(cfg, clock: str) -> Budget:
    """Warm-up, repeats and time budget of each phase, on the decision's clock."""
    return Budget(cfg.warmup, cfg.min_repeats, cfg.max_repeats, cfg.budget_s,
                  time.process_time if clock == "cpu" else time.perf_counter)


def workload(suite, cfg, dtype: str, backend, batch: int, seq: int, transform=None) -> tuple[Workload, dict]:
    """The perf-sized model and its inputs (``transform(model)`` applied after the build: the
    detection benchmark's injected slowdowns), with the workload's identity a baseline must share."""
    mc = perf_model_config(suite, cfg.width, cfg.layers, cfg.prune)
    wl = Workload(suite, mc, dtype, backend, batch, seq, cfg.decode_tokens, cfg.seed,
                  cpu_clock=backend.device_type == "cpu")
    if transform is not None:
        transform(wl.model)
    shape = {"batch": batch, "seq": seq, "decode_tokens": cfg.decode_tokens, "width": cfg.width,
             "layers": cfg.layers, "prune": cfg.prune, "parameters": wl.parameters}
    return wl, shape


def calibration(backend, dtype: str, cfg, clock: str) -> tuple[calib.Kernels, dict]:
    """The calibration kernels and their figures, in the run's dtype and on the decision's clock."""
    return calib.calibrate(backend, torch_dtype(dtype), dtype, Budget(1, 7, 40, cfg.calibration_budget_s),
                           clock=clock, min_sample_s=cfg.kernel_sample_s, size=cfg.kernel_size)


@dataclass
class PhaseFigures:
    samples: dict[str, list[float]]  # metric -> samples (wall and, on a CPU, the process-clock twin)
    reference: dict[str, list[float]]  # the phase's calibration kernel, interleaved with its samples
    faults: float | None  # host minor page faults per repeat, warm-up included (None: no repeat)
    peak_bytes: int | None  # peak device memory (None: not measurable here)


def measure_phase(backend, sample, budget: Budget, kernel, mem_ok: bool) -> PhaseFigures:
    """One phase timed within ``budget``, interleaved with its reference ``kernel``."""
    if mem_ok:
        backend.reset_peak_memory()
    f0 = minor_faults()
    got = collect(sample, budget, reference=kernel)
    n = max((len(v) for v in got.values()), default=0)
    # warm-up included: faults that keep coming every repeat say the allocator is cold
    faults = (minor_faults() - f0) / n if n else None
    ref = {k: got.pop(k) for k in list(got) if k.startswith("calib_")}
    return PhaseFigures(got, ref, faults, backend.peak_memory() if mem_ok else None)


def phase_samplers(wl: Workload) -> dict:
    return {"prefill": wl.prefill_sample, "decode": wl.decode_sample, "train": wl.train_sample}


def profile_phases(wl: Workload, backend, phases: list[str], repeats: int) -> dict[str, dict]:
    """Operators, modules and the tensor-memory peak of each phase (harness/perf/profile.py), in
    repeats of their own: the profiler's overhead never reaches a timed sample. {} for 0 repeats."""
    from harness.perf.profile import profile_phase

    out: dict[str, dict] = {}
    if repeats <= 0:
        return out
    fns = phase_samplers(wl)
    for phase in phases:
        if phase == "decode" and "prefill" not in phases:
            wl.prefill_sample()  # the decode needs a prompt in the cache
        out[phase] = profile_phase(fns[phase], wl.model, backend, repeats)
        if phase == "train":
            wl.release_training()
    return out


@dataclass
class Roofline:
    work: roofline.Work
    roof: dict  # clock, peaks and their sources, the work, the fractions (MFU / MBU)
    figures: dict[str, float]  # metric -> value, in recording order: fractions, throughputs, medians


def roofline_figures(suite, wl: Workload, cfg, dtype: str, batch: int, seq: int, samples: dict, clock: str,
                     cal: dict) -> Roofline:
    """MFU / MBU of each phase from harness.inspect's FLOPs and bytes and the peaks (declared, else
    the calibration kernels'), on the decision's clock; tokens per second on the wall clock."""
    med = {m: stats.summarize(v).median for m, v in samples.items()}
    w = roofline.work_for_model(suite, wl.mc, batch, seq, cfg.decode_tokens, dtype)
    declared = cfg.peak_flops.get(dtype)
    peak_f = declared or cal["matmul_flops_per_s"]
    peak_b = cfg.peak_bandwidth or cal["copy_bytes_per_s"]
    roof = {"clock": clock, "peak_flops_per_s": peak_f,
            "peak_flops_source": "declared" if declared else "calibration matmul",
            "peak_bytes_per_s": peak_b,
            "peak_bytes_source": "declared" if cfg.peak_bandwidth else "calibration copy",
            "work": w.to_dict(), "fractions": {}}
    tokens = batch * seq
    pairs = {"prefill_mfu": (w.prefill_flops, "prefill_s", peak_f),
             "decode_mfu": (w.decode_flops_per_step, "decode_token_s", peak_f),
             "decode_mbu": (w.decode_bytes_per_step, "decode_token_s", peak_b),
             "train_mfu": (w.train_flops, "train_step_s", peak_f)}
    for name, (amount, m, peak) in pairs.items():
        k = samples_key(clock, m)
        if k in med:
            f = roofline.fraction(amount, med[k], peak)
            if f is not None:
                roof["fractions"][name] = f
    figures = dict(roof["fractions"])
    for name, m, n in (("prefill_tokens_per_s", "prefill_s", tokens),
                       ("decode_tokens_per_s", "decode_token_s", batch),
                       ("train_tokens_per_s", "train_step_s", tokens)):
        if m in med and med[m] > 0:
            figures[name] = n / med[m]  # what a user sees: wall clock
    return Roofline(w, roof, figures | med)


def interleaved_medians(backend, fns: list, repeats: int) -> tuple[list[float], str]:
    """Each callable's median time over ``repeats`` samples, the callables interleaved (a-b-a-b: a slow
    spell of the machine shows up in all), and the clock in words: on a CPU with one intra-op thread
    and on the process CPU clock, as the perf check decides; elsewhere wall time, synchronized."""
    cpu = backend.device_type == "cpu"
    sync = backend.synchronize

    def sampler(fn):
        def sample():
            wall, proc = timed_both(fn, sync)
            return {"s": proc if cpu else wall}

        return sample

    with pinned(1 if cpu else 0):
        got = interleaved([sampler(fn) for fn in fns], repeats)
    return [stats.summarize(g["s"]).median for g in got], ("process CPU time, 1 thread" if cpu
                                                          else "wall time, synchronized")


def peak_memory(backend, fns: dict) -> dict[str, int]:
    """key -> the peak device memory of one call of ``fns[key]`` (where the backend reports one)."""
    out = {}
    for key, fn in fns.items():
        backend.reset_peak_memory()
        fn()
        peak = backend.peak_memory()
        if peak is not None:
            out[key] = peak
    return out
