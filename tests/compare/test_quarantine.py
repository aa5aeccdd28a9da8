"""The quarantine file's rules (harness.compare.quarantine): flaky in, K clean runs in a row out, a
flake while quarantined starts the count again, deterministic failures and infrastructure never go
in, items absent from a run are left alone, and a bad file is one clear line. The whole life cycle
through `harness ci-local` and a GitHub server is tests/ci/test_ci_local.py."""

from __future__ import annotations

import datetime as dt
import json

import pytest

from harness.compare import quarantine
from harness.compare.junit import Case, Results

KEY = "suites.a.toml::smoke[cpu-float32]"
OTHER = "suites.b.toml::smoke[cpu-float32]"


def case(key: str, outcome: str = "passed", attempts: list[str] | None = None, confirm: str = "",
         rerun_children: int = 0) -> Case:
    details = {}
    if attempts:
        details["confirm_attempts"] = json.dumps([{"outcome": a, "message": "", "seconds": 1} for a in attempts])
    if confirm:
        details["confirm"] = confirm
    return Case(key=key, name=key.split("::")[1], classname=key.split("::")[0], outcome=outcome,
                suite=key.split(".")[1], check="smoke", backend="cpu", dtype="float32", device="cpu", variant="",
                metrics={}, tolerances={}, details=details, flaky=outcome == "passed" and rerun_children > 0,
                attempts=1 + rerun_children)


def run(*cases: Case) -> Results:
    return Results(cases={c.key: c for c in cases})


def test_flaky_goes_in_and_clean_runs_bring_it_back():
    """One flake in its only run proves no rate of 1: read as 1 in MIN_RECORD = 8 runs, 0.875^23 < 0.05."""
    q = quarantine.Quarantine()
    day = dt.date(2026, 12, 4)
    ch = quarantine.update(q, run(case(KEY, "passed", ["failed", "passed", "passed"], "flaky", 1), case(OTHER)),
                           reenable_after=3, today=day)
    assert [(c.op, c.key) for c in ch] == [("quarantined", KEY)]
    e = q.items[KEY]
    assert e.since == "2026-12-04" and e.rate == 0.333 and "failed 1 of 3 attempts" in e.reason
    assert (e.runs, e.flakes) == (1, 1) and quarantine.needed(e, 3) == 23
    ops = []
    for _ in range(23):
        ops += [c.op for c in quarantine.update(q, run(case(KEY)), reenable_after=3, today=day)]
    assert ops == ["clean"] * 22 + ["reenabled"] and KEY not in q


def test_a_flake_while_quarantined_restarts_the_count_and_absence_changes_nothing():
    q = quarantine.Quarantine({KEY: quarantine.Entry(since="2026-12-01", reason="r", clean=2)})
    assert quarantine.update(q, run(case(OTHER)), reenable_after=3) == []  # not in this run (another shard)
    assert q.items[KEY].clean == 2
    quarantine.update(q, run(case(KEY, "skipped")), reenable_after=3)  # skipped: not a clean run either
    assert q.items[KEY].clean == 2
    (c,) = quarantine.update(q, run(case(KEY, "passed", ["failed", "passed", "passed"], "flaky", 1)),
                             reenable_after=3)
    assert c.op == "flaked" and "failed 1 of 3 attempts" in c.text and q.items[KEY].clean == 0
    (c,) = quarantine.update(q, run(case(KEY, "failed")), reenable_after=3)
    assert c.op == "flaked" and q.items[KEY].clean == 0


def test_deterministic_and_infrastructure_failures_are_never_quarantined():
    q = quarantine.Quarantine()
    ch = quarantine.update(q, run(case(KEY, "failed", ["failed"] * 3, "deterministic", 2),
                                  case(OTHER, "passed", ["error", "passed", "passed"], "infrastructure", 1)))
    assert ch == [] and not q.items


def test_pytest_rerunfailures_flakes_count_too():
    """A flaky case from JUnit rerun children alone (no harness attempt record) goes in."""
    q = quarantine.Quarantine()
    (c,) = quarantine.update(q, run(case(KEY, "passed", rerun_children=2)))
    assert c.op == "quarantined" and "failed 2 of 3 attempts" in q.items[KEY].reason


def test_the_file_round_trips_and_a_bad_one_is_one_line(tmp_path):
    p = tmp_path / "q.json"
    assert quarantine.load(p).items == {}  # missing: empty
    q = quarantine.Quarantine({KEY: quarantine.Entry(since="2026-12-04", reason="r", rate=0.5)})
    quarantine.save(p, q)
    assert quarantine.load(p).items == q.items
    for text, why in (("{", "cannot read the quarantine file"), ('{"format": 2, "items": {}}', "format 1"),
                      ('{"format": 1, "items": {"k": {"since": "x", "reason": "r", "colour": 1}}}', "item 'k'"),
                      ('{"format": 1, "items": {"k": {"since": "x", "reason": "r", "clean": -1}}}', "'clean'")):
        p.write_text(text)
        with pytest.raises(quarantine.QuarantineError, match=why) as e:
            quarantine.load(p)
        assert "\n" not in str(e.value)


def test_keys_are_the_comparators():
    assert quarantine.key_of("suites/a.toml::smoke[cpu-float32]") == KEY
    assert quarantine.key_of(KEY) == KEY
    assert quarantine.key_of("suites/a.toml::ops[cpu-float32-aten::mm.default]") == \
        "suites.a.toml::ops[cpu-float32-aten::mm.default]"


def test_a_quarantine_expires_and_names_its_owner():
    """Nothing stays hidden for good: past its expiry (default 30 days) an item leaves the quarantine
    whatever its state, and the run stops treating it as quarantined."""
    e = quarantine.Entry(since="2026-11-01", reason="r", by="vendor-ci-team")
    assert e.expiry() == dt.date(2026, 12, 1) and not e.active(dt.date(2026, 12, 4))
    q = quarantine.Quarantine({KEY: e, OTHER: quarantine.Entry(since="2026-12-01", reason="r", expires="2027-01-31")})
    assert q.get(KEY, dt.date(2026, 12, 4)) is None and q.get(OTHER, dt.date(2026, 12, 4)) is not None
    (c,) = quarantine.update(q, run(case(OTHER)), today=dt.date(2026, 12, 4))[:1]
    assert c.op == "expired" and c.key == KEY and "owner vendor-ci-team" in c.text and KEY not in q
    new = quarantine.Quarantine()
    quarantine.update(new, run(case(KEY, "passed", ["failed", "passed", "passed"], "flaky", 1)),
                      today=dt.date(2026, 12, 4))
    assert new.items[KEY].expires == "2027-01-03" and new.items[KEY].by == "harness compare"
