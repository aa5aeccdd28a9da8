"""Kill a whole process tree, including what escaped it.

``killpg`` of the launch's session is not enough on its own: torchrun starts every rank in a session of
its own (``start_new_session``), so a killpg of torchrun's session misses the ranks, and any process
may call ``setsid`` or double-fork (a compile worker pool, a server's helper). So the kill is three
nets, one after another: the session (``killpg``), every descendant found by parent links *before*
anything dies (after, the orphans are re-parented to init and out of reach), and every process whose
environment carries the launch's marker token (``HARNESS_LAUNCH_GROUP``, inherited by everything the
launch starts unless it scrubs its environment) - the one net that catches a grandchild whose parent
already exited. Then it waits until they are gone: a process that still holds a port or a device
after the kill returned would fail the next launch.
"""

from __future__ import annotations

import os
import signal
import uuid

from harness import settings


def new_token() -> str:
    return uuid.uuid4().hex[:16]


def mark(env: dict, token: str) -> None:
    """Add ``token`` to ``env``'s marker (a launch inside a launch carries both tokens)."""
    outer = settings.env("HARNESS_LAUNCH_GROUP", env) or ""
    settings.set_env("HARNESS_LAUNCH_GROUP", " ".join([*outer.split(), token]), env)


def marked(token: str) -> list:
    """The live processes (of this user) whose environment carries ``token``."""
    import psutil

    out = []
    me = os.getpid()
    for p in psutil.process_iter(["pid"]):
        if p.pid == me:
            continue
        try:
            val = settings.env("HARNESS_LAUNCH_GROUP", p.environ()) or ""
        except (psutil.Error, OSError, settings.SettingsError):  # gone, a zombie, another user's
            continue
        if token in val.split():
            out.append(p)
    return out


def _descendants(pid: int) -> list:
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def kill_tree(pid: int, token: str | None = None, session: bool = True, wait_s: float = 10.0) -> list[int]:
    """SIGKILL ``pid``'s session (``session``: it was started in its own), every descendant of ``pid``
    and every process marked with ``token``; wait up to ``wait_s`` for them to be gone. Returns the pids
    killed other than ``pid`` itself (the caller reaps it). Rounds repeat while new ones appear: a
    process may fork between the look and the kill."""
    import psutil

    killed: dict[int, psutil.Process] = {}
    for _ in range(5):
        found = _descendants(pid) + (marked(token) if token else [])
        if session:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        fresh = [p for p in found if p.pid not in killed and p.pid != pid]
        for p in fresh:
            try:
                p.kill()
            except psutil.Error:
                continue
            killed[p.pid] = p
        if not fresh:
            break
    wait_gone(list(killed.values()), wait_s)
    return sorted(killed)


def alive(p) -> bool:
    """Running, a zombie not counted: a killed orphan waits as a zombie until init reaps it (some
    containers' init never does), holding no memory, port or device."""
    import psutil

    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def wait_gone(procs: list, wait_s: float) -> list:
    """Wait up to ``wait_s`` until none of ``procs`` is alive; returns the ones still alive (a process
    in uninterruptible sleep in a device driver dies when the driver lets it)."""
    import time

    deadline = time.monotonic() + wait_s
    left = [p for p in procs if alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.02)
        left = [p for p in left if alive(p)]
    return left


def sweep(token: str, wait_s: float = 10.0) -> list[int]:
    """Kill whatever still carries ``token`` (after the group ended on its own: a rank's stray
    grandchild must not outlive the item either). Returns their pids."""
    import psutil

    procs = marked(token)
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    wait_gone(procs, wait_s)
    return sorted(p.pid for p in procs)
