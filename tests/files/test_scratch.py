"""Scratch folders: removed at exit, and a killed owner's by the next process that makes one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from harness.files import scratch

_MAKE = ("import sys, time\nfrom harness.files.scratch import scratch_dir\n"
         "print(scratch_dir('harness-t-', sys.argv[1]), flush=True)\n"
         "if sys.argv[2] == 'sleep':\n    time.sleep(600)\n")


def _make(tmp_path, then: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _MAKE, str(tmp_path), then], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})


def test_a_folder_goes_with_its_process_and_a_killed_owners_with_the_next_one_only(tmp_path):
    p = _make(tmp_path, "exit")
    ended = p.stdout.readline().strip()
    p.wait()
    assert ended and not os.path.exists(ended)  # atexit
    alive, killed = _make(tmp_path, "sleep"), _make(tmp_path, "sleep")
    try:
        live, dead = alive.stdout.readline().strip(), killed.stdout.readline().strip()
        killed.send_signal(signal.SIGKILL)  # no atexit, no finally: the folder stays
        killed.wait()
        assert os.path.isdir(dead)
        other = tmp_path / "harness-other-x"  # another kind: not this prefix's to sweep
        other.mkdir()
        (other / scratch.OWNER).write_text(scratch.owner_record(killed.pid))
        mine = scratch.scratch_dir("harness-t-", tmp_path)
        assert not os.path.exists(dead) and os.path.isdir(live) and other.is_dir() and mine.is_dir()
    finally:
        alive.kill()
        killed.kill()


def test_an_owner_is_judged_gone_only_when_that_can_be_told():
    me = scratch.owner_record()
    assert not scratch.owner_gone(me)
    pid, ticks, ns = me.split()
    assert scratch.owner_gone(f"{pid} {int(ticks) + 1} {ns}")  # the pid was reused by a later process
    assert not scratch.owner_gone(f"{pid} {ticks} pid:[1]")  # another pid namespace: not ours to judge
    assert not scratch.owner_gone("not a record")
    p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    assert scratch.owner_gone(f"{p.stdout.strip()} - {ns}")  # ended (its pid is not reused so soon)


def test_a_forked_child_ending_leaves_its_parents_folder_alone(tmp_path):
    # an isolated item worker is forked from the parent that made the folder (its children's status files)
    # and runs the atexit handlers it inherited when it ends: the folder is the parent's, and stays
    code = ("import os, sys\nfrom harness.files.scratch import scratch_dir\nfrom harness.proc import run_exit_handlers\n"
            "d = scratch_dir('harness-t-', sys.argv[1])\npid = os.fork()\n"
            "if pid == 0:\n    run_exit_handlers()\n    os._exit(0)\n"
            "os.waitpid(pid, 0)\nprint(d, os.path.isdir(d), flush=True)\n")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": os.getcwd()}, timeout=60)
    folder, kept = out.stdout.split()
    assert kept == "True", out.stderr  # the child's exit left it
    assert not os.path.exists(folder)  # the parent's own exit removed it


def test_a_remnant_without_its_owner_record_goes_once_a_day_old_and_not_before(tmp_path):
    # what an exit's removal left when a child was still making a subfolder: the record gone, a folder kept
    old, fresh = tmp_path / "harness-t-old", tmp_path / "harness-t-fresh"
    for f in (old, fresh):
        (f / "key" / "w2-launch0").mkdir(parents=True)
    day_ago = time.time() - scratch.STALE_S - 60
    os.utime(old, (day_ago, day_ago))
    assert scratch.sweep_orphans("harness-t-", tmp_path) == [old]
    assert not old.exists() and fresh.is_dir()
