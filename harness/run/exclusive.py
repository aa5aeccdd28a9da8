"""One run's items never overlap an item that measures time.

A ``perf`` item's samples are only worth comparing if nothing else of the run shares the cores while
it measures: under xdist another worker would be building and running models at the same time (on a
2-core runner that doubles a CPU-bound timing). Checks declare it (``Check.exclusive``); the plugin
holds this lock around every item: shared for ordinary items, exclusive for such a check's items. It is
a reader-writer lock across processes, ``fcntl.flock`` on a file in the results directory, so it also
spans separate ``pytest`` processes writing the same results (a CI matrix on one machine). flock locks
die with their process: a killed worker never leaves the lock held.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

LOCK_NAME = ".harness-run.lock"


@contextlib.contextmanager
def hold(directory: str | Path, exclusive: bool):
    """Hold the run lock in ``directory`` shared (ordinary item) or exclusive (an item that measures
    time). Where the lock cannot be taken (no fcntl, an unwritable directory) the item runs without
    it: nothing is lost but the guarantee, which the caller may note."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield False
        return
    try:
        Path(directory).mkdir(parents=True, exist_ok=True)
        fd = os.open(Path(directory) / LOCK_NAME, os.O_CREAT | os.O_RDWR, 0o600)
    except OSError:
        yield False
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield True
    finally:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
