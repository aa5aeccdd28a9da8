"""harness/proc.py's memory figures (issue #44 item 5: read from /proc they were 0 off Linux; psutil
reads each platform's own counters): real processes, real allocations."""

from __future__ import annotations

import subprocess
import sys
import time

from harness import proc

MIB = 2**20


def test_rss_of_this_process_and_a_child_and_a_gone_one():
    assert proc.rss_bytes() > 10 * MIB  # an interpreter with pytest loaded
    child = subprocess.Popen([sys.executable, "-c", "import sys; b = bytearray(64 << 20); sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    try:
        # the child's 64 MiB buffer is resident once written (bytearray zero-fills it)
        for _ in range(200):
            if proc.rss_bytes(child.pid) > 64 * MIB:
                break
            time.sleep(0.05)
        assert proc.rss_bytes(child.pid) > 64 * MIB
    finally:
        child.communicate(b"")
    assert proc.rss_bytes(child.pid) == 0  # reaped: gone, not an error


def test_peak_follows_an_allocation_and_resets_where_the_platform_can():
    before = proc.peak_rss_bytes()
    assert before >= proc.rss_bytes() > 0
    buf = bytearray(256 * MIB)  # zero-filled: resident
    assert proc.peak_rss_bytes() >= proc.rss_bytes() >= 256 * MIB
    del buf
    if proc.reset_peak_rss():  # Linux: VmHWM back to the current RSS
        assert proc.peak_rss_bytes() < 256 * MIB + before
    assert proc.peak_rss_bytes() >= proc.rss_bytes()


def test_available_memory_is_a_positive_figure():
    avail = proc.available_memory_bytes()
    assert avail is not None and avail > 0
