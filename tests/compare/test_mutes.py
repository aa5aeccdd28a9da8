"""The mute file: matching, expiry, bad input."""

from __future__ import annotations

import datetime as dt

from harness.compare import mutes
from harness.compare.classify import Finding


def f(suite="kimi-k2", backend="npu", kind="performance", key="suites.kimi-k2.toml::moe_dispatch[npu-bf16]"):
    return Finding("metric_regression", kind, key, suite, backend)


def test_match_fields_and_globs(tmp_path):
    p = tmp_path / "m.toml"
    p.write_text('[[mute]]\nsuite = "kimi-*"\nkind = "performance"\ntest = "*moe*"\nuntil = 2030-01-01\n')
    active, notes = mutes.load(str(p), today=dt.date(2029, 12, 31))
    assert notes == [] and len(active) == 1
    kept, muted = mutes.apply([f(), f(kind="failure"), f(key="x::smoke")], active)
    assert muted == [f()] and len(kept) == 2


def test_expired_and_invalid_entries_are_reported(tmp_path):
    p = tmp_path / "m.toml"
    p.write_text('[[mute]]\nbackend = "npu"\nuntil = 2020-01-01\nreason = "old driver"\n'
                 '[[mute]]\nbackend = "npu"\n')
    active, notes = mutes.load(str(p), today=dt.date(2026, 1, 1))
    assert active == []
    assert "expired on 2020-01-01" in notes[0] and "old driver" in notes[0]
    assert "mute #2: until: Field required; mute #2 ignored" in notes[1]


def test_missing_and_broken_files(tmp_path):
    assert mutes.load(str(tmp_path / "none.toml")) == ([], [])
    p = tmp_path / "bad.toml"
    p.write_text("[[mute]\n")
    active, notes = mutes.load(str(p))
    assert active == [] and "cannot read the mute file" in notes[0]


def test_misspelt_keys_and_wrong_types_are_refused_naming_the_field(tmp_path):
    """A misspelt key used to load as a wildcard (``suit = "kimi-k2"`` muted every suite until its
    date without a word): each bad entry is ignored with one message per field, the good ones apply."""
    p = tmp_path / "m.toml"
    p.write_text('[[mute]]\nsuit = "kimi-k2"\nuntil = 2030-01-01\n'      # misspelt key
                 '[[mute]]\nsuite = 7\nuntil = 2030-01-01\n'            # not a string
                 '[[mute]]\nkind = "perf"\nuntil = 2030-01-01\n'        # not an issue kind
                 '[[mute]]\nsuite = "kimi-k2"\nuntil = "soon"\n'        # not a date
                 '[[mute]]\nsuite = "kimi-k2"\nkind = "performance"\nuntil = 2030-01-01\n')
    active, notes = mutes.load(str(p), today=dt.date(2029, 1, 1))
    assert [m.suite for m in active] == ["kimi-k2"] and active[0].kind == "performance"
    assert any("mute #1: suit: Extra inputs are not permitted" in n for n in notes), notes
    assert any("mute #2: suite: Input should be a valid string" in n for n in notes), notes
    assert any("mute #3: kind:" in n and "'performance'" in n for n in notes), notes
    assert any("mute #4: until:" in n for n in notes), notes
    kept, muted = mutes.apply([f(suite="other", kind="failure")], active)
    assert muted == [] and len(kept) == 1  # nothing silenced by the refused entries


def test_an_unknown_top_level_table_mutes_nothing_and_says_so(tmp_path):
    p = tmp_path / "m.toml"
    p.write_text('[[mutes]]\nsuite = "kimi-k2"\nuntil = 2030-01-01\n')
    active, notes = mutes.load(str(p), today=dt.date(2029, 1, 1))
    assert active == [] and "the file: mutes: Extra inputs are not permitted" in notes[0]


def test_compare_reports_a_refused_entry_and_files_the_finding(tmp_path, monkeypatch):
    """Through the command line: the misspelt entry does not mute the failure, and the summary
    says why (file, entry, field)."""
    import json

    from harness.cli import main as harness_main

    from .junit_factory import item, write_junit

    base = write_junit(tmp_path / "base.xml", [item("kimi-k2", "smoke")])
    cur = write_junit(tmp_path / "cur.xml", [item("kimi-k2", "smoke", fail="loss went up")])
    mute = tmp_path / "mutes.toml"
    mute.write_text('[[mute]]\nsuit = "kimi-k2"\nuntil = 2999-01-01\nreason = "typo"\n')
    monkeypatch.chdir(tmp_path)
    code = harness_main(["compare", cur, "--baseline", base, "--history", "", "--sink", "file",
                         "--out-dir", "issues", "--mute-file", str(mute), "--summary", "s.md"])
    assert code == 0
    (issue,) = json.load(open(tmp_path / "issues" / "issues.json")).values()
    assert "kimi-k2" in issue["title"]
    summary = (tmp_path / "s.md").read_text()
    assert "mute #1: suit: Extra inputs are not permitted" in summary, summary

