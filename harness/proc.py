"""Process plumbing shared by every child harness starts (isolated items, torchrun ranks, the
comparator's prefetch): standard library only, so that a wrapper importing it starts in milliseconds."""

from __future__ import annotations

import signal


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
