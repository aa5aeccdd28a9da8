"""Process plumbing shared by every child harness starts (isolated items, torchrun ranks, the
comparator's prefetch), and by the ``harness`` command itself (a stdout whose reader went away):
standard library only, so that a wrapper importing it starts in milliseconds."""

from __future__ import annotations

import os
import signal
import sys


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux ``PR_SET_PDEATHSIG``), so a
    killed run leaves no orphan holding a device or a port. Elsewhere a no-op; also usable as a
    ``preexec_fn``."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def die_with(parent: int):
    """A ``preexec_fn``: ``die_with_parent`` in the child, which also ends at once where ``parent`` (the
    pid that forked it) died between the fork and the request - no signal would ever come then."""
    def preexec() -> None:
        die_with_parent()
        if os.getppid() != parent:
            os._exit(1)
    return preexec


def wait_forwarding(proc) -> tuple[int, str | None]:
    """Wait for ``proc`` (a ``subprocess.Popen``), passing it every SIGTERM and SIGINT this process gets
    meanwhile (a launcher's stop reaches the child through its wrapper); its exit code and the first
    signal passed on, by name (None: none)."""
    stopped: list[str] = []

    def forward(signum, _frame):
        stopped.append(signal_name(signum))
        try:
            proc.send_signal(signum)
        except ProcessLookupError:
            pass

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    return proc.wait(), (stopped[0] if stopped else None)


def signal_name(n: int) -> str:
    """``9`` -> ``SIGKILL``; an unknown number as ``signal <n>``."""
    try:
        return signal.Signals(n).name
    except ValueError:
        return f"signal {n}"


def exit_now(code: int) -> None:
    """End the process with ``code`` without the interpreter's teardown when torch is loaded: tearing
    down torch's and transformers' modules takes ~0.46 s (measured; 0.02 s this way), after every
    command's work is done. What a normal exit does that matters still happens: the atexit handlers
    (logging's flush, temporary folders, multiprocessing's children) and the flush of stdout and
    stderr. With another non-daemon thread still running (the interpreter would wait for it) or
    without torch (its teardown is fast), the normal exit."""
    import threading

    others = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    if "torch" not in sys.modules or others:
        sys.exit(code)
    run_exit_handlers()
    os._exit(code)


def run_exit_handlers() -> None:
    """What an interpreter's exit does that matters, without its teardown: the atexit handlers
    (logging's flush, temporary folders, multiprocessing's children; each runs once, so a later
    exit finds none), then stdout and stderr flushed."""
    import atexit

    atexit._run_exitfuncs()
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except (OSError, ValueError):  # a closed pipe (`harness ... | head`), a closed stream
            pass


# --- a reader that goes away -----------------------------------------------------------------------
class OutlivesReader:
    """``sys.stdout`` that outlives its reader: ``harness run ... | head`` closes the pipe after a few
    lines, and the next write raised BrokenPipeError wherever it happened. rich's console answers that
    with SystemExit(1) (its ``on_broken_pipe``), which stopped the run at its next progress line (pytest's
    INTERNALERROR): 17 of 18 items never ran. Here the first write to a closed reader points
    the file descriptor at /dev/null (what rich and Python's own note on SIGPIPE do) and the process
    carries on; results go to the results folder, never only to stdout. Everything else is the stream's."""

    def __init__(self, stream):
        self._stream = stream

    def _gone(self) -> None:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, self._stream.fileno())  # children started later inherit /dev/null too
        finally:
            os.close(devnull)

    def write(self, s):
        try:
            return self._stream.write(s)
        except BrokenPipeError:
            self._gone()
            return len(s)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._gone()
            self._stream.flush()  # what was buffered goes to /dev/null now

    def __getattr__(self, name):
        return getattr(self._stream, name)


def outlive_reader() -> None:
    """Install OutlivesReader as ``sys.stdout`` (a command's first step; once)."""
    if not isinstance(sys.stdout, OutlivesReader) and sys.stdout is not None:
        try:
            sys.stdout.fileno()
        except (OSError, ValueError, AttributeError):  # no descriptor to point elsewhere (a test's capture)
            return
        sys.stdout = OutlivesReader(sys.stdout)


# --- memory ---------------------------------------------------------------------------------------
# psutil reads the same kernel counters as /proc on Linux and the platform's own elsewhere (a /proc read
# gave 0 off Linux). It is imported where used: this module stays quick to import for wrappers.


def rss_bytes(pid: int | None = None) -> int:
    """Resident set size of process ``pid`` (None: this one) in bytes; 0 where it is gone or unreadable."""
    import psutil

    try:
        return int(psutil.Process(pid).memory_info().rss)
    except (psutil.Error, OSError):
        return 0


def peak_rss_bytes() -> int:
    """This process's peak resident set size in bytes: Linux's VmHWM (the one counter ``reset_peak_rss``
    can reset; psutil does not expose it), Windows' peak working set (psutil), elsewhere the rusage
    maximum (bytes on macOS, KiB on the BSDs); never below the current RSS."""
    import psutil

    now = rss_bytes()
    if sys.platform.startswith("linux"):
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return max(now, int(line.split()[1]) * 1024)
        except OSError:
            pass
    peak = getattr(psutil.Process().memory_info(), "peak_wset", None)  # Windows only
    if peak is None:
        try:
            import resource
        except ImportError:  # Windows has no resource module (and has peak_wset)
            return now
        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak = maxrss if sys.platform == "darwin" else maxrss * 1024
    return max(now, int(peak))


def reset_peak_rss() -> bool:
    """Reset this process's peak RSS to its current RSS (Linux: writing 5 to /proc/self/clear_refs
    resets VmHWM). False where the platform cannot: the peak is then the process's lifetime peak."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def available_memory_bytes() -> int | None:
    """Memory the host can give without swapping (Linux MemAvailable; psutil's estimate elsewhere)."""
    import psutil

    try:
        return int(psutil.virtual_memory().available)
    except (psutil.Error, OSError):
        return None
