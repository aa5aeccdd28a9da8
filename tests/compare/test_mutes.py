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
    assert "no valid 'until'" in notes[1]


def test_missing_and_broken_files(tmp_path):
    assert mutes.load(str(tmp_path / "none.toml")) == ([], [])
    p = tmp_path / "bad.toml"
    p.write_text("[[mute]\n")
    active, notes = mutes.load(str(p))
    assert active == [] and "cannot read the mute file" in notes[0]
