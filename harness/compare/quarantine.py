"""The quarantine: items confirmed flaky, which still run and report but fail no job and file no
failure issue, until ``reenable_after`` clean runs in a row give them back (docs/ci.md).

The record is one JSON file (``quarantine_file`` in harness.toml, default ``quarantine.json``) that
the comparator maintains (``harness compare --quarantine FILE``) and ``harness run`` reads (a
quarantined item that fails is reported as ``quarantined``: in the JUnit XML still a failure, with
the property ``harness.detail.quarantined``; the run's exit status ignores it). A person edits it
with ``harness quarantine list|add|remove``. PyTorch's CI keeps the same record as "DISABLED" issues;
here the flaky issue the comparator files for the suite x backend (kind ``flaky``) is the visible
side, and it closes once the item is re-enabled and stays clean.

.. code-block:: json

    {"format": 1, "items": {
      "suites.kimi-k2.toml::smoke[npu-bfloat16]": {
        "since": "2026-12-04", "reason": "flaky: failed 1 of 3 attempts (rate 0.33)",
        "rate": 0.333, "clean": 1, "by": "harness compare", "expires": "2027-01-03"}}}

Per comparison (:func:`update`), for every item of the run:

* quarantined, passed at its first attempt: one more clean run; at ``reenable_after`` it leaves the
  quarantine (*re-enabled*) and counts again from the next run;
* quarantined, failed or needed a rerun: its clean count goes back to 0 (``last_flake`` dated);
* past its ``expires`` date (default ``since`` + 30 days; ``harness quarantine add --days``): it leaves
  the quarantine whatever its state (*expired*), as mutes expire: nothing stays hidden for good;
* not quarantined, flaky (failed in one attempt, passed in another: harness's own reruns, or
  pytest-rerunfailures): quarantined now.

Items absent from the run (another shard missing, deselected) are left as they are. A deterministic
failure is never quarantined: it is a regression.
"""

from __future__ import annotations

import datetime as dt
import json
import os
from dataclasses import asdict, dataclass, field

from harness.compare.junit import Case, Results, attempt_counts
from harness.files import atomic

FORMAT = 1
REENABLE_AFTER = 3  # clean runs in a row before a quarantined item counts again
EXPIRE_DAYS = 30  # a quarantine ends by itself after this, clean or not: nothing stays hidden for good


class QuarantineError(Exception):
    """The quarantine file cannot be read (one line): never silently an empty quarantine."""


@dataclass
class Entry:
    since: str  # ISO date it was quarantined
    reason: str
    rate: float | None = None  # failed attempts / attempts when it was quarantined
    clean: int = 0  # clean runs in a row since it was quarantined (or since it last flaked)
    by: str = "harness compare"  # the owner: who answers for it (harness compare, or a person's name)
    last_flake: str = ""  # ISO date of the last run it failed or needed a rerun in
    expires: str = ""  # ISO date after which it is no longer quarantined ("": since + EXPIRE_DAYS)

    def expiry(self) -> dt.date:
        if self.expires:
            return dt.date.fromisoformat(self.expires)
        return dt.date.fromisoformat(self.since) + dt.timedelta(days=EXPIRE_DAYS)

    def active(self, today: dt.date | None = None) -> bool:
        return (today or dt.date.today()) <= self.expiry()


@dataclass
class Change:
    op: str  # quarantined | reenabled | flaked | clean
    key: str
    text: str


@dataclass
class Quarantine:
    items: dict[str, Entry] = field(default_factory=dict)

    def __contains__(self, key: str) -> bool:
        return key in self.items

    def get(self, key: str, today: dt.date | None = None) -> Entry | None:
        """The entry of an item that is quarantined now (an expired one is not)."""
        e = self.items.get(key)
        return e if e is not None and e.active(today) else None


def key_of(test: str) -> str:
    """A pytest node id (``suites/x.toml::smoke[cpu-float32]``) or a JUnit key
    (``suites.x.toml::smoke[cpu-float32]``) -> the JUnit key the comparator and the file use."""
    test = test.strip()
    head = test.split("::", 1)[0]
    if "/" not in head:
        return test
    from _pytest.junitxml import mangle_test_address  # pytest's mangling, as the JUnit writers use

    names = mangle_test_address(test)
    return ".".join(names[:-1]) + "::" + names[-1]


def load(path: str | os.PathLike | None) -> Quarantine:
    """The quarantine in ``path``; a missing file (or no path) is an empty one."""
    if not path or not os.path.exists(path):
        return Quarantine()
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise QuarantineError(f"{path}: cannot read the quarantine file: {e}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("items"), dict):
        raise QuarantineError(f"{path}: not a harness quarantine file of format {FORMAT} "
                              '(expected {"format": 1, "items": {...}})')
    out = Quarantine()
    for key, raw in data["items"].items():
        if not isinstance(raw, dict):
            raise QuarantineError(f"{path}: item {key!r}: expected an object, got {type(raw).__name__}")
        try:
            e = Entry(**raw)
        except TypeError as err:
            raise QuarantineError(f"{path}: item {key!r}: {err}") from None
        if not isinstance(e.clean, int) or e.clean < 0 or not isinstance(e.since, str):
            raise QuarantineError(f"{path}: item {key!r}: 'clean' must be a count and 'since' a date")
        try:
            e.expiry()
        except (TypeError, ValueError):
            raise QuarantineError(f"{path}: item {key!r}: 'since' / 'expires' are not dates (YYYY-MM-DD)") from None
        out.items[key] = e
    return out


def save(path: str | os.PathLike, q: Quarantine) -> None:
    atomic.write_json(path, {"format": FORMAT, "items": {k: asdict(v) for k, v in sorted(q.items.items())}},
                      indent=1)


def _flaky(case: Case) -> bool:
    return case.flaky or case.details.get("confirm") == "flaky"


def update(q: Quarantine, current: Results, reenable_after: int = REENABLE_AFTER,
           today: dt.date | None = None) -> list[Change]:
    """Apply one run to the quarantine (in place); what changed, one line each."""
    day = (today or dt.date.today()).isoformat()
    changes: list[Change] = []
    for key in sorted(k for k, e in q.items.items() if not e.active(today)):
        e = q.items.pop(key)  # its failures count again: an expired quarantine hides nothing
        changes.append(Change("expired", key, f"quarantine expired on {e.expiry()} (owner {e.by}, since {e.since}); "
                                              "its failures count again"))
    for key, case in sorted(current.cases.items()):
        if case.outcome == "skipped":
            continue  # not run here: neither clean nor flaky
        entry = q.items.get(key)
        failed_attempts, n = attempt_counts(case)
        if entry is not None:
            if case.outcome == "passed" and failed_attempts == 0:
                entry.clean += 1
                if entry.clean >= reenable_after:
                    del q.items[key]
                    changes.append(Change("reenabled", key, f"re-enabled after {entry.clean} clean runs in a row "
                                                            f"(quarantined since {entry.since})"))
                else:
                    changes.append(Change("clean", key, f"clean run {entry.clean} of {reenable_after}"))
            else:
                entry.clean, entry.last_flake = 0, day
                what = "failed" if case.outcome != "passed" else f"failed {failed_attempts} of {n} attempts"
                changes.append(Change("flaked", key, f"{what} while quarantined; clean count back to 0"))
        elif _flaky(case) and case.details.get("confirm") != "infrastructure":
            rate = failed_attempts / max(n, 1)
            entry = Entry(since=day, reason=f"flaky: failed {failed_attempts} of {n} attempts "
                                            f"(rate {rate:.2f})", rate=round(rate, 3), last_flake=day)
            entry.expires = entry.expiry().isoformat()
            q.items[key] = entry
            changes.append(Change("quarantined", key, f"quarantined: {entry.reason}; re-enabled after "
                                                      f"{reenable_after} clean runs in a row"))
    return changes
