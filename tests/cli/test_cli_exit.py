"""``harness.proc.exit_now``: the ``harness`` command ends without the interpreter's teardown of torch
(~0.46 s), and nothing a normal exit does that matters is lost - the exit status, every byte of
output through a pipe, the atexit handlers, a non-daemon thread's work."""

from __future__ import annotations

import subprocess
import sys

import pytest

PRELUDE = "import atexit, sys, threading, time, torch\nfrom harness.proc import exit_now\n"


def _run(body: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PRELUDE + body], capture_output=True, text=True, timeout=120)


def test_status_output_and_atexit_handlers_survive():
    r = _run("atexit.register(lambda: print('atexit ran', flush=True))\n"
             "sys.stdout.write('x' * 200000)\nsys.stderr.write('to stderr')\nexit_now(3)\n")
    assert r.returncode == 3
    assert r.stdout.startswith("x" * 200000) and r.stdout.endswith("atexit ran\n")  # a pipe's whole buffer
    assert r.stderr == "to stderr"


def test_a_running_non_daemon_thread_is_waited_for():
    r = _run("def work():\n    time.sleep(0.5)\n    print('thread finished', flush=True)\n"
             "threading.Thread(target=work).start()\nexit_now(0)\n")
    assert r.returncode == 0 and r.stdout == "thread finished\n", r


@pytest.mark.parametrize("argv,code", [(["--help"], 0), (["no-such-command"], 2)])
def test_the_command_keeps_its_exit_status(argv, code):
    r = subprocess.run([sys.executable, "-m", "harness", *argv], capture_output=True, text=True, timeout=120)
    assert r.returncode == code, r
    assert "usage: harness" in r.stdout + r.stderr
