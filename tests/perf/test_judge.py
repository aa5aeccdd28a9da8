"""The perf check's judging steps as library functions, on figures built here: a memory regression
is recorded as a finding shaped like the timing decisions and fails with the module that grew; no
baseline is said, not judged."""

from __future__ import annotations

from types import SimpleNamespace

from harness.perf import judge
from harness.perf.decide import decide

MEM = {"change": 0.25, "module": "model.layers.0.mlp", "module_bytes": 4096, "peak_bytes": 5 * 2**20,
       "base_peak_bytes": 4 * 2**20}
ROOF = {"fractions": {"prefill_mfu": 0.1}}


def test_a_memory_regression_is_a_finding_and_the_failure_names_the_module():
    c = judge.Comparison(baseline_why="baseline of class x", memory={"prefill": MEM})
    verdict, figures = judge.verdict(c, {}, "cpu", {"backend": "cpu"}, ROOF, 0.01)
    entry = verdict["metrics"]["prefill_tensor_peak_bytes"]
    assert entry["verdict"] == "regression" and entry["calibrated_ratio"] == 1.25 and figures == {}
    assert verdict["memory"] == {"prefill": MEM} and verdict["roofline"] == ROOF["fractions"]
    f = judge.failure(c, verdict, "cpu", ROOF, {}, 0.01)
    assert f.message == "prefill tensor-memory peak grew +25.0% (4.00 -> 5.00 MiB): model.layers.0.mlp holds +4.0 KiB more at the peak"
    assert f.fields["metric"] == "prefill_tensor_peak_bytes" and "baseline of class x" in f.fields["details"]
    assert f.where is None


def test_a_confirmed_timing_regression_fails_with_its_table_and_an_unchanged_one_passes():
    now, then = [2.0 + i * 0.01 for i in range(8)], [1.0 + i * 0.01 for i in range(8)]
    c = judge.Comparison(status="regression", baseline_why="b")
    c.decisions["prefill_s"] = decide("prefill_s", now, then, threshold=0.05, alpha=0.01)
    c.decided["prefill_s"] = ("prefill_s", now, then)
    verdict, figures = judge.verdict(c, {}, "wall", {}, ROOF, 0.01)
    assert set(figures) == {"prefill_s_p_value", "prefill_s_change"} and figures["prefill_s_change"] > 0.9
    f = judge.failure(c, verdict, "wall", ROOF, {}, 0.01)
    assert f.message.startswith("prefill_s regressed +")
    assert "medians on the wall clock" in f.fields["details"] and "prefill_mfu 10.0%" in f.fields["details"]
    assert judge.failure(judge.Comparison(), verdict, "wall", ROOF, {}, 0.01) is None


def test_no_baseline_is_said(tmp_path):
    c = judge.compare("no-such-suite", "cpu-float32-b1-s8", {"backend": "cpu"}, tmp_path, {}, "cpu", None, {}, {}, {},
                      None, None)
    assert c.status == "no-baseline" and c.note == c.baseline_why and "harness baseline update" in c.note


def _baseline(tmp_path, runs: int) -> tuple[dict, object]:
    """A baseline of ``runs`` processes (``runs`` results dirs pooled by `harness baseline update`)."""
    from harness.backends import get
    from harness.perf import baseline as store
    from harness.perf import fingerprint as fpmod

    fp = fpmod.fingerprint(get("cpu"), threads=1)
    cal = {"dtype": "float32", "matmul_shape": [128, 1024, 1024], "matvec_shape": [4096, 4096],
           "copy_bytes": 32 << 20, "clock": "wall", "samples": {"calib_matmul_s": [0.010] * 5}}
    dirs = []
    for r in range(runs):
        rec = {"suite": "s", "key": "cpu-float32-b1-s8", "backend": "cpu", "dtype": "float32", "variant": "b1-s8",
               "fingerprint": fp, "class": fpmod.class_key(fp), "shape": {"batch": 1}, "calibration": cal,
               "reference": {"prefill": {"calib_matmul_s": [0.010 + i * 1e-5 for i in range(10)]}},
               "samples": {"prefill_s": [0.100 + (i + r) * 1e-4 for i in range(10)]}}
        store.write_sidecar(rec, tmp_path / f"r{r}")
        dirs.append(tmp_path / f"r{r}")
    store.update(dirs, tmp_path / "golden")
    return fp, cal


def _again(monkeypatch, samples: list[float], kernel: list[float]) -> SimpleNamespace:
    """The re-measure as the machine gives it (judge.remeasure's interleaved phase and reference kernel),
    given here: the rule judging it is what these tests are about. Returns the ``kernels`` argument."""
    monkeypatch.setattr(judge, "phase_samplers", lambda wl: {"prefill": None})
    monkeypatch.setattr(judge, "interleaved", lambda fns, n: [{"prefill_s": list(samples)},
                                                              {"calib_matmul_s": list(kernel)}])
    return SimpleNamespace(for_phase=lambda phase: None)


def _compare(tmp_path, now: list[float], kernel: list[float], kernels):
    from harness.checks.perf import PerfConfig

    fp, cal = _baseline(tmp_path, runs=3)
    c = judge.compare("s", "cpu-float32-b1-s8", fp, tmp_path / "golden", {"batch": 1}, "wall", PerfConfig(),
                      {"prefill_s": now}, {"prefill": {"calib_matmul_s": kernel}}, cal, object(), kernels)
    verdict, _ = judge.verdict(c, {}, "wall", fp, ROOF, 0.01)
    return c, verdict, judge.failure(c, verdict, "wall", ROOF, {}, 0.01)


KERNEL = [0.010 + i * 1e-5 for i in range(10)]  # the baseline's own reference kernel level


def test_a_regression_the_re_measure_does_not_show_is_not_confirmed(tmp_path, monkeypatch):
    kernels = _again(monkeypatch, [0.1003 + i * 1e-4 for i in range(10)], KERNEL)  # back at the baseline
    c, verdict, f = _compare(tmp_path, [0.108 + i * 1e-4 for i in range(10)], KERNEL, kernels)
    d = c.decisions["prefill_s"]
    assert c.first["prefill_s"].verdict == "regression"
    assert d.verdict == "unchanged" and d.why.startswith("suspected (+7.") and "not confirmed on re-measure" in d.why
    assert f is None and c.status == "unchanged"
    kernels = _again(monkeypatch, [0.109 + i * 1e-4 for i in range(10)], KERNEL)  # slower again: confirmed
    c, verdict, f = _compare(tmp_path / "again", [0.108 + i * 1e-4 for i in range(10)], KERNEL, kernels)
    assert c.decisions["prefill_s"].verdict == "regression" and "confirmed on re-measure" in f.message


def test_one_too_noisy_to_judge_alone_is_re_measured_and_filed_where_the_re_measure_is_a_regression(
        tmp_path, monkeypatch):
    # first: raw +4 % against a calibration kernel 6 % faster with a 10 % spread: calibrated +11 %, within
    # threshold + spread, so too noisy to judge (before, never measured again); the re-measure, the kernel
    # steady, reads +14 % with every hold passed: filed, the first's "too noisy" said beside it
    wide = [0.0085 + i * 2e-4 for i in range(10)]
    kernels = _again(monkeypatch, [0.114 + i * 1e-4 for i in range(10)], KERNEL)
    c, verdict, f = _compare(tmp_path, [0.104 + i * 1e-4 for i in range(10)], wide, kernels)
    d = c.decisions["prefill_s"]
    assert c.first["prefill_s"].verdict == "noisy" and c.first["prefill_s"].why.startswith("too noisy to judge")
    assert d.verdict == "regression" and "the first measurement was too noisy to judge" in d.why, d.why
    assert f is not None and "confirmed on re-measure" in f.message and c.status == "regression"
    assert verdict["metrics"]["prefill_s"]["decided"]["samples"] == "prefill_s_remeasured"
    assert verdict["metrics"]["prefill_s"]["first"]["verdict"] == "noisy"
    # a clean re-measure leaves it too noisy to judge, said with what the re-measure read; nothing filed
    kernels = _again(monkeypatch, [0.1003 + i * 1e-4 for i in range(10)], KERNEL)
    c, verdict, f = _compare(tmp_path / "clean", [0.104 + i * 1e-4 for i in range(10)], wide, kernels)
    d = c.decisions["prefill_s"]
    assert d.verdict == "noisy" and "; re-measured: " in d.why and f is None, d.why
    assert verdict["held"]["prefill_s"].startswith("too noisy to judge")


def test_a_faster_raw_run_against_a_quicker_kernel_is_held_as_too_noisy(tmp_path, monkeypatch):
    # raw 3 % faster, the kernel 9 % faster still: only the calibration makes it slower, measured twice
    quick = [0.0091 + i * 1e-5 for i in range(10)]
    kernels = _again(monkeypatch, [0.097 + i * 1e-4 for i in range(10)], quick)
    c, verdict, f = _compare(tmp_path, [0.097 + i * 1e-4 for i in range(10)], quick, kernels)
    d = c.decisions["prefill_s"]
    assert c.runs == 3 and d.verdict == "noisy" and c.status == "unchanged", d.why
    assert verdict["held"]["prefill_s"].startswith("too noisy to judge") and verdict["baseline_runs"] == 3
    assert f is None  # nothing filed


def test_a_baseline_of_one_process_holds_a_small_slowdown_as_thin(tmp_path):
    from harness.checks.perf import PerfConfig

    fp, cal = _baseline(tmp_path, runs=1)
    now = {"prefill_s": [0.110 + i * 1e-4 for i in range(10)]}  # +10%, the kernel unchanged
    ref = {"prefill": {"calib_matmul_s": [0.010 + i * 1e-5 for i in range(10)]}}
    c = judge.compare("s", "cpu-float32-b1-s8", fp, tmp_path / "golden", {"batch": 1}, "wall", PerfConfig(), now,
                      ref, cal, None, None)
    assert c.runs == 1 and c.decisions["prefill_s"].verdict == "thin-baseline" and c.status == "unchanged"
    assert c.held["prefill_s"].startswith("baseline too thin")


def test_first_decisions_are_the_comparisons_before_any_re_measure(tmp_path):
    """first_decisions is compare's own first step (benchmarks/bench_perf_holds.py judges recorded trials
    with it): a 30 % slower run is a regression there, with the baseline it was judged against; the
    re-measure that compare would run next is not run."""
    from harness.checks.perf import PerfConfig

    fp, cal = _baseline(tmp_path, runs=3)
    now = {"prefill_s": [0.130 + i * 1e-4 for i in range(10)]}
    ref = {"prefill": {"calib_matmul_s": [0.010 + i * 1e-5 for i in range(10)]}}
    c, base = judge.first_decisions("s", "cpu-float32-b1-s8", fp, tmp_path / "golden", {"batch": 1}, "wall",
                                    PerfConfig(), now, ref, cal)
    assert base is not None and base["samples"]["prefill_s"] and c.runs == 3
    assert c.decisions["prefill_s"].verdict == "regression" and not c.first  # nothing re-measured
    c, base = judge.first_decisions("s", "cpu-float32-b1-s8", fp, tmp_path / "golden", {"batch": 2}, "wall",
                                    PerfConfig(), now, ref, cal)
    assert base is None and c.status == "incomparable" and "another workload" in c.note


def test_only_a_hold_a_re_measure_can_tell_apart_gets_one():
    # a spell of the machine (raw samples faster, a calibration kernel noisier than the threshold) can be
    # told apart by a re-measure interleaved with its kernel; the baseline processes' spread cannot: the
    # re-measure runs at this process's level (tried: a clean ttft_s first +14.6 %, re-measured +22 %, filed)
    then = [0.100 + i * 1e-4 for i in range(30)]
    now = [0.112 + i * 1e-4 for i in range(10)]
    by_process = decide("prefill_s", now, then, threshold=0.05, alpha=0.01, process_spread=0.10)
    by_raw = decide("prefill_s", [0.099 + i * 1e-4 for i in range(10)], then, threshold=0.05, alpha=0.01,
                    kernel_ratio=0.85)
    by_spread = decide("prefill_s", [0.104 + i * 1e-4 for i in range(10)], then, threshold=0.05, alpha=0.01,
                       kernel_ratio=0.94, kernel_spread=0.10)
    assert [d.held_by for d in (by_process, by_raw, by_spread)] == ["process", "raw", "spread"]
    assert all(d.verdict == "noisy" for d in (by_process, by_raw, by_spread))
    assert [judge.remeasured(d) for d in (by_process, by_raw, by_spread)] == [False, True, True]
    assert judge.remeasured(decide("prefill_s", now, then, threshold=0.05, alpha=0.01))  # a regression
    assert not judge.remeasured(decide("prefill_s", then[:10], then, threshold=0.05, alpha=0.01))
