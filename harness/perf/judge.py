"""The perf check's judging steps as library functions (harness/checks/perf.py calls them): the
comparison with the baseline of this suite and machine class (calibrated ratio + Mann-Whitney, a
suspected regression re-measured once, interleaved with its calibration kernel), the tensor-memory
peaks against the baseline's, the verdict and samples records, and the failure's message and table.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from harness import metrics
from harness.perf import baseline as store
from harness.perf import calibrate as calib
from harness.perf import fingerprint as fpmod
from harness.perf import stats
from harness.perf.decide import HELD, Decision, decide
from harness.perf.measure import PHASE_OF, phase_samplers, samples_key
from harness.perf.timing import interleaved


@dataclass
class Comparison:
    """What the comparison with the baseline found (``status``: unchanged, improvement, regression,
    no-baseline or incomparable; ``note``: what to tell the user where none was compared)."""

    status: str = "unchanged"
    baseline_why: str = ""
    note: str | None = None
    decisions: dict[str, Decision] = field(default_factory=dict)
    first: dict[str, Decision] = field(default_factory=dict)  # the first decision of a re-measured metric
    # metric -> (samples key, samples decided on, baseline samples): the decision's own clock, the
    # re-measured samples where the check measured again
    decided: dict[str, tuple[str, list[float], list[float]]] = field(default_factory=dict)
    ratios: dict[str, float | None] = field(default_factory=dict)  # metric -> calibration kernel ratio
    base_profile: dict = field(default_factory=dict)
    memory: dict[str, dict] = field(default_factory=dict)  # phase -> its tensor-memory regression
    spreads: dict[str, float | None] = field(default_factory=dict)  # metric -> calibration kernel spread
    runs: int = 1  # processes the baseline's samples come from (baseline.runs)

    @property
    def held(self) -> dict[str, str]:
        """Metrics the rule called regressions that the machine or the baseline cannot back
        (decide.HELD: too noisy to judge, baseline too thin), with why: noted, never filed."""
        return {m: d.why for m, d in self.decisions.items() if d.verdict in HELD}


def _incomparable(why: str, status: str = "incomparable") -> Comparison:
    return Comparison(status=status, baseline_why=why, note=why)


def _decide(m: str, now: list[float], then: list[float], cfg, ratio: float | None, c: Comparison) -> Decision:
    return decide(m, now, then, direction=metrics.direction(m), threshold=cfg.thresholds.get(m, cfg.threshold),
                  alpha=cfg.alpha, kernel_ratio=ratio, kernel_spread=c.spreads.get(m), baseline_runs=c.runs,
                  thin_margin=getattr(cfg, "thin_margin", None))


def compare(suite: str, key: str, fp: dict, golden_root, shape: dict, clock: str, cfg, samples: dict, ref: dict,
            cal: dict, wl, kernels) -> Comparison:
    """Every timed metric against the baseline; a suspected regression re-measured (``remeasure``:
    ``samples`` and ``ref`` get the re-measured samples, as the sidecar records them)."""
    base, why = store.find_baseline(suite, key, fp, golden_root)
    if base is None:
        return _incomparable(why, "incomparable" if "incomparable" in why else "no-baseline")
    bcal = base.get("calibration") or {}
    if base.get("shape") != shape:
        return _incomparable(f"baseline measured another workload ({base.get('shape')}, now {shape}); not compared")
    if bcal.get("clock", "wall") != clock:
        return _incomparable(f"baseline timed on the {bcal.get('clock', 'wall')} clock, this run on the {clock} clock")
    timed_metrics = [m for m in PHASE_OF if samples_key(clock, m) in samples]
    ratios = {m: (calib.kernel_ratio(m, cal, bcal, ref, base.get("reference"), clock) if cfg.calibrate else None)
              for m in timed_metrics}
    wild = {m: r for m, r in ratios.items() if r and not 1 / cfg.max_kernel_ratio <= r <= cfg.max_kernel_ratio}
    if wild:
        m, r = next(iter(wild.items()))
        return _incomparable(f"this machine runs the calibration kernel of {m} in {r:.2f}x the baseline's time "
                             f"(limit {cfg.max_kernel_ratio}x): not comparable; {why}")
    c = Comparison(baseline_why=why, ratios=ratios, base_profile=base.get("profile") or {}, runs=store.runs(base))
    c.spreads = {m: (calib.kernel_spread(m, cal, bcal, ref, base.get("reference"), clock) if cfg.calibrate else None)
                 for m in timed_metrics}
    for m in timed_metrics:
        k = samples_key(clock, m)
        c.decided[m] = (k, samples[k], base["samples"].get(k, []))
        c.decisions[m] = _decide(m, samples[k], base["samples"].get(k, []), cfg, ratios[m], c)
    suspected = [m for m, d in c.decisions.items() if d.verdict == "regression"]
    if suspected:
        remeasure(c, suspected, base, clock, cfg, samples, ref, cal, wl, kernels)
    verdicts = {d.verdict for d in c.decisions.values()}
    c.status = "regression" if "regression" in verdicts else "improvement" if "improvement" in verdicts else "unchanged"
    return c


def remeasure(c: Comparison, suspected: list[str], base: dict, clock: str, cfg, samples: dict, ref: dict, cal: dict,
              wl, kernels) -> None:
    """Once more, in this run: the phase's samples interleaved with its reference kernel's (a-b-a-b),
    so a slow spell of the machine shows up in both. Only a regression that holds again is reported;
    the first decision is kept beside it."""
    fns = phase_samplers(wl)
    for phase in dict.fromkeys(PHASE_OF[m] for m in suspected):
        if phase == "decode" and "prefill_s" not in samples:
            wl.prefill_sample()
        got, kern = interleaved([fns[phase], kernels.for_phase(phase)], cfg.remeasure_repeats)
        if phase == "train":
            wl.release_training()
        ref[f"{phase}_remeasured"] = kern
        for k, v in got.items():
            samples[f"{k}_remeasured"] = v
        for m in (x for x in suspected if PHASE_OF[x] == phase):
            k = samples_key(clock, m)
            r = (calib.kernel_ratio(m, cal, base.get("calibration") or {}, {phase: kern}, base.get("reference"), clock)
                 if cfg.calibrate else None)
            c.first[m] = c.decisions[m]
            c.decided[m] = (f"{k}_remeasured", got[k], base["samples"][k])
            c.spreads[m] = (calib.kernel_spread(m, cal, base.get("calibration") or {}, {phase: kern},
                                                base.get("reference"), clock) if cfg.calibrate else None)
            c.decisions[m] = d = _decide(m, got[k], base["samples"][k], cfg, r, c)
            if d.verdict != "regression":
                d.why = f"suspected ({c.first[m].why}) but not confirmed on re-measure: {d.why}"


def memory_regressions(profile: dict, base_profile: dict, threshold: float) -> dict[str, dict]:
    """Tensor-memory peak per phase against the baseline's: counted exactly (no noise), so any growth
    over ``threshold`` is a regression, named by the module that holds the extra bytes at the peak."""
    from harness.perf import profile as prof  # torch.profiler: loaded by the items that profile

    out = {}
    for phase, now in (profile or {}).items():
        ex = prof.explain(now, base_profile.get(phase))
        mem = ex and ex["memory"]
        if mem and mem["change"] > threshold:
            out[phase] = mem
    return out


def _memory_entry(phase: str, mem: dict, threshold: float) -> dict:
    """A memory regression shaped as the timing decisions are, so the comparator files it as the same
    kind of performance finding (counted, not sampled: n = 1, no p)."""
    return {"metric": f"{phase}_tensor_peak_bytes", "verdict": "regression", "direction": "lower",
            "ratio": 1 + mem["change"], "calibrated_ratio": 1 + mem["change"], "change": mem["change"],
            "kernel_ratio": 1.0, "threshold": threshold, "n_current": 1, "n_baseline": 1,
            "why": f"tensor-memory peak {mem['change']:+.1%} (counted exactly); at the peak {mem['module']} "
                   f"holds {mem['module_bytes']:+,} bytes more",
            "decided": {"clock": "counted", "now": {"median": mem["peak_bytes"]},
                        "baseline": {"median": mem["base_peak_bytes"]}}}


def verdict(c: Comparison, summary: dict, clock: str, fp: dict, roof: dict, memory_threshold: float
            ) -> tuple[dict, dict[str, float]]:
    """The verdict record (every decision with what it read, the roofline, the memory regressions)
    and the metrics it adds: each decision's p-value and calibrated change."""
    out = {"status": c.status, "baseline": c.baseline_why, "class": fpmod.class_key(fp), "metrics": {}}
    figures: dict[str, float] = {}
    for m, d in c.decisions.items():
        entry = d.to_dict()
        if m in c.first:
            entry["first"] = c.first[m].to_dict()
        entry["summary"] = summary.get(m)
        if m in c.decided:  # what the decision read, on its clock: now and baseline side by side
            key, now, then = c.decided[m]
            entry["decided"] = {"clock": clock, "samples": key, "now": stats.summarize(now).to_dict(),
                                "baseline": stats.summarize(then).to_dict()}
        out["metrics"][m] = entry
        if math.isfinite(d.p_value):
            figures[f"{m}_p_value"] = d.p_value
        if math.isfinite(d.calibrated_ratio):
            figures[f"{m}_change"] = d.calibrated_ratio - 1
    out["roofline"] = roof["fractions"]
    out["baseline_runs"] = c.runs
    if c.held:  # not regressions: what the check could not judge, said (the comparator files none)
        out["held"] = c.held
    for phase, mem in c.memory.items():
        out["metrics"][f"{phase}_tensor_peak_bytes"] = _memory_entry(phase, mem, memory_threshold)
    if c.memory:
        out["memory"] = c.memory
    return out, figures


def sidecar(item: dict, fp: dict, pin, shape: dict, cal: dict, samples: dict, ref: dict, summary: dict,
            memory: dict, roof: dict, verdict: dict, profile: dict) -> dict:
    """The samples sidecar (results/perf/): ``item`` (suite, key, backend, dtype, variant) and every
    figure of the run, the re-measured samples apart."""
    return {**item, "fingerprint": fp, "class": fpmod.class_key(fp), "pinning": pin.to_dict(), "shape": shape,
            "calibration": cal,
            "samples": {m: v for m, v in samples.items() if not m.endswith("_remeasured")},
            "remeasured": {m: v for m, v in samples.items() if m.endswith("_remeasured")},
            "reference": {k: v for k, v in ref.items() if not k.endswith("_remeasured")},
            "reference_remeasured": {k: v for k, v in ref.items() if k.endswith("_remeasured")},
            "summary": summary, "memory": memory, "roofline": roof, "verdict": verdict, "profile": profile}


def details(summary: dict, verdict: dict, fp: dict, pin, roof: dict, work) -> dict[str, str]:
    """The JUnit details of the run, in recording order."""
    compact = {"separators": (",", ":")}
    return {
        "perf_summary": json.dumps({m: {k: s[k] for k in ("n", "median", "q1", "q3", "iqr", "ci_low", "ci_high")}
                                    for m, s in summary.items()}, **compact),
        "perf_verdict": json.dumps(verdict, default=str, **compact),
        "perf_fingerprint": json.dumps(fp, sort_keys=True, **compact),
        "perf_class": fpmod.class_key(fp),
        "perf_pinning": json.dumps(pin.to_dict(), **compact),
        "perf_roofline": json.dumps({k: v for k, v in roof.items() if k != "work"} | {"work": work.to_dict()},
                                    default=str, **compact),
    }


def fmt_s(v: float) -> str:
    return f"{v * 1e3:.3g} ms" if v < 1 else f"{v:.3g} s"


@dataclass
class Failure:
    message: str
    fields: dict  # CheckFailure's metric, expected, observed, tolerance, details
    where: str | None = None  # the perf_where detail (JSON), where a profile names what grew


def _memory_failure(c: Comparison, threshold: float) -> Failure:
    phase, mem = max(c.memory.items(), key=lambda kv: kv[1]["change"])
    holder = f": {mem['module']} holds {mem['module_bytes'] / 2**10:+.1f} KiB more at the peak" if mem["module"] else ""
    return Failure(
        f"{phase} tensor-memory peak grew {mem['change']:+.1%} ({mem['base_peak_bytes'] / 2**20:.2f} -> "
        f"{mem['peak_bytes'] / 2**20:.2f} MiB){holder}",
        dict(metric=f"{phase}_tensor_peak_bytes", expected=f"<= {1 + threshold:.2f}x baseline "
             f"({mem['base_peak_bytes']} bytes)", observed=f"{mem['peak_bytes']} bytes", tolerance=threshold,
             details=f"module holding the extra bytes at the peak: {mem['module']}\nbaseline: {c.baseline_why}"))


def failure(c: Comparison, verdict: dict, clock: str, roof: dict, profile: dict, memory_threshold: float
            ) -> Failure | None:
    """A confirmed regression's failure (the worst one, with the table of every regressed metric and
    where the phase's profile grew against the baseline's; ``verdict`` gets the ``where``), else a
    memory regression's; None if there is neither."""
    from harness.perf import profile as prof

    bad = [d for d in c.decisions.values() if d.verdict == "regression"]
    if not bad and not c.memory:
        return None
    if not bad:
        return _memory_failure(c, memory_threshold)
    lines = [f"medians on the {clock} clock",
             f"{'metric':<16} {'now':>10} {'baseline':>10} {'change':>8} {'p':>8}  IQR now      roofline"]
    for d in bad:
        # Both medians on the decision's clock (the CPU clock on a one-thread cpu run).
        dec = verdict["metrics"][d.metric].get("decided") or {}
        s, b = dec.get("now") or {}, dec.get("baseline") or {}
        b_med = b.get("median", math.nan)
        frac = {"prefill_s": "prefill_mfu", "ttft_s": "prefill_mfu", "decode_token_s": "decode_mbu",
                "train_step_s": "train_mfu"}.get(d.metric)
        fr = roof["fractions"].get(frac)
        lines.append(f"{d.metric:<16} {fmt_s(s.get('median', math.nan)):>10} {fmt_s(b_med):>10} "
                     f"{d.change:>+8.1%} {d.p_value:>8.2g}  {fmt_s(s.get('iqr', math.nan)):<12} "
                     + (f"{frac} {fr:.1%}" if fr is not None else ""))
    worst = max(bad, key=lambda d: d.change)
    # where: the phase's profile against the baseline's, calibrated by the phase's kernel ratio
    phase = PHASE_OF[worst.metric]
    ex = prof.explain((profile or {}).get(phase), (c.base_profile or {}).get(phase), (c.ratios or {}).get(worst.metric))
    where, where_detail = "", None
    if ex is not None:
        lines += ["", *prof.lines(ex, phase)]
        where = prof.headline(ex)
        where = f"; where: {where}" if where else ""
        verdict["where"] = {"phase": phase, **ex}
        where_detail = json.dumps(verdict["where"], separators=(",", ":"), default=str)
    elif profile:
        lines += ["", "where: the baseline has no profile (taken before profiles were recorded); "
                  "`harness baseline update` with this run adds one"]
    for ph, mem in c.memory.items():
        lines.append(f"{ph} tensor-memory peak {mem['change']:+.1%}: {mem['module']} holds "
                     f"{mem['module_bytes'] / 2**10:+.1f} KiB more")
    return Failure(
        f"{worst.metric} regressed {worst.change:+.1%} (calibrated, p={worst.p_value:.2g}, confirmed on "
        f"re-measure) against the baseline of this machine class{where}",
        dict(metric=worst.metric, expected=f"<= {1 + worst.threshold:.2f}x baseline",
             observed=f"{worst.calibrated_ratio:.3f}x", tolerance=worst.threshold,
             details="\n".join(lines + ["", f"baseline: {c.baseline_why}"])), where_detail)
