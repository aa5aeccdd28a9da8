"""Throughput and latency baselines: the ``perf`` check.

Per suite x backend x dtype x shape (``b<batch>-s<seq>``, the grid of ``batch_sizes`` x ``seq_lens``),
on a perf-sized model (harness/perf/workload.py: the suite's architecture at hidden ``width``,
``layers`` layers), as named steps (``PerfCheck.steps``), each a call of harness/perf/measure.py
(measuring) or harness/perf/judge.py (judging) whose figures the step records:

``setup``      timer safety and memory statistics of the backend, the perf model, its inputs;
``calibrate``  machine fingerprint and calibration kernels (matmul FLOP/s, copy bandwidth);
``prefill``    prefill latency and time to first token, B x S tokens with the KV cache on;
``decode``     time per output token with the KV cache, ``decode_tokens`` greedy steps;
``train``      one optimizer step (forward, backward, AdamW);
``roofline``   MFU / MBU of each phase from harness.inspect's FLOPs and bytes and the peaks;
``compare``    against the baseline of this suite and machine class: calibrated ratio + Mann-Whitney;
               a suspected regression (or one too noisy to judge for a spell of the machine) is
               re-measured once, interleaved with the calibration kernels, and filed where the re-measure
               alone is a regression;
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

from types import SimpleNamespace
from typing import Literal

from pydantic import Field, field_validator

from harness import metrics
from harness.checks import Check, CheckConfig, CheckContext, CheckFailure, CheckRegistry, NotApplicable
from harness.perf import baseline as store
from harness.perf import fingerprint as fpmod
from harness.perf import judge, stats
from harness.perf import measure as meas
from harness.perf.measure import PHASE_OF, TIMED
from harness.perf.timing import cpu_key, memory_support, pinned, steady_allocator, timer_safety

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
    metrics.declare(f"{_ph}_worst_op_change", "", "none", f"perf: largest calibrated change of an operator of "
                    f"at least op_min_share of {_ph}, over its profile repeats (judged on its own)")
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
    thin_margin: float = Field(
        0.25, gt=0, description="Against a baseline of one process's samples (one run taken by `harness baseline "
        "update`), a change within this margin is noted as 'baseline too thin', not a regression: one process's "
        "level can be 15% off another's on a loaded CPU. Pool several runs to judge smaller changes.")
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
        5, ge=0, description="Repeats of each phase under torch.profiler with module ranges, apart from the timed "
        "ones (harness/perf/profile.py): operator and module times and the tensor-memory peak by module, stored "
        "with the samples and the baseline; a regression names what grew. 0: no profile.")
    op_min_share: float = Field(
        0.02, ge=0, le=1, description="An operator (a module's own time) holding at least this share of its phase "
        "in the baseline's profile is judged on its own profile repeats, whatever its phase did.")
    op_min_time: float = Field(
        1e-3, ge=0, description="Seconds per phase call (the baseline's median over the profile repeats) under "
        "which an operator (a module's own time) is not judged on its own, whatever its share: timing an "
        "operator costs a few microseconds per call (measured on this project's CPU: ~2 us inside each call on "
        "the CPU clock, 0.2-2 us per profiler event), as much as a ~17 us kernel itself (docs/perf.md, \"Profiles\").")
    op_min_call_time: float = Field(
        1e-4, ge=0, description="Seconds per timed call (baseline; a module's own time: per call and per operator "
        "call in it) under which an operator (module) is not judged on its own: the timing costs ~2 us inside "
        "each operator call and ~7 us in its module's own time, so 40 calls of a 37 us operator are over "
        "op_min_time and as noisy as one.")
    op_threshold: float = Field(
        0.25, gt=0, description="Calibrated growth of such an operator (or module, own time) that is a regression "
        "with p < alpha over its profile repeats, confirmed on a re-profile (5 repeats a side: the smallest exact "
        "p of 3 is 0.05). At least thin_margin: a profile is one process's samples.")
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

    # --- steps: each a call of harness/perf/measure.py or judge.py, its figures recorded ----------
    def setup(self, ctx: CheckContext, st) -> None:
        cfg = st.cfg = ctx.config
        st.batch, st.seq, published = parse_shape(ctx.variant, cfg)
        if published:  # the real model's per-layer size: its own width and phases
            cfg = st.cfg = cfg.model_copy(update={"width": "published", "phases": cfg.published_phases})
        st.key = store.item_key(ctx.backend.name, ctx.dtype, ctx.variant or shape_id(st.batch, st.seq))
        st.samples, st.memory, st.ref = {}, {}, {}  # ref: phase -> {kernel key: interleaved samples}
        st.profile, st.cmp, st.ops = {}, judge.Comparison(), {}
        ok, why = timer_safety(ctx.backend)
        if not ok:
            ctx.detail("perf_timing", why)
            raise NotApplicable(f"no perf figures: {why}")
        st.mem_ok, why = memory_support(ctx.backend)
        if not st.mem_ok:
            ctx.detail("perf_memory", why)
        st.clock, note = meas.decision_clock(cfg.clock, ctx.backend.device_type, st.pin.threads)
        ctx.notes.extend([note] if note else [])
        ctx.detail("perf_clock", st.clock)
        st.budget = meas.phase_budget(cfg, st.clock)
        st.wl, st.shape = meas.workload(ctx.suite, cfg, ctx.dtype, ctx.backend, st.batch, st.seq, st.transform)
        ctx.notes.extend(st.wl.mc.notes)
        ctx.metric("perf_parameters", st.wl.parameters)

    def calibrate(self, ctx: CheckContext, st) -> None:
        st.fp = fpmod.fingerprint(ctx.backend, st.pin.threads, st.pin.cpus)
        st.kernels, st.calib = meas.calibration(ctx.backend, ctx.dtype, st.cfg, st.clock)
        for k in ("matmul_flops_per_s", "copy_bytes_per_s", "matvec_bytes_per_s"):
            ctx.metric(f"calib_{k}", st.calib[k])

    def _phase(self, ctx: CheckContext, st, phase: str, sample) -> None:
        if phase not in st.cfg.phases:
            return
        got = meas.measure_phase(ctx.backend, sample, st.budget, st.kernels.for_phase(phase), st.mem_ok)
        if got.faults is not None:
            ctx.metric(f"{phase}_minor_faults", got.faults)
        st.ref[phase] = got.reference
        st.samples.update(got.samples)
        if got.peak_bytes is not None:
            st.memory[phase] = ctx.metric(f"{phase}_peak_memory_bytes", got.peak_bytes)

    def prefill(self, ctx: CheckContext, st) -> None:
        self._phase(ctx, st, "prefill", st.wl.prefill_sample)

    def decode(self, ctx: CheckContext, st) -> None:
        if "prefill" not in st.cfg.phases and "decode" in st.cfg.phases:
            st.wl.prefill_sample()  # the decode needs a prompt in the cache
        self._phase(ctx, st, "decode", st.wl.decode_sample)

    def train(self, ctx: CheckContext, st) -> None:
        self._phase(ctx, st, "train", st.wl.train_sample)
        st.wl.release_training()

    def roofline(self, ctx: CheckContext, st) -> None:
        r = meas.roofline_figures(ctx.suite, st.wl, st.cfg, ctx.dtype, st.batch, st.seq, st.samples, st.clock,
                                  st.calib)
        st.work, st.roof = r.work, r.roof
        for name, v in r.figures.items():
            ctx.metric(name, v)

    def compare(self, ctx: CheckContext, st) -> None:
        st.cmp = judge.compare(ctx.suite.name, st.key, st.fp, st.golden_root, st.shape, st.clock, st.cfg,
                               st.samples, st.ref, st.calib, st.wl, st.kernels)
        ctx.notes.extend([st.cmp.note] if st.cmp.note else [])

    def profile(self, ctx: CheckContext, st) -> None:
        """Operators, modules and the tensor-memory peak of each phase, in repeats of their own after
        the timed ones and the re-measurement; then the tensor-memory peaks against the baseline's."""
        st.profile = meas.profile_phases(st.wl, ctx.backend, st.cfg.phases, st.cfg.profile_repeats)
        for phase, p in st.profile.items():
            ctx.metric(f"{phase}_tensor_peak_bytes", p["memory"]["peak_bytes"])
        st.cmp.memory = judge.memory_regressions(st.profile, st.cmp.base_profile, st.cfg.memory_threshold)
        if st.cmp.memory:
            st.cmp.status = "regression"
        # operators judged on their own repeats; a suspect is profiled once more before it counts
        st.ops = judge.operator_verdicts(st.cmp, st.profile, st.cfg, lambda ph: meas.profile_phases(
            st.wl, ctx.backend, [ph], st.cfg.profile_repeats)[ph])
        for phase, rec in st.ops.items():
            if "worst_op_change" in rec:
                ctx.metric(f"{phase}_worst_op_change", rec["worst_op_change"])
            ctx.notes.extend(f"perf {phase} {what}: {why}" for what, why in rec["held"].items())
            ctx.notes.extend([f"perf {phase}: {rec['note']}"] if rec["note"] else [])

    def record(self, ctx: CheckContext, st) -> None:
        summary = {m: stats.summarize(v).to_dict() for m, v in st.samples.items()}
        st.verdict, figures = judge.verdict(st.cmp, summary, st.clock, st.fp, st.roof, st.cfg.memory_threshold)
        st.verdict["operators"] = st.ops
        for name, v in figures.items():
            ctx.metric(name, v)
        item = {"suite": ctx.suite.name, "key": st.key, "backend": ctx.backend.name, "dtype": ctx.dtype,
                "variant": ctx.variant}
        try:
            path = store.write_sidecar(judge.sidecar(item, st.fp, st.pin, st.shape, st.calib, st.samples, st.ref,
                                                     summary, st.memory, st.roof, st.verdict, st.profile),
                                       st.results_dir)
            ctx.detail("perf_samples", str(path))
        except OSError as e:  # the figures are in the details anyway
            ctx.notes.append(f"perf samples not written: {e}")
        for k, v in judge.details(summary, st.verdict, st.fp, st.pin, st.roof, st.work).items():
            ctx.detail(k, v)
        if st.cmp.status in ("no-baseline", "incomparable"):
            ctx.notes.append(f"perf: {st.cmp.status}")
        ctx.notes.extend(f"perf {m}: {why}" for m, why in st.cmp.held.items())

    def verdict(self, ctx: CheckContext, st) -> None:
        if not st.cfg.fail_on_regression:
            return
        found = judge.failure(st.cmp, st.verdict, st.clock, st.roof, st.profile, st.cfg.memory_threshold, st.ops)
        if found is None:
            return
        if found.where is not None:
            ctx.detail("perf_where", found.where)
        raise CheckFailure(found.message, **found.fields)


def register(registry: CheckRegistry) -> None:
    registry.add(PerfCheck())
