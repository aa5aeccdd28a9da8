"""Process plumbing shared by every child harness starts (isolated items, torchrun ranks, the
comparator's prefetch): standard library only, so that a wrapper importing it starts in milliseconds."""

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
