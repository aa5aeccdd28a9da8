"""Throughput and latency baselines: the ``perf`` check.

Per suite x backend x dtype x shape (``b<batch>-s<seq>``, the grid of ``batch_sizes`` x ``seq_lens``),
on a perf-sized model (harness/perf/workload.py: the suite's architecture at hidden ``width``,
``layers`` layers), as named steps (``PerfCheck.steps``):

``setup``      timer safety and memory statistics of the backend, the perf model, its inputs;
``calibrate``  machine fingerprint and calibration kernels (matmul FLOP/s, copy bandwidth);
``prefill``    prefill latency and time to first token, B x S tokens with the KV cache on;
``decode``     time per output token with the KV cache, ``decode_tokens`` greedy steps;
``train``      one optimizer step (forward, backward, AdamW);
``roofline``   MFU / MBU of each phase from harness.inspect's FLOPs and bytes and the peaks;
``compare``    against the baseline of this suite and machine class: calibrated ratio + Mann-Whitney;
               a suspected regression is re-measured once, interleaved with the calibration kernels;
``record``     samples sidecar (results/perf/), summaries and verdicts as JUnit details;
``verdict``    a confirmed regression fails the item (``fail_on_regression``).

Every timing follows harness/perf/timing.py (warm-up, synchronize, repeats within a budget, GC off,
threads and affinity fixed). Nightly scope by default: one item costs ~10-20 s of a CPU against
~1 s for the other checks, so per-commit runs leave it out (``harness run --scope nightly``, or a
suite's ``[checks.perf] scope = "commit"``; ``HARNESS_PERF=1`` turns it on in every scope and for
every suite, as the golden-update and nightly workflows do). On devices the nightly run adds one item per shape at
the real model's per-layer size (``-published``). See docs/perf.md.
"""

from __future__ import annotations

import json
import math
import time
from types import SimpleNamespace
from typing import Literal

from pydantic import Field, field_validator

from harness import metrics
from harness.checks import Check, CheckConfig, CheckContext, CheckFailure, CheckRegistry, NotApplicable
from harness.models.build import torch_dtype
from harness.perf import baseline as store
from harness.perf import calibrate as calib
from harness.perf import fingerprint as fpmod
from harness.perf import roofline, stats
from harness.perf.decide import Decision, decide
from harness.perf.timing import (
    Budget,
    collect,
    cpu_key,
    interleaved,
    memory_support,
    minor_faults,
    pinned,
    steady_allocator,
    timer_safety,
)
from harness.perf.workload import Workload, perf_model_config

TIMED = {"prefill": ("prefill_s", "ttft_s"), "decode": ("decode_token_s",), "train": ("train_step_s",)}
PHASE_OF = {m: ph for ph, ms in TIMED.items() for m in ms}

metrics.declare("prefill_s", "s", "lower", "perf: median prefill latency of the B x S prompt (KV cache on)")
metrics.declare("ttft_s", "s", "lower", "perf: median time to first token (prefill + first token on the host)")
metrics.declare("decode_token_s", "s", "lower", "perf: median time per output token, greedy decode with KV cache")
metrics.declare("train_step_s", "s", "lower", "perf: median time of one optimizer step (fwd + bwd + AdamW)")
metrics.declare("prefill_tokens_per_s", "tokens/s", "higher", "perf: B x S / prefill_s")
metrics.declare("decode_tokens_per_s", "tokens/s", "higher", "perf: B / decode_token_s")
metrics.declare("train_tokens_per_s", "tokens/s", "higher", "perf: B x S / train_step_s")
for _ph in TIMED:
    metrics.declare(f"{_ph}_peak_memory_bytes", "bytes", "lower", f"perf: peak device memory during {_ph}")
    metrics.declare(f"{_ph}_minor_faults", "", "none",
                    f"perf: host minor page faults per {_ph} repeat (many: the allocator re-faults its pages)")
metrics.declare("prefill_mfu", "", "higher", "perf: prefill FLOP/s / peak FLOP/s (model FLOPs utilisation)")
metrics.declare("decode_mfu", "", "higher", "perf: decode FLOP/s / peak FLOP/s")
metrics.declare("decode_mbu", "", "higher", "perf: decode bytes/s / peak bytes/s (memory bandwidth utilisation)")
metrics.declare("train_mfu", "", "higher", "perf: training FLOP/s / peak FLOP/s")
metrics.declare("calib_matmul_flops_per_s", "FLOP/s", "none", "perf: calibration matmul rate in the run dtype")
metrics.declare("calib_copy_bytes_per_s", "bytes/s", "none", "perf: calibration copy bandwidth (read + write)")
metrics.declare("calib_matvec_bytes_per_s", "bytes/s", "none", "perf: calibration matrix-vector bandwidth")
metrics.declare("perf_parameters", "", "none", "perf: parameters of the perf-sized model")
for _m in PHASE_OF:
    metrics.declare(cpu_key(_m), "s", "lower", f"perf: {_m} on the process CPU clock (cpu backend)")
for _ph in TIMED:
    metrics.declare(f"{_ph}_tensor_peak_bytes", "bytes", "lower",
                    f"perf: peak of live tensor storage during one {_ph} repeat (counted by op, every backend)")
    metrics.declare(f"{_m}_p_value", "", "none", f"perf: Mann-Whitney p of {_m} against the baseline (one-sided)")
    metrics.declare(f"{_m}_change", "", "none", f"perf: calibrated relative change of {_m} against the baseline")


class PerfConfig(CheckConfig):
    """Throughput and latency against a per-machine-class baseline, with roofline fractions."""

    scope: Literal["commit", "nightly"] = Field(
        "nightly", description="Nightly by default (10-20 s per item on a CPU): `harness run --scope nightly`.")
    published: Literal["devices", "always", "never"] = Field(
        "devices", description="Also one item per shape at the real model's per-layer size (width 'published', "
        "variant suffix -published): on device backends only, on every backend, or never.")
    published_phases: list[Literal["prefill", "decode", "train"]] = Field(
        default_factory=lambda: ["prefill", "decode"], description="Phases of the -published items (training a "
        "published MoE layer with AdamW needs ~16 bytes per parameter).")
    batch_sizes: list[int] = Field(default_factory=lambda: [1], description="Batch grid (one item per batch x seq).")
    seq_lens: list[int] = Field(default_factory=lambda: [128], description="Prompt-length grid.")
    decode_tokens: int = Field(8, ge=1, description="Greedy tokens decoded after the prompt (per decode sample).")
    width: int | Literal["published"] = Field(
        1024, description="Hidden size of the perf model; every width-like dimension of the suite's pruning "
        "scales with it. 0: the suite's pruned size; 'published': the real model's per-layer size (devices).")
    layers: int = Field(2, ge=1, description="Decoder layers of the perf model.")
    prune: dict[str, int | float | bool | str | dict | None] = Field(
        default_factory=dict, description="Prune keys applied last (e.g. num_experts = 16).")
    phases: list[Literal["prefill", "decode", "train"]] = Field(
        default_factory=lambda: ["prefill", "decode", "train"], description="Phases to measure.")
    threads: int = Field(
        1, ge=0, description="Intra-op threads while timing on CPU (0: one per CPU of the affinity). 1 by default: on "
        "a shared runner a multi-threaded op waits for its slowest thread, and one descheduled thread makes a "
        "sample 5-15x slower; a dedicated machine sets its core count.")
    cpus: list[int] = Field(default_factory=list, description="CPU affinity while timing (empty: keep the current).")
    warmup: int = Field(2, ge=0, description="Warm-up repeats per phase, not recorded.")
    min_repeats: int = Field(5, ge=2, description="At least this many samples per phase.")
    max_repeats: int = Field(40, ge=2, description="At most this many samples per phase.")
    budget_s: float = Field(2.0, gt=0, description="Time budget per phase on the decision's clock; repeats continue "
                            "until it is spent.")
    calibration_budget_s: float = Field(0.5, gt=0, description="Time budget of the calibration kernels.")
    kernel_sample_s: float = Field(0.04, gt=0, description="Each calibration sample repeats its kernel to about this long.")
    kernel_size: float = Field(1.0, gt=0, le=4, description="Scale of the calibration kernels' dimensions "
                               "(1: matmul [128, 1024] @ [1024, 1024], matvec 4096^2, copy 32 MiB on CPU).")
    threshold: float = Field(0.05, gt=0, description="Relative change that may count as a regression.")
    thresholds: dict[str, float] = Field(
        default_factory=lambda: {"decode_token_s": 0.10},
        description="Per-metric thresholds over `threshold`. Decode is 10% by default: on a CPU it is memory-bound, "
        "and one process's decode differs from another's by up to ~10% (page placement, the neighbours' memory "
        "traffic) where no clock or kernel corrects it (docs/perf.md).")
    alpha: float = Field(0.01, gt=0, lt=1, description="Mann-Whitney significance level.")
    remeasure_repeats: int = Field(10, ge=3, description="Samples of the re-measurement of a suspected regression.")
    max_kernel_ratio: float = Field(
        2.0, gt=1, description="Calibration kernels this much slower or faster than the baseline's: the machine "
        "is not comparable (a different class in disguise, or a throttled one).")
    calibrate: bool = Field(True, description="Divide ratios by the calibration kernels' ratio.")
    allocator: Literal["fixed", "as-is"] = Field(
        "fixed", description="'fixed': glibc malloc's mmap/trim thresholds fixed while measuring, so a sample "
        "does not depend on what the worker process ran before (timing.steady_allocator); 'as-is': untouched.")
    clock: Literal["auto", "wall", "cpu"] = Field(
        "auto", description="Clock of the decision and the roofline: 'cpu' = process CPU time (cpu backend), "
        "'wall' = wall time with synchronize; 'auto': cpu on the cpu backend with threads = 1, else wall. "
        "Wall-clock medians are recorded either way.")
    peak_flops: dict[str, float] = Field(
        default_factory=dict, description="Declared peak FLOP/s per dtype for MFU (absent: the calibration matmul).")
    peak_bandwidth: float | None = Field(None, gt=0, description="Declared peak bytes/s for MBU (absent: calibration copy).")
    profile_repeats: int = Field(
        3, ge=0, description="Repeats of each phase under torch.profiler with module ranges, apart from the timed "
        "ones (harness/perf/profile.py): operator and module times and the tensor-memory peak by module, stored "
        "with the samples and the baseline; a regression names what grew. 0: no profile.")
    memory_threshold: float = Field(
        0.01, ge=0, description="Relative growth of a phase's tensor-memory peak (live storage, counted exactly) "
        "that is a memory regression, named by the module holding the extra bytes at the peak.")
    fail_on_regression: bool = Field(True, description="A confirmed regression fails the item.")
    seed: int = Field(0, description="Seed for weights and inputs.")

    @field_validator("batch_sizes", "seq_lens")
    @classmethod
    def _positive(cls, v: list[int]) -> list[int]:
        if not v or any(x < 1 for x in v):
            raise ValueError(f"must be a non-empty list of positive integers, got {v}")
        return v

    @field_validator("width")
    @classmethod
    def _width(cls, v):
        if isinstance(v, int) and v < 0:
            raise ValueError(f"must be >= 0 or 'published', got {v}")
        return v


def shape_id(batch: int, seq: int) -> str:
    return f"b{batch}-s{seq}"


PUBLISHED = "-published"


def _forced() -> bool:
    from harness.settings import env

    return env("HARNESS_PERF")


def parse_shape(variant: str | None, cfg: PerfConfig) -> tuple[int, int, bool]:
    """``b1-s128`` -> (1, 128, False); ``b1-s128-published`` -> (1, 128, True)."""
    if not variant:
        return cfg.batch_sizes[0], cfg.seq_lens[0], False
    published = variant.endswith(PUBLISHED)
    b, s = variant.removesuffix(PUBLISHED).split("-")
    return int(b[1:]), int(s[1:]), published


def _fmt_s(v: float) -> str:
    return f"{v * 1e3:.3g} ms" if v < 1 else f"{v:.3g} s"


class PerfCheck(Check):
    name = "perf"
    order = 60
    config_model = PerfConfig
    description = "Throughput and latency against a per-machine-class baseline, with roofline fractions."
    headline = ("prefill_s", "decode_token_s", "prefill_mfu")
    exclusive = True  # timings: nothing else of the run on the machine meanwhile (harness/run/exclusive.py)
    statistical_verdict = True  # a regression is re-measured before it fails the item: never rerun by --confirm
    # profile after compare: the re-measurement of a suspected regression must run as the baseline's
    # samples did, before anything the profiler leaves behind in the process
    steps = ("setup", "calibrate", "prefill", "decode", "train", "roofline", "compare", "profile", "record",
             "verdict")
    setup_steps = ("setup", "calibrate")

    def enabled(self, suite) -> bool:
        return bool(self.config(suite).enabled) or _forced()

    def scope(self, suite, variant) -> str:
        # HARNESS_PERF=1 (the golden-update and nightly workflows): perf items in whatever scope
        # the run has, so `harness run --check perf` measures without --scope nightly.
        return "commit" if _forced() else super().scope(suite, variant)

    def variants(self, suite, backend) -> list[str | None]:
        cfg = self.config(suite)
        shapes = [shape_id(b, s) for b in cfg.batch_sizes for s in cfg.seq_lens]
        full = cfg.published == "always" or (cfg.published == "devices" and backend.device_type != "cpu")
        return shapes + ([v + PUBLISHED for v in shapes] if full else [])

    def new_state(self, ctx: CheckContext):
        # Options (run(ctx, **options)): results_dir / golden_root redirect files; transform(model)
        # changes the model after the build (the detection benchmark injects slowdowns with it).
        return SimpleNamespace(results_dir=None, golden_root=None, transform=None)

    def run_steps(self, ctx: CheckContext, st) -> None:
        cfg = ctx.config
        # Threads and affinity fixed for every step, restored whatever happens.
        with (pinned(cfg.threads if ctx.backend.device_type == "cpu" else 0, cfg.cpus) as pin,
              steady_allocator(cfg.allocator) as alloc):
            st.pin = pin
            pin.allocator = alloc
            super().run_steps(ctx, st)

    # --- steps -------------------------------------------------------------------------------
    def setup(self, ctx: CheckContext, st) -> None:
        cfg = st.cfg = ctx.config
        st.batch, st.seq, published = parse_shape(ctx.variant, cfg)
        if published:  # the real model's per-layer size: its own width and phases
            cfg = st.cfg = cfg.model_copy(update={"width": "published", "phases": cfg.published_phases})
        st.key = store.item_key(ctx.backend.name, ctx.dtype, ctx.variant or shape_id(st.batch, st.seq))
        st.samples, st.memory, st.ref = {}, {}, {}  # ref: phase -> {kernel key: interleaved samples}
        st.profile, st.base_profile, st.ratios, st.memory_regressions = {}, {}, {}, {}
        ok, why = timer_safety(ctx.backend)
        if not ok:
            ctx.detail("perf_timing", why)
            raise NotApplicable(f"no perf figures: {why}")
        st.mem_ok, why = memory_support(ctx.backend)
        if not st.mem_ok:
            ctx.detail("perf_memory", why)
        # The clock the decision (and the roofline) uses: process CPU time on a CPU backend with
        # one intra-op thread (timing.timed_both says why), wall time everywhere else.
        cpu_ok = ctx.backend.device_type == "cpu" and st.pin.threads == 1
        st.clock = cfg.clock if cfg.clock != "auto" else ("cpu" if cpu_ok else "wall")
        if st.clock == "cpu" and ctx.backend.device_type != "cpu":
            st.clock = "wall"
            ctx.notes.append("perf: clock = 'cpu' needs the cpu backend; wall clock used")
        ctx.detail("perf_clock", st.clock)
        st.budget = Budget(cfg.warmup, cfg.min_repeats, cfg.max_repeats, cfg.budget_s,
                           time.process_time if st.clock == "cpu" else time.perf_counter)
        mc = perf_model_config(ctx.suite, cfg.width, cfg.layers, cfg.prune)
        st.wl = Workload(ctx.suite, mc, ctx.dtype, ctx.backend, st.batch, st.seq, cfg.decode_tokens, cfg.seed,
                         cpu_clock=ctx.backend.device_type == "cpu")
        if st.transform is not None:
            st.transform(st.wl.model)
        ctx.notes.extend(st.wl.mc.notes)
        ctx.metric("perf_parameters", st.wl.parameters)
        st.shape = {"batch": st.batch, "seq": st.seq, "decode_tokens": cfg.decode_tokens, "width": cfg.width,
                    "layers": cfg.layers, "prune": cfg.prune, "parameters": st.wl.parameters}

    def _key(self, st, metric: str) -> str:
        """The samples the decision reads for a metric: its CPU-clock twin when the clock is cpu."""
        return cpu_key(metric) if st.clock == "cpu" else metric

    def calibrate(self, ctx: CheckContext, st) -> None:
        st.fp = fpmod.fingerprint(ctx.backend, st.pin.threads, st.pin.cpus)
        st.kernels, st.calib = calib.calibrate(ctx.backend, torch_dtype(ctx.dtype), ctx.dtype,
                                               Budget(1, 7, 40, st.cfg.calibration_budget_s), clock=st.clock,
                                               min_sample_s=st.cfg.kernel_sample_s, size=st.cfg.kernel_size)
        ctx.metric("calib_matmul_flops_per_s", st.calib["matmul_flops_per_s"])
        ctx.metric("calib_copy_bytes_per_s", st.calib["copy_bytes_per_s"])
        ctx.metric("calib_matvec_bytes_per_s", st.calib["matvec_bytes_per_s"])

    def _phase(self, ctx: CheckContext, st, phase: str, sample) -> None:
        if phase not in st.cfg.phases:
            return
        if st.mem_ok:
            ctx.backend.reset_peak_memory()
        f0 = minor_faults()
        got = collect(sample, st.budget, reference=st.kernels.for_phase(phase))
        n = max((len(v) for v in got.values()), default=0)
        if n:  # warm-up included: faults that keep coming every repeat say the allocator is cold
            ctx.metric(f"{phase}_minor_faults", (minor_faults() - f0) / n)
        st.ref[phase] = {k: got.pop(k) for k in list(got) if k.startswith("calib_")}
        st.samples.update(got)
        if st.mem_ok:
            peak = ctx.backend.peak_memory()
            if peak is not None:
                st.memory[phase] = peak
                ctx.metric(f"{phase}_peak_memory_bytes", peak)

    def prefill(self, ctx: CheckContext, st) -> None:
        self._phase(ctx, st, "prefill", st.wl.prefill_sample)

    def decode(self, ctx: CheckContext, st) -> None:
        if "prefill" not in st.cfg.phases and "decode" in st.cfg.phases:
            st.wl.prefill_sample()  # the decode needs a prompt in the cache
        self._phase(ctx, st, "decode", st.wl.decode_sample)

    def train(self, ctx: CheckContext, st) -> None:
        self._phase(ctx, st, "train", st.wl.train_sample)
        st.wl.release_training()

    def profile(self, ctx: CheckContext, st) -> None:
        """Operators, modules and the tensor-memory peak of each phase, in repeats of their own after
        the timed ones and the re-measurement (the profiler's overhead never reaches a sample); then
        the tensor-memory peaks against the baseline's."""
        from harness.perf.profile import profile_phase

        st.profile = {}
        if st.cfg.profile_repeats <= 0:
            return
        fns = {"prefill": st.wl.prefill_sample, "decode": st.wl.decode_sample, "train": st.wl.train_sample}
        for phase in st.cfg.phases:
            if phase == "decode" and "prefill" not in st.cfg.phases:
                st.wl.prefill_sample()
            st.profile[phase] = p = profile_phase(fns[phase], st.wl.model, ctx.backend, st.cfg.profile_repeats)
            ctx.metric(f"{phase}_tensor_peak_bytes", p["memory"]["peak_bytes"])
            if phase == "train":
                st.wl.release_training()
        self._memory(ctx, st)
        if st.memory_regressions:
            st.status = "regression"

    def roofline(self, ctx: CheckContext, st) -> None:
        cfg = st.cfg
        med = {m: stats.summarize(v).median for m, v in st.samples.items()}
        st.work = w = roofline.work_for_model(ctx.suite, st.wl.mc, st.batch, st.seq, cfg.decode_tokens, ctx.dtype)
        declared = cfg.peak_flops.get(ctx.dtype)
        peak_f = declared or st.calib["matmul_flops_per_s"]
        peak_b = cfg.peak_bandwidth or st.calib["copy_bytes_per_s"]
        st.roof = {"clock": st.clock, "peak_flops_per_s": peak_f,
                   "peak_flops_source": "declared" if declared else "calibration matmul",
                   "peak_bytes_per_s": peak_b,
                   "peak_bytes_source": "declared" if cfg.peak_bandwidth else "calibration copy",
                   "work": w.to_dict(), "fractions": {}}
        tokens = st.batch * st.seq
        pairs = {"prefill_mfu": (w.prefill_flops, "prefill_s", peak_f),
                 "decode_mfu": (w.decode_flops_per_step, "decode_token_s", peak_f),
                 "decode_mbu": (w.decode_bytes_per_step, "decode_token_s", peak_b),
                 "train_mfu": (w.train_flops, "train_step_s", peak_f)}
        for name, (amount, m, peak) in pairs.items():
            k = self._key(st, m)
            if k in med:
                f = roofline.fraction(amount, med[k], peak)
                if f is not None:
                    st.roof["fractions"][name] = ctx.metric(name, f)
        for name, m, n in (("prefill_tokens_per_s", "prefill_s", tokens),
                           ("decode_tokens_per_s", "decode_token_s", st.batch),
                           ("train_tokens_per_s", "train_step_s", tokens)):
            if m in med and med[m] > 0:
                ctx.metric(name, n / med[m])  # what a user sees: wall clock
        for m, v in med.items():
            ctx.metric(m, v)

    def compare(self, ctx: CheckContext, st) -> None:
        cfg = st.cfg
        st.decisions: dict[str, Decision] = {}
        st.first: dict[str, Decision] = {}
        # metric -> (samples key, samples decided on, baseline samples): the decision's own clock,
        # the re-measured samples where the check measured again.
        st.decided: dict[str, tuple[str, list[float], list[float]]] = {}
        st.status = "unchanged"
        st.ratios, st.base_profile, st.memory_regressions = {}, {}, {}
        base, why = store.find_baseline(ctx.suite.name, st.key, st.fp, st.golden_root)
        st.baseline_why = why
        if base is None:
            st.status = "incomparable" if "incomparable" in why else "no-baseline"
            ctx.notes.append(why)
            return
        bcal = base.get("calibration") or {}
        problem = None
        if base.get("shape") != st.shape:
            problem = f"baseline measured another workload ({base.get('shape')}, now {st.shape}); not compared"
        elif bcal.get("clock", "wall") != st.clock:
            problem = f"baseline timed on the {bcal.get('clock', 'wall')} clock, this run on the {st.clock} clock"
        if problem:
            st.status, st.baseline_why = "incomparable", problem
            ctx.notes.append(problem)
            return
        timed_metrics = [m for m in PHASE_OF if self._key(st, m) in st.samples]
        ratios = {m: (calib.kernel_ratio(m, st.calib, bcal, st.ref, base.get("reference"), st.clock)
                      if cfg.calibrate else None) for m in timed_metrics}
        wild = {m: r for m, r in ratios.items() if r and not 1 / cfg.max_kernel_ratio <= r <= cfg.max_kernel_ratio}
        if wild:
            m, r = next(iter(wild.items()))
            st.status, st.baseline_why = "incomparable", (
                f"this machine runs the calibration kernel of {m} in {r:.2f}x the baseline's time "
                f"(limit {cfg.max_kernel_ratio}x): not comparable; {why}")
            ctx.notes.append(st.baseline_why)
            return
        st.ratios, st.base_profile = ratios, base.get("profile") or {}
        for m in timed_metrics:
            k = self._key(st, m)
            st.decided[m] = (k, st.samples[k], base["samples"].get(k, []))
            st.decisions[m] = decide(m, st.samples[k], base["samples"].get(k, []), direction=metrics.direction(m),
                                     threshold=cfg.thresholds.get(m, cfg.threshold), alpha=cfg.alpha,
                                     kernel_ratio=ratios[m])
        suspected = [m for m, d in st.decisions.items() if d.verdict == "regression"]
        if suspected:
            self._remeasure(ctx, st, suspected, base)
        verdicts = {d.verdict for d in st.decisions.values()}
        st.status = ("regression" if "regression" in verdicts else
                     "improvement" if "improvement" in verdicts else "unchanged")

    def _memory(self, ctx: CheckContext, st) -> None:
        """Tensor-memory peak per phase against the baseline's: counted exactly (no noise), so any
        growth over ``memory_threshold`` is a regression, named by the module that holds the extra
        bytes at the peak."""
        from harness.perf.profile import explain

        for phase, now in (st.profile or {}).items():
            ex = explain(now, st.base_profile.get(phase))
            mem = ex and ex["memory"]
            if mem and mem["change"] > st.cfg.memory_threshold:
                st.memory_regressions[phase] = mem

    def _remeasure(self, ctx: CheckContext, st, suspected: list[str], base: dict) -> None:
        """Once more, in this run: the phase's samples interleaved with its reference kernel's
        (a-b-a-b), so a slow spell of the machine shows up in both. Only a regression that holds
        again is reported; the first decision is kept beside it."""
        cfg = st.cfg
        fns = {"prefill": st.wl.prefill_sample, "decode": st.wl.decode_sample, "train": st.wl.train_sample}
        for phase in dict.fromkeys(PHASE_OF[m] for m in suspected):
            if phase == "decode" and "prefill_s" not in st.samples:
                st.wl.prefill_sample()
            got, kern = interleaved([fns[phase], st.kernels.for_phase(phase)], cfg.remeasure_repeats)
            if phase == "train":
                st.wl.release_training()
            now_ref = {phase: kern}
            st.ref[f"{phase}_remeasured"] = kern
            for k, v in got.items():
                st.samples[f"{k}_remeasured"] = v
            for m in (x for x in suspected if PHASE_OF[x] == phase):
                k = self._key(st, m)
                r = (calib.kernel_ratio(m, st.calib, base.get("calibration") or {}, now_ref, base.get("reference"),
                                        st.clock) if cfg.calibrate else None)
                st.first[m] = st.decisions[m]
                st.decided[m] = (f"{k}_remeasured", got[k], base["samples"][k])
                st.decisions[m] = d = decide(m, got[k], base["samples"][k], direction=metrics.direction(m),
                                             threshold=cfg.thresholds.get(m, cfg.threshold), alpha=cfg.alpha,
                                             kernel_ratio=r)
                if d.verdict != "regression":
                    d.why = f"suspected ({st.first[m].why}) but not confirmed on re-measure: {d.why}"

    def record(self, ctx: CheckContext, st) -> None:
        summary = {m: stats.summarize(v).to_dict() for m, v in st.samples.items()}
        verdict = {"status": st.status, "baseline": st.baseline_why, "class": fpmod.class_key(st.fp),
                   "metrics": {}}
        for m, d in st.decisions.items():
            entry = d.to_dict()
            if m in st.first:
                entry["first"] = st.first[m].to_dict()
            entry["summary"] = summary.get(m)
            if m in st.decided:  # what the decision read, on its clock: now and baseline side by side
                key, now, then = st.decided[m]
                entry["decided"] = {"clock": st.clock, "samples": key, "now": stats.summarize(now).to_dict(),
                                    "baseline": stats.summarize(then).to_dict()}
            verdict["metrics"][m] = entry
            if math.isfinite(d.p_value):
                ctx.metric(f"{m}_p_value", d.p_value)
            if math.isfinite(d.calibrated_ratio):
                ctx.metric(f"{m}_change", d.calibrated_ratio - 1)
        verdict["roofline"] = st.roof["fractions"]
        for phase, mem in st.memory_regressions.items():
            # one entry per memory regression, shaped as the timing decisions are, so the comparator
            # files it as the same kind of performance finding (counted, not sampled: n = 1, no p)
            verdict["metrics"][f"{phase}_tensor_peak_bytes"] = {
                "metric": f"{phase}_tensor_peak_bytes", "verdict": "regression", "direction": "lower",
                "ratio": 1 + mem["change"], "calibrated_ratio": 1 + mem["change"], "change": mem["change"],
                "kernel_ratio": 1.0, "threshold": st.cfg.memory_threshold, "n_current": 1, "n_baseline": 1,
                "why": f"tensor-memory peak {mem['change']:+.1%} (counted exactly); at the peak {mem['module']} "
                       f"holds {mem['module_bytes']:+,} bytes more",
                "decided": {"clock": "counted", "now": {"median": mem["peak_bytes"]},
                            "baseline": {"median": mem["base_peak_bytes"]}}}
        if st.memory_regressions:
            verdict["memory"] = st.memory_regressions
        st.verdict = verdict
        record = {"suite": ctx.suite.name, "key": st.key, "backend": ctx.backend.name, "dtype": ctx.dtype,
                  "variant": ctx.variant, "fingerprint": st.fp, "class": fpmod.class_key(st.fp),
                  "pinning": st.pin.to_dict(), "shape": st.shape, "calibration": st.calib,
                  "samples": {m: v for m, v in st.samples.items() if not m.endswith("_remeasured")},
                  "remeasured": {m: v for m, v in st.samples.items() if m.endswith("_remeasured")},
                  "reference": {k: v for k, v in st.ref.items() if not k.endswith("_remeasured")},
                  "reference_remeasured": {k: v for k, v in st.ref.items() if k.endswith("_remeasured")},
                  "summary": summary, "memory": st.memory, "roofline": st.roof, "verdict": verdict,
                  "profile": st.profile}
        try:
            path = store.write_sidecar(record, st.results_dir)
            ctx.detail("perf_samples", str(path))
        except OSError as e:  # the figures are in the details anyway
            ctx.notes.append(f"perf samples not written: {e}")
        ctx.detail("perf_summary", json.dumps({m: {k: s[k] for k in ("n", "median", "q1", "q3", "iqr", "ci_low",
                                                                      "ci_high")} for m, s in summary.items()},
                                              separators=(",", ":")))
        ctx.detail("perf_verdict", json.dumps(verdict, separators=(",", ":"), default=str))
        ctx.detail("perf_fingerprint", json.dumps(st.fp, separators=(",", ":"), sort_keys=True))
        ctx.detail("perf_class", fpmod.class_key(st.fp))
        ctx.detail("perf_pinning", json.dumps(st.pin.to_dict(), separators=(",", ":")))
        ctx.detail("perf_roofline", json.dumps({k: v for k, v in st.roof.items() if k != "work"} |
                                               {"work": st.work.to_dict()}, separators=(",", ":"), default=str))
        if st.status in ("no-baseline", "incomparable"):
            ctx.notes.append(f"perf: {st.status}")

    def verdict(self, ctx: CheckContext, st) -> None:
        from harness.perf import profile as prof

        bad = [d for d in st.decisions.values() if d.verdict == "regression"]
        if not st.cfg.fail_on_regression or not bad and not st.memory_regressions:
            return
        if not bad:
            phase, mem = max(st.memory_regressions.items(), key=lambda kv: kv[1]["change"])
            holder = (f": {mem['module']} holds {mem['module_bytes'] / 2**10:+.1f} KiB more at the peak"
                      if mem["module"] else "")
            raise CheckFailure(
                f"{phase} tensor-memory peak grew {mem['change']:+.1%} ({mem['base_peak_bytes'] / 2**20:.2f} -> "
                f"{mem['peak_bytes'] / 2**20:.2f} MiB){holder}", metric=f"{phase}_tensor_peak_bytes",
                expected=f"<= {1 + st.cfg.memory_threshold:.2f}x baseline ({mem['base_peak_bytes']} bytes)",
                observed=f"{mem['peak_bytes']} bytes", tolerance=st.cfg.memory_threshold,
                details=f"module holding the extra bytes at the peak: {mem['module']}\nbaseline: {st.baseline_why}")
        lines = [f"medians on the {st.clock} clock",
                 f"{'metric':<16} {'now':>10} {'baseline':>10} {'change':>8} {'p':>8}  IQR now      roofline"]
        for d in bad:
            # Both medians on the decision's clock (the CPU clock on a one-thread cpu run).
            dec = st.verdict["metrics"][d.metric].get("decided") or {}
            s, b = dec.get("now") or {}, dec.get("baseline") or {}
            b_med = b.get("median", math.nan)
            frac = {"prefill_s": "prefill_mfu", "ttft_s": "prefill_mfu", "decode_token_s": "decode_mbu",
                    "train_step_s": "train_mfu"}.get(d.metric)
            fr = st.roof["fractions"].get(frac)
            lines.append(f"{d.metric:<16} {_fmt_s(s.get('median', math.nan)):>10} {_fmt_s(b_med):>10} "
                         f"{d.change:>+8.1%} {d.p_value:>8.2g}  {_fmt_s(s.get('iqr', math.nan)):<12} "
                         + (f"{frac} {fr:.1%}" if fr is not None else ""))
        worst = max(bad, key=lambda d: d.change)
        # where: the phase's profile against the baseline's, calibrated by the phase's kernel ratio
        phase = PHASE_OF[worst.metric]
        ex = prof.explain((st.profile or {}).get(phase), (st.base_profile or {}).get(phase),
                          (st.ratios or {}).get(worst.metric))
        where = ""
        if ex is not None:
            lines += ["", *prof.lines(ex, phase)]
            where = prof.headline(ex)
            where = f"; where: {where}" if where else ""
            st.verdict["where"] = {"phase": phase, **ex}
            ctx.detail("perf_where", json.dumps(st.verdict["where"], separators=(",", ":"), default=str))
        elif st.profile:
            lines += ["", "where: the baseline has no profile (taken before profiles were recorded); "
                      "`harness baseline update` with this run adds one"]
        for ph, mem in st.memory_regressions.items():
            lines.append(f"{ph} tensor-memory peak {mem['change']:+.1%}: {mem['module']} holds "
                         f"{mem['module_bytes'] / 2**10:+.1f} KiB more")
        raise CheckFailure(
            f"{worst.metric} regressed {worst.change:+.1%} (calibrated, p={worst.p_value:.2g}, confirmed on "
            f"re-measure) against the baseline of this machine class{where}",
            metric=worst.metric, expected=f"<= {1 + worst.threshold:.2f}x baseline", observed=f"{worst.calibrated_ratio:.3f}x",
            tolerance=worst.threshold, details="\n".join(lines + ["", f"baseline: {st.baseline_why}"]))


def register(registry: CheckRegistry) -> None:
    registry.add(PerfCheck())
