"""The node wrapper (harness/launch/noderun.py): each node's own run folder made in the node's temp
folder, named to what it runs in place of ``@tmp/NAME``, and removed after - never a ``./@tmp`` in the
working folder, never a folder left per launch on a long-lived node."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from harness.files import scratch
from harness.launch import noderun

# what the wrapper runs: writes into the folder it was given, says where, exits with argv[2]
CHILD = ("import os, sys; open(os.path.join(sys.argv[1], 'rank0.log'), 'w').write('x'); "
         "print(sys.argv[1], flush=True); sys.exit(int(sys.argv[2]))")


def _wrap(tmp_path: Path, name: str, *args: str, **kw) -> subprocess.Popen:
    (tmp_path / "node").mkdir(exist_ok=True)
    (tmp_path / "cwd").mkdir(exist_ok=True)
    env = {**os.environ, "TMPDIR": str(tmp_path / "node")}
    return subprocess.Popen([sys.executable, "-m", "harness.launch.noderun", f"@tmp/{name}", "--", *args],
                            cwd=tmp_path / "cwd", env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, **kw)


def test_the_nodes_folder_is_made_named_in_place_of_at_tmp_and_removed_after(tmp_path):
    p = _wrap(tmp_path, "harness-launch-a1", sys.executable, "-c", CHILD, "@tmp/harness-launch-a1", "3")
    out, err = p.communicate(timeout=60)
    assert p.returncode == 3, err  # the child's exit status is the wrapper's
    assert out.strip() == str(tmp_path / "node" / "harness-launch-a1")  # the node's temp folder, resolved
    assert list((tmp_path / "node").iterdir()) == []  # removed after the child ended
    assert list((tmp_path / "cwd").iterdir()) == []  # nothing relative to the working folder


def test_a_folder_that_exists_already_is_someone_elses_and_stays(tmp_path):
    # harness node-agent makes its share's folder and writes its log there before the wrapper runs
    own = tmp_path / "node" / "harness-launch-b2"
    own.mkdir(parents=True)
    p = _wrap(tmp_path, "harness-launch-b2", sys.executable, "-c", CHILD, "@tmp/harness-launch-b2", "0")
    p.communicate(timeout=60)
    assert p.returncode == 0 and (own / "rank0.log").read_text() == "x"
    assert not (own / scratch.OWNER).exists()


def test_a_killed_wrappers_folder_is_swept_by_the_next_one_on_that_node(tmp_path):
    # SIGKILL runs no cleanup: the folder stays, with its owner; the next wrapper on the node removes it
    p = _wrap(tmp_path, "harness-launch-c3", sys.executable, "-c", "import time; print('ready', flush=True); "
              "time.sleep(60)")
    folder = tmp_path / "node" / "harness-launch-c3"
    assert p.stdout.readline().strip() == "ready"
    p.kill()  # its child dies with it (PR_SET_PDEATHSIG)
    p.communicate(timeout=60)
    assert (folder / scratch.OWNER).exists()
    q = _wrap(tmp_path, "harness-launch-d4", sys.executable, "-c", CHILD, "@tmp/harness-launch-d4", "0")
    q.communicate(timeout=60)
    assert q.returncode == 0 and list((tmp_path / "node").iterdir()) == []


def test_sigterm_reaches_what_it_runs_and_the_folder_still_goes(tmp_path):
    # srun and the launcher's group kill say SIGTERM first: torchrun must hear it, and the folder still goes
    code = ("import signal, sys, time\n"
            "signal.signal(signal.SIGTERM, lambda *a: sys.exit(7))\n"
            "print('ready', flush=True)\ntime.sleep(60)\n")
    p = _wrap(tmp_path, "harness-launch-e5", sys.executable, "-c", code)
    assert p.stdout.readline().strip() == "ready"
    p.send_signal(signal.SIGTERM)
    p.communicate(timeout=60)
    assert p.returncode == 7 and list((tmp_path / "node").iterdir()) == []


def test_a_bad_command_line_and_a_command_that_cannot_start_are_one_line_each(tmp_path):
    p = _wrap(tmp_path, "harness-launch-f6")  # no "--" and nothing to run
    _out, err = p.communicate(timeout=60)
    assert p.returncode == 2 and err.startswith("usage: python -m harness.launch.noderun")
    p = _wrap(tmp_path, "harness-launch-f7", str(tmp_path / "no-such-program"))
    _out, err = p.communicate(timeout=60)
    assert p.returncode == 127 and "cannot start" in err and list((tmp_path / "node").iterdir()) == []


def test_only_at_tmp_is_resolved_and_a_name_cannot_leave_the_temp_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again
    assert noderun.resolve("@tmp/harness-launch-x") == str(tmp_path / "harness-launch-x")
    assert noderun.resolve("/abs/run") == "/abs/run"
    with pytest.raises(ValueError):
        noderun.resolve("@tmp/../escape")
