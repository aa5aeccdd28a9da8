"""The options of a run, declared once: ``harness run``'s argparse parser, the pytest plugin's
``--harness-*`` options and the driver's translation of the one into the other are all built from
:data:`OPTIONS` (issue #44: each option used to be written twice and translated in a third file,
and the three drifted).

An :class:`Option` names its value (``name``: ``args.<name>`` of ``harness run``), the flags
``harness run`` spells it with, and the pytest flag the value reaches pytest as. Some are one side's
only: ``--selection`` picks suites before pytest starts (no pytest flag), ``--harness-results`` is
written by ``harness run`` as a plugin it hands pytest (no translation: a second results writer
would race the first), ``-n``/``-k`` are xdist's and pytest's own (forwarded, not declared).

Cheap to import (no torch, no checks): the ``harness`` command builds every subcommand's parser.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.numbers import DAY_S, amount, count
from harness.suite.schema import DTYPES

MAX_CONFIRM = 20  # reruns of one failed item: more proves nothing more (--confirm 1000000 ran for hours)


@dataclass(frozen=True)
class Option:
    """One option of a run.

    * ``flags``: ``harness run``'s spellings (``()``: pytest only);
    * ``pytest``: the flag its value reaches pytest as (None: ``harness run`` only);
    * ``declared``: the plugin declares ``pytest`` (False: pytest's or xdist's own, e.g. ``-n``);
    * ``forward``: the driver passes ``harness run``'s value on as ``pytest`` (False: it gets there
      another way);
    * ``repeat``: repeatable, a list (pytest also takes comma-separated values, which the plugin checks
      against the known names itself: ``choices`` then holds for ``harness run`` only);
    * ``switch``: ``harness run``'s flag takes no value and sets this one (``--no-isolate``: "off").
    """

    name: str
    help: str
    flags: tuple[str, ...] = ()
    pytest: str | None = None
    type: Callable[[str], Any] | None = None
    default: Any = None
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    repeat: bool = False
    switch: Any = None
    declared: bool = True
    forward: bool = True

    def argparse_kwargs(self) -> dict:
        """``add_argument`` keywords of ``harness run``'s flag."""
        if self.switch is not None:
            return dict(dest=self.name, action="store_const", const=self.switch, default=self.default, help=self.help)
        kw: dict[str, Any] = dict(dest=self.name, help=self.help,
                                  default=[] if self.repeat else self.default)
        if self.repeat:
            kw["action"] = "append"
        for k in ("type", "choices", "metavar"):
            if getattr(self, k) is not None:
                kw[k] = list(self.choices) if k == "choices" else getattr(self, k)
        return kw

    def pytest_kwargs(self) -> dict:
        """``addoption`` keywords of the plugin's flag (dest: pytest's, from the flag's name)."""
        kw: dict[str, Any] = dict(help=self.help, default=[] if self.repeat else self.default)
        if self.repeat:
            kw["action"] = "append"
        if self.type is not None:
            kw["type"] = self.type
        if self.choices is not None and not self.repeat:
            kw["choices"] = self.choices  # shown as {a,b}: no metavar
        elif self.metavar is not None:
            kw["metavar"] = self.metavar
        return kw

    def pytest_args(self, value) -> list[str]:
        """The pytest arguments that carry ``value`` (none for an unset one)."""
        if not self.forward or self.pytest is None or value is None:
            return []
        values = value if self.repeat else [value]
        if self.pytest.startswith("--"):
            return [f"{self.pytest}={v}" for v in values]
        return [a for v in values for a in (self.pytest, str(v))]  # a short flag: "-n=2" would read "=2"


_TIMEOUT = ("wall-clock limit of one item, the backstop for what keeps spinning (default: the suite's timeout_s, "
            "else 30x its recorded duration and >= 900 s, else 1800 s); an item that makes no progress (no CPU, "
            "no module entered) for the suite's stall_s (60 s) is hung and killed whatever this says")

OPTIONS: tuple[Option, ...] = (
    Option("backend", "only generate items for these backends (repeatable; pytest: repeat or comma-separate); "
           "harness run's default: every available one", ("--backend", "-b"), "--harness-backend", metavar="NAME", repeat=True),
    Option("dtype", f"only these dtypes (repeatable; one of {', '.join(DTYPES)}); replaces the suites' own "
           "dtype lists", ("--dtype", "-d"), "--harness-dtype", metavar="DTYPE", choices=tuple(DTYPES), repeat=True),
    Option("check", "only these checks (repeatable)", ("--check", "-c"), "--harness-check", metavar="CHECK",
           repeat=True),
    Option("workers", "pytest-xdist workers (a number or 'auto'; 0: one process). Default: one per core (at most "
           "4) when the chosen suites' recorded durations add up to a minute or more, else one",
           ("--workers", "-n"), "-n", declared=False),
    Option("keyword", "pytest -k expression", ("-k",), "-k", declared=False),
    Option("results", "results directory (harness run's default: results/; pytest writes none unless given): each finished item is journaled to "
           "DIR/journal.jsonl, and DIR/junit.xml, summary.json and summary.txt are written atomically at the "
           "end and on SIGTERM/SIGINT", ("--results",), "--harness-results", type=Path, metavar="DIR",
           forward=False),  # harness run hands pytest its writer (harness.run.driver)
    Option("timeout", _TIMEOUT, ("--timeout",), "--harness-timeout", type=amount(0, 7 * DAY_S, low_open=True),
           metavar="SECONDS"),
    Option("memory_limit", "host RSS limit of one isolated item (default: the suite's memory_limit_gib, else none)",
           ("--memory-limit",), "--harness-memory-limit", type=amount(0, 2**20, low_open=True), metavar="GIB"),
    Option("shard", "run only shard I of N (1-based), balanced by recorded durations (harness durations; "
           "harness/run/shard.py)", ("--shard",), "--harness-shard", metavar="I/N"),
    Option("scope", "commit (default): what every commit runs; nightly: plus the nightly-only items (real "
           "weights, full-size shapes, the full parallel matrix)", ("--scope",), "--harness-scope",
           choices=("commit", "nightly"), default="commit"),
    Option("confirm", "rerun a failed or erroring item N more times, each in a fresh worker, and classify it "
           "deterministic / flaky / infrastructure before reporting (default: confirm_reruns in harness.toml, "
           "else 0; harness/run/confirm.py)", ("--confirm",), "--harness-confirm", type=count(0, MAX_CONFIRM),
           metavar="N"),
    Option("quarantine", "quarantine file: its items run and report, and their failures do not fail the run "
           "(default: quarantine_file in harness.toml, quarantine.json)", ("--quarantine",),
           "--harness-quarantine", metavar="FILE"),
    Option("selection", "run only what `harness select --json FILE` selected (a pull request's change); a "
           "missing FILE: every item, said in one line", ("--selection",), metavar="FILE"),
    Option("nodes", "nodes the parallel check's launches span (default 1): one torchrun agent per node joined "
           "by a c10d rendezvous, the ranks' results brought back over the coordinator's store "
           "(harness/launch/nodes.py); needs --launcher", ("--nodes",), "--harness-nodes", type=count(1, 4096),
           metavar="N"),
    Option("launcher", "how the agents reach their nodes: netns (a rehearsal on this machine: each node a network "
           "namespace with its own hostname and folders; root), srun (inside a Slurm allocation), slurm (submit "
           "this run as an sbatch job and collect its results), agents (each node's `harness node-agent` pulls its "
           "share: Kubernetes, VMs)", ("--launcher",), "--harness-launcher",
           choices=("netns", "srun", "slurm", "agents")),
    Option("engine", "the serving engine the serve check runs (default: the suite's checks.serve.engine, vllm): "
           "its build for the run's backend, e.g. --engine vllm --backend npu is the vllm build a vendor declared "
           "for npu (harness engine show; docs/serving.md)", ("--engine",), "--harness-engine", metavar="ENGINE"),
    Option("isolate", "items run each in a child process with a time limit (the default; pytest: "
           "--harness-isolate on); --no-isolate (pytest: off) runs them in this process: faster on trusted CPU "
           "runs, but a hang or crash then costs the run; device backends are always isolated", ("--no-isolate",), "--harness-isolate",
           choices=("on", "off"), default="on", switch="off"),
)

BY_NAME: dict[str, Option] = {o.name: o for o in OPTIONS}


def add_to_argparse(parser: argparse.ArgumentParser) -> None:
    """``harness run``'s flags, one per option it spells."""
    for o in OPTIONS:
        if o.flags:
            parser.add_argument(*o.flags, **o.argparse_kwargs())


def add_to_pytest(group) -> None:
    """The plugin's ``--harness-*`` options (``group``: pytest's ``parser.getgroup``)."""
    for o in OPTIONS:
        if o.pytest is not None and o.declared:
            group.addoption(o.pytest, **o.pytest_kwargs())


def values(args) -> dict[str, Any]:
    """name -> value of every ``harness run`` option in ``args`` (an argparse namespace)."""
    return {o.name: getattr(args, o.name) for o in OPTIONS if o.flags}


def pytest_args(vals: Mapping[str, Any]) -> list[str]:
    """The pytest arguments that carry ``vals`` (name -> value; unset or missing names: nothing)."""
    return [a for o in OPTIONS if o.name in vals for a in o.pytest_args(vals[o.name])]
