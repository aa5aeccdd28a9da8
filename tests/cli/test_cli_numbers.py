"""Numbers on the command line are checked where they enter (issue #49): each bad value is argparse's
one line naming the option (exit 2) before any work, not a traceback after it, an OverflowError or a
silent no-op."""

from __future__ import annotations

import pytest

from harness.cli import main

BAD = [
    (["quarantine", "add", "x::y", "--days", "3000000"], "--days", "must be >= 1 and <= 3650"),
    (["quarantine", "add", "x::y", "--days", "0"], "--days", "must be >= 1"),
    (["server", "start", "--idle", "inf"], "--idle", "expected a finite number"),
    (["server", "start", "--idle", "nan"], "--idle", "expected a finite number"),
    (["server", "start", "--idle", "-5"], "--idle", "must be > 0"),
    (["compare", "r.xml", "--pr-comment", "0"], "--pr-comment", "must be >= 1"),
    (["compare", "r.xml", "--pr-comment", "²"], "--pr-comment", "expected a whole number, got '²'"),
    (["compare", "r.xml", "--threshold", "nan"], "--threshold", "expected a finite number"),
    (["compare", "r.xml", "--drift-fraction", "2"], "--drift-fraction", "must be >= 0 and <= 1"),
    (["compare", "r.xml", "--min-bad-runs", "1_000"], "--min-bad-runs", "expected a whole number"),
    (["plan", "llama-3.1-8b", "--devices", "8", "--usable", "1.5"], "--usable", "must be > 0 and <= 1"),
    (["inspect", "llama-3.1-8b", "--context", "1e9"], "--context", "expected a whole number"),
    (["select", "--sample", "-1"], "--sample", "must be >= 0"),
    (["bisect", "--good", "a", "--bad", "b", "s::i", "--step-timeout", "inf"], "--step-timeout",
     "expected a finite number"),
    (["certify", "--backend", "cpu", "--timeout", "-1"], "--timeout", "must be > 0"),
    (["ci-local", "--shards", "0"], "--shards", "must be >= 1"),
    (["init", "c.json", "--max-params", "-3"], "--max-params", "must be >= 1"),
    (["run", "--confirm", "1000000"], "--confirm", "must be >= 0 and <= 20"),
    (["run", "--timeout", "nan"], "--timeout", "expected a finite number"),
    (["run", "--memory-limit", "-1"], "--memory-limit", "must be > 0"),
]


@pytest.mark.parametrize(("argv", "option", "why"), BAD, ids=[" ".join(a[:1] + a[-2:]) for a, _, _ in BAD])
def test_a_bad_number_is_one_line_naming_the_option(argv, option, why, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    line = err.strip().splitlines()[-1]
    assert f"argument {option}" in line and why in line, err
    assert "Traceback" not in err


def test_good_numbers_still_parse():
    from harness.numbers import amount, count, pull_request

    assert count(1, 3650)("30") == 30 and amount(0, 1, low_open=True)("0.9") == 0.9
    assert pull_request("auto") == "auto" and pull_request("12") == "12"
