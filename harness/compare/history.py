"""The history of earlier runs: one SQLite file that CI carries between runs (cache or artifact).

What is kept, per run: every test's outcome, every metric that has a direction, and whether each
issue group was bad. Plus, across runs, which GitHub issue number belongs to which group
fingerprint, so a closed issue can be reopened without searching GitHub for it.

Losing the file is safe: classification falls back to the baseline alone, regressions need two
more runs to confirm, and a recurrence opens a new issue instead of reopening the old one.
"""

from __future__ import annotations

import sqlite3
import time
from collections import defaultdict
from dataclasses import dataclass

from harness.compare.junit import Results
from harness.metrics import direction

SCHEMA_VERSION = "1"
_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta(key TEXT PRIMARY KEY, value TEXT);
CREATE TABLE IF NOT EXISTS runs(id INTEGER PRIMARY KEY, run_key TEXT UNIQUE, commit_sha TEXT,
                                created REAL, url TEXT, machine TEXT);
CREATE TABLE IF NOT EXISTS tests(id INTEGER PRIMARY KEY, key TEXT UNIQUE, suite TEXT, backend TEXT);
CREATE TABLE IF NOT EXISTS outcomes(run_id INT, test_id INT, outcome TEXT,
                                    PRIMARY KEY(run_id, test_id)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS metrics(run_id INT, test_id INT, name TEXT, value REAL,
                                   PRIMARY KEY(run_id, test_id, name)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS groups(run_id INT, fingerprint TEXT, bad INT,
                                  PRIMARY KEY(run_id, fingerprint)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS issues(fingerprint TEXT PRIMARY KEY, number INT, state TEXT);
"""


@dataclass(frozen=True)
class RunInfo:
    id: int
    run_key: str
    commit: str
    created: float
    url: str


class History:
    def __init__(self, path: str):
        self.path = path
        self.db = sqlite3.connect(path)
        self.db.executescript(_SCHEMA)
        row = self.db.execute("SELECT value FROM meta WHERE key='schema'").fetchone()
        if row is None:
            self.db.execute("INSERT INTO meta VALUES('schema', ?)", (SCHEMA_VERSION,))
        elif row[0] != SCHEMA_VERSION:
            raise ValueError(f"{path}: history schema {row[0]}, this harness reads {SCHEMA_VERSION}")
        self.db.commit()

    def close(self) -> None:
        self.db.close()

    # ---- reading -------------------------------------------------------------------------------
    def runs(self, limit: int = 30, exclude_key: str | None = None) -> list[RunInfo]:
        """The latest ``limit`` runs, oldest first."""
        rows = self.db.execute(
            "SELECT id, run_key, commit_sha, created, url FROM runs WHERE run_key IS NOT ? "
            "ORDER BY id DESC LIMIT ?", (exclude_key, limit)).fetchall()
        return [RunInfo(*r) for r in reversed(rows)]

    def outcomes(self, run_id: int) -> dict[str, tuple[str, str, str]]:
        """``test key -> (outcome, suite, backend)`` of one run."""
        return {k: (o, s, b) for k, o, s, b in self.db.execute(
            "SELECT t.key, o.outcome, t.suite, t.backend FROM outcomes o JOIN tests t "
            "ON t.id = o.test_id WHERE o.run_id = ?", (run_id,))}

    def metric_series(self, run_ids: list[int]) -> dict[tuple[str, str], list[float]]:
        """``(test key, metric) -> values``, oldest first, over the given runs (missing skipped)."""
        series: dict[tuple[str, str], list[float]] = defaultdict(list)
        if not run_ids:
            return series
        keys = dict(self.db.execute("SELECT id, key FROM tests"))
        marks = ",".join("?" * len(run_ids))
        for _run, test_id, name, value in self.db.execute(
                f"SELECT run_id, test_id, name, value FROM metrics WHERE run_id IN ({marks}) "
                "ORDER BY run_id", run_ids):
            series[(keys[test_id], name)].append(value)
        return series

    def clean_streak(self, fingerprint: str) -> int:
        """How many of the latest recorded runs in a row had this group clean (runs in which the
        group did not run at all are skipped: a missing shard proves nothing)."""
        n = 0
        for (bad,) in self.db.execute(
                "SELECT bad FROM groups WHERE fingerprint = ? ORDER BY run_id DESC", (fingerprint,)):
            if bad:
                break
            n += 1
        return n

    def issues(self) -> dict[str, tuple[int, str]]:
        """``fingerprint -> (issue number, state)`` as last seen or set by harness."""
        return {fp: (n, s) for fp, n, s in self.db.execute("SELECT fingerprint, number, state FROM issues")}

    # ---- writing -------------------------------------------------------------------------------
    def record(self, run_key: str, results: Results, groups: dict[str, bool], commit: str = "",
               url: str = "", machine: str = "", keep: int = 60) -> int:
        """Store one run (replacing an earlier record under the same key) and prune to ``keep``."""
        db = self.db
        old = db.execute("SELECT id FROM runs WHERE run_key = ?", (run_key,)).fetchone()
        if old:
            self._delete_runs([old[0]])
        run_id = db.execute("INSERT INTO runs(run_key, commit_sha, created, url, machine) "
                            "VALUES(?,?,?,?,?)", (run_key, commit, time.time(), url, machine)).lastrowid
        db.executemany("INSERT OR IGNORE INTO tests(key, suite, backend) VALUES(?,?,?)",
                       ((k, c.suite, c.backend) for k, c in results.cases.items()))
        ids = dict(db.execute("SELECT key, id FROM tests"))
        db.executemany("INSERT INTO outcomes VALUES(?,?,?)",
                       ((run_id, ids[k], c.outcome) for k, c in results.cases.items()))
        wanted: dict[str, bool] = {}
        db.executemany("INSERT INTO metrics VALUES(?,?,?,?)", (
            (run_id, ids[k], name, value)
            for k, c in results.cases.items() for name, value in c.metrics.items()
            if wanted.setdefault(name, direction(name) != "none")))
        db.executemany("INSERT INTO groups VALUES(?,?,?)",
                       ((run_id, fp, int(bad)) for fp, bad in groups.items()))
        stale = [r for (r,) in db.execute("SELECT id FROM runs ORDER BY id DESC LIMIT -1 OFFSET ?",
                                          (keep,))]
        self._delete_runs(stale)
        db.commit()
        return run_id

    def set_issue(self, fingerprint: str, number: int, state: str) -> None:
        self.db.execute("INSERT OR REPLACE INTO issues VALUES(?,?,?)", (fingerprint, number, state))
        self.db.commit()

    def _delete_runs(self, run_ids: list[int]) -> None:
        for table, col in (("outcomes", "run_id"), ("metrics", "run_id"), ("groups", "run_id"),
                           ("runs", "id")):
            self.db.executemany(f"DELETE FROM {table} WHERE {col} = ?", ((r,) for r in run_ids))
