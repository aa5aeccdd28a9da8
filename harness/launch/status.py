"""Per-rank files of a launch, in its run folder: what each rank was doing, how it ended, what it said.

* ``status-<rank>``: one fixed-size record, rewritten in place (``pwrite``) whenever the rank's state
  changes - readable at any time, above all after the rank was killed (a hang), without a torn line.
  Its fields are the caller's (the parallel check: layout index, layout, step, collective, module).
* ``exit-<rank>.json``: written by the rank wrapper (``harness.launch.rank``) when the rank ended:
  exit code, the signal that killed it, and the signal the launcher sent it (torchrun stopping the
  other ranks after one failed is not their failure).
* ``rank<rank>.log``: the rank's stdout and stderr; its tail goes into error messages.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

STATUS_BYTES = 1024


def status_path(run_dir: str | Path, rank: int) -> str:
    return os.path.join(run_dir, f"status-{rank}")


def exit_path(run_dir: str | Path, rank: int) -> str:
    return os.path.join(run_dir, f"exit-{rank}.json")


def log_path(run_dir: str | Path, rank: int) -> str:
    return os.path.join(run_dir, f"rank{rank}.log")


class StatusRecord:
    """The writer of one rank's status file: ``write(fields)`` replaces the record (tab-separated)."""

    def __init__(self, path: str):
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)

    def write(self, fields: list[str]) -> None:
        rec = "\t".join(fields).encode()[:STATUS_BYTES]
        os.pwrite(self.fd, rec + b" " * (STATUS_BYTES - len(rec)), 0)


def read_record(path: str, n: int) -> list[str] | None:
    """The ``n`` fields of a status record (missing ones empty); None where there is no file."""
    try:
        with open(path, "rb") as f:
            raw = f.read(STATUS_BYTES).decode("utf-8", "replace")
    except OSError:
        return None
    return (raw.strip("\x00 \n").split("\t") + [""] * n)[:n]


def write_exit(run_dir: str | Path, rank: int, rec: dict) -> None:
    from harness.files import atomic

    atomic.write_json(exit_path(run_dir, rank), rec, indent=None, newline=False)


def read_exits(run_dir: str | Path, world: int) -> dict[int, dict]:
    """``{rank: exit record}`` of the ranks that wrote one (a rank killed with its wrapper wrote none)."""
    out = {}
    for r in range(world):
        try:
            out[r] = json.loads(Path(exit_path(run_dir, r)).read_text())
        except (OSError, ValueError):
            pass
    return out


def log_tail(path: str | Path, lines: int = 3) -> list[str]:
    """The last ``lines`` non-empty lines of a log (read from its end: a rank's log can be large)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return []
    return [ln.rstrip() for ln in text.splitlines() if ln.strip()][-lines:]
