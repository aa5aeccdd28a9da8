"""Parse a large baseline in a second process while this one parses the current run.

Parsing is most of a comparison's time, and the current and the baseline XML are independent, so
on a machine with two or more cores the baseline goes to a child process, which stores it in the
history's baseline cache (:meth:`harness.compare.history.History.record` with
``kind='baseline'``); the parent then reads it back from there, which takes a fraction of a parse.

The child is a plain ``python -m harness.compare.prefetch`` process rather than multiprocessing:
it must not re-run whatever script started the parent. Any failure (no second core, the child
cannot start, the baseline has problems) simply means the parent parses the baseline itself.
"""

from __future__ import annotations

import os
import subprocess
import sys

from harness.compare.junit import expand

MIN_BYTES = 8 << 20  # below this a second process costs more than it saves


def start(paths: list[str], db_path: str, key: str) -> subprocess.Popen | None:
    """Start the child if it is worth it; None when the parent should parse by itself."""
    if (os.cpu_count() or 1) < 2:
        return None
    try:
        size = sum(os.path.getsize(p) for p in expand(paths))
    except OSError:
        return None
    if size < MIN_BYTES:
        return None
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    try:
        return subprocess.Popen([sys.executable, "-m", "harness.compare.prefetch", db_path, key, *paths],
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    except OSError:
        return None


def finish(proc: subprocess.Popen | None) -> bool:
    """Wait for the child; True when the baseline is now in the history's cache."""
    if proc is None:
        return False
    _out, _err = proc.communicate()
    return proc.returncode == 0


def main(argv: list[str]) -> int:
    import gc

    from harness.compare.history import History
    from harness.compare.junit import read_results

    db_path, key, *paths = argv
    gc.disable()  # see harness.compare.pipeline.run_compare
    baseline = read_results(paths)
    if baseline.problems or not baseline.cases:
        return 3  # the parent parses it again and reports the problems itself
    history = History(db_path)
    history.record(f"baseline-{key[:16]}", baseline, {}, kind="baseline", inputs=key, keep=2)
    history.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
