"""Each `harness run` option is declared once (harness/run/options.py): `harness run`'s parser,
pytest's `--harness-*` options and the driver's translation between them come from that one table,
so a value given to `harness run` reaches the plugin as the same value."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.cli import build_parser
from harness.run import options
from harness.run.driver import build_args


def run_parser():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")  # argparse keeps subparsers there
    return sub.choices["run"]


def test_every_option_is_in_both_helps(pytester):
    run_help = run_parser().format_help()
    r = pytester.runpytest_subprocess("--help")
    pytest_help = r.stdout.str()
    for o in options.OPTIONS:
        for flag in o.flags:
            assert flag in run_help, flag
        if o.pytest and o.declared:
            assert o.pytest in pytest_help, o.pytest
        # one help text: the first words of it reach both helps
        head = " ".join(o.help.split()[:3])
        if o.flags:
            assert head in " ".join(run_help.split()), (o.name, head)
        if o.pytest and o.declared:
            assert head in " ".join(pytest_help.split()), (o.name, head)


def test_a_run_command_line_reaches_the_plugin_as_the_same_values(pytester):
    argv = ["run", "tiny", "-b", "cpu", "--backend", "meta", "-d", "bfloat16", "-c", "smoke", "--timeout", "12.5",
            "--memory-limit", "3", "--shard", "2/3", "--scope", "nightly", "--confirm", "2",
            "--quarantine", "q.json", "--no-isolate", "-k", "smoke and not bf16", "-n", "2", "--results", "out"]
    args = run_parser().parse_args(argv[1:])
    vals = options.values(args)
    assert vals["isolate"] == "off" and vals["backend"] == ["cpu", "meta"] and vals["results"] == Path("out")
    pytest_argv = build_args([Path("suites/tiny.toml")], vals, ["-x"])
    assert pytest_argv[0] == "suites/tiny.toml" and pytest_argv[-1] == "-x"
    assert pytest_argv[pytest_argv.index("-n") + 1] == "2"
    assert pytest_argv[pytest_argv.index("-k") + 1] == "smoke and not bf16"
    assert not any(a.startswith("--harness-results") for a in pytest_argv)  # the driver hands pytest its writer
    # pytest's own parser, with harness's plugin loaded through its entry point, reads them back
    flags = [a for a in pytest_argv if a.startswith("--harness-")]
    config = pytester.parseconfig(*flags)
    for o in options.OPTIONS:
        if o.pytest and o.declared and o.forward:
            assert config.getoption(o.pytest.lstrip("-").replace("-", "_")) == vals[o.name], o.name


def test_defaults_and_unset_values_add_nothing_but_the_defaults(pytester):
    args = run_parser().parse_args([])
    vals = options.values(args)
    assert vals["backend"] == [] and vals["isolate"] == "on" and vals["scope"] == "commit" and vals["timeout"] is None
    assert options.pytest_args(vals) == ["--harness-scope=commit", "--harness-isolate=on"]
    config = pytester.parseconfig()  # pytest alone: the same defaults
    for o in options.OPTIONS:
        if o.pytest and o.declared:
            assert config.getoption(o.pytest.lstrip("-").replace("-", "_")) == ([] if o.repeat else o.default), o.name


def test_harness_run_refuses_a_bad_choice_in_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        run_parser().parse_args(["--dtype", "fp32"])
    assert e.value.code == 2
    assert "invalid choice: 'fp32'" in capsys.readouterr().err
