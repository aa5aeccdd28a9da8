"""The comparator's life cycle against the GitHub emulator (issue #49 item 5): the upstream canary
files only what passes on the pinned stack; a damaged or old history is moved aside and a new one
started, so issues close again; the pull request's comment is edited only when what it says changed;
a quarantined flaky item is re-enabled on evidence bounding its flake rate, not after a fixed count."""

from __future__ import annotations

import io
import itertools
import json
import sqlite3

import pytest

from harness.cli import main as cli
from harness.compare import quarantine
from harness.compare.history import History
from harness.compare.pipeline import Options, run_compare
from harness.compare.report import summary_markdown

from .junit_factory import item, write_junit

PINNED = {"torch": "2.13.0+cpu", "transformers": "5.24.0"}
NEXT = {"torch": "2.14.0.dev20261203+cpu", "transformers": "5.25.0.dev0"}
_runs = itertools.count()


def compare(tmp_path, github, items, baseline=None, reruns=None, **kw):
    n = next(_runs)
    cur = write_junit(tmp_path / f"cur-{n}.xml", items, reruns=reruns, stack=kw.pop("stack", None))
    kw.setdefault("run_key", f"run-{n}")
    opts = Options(results=[cur], baseline=baseline, history=str(tmp_path / "history.sqlite"), sink="github",
                   api_url=github.url, repo="acme/models", **kw)
    return run_compare(opts, out=io.StringIO())


# ---- 1. the upstream canary --------------------------------------------------------------------
def test_upstream_files_only_what_passes_on_the_pinned_stack(tmp_path, github):
    pinned = write_junit(tmp_path / "pinned.xml", [item("s", "smoke"), item("s", "precision", fail="nan"),
                                                   item("t", "smoke", fail="nan")], stack=PINNED)
    out = compare(tmp_path, github, [item("s", "smoke", fail="logits differ"), item("s", "precision", fail="nan"),
                                     item("t", "smoke", fail="nan")], [pinned], stack=NEXT, upstream=True)
    # one upstream issue, for the item that passes pinned; the two failing on both are not upstream's
    (issue,) = github.state.issues.values()
    assert issue["title"].startswith("[harness] upstream regression: s on cpu (torch 2.13.0+cpu -> ")
    assert "smoke&#91;cpu-float32&#93;" in issue["body"] or "smoke[cpu-float32]" in issue["body"]
    assert "precision" not in issue["body"].split("<!--")[0]
    kinds = {f.key: (f.category, f.kind) for f in out.classification.findings}
    assert kinds == {"suites.s.toml::smoke[cpu-float32]": ("new_failure", "upstream"),
                     "suites.s.toml::precision[cpu-float32]": ("still_failing", "info"),
                     "suites.t.toml::smoke[cpu-float32]": ("still_failing", "info")}
    assert all("failed on the pinned stack too: not upstream's" in f.note
               for f in out.classification.findings if f.kind == "info")
    # the report's table and the filing agree: the two read "still failing", and no issue names them
    rows = [ln for ln in summary_markdown(out).splitlines() if ln.startswith("| still failing | ")
            and "float32" in ln]
    assert len(rows) == 2 and all("| nan; failed on the pinned stack too: not upstream's" in r for r in rows)
    assert not any(i["title"].endswith("t on cpu") or "t on cpu (" in i["title"]
                   for i in github.state.issues.values())


# ---- 2. a damaged or old history ---------------------------------------------------------------
def _old_schema(path):
    db = sqlite3.connect(path)
    db.execute("UPDATE meta SET value='1' WHERE key='schema'")
    db.commit()
    db.close()


def _old_layout(path):
    """A history of an older harness: no meta table, runs without the columns read today."""
    path.unlink()
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE runs(id INTEGER PRIMARY KEY, run_key TEXT, created REAL)")
    db.execute("INSERT INTO runs(run_key, created) VALUES('old', 0)")
    db.commit()
    db.close()


def _corrupt_pages(path):
    """Garbage over every page but the first: the header reads, the tables do not."""
    data = bytearray(path.read_bytes())
    page = int.from_bytes(data[16:18], "big")
    data[page:] = bytes((i * 37 + 11) % 256 for i in range(len(data) - page))
    path.write_bytes(bytes(data))


def _corrupt_header(path):
    data = bytearray(path.read_bytes())
    data[:16] = b"this is no dbase"
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [_old_schema, _old_layout, _corrupt_pages, _corrupt_header])
def test_a_damaged_history_is_moved_aside_and_issues_close_again(tmp_path, github, damage):
    base = [write_junit(tmp_path / "base.xml", [item("s", "a"), item("s", "b")])]
    compare(tmp_path, github, [item("s", "a", fail="x"), item("s", "b")], base)
    (number,) = github.state.issues
    history = tmp_path / "history.sqlite"
    damage(history)
    good = [item("s", "a"), item("s", "b")]
    first = compare(tmp_path, github, good, base)
    (line,) = [w for w in first.warnings if "moved aside" in w]
    (aside,) = tmp_path.glob("history.sqlite.damaged-*")
    assert str(aside) in line and "a new history starts" in line and not first.problems
    assert History(str(history)).runs()[-1].run_key == first.run_key  # recorded in the new one
    second = compare(tmp_path, github, good, base)
    assert not [w for w in second.warnings if "moved aside" in w] and not second.problems
    assert [a.op for a in second.actions] == ["close"]  # two clean runs in the new history
    assert github.state.issues[number]["state"] == "closed"


def test_a_locked_or_unreadable_history_is_not_moved_aside(tmp_path):
    """Only a file that is itself bad is moved: a directory in its place stays where it is."""
    (tmp_path / "h.sqlite").mkdir()
    cur = write_junit(tmp_path / "c.xml", [item("s", "a")])
    out = run_compare(Options(results=[cur], history=str(tmp_path / "h.sqlite"), sink="stdout"),
                      out=io.StringIO())
    assert any("compared without it" in p for p in out.problems)
    assert not list(tmp_path.glob("*.damaged-*"))


# ---- 3. the pull request's comment -------------------------------------------------------------
def test_the_pr_comment_is_edited_only_when_its_table_changed(tmp_path, capsys, github, monkeypatch):
    github.state.issues[7] = {"title": "A change", "body": "", "labels": [], "state": "open", "comments": [],
                              "changes": []}
    monkeypatch.setenv("GITHUB_REF", "refs/pull/7/merge")

    def push(n: int, items) -> list[tuple[str, str]]:
        before = len(github.state.requests)
        argv = ["compare", write_junit(tmp_path / f"{n}.xml", items), "--history", "", "--sink", "stdout",
                "--pr-comment", "auto", "--api-url", github.url, "--run-id", f"pr-{n}",
                "--run-url", f"https://ci.test/runs/{n}", "--commit", f"{n:040x}"]
        assert cli(argv) == 0
        capsys.readouterr()
        return [r for r in github.state.requests[before:] if r[0] != "GET"]

    broken = [item("s", "a", fail="loss is nan"), item("s", "b")]
    assert push(1, broken) == [("POST", "/repos/acme/models/issues/7/comments")]
    for n in (2, 3):  # new pushes, new run URLs and commits, the same table: no edit
        assert push(n, broken) == []
    (c,) = github.state.issues[7]["comments"]
    assert "edits" not in c and "https://ci.test/runs/1" in c["body"]
    assert push(4, [item("s", "a"), item("s", "b", fail="loss is nan")]) == [
        ("PATCH", "/repos/acme/models/issues/comments/1")]  # the table changed: one edit
    assert "https://ci.test/runs/4" in github.state.issues[7]["comments"][0]["body"]


# ---- 4. re-enabling a quarantined item on evidence ---------------------------------------------
KEY = "suites.s.toml::flaky[cpu-float32]"


def _night(tmp_path, github, n: int, flaked: bool):
    items = [item("s", "flaky"), item("s", "steady")]
    return compare(tmp_path, github, items, reruns={"flaky[cpu-float32]": 1} if flaked else None,
                   quarantine_file=str(tmp_path / "q.json"), run_key=f"night-{n}")


def _held(tmp_path) -> dict:
    return json.loads((tmp_path / "q.json").read_text())["items"]


def test_a_25_percent_flake_is_not_reenabled_after_three_clean_runs(tmp_path, github):
    """Fails 1 night in 4: 0.75^3 = 0.42 would give it back; it needs (1 - 0.25)^n < 0.05: 11."""
    for n in range(12):
        _night(tmp_path, github, n, flaked=n % 4 == 3)
    e = _held(tmp_path)[KEY]
    assert (e["runs"], e["flakes"], e["clean"]) == (12, 3, 0)  # its history seeded the record
    assert quarantine.needed(quarantine.Entry(**e)) == 11
    for n in range(12, 22):  # ten clean nights: still quarantined
        _night(tmp_path, github, n, flaked=False)
        assert KEY in _held(tmp_path)
    _night(tmp_path, github, 22, flaked=False)
    assert KEY not in _held(tmp_path)


def test_an_item_that_flaked_once_in_40_runs_is_reenabled_in_a_few_clean_runs(tmp_path, github):
    for n in range(40):
        _night(tmp_path, github, n, flaked=n == 39)
    e = _held(tmp_path)[KEY]
    assert (e["runs"], e["flakes"]) == (40, 1)
    ops = []
    for n in range(40, 50):
        ops.append(_night(tmp_path, github, n, flaked=False).quarantine[0].op)
        if ops[-1] == "reenabled":
            break
    # the one-sided 95 % bound of 1 flake in 46 runs is under 10 %: six clean runs, not 119
    assert ops == ["clean"] * 5 + ["reenabled"]


@pytest.mark.parametrize(("flakes", "runs", "want"), [(1, 1, 23), (1, 4, 23), (2, 4, 11), (3, 12, 11),
                                                      (1, 40, 6), (1, 200, 3), (5, 10, 5)])
def test_clean_runs_needed_bound_the_rate_the_item_showed(flakes, runs, want):
    e = quarantine.Entry(since="2026-12-01", reason="r", runs=runs, flakes=flakes)
    assert quarantine.needed(e, 3) == want
    p = flakes / max(runs, quarantine.MIN_RECORD)
    # either a streak that unlikely at its rate, or its rate bounded under TOLERABLE
    assert (1 - p) ** want < quarantine.ALPHA or quarantine.upper_bound(flakes, runs + want) <= quarantine.TOLERABLE
