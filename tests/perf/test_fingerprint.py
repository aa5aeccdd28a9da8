"""Machine fingerprints: what is recorded, which machines compare, and the refusal that says why."""

from __future__ import annotations

import re

from harness.backends import get
from harness.perf import fingerprint as fpmod


def test_cpu_fingerprint_records_the_machine():
    fp = fpmod.fingerprint(get("cpu"), threads=1, cpus=[0])
    for k in ("backend", "device_name", "device_count", "cpu_model", "cpu_count", "threads", "torch", "driver",
              "plugin"):
        assert k in fp
    assert (fp["backend"], fp["threads"], fp["cpus"], fp["device_count"]) == ("cpu", 1, [0], 1)
    assert fp["cpu_model"] == fpmod.cpu_model() and fp["torch"]


def test_class_key_is_stable_and_file_safe():
    fp = fpmod.fingerprint(get("cpu"), threads=2)
    key = fpmod.class_key(fp)
    assert key == fpmod.class_key(dict(fp)) and re.fullmatch(r"[a-z0-9.-]+", key)
    assert key.startswith("cpu-") and "-2t-" in key
    # The software is not part of the class: a new torch is what a baseline must catch.
    assert fpmod.class_key({**fp, "torch": "9.9.9", "driver": "x"}) == key
    assert fpmod.class_key({**fp, "threads": 4}) != key


def test_same_class_compares_and_says_what_software_changed():
    fp = fpmod.fingerprint(get("cpu"), threads=1)
    ok, why = fpmod.compare(fp, dict(fp))
    assert ok and why == "same machine class"
    ok, why = fpmod.compare({**fp, "torch": "2.12.0"}, fp)
    assert ok and "torch 2.12.0 -> " in why


def test_another_class_is_refused_with_the_fields_that_differ():
    fp = fpmod.fingerprint(get("cpu"), threads=1)
    other = {**fp, "cpu_model": "Some Other CPU", "threads": 8}
    ok, why = fpmod.compare(other, fp)
    assert not ok
    assert why.startswith("incomparable machine")
    assert "cpu_model: baseline 'Some Other CPU'" in why and "threads: baseline 8, now 1" in why
