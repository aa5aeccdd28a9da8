"""Readiness of a server started through the launch layer: its TCP port on 127.0.0.1 accepts a
connection, or a ready-line appears in its log - within a time limit. A server that exits, or is not
ready in time, is a one-line ``NotReady`` with the tail of its log (the reason is almost always
there: a missing module, a port in use, out of memory). The serving-engine check starts vLLM's server
this way (issue #46).
"""

from __future__ import annotations

import re
import socket
import time
from collections.abc import Callable
from pathlib import Path

from harness.launch.status import log_tail


class NotReady(Exception):
    """The server exited or was not ready within its limit (one line, with its log's tail)."""


def port_open(port: int, host: str = "127.0.0.1", timeout_s: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the kernel's pick; a server started next may take it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _line_seen(log: Path, pattern: re.Pattern, pos: list[int]) -> bool:
    """Whether ``pattern`` appears in what ``log`` gained since ``pos[0]`` (a line is read whole)."""
    try:
        with open(log, "rb") as f:
            f.seek(pos[0])
            chunk = f.read()
    except OSError:
        return False
    end = chunk.rfind(b"\n")
    if end < 0:
        return False
    pos[0] += end + 1
    return any(pattern.search(ln) for ln in chunk[:end].decode("utf-8", "replace").splitlines())


def wait_ready(*, timeout_s: float, port: int | None = None, line: str | None = None, log: Path | None = None,
               poll: Callable[[], int | None] | None = None, name: str = "server", interval_s: float = 0.1) -> float:
    """Wait until ``port`` on 127.0.0.1 accepts and/or ``line`` (a regular expression) appears in
    ``log``; both given, both are needed. ``poll()`` (e.g. ``Popen.poll``) returns the exit code once
    the server exited: then it is not waited for. Returns the seconds it took."""
    if port is None and line is None:
        raise ValueError("wait_ready needs a port, a ready-line or both")
    if line is not None and log is None:
        raise ValueError("a ready-line needs the log to look for it in")
    pattern = re.compile(line) if line is not None else None
    pos = [0]
    seen_line = pattern is None
    t0 = time.monotonic()
    while True:
        seen_line = seen_line or _line_seen(log, pattern, pos)
        if seen_line and (port is None or port_open(port)):
            return time.monotonic() - t0
        code = poll() if poll is not None else None
        waited = time.monotonic() - t0
        if code is not None or waited > timeout_s:
            what = " and ".join(x for x in (f"port {port} accepting" if port is not None else "",
                                            f"a line matching {line!r} in its log" if line is not None else "") if x)
            how = f"exited with code {code}" if code is not None else f"not ready within {timeout_s:g} s"
            tail = " / ".join(log_tail(log)) if log is not None else ""
            raise NotReady(f"{name} {how} (waited for {what})" + (f"; log: {tail}" if tail else "; log empty"))
        time.sleep(interval_s)
