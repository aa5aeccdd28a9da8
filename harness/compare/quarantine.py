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

* quarantined, passed at its first attempt: one more clean run; once the clean runs in a row are
  evidence that it no longer flakes at the rate it showed (:func:`needed`; never fewer than
  ``reenable_after``) it leaves the quarantine (*re-enabled*) and counts again from the next run;
* quarantined, failed or needed a rerun: its clean count goes back to 0 (``last_flake`` dated);
* past its ``expires`` date (default ``since`` + 30 days; ``harness quarantine add --days``): it leaves
  the quarantine whatever its state (*expired*), as mutes expire: nothing stays hidden for good;
* not quarantined, flaky (failed in one attempt, passed in another: harness's own reruns, or
  pytest-rerunfailures): quarantined now.

**Re-enabling on evidence, not a count.** A fixed count of clean runs says nothing about a flaky
item: a test that flakes in 1 run of 4 passes 3 in a row with probability 0.75^3 = 0.42, so it was
re-enabled, flaked, was quarantined again, and its issue closed and reopened all month. Each entry
keeps the record its flake rate is estimated from (``runs`` it ran in, ``flakes``: runs it failed or
flaked in; seeded from the history's last runs when it is quarantined). With ``p`` the rate it showed
up to its last flake, it is re-enabled after ``n`` clean runs in a row when either

* ``(1 - p)^n < ALPHA``: were it still flaking at rate ``p``, so long a clean streak would be that
  unlikely (p = 0.25: 11 runs; a record shorter than ``MIN_RECORD`` runs is read as that long, as one
  flake in an item's first run proves no rate of 1, and would re-enable it after 1 clean run); or
* the one-sided ``1 - ALPHA`` binomial (Clopper-Pearson) upper bound of its rate over all its runs is
  at most ``TOLERABLE``: a rare flake (1 in 40 runs) is re-enabled after a few clean runs, where the
  first rule would ask for 119.

Items absent from the run (another shard missing, deselected) are left as they are. A deterministic
failure is never quarantined: it is a regression.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
from dataclasses import asdict, dataclass, field

from harness.compare.junit import Case, Results, attempt_counts
from harness.files import atomic

FORMAT = 1
REENABLE_AFTER = 3  # the fewest clean runs in a row before a quarantined item counts again
ALPHA = 0.05  # re-enabled when a streak this unlikely under its old flake rate, or its rate bounded so
TOLERABLE = 0.10  # a flake rate low enough to run unquarantined (upper bound at 1 - ALPHA)
MIN_RECORD = 8  # a shorter record is read as this many runs: 1 flake in its 1st run is 1 in 8, not 1 in 1
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
    runs: int = 0  # runs it ran in, the quarantining one and its recent history included ...
    flakes: int = 0  # ... and how many of them it failed or flaked in (0/0 in an older file: 1/1)

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
        if not all(isinstance(v, int) and 0 <= v < 10**6 for v in (e.clean, e.runs, e.flakes)) \
                or not isinstance(e.since, str):
            raise QuarantineError(f"{path}: item {key!r}: 'clean', 'runs' and 'flakes' must be counts "
                                  "(0 to 999999) and 'since' a date")
        try:
            e.expiry()
        except (TypeError, ValueError):
            raise QuarantineError(f"{path}: item {key!r}: 'since' / 'expires' are not dates (YYYY-MM-DD)") from None
        out.items[key] = e
    return out


def save(path: str | os.PathLike, q: Quarantine) -> None:
    atomic.write_json(path, {"format": FORMAT, "items": {k: asdict(v) for k, v in sorted(q.items.items())}},
                      indent=1)


def upper_bound(flakes: int, runs: int, alpha: float = ALPHA) -> float:
    """One-sided ``1 - alpha`` Clopper-Pearson upper bound of a rate seen ``flakes`` times in ``runs``:
    the rate p at which seeing at most ``flakes`` has probability ``alpha`` (bisection)."""
    if runs <= 0 or flakes >= runs:
        return 1.0
    lo, hi = flakes / runs, 1.0
    for _ in range(60):
        p = (lo + hi) / 2
        cdf = sum(math.comb(runs, k) * p**k * (1 - p) ** (runs - k) for k in range(flakes + 1))
        lo, hi = (p, hi) if cdf > alpha else (lo, p)
    return hi


def _record(e: Entry) -> tuple[int, int, int]:
    """(flakes, runs, runs up to its last flake); an entry of an older file counts as 1 flake in 1 run."""
    flakes, runs = max(e.flakes, 1), max(e.runs, e.clean + 1, 1)
    return flakes, runs, max(runs - e.clean, flakes)


def needed(e: Entry, floor: int = REENABLE_AFTER) -> int:
    """Clean runs in a row that re-enable ``e`` (counting from its last flake): the fewer of what
    bounds the rate it showed and what bounds its rate below TOLERABLE, never fewer than ``floor``."""
    flakes, _runs, shown = _record(e)
    p = flakes / max(shown, MIN_RECORD)
    n_rate = math.ceil(math.log(ALPHA) / math.log1p(-p) - 1e-9)
    n_tol = next((n for n in range(n_rate) if upper_bound(flakes, shown + n) <= TOLERABLE), n_rate)
    return max(floor, min(n_rate, n_tol))


def _flaky(case: Case) -> bool:
    return case.flaky or case.details.get("confirm") == "flaky"


def update(q: Quarantine, current: Results, reenable_after: int = REENABLE_AFTER,
           today: dt.date | None = None, prior: dict[str, tuple[int, int]] | None = None) -> list[Change]:
    """Apply one run to the quarantine (in place); what changed, one line each. ``reenable_after``:
    the fewest clean runs that re-enable an item; ``prior``: per item, ``(runs, flakes)`` in the
    history's recent runs before this one (harness.compare.history.History.item_record)."""
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
        if entry is not None:
            changes.append(_held(q, key, entry, case, reenable_after, day))
        elif _flaky(case) and case.details.get("confirm") != "infrastructure":
            changes.append(_quarantine(q, key, case, reenable_after, day, (prior or {}).get(key, (0, 0))))
    return changes


def _held(q: Quarantine, key: str, entry: Entry, case: Case, reenable_after: int, day: str) -> Change:
    """One run of a quarantined item: clean (and maybe re-enabled) or flaked."""
    failed_attempts, n = attempt_counts(case)
    entry.runs = max(entry.runs, entry.clean + 1, 1) + 1
    if case.outcome == "passed" and failed_attempts == 0:
        entry.clean += 1
        want = needed(entry, reenable_after)
        if entry.clean >= want:
            del q.items[key]
            return Change("reenabled", key, f"re-enabled after {entry.clean} clean runs in a row "
                                            f"(quarantined since {entry.since}; {_evidence(entry)})")
        return Change("clean", key, f"clean run {entry.clean} of {want}")
    entry.clean, entry.last_flake = 0, day
    entry.flakes = max(entry.flakes, 1) + 1
    what = "failed" if case.outcome != "passed" else f"failed {failed_attempts} of {n} attempts"
    return Change("flaked", key, f"{what} while quarantined; clean count back to 0 "
                                 f"({_evidence(entry)}: {needed(entry, reenable_after)} clean runs re-enable it)")


def _quarantine(q: Quarantine, key: str, case: Case, reenable_after: int, day: str,
                prior: tuple[int, int]) -> Change:
    failed_attempts, n = attempt_counts(case)
    rate = failed_attempts / max(n, 1)
    entry = Entry(since=day, reason=f"flaky: failed {failed_attempts} of {n} attempts (rate {rate:.2f})",
                  rate=round(rate, 3), last_flake=day, runs=prior[0] + 1, flakes=prior[1] + 1)
    entry.expires = entry.expiry().isoformat()
    q.items[key] = entry
    return Change("quarantined", key, f"quarantined: {entry.reason}; {_evidence(entry)}: re-enabled after "
                                      f"{needed(entry, reenable_after)} clean runs in a row")


def _evidence(e: Entry) -> str:
    flakes, runs, _shown = _record(e)
    return f"flaked in {flakes} of its last {runs} runs"
