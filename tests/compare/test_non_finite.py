"""A metric that was a number and turns NaN is a change `harness compare` reports (a NaN compares
false with every threshold, so before it read "Nothing changed")."""

from __future__ import annotations

import html

from harness.cli import main as harness_main

from .junit_factory import item, write_junit


def test_a_metric_turning_nan_is_reported_as_a_change(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    base = write_junit(tmp_path / "base.xml", [item("kimi-k2", "smoke", metrics={"loss_final": 2.0})])
    cur = write_junit(tmp_path / "cur.xml", [item("kimi-k2", "smoke", metrics={"loss_final": float("nan")})])
    harness_main(["compare", cur, "--baseline", base, "--history", "h.sqlite", "--sink", "file",
                  "--out-dir", "issues", "--run-id", "r1", "--mute-file", "", "--summary", "s.md"])
    summary = html.unescape((tmp_path / "s.md").read_text())
    assert "Nothing changed" not in summary
    assert "loss_final" in summary and "non-finite" in summary


def test_a_metric_that_was_never_a_number_stays_quiet(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    base = write_junit(tmp_path / "base.xml", [item("kimi-k2", "smoke", metrics={"loss_final": float("nan")})])
    cur = write_junit(tmp_path / "cur.xml", [item("kimi-k2", "smoke", metrics={"loss_final": float("nan")})])
    harness_main(["compare", cur, "--baseline", base, "--history", "h.sqlite", "--sink", "file",
                  "--out-dir", "issues", "--run-id", "r1", "--mute-file", "", "--summary", "s.md"])
    assert "non-finite" not in html.unescape((tmp_path / "s.md").read_text())
