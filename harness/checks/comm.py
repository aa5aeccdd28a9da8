"""Check ``comm``: the backend's collective library, measured (issue #30 item 4).

One item per world size (``comm[cpu-float32-w2]``): one launch of that many ranks over the backend's
collective library (harness/perf/comm.py: all-reduce, all-gather, reduce-scatter, all-to-all,
broadcast, send/recv at each message size), algorithm and bus bandwidth as nccl-tests defines them,
compared with the baseline of this machine class by the perf check's rule (harness.perf.decide: the
threshold *and* one-sided Mann-Whitney), per collective and size, on each launch's fastest half
calibrated by that launch's other collectives (harness/perf/commjudge.py ``judge``: one launch's
samples share its load). A collective that is slower at at least half its sizes is a regression named
by collective, with its bandwidth then and now; what the machine was too noisy to back is noted.

Steps: ``setup`` -> ``launch`` (torchrun through harness.launch, the whole tree killed at ``timeout_s``;
results written before teardown) -> ``bandwidth`` (algbw / busbw per collective and size; metrics) ->
``compare`` -> ``record`` (samples sidecar, `harness baseline update` takes it like a perf one) -> ``verdict``.

Off by default (``[checks.comm] enabled = true``: the bundled llama-3.1-8b suite has it) and nightly:
the measurement is the backend's, not a model's, so one suite carrying it is enough.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Literal

from pydantic import Field, field_validator

from harness import metrics
from harness.checks import (
    Check,
    CheckConfig,
    CheckContext,
    CheckFailure,
    CheckRegistry,
    CouldNotRun,
    NotApplicable,
)
from harness.messages import first_line
from harness.perf import baseline as store
from harness.perf import commjudge, stats
from harness.perf import fingerprint as fpmod
from harness.perf.comm import COLLECTIVES, bandwidths

for _c in COLLECTIVES:
    metrics.declare(f"comm_{_c}_busbw", "bytes/s", "higher", f"comm: {_c} bus bandwidth at the largest size (nccl-tests)")
    metrics.declare(f"comm_{_c}_latency_s", "s", "lower", f"comm: {_c} median time at the smallest size")

metrics.declare("comm_pair_round_trip_s", "s", "lower", "comm: the slowest pair of ranks' median round trip "
                "(pair_bytes each way): a slow link between nodes")
metrics.declare("comm_launch_s", "s", "none", "comm: wall time of the launch (ranks' start, measurement, teardown)")

Collective = Literal["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv"]


class CommConfig(CheckConfig):
    """Collective bandwidth of the backend's communication library against a per-machine-class baseline."""

    enabled: bool = Field(False, description="Off by default: one suite carrying it measures the backend.")
    scope: Literal["commit", "nightly"] = Field("nightly", description="Nightly by default.")
    world_sizes: list[int] = Field(default_factory=lambda: [2], description="One item (one launch) per world size.")
    collectives: list[Collective] = Field(default_factory=lambda: list(COLLECTIVES),
                                          description="Collectives measured (nccl-tests' names).")
    sizes: list[int] = Field(default_factory=lambda: [4096, 65536, 1 << 20, 16 << 20], json_schema_extra={"max": 1 << 32},
                             description="Message sizes in bytes (nccl-tests' size: see harness/perf/comm.py).")
    warmup: int = Field(3, ge=0, description="Untimed rounds (a round: one call of every collective at every size).")
    repeats: int = Field(10, ge=3, description="Timed rounds: the samples of each collective and size.")
    threshold: float = Field(0.25, gt=0, description="Relative slowdown that may count as a regression: a shared "
                             "CPU's collectives vary more than its matmuls.")
    alpha: float = Field(0.01, gt=0, lt=1, description="Mann-Whitney significance level.")
    pair_bytes: int = Field(65536, ge=0, le=1 << 26, description="Round trips of this many bytes between every "
                            "pair of ranks (pair/<i>-<j>): a slow link between two nodes is named by its pair; 0: off.")
    thin_margin: float = Field(1.0, gt=0, description="Against a baseline of one launch's samples, a slowdown "
                               "within this margin is noted as 'baseline too thin', not a regression: pool several "
                               "launches (harness baseline update DIR1 DIR2 ...) to judge smaller ones.")
    timeout_s: float = Field(300.0, gt=0, description="Limit of the launch.")
    remeasure: bool = Field(True, description="A suspected regression (a collective, or a link) is measured again "
                            "by a second launch and filed only where it is slower again: one launch's samples share "
                            "one load level, and a scheduler tick that held one collective for a whole launch is not "
                            "repeated by the next (harness/perf/commjudge.py ``confirmed``). A collective one launch "
                            "was too noisy to judge is judged again on both launches pooled (``merge``).")
    fail_on_regression: bool = Field(True, description="A regression fails the item.")

    @field_validator("world_sizes", "sizes")
    @classmethod
    def _positive(cls, v: list[int]) -> list[int]:
        if not v or any(x < 1 for x in v):
            raise ValueError(f"must be a non-empty list of positive integers, got {v}")
        return v


class CommCheck(Check):
    name = "comm"
    order = 95
    config_model = CommConfig
    description = "Collective bandwidth of the backend's library (nccl-tests' algbw / busbw) against a baseline."
    headline = ("comm_all_reduce_busbw", "comm_all_gather_busbw")
    exclusive = True  # timings: nothing else of the run on the machine meanwhile
    statistical_verdict = True  # a slower collective is decided by its statistics: never rerun by --confirm
    steps = ("setup", "launch", "bandwidth", "compare", "record", "verdict")
    setup_steps = ("setup", "launch")

    def variants(self, suite, backend) -> list[str | None]:
        return [f"w{n}" for n in self.config(suite).world_sizes]

    def new_state(self, ctx: CheckContext):
        # Options: results_dir / golden_root redirect files; delay {collective: seconds} slows one
        # collective inside the ranks (tests).
        # link_rate {node: Mbit/s}: that node's link of a multi-node rehearsal throttled (tests).
        return SimpleNamespace(results_dir=None, golden_root=None, delay=None, link_rate=None, again_raw=None,
                               remeasure="", noisy=[])

    def setup(self, ctx: CheckContext, st) -> None:
        st.cfg = ctx.config
        st.world = int((ctx.variant or "w2")[1:])
        if st.world < 2:
            raise NotApplicable("a collective needs at least 2 ranks")
        if ctx.backend.device_type != "cpu":
            mod = ctx.backend._mod()
            count = getattr(mod, "device_count", lambda: 0)() if mod is not None else 0
            if count < st.world:
                raise NotApplicable(f"{st.world} ranks need {st.world} {ctx.backend.device_type} devices; "
                                    f"this machine has {count}")
        st.key = store.item_key(ctx.backend.name, ctx.dtype, ctx.variant)
        st.fp = fpmod.fingerprint(ctx.backend, 1)

    def launch(self, ctx: CheckContext, st) -> None:
        st.raw, wall, teardown = _launch(ctx, st)
        ctx.metric("comm_launch_s", wall)
        if teardown:  # a teardown abort after complete results (gloo/DTensor): said, not failed
            ctx.notes.append(teardown)

    def bandwidth(self, ctx: CheckContext, st) -> None:
        st.pairs = {k: statistics.median(v) for k, v in st.raw["samples"].items() if k.startswith("pair/")}
        if st.pairs:
            ctx.metric("comm_pair_round_trip_s", max(st.pairs.values()))
            ctx.detail("comm_pairs", json.dumps({k: {"median_s": t, "link": self._link(st, k)} for k, t in
                                                 st.pairs.items()}, separators=(",", ":")))
        st.table = _table(st.raw)
        for coll in st.cfg.collectives:
            rows = sorted((r for r in st.table.values() if r["collective"] == coll), key=lambda r: r["size"])
            if rows:
                ctx.metric(f"comm_{coll}_busbw", rows[-1]["busbw"])
                ctx.metric(f"comm_{coll}_latency_s", rows[0]["median_s"])

    def compare(self, ctx: CheckContext, st) -> None:
        st.decisions, st.regressed, st.slow_pairs, st.status = {}, {}, {}, "unchanged"
        base, why = store.find_baseline(ctx.suite.name, st.key, st.fp, st.golden_root)
        st.baseline_why = why
        if base is None:
            st.status = "incomparable" if "incomparable" in why else "no-baseline"
            ctx.notes.append(why)
            return
        if base.get("shape") != self._shape(st):
            st.status, st.baseline_why = "incomparable", f"baseline measured another grid ({base.get('shape')}); not compared"
            ctx.notes.append(st.baseline_why)
            return
        # each collective and size by its own samples, each launch calibrated by its own load (commjudge.judge)
        self._judge(st, base)
        ctx.notes.extend(f"comm {k}: {why}" for k, why in commjudge.held(st.decisions).items())
        if st.slow_pairs and len(set(st.raw.get("hosts") or [])) < 2:  # one host: no link between nodes to name
            ctx.notes.extend(f"comm {k}: {d.why} (ranks on one host: no link; not a regression)"
                             for k, d in st.slow_pairs.items())
            st.slow_pairs = {}
        st.noisy = [c for c in commjudge.noisy(st.decisions, st.cfg.collectives) if c not in st.regressed]
        if (st.regressed or st.slow_pairs or st.noisy) and st.cfg.remeasure:
            self._remeasure(ctx, st, base)
        st.status = "regression" if st.regressed or st.slow_pairs else "unchanged"
        if st.status == "unchanged" and (noisy := commjudge.noisy(st.decisions, st.cfg.collectives)):
            st.status = "noisy"  # said, not filed: the machine could not back what the rule saw
            ctx.notes.append(f"comm: too noisy to judge {', '.join(noisy)} (sizes held: see the notes above)")

    @staticmethod
    def _decide(st, raw: dict, base: dict) -> dict:
        return commjudge.judge(raw["samples"], base, raw.get("backend", ""), threshold=st.cfg.threshold,
                               alpha=st.cfg.alpha, thin_margin=st.cfg.thin_margin)

    def _judge(self, st, base: dict) -> None:
        st.decisions = self._decide(st, st.raw, base)
        st.regressed = commjudge.regressed(st.decisions, st.cfg.collectives)
        st.slow_pairs = {k: d for k, d in st.decisions.items() if k.startswith("pair/") and d.verdict == "regression"}

    def _remeasure(self, ctx: CheckContext, st, base: dict) -> None:
        """A second launch, judged alike: what it does not find slower again is noted, not filed
        (commjudge.confirmed). The failure is told from the first launch, the evidence; the second's
        samples go to the sidecar beside them. A collective the first launch was too noisy to judge
        is judged again on both launches pooled (``_pooled``)."""
        try:
            raw, wall, _ = _launch(ctx, st)
        except CouldNotRun as e:
            # the first launch's finding stands, filed unconfirmed: a second launch that died is no evidence
            # either way, and turning the item into "could not run" lost what the first launch measured
            st.remeasure = f"not re-measured: the second launch failed ({first_line(e)})"
            ctx.detail("comm_remeasure", json.dumps({"failed": e.message}, separators=(",", ":")))
            ctx.notes.append(f"comm: {st.remeasure}; filed on the first launch alone")
            return
        st.remeasure = "confirmed on re-measure"
        again = self._decide(st, raw, base)
        st.regressed, gone = commjudge.confirmed(st.regressed, again)
        pooled = self._pooled(ctx, st, base, raw, again)
        kept = {k: d for k, d in st.slow_pairs.items() if k in again and commjudge.slower(again[k])}
        gone += [f"{k} {d.change:+.1%}" for k, d in st.slow_pairs.items() if k not in kept]
        st.slow_pairs, st.again_raw = kept, raw
        ctx.detail("comm_remeasure", json.dumps({"launch_s": wall, "confirmed": sorted(st.regressed) + sorted(kept),
                                                 "not_repeated": gone, "pooled": pooled}, separators=(",", ":")))
        if gone:
            ctx.notes.append("comm: slower in one launch, not on re-measure (not filed): " + "; ".join(gone))

    def _pooled(self, ctx: CheckContext, st, base: dict, raw: dict, again: dict) -> list[str]:
        """The collectives the first launch was too noisy to judge, judged on both launches pooled and
        filed as commjudge.pooled_findings says; their pooled decisions replace the first launch's."""
        if not st.noisy:
            return []
        found, decisions = commjudge.pooled_findings([st.raw["samples"], raw["samples"]], again, st.noisy, base,
                                                     st.raw.get("backend", ""), threshold=st.cfg.threshold,
                                                     alpha=st.cfg.alpha, thin_margin=st.cfg.thin_margin)
        if found and not st.regressed:  # every finding is a pooled one: the failure says so
            st.remeasure = "regressed on two launches pooled (one alone too noisy to judge), slower in the second too"
        st.decisions.update(decisions)
        st.regressed.update(found)
        if found:
            ctx.notes.append("comm: too noisy to judge on one launch, regressed on two pooled: " + ", ".join(found))
        if rest := [c for c in st.noisy if c not in found]:
            ctx.notes.append("comm: too noisy to judge on one launch and on two pooled: " + ", ".join(rest))
        return sorted(found)

    @staticmethod
    def _shape(st) -> dict:
        shape = {"world": st.world, "collectives": list(st.cfg.collectives), "sizes": list(st.cfg.sizes),
                 "repeats": st.cfg.repeats}
        if st.cfg.pair_bytes:
            shape["pair_bytes"] = st.cfg.pair_bytes
        if getattr(st, "nodes", 1) > 1:  # a link between nodes is another machine than one host's
            shape["nodes"] = st.nodes
        return shape

    @staticmethod
    def _link(st, key: str) -> str:
        return commjudge.link_name(st.raw.get("hosts") or [], key)

    def record(self, ctx: CheckContext, st) -> None:
        verdict = {"status": st.status, "baseline": st.baseline_why, "class": fpmod.class_key(st.fp),
                   "regressed": {c: sorted(b) for c, b in st.regressed.items()},
                   "held": commjudge.held(st.decisions),  # noted, not regressions: noisy or thin
                   "decisions": {k: d.to_dict() for k, d in st.decisions.items()}}
        rec = {"suite": ctx.suite.name, "key": st.key, "backend": ctx.backend.name, "dtype": ctx.dtype,
               "variant": ctx.variant, "fingerprint": st.fp, "class": fpmod.class_key(st.fp),
               "shape": self._shape(st), "samples": st.raw["samples"],
               "summary": {k: stats.summarize(v).to_dict() for k, v in st.raw["samples"].items()},
               "bandwidth": st.table, "verdict": verdict, "calibration": {}, "reference": {}}
        if st.again_raw is not None:  # re-measured: the second launch's samples beside the first's
            rec["remeasure_samples"] = st.again_raw["samples"]
        try:
            ctx.detail("comm_samples", str(store.write_sidecar(rec, st.results_dir)))
        except OSError as e:
            ctx.notes.append(f"comm samples not written: {e}")
        ctx.detail("comm_table", json.dumps(st.table, separators=(",", ":")))
        ctx.detail("comm_verdict", json.dumps(verdict, separators=(",", ":"), default=str))

    def verdict(self, ctx: CheckContext, st) -> None:
        if not st.cfg.fail_on_regression:
            return
        # A link is the finding only when it localizes: some pairs slower, others not (their collectives
        # slow with it). Every pair slower (one pair of two ranks, or the whole machine) is no link: the
        # collectives' own verdict leads then.
        if st.slow_pairs and (len(st.slow_pairs) < len(st.pairs) or not st.regressed):
            self._link_verdict(st)
        if st.regressed:
            self._collective_verdict(st)

    def _link_verdict(self, st) -> None:
        msg, fields = commjudge.link_failure(st.slow_pairs, st.pairs, st.raw.get("hosts") or [], st.cfg.threshold,
                                             st.baseline_why, st.remeasure, list(st.regressed))
        raise CheckFailure(msg, **fields)

    def _collective_verdict(self, st) -> None:
        msg, fields = commjudge.collective_failure(st.regressed, st.decisions, st.table, len(st.cfg.sizes),
                                                   st.cfg.threshold, st.baseline_why, st.raw.get("backend", ""),
                                                   st.remeasure)
        raise CheckFailure(msg, **fields)


def _launch(ctx: CheckContext, st) -> tuple[dict, float, str]:
    """(the ranks' results, the launch's wall seconds, a note on a teardown abort or '')."""
    from harness.files import atomic
    from harness.launch.nodes import launched, spans

    cfg = st.cfg
    st.nodes = spans(st.world)
    with tempfile.TemporaryDirectory(prefix="harness-comm-") as d:
        spec = {"backend": ctx.backend.collective, "device_type": ctx.backend.device_type, "dtype": ctx.dtype,
                "collectives": list(cfg.collectives), "sizes": list(cfg.sizes), "warmup": cfg.warmup,
                "repeats": cfg.repeats, "out": "out/rank0.json", "delay": st.delay or {},
                "pair_bytes": cfg.pair_bytes}
        atomic.write_json(Path(d) / "spec.json", spec)
        # Through the launch layer: at the time limit the whole tree is killed (torchrun puts its
        # ranks in sessions of their own: killing torchrun alone, before, left ranks hung in a
        # collective running past the item). With `harness run --nodes N` the ranks span N nodes.
        with launched("harness.perf.comm", Path(d) / "spec.json", st.world, link_rate_mbit=st.link_rate) as group:
            end = group.wait(deadline_s=cfg.timeout_s)
            why = group.describe()
        if end.how == "timeout":
            raise CouldNotRun(f"the {st.world}-rank launch did not finish in {cfg.timeout_s:g} s (a rank hung "
                              f"in a collective); {why}", step="launch")
        out = Path(d) / spec["out"]
        if not out.exists():  # results are written before teardown: none means the ranks failed
            raise CouldNotRun(f"the {st.world}-rank launch failed: {why}", step="launch")
        teardown = f"ranks exited {end.code} after writing complete results (teardown)" if end.code != 0 else ""
        return json.loads(out.read_text()), end.wall_s, teardown


def _table(raw: dict) -> dict:
    """``collective/size`` -> median time, algbw and busbw (nccl-tests' definitions) of one launch."""
    n, table = raw["world"], {}
    for key, samples in raw["samples"].items():
        if key.startswith("pair/"):
            continue
        coll, size = key.split("/")
        med = statistics.median(samples)
        alg, bus = bandwidths(coll, int(size), med, n)
        table[key] = {"collective": coll, "size": int(size), "median_s": med, "algbw": alg, "busbw": bus}
    return table


def register(registry: CheckRegistry) -> None:
    registry.add(CommCheck())
