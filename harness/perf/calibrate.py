"""Calibration kernels, measured in the same run as the model: how fast is this machine *now*?

Three reference kernels with a known amount of work, in the run's dtype:

* ``matmul``: ``[m, k] @ [k, n]`` (a transformer's projection shape: on CPU ``[128, 1024] @
  [1024, 1024]``), ``2 m k n`` FLOPs -> FLOP/s;
* ``matvec``: ``[1, k] @ [k, n]`` over a matrix larger than the caches (what one decode step does
  with each weight), bytes of the matrix -> bytes/s;
* ``copy``: ``dst.copy_(src)`` over a buffer larger than the caches, read + write = ``2 x bytes``
  -> bytes/s.

They serve twice. As the roofline's peaks where neither the backend nor the suite declares any
(an achieved peak, not the datasheet's: on CPU nothing better is known): matmul FLOP/s and copy
bandwidth. And as the yardstick of a comparison: every phase is timed with its kernel interleaved
(``timing.collect``: prefill and train with ``matmul``, decode with ``matvec``), and a baseline is
compared as ``(model time now / then) / (kernel time now / then)``, so a machine that is
uniformly 8% slower today, or busier during this run, does not read as an 8% regression of the
model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from harness.perf import stats
from harness.perf.timing import Budget, collect, cpu_key, timed, timed_both

PHASE_FOR = {"prefill_s": "prefill", "ttft_s": "prefill", "train_step_s": "train", "decode_token_s": "decode"}
# Compute-bound phases follow matmul; decode (weights streamed once per token) follows matvec.
PHASE_KERNEL = {"prefill": "matmul", "decode": "matvec", "train": "matmul"}
KERNEL_FOR = {m: PHASE_KERNEL[p] for m, p in PHASE_FOR.items()}
KINDS = ("matmul", "matvec", "copy")


@dataclass
class Kernels:
    """The calibration kernels for one backend and dtype. Each sample repeats its kernel until it
    lasts about ``min_sample_s``: a few-ms kernel on a shared machine is hit or missed whole by a
    scheduler time slice (its spread there is ~100% of its median); repeated to ~40 ms it averages
    over several slices."""

    backend: object
    dtype: torch.dtype
    shape: tuple[int, int, int] = ()  # matmul m, k, n
    matvec_shape: tuple[int, int] = ()  # k, n
    copy_bytes: int = 0
    min_sample_s: float = 0.04
    size: float = 1.0  # scales every kernel's dimensions (tests use small kernels)
    cpu_clock: bool = False  # also time each sample on the process CPU clock (timing.timed_both)
    reps: dict = field(default_factory=dict)

    def __post_init__(self):
        cpu = self.backend.device_type == "cpu"
        f = self.size

        def dim(d):
            return max(8, int(d * f))

        m, k, n = tuple(self.shape) or ((128, 1024, 1024) if cpu else (8192, 8192, 8192))
        self.shape = (m, dim(k), dim(n)) if not tuple(self.shape) else (m, k, n)
        self.matvec_shape = tuple(self.matvec_shape) or tuple(dim(d) for d in ((4096, 4096) if cpu else (16384, 16384)))
        self.copy_bytes = self.copy_bytes or max(4096, int(((32 if cpu else 1024) << 20) * f * f)) // 4 * 4
        dev = self.backend.device()
        g = torch.Generator().manual_seed(0)
        m, k, n = self.shape
        self.a = torch.randn(m, k, generator=g).to(device=dev, dtype=self.dtype)
        self.b = torch.randn(k, n, generator=g).to(device=dev, dtype=self.dtype)
        vk, vn = self.matvec_shape
        self.w = torch.randn(vk, vn, generator=g).to(device=dev, dtype=self.dtype)
        self.x = torch.randn(1, vk, generator=g).to(device=dev, dtype=self.dtype)
        self.src = torch.ones(self.copy_bytes // 4, dtype=torch.float32, device=dev)
        self.dst = torch.empty_like(self.src)
        self._fns = {"matmul": lambda: torch.mm(self.a, self.b), "matvec": lambda: torch.mm(self.x, self.w),
                     "copy": lambda: self.dst.copy_(self.src)}
        for kind, fn in self._fns.items():
            fn()
            t = min(timed(fn, self.backend.synchronize) for _ in range(3))  # warm, least disturbed
            self.reps[kind] = max(1, min(1000, int(self.min_sample_s / max(t, 1e-6)) + 1))

    @property
    def work(self) -> dict[str, float]:
        """FLOPs (matmul) or bytes (matvec, copy) of one repetition."""
        m, k, n = self.shape
        vk, vn = self.matvec_shape
        return {"matmul": 2.0 * m * k * n, "matvec": float(vk * vn * self.w.element_size()),
                "copy": 2.0 * self.copy_bytes}

    def _sample(self, kind: str) -> dict[str, float]:
        fn, reps = self._fns[kind], self.reps[kind]

        def body():
            for _ in range(reps):
                fn()

        wall, cpu = timed_both(body, self.backend.synchronize)
        key = f"calib_{kind}_s"
        return {key: wall / reps, cpu_key(key): cpu / reps} if self.cpu_clock else {key: wall / reps}

    def matmul_sample(self) -> dict[str, float]:
        return self._sample("matmul")

    def matvec_sample(self) -> dict[str, float]:
        return self._sample("matvec")

    def copy_sample(self) -> dict[str, float]:
        return self._sample("copy")

    def sample(self) -> dict[str, float]:
        return {**self.matmul_sample(), **self.matvec_sample(), **self.copy_sample()}

    def for_phase(self, phase: str):
        """The sample function of the kernel that tracks ``phase``."""
        kind = PHASE_KERNEL[phase]
        return lambda: self._sample(kind)

    def identity(self) -> dict:
        """What must be equal for two kernel timings to be comparable."""
        return {"matmul_shape": list(self.shape), "matvec_shape": list(self.matvec_shape),
                "copy_bytes": self.copy_bytes}


def summarize_calibration(k: Kernels, samples: dict[str, list[float]], dtype_name: str, clock: str = "wall") -> dict:
    """Samples -> the figures a baseline keeps (and the roofline uses). Rates are on ``clock``:
    with the CPU clock they are what the machine does while it runs this process."""
    summ = {key: stats.summarize(v) for key, v in samples.items()}

    def med(kind):
        key = f"calib_{kind}_s"
        return summ[cpu_key(key) if clock == "cpu" else key].median

    w = k.work
    return {
        "dtype": dtype_name,
        **k.identity(),
        "clock": clock,
        "reps": dict(k.reps),
        "matmul_flops_per_s": w["matmul"] / med("matmul"),
        "matvec_bytes_per_s": w["matvec"] / med("matvec"),
        "copy_bytes_per_s": w["copy"] / med("copy"),
        "samples": {key: list(v) for key, v in samples.items()},
        "summary": {key: s.to_dict() for key, s in summ.items()},
    }


def calibrate(backend, dtype: torch.dtype, dtype_name: str, budget: Budget | None = None,
              clock: str = "wall", min_sample_s: float = 0.04, size: float = 1.0) -> tuple[Kernels, dict]:
    k = Kernels(backend, dtype, cpu_clock=clock == "cpu", min_sample_s=min_sample_s, size=size)
    samples = collect(k.sample, budget or Budget(warmup=1, min_repeats=7, max_repeats=40, budget_s=0.5))
    return k, summarize_calibration(k, samples, dtype_name, clock)


def _kernel_samples(metric: str, cal: dict, ref: dict | None, clock: str) -> list[float] | None:
    """The metric's reference-kernel samples: those interleaved with its phase (``ref``) over the
    calibration step's."""
    key = f"calib_{KERNEL_FOR[metric]}_s"
    key = cpu_key(key) if clock == "cpu" else key
    return ((ref or {}).get(PHASE_FOR[metric]) or {}).get(key) or (cal.get("samples") or {}).get(key) or None


def kernel_ratio(metric: str, now_cal: dict, then_cal: dict, now_ref: dict | None = None,
                 then_ref: dict | None = None, clock: str = "wall") -> float | None:
    """How much slower (>1) this machine runs the metric's reference kernel than the baseline's
    did: median kernel time now / then, on ``clock``. The kernel samples interleaved with the
    metric's phase (``*_ref``: phase -> {key: samples}, timing.collect) are preferred to the
    calibration step's. None when either side lacks them or the kernels differ (shape, dtype)."""
    kernel = KERNEL_FOR.get(metric)
    if kernel is None or not now_cal or not then_cal:
        return None
    same = ("dtype", "matmul_shape", "matvec_shape", "copy_bytes")
    if any(now_cal.get(k) != then_cal.get(k) for k in same):
        return None
    xs, ys = _kernel_samples(metric, now_cal, now_ref, clock), _kernel_samples(metric, then_cal, then_ref, clock)
    a, b = (stats.summarize(xs).median if xs else None), (stats.summarize(ys).median if ys else None)
    if not a or not b:
        return None
    return a / b


def kernel_spread(metric: str, now_cal: dict, then_cal: dict, now_ref: dict | None = None,
                  then_ref: dict | None = None, clock: str = "wall") -> float | None:
    """The larger relative spread (IQR / median) of the metric's reference kernel now and in the
    baseline: how finely the kernel ratio can resolve a change (decide.py's ``noisy`` hold)."""
    if KERNEL_FOR.get(metric) is None or not now_cal or not then_cal:
        return None
    spreads = []
    for cal, ref in ((now_cal, now_ref), (then_cal, then_ref)):
        xs = _kernel_samples(metric, cal, ref, clock)
        if xs:
            s = stats.summarize(xs)
            spreads.append(s.iqr / s.median if s.median else 0.0)
    return max(spreads) if spreads else None
