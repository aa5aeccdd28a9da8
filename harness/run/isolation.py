"""Run items in a child process with a time limit, a memory limit and a post-mortem.

Why a child: a kernel that hangs, a driver that calls ``abort()``, or a model that leaks memory must
cost one item, not the run. The pytest process (or each xdist worker) keeps one long-lived child,
``python -m harness.run.isolation``, that imports torch once and runs items one after another; so the
price of isolation is one interpreter start per pytest process, not one per item.

Protocol: a fresh child writes ``{"ready": true}`` once its imports are done (the item's time
limit counts from there: an interpreter start on a loaded runner is not the item's hang; a child
that cannot start within ``startup_s`` is an error of its own). The parent writes one JSON line per
item on the child's command pipe and reads one JSON line back on the result pipe (``ItemResult`` plus RSS before/after). While the item runs, the child
keeps a 1 KiB *status file* up to date: the check's step (``ctx.step`` phases: build, forward,
backward, ...) and the last ``nn.Module`` entered (a global forward pre-hook). When the item:

* stops making progress (no CPU time used by any process of its tree - the child, its compile
  workers, its launched ranks - and no phase or module entered, for ``stall_s``): the child's process
  group is killed and the item is an *error* naming the phase and the last module entered ("hung: no
  progress for 60 s ... in forward (last module entered: model.layers.1.mlp)"). An item that is only
  slow - a busy machine, a cold compiler cache - keeps using CPU and is not killed;
* runs past its wall-clock limit (a generous backstop for what keeps spinning, or the limit the user
  set with ``--timeout``): killed the same way, "hung: no result within the N s time limit";
* dies by a signal (``abort()`` -> SIGABRT, a segfault): an *error* with the signal and phase;
* exceeds the memory limit (RSS polled by the parent): killed, an *error* with the figures;
* leaks (RSS after the item exceeds RSS before by more than ``leak_bytes``): it keeps its own
  outcome, records ``leaked_bytes``, and the child is replaced, so the leak is never charged to the
  next item's peak memory.

After any kill the next item gets a fresh child. Peak memory is each item's own: the child resets
its high-water mark (VmHWM) before every item.

A vendor module (the request's ``module``: torch_npu, the test device) is imported by a child before
its first item, never after another item: torch's autograd engine sizes its per-device queues from
the devices registered at the first backward, so a PrivateUse1 module imported after a CPU item's
backward fails every later backward on that device (``device_ready_queues_`` internal assert; found
with ``harness run --backend cpu --backend testdev``). A request whose module the child has not
imported, after items without it, gets a fresh child.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from harness import metrics
from harness.launch import tree
from harness.proc import die_with_parent, rss_bytes, signal_name
from harness.run.rows import ItemResult
from harness.settings import env as setting
from harness.settings import set_env

STATUS_BYTES = 1024
_STATUS_DIR: list[str] = []  # this process's folder of its children's status files (made on first use)


def _status_dir() -> str:
    """One scratch folder per parent for its children's status files: removed at its exit, and swept by
    the next parent where this one was SIGKILLed (a lone ``harness-status-*`` file stayed in the temp
    folder for every killed run)."""
    if not _STATUS_DIR:
        from harness.files import scratch

        _STATUS_DIR.append(str(scratch.scratch_dir("harness-isolation-")))
    return _STATUS_DIR[0]


# How an item's error begins when its fresh child never became ready (confirm.py: the runner's fault)
WORKER_DID_NOT_START = "the isolated worker did not start"
metrics.declare("leaked_bytes", "bytes", "lower",
                "host RSS the item left behind in its process (its worker was replaced afterwards)")


@dataclass
class Limits:
    timeout_s: float  # wall time for one item, build included: the backstop (durations.timeout_for)
    memory_bytes: int | None = None  # RSS limit of the child; None: none
    # A fresh child's interpreter start and imports (torch, transformers: 3-5 s idle, tens of
    # seconds on a loaded CI runner) are not the item's: its clock starts once the child says it
    # is ready, and the start has its own, generous limit.
    startup_s: float = 300.0
    leak_bytes: int = 512 * 2**20  # RSS growth over one item that replaces the child
    # No progress for this long is a hang (_Progress); None: the wall clock alone decides.
    stall_s: float | None = None


class _Progress:
    """Is an item still doing anything? Sampled by the parent about once a second.

    Progress is either of two signals, over the last ``stall_s`` seconds:

    * CPU time used by the item's process tree (the child and every descendant: inductor's compile
      workers, torchrun and its ranks, an engine) of at least ``MIN_CPU_SHARE`` of one core. A
      process that waits forever - a kernel blocked on a device, a collective whose peer is gone,
      a sleep - uses next to none; an item that is merely slow uses its share of the cores however
      loaded the machine is (4 processes per core still get 25 % each, 12x this floor);
    * a change of the status file (a new phase, a module entered): a wait that ends moves it.

    Only a tree that shows neither for ``stall_s`` is hung. A kernel that spins on the CPU forever
    looks like work: the wall-clock backstop catches that one.
    """

    MIN_CPU_SHARE = 0.02  # of one core, averaged over the window

    def __init__(self, pid: int, stall_s: float):
        self.pid, self.stall_s = pid, stall_s
        self.cpu: dict[int, float] = {}  # pid -> CPU seconds at the last sample
        self.used = 0.0  # CPU seconds the tree used since the item started (positive deltas only)
        self.samples: list[tuple[float, float, str]] = []  # (time, used, status) within the window
        self.t_next = 0.0

    def _tree_cpu(self) -> dict[int, float]:
        import psutil

        try:
            root = psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return {}
        out = {}
        for p in procs:
            try:
                t = p.cpu_times()  # children_*: the reaped children's, so a finished worker's CPU stays counted
                out[p.pid] = t.user + t.system + t.children_user + t.children_system
            except psutil.Error:
                pass
        return out

    def sample(self, now: float, status: str) -> None:
        if now < self.t_next:
            return
        self.t_next = now + 1.0
        cpu = self._tree_cpu()
        # a new process's whole CPU counts; one that went away is simply no longer summed
        self.used += sum(max(0.0, c - self.cpu.get(pid, 0.0)) for pid, c in cpu.items())
        self.cpu = cpu
        self.samples.append((now, self.used, status))
        while len(self.samples) > 2 and self.samples[1][0] <= now - self.stall_s:
            self.samples.pop(0)  # keep one sample at or before the window's start

    def stalled(self, now: float) -> bool:
        if not self.samples or now - self.samples[0][0] < self.stall_s:
            return False  # not watched for a whole window yet
        t0, used0, _ = self.samples[0]
        if any(st != self.samples[0][2] for _, _, st in self.samples):
            return False
        return self.used - used0 < self.MIN_CPU_SHARE * (now - t0)


def _rss(pid: int | None = None) -> int:
    return rss_bytes(pid)


# Set by `harness server` in a command's process, a fresh fork of a process that has imported torch,
# transformers and the checks and run nothing (harness/cli/server.py): its first worker is a fork of
# it too, ready at once, where a new interpreter imports everything again (2.5-2.8 s here). Only the
# first, started before this process has run anything; replacements (after a hang, a crash, a leak)
# start as usual.
FORK_FIRST_WORKER = False


def _fork_ok() -> bool:
    global FORK_FIRST_WORKER
    import threading

    ok = FORK_FIRST_WORKER and threading.active_count() == 1
    FORK_FIRST_WORKER = False
    return ok


class _Forked:
    """What a Worker uses of ``subprocess.Popen``, for a child forked rather than started."""

    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: gone, status unknown
                self.returncode = -signal.SIGKILL
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)  # -n for signal n, as Popen's
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.poll() is not None:
            return self.returncode
        try:  # woken by the exit itself, not by polling
            fd = os.pidfd_open(self.pid)
        except (OSError, AttributeError):
            fd = None
        try:
            deadline = None if timeout is None else time.monotonic() + timeout
            while self.poll() is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
                if fd is not None:
                    select.select([fd], [], [], left)
                else:
                    time.sleep(0.005 if left is None else min(0.005, left))
        finally:
            if fd is not None:
                os.close(fd)
        return self.returncode


def _forked_child(close: tuple[int, ...], env: dict) -> int:
    """The worker's process when forked: what ``python -m harness.run.isolation`` would be (its
    pipes' ends named in ``env``, as for a started one; ``close``: the parent's ends)."""
    os.setsid()  # its own session, as start_new_session gives the started one
    for fd in close:
        os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.environ.clear()
    os.environ.update(env)
    code = 1
    try:
        code = _child_main()
    finally:
        from harness.proc import exit_now

        try:
            exit_now(code)
        finally:
            os._exit(code)


class Worker:
    """The parent's handle on one child."""

    def __init__(self, env: dict | None = None):
        self.env = env
        self.proc: subprocess.Popen | None = None
        self.status_path: str | None = None
        self.started = 0.0
        self.busy = False  # an item is in flight (an interrupted parent must not wait for it)
        self.items = 0  # items the current child has run
        self.modules: set[str] = set()  # vendor modules the current child's items imported
        self.restarts_for_module = 0

    # --- life cycle ---------------------------------------------------------------------------
    def _start(self) -> None:
        cmd_r, cmd_w = os.pipe()
        res_r, res_w = os.pipe()
        fd, self.status_path = tempfile.mkstemp(prefix="status-", dir=_status_dir())
        os.write(fd, b" " * STATUS_BYTES)
        os.close(fd)
        env = dict(os.environ if self.env is None else self.env)
        # everything the child starts carries this token, so a kill finds what escaped its session
        self.token = tree.new_token()
        tree.mark(env, self.token)
        set_env("HARNESS_ISOLATION_FDS", f"{cmd_r},{res_w}", env)
        set_env("HARNESS_ISOLATION_STATUS", self.status_path, env)
        # Its own session: a kill of the process group takes the child's own children (a
        # compile worker, a launcher) with it, and a signal meant for the parent's group (Ctrl-C)
        # does not reach the child mid-item; the child dies with the parent (PR_SET_PDEATHSIG).
        if _fork_ok():
            pid = os.fork()
            if pid == 0:
                _forked_child((cmd_w, res_r), env)
            self.proc = _Forked(pid)
        else:
            self.proc = subprocess.Popen([sys.executable, "-m", "harness.run.isolation"], env=env,
                                         pass_fds=(cmd_r, res_w), start_new_session=True, stdin=subprocess.DEVNULL)
        os.close(cmd_r)
        os.close(res_w)
        self.cmd = os.fdopen(cmd_w, "w", buffering=1)
        self.res_fd = res_r
        self.buf = b""
        self.started = time.monotonic()
        self.ready = False  # the child has said {"ready": true}
        self.items, self.modules = 0, set()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """The child, its session and everything it started, what escaped the session included (a
        compile pool, a launcher's ranks, a daemon that double-forked: harness.launch.tree)."""
        if self.proc is None:
            return
        tree.kill_tree(self.proc.pid, getattr(self, "token", None))
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self._close()

    def close(self) -> None:
        """Polite shutdown at the end of the session (a kill if an item is still in flight). The
        child says ``{"bye": true}`` once its exit handlers have run: its process's end after that
        (the kernel unmapping torch's address space: ~40 ms, measured) is not waited for. A child that
        has not said ready yet ran no item: it is killed, not asked (it would read the request only after
        its imports, and a run that refuses its input in a second waited 5 s for that)."""
        if self.alive() and not self.busy and self.ready:
            try:
                self.cmd.write("null\n")
                self.cmd.flush()
                deadline = time.monotonic() + 5
                while (line := self._readline(max(0.0, deadline - time.monotonic()))) is not None:
                    if json.loads(line).get("bye"):
                        self._close()  # it is leaving; the kernel reaps it once this process ends
                        tree.sweep(self.token, wait_s=2.0)  # a stray an item left running ends with it
                        return
                self.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except (OSError, subprocess.TimeoutExpired, ValueError):
                pass
        self.kill()

    def _close(self) -> None:
        for f in (getattr(self, "cmd", None),):
            try:
                if f:
                    f.close()
            except OSError:
                pass
        try:
            os.close(self.res_fd)
        except (OSError, AttributeError):
            pass
        if self.status_path:
            try:
                os.unlink(self.status_path)
            except OSError:
                pass
        self.proc, self.status_path = None, None

    # --- one item -----------------------------------------------------------------------------
    def _raw_status(self) -> str:
        try:
            with open(self.status_path, "rb") as f:
                return f.read(STATUS_BYTES).decode("utf-8", "replace").strip()
        except (OSError, TypeError):
            return ""

    def status(self) -> tuple[str, str]:
        """(phase, last module entered) as the child last wrote them."""
        phase, _, module = self._raw_status().partition("\t")
        return phase.strip(), module.strip()

    def run(self, request: dict, limits: Limits) -> tuple[ItemResult, dict]:
        """Run one item; returns its result and facts about the run (rss, restarted...)."""
        module = request.get("module")
        if module and module not in self.modules and self.items and self.alive():
            self.close()  # its autograd engine started without this device (the module docstring)
            self.restarts_for_module += 1
        if not self.alive():
            if self.proc is not None:
                self._close()
            self._start()
        if not self.ready:
            failed = self._await_ready(limits.startup_s)
            if failed is not None:
                return failed, {"replace": True}
        t0 = time.monotonic()
        deadline = t0 + limits.timeout_s
        try:
            self.cmd.write(json.dumps(request) + "\n")
            self.cmd.flush()
        except (BrokenPipeError, OSError):
            pass  # the child died already: found out below
        self.busy = True
        self.items += 1
        if module:
            self.modules.add(module)
        try:
            return self._wait(t0, deadline, limits)
        except BaseException:  # interrupted (SIGTERM, Ctrl-C): the item in flight dies with us
            self.kill()
            raise
        finally:
            self.busy = False

    def _await_ready(self, limit_s: float) -> ItemResult | None:
        """Wait for a fresh child's ``{"ready": true}``; None when it came, else the error to
        report (the child exited or did not finish its imports within ``limit_s``)."""
        t0 = time.monotonic()
        while True:
            line = self._readline(0.5)
            if line is not None and json.loads(line).get("ready"):
                self.ready = True
                return None
            if not self.alive():
                how = self._exited()
                return self._dead(f"{WORKER_DID_NOT_START}: it {how}", "", "", time.monotonic() - t0)
            if time.monotonic() - t0 >= limit_s:
                self.kill()
                return self._dead(f"{WORKER_DID_NOT_START} within {limit_s:g} s", "", "", time.monotonic() - t0)

    def _wait(self, t0: float, deadline: float, limits: Limits) -> tuple[ItemResult, dict]:
        peak_seen = 0
        progress = _Progress(self.proc.pid, limits.stall_s) if limits.stall_s else None
        while True:
            now = time.monotonic()
            line = self._readline(min(0.5, max(0.0, deadline - now)))
            if line is not None:
                msg = json.loads(line)
                result = ItemResult.from_json(msg["result"])
                facts = {"rss_before": msg.get("rss_before", 0), "rss_after": msg.get("rss_after", 0),
                         "replace": False}
                grown = facts["rss_after"] - facts["rss_before"]
                if grown > limits.leak_bytes:
                    result.properties.append(metrics.metric_property("leaked_bytes", grown))
                    result.notes.append(f"the item left {grown / 2**20:.0f} MiB behind in its process; "
                                        "the worker was replaced so the next item is not charged for it")
                    facts["replace"] = True
                    self.kill()
                return result, facts
            if not self.alive():
                phase, module = self.status()
                return self._dead(self._exited(), phase, module, time.monotonic() - t0), {"replace": True}
            rss = _rss(self.proc.pid)
            peak_seen = max(peak_seen, rss)
            if limits.memory_bytes and rss > limits.memory_bytes:
                phase, module = self.status()
                self.kill()
                return self._dead(f"exceeded the memory limit ({rss / 2**30:.2f} GiB > "
                                  f"{limits.memory_bytes / 2**30:.2f} GiB) and was killed", phase, module,
                                  time.monotonic() - t0), {"replace": True}
            now = time.monotonic()
            if progress is not None:
                progress.sample(now, self._raw_status())
                if progress.stalled(now):
                    phase, module = self.status()
                    self.kill()
                    return self._dead(f"hung: no progress for {limits.stall_s:g} s (its processes used no CPU "
                                      "and entered no phase or module), killed", phase, module,
                                      time.monotonic() - t0), {"replace": True}
            if now >= deadline:
                phase, module = self.status()
                self.kill()
                return self._dead(f"hung: no result within the {limits.timeout_s:g} s time limit, killed",
                                  phase, module, time.monotonic() - t0), {"replace": True}

    def _exited(self) -> str:
        """How the dead child ended ('crashed with SIGABRT', 'exited with status 3'); closes our ends."""
        code = self.proc.returncode if self.proc else None
        self._close()
        return (f"crashed with {signal_name(-code)}" if code is not None and code < 0
                else f"exited with status {code}")

    def _readline(self, timeout: float) -> str | None:
        while b"\n" not in self.buf:
            r, _, _ = select.select([self.res_fd], [], [], timeout)
            if not r:
                return None
            chunk = os.read(self.res_fd, 1 << 16)
            if not chunk:
                return None  # EOF: the child is gone; alive() says so next
            self.buf += chunk
            timeout = 0.5
        line, _, self.buf = self.buf.partition(b"\n")
        return line.decode()

    @staticmethod
    def _dead(how: str, phase: str, module: str, elapsed: float) -> ItemResult:
        where = f" in {phase}" if phase else ""
        if module:
            where += f" (last module entered: {module})"
        msg = f"{how}{where}"
        props = [metrics.metric_property("wall_time_s", elapsed)]
        if phase:
            props.append(metrics.detail_property("phase", phase))
        if module:
            props.append(metrics.detail_property("last_module", module))
        return ItemResult("error", msg, f"the item's process {msg} after {elapsed:.1f} s", props, [], phase)


# --- the child ------------------------------------------------------------------------------------


class _Status:
    """Writes 'phase\\tmodule' into the status file; the parent reads it after a hang or crash."""

    def __init__(self, path: str):
        self.fd = os.open(path, os.O_WRONLY)
        self.phase, self.module = "startup", ""
        self._write()

    def _write(self) -> None:
        rec = f"{self.phase}\t{self.module}".encode()[:STATUS_BYTES]
        os.pwrite(self.fd, rec + b" " * (STATUS_BYTES - len(rec)), 0)

    def set_phase(self, phase: str, _detail: str = "") -> None:
        self.phase, self.module = phase, ""
        self._write()

    def enter(self, module, _args) -> None:
        import torch

        if torch.compiler.is_compiling():
            # inside a graph torch.compile is tracing: a file write there is a graph break per module
            # (the compile check counted 23 on llama-3.1-8b); the module entered before the compiled
            # region stays the one reported
            return
        name = getattr(module, "_harness_qualname", None)
        if name is None:
            # The first module entered is the root (the CausalLM): name every submodule once.
            for n, m in module.named_modules():
                m._harness_qualname = n or type(m).__name__
            name = module._harness_qualname
        if name != self.module:
            self.module = name
            self._write()


def _release_memory() -> None:
    """Give freed memory back to the OS before measuring RSS after an item: glibc keeps freed
    blocks in its arenas, which would look like a leak."""
    import gc

    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


# torch.compile(module) warns at every compiled call while any global module hook exists ("this will
# cause the hooks to fire an extra time for the OptimizedModule"). In an isolated item the status hook
# below is one, always: the warning then says nothing about the model and was listed with every compile
# item (26 in each Llama-4-Scout compile item). Its effect on this hook is one more status write.
GLOBAL_HOOK_WARNING = r"Using `torch\.compile\(module\)` when there are global hooks on modules"


def status_hook(status):
    """The global forward pre-hook that keeps ``status``'s last module entered, and the ignore for the
    warning it alone causes (LibraryWarnings keeps an ignore). Returns the hook's handle."""
    import warnings

    import torch

    warnings.filterwarnings("ignore", message=GLOBAL_HOOK_WARNING, category=UserWarning)
    return torch.nn.modules.module.register_module_forward_pre_hook(status.enter)


def _child_main() -> int:
    die_with_parent()
    cmd_fd, res_fd = (int(x) for x in setting("HARNESS_ISOLATION_FDS").split(","))
    status = _Status(str(setting("HARNESS_ISOLATION_STATUS")))
    cmd = os.fdopen(cmd_fd, "r")
    res = os.fdopen(res_fd, "w", buffering=1)

    import torch

    from harness.backends import get as get_backend
    from harness.checks import add_phase_listener
    from harness.run.execute import execute
    from harness.suite.loader import load_suite

    try:  # what every model-building item imports first (1-2 s), done while the parent still collects
        import transformers.modeling_utils  # noqa: F401
    except ImportError:  # pragma: no cover - transformers is a dependency; its absence is the item's error
        pass
    leak_bytes = setting("HARNESS_LEAK_BYTES")
    leak_bytes = Limits.leak_bytes if leak_bytes is None else leak_bytes
    import gc

    # The imported modules never die: keep them out of every later collection's walk. No
    # collection first: it would cost ~85 ms on every run's critical path to free the few cycles
    # imports leave behind.
    gc.freeze()
    status_hook(status)
    add_phase_listener(status.set_phase)
    if setting("HARNESS_NUM_THREADS"):
        torch.set_num_threads(setting("HARNESS_NUM_THREADS"))
    res.write(json.dumps({"ready": True}) + "\n")  # the next item's clock starts now, not at our exec
    res.flush()
    suites: dict = {}  # (path, mtime) -> LoadedSuite: one parse per suite, not per item
    for line in cmd:
        req = json.loads(line)
        if req is None:
            break
        status.set_phase("load")
        rss_before = _rss()
        try:
            key = (req["suite"], os.stat(req["suite"]).st_mtime_ns)
            ls = suites.get(key) or suites.setdefault(key, load_suite(req["suite"]))
            backend = get_backend(req["backend"])
            result = execute(ls, req["check"], backend, req["dtype"], req.get("variant"))
        except Exception as e:  # the suite loaded in the parent: anything here is a setup problem
            result = ItemResult("error", f"could not run in the isolated worker: {type(e).__name__}: {e}",
                                f"could not run in the isolated worker: {type(e).__name__}: {e}")
        status.set_phase("done")
        rss_after = _rss()
        if rss_after - rss_before > leak_bytes // 2:
            # Looks like growth: free what is only waiting for the cycle collector and give freed
            # blocks back to the OS before calling it a leak. (Not after every item: a full
            # collection costs ~0.2 s with torch and transformers loaded.)
            _release_memory()
            rss_after = _rss()
        res.write(json.dumps({"result": result.to_json(), "rss_before": rss_before, "rss_after": rss_after}) + "\n")
        res.flush()
    _say_bye(res)
    return 0


def _say_bye(res) -> None:
    """The child's last words (``Worker.close``), once the exit handlers that matter have run: the
    parent then stops waiting; what is left is the kernel's teardown of the process."""
    from harness.proc import run_exit_handlers

    run_exit_handlers()
    try:
        res.write(json.dumps({"bye": True}) + "\n")
        res.flush()
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    code = _child_main()
    # Every result is already in the parent's hands. The interpreter's own teardown with torch and
    # transformers loaded takes ~0.46 s, on the critical path of every run's end (the parent waits
    # for the child's exit): skipped as the harness command skips it (harness.proc.exit_now).
    from harness.proc import exit_now

    exit_now(code)
