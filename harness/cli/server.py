"""`harness server`: a warm process that runs harness commands without paying their imports again.

Every ``harness`` command is a fresh interpreter, and one that builds a model first imports torch and
transformers: 2.5-2.8 s on this 2-core machine before any work, against 0.9 s of items in a smoke run
over the six bundled suites (docs/running.md). Only a process that stays alive between commands can
remove that floor, so, as Gradle's daemon, Ruby's spring or Android's zygote do it:

* ``harness server start`` starts a process that imports torch, transformers, pytest and harness's
  own modules once, runs nothing, and waits on a local socket;
* each ``harness ...`` command then sends its arguments, working directory, environment and standard
  streams (the file descriptors themselves) to that process, which **forks** a child for it: the
  child runs the command and its exit status goes back to the command, which exits with it. The
  child's isolated item worker (docs/running.md) is a fork of the same pristine process too, ready at
  once, where a fresh one imports everything again.

Every command runs in a fresh fork of a process that has only imported, never after another command
in the same one, so nothing a run does leaks into the next. A command uses a server only when one was
started for the same *key*: the interpreter, ``sys.path``, the user, every environment variable
(except the few a shell changes as it goes: ``PWD``, ``OLDPWD``, ``_``, ``SHLVL``), the path, size
and mtime of each of harness's own source files, and the mtime of each site-packages folder on
``sys.path`` (an install or uninstall changes it; a vendor plugin's source edited in place does not:
``harness server stop`` after that). Modules read some variables at import (``TORCH_LOGS``,
``OMP_NUM_THREADS``...), so a command whose environment differs in any of them meets no server and
runs as before. Without a server nothing changes: the check costs a few milliseconds.

The socket is in Linux's abstract namespace (no file is written anywhere), and the server serves
only its own user (the peer's uid, ``SO_PEERCRED``). It ends after ``--idle`` minutes without a
command (30), on ``harness server stop``, or with its key's sources: a later command with changed
sources has another key and starts nothing (the old server idles out). Ctrl-C and ``kill`` of the
command reach its child; a command killed outright (SIGKILL) takes its child's process group with it.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import struct
import sys
import time
from pathlib import Path

from harness.numbers import amount

# Variables a shell changes by itself (cd, nesting, the last command): no import reads them.
VOLATILE_ENV = frozenset({"PWD", "OLDPWD", "_", "SHLVL"})
DEFAULT_IDLE_MIN = 30.0
_HEADER = struct.Struct("!I")  # the request's JSON length; the standard streams ride on its first byte
_PACKAGE = Path(__file__).resolve().parents[1]  # harness/


# --- the key and the address (standard library only: every command computes them) --------------------
def server_key(env: dict[str, str] | None = None) -> str:
    """What a process imported with ``env`` depends on, hashed (module docstring)."""
    env = dict(os.environ if env is None else env)
    h = hashlib.sha256()
    # sys.path[0] is the script's folder (the console script's bin/, `python -m`'s working folder):
    # the command and the server are started differently, and harness is imported from its package.
    h.update(repr((os.path.realpath(sys.executable), sys.prefix, sys.version, os.getuid(), sys.path[1:])).encode())
    for k in sorted(env):
        if k not in VOLATILE_ENV:
            h.update(f"{k}={env[k]}\0".encode("utf-8", "surrogateescape"))
    for root, dirs, files in os.walk(_PACKAGE):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for f in sorted(files):
            if f.endswith(".py"):
                p = os.path.join(root, f)
                try:
                    st = os.stat(p)
                except OSError:
                    continue
                h.update(f"{p}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    for p in sys.path[1:]:
        # an install or uninstall adds or removes an entry there; a source folder on the path (the
        # working folder, through an empty PYTHONPATH entry) changes with every file a run writes
        if p.endswith(("site-packages", "dist-packages")):
            try:
                h.update(f"{p}\0{os.stat(p).st_mtime_ns}\0".encode())
            except OSError:
                pass
    return h.hexdigest()[:24]


def address(key: str) -> bytes:
    """The server's socket: Linux's abstract namespace (a leading NUL), so nothing is written to disk."""
    return b"\0harness-server-%d-%s" % (os.getuid(), key.encode())


def _peer_uid(s: socket.socket) -> int:
    return struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[1]


def _connect(key: str, timeout: float | None = 5.0) -> socket.socket | None:
    """A connection to the server of ``key``, if one runs as this user. The abstract namespace has no
    permissions: a name another user bound first gets nothing from us (not the environment, which
    may hold tokens, nor the terminal)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(address(key))
        if _peer_uid(s) != os.getuid():
            raise PermissionError("another user's socket")
    except OSError:
        s.close()
        return None
    return s


def _send(s: socket.socket, message: dict, fds: list[int] = ()) -> None:
    data = json.dumps(message).encode()
    head = _HEADER.pack(len(data))
    socket.send_fds(s, [head[:1]], list(fds))  # SCM_RIGHTS: the descriptors travel with this byte
    s.sendall(head[1:] + data)


def _recv_exact(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("closed mid-message")
        buf += chunk
    return buf


def _recv(s: socket.socket, maxfds: int = 3) -> tuple[dict, list[int]]:
    first, fds, _, _ = socket.recv_fds(s, 1, maxfds)
    if not first:
        raise ConnectionError("closed before a message")
    head = first + _recv_exact(s, _HEADER.size - 1)
    return json.loads(_recv_exact(s, _HEADER.unpack(head)[0])), fds


def _lines(s: socket.socket):
    """The server's replies: one JSON object a line, until it closes."""
    buf = b""
    while True:
        try:
            chunk = s.recv(4096)
        except InterruptedError:  # pragma: no cover - PEP 475 retries; kept for old kernels
            continue
        if not chunk:
            return
        buf += chunk
        while b"\n" in buf:
            line, _, buf = buf.partition(b"\n")
            yield json.loads(line)


def ask(key: str, op: str) -> dict | None:
    """``ping`` / ``stop`` the server of ``key``; None when there is none."""
    s = _connect(key)
    if s is None:
        return None
    try:
        _send(s, {"op": op, "key": key})
        return next(_lines(s), None)
    except (OSError, ValueError, ConnectionError):
        return None
    finally:
        s.close()


# --- the command's side: hand the command over, relay signals, return its status ----------------------
def forward(argv: list[str]) -> int | None:
    """Run ``harness argv`` in a server started for this environment and return its exit status;
    None when there is no such server (or it refused before starting anything): run it here."""
    if argv[:1] == ["server"]:
        return None
    try:
        key = server_key()
        s = _connect(key)
    except Exception:  # noqa: BLE001 - a server is an optimisation: anything odd, run here
        return None
    if s is None:
        return None
    fds = _open_streams()
    umask = os.umask(0)
    os.umask(umask)
    request = {"op": "run", "key": key, "argv": argv, "cwd": os.getcwd(), "env": dict(os.environ),
               "umask": umask, "path": sys.path, "argv0": sys.argv[0] if sys.argv else "harness",
               "streams": [fd >= 0 for fd in fds]}
    try:
        _send(s, request, [fd for fd in fds if fd >= 0])
        replies = _lines(s)
        # The fork's pid comes within milliseconds; a server busy with another connection's
        # request answers within its 10 s limit for one. Past this, nothing ran there: run here.
        s.settimeout(60)
        started = next(replies, None)
        s.settimeout(None)
    except (OSError, ValueError, ConnectionError):
        s.close()
        return None
    if not started or "pid" not in started:
        s.close()
        return None
    return _await_exit(s, replies, started["pid"])


def _open_streams() -> list[int]:
    """Standard input, output and error: each one's fd, -1 where it is closed (`harness ... <&-`:
    the child gets /dev/null there)."""
    fds = []
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
            fds.append(fd)
        except OSError:
            fds.append(-1)
    return fds


def _await_exit(s: socket.socket, replies, pid: int) -> int:
    """The command's exit status from the server, relaying this process's signals to its fork."""

    def relay(sig, _frame):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, relay)
    try:
        for msg in replies:
            if "exit" in msg:
                return int(msg["exit"])
    except (OSError, ValueError):
        pass
    finally:
        s.close()
    print(f"harness: the server went away while it ran this command (its pid {pid})", file=sys.stderr)
    return 1


# --- the server's side ---------------------------------------------------------------------------------
def _preload() -> None:
    """Import what every model-running command and its isolated worker import (never run anything:
    each fork must start as a fresh process would, torch's thread pools and devices untouched)."""
    from importlib.metadata import entry_points

    import pytest  # noqa: F401
    import torch  # noqa: F401
    import transformers.generation.utils  # noqa: F401
    import transformers.modeling_utils  # noqa: F401

    import harness.checks  # noqa: F401
    import harness.compare.pipeline  # noqa: F401 - `harness compare` / `report` import it when they run
    import harness.compare.report  # noqa: F401
    import harness.run.driver  # noqa: F401
    import harness.run.execute  # noqa: F401
    import harness.run.isolation  # noqa: F401
    import harness.run.plugin  # noqa: F401
    import harness.suite.loader  # noqa: F401
    from harness.cli import build_parser

    build_parser()  # imports every subcommand's module
    from harness.registry import of_group

    # What the first item (and `harness backends`) loads: the entry points' targets. A backend's
    # device module (torch_npu...) is not among them: a worker imports it before its first item.
    for group in ("harness.backends", "harness.checks", "harness.models", "harness.weights", "harness.sinks"):
        of_group(group)
    for ep in entry_points(group="pytest11"):  # pytest loads them at every session
        try:
            ep.load()
        except Exception:  # noqa: BLE001, S110 - pytest reports it in the command, as without a server
            pass


def _own_finalizers() -> list:
    """Keep the server's exit-time finalizers out of its forks' exits, and return them (the server
    runs them at its own end). They are the server's: torch's operator libraries (176 here), which a
    fork's exit would deregister one by one through copy-on-write pages (~30 ms, measured), and
    anything of the server's own a fork must not remove (a temporary folder's cleanup)."""
    import gc
    import weakref

    mine = [o for o in gc.get_objects() if issubclass(type(o), weakref.finalize) and o.atexit]
    for f in mine:
        f.atexit = False  # a documented, writable property of weakref.finalize
    return mine


class _Server:
    def __init__(self, key: str, idle_s: float):
        self.key, self.idle_s = key, idle_s
        self.started = time.time()
        self.served = 0
        self.children: dict[int, socket.socket] = {}  # command child's pid -> its command's connection
        self.stopping = False

    def run(self, listener: socket.socket) -> None:
        import selectors

        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_r, False)
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the loop through the wakeup fd
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "stopping", True))
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        sel = selectors.DefaultSelector()
        self.fds = [listener.fileno(), wake_r, wake_w, sel.fileno()]  # what a fork closes first
        sel.register(listener, selectors.EVENT_READ, "accept")
        sel.register(wake_r, selectors.EVENT_READ, "wake")
        last = time.monotonic()
        while True:
            if self.stopping and listener.fileno() >= 0:
                # no new command waits on a server that is ending: a connect is refused at once
                # and the command runs where it was typed
                sel.unregister(listener)
                listener.close()
            if self.stopping and not self.children:
                break
            timeout = None if self.children else max(0.0, last + self.idle_s - time.monotonic())
            if not self.children and timeout <= 0:
                break
            for k, _ in sel.select(timeout):
                self._event(k, sel, listener, wake_r)
            self._reap(sel)
            if self.children:
                last = time.monotonic()
        listener.close()

    def _event(self, k, sel, listener: socket.socket, wake_r: int) -> None:
        """One ready file of the loop: the signal wakeup pipe (drained), the listener (a command to
        serve), or a command's connection (only its end is news)."""
        if k.data == "wake":
            try:
                while os.read(wake_r, 512):
                    pass
            except BlockingIOError:
                pass
        elif k.data == "accept" and not self.stopping:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            self._serve(conn, sel)
        elif isinstance(k.data, int):
            self._drop_if_gone(k.data, k.fileobj, sel)

    def _drop_if_gone(self, pid: int, conn: socket.socket, sel) -> None:
        """The command died (SIGKILL, a closed terminal): its run goes with it."""
        try:
            gone = conn.recv(1, socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            gone = False
        except OSError:
            gone = True
        if gone:
            sel.unregister(conn)
            self._kill(pid)

    def _kill(self, pid: int) -> None:
        for target in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
            try:
                target()
                return
            except (ProcessLookupError, PermissionError):
                continue

    def _reap(self, sel) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            if conn is None:
                continue
            code = os.waitstatus_to_exitcode(status)
            code = 128 - code if code < 0 else code  # killed by signal n: the shell's 128 + n
            try:
                sel.unregister(conn)
            except (KeyError, ValueError):
                pass
            try:
                conn.sendall(json.dumps({"exit": code}).encode() + b"\n")
            except OSError:
                pass
            conn.close()

    def _serve(self, conn: socket.socket, sel) -> None:
        import selectors

        conn.settimeout(10)
        fds: list[int] = []
        try:
            if _peer_uid(conn) != os.getuid():  # another user: never run their command as ours
                conn.close()
                return
            req, fds = _recv(conn)
            op = req.get("op")
            if req.get("key") != self.key:
                raise ValueError("another key")
            if op == "ping":
                conn.sendall(json.dumps(self.status()).encode() + b"\n")
            elif op == "stop":
                self.stopping = True
                conn.sendall(json.dumps({**self.status(), "stopping": True}).encode() + b"\n")
            elif op == "run":
                pid = self._fork(req, fds, conn)
                fds = []  # the child has them; ours are closed
                self.children[pid] = conn
                self.served += 1
                conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
                conn.settimeout(None)
                sel.register(conn, selectors.EVENT_READ, pid)
                return
        except (OSError, ValueError, ConnectionError):
            pass
        finally:
            for fd in fds:
                os.close(fd)
        if conn.fileno() >= 0 and conn not in self.children.values():
            conn.close()

    def status(self) -> dict:
        return {"pid": os.getpid(), "key": self.key, "started": self.started, "served": self.served,
                "running": sorted(self.children), "idle_s": self.idle_s}

    def _fork(self, req: dict, fds: list[int], conn: socket.socket) -> int:
        pid = os.fork()
        if pid:
            for fd in fds:
                os.close(fd)
            return pid
        code = 1
        try:
            code = _command_child(req, fds, [*self.fds, *(c.fileno() for c in self.children.values())])
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
        except KeyboardInterrupt:
            code = 130
        except BaseException:  # noqa: BLE001 - never back into the server's loop
            import traceback

            traceback.print_exc()
        finally:
            try:
                _leave(code, conn)
            finally:
                os._exit(code)


def _leave(code: int, conn: socket.socket) -> None:
    """End the command as an interpreter's exit would (its non-daemon threads waited for, the exit
    handlers run, the streams flushed), then tell the command its status at once: the kernel's
    teardown of this process's address space (~40 ms with torch mapped, measured) is no longer the
    command's wait."""
    import threading

    from harness.proc import run_exit_handlers

    for t in threading.enumerate():
        if t is not threading.main_thread() and not t.daemon:
            t.join()
    run_exit_handlers()
    try:
        conn.sendall(json.dumps({"exit": code}).encode() + b"\n")
    except OSError:
        pass  # the server reports it after reaping this process


def _command_child(req: dict, fds: list[int], server_fds: list[int]) -> int:
    """In the fork: become the command (its streams, folder, environment, argv) and run it."""
    import importlib
    import io
    import random

    from harness.proc import die_with_parent

    os.setpgid(0, 0)  # its own group: the server kills the whole run when the command dies
    die_with_parent()  # and a killed server takes its commands with it
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for fd in server_fds:
        try:
            os.close(fd)
        except OSError:
            pass
    given = iter(fds)
    for target, present in zip((0, 1, 2), req.get("streams", [True] * 3), strict=True):
        fd = next(given) if present else os.open(os.devnull, os.O_RDWR)
        if fd != target:
            os.dup2(fd, target)
            os.close(fd)
    os.chdir(req["cwd"])
    os.umask(int(req.get("umask", 0o022)))
    os.environ.clear()
    os.environ.update(req["env"])
    sys.path[:] = req["path"]
    sys.argv = [req.get("argv0", "harness"), *req["argv"]]
    # Python chose the streams' buffering for the server's /dev/null: choose again for these.
    enc = {"encoding": sys.stdout.encoding, "errors": "backslashreplace"}
    sys.stdin = io.TextIOWrapper(os.fdopen(0, "rb", closefd=False), encoding=sys.stdin.encoding)
    sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", closefd=False), line_buffering=os.isatty(1), **enc)
    sys.stderr = io.TextIOWrapper(os.fdopen(2, "wb", closefd=False), line_buffering=True, **enc)
    random.seed()  # a fresh process's seed, not the server's state shared by every fork
    importlib.invalidate_caches()
    from harness import settings
    from harness.run import isolation

    settings.reset_caches()  # harness.toml and HARNESS_* are read anew, as in a fresh process
    # `harness run` starts its worker first thing, while this process has run nothing: a fork then.
    # Any other command (or a later worker) may start one after its own torch work: a new process.
    isolation.FORK_FIRST_WORKER = req["argv"][:1] == ["run"]
    from harness.cli import main

    return main(list(req["argv"]))


def serve(idle_min: float) -> int:
    """The server process (``python -m harness.cli.server``, started by ``harness server start``)."""
    key = server_key()  # before any import can touch the environment
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(address(key))
    except OSError:
        print("harness server: one is already running for this environment", file=sys.stderr)
        return 1
    _preload()
    finalizers = _own_finalizers()
    import gc

    gc.freeze()  # every fork shares these pages and never walks them again
    listener.listen(64)
    # started: the starter was waiting for this line; nothing more is written anywhere
    print(json.dumps({"ready": os.getpid()}), flush=True)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)
    _Server(key, idle_min * 60).run(listener)
    for f in finalizers:
        f.atexit = True
    return 0


# --- `harness server start|stop|status` ----------------------------------------------------------------
def register(sub) -> None:
    p = sub.add_parser("server", help="a warm process that runs later commands without their imports (start/stop/status)")
    p.add_argument("action", choices=("start", "stop", "status"))
    p.add_argument("--idle", type=amount(0, 7 * 24 * 60, low_open=True), default=DEFAULT_IDLE_MIN, metavar="MIN",
                   help=f"minutes without a command before the server ends (default {DEFAULT_IDLE_MIN:g})")
    p.set_defaults(func=main)


def main(args) -> int:
    import subprocess

    key = server_key()
    if args.action == "status":
        st = ask(key, "ping")
        if st is None:
            print("harness server: none for this environment")
            return 1
        print(f"harness server: pid {st['pid']}, up {time.time() - st['started']:.0f} s, {st['served']} "
              f"command(s) served, {len(st['running'])} running, ends after {st['idle_s'] / 60:g} min idle")
        return 0
    if args.action == "stop":
        st = ask(key, "stop")
        print("harness server: none for this environment" if st is None else
              f"harness server: pid {st['pid']} stops" + (" after its running commands" if st["running"] else ""))
        return 0
    st = ask(key, "ping")
    if st is not None:
        print(f"harness server: already running, pid {st['pid']}")
        return 0
    t = time.monotonic()
    # One pipe for both streams, read line by line until the ready line: what the imports print
    # (warnings) can never fill a pipe nobody reads; the last other line is the error if it fails.
    proc = subprocess.Popen([sys.executable, "-m", "harness.cli.server", "--idle", str(args.idle)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    ready, said = None, []
    for raw in proc.stdout:
        line = raw.decode(errors="replace").strip()
        try:
            ready = json.loads(line).get("ready") if line.startswith("{") else None
        except (ValueError, AttributeError):
            ready = None
        if ready:
            break
        if line:
            said.append(line)
    if not ready:
        proc.wait()
        print(f"harness server: did not start: {said[-1] if said else f'exit status {proc.returncode}'}",
              file=sys.stderr)
        return 1
    proc.stdout.close()
    print(f"harness server: pid {ready}, ready in {time.monotonic() - t:.1f} s; later `harness` commands from "
          f"this environment run in it; ends after {args.idle:g} min idle or `harness server stop`")
    return 0


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(prog="python -m harness.cli.server")
    ap.add_argument("--idle", type=amount(0, 7 * 24 * 60, low_open=True), default=DEFAULT_IDLE_MIN)
    sys.exit(serve(ap.parse_args().idle))
