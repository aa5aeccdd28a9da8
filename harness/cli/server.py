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
``harness server stop`` after that), and what the process is subject to: its resource limits
(``ulimit``, ``prlimit``), niceness, CPU affinity, scheduling policy, cgroup and OOM score
(``process_state``: a fork inherits them from the server, so the server must have the command's).
Modules read some variables at import (``TORCH_LOGS``, ``OMP_NUM_THREADS``...), so a command whose
environment differs in any of them meets no server and runs as before; so does a command under a
memory cap the server was not started under (start one under it: ``ulimit -v ...; harness server
start``). Without a server nothing changes: the check costs a few milliseconds.

The socket is in Linux's abstract namespace (no file is written anywhere), and the server serves
only its own user (the peer's uid, ``SO_PEERCRED``). It ends after ``--idle`` minutes without a
command (30), on ``harness server stop`` or SIGTERM (both after its running commands), or when its
sources change: a later command that meets no server asks every server of the same interpreter and
package whose sources are not today's to stop (no command can reach them again). Ctrl-C and ``kill``
of the command reach its child; a command killed outright (SIGKILL) takes its child's process group
with it; a server killed outright stops its commands with SIGTERM, so each ends as a ``kill`` of it
would (``harness run`` writes the results of what finished, marked interrupted).
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
    """What a process imported with ``env`` depends on, hashed (module docstring), in three parts,
    ``<place>-<code>-<rest>``: where harness runs from (interpreter, ``sys.path``, user, package
    folder), what its code on disk is (harness's sources, the site-packages folders), and the rest
    (the environment, the process's limits). A server whose place is ours and whose code is not can
    never be reached again: ``stop_stale`` finds it by its address."""
    env = dict(os.environ if env is None else env)
    # sys.path[0] is the script's folder (the console script's bin/, `python -m`'s working folder):
    # the command and the server are started differently, and harness is imported from its package.
    place = repr((os.path.realpath(sys.executable), sys.prefix, sys.version, os.getuid(), sys.path[1:], str(_PACKAGE)))
    rest = hashlib.sha256()
    for k in sorted(env):
        if k not in VOLATILE_ENV:
            rest.update(f"{k}={env[k]}\0".encode("utf-8", "surrogateescape"))
    rest.update(repr(process_state()).encode())
    return f"{hashlib.sha256(place.encode()).hexdigest()[:8]}-{_code_digest()}-{rest.hexdigest()[:16]}"


def _code_digest() -> str:
    """The path, size and mtime of each of harness's own source files and the mtime of each
    site-packages folder on ``sys.path``, hashed."""
    h = hashlib.sha256()
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
    return h.hexdigest()[:8]


def process_state() -> dict:
    """What the kernel gives a child as it is and a command is subject to: every resource limit
    (``ulimit``, ``prlimit``), the niceness (``nice``), the CPU affinity (``taskset``), the
    scheduling policy (``chrt``), the cgroup (``systemd-run -p MemoryMax=``) and the OOM score.

    They are part of the key, not carried in the request and applied in the fork: a fork inherits
    them from the server exactly as any child inherits them from its parent, with nothing to apply
    that could fail half-way (raising a hard limit, lowering the niceness or changing the cgroup
    needs privileges), and a limit on the address space counts the whole process, so a fork of a
    process that has torch mapped is not the process the limit was chosen for unless the server
    itself lived under it. A command under other limits meets no server and runs as before; a
    server started under the same ones has them, and so do its forks (``serve`` checks that its
    imports left them as they were)."""
    state: dict = {}
    try:
        import resource

        for name in sorted(n for n in dir(resource) if n.startswith("RLIMIT_")):
            try:
                state[name] = resource.getrlimit(getattr(resource, name))
            except (ValueError, OSError):
                pass
    except ImportError:  # pragma: no cover - not on Linux or macOS
        pass
    for name, get in (("nice", lambda: os.getpriority(os.PRIO_PROCESS, 0)),
                      ("cpus", lambda: sorted(os.sched_getaffinity(0))),
                      ("policy", lambda: os.sched_getscheduler(0)),
                      ("cgroup", lambda: Path("/proc/self/cgroup").read_text()),
                      ("oom_score_adj", lambda: Path("/proc/self/oom_score_adj").read_text())):
        try:
            state[name] = get()
        except (AttributeError, OSError):  # not on this platform
            pass
    return state


def address(key: str) -> bytes:
    """The server's socket: Linux's abstract namespace (a leading NUL), so nothing is written to disk."""
    return b"\0harness-server-%d-%s" % (os.getuid(), key.encode())


def stop_stale(key: str) -> list[int]:
    """Ask this user's servers for the same place as ``key`` whose code differs from what is on disk
    now to stop, and return their pids. No command can reach them again (every command's key has
    today's code); left alone, each would hold its memory until its idle end. They are found by
    their addresses in /proc/net/unix (abstract names start with '@'). The code is hashed anew
    here: a command that hashed it during an edit must not stop a server that is up to date."""
    place, code = key.split("-")[0], _code_digest()
    prefix = "@" + address("")[1:].decode()  # '@harness-server-<uid>-'
    try:
        table = Path("/proc/net/unix").read_text(errors="replace")
    except OSError:
        return []
    # each socket a line, its name last; a server's accepted connections carry its name too
    names = {f[7] for f in (line.split() for line in table.splitlines()[1:]) if len(f) > 7 and f[7].startswith(prefix)}
    stopped = []
    for name in sorted(names):
        theirs = name[len(prefix):]
        if theirs.split("-")[:1] == [place] and theirs.split("-")[1:2] != [code]:
            st = ask(theirs, "stop", timeout=2.0)
            if st is not None:
                stopped.append(st["pid"])
    return stopped


def _peer(s: socket.socket) -> tuple[int, int]:
    """The pid and uid of the process at the other end (``SO_PEERCRED``)."""
    pid, uid, _ = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return pid, uid


def _peer_uid(s: socket.socket) -> int:
    return _peer(s)[1]


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


def ask(key: str, op: str, timeout: float = 5.0) -> dict | None:
    """``ping`` / ``stop`` the server of ``key``; None when there is none."""
    s = _connect(key, timeout)
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
        if s is None:
            stop_stale(key)  # a source edit since they started: they would idle out unreachable
            return None
        server = _peer(s)[0]
    except Exception:  # noqa: BLE001 - a server is an optimisation: anything odd, run here
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
    code = _await_exit(s, replies, started["pid"])
    if code and not _alive(server):
        print(f"harness: the server (pid {server}) was killed while it ran this command, which was "
              "stopped as SIGTERM stops it", file=sys.stderr)
    return code


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs: a killed server stays a zombie until its new parent reaps it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        pass
    return True


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
        server = os.getpid()
        pid = os.fork()
        if pid:
            for fd in fds:
                os.close(fd)
            return pid
        code = 1
        try:
            code = _command_child(req, fds, [*self.fds, *(c.fileno() for c in self.children.values())], server)
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


def _end_with_server(server: int) -> None:
    """SIGTERM this fork when its server dies (Linux ``PR_SET_PDEATHSIG``): a killed server stops
    its commands as a ``kill`` of each would, so each one's own SIGTERM path runs (``harness run``
    writes its results for what finished, marked interrupted; a bisect removes its worktree). Not
    SIGKILL, which took the results with it; not left to run on, where nothing would end it if its
    command died too (the server is what kills the run of a command killed outright)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        return
    if os.getppid() != server:  # it died before the line above: no signal will come
        raise SystemExit(128 + signal.SIGTERM)


def _command_child(req: dict, fds: list[int], server_fds: list[int], server: int) -> int:
    """In the fork: become the command (its streams, folder, environment, argv) and run it."""
    import importlib
    import io
    import random

    os.setpgid(0, 0)  # its own group: the server kills the whole run when the command dies
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _end_with_server(server)
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
    state = process_state()
    _preload()
    changed = _restore(state)
    if changed:
        print(f"harness server: its imports changed {changed} and it cannot change it back", file=sys.stderr)
        return 1
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


def _restore(before: dict) -> str:
    """Put back what the imports changed of the process state in the key (``process_state``: a
    library may raise its own file limit as it loads); what stays changed, named ('' if nothing).
    A fork must start with exactly the limits its command's key says."""
    import resource

    for name, lim in before.items():
        if name.startswith("RLIMIT_") and resource.getrlimit(getattr(resource, name)) != lim:
            _try(resource.setrlimit, getattr(resource, name), lim)
    if "nice" in before and os.getpriority(os.PRIO_PROCESS, 0) != before["nice"]:
        _try(os.setpriority, os.PRIO_PROCESS, 0, before["nice"])
    if "cpus" in before and sorted(os.sched_getaffinity(0)) != before["cpus"]:
        _try(os.sched_setaffinity, 0, before["cpus"])
    after = process_state()
    return ", ".join(k for k in before if after.get(k) != before[k])


def _try(f, *args) -> None:
    try:
        f(*args)
    except (ValueError, OSError):  # not allowed: _restore names what stays changed
        pass


# --- `harness server start|stop|status` ----------------------------------------------------------------
def register(sub) -> None:
    p = sub.add_parser("server", help="a warm process that runs later commands without their imports (start/stop/status)")
    p.add_argument("action", choices=("start", "stop", "status"))
    p.add_argument("--idle", type=amount(0, 7 * 24 * 60, low_open=True), default=DEFAULT_IDLE_MIN, metavar="MIN",
                   help=f"minutes without a command before the server ends (default {DEFAULT_IDLE_MIN:g})")
    p.set_defaults(func=main)


def main(args) -> int:
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
        if st is None:
            _say_stale(stop_stale(key))
        return 0
    st = ask(key, "ping")
    if st is not None:
        print(f"harness server: already running, pid {st['pid']}")
        return 0
    stale = stop_stale(key)
    rc = _start(args.idle)
    _say_stale(stale)
    return rc


def _say_stale(pids: list[int]) -> None:
    if pids:
        print(f"harness server: pid {', '.join(map(str, pids))} (started for harness's sources as they were "
              "before an edit, which no command can reach) stops")


def _start(idle: float) -> int:
    import subprocess

    t = time.monotonic()
    # One pipe for both streams, read line by line until the ready line: what the imports print
    # (warnings) can never fill a pipe nobody reads; the last other line is the error if it fails.
    proc = subprocess.Popen([sys.executable, "-m", "harness.cli.server", "--idle", str(idle)],
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
          f"this environment run in it; ends after {idle:g} min idle or `harness server stop`")
    return 0


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(prog="python -m harness.cli.server")
    ap.add_argument("--idle", type=amount(0, 7 * 24 * 60, low_open=True), default=DEFAULT_IDLE_MIN)
    sys.exit(serve(ap.parse_args().idle))
