"""`harness` console script: one module per subcommand.

Subcommands (one module each): ``run``, ``validate``, ``init``, ``backends``, ``inspect``, ``plan``,
``golden``, ``precision``, ``weights``, ``oplist``, ``compare``, ``report``, ``baseline``,
``durations``, ``ci_local`` (``harness ci-local``), ``certify``, ``bisect``, ``quarantine``, ``select``,
``server``, ``engine``, ``export``, ``node_agent`` (``harness node-agent``). ``run_slurm`` is no
subcommand: ``harness run --launcher slurm``'s submit path.

Each module in SUBCOMMANDS defines ``register(subparsers)`` which adds its parser and sets
``func`` (called with the parsed args, returns an exit code). Adding a subcommand = one module
plus one line here.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = [
    "harness.cli.run",
    "harness.cli.validate",
    "harness.cli.backends",
    "harness.cli.inspect",
    "harness.cli.oplist",
    "harness.cli.init",
    "harness.cli.golden",
    "harness.cli.precision",
    "harness.cli.compare",
    "harness.cli.report",
    "harness.cli.durations",
    "harness.cli.baseline",
    "harness.cli.weights",
    "harness.cli.plan",
    "harness.cli.ci_local",
    "harness.cli.certify",
    "harness.cli.bisect",
    "harness.cli.quarantine",
    "harness.cli.select",
    "harness.cli.server",
    "harness.cli.engine",
    "harness.cli.export",
    "harness.cli.node_agent",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="harness",
        description="Day-0 model bring-up regression harness: suites -> pytest items -> results -> issues.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        importlib.import_module(name).register(sub)
    return parser


def entry() -> None:
    """The ``harness`` command (``main`` is what tests call in-process)."""
    from harness.cli.server import forward
    from harness.proc import exit_now, outlive_reader

    outlive_reader()  # `harness run ... | head`: a reader that goes away costs no item (harness.proc)
    rc = forward(sys.argv[1:])  # a warm `harness server` for this environment runs it, if one runs
    exit_now(main() if rc is None else rc)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    # Everything after a bare `--` is passed through untouched (e.g. to pytest by `harness run`).
    passthrough = argv[argv.index("--") + 1:] if "--" in argv else []
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    args.passthrough = passthrough
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from harness.settings import SettingsError, load_settings

    try:  # a bad harness.toml / HARNESS_CONFIG: one line in every command, not a traceback
        load_settings()
    except SettingsError as e:
        print(f"harness: {e}", file=sys.stderr)
        return 2
    try:
        rc = int(args.func(args) or 0)
    except SettingsError as e:  # a malformed HARNESS_* variable, read where it is used
        print(f"harness: {e}", file=sys.stderr)
        return 2
    from harness.registry import broken_entry_points

    broken = broken_entry_points()
    for line in broken:  # what loaded ran; what did not is named, once, and the exit status says so
        print(f"harness: error: {line}", file=sys.stderr)
    return rc or (1 if broken else 0)


if __name__ == "__main__":
    entry()
