"""Scratch folders a harness process makes in the system's temp folder, and their removal.

A scratch folder holds what only this process needs (a parallel launch's rank files, a node set's
folders) and goes when the process ends (atexit). A process that is SIGKILLed - an item's time
limit, a runner's cancel, the OOM killer - runs neither ``finally`` nor atexit, and its folder
stays: on a shared runner those add up until the disk is full and every later job fails at its
first write. So each folder carries its owner (pid, the pid's start time, its pid namespace), and
the next harness process that makes a folder of the same kind removes those whose owner is gone.

"Gone" is decided conservatively: an owner in another pid namespace (another container sharing
``/tmp``) or one whose record cannot be read is never judged, and a pid that is alive counts as
the owner unless its start time differs (the pid was reused).
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import time
from pathlib import Path

from harness.files import atomic

OWNER = ".harness-owner"  # "<pid> <start time in clock ticks> <pid namespace>" of the folder's process


def _start_ticks(pid: int) -> str:
    """The process's start time since boot in clock ticks (field 22 of /proc/PID/stat; "" where
    there is no /proc): with the pid it names one process, a reused pid has another."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    # the command name (field 2) is in parentheses and may hold spaces: count fields after its ')'
    return stat[stat.rindex(")") + 2:].split()[19]


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def owner_record(pid: int | None = None) -> str:
    """This process's (or ``pid``'s, in this namespace) owner line."""
    pid = os.getpid() if pid is None else pid
    return f"{pid} {_start_ticks(pid) or '-'} {_pid_namespace() or '-'}\n"


def owner_gone(record: str) -> bool:
    """Whether the process an owner record names has ended (False where that cannot be told)."""
    try:
        pid_s, ticks, ns = record.split()
        pid = int(pid_s)
    except ValueError:
        return False
    if ns != (_pid_namespace() or "-"):
        return False  # another pid namespace: its pids mean nothing here
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive, another user's
        return False
    return ticks != "-" and _start_ticks(pid) not in ("", ticks)


STALE_S = 86400.0  # a folder of the prefix without an owner record, untouched this long, is a remnant


def sweep_orphans(prefix: str, root: str | Path | None = None) -> list[Path]:
    """Remove the scratch folders named ``<prefix>*`` under ``root`` (the temp folder) whose owner
    is gone; the folders removed. Also those with no owner record left that nothing touched for a
    day: an exit's removal that raced a child still making a subfolder took the record and left the
    rest (CI saw ``harness-parallel-*/<key>/w2-launch0``), and nothing else would ever remove them."""
    gone = []
    for folder in Path(root or tempfile.gettempdir()).glob(f"{prefix}*"):
        if _orphaned(folder):
            shutil.rmtree(folder, ignore_errors=True)
            gone.append(folder)
    return gone


def _orphaned(folder: Path) -> bool:
    """Its owner is gone, or it has no owner record and is a day old (False where that cannot be read)."""
    try:
        return owner_gone((folder / OWNER).read_text())
    except FileNotFoundError:
        try:
            return folder.is_dir() and time.time() - folder.stat().st_mtime > STALE_S
        except OSError:
            return False
    except OSError:
        return False


def scratch_dir(prefix: str, root: str | Path | None = None) -> Path:
    """A new folder ``<root>/<prefix><random>`` owned by this process (mode 0700), removed when the
    process exits; orphans of the same prefix are swept first."""
    sweep_orphans(prefix, root)
    p = Path(tempfile.mkdtemp(prefix=prefix, dir=root))
    atomic.write_text(p / OWNER, owner_record())
    atexit.register(_remove, p, os.getpid())
    return p


def _remove(p: Path, pid: int) -> None:
    # a forked child inherits the atexit handlers (an isolated item worker, `harness server`'s): only the
    # folder's own process removes it, never a child that ends while its parent still uses it
    if os.getpid() == pid:
        shutil.rmtree(p, ignore_errors=True)
