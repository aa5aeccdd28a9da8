"""What torchrun starts on every rank: a small wrapper (no torch import) that runs the real rank
(``harness.parallel.worker``) as its child and records how it ended - exit status, or the signal
that killed it - in ``exit-<rank>.json``. torchrun itself only reports "exitcode -6" in its log
text; the wrapper makes the signal a fact the launcher reads.

The worker dies with the wrapper (PR_SET_PDEATHSIG), and a SIGTERM from torchrun (stopping the
other ranks after one failed) is passed on to the worker and recorded as such.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from harness.proc import die_with_parent, signal_name


def main(argv: list[str]) -> int:
    die_with_parent()
    spec_path = argv[0]
    run_dir = os.path.dirname(spec_path)
    rank = int(os.environ.get("RANK", "0"))
    log = open(os.path.join(run_dir, f"rank{rank}.log"), "ab")
    # PR_SET_PDEATHSIG set before exec (preexec_fn): the worker dies with this wrapper even while it
    # is still importing torch, long before its own code could ask for it.
    proc = subprocess.Popen([sys.executable, "-m", "harness.parallel.worker", spec_path], stdout=log,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)
    stopped = []

    def forward(signum, _frame):
        stopped.append(signal_name(signum))
        try:
            proc.send_signal(signum)
        except ProcessLookupError:
            pass

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    code = proc.wait()
    rec = {"rank": rank, "code": code, "time": time.time(),
           "signal": signal_name(-code) if code < 0 else None,
           "stopped_by_launcher": stopped[0] if stopped else None}
    from harness.files import atomic

    atomic.write_json(os.path.join(run_dir, f"exit-{rank}.json"), rec, indent=None, newline=False)
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
