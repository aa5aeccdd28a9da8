"""Parse a large baseline in a second process while this one parses the current run.

Parsing is most of a comparison's time, and the current and the baseline XML are independent, so
on a machine with two or more cores the baseline goes to a child process, which stores it in the
history's baseline cache (:meth:`harness.compare.history.History.record` with
``kind='baseline'``); the parent then reads it back from there, which takes a fraction of a parse.

The child is a plain ``python -m harness.compare.prefetch`` process rather than multiprocessing:
it must not re-run whatever script started the parent. Any failure (no second core, the child
cannot start, the baseline has problems) simply means the parent parses the baseline itself.

The child is tied to its parent: it holds the read end of a pipe whose write end only the parent
has, and a watcher thread ends the child the moment that pipe reports end-of-file -- which the
kernel does when the parent exits for any reason, ``kill -9`` included. On Linux the kernel is also
asked to kill the child when its parent dies (``PR_SET_PDEATHSIG``), which does not wait for the
watcher thread to get the interpreter lock from a long parse. (A killed comparison must
not leave a process behind that goes on writing into the history.) The child does not take the
history's lock: its parent holds it for both of them.
"""

from __future__ import annotations

import os
import subprocess
import sys

from harness.proc import die_with_parent
from harness.settings import env as setting
from harness.settings import set_env

MIN_BYTES = 8 << 20  # below this a second process costs more than it saves


def start(paths: list[str], db_path: str, key: str) -> subprocess.Popen | None:
    """Start the child if it is worth it; None when the parent should parse by itself."""
    from harness.compare.junit import expand  # here, not at the top: the child starts light

    if (os.cpu_count() or 1) < 2:
        return None
    try:
        size = sum(os.path.getsize(p) for p in expand(paths))
    except OSError:
        return None
    if size < MIN_BYTES:
        return None
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    set_env("HARNESS_PREFETCH_PARENT", os.getpid(), env)
    try:
        # stdin is the lifeline: the parent never writes to it, and never closes it until done
        return subprocess.Popen([sys.executable, "-m", "harness.compare.prefetch", db_path, key, *paths],
                                env=env, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    except OSError:
        return None


def finish(proc: subprocess.Popen | None) -> bool:
    """Wait for the child; True when the baseline is now in the history's cache."""
    if proc is None:
        return False
    proc.wait()
    proc.stdin.close()
    return proc.returncode == 0


def stop(proc: subprocess.Popen | None) -> None:
    """End the child early (the parent is failing)."""
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait()
        proc.stdin.close()


def _lifeline() -> None:
    """Block on the lifeline (stdin); end-of-file means the parent is gone: exit at once, without
    committing anything (SQLite rolls back an unfinished transaction)."""
    import threading

    if sys.platform.startswith("linux"):
        die_with_parent()
        if setting("HARNESS_PREFETCH_PARENT") not in (None, os.getppid()):
            os._exit(4)  # the parent died before the request took effect

    def watch() -> None:
        try:  # os.read on the raw descriptor: no buffered-reader lock to trip over at shutdown
            while os.read(0, 65536):
                pass
        except OSError:
            pass
        os._exit(4)

    threading.Thread(target=watch, daemon=True).start()


def main(argv: list[str]) -> int:
    import gc

    from harness.compare.history import History
    from harness.compare.junit import read_results

    db_path, key, *paths = argv
    gc.disable()  # see harness.compare.pipeline.run_compare
    baseline = read_results(paths)
    if baseline.problems or baseline.warnings or not baseline.cases:
        return 3  # the parent parses it again and reports the problems (and warnings) itself
    history = History(db_path, lock=False)  # the parent holds the lock for both
    history.record(f"baseline-{key[:16]}", baseline, {}, kind="baseline", inputs=key, keep=2)
    history.close()
    return 0


if __name__ == "__main__":
    _lifeline()  # first, before the imports that take a while
    sys.exit(main(sys.argv[1:]))
