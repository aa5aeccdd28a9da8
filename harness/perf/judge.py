"""The perf check's judging steps as library functions (harness/checks/perf.py calls them): the
comparison with the baseline of this suite and machine class (calibrated ratio + Mann-Whitney, a
suspected regression - or one too noisy to judge for a spell of the machine - re-measured once,
interleaved with its calibration kernel), the tensor-memory peaks against the baseline's, the verdict
and samples records, and the failure's message and table.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from functools import partial

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
    # metric -> half the range of the baseline processes' levels (baseline.process_spread)
    process_spreads: dict[str, float | None] = field(default_factory=dict)
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
                  thin_margin=getattr(cfg, "thin_margin", None), process_spread=c.process_spreads.get(m))


def compare(suite: str, key: str, fp: dict, golden_root, shape: dict, clock: str, cfg, samples: dict, ref: dict,
            cal: dict, wl, kernels) -> Comparison:
    """Every timed metric against the baseline; a suspected regression re-measured (``remeasure``:
    ``samples`` and ``ref`` get the re-measured samples, as the sidecar records them)."""
    c, base = first_decisions(suite, key, fp, golden_root, shape, clock, cfg, samples, ref, cal)
    if base is None:
        return c
    suspected = [m for m, d in c.decisions.items() if remeasured(d)]
    if suspected:
        remeasure(c, suspected, base, clock, cfg, samples, ref, cal, wl, kernels)
    verdicts = {d.verdict for d in c.decisions.values()}
    c.status = "regression" if "regression" in verdicts else "improvement" if "improvement" in verdicts else "unchanged"
    return c


def first_decisions(suite: str, key: str, fp: dict, golden_root, shape: dict, clock: str, cfg, samples: dict,
                    ref: dict, cal: dict) -> tuple[Comparison, dict | None]:
    """The comparison's first decisions, before any re-measure, and the baseline they were taken against
    (None: not compared, the Comparison says why). benchmarks/bench_perf_holds.py judges recorded trials
    with it, so the benchmark measures the check's own rule."""
    base, why = store.find_baseline(suite, key, fp, golden_root)
    if base is None:
        return _incomparable(why, "incomparable" if "incomparable" in why else "no-baseline"), None
    bcal = base.get("calibration") or {}
    if base.get("shape") != shape:
        return _incomparable(f"baseline measured another workload ({base.get('shape')}, now {shape}); not compared"), None
    if bcal.get("clock", "wall") != clock:
        return _incomparable(f"baseline timed on the {bcal.get('clock', 'wall')} clock, this run on the {clock} clock"), None
    timed_metrics = [m for m in PHASE_OF if samples_key(clock, m) in samples]
    ratios = {m: (calib.kernel_ratio(m, cal, bcal, ref, base.get("reference"), clock) if cfg.calibrate else None)
              for m in timed_metrics}
    wild = {m: r for m, r in ratios.items() if r and not 1 / cfg.max_kernel_ratio <= r <= cfg.max_kernel_ratio}
    if wild:
        m, r = next(iter(wild.items()))
        return _incomparable(f"this machine runs the calibration kernel of {m} in {r:.2f}x the baseline's time "
                             f"(limit {cfg.max_kernel_ratio}x): not comparable; {why}"), None
    c = Comparison(baseline_why=why, ratios=ratios, base_profile=base.get("profile") or {}, runs=store.runs(base))
    c.spreads = {m: (calib.kernel_spread(m, cal, bcal, ref, base.get("reference"), clock) if cfg.calibrate else None)
                 for m in timed_metrics}
    c.process_spreads = {m: store.process_spread(base, samples_key(clock, m)) for m in timed_metrics}
    for m in timed_metrics:
        k = samples_key(clock, m)
        c.decided[m] = (k, samples[k], base["samples"].get(k, []))
        c.decisions[m] = _decide(m, samples[k], base["samples"].get(k, []), cfg, ratios[m], c)
    return c, base


def remeasure(c: Comparison, suspected: list[str], base: dict, clock: str, cfg, samples: dict, ref: dict, cal: dict,
              wl, kernels) -> None:
    """Once more, in this run: the phase's samples interleaved with its reference kernel's (a-b-a-b),
    so a slow spell of the machine shows up in both. Only a regression that holds again (``confirm``) is
    reported; the first decision is kept beside it."""
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
            decide_again(c, m, base, clock, cfg, cal, got[samples_key(clock, m)], kern)


def remeasured(d: Decision) -> bool:
    """Whether a first decision gets a second measurement: a regression by the rule, and one the rule held
    as too noisy to judge for a spell of the machine (the raw samples or the calibration kernel's spread
    disagree), which a re-measure interleaved with its kernel can tell apart. Not one held for the
    baseline processes' spread: the re-measure runs in this process, at this process's level, and would
    repeat it (tried: it filed a clean ttft_s +22 %, first +14.6 % within 5 % + the 9.8 % process spread)."""
    return d.verdict == "regression" or (d.verdict == "noisy" and d.held_by in ("raw", "spread"))


def decide_again(c: Comparison, m: str, base: dict, clock: str, cfg, cal: dict, again: list[float],
                 kern: dict) -> Decision:
    """A suspect's decision once measured again (``again``, with ``kern``: its reference kernel's samples
    interleaved with it; ``confirm``); ``c`` gets the first decision beside it and what it read. Returns
    the decision (benchmarks/bench_perf_holds.py replays it from a trial's sidecar)."""
    phase, k = PHASE_OF[m], samples_key(clock, m)
    bcal, then = base.get("calibration") or {}, base["samples"][k]
    r = calib.kernel_ratio(m, cal, bcal, {phase: kern}, base.get("reference"), clock) if cfg.calibrate else None
    c.first[m] = c.decisions[m]
    c.spreads[m] = calib.kernel_spread(m, cal, bcal, {phase: kern}, base.get("reference"), clock) if cfg.calibrate else None
    c.decisions[m] = d = confirm(c.first[m], _decide(m, again, then, cfg, r, c))
    c.decided[m] = (f"{k}_remeasured", again, then)
    return d


def confirm(first: Decision, alone: Decision) -> Decision:
    """The decision once a suspect was measured again (``alone``: the re-measure by itself, every hold
    applied). A regression there confirms the first measurement's regression, as before, and also one the
    first could only call too noisy to judge (past the threshold and significant, but held): two
    measurements, each past the threshold with its own evidence, the second backed by its own interleaved
    kernel. Else the first's regression was not confirmed, or its "too noisy" stands, said with what the
    re-measure read."""
    if alone.verdict == "regression":
        if first.verdict == "noisy":
            alone.why += f"; the first measurement was too noisy to judge ({first.why})"
        return alone
    if first.verdict == "regression":
        alone.why = f"suspected ({first.why}) but not confirmed on re-measure: {alone.why}"
        return alone
    first.why += f"; re-measured: {alone.why}"
    return first


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


def failure(c: Comparison, verdict: dict, clock: str, roof: dict, profile: dict, memory_threshold: float,
            ops: dict | None = None) -> Failure | None:
    """A confirmed regression's failure (the worst one, with the table of every regressed metric and
    where the phase's profile grew against the baseline's; ``verdict`` gets the ``where``), else a
    memory regression's, else a confirmed operator regression's (``ops``: operator_verdicts); None
    if there is none."""
    from harness.perf import profile as prof

    bad = [d for d in c.decisions.values() if d.verdict == "regression"]
    if not bad:  # a memory regression is counted exactly: it leads an operator's (which it may cause)
        return _memory_failure(c, memory_threshold) if c.memory else operator_failure(c, ops or {})
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


# --- operators (and modules, own time) judged on their own samples (issue #51 item 2) ------------------
#
# Each profile repeat is one sample of every operator's time (profile.py ``op_samples``) and every module's
# own time (``modules_self_samples``), on the CPU clock on a CPU (profile._on_cpu_clock: the profiler's wall
# clock reads a scheduler's pause as a slower operator; a device's profile keeps the profiler's times). An
# operator holding at least ``op_min_share`` of the phase, ``op_min_time`` seconds per phase call and
# ``op_min_call_time`` per timed call in the baseline is judged by decide.decide, the phase's rule and
# holds, on those samples: its calibrated change (divided by the phase's calibration-kernel ratio, as
# ``explain`` does) past ``op_threshold`` with a one-sided Mann-Whitney p < alpha. The floors: timing an
# operator costs a few microseconds per call (the op clock ~2 us inside each call and ~5 us around it, the
# profiler 0.2-2 us per event plus ~1.7 us per child in its parent), as much as a ~17 us attention kernel
# itself, which the rule without a floor "confirmed" in 2 of ~60 clean reruns; and 40 calls of a 37 us
# operator (decode's aten::mean) pass 1 ms per phase call yet were confirmed +43% on a clean rerun at load
# ~9. At 100 us a call the ~2 us it costs is 2%, a tenth of ``op_threshold``.
# Evidence needs repeats: the smallest exact one-sided p of n samples against n is 1 / C(2n, n), 0.05 for
# 3 a side, so no operator could ever be significant at alpha 0.01; hence ``profile_repeats`` 5 (1/252 =
# 0.004), and fewer than alpha allows is said, not judged. A profile is one process's samples (a pooled
# baseline keeps its newest run's), so the thin-baseline hold always applies: ``op_threshold`` is at least
# ``thin_margin`` by default. Its share of the repeat must grow too (``_judge_one``), and a phase where
# more than a fifth of the judged moved past the threshold at once is too noisy to judge (the calibration
# kernels ran during the timed phases, not the profile). A suspected operator is profiled once more and
# must hold again, as a phase's regression is re-measured.


def _min_p(n: int, m: int) -> float:
    return 1 / math.comb(n + m, n) if n and m else 1.0


def _phase_metric(c: Comparison, phase: str) -> str | None:
    return next((m for m in c.ratios if PHASE_OF.get(m) == phase), None)


def _candidates(base: dict, min_share: float, min_time: float, min_call_time: float = 0.0
                ) -> tuple[list[tuple[str, str, float]], list[str]]:
    """(kind, name, baseline share) of the operators and modules (own time) big enough to judge: at least
    ``min_share`` of the phase's operators' (modules' own) time, ``min_time`` seconds per phase call and
    ``min_call_time`` per timed call where the profile counted calls (a module's: its own calls and the
    operator calls in its own time), medians of the baseline's repeats; and the names of those of the
    share but under a floor."""
    from harness.perf.profile import OTHER

    out, under = [], []
    calls, inner = base.get("calls") or {}, base.get("module_op_calls") or {}
    for kind, key, tot in (("operator", "op_samples", "total_samples"),
                           ("module", "modules_self_samples", "modules_self_total_samples")):
        total = stats.summarize(base.get(tot) or [math.nan]).median
        for name, xs in (base.get(key) or {}).items():
            med = stats.summarize(xs).median
            if name == OTHER or not total > 0 or not med / total >= min_share:
                continue
            # the floors: under them the timing's own cost is a sizeable part of what is measured
            # (op_min_time, op_min_call_time; docs/perf.md, "Profiles"): a 17 us kernel "regressed" on the
            # profiler's, a 37 us mean called 40 times per decode on the CPU clock's. Per timed call: a
            # module's own time holds its own call and every operator call it makes itself
            timed = (calls.get(name) or 0) + (inner.get(name, 0) if kind == "module" else 0)
            per_call = med / timed if timed else math.inf
            if med * 1e-6 >= min_time and per_call * 1e-6 >= min_call_time:
                out.append((kind, name, med / total))
            else:
                under.append(f"{kind} {name}")
    return out, under


def _samples(p: dict, kind: str, name: str) -> list[float]:
    """An operator's time (a module's own time) per repeat, us: on the CPU clock where the profile has
    one (profile.py ``_on_cpu_clock``), else the profiler's (a device's)."""
    return list(((p or {}).get("op_samples" if kind == "operator" else "modules_self_samples") or {}).get(name, []))


def _op_module(now: dict, base: dict, name: str, ratio: float) -> str | None:
    """The module an operator's growth sits in (as ``explain`` names it)."""
    wn, wb = (now.get("op_modules") or {}).get(name, {}), (base.get("op_modules") or {}).get(name, {})
    grown = {m: wn.get(m, 0.0) / ratio - wb.get(m, 0.0) for m in set(wn) | set(wb)}
    return max(grown, key=grown.get) if grown else None


def _judge_one(c: Comparison, cfg, phase: str, metric: str | None, base: dict, kind: str, name: str, share: float,
               now: dict) -> Decision:
    """The phase's rule and holds on one operator's (module's) profile repeats, now against the baseline's,
    and one hold more: its median share of the repeats must have grown too, by at least half what a
    slowdown of exactly the threshold gives an operator of its baseline ``share`` ((1 + t) / (1 + share
    t) - 1: 23% at 5% of the phase, 7% at two thirds), or the whole phase moved with it - the machine or
    the process, not the operator - and it is ``noisy``. Size only: the evidence is the time's, and a
    second test at alpha on the shares (whose every repeat carries the whole profile's noise) missed a
    planted +250% operator in 2 of 8 runs on a loaded machine."""
    cur, then = _samples(now, kind, name), _samples(base, kind, name)
    d = decide(f"{phase} {kind} {name}", cur, then, direction="lower", threshold=cfg.op_threshold, alpha=cfg.alpha,
               kernel_ratio=c.ratios.get(metric) if metric else None,
               kernel_spread=c.spreads.get(metric) if metric else None, baseline_runs=1,
               thin_margin=cfg.thin_margin)
    if d.verdict == "regression":
        tot = "total_samples" if kind == "operator" else "modules_self_total_samples"
        shares = [[v / t if t > 0 else math.nan for v, t in zip(xs, p.get(tot) or [], strict=False)]
                 for xs, p in ((cur, now), (then, base))]
        t = cfg.op_threshold
        need = ((1 + t) / (1 + share * t) - 1) / 2
        sd = decide("share", shares[0], shares[1], threshold=need, alpha=cfg.alpha)
        if not sd.change > need:
            d.verdict = "noisy"
            d.why = (f"too noisy to judge: {d.change:+.1%} calibrated (p={d.p_value:.2g}) but its share of the "
                     f"phase {sd.change:+.1%} (needs > {need:+.1%}): the phase moved with it; not a regression")
    return d


def _not_judgeable(base: dict, now: dict, alpha: float) -> str | None:
    """Why a phase's operators cannot be judged against ``base`` (None: they can): no per-repeat samples
    in the baseline, samples on another clock, or too few repeats to ever reach p < ``alpha``."""
    if "op_samples" not in base or base.get("clock") != now.get("clock"):
        return ((f"the baseline's operator samples are on the {base.get('clock') or 'wall'} clock, this run's "
                 f"on the {now.get('clock') or 'wall'}" if "op_samples" in base else
                 "the baseline has no per-repeat operator samples") + "; `harness baseline update` with this run adds them")
    n, nb = now.get("repeats", 0), base.get("repeats", 0)
    if not _min_p(n, nb) < alpha:
        return (f"operators not judged: {n} profile repeats against {nb} cannot reach p < {alpha} "
                f"(smallest p {_min_p(n, nb):.2g}); raise profile_repeats")
    return None


def operator_verdicts(c: Comparison, profile: dict, cfg, reprofile) -> dict[str, dict]:
    """Per phase: every operator and module (own time) of at least ``op_min_share`` of the baseline's
    phase, judged on its profile repeats (module comment above); ``reprofile(phase)`` profiles the
    phase once more to confirm a suspect. Returns phase -> {worst_op_change, judged, regressions
    (confirmed, worst first: operators before modules), held, note}."""
    out: dict[str, dict] = {}
    for phase, now in (profile or {}).items():
        base = (c.base_profile or {}).get(phase)
        rec: dict = {"judged": 0, "moved": 0, "regressions": [], "held": {},
                     "note": _not_judgeable(base, now, cfg.alpha) if base else None}
        out[phase] = rec
        if not base or rec["note"]:
            continue
        metric = _phase_metric(c, phase)
        ratio = c.ratios.get(metric) if metric else None
        r = ratio if ratio and ratio > 0 else 1.0
        judge_one = partial(_judge_one, c, cfg, phase, metric, base)
        first = {}
        judged, rec["under_floor"] = _candidates(base, cfg.op_min_share, cfg.op_min_time, cfg.op_min_call_time)
        for kind, name, share in judged:
            if not _samples(now, kind, name):
                continue  # gone from the profile (or below its top operators): not slower
            d = judge_one(kind, name, share, now)
            rec["judged"] += 1
            rec["moved"] += d.change > cfg.op_threshold
            if kind == "operator" and math.isfinite(d.change):
                rec["worst_op_change"] = max(rec.get("worst_op_change", -math.inf), d.change)
            if d.verdict in HELD:
                rec["held"][f"{kind} {name}"] = d.why
            elif d.verdict == "regression":
                first[(kind, name)] = (share, d)
        if not first:
            continue
        if rec["moved"] > max(3, rec["judged"] / 5):
            # one slower operator moves itself and the modules around it; many at once are the profile's
            # noise (a busy neighbour, the profiler's own overhead on microsecond operators), not a finding
            rec["note"] = (f"too noisy to judge operators: {rec['moved']} of {rec['judged']} judged moved past "
                           f"{cfg.op_threshold:.0%} at once; suspected, not filed: "
                           + ", ".join(f"{k} {n} {d.change:+.0%}" for (k, n), (_, d) in first.items()))
            continue
        again = reprofile(phase)  # once more: one noisy profile repeat never files
        rec["reprofiled"] = True
        for (kind, name), (share, d1) in first.items():
            d = judge_one(kind, name, share, again)
            if d.verdict != "regression":
                rec["held"][f"{kind} {name}"] = f"suspected ({d1.why}) but not confirmed on re-profile: {d.why}"
                continue
            rec["regressions"].append({
                "kind": kind, "name": name, "phase": phase, "share": share, "change": d.change,
                "first_change": d1.change, "p_value": d.p_value, "first_p_value": d1.p_value,
                "threshold": d.threshold, "kernel_ratio": d.kernel_ratio, "why": d.why,
                "module": _op_module(again, base, name, r) if kind == "operator" else name})
        rec["regressions"].sort(key=lambda x: (x["kind"] != "operator", -x["change"]))
    return out


def operator_failure(c: Comparison, ops: dict[str, dict]) -> Failure | None:
    """The worst confirmed operator (else module) regression's failure, its phase's own verdict said
    beside it; None without one."""
    found = [x for rec in ops.values() for x in rec["regressions"]]
    if not found:
        return None
    found.sort(key=lambda x: (x["kind"] != "operator", -x["change"]))
    w = found[0]
    metric = _phase_metric(c, w["phase"])
    d = c.decisions.get(metric) if metric else None
    if d is None or not math.isfinite(d.change):
        its = "its phase not compared"
    elif d.change <= d.threshold:
        its = f"its phase {d.change:+.1%}, under the {d.threshold:.0%} threshold"
    else:
        its = f"its phase {d.change:+.1%}, {d.verdict}"
    where = f" in {w['module']}" if w["kind"] == "operator" and w.get("module") else ""
    own = " (own time)" if w["kind"] == "module" else ""
    lines = [f"operators and modules judged on their own profile repeats (calibrated by the {metric} kernel "
             "ratio; first profile, then the re-profile that confirmed it)",
             f"  {'what':<58} {'share':>6} {'first':>8} {'again':>8} {'p':>8}  module"]
    for x in found:
        lines.append(f"  {(x['kind'] + ' ' + x['name'])[:58]:<58} {x['share']:>6.1%} {x['first_change']:>+8.1%} "
                     f"{x['change']:>+8.1%} {x['p_value']:>8.2g}  {x.get('module') or ''}")
    return Failure(
        f"{w['kind']} {w['name']}{where} regressed {w['change']:+.0%}{own} in {w['phase']} ({its}; "
        f"p={w['p_value']:.2g}, confirmed on re-profile)",
        dict(metric=f"{w['phase']}_worst_op_change", expected=f"<= {1 + w['threshold']:.2f}x baseline",
             observed=f"{1 + w['change']:.3f}x", tolerance=w["threshold"],
             details="\n".join(lines + ["", f"baseline: {c.baseline_why}"])),
        json.dumps({"phase": w["phase"], "operator": w}, separators=(",", ":"), default=str))
