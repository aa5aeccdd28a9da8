"""The history of earlier runs: one SQLite file that CI carries between runs (cache or artifact).

Kept per run: every test's outcome and every metric that has a direction (as the run's own results
declare it: ``Results.meanings``), whether each issue group was bad, and (across runs) which GitHub
issue number belongs to which group fingerprint, so a closed issue can be reopened without
searching GitHub for it.

Layout, chosen for 100,000-test runs: tests are numbered once (``tests``), and a run stores one
array per column -- outcomes as bytes, each metric as float64 -- indexed by test number. Writing a
run is a handful of rows, and reading 30 runs of a metric is 30 array loads instead of millions of
rows. A parsed baseline is cached the same way (``kind='baseline'``, keyed by a digest of its
files), so the same baseline XML is parsed once, not on every run.

One comparison at a time: a :class:`History` holds an advisory lock (``flock``) on the file from
open to close, so two ``harness compare`` processes on one history (two workflows, a re-run
overlapping a scheduled run) run one after the other instead of both filing the same issue or
racing on the tests table. (SQLite's own locks are POSIX record locks, independent of ``flock`` on
Linux, so the two never interfere.)

The ``outbox`` table holds the comments a state change still owes (see
:mod:`harness.compare.sinks`): written before the change, removed once the comment is posted.

Losing the file is safe: classification falls back to the baseline alone, regressions need two
more runs to confirm, and a recurrence opens a new issue instead of reopening the old one.
"""

from __future__ import annotations

import math
import os
import sqlite3
import sys
import time
from dataclasses import dataclass

try:
    import fcntl
except ImportError:  # Windows: no advisory lock (CI runners that compare are Linux or macOS)
    fcntl = None

import numpy as np

from harness.compare.junit import Case, Results, attempt_counts
from harness.metrics import Meanings

SCHEMA_VERSION = "2"
_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta(key TEXT PRIMARY KEY, value TEXT);
CREATE TABLE IF NOT EXISTS runs(id INTEGER PRIMARY KEY, run_key TEXT UNIQUE, commit_sha TEXT,
                                created REAL, url TEXT, machine TEXT, kind TEXT, inputs TEXT);
CREATE TABLE IF NOT EXISTS tests(id INTEGER PRIMARY KEY, key TEXT UNIQUE, suite TEXT, backend TEXT);
CREATE TABLE IF NOT EXISTS outcomes(run_id INTEGER PRIMARY KEY, codes BLOB);
CREATE TABLE IF NOT EXISTS attempts(run_id INTEGER PRIMARY KEY, total BLOB, failed BLOB);
CREATE TABLE IF NOT EXISTS metrics(run_id INT, name TEXT, vals BLOB, PRIMARY KEY(run_id, name));
CREATE TABLE IF NOT EXISTS groups(run_id INT, fingerprint TEXT, bad INT,
                                  PRIMARY KEY(run_id, fingerprint)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS issues(fingerprint TEXT PRIMARY KEY, number INT, state TEXT);
CREATE TABLE IF NOT EXISTS outbox(key TEXT PRIMARY KEY, number INT, fingerprint TEXT, text TEXT);
"""
# the columns this harness reads, per table: a file of an older layout (no version, or one this
# harness does not know) is not a history it can read, however its meta row reads
_COLUMNS = {"runs": {"id", "run_key", "commit_sha", "created", "url", "machine", "kind", "inputs"},
            "tests": {"id", "key", "suite", "backend"}, "outcomes": {"run_id", "codes"},
            "attempts": {"run_id", "total", "failed"}, "metrics": {"run_id", "name", "vals"},
            "groups": {"run_id", "fingerprint", "bad"}, "issues": {"fingerprint", "number", "state"},
            "outbox": {"key", "number", "fingerprint", "text"}}
_DAMAGED = ("SQLITE_NOTADB", "SQLITE_CORRUPT")  # the file itself is bad (not: locked, unwritable, full)
_CODES = ["", "passed", "failed", "error", "skipped"]  # 0: the test was not in the run
_CODE = {o: i for i, o in enumerate(_CODES)}


@dataclass(frozen=True)
class RunInfo:
    id: int
    run_key: str
    commit: str
    created: float
    url: str


class SeriesView:
    """``(test key, metric) -> values`` of earlier runs, oldest first, built column by column
    on demand from the per-run arrays (most tests are never asked for)."""

    def __init__(self, ids: dict[str, int], matrices: dict[str, np.ndarray]):
        self._ids, self._m = ids, matrices
        # per metric: each test's lowest and highest earlier value and how many runs had it
        self._bounds = {n: (np.fmin.reduce(m, axis=0).tolist(), np.fmax.reduce(m, axis=0).tolist(),
                            (~np.isnan(m)).sum(axis=0).tolist()) for n, m in matrices.items()}

    def run_totals(self, tests: list[str], name: str) -> list[float]:
        """Per earlier run, the sum of ``name`` over ``tests`` (a suite's total wall time)."""
        m = self._m.get(name)
        cols = [i for i in (self._ids.get(t) for t in tests) if i is not None and m is not None
                and i < m.shape[1]]
        if not cols:
            return []
        sub = m[:, cols]
        return [float(np.nansum(row)) for row in sub if not np.isnan(row).all()]

    def bounds(self, key: tuple[str, str]) -> tuple[float | None, float | None, int]:
        test, name = key
        b, i = self._bounds.get(name), self._ids.get(test)
        if b is None or i is None or i >= len(b[2]):
            return None, None, 0
        return b[0][i], b[1][i], b[2][i]

    def get(self, key: tuple[str, str], default=()):
        test, name = key
        m, i = self._m.get(name), self._ids.get(test)
        if m is None or i is None or i >= m.shape[1]:
            return list(default)
        return [v for v in m[:, i].tolist() if not math.isnan(v)]


class HistoryDamaged(ValueError):
    """The file is not a history this harness can read (corrupt bytes, another schema): kept as it
    is, it would leave every later comparison without a history, and no issue could close again."""


def move_aside(path: str) -> str:
    """Rename a damaged history (and any journal of it, which would otherwise be replayed into the
    new file) to ``PATH.damaged-YYYYmmddTHHMMSS``; the new name."""
    aside = f"{path}.damaged-{time.strftime('%Y%m%dT%H%M%S')}"
    n = 1
    while os.path.exists(aside):
        aside = f"{path}.damaged-{time.strftime('%Y%m%dT%H%M%S')}-{n}"
        n += 1
    os.replace(path, aside)
    for tail in ("-journal", "-wal", "-shm"):
        if os.path.exists(path + tail):
            os.replace(path + tail, aside + tail)
    return aside


class History:
    def __init__(self, path: str, lock: bool = True):
        self.path = path
        self.note = ""  # one line for the report (set when a damaged file was moved aside for this one)
        self._lock = None
        if lock and fcntl is not None:
            self._lock = open(path, "ab")  # noqa: SIM115 - held until close(); creates the file
            try:
                fcntl.flock(self._lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                print(f"harness compare: {path} is in use by another comparison; waiting for it",
                      file=sys.stderr)
                fcntl.flock(self._lock.fileno(), fcntl.LOCK_EX)
            except OSError:
                pass  # a file system without flock: compare without the lock
        try:
            self._open(path)
        except BaseException:
            self.close()
            raise

    def _open(self, path: str) -> None:
        self.db = sqlite3.connect(path, timeout=60)
        try:
            self._check(path)
            self.db.executescript(_SCHEMA)
            row = self.db.execute("SELECT value FROM meta WHERE key='schema'").fetchone()
        except sqlite3.DatabaseError as e:
            if getattr(e, "sqlite_errorname", "") in _DAMAGED:
                raise HistoryDamaged(f"{path}: not a readable history database ({e})") from None
            raise
        if row is None:
            self.db.execute("INSERT INTO meta VALUES('schema', ?)", (SCHEMA_VERSION,))
        elif row[0] != SCHEMA_VERSION:
            raise HistoryDamaged(f"{path}: history schema {row[0]}, this harness reads {SCHEMA_VERSION}")
        self.db.commit()
        self._ids: dict[str, int] | None = None
        self._rows: list[tuple[int, str, str, str]] | None = None

    def _check(self, path: str) -> None:
        """Raise HistoryDamaged for a file SQLite finds corrupt, or whose tables lack columns this
        harness reads (an older layout); a new, empty file passes."""
        (ok,) = self.db.execute("PRAGMA quick_check(1)").fetchone()
        if ok != "ok":
            raise HistoryDamaged(f"{path}: the history database is damaged ({ok})")
        for table, wanted in _COLUMNS.items():
            have = {r[1] for r in self.db.execute(f"PRAGMA table_info({table})")}
            if have and not wanted <= have:
                raise HistoryDamaged(f"{path}: table {table} lacks {sorted(wanted - have)}: "
                                     "an older history layout")

    def close(self) -> None:
        if getattr(self, "db", None) is not None:
            self.db.close()
            self.db = None
        if self._lock is not None:
            self._lock.close()  # releases the flock
            self._lock = None

    def refresh(self) -> None:
        """Forget what was read of the tests table (another process may have added to it)."""
        self._ids = self._rows = None

    def _tests(self) -> list[tuple[int, str, str, str]]:
        """``(number, key, suite, backend)`` of every test ever recorded, read once."""
        if self._rows is None:
            self._rows = self.db.execute("SELECT id, key, suite, backend FROM tests").fetchall()
        return self._rows

    def _test_ids(self) -> dict[str, int]:
        if self._ids is None:
            self._ids = {k: i for i, k, _s, _b in self._tests()}
        return self._ids

    # ---- reading -------------------------------------------------------------------------------
    def runs(self, limit: int = 30, exclude_key: str | None = None) -> list[RunInfo]:
        """The latest ``limit`` runs, oldest first (cached baselines are not runs)."""
        rows = self.db.execute(
            "SELECT id, run_key, commit_sha, created, url FROM runs WHERE kind = 'run' "
            "AND run_key IS NOT ? ORDER BY id DESC LIMIT ?", (exclude_key, limit)).fetchall()
        return [RunInfo(*r) for r in reversed(rows)]

    def latest(self) -> tuple[str, str] | None:
        """``(run_key, inputs digest)`` of the latest recorded run."""
        row = self.db.execute("SELECT run_key, inputs FROM runs WHERE kind = 'run' ORDER BY id DESC "
                              "LIMIT 1").fetchone()
        return (row[0], row[1] or "") if row else None

    def outcomes(self, run_id: int) -> dict[str, tuple[str, str, str]]:
        """``test key -> (outcome, suite, backend)`` of one run."""
        row = self.db.execute("SELECT codes FROM outcomes WHERE run_id = ?", (run_id,)).fetchone()
        if row is None:
            return {}
        codes = np.frombuffer(row[0], dtype=np.uint8)
        codes = codes.tolist()
        n = len(codes)
        return {k: (_CODES[codes[i]], s, b) for i, k, s, b in self._tests() if i < n and codes[i]}

    def flaky_runs(self, run_ids: list[int]) -> dict[str, int]:
        """``test key -> runs`` among ``run_ids`` in which the test failed an attempt and passed
        another (harness's confirming reruns recorded it flaky)."""
        ids = {i: k for k, i in self._test_ids().items()}
        out: dict[str, int] = {}
        for run_id in run_ids:
            row = self.db.execute("SELECT total, failed FROM attempts WHERE run_id = ?", (run_id,)).fetchone()
            codes = self.db.execute("SELECT codes FROM outcomes WHERE run_id = ?", (run_id,)).fetchone()
            if row is None or codes is None:
                continue
            total, failed = np.frombuffer(row[0], dtype=np.uint8), np.frombuffer(row[1], dtype=np.uint8)
            outcome = np.frombuffer(codes[0], dtype=np.uint8)
            for i in np.nonzero((failed > 0) & (failed < total))[0].tolist():
                if i < len(outcome) and _CODES[outcome[i]] == "passed" and i in ids:
                    out[ids[i]] = out.get(ids[i], 0) + 1
        return out

    def item_record(self, keys: list[str], run_ids: list[int]) -> dict[str, tuple[int, int]]:
        """``test key -> (runs it ran in, runs it failed or flaked in)`` among ``run_ids``: the
        record a quarantine estimates an item's flake rate from (harness.compare.quarantine)."""
        ids = self._test_ids()
        idx = {k: ids[k] for k in keys if k in ids}
        out = {k: [0, 0] for k in idx}
        for run_id in run_ids:
            row = self.db.execute("SELECT codes FROM outcomes WHERE run_id = ?", (run_id,)).fetchone()
            att = self.db.execute("SELECT failed FROM attempts WHERE run_id = ?", (run_id,)).fetchone()
            codes = np.frombuffer(row[0], dtype=np.uint8) if row else np.zeros(0, dtype=np.uint8)
            failed = np.frombuffer(att[0], dtype=np.uint8) if att else np.zeros(0, dtype=np.uint8)
            for k, i in idx.items():
                code = _CODES[codes[i]] if i < len(codes) else ""
                if code in ("passed", "failed", "error"):
                    out[k][0] += 1
                    out[k][1] += int(code != "passed" or (i < len(failed) and int(failed[i]) > 0))
        return {k: (int(r), int(b)) for k, (r, b) in out.items()}  # plain ints: they go to JSON

    def metric_series(self, run_ids: list[int]) -> SeriesView:
        width = max(self._test_ids().values(), default=0) + 1
        columns: dict[str, list[np.ndarray]] = {}
        for rank, run_id in enumerate(run_ids):
            for name, blob in self.db.execute("SELECT name, vals FROM metrics WHERE run_id = ?", (run_id,)):
                rows = columns.setdefault(name, [np.full(width, np.nan)] * len(run_ids))
                v = np.frombuffer(blob, dtype=np.float64)
                row = np.full(width, np.nan)
                row[: len(v)] = v
                rows[rank] = row
        return SeriesView(self._test_ids(), {n: np.vstack(rows) for n, rows in columns.items()})

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

    def owe(self, key: str, number: int, fingerprint: str, text: str) -> None:
        self.db.execute("INSERT OR REPLACE INTO outbox VALUES(?,?,?,?)", (key, number, fingerprint, text))
        self.db.commit()

    def settle(self, key: str) -> None:
        self.db.execute("DELETE FROM outbox WHERE key = ?", (key,))
        self.db.commit()

    def owed(self) -> list[tuple[str, int, str, str]]:
        return self.db.execute("SELECT key, number, fingerprint, text FROM outbox").fetchall()

    def issues(self) -> dict[str, tuple[int, str]]:
        """``fingerprint -> (issue number, state)`` as last seen or set by harness."""
        return {fp: (n, s) for fp, n, s in self.db.execute("SELECT fingerprint, number, state FROM issues")}

    def cached_baseline(self, inputs: str) -> Results | None:
        """A baseline parsed before from files with this digest, or None."""
        rows = self.db.execute("SELECT id FROM runs WHERE kind = 'baseline' AND inputs = ?",
                               (inputs,)).fetchall()  # fetchall: no read lock left behind
        if not rows:
            return None
        row = rows[0]
        codes = np.frombuffer(self.db.execute("SELECT codes FROM outcomes WHERE run_id = ?",
                                              (row[0],)).fetchone()[0], dtype=np.uint8).tolist()
        metrics = {name: np.frombuffer(blob, dtype=np.float64).tolist() for name, blob in self.db.execute(
            "SELECT name, vals FROM metrics WHERE run_id = ?", (row[0],))}
        res = Results(files=[f"(cached baseline {inputs[:12]})"])
        for i, key, suite, backend in self._tests():
            if i >= len(codes) or not codes[i]:
                continue
            vals = {}
            for n, v in metrics.items():
                if i < len(v) and v[i] == v[i]:  # NaN: the test had no such metric
                    vals[n] = v[i]
            classname, _, name = key.partition("::")
            res.cases[key] = Case(key, name, classname, _CODES[codes[i]], suite, "", backend, "", "", "",
                                  vals, {}, {})
        return res

    # ---- writing -------------------------------------------------------------------------------
    def record(self, run_key: str, results: Results, groups: dict[str, bool | None], commit: str = "",
               url: str = "", machine: str = "", keep: int = 60, kind: str = "run",
               inputs: str = "") -> int:
        """Store one run (replacing an earlier record under the same key) and prune to ``keep``.
        A group whose status is None (not known this run) is not recorded either way."""
        db = self.db
        old = db.execute("SELECT id FROM runs WHERE run_key = ?", (run_key,)).fetchone()
        if old:
            self._delete_runs([old[0]])
        run_id = db.execute("INSERT INTO runs(run_key, commit_sha, created, url, machine, kind, inputs) "
                            "VALUES(?,?,?,?,?,?,?)",
                            (run_key, commit, time.time(), url, machine, kind, inputs)).lastrowid
        ids = self._test_ids()
        new = [(k, c.suite, c.backend) for k, c in results.cases.items() if k not in ids]
        db.executemany("INSERT INTO tests(key, suite, backend) VALUES(?,?,?)", new)
        if new:
            self._ids = self._rows = None
            ids = self._test_ids()
        width = max(ids.values(), default=0) + 1
        codes = np.zeros(width, dtype=np.uint8)
        columns: dict[str, np.ndarray] = {}
        wanted: dict[str, bool] = {}
        meanings = Meanings(results.meanings)  # the run's own word on each metric (classify notes fallbacks)
        for k, c in results.cases.items():
            i = ids[k]
            codes[i] = _CODE.get(c.outcome, 0)
            for name, value in c.metrics.items():
                if wanted.setdefault(name, meanings.direction(name) != "none"):
                    col = columns.get(name)
                    if col is None:
                        col = columns[name] = np.full(width, np.nan)
                    col[i] = value
        db.execute("INSERT INTO outcomes VALUES(?,?)", (run_id, codes.tobytes()))
        # confirming reruns (harness run --confirm, pytest-rerunfailures): attempts and failed attempts
        # per test, kept only for runs that reran something
        total, failed = np.zeros(width, dtype=np.uint8), np.zeros(width, dtype=np.uint8)
        for k, c in results.cases.items():
            f, n = attempt_counts(c)
            if n > 1:
                total[ids[k]], failed[ids[k]] = min(n, 255), min(f, 255)
        if total.any():
            db.execute("INSERT INTO attempts VALUES(?,?,?)", (run_id, total.tobytes(), failed.tobytes()))
        db.executemany("INSERT INTO metrics VALUES(?,?,?)",
                       ((run_id, n, col.tobytes()) for n, col in columns.items()))
        db.executemany("INSERT INTO groups VALUES(?,?,?)",
                       ((run_id, fp, int(bad)) for fp, bad in groups.items() if bad is not None))
        stale = [r for (r,) in db.execute("SELECT id FROM runs WHERE kind = ? ORDER BY id DESC "
                                          "LIMIT -1 OFFSET ?", (kind, keep))]
        self._delete_runs(stale)
        db.commit()
        return run_id

    def set_issue(self, fingerprint: str, number: int, state: str) -> None:
        self.db.execute("INSERT OR REPLACE INTO issues VALUES(?,?,?)", (fingerprint, number, state))
        self.db.commit()

    def _delete_runs(self, run_ids: list[int]) -> None:
        for table, col in (("outcomes", "run_id"), ("attempts", "run_id"), ("metrics", "run_id"),
                           ("groups", "run_id"), ("runs", "id")):
            self.db.executemany(f"DELETE FROM {table} WHERE {col} = ?", ((r,) for r in run_ids))
