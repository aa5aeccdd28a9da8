"""The perf check's measuring steps as library functions: the decision's clock and the samples it
reads, and two forwards timed interleaved (the compile check's speed item uses them)."""

from __future__ import annotations

import time

from harness.backends import get
from harness.perf import measure


def test_the_decision_clock_is_cpu_time_only_for_one_thread_on_the_cpu_backend():
    assert measure.decision_clock("auto", "cpu", 1) == ("cpu", None)
    assert measure.decision_clock("auto", "cpu", 4) == ("wall", None)  # a multi-threaded op waits for its slowest
    assert measure.decision_clock("auto", "cuda", 1) == ("wall", None)
    assert measure.decision_clock("cpu", "cuda", 1) == ("wall", measure.CLOCK_NOTE)  # said, not silently changed
    assert measure.decision_clock("wall", "cpu", 1) == ("wall", None)
    assert measure.samples_key("cpu", "prefill_s") == "prefill_cpu_s"
    assert measure.samples_key("wall", "prefill_s") == "prefill_s"
    assert set(measure.PHASE_OF) == {m for ms in measure.TIMED.values() for m in ms}


def test_interleaved_medians_tell_a_slow_callable_from_a_fast_one():
    def spin(s):
        end = time.process_time() + s
        while time.process_time() < end:
            pass

    (fast, slow), clock = measure.interleaved_medians(get("cpu"), [lambda: spin(0.001), lambda: spin(0.01)], 3)
    assert clock == "process CPU time, 1 thread"
    assert 0.0005 < fast < slow and slow > 0.008, (fast, slow)
