"""What each node runs for its share of a multi-node launch: ``python -m harness.launch.noderun
@tmp/NAME -- ARGV...`` makes the node's own run folder ``NAME`` in the node's temp folder, runs ARGV
(torchrun, every rank under ``harness.launch.rank``) with every argument equal to ``@tmp/NAME``
replaced by that folder's path, and removes the folder once ARGV has ended.

Why a wrapper: the coordinator cannot know a node's temp folder (a Slurm node's ``/tmp``, a rehearsal
node's ``TMPDIR``), so the command names it as ``@tmp/NAME``. Only harness code can read that; torchrun
took its ``--log-dir @tmp/NAME`` as a relative path and made ``./@tmp/NAME/...`` in the user's working
folder on every launch, and the node's folder stayed in ``/tmp`` after every launch: a long-lived node
fills its disk run after run. By the time ARGV ends, every rank wrapper has published its files to the
coordinator (``harness.launch.channel``), so nothing in the folder is needed any more.

A folder that already exists is someone else's (``harness node-agent`` makes its share's folder,
writes its log there and removes it itself) and is left alone. A wrapper SIGKILLed runs no cleanup:
its folder carries its owner (``harness.files.scratch``), and the next wrapper on that node sweeps it.
Standard library only (no torch): it costs milliseconds per node.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from harness.files import atomic, paths, scratch
from harness.proc import die_with, wait_forwarding

TMP = "@tmp/"
# the node folders' names (NodeLaunch.run_id): the prefix whose orphans a wrapper sweeps
PREFIX = "harness-launch-"


def resolve(spec: str) -> str:
    """``@tmp/NAME`` -> ``<this node's temp folder>/NAME`` (NAME one plain name); anything else as it is."""
    if not spec.startswith(TMP):
        return spec
    return str(paths.join(tempfile.gettempdir(), spec[len(TMP):], source="node wrapper", field="run folder"))


def make_folder(path: str) -> bool:
    """Make ``path`` as this process's scratch folder (its orphans swept first); False where it exists."""
    scratch.sweep_orphans(PREFIX, os.path.dirname(path))
    try:
        os.mkdir(path)
    except FileExistsError:
        return False
    atomic.write_text(Path(path) / scratch.OWNER, scratch.owner_record())
    return True


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m harness.launch.noderun @tmp/NAME -- ARGV...", file=sys.stderr)
        return 2
    spec, args = argv[0], argv[2:]
    try:
        folder = resolve(spec)
    except ValueError as e:  # paths.PathRefused: a name that would leave the temp folder
        print(f"node wrapper: {e}", file=sys.stderr)
        return 2
    ours = make_folder(folder)
    args = [folder if a == spec else a for a in args]
    try:
        proc = subprocess.Popen(args, preexec_fn=die_with(os.getpid()))
    except OSError as e:
        if ours:
            shutil.rmtree(folder, ignore_errors=True)
        print(f"node wrapper: cannot start {args[0]}: {e}", file=sys.stderr)
        return 127

    # srun and the launcher's kill say SIGTERM first: torchrun stops its ranks, then this removes the folder
    code, _stopped = wait_forwarding(proc)
    if ours:
        shutil.rmtree(folder, ignore_errors=True)
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
