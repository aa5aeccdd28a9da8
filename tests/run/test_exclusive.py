"""harness/run/exclusive.py: the run lock across processes (xdist workers are processes)."""

from __future__ import annotations

import multiprocessing as mp
import time

from harness.checks import registry
from harness.run import exclusive


def _hold(directory, excl, seconds, log, name):
    with exclusive.hold(directory, excl) as held:
        log.put((name, "start", time.monotonic(), held))
        time.sleep(seconds)
        log.put((name, "end", time.monotonic(), held))


def _spans(log, n, seen=()):
    ev = list(seen) + [log.get(timeout=30) for _ in range(2 * n - len(seen))]
    out = {}
    for name, what, t, held in ev:
        assert held
        out.setdefault(name, {})[what] = t
    return out


def test_an_exclusive_item_waits_for_running_items_and_holds_others_off(tmp_path):
    ctx = mp.get_context("spawn")
    log = ctx.Queue()
    a = ctx.Process(target=_hold, args=(tmp_path, False, 1.0, log, "a"))  # an ordinary item, running
    a.start()
    first = log.get(timeout=30)
    assert first[1] == "start"
    p = ctx.Process(target=_hold, args=(tmp_path, True, 1.0, log, "perf"))  # wants the machine to itself
    p.start()
    time.sleep(0.3)
    b = ctx.Process(target=_hold, args=(tmp_path, False, 0.2, log, "b"))  # comes while perf waits or runs
    b.start()
    spans = _spans(log, 3, [first])
    for q in (a, p, b):
        q.join(30)
        assert q.exitcode == 0
    perf = spans.pop("perf")
    for name, s in spans.items():  # no ordinary item overlaps the measurement
        assert s["end"] <= perf["start"] or s["start"] >= perf["end"], (name, s, perf)


def test_ordinary_items_share_the_lock(tmp_path):
    ctx = mp.get_context("spawn")
    log = ctx.Queue()
    ps = [ctx.Process(target=_hold, args=(tmp_path, False, 1.0, log, n)) for n in "ab"]
    for q in ps:
        q.start()
    s = _spans(log, 2)
    for q in ps:
        q.join(30)
    assert s["a"]["start"] < s["b"]["end"] and s["b"]["start"] < s["a"]["end"]  # they overlapped


def test_a_killed_holder_releases_the_lock(tmp_path):
    ctx = mp.get_context("spawn")
    log = ctx.Queue()
    q = ctx.Process(target=_hold, args=(tmp_path, True, 60.0, log, "stuck"))
    q.start()
    assert log.get(timeout=30)[1] == "start"
    q.kill()
    q.join(30)
    t = time.monotonic()
    with exclusive.hold(tmp_path, True) as held:
        assert held and time.monotonic() - t < 5


def test_timing_checks_declare_themselves_exclusive():
    reg = registry()
    assert reg.get("perf").exclusive
    assert not any(reg.get(n).exclusive for n in ("smoke", "precision", "ops"))
