"""What torchrun starts on every rank: ``python -m harness.launch.rank RUN_DIR ARGS...`` runs
``python ARGS...`` (the real rank) as its child and records how it ended - exit status, or the signal
that killed it - in ``exit-<rank>.json``; the child's stdout and stderr go to ``rank<rank>.log``.
torchrun itself only reports "exitcode -6" in its log text; the wrapper makes the signal a fact the
launcher reads. It imports no torch: it costs milliseconds per rank.

The wrapper dies with torchrun and the rank with the wrapper (PR_SET_PDEATHSIG; torchrun puts each
rank in a session of its own, so a killpg of torchrun's session alone would miss them), and a SIGTERM
from torchrun (stopping the other ranks after one failed) is passed on to the rank and recorded as such.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from harness.files import paths
from harness.launch import channel
from harness.launch.status import log_path, write_exit
from harness.proc import die_with, die_with_parent, signal_name, wait_forwarding


def main(argv: list[str]) -> int:
    die_with_parent()
    run_dir, args = argv[0], argv[1:]
    rank = int(os.environ.get("RANK", "0"))
    os.makedirs(run_dir, exist_ok=True)
    pub = channel.publisher_from_env(run_dir, rank)
    if pub is not None:
        pub.fetch_stage()
        pub.start()
    args = [str(paths.join(run_dir, a[len("@run/"):], source="rank wrapper", field="argument"))
            if a.startswith("@run/") else a for a in args]
    log = open(log_path(run_dir, rank), "ab")
    # PR_SET_PDEATHSIG set before exec (preexec_fn): the rank dies with this wrapper even while it is
    # still importing torch, long before its own code could ask for it.
    proc = subprocess.Popen([sys.executable, *args], stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, preexec_fn=die_with(os.getpid()))
    code, stopped = wait_forwarding(proc)
    write_exit(run_dir, rank, {"rank": rank, "code": code, "time": time.time(), "pid": proc.pid,
                               "signal": signal_name(-code) if code < 0 else None,
                               "stopped_by_launcher": stopped})
    if pub is not None:
        log.flush()
        pub.stop()
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
