"""Baselines: `harness baseline update RESULTS` takes a run's samples; lookups by machine class."""

from __future__ import annotations

import json

from harness.backends import get
from harness.cli import main
from harness.perf import baseline as store
from harness.perf import fingerprint as fpmod


def record(suite="llama-3.1-8b", key="cpu-float32-b1-s128", fp=None, prefill=(0.1, 0.11, 0.12)):
    fp = fp or fpmod.fingerprint(get("cpu"), threads=1)
    return {"suite": suite, "key": key, "backend": "cpu", "dtype": "float32", "variant": "b1-s128",
            "fingerprint": fp, "class": fpmod.class_key(fp), "shape": {"batch": 1, "seq": 128},
            "calibration": {"dtype": "float32", "samples": {"calib_matmul_s": [0.01]}},
            "reference": {"prefill": {"calib_matmul_s": [0.01]}},
            "samples": {"prefill_s": list(prefill)}, "summary": {"prefill_s": {"median": prefill[1]}}}


def test_round_trip_through_the_command_line(tmp_path, capsys):
    results, golden = tmp_path / "results", tmp_path / "golden"
    side = store.write_sidecar(record(), results)
    assert side == results / "perf" / "llama-3.1-8b" / "cpu-float32-b1-s128.json"
    assert main(["baseline", "update", str(results), "--golden-dir", str(golden)]) == 0
    out = capsys.readouterr().out
    assert "1 item(s)" in out and "cpu-float32-b1-s128" in out
    fp = fpmod.fingerprint(get("cpu"), threads=1)
    item, why = store.find_baseline("llama-3.1-8b", "cpu-float32-b1-s128", fp, golden)
    assert item["samples"]["prefill_s"] == [0.1, 0.11, 0.12] and "same machine class" in why
    assert item["reference"] == {"prefill": {"calib_matmul_s": [0.01]}} and item["source"] == str(side)
    path = golden / "perf" / "llama-3.1-8b" / f"{fpmod.class_key(fp)}.json"
    assert json.loads(path.read_text())["class"] == fpmod.class_of(fp)

    # A later reviewed run replaces its items and keeps the others.
    results2 = tmp_path / "results2"
    store.write_sidecar(record(prefill=(0.2, 0.2, 0.2)), results2)
    store.write_sidecar(record(key="cpu-float32-b4-s128"), results2)
    assert main(["baseline", "update", str(results2), "--golden-dir", str(golden)]) == 0
    items = json.loads(path.read_text())["items"]
    assert sorted(items) == ["cpu-float32-b1-s128", "cpu-float32-b4-s128"]
    assert items["cpu-float32-b1-s128"]["samples"]["prefill_s"] == [0.2, 0.2, 0.2]
    assert main(["baseline", "show", "--golden-dir", str(golden)]) == 0
    assert "cpu-float32-b4-s128: prefill_s 110 ms" in capsys.readouterr().out


def test_another_machine_class_is_said_to_be_incomparable(tmp_path):
    fp = fpmod.fingerprint(get("cpu"), threads=1)
    other = {**fp, "cpu_model": "Other CPU 9000", "device_name": "Other CPU 9000"}
    store.write_sidecar(record(fp=other), tmp_path / "r")
    store.update(tmp_path / "r", tmp_path / "g")
    item, why = store.find_baseline("llama-3.1-8b", "cpu-float32-b1-s128", fp, tmp_path / "g")
    assert item is None
    assert "incomparable machine" in why and "cpu_model: baseline 'Other CPU 9000'" in why
    item, why = store.find_baseline("llama-3.1-8b", "cpu-float32-b1-s128", fp, tmp_path / "nothing")
    assert item is None and why.startswith("no baseline for llama-3.1-8b")


def test_bad_input_is_one_line(tmp_path, capsys):
    assert main(["baseline", "update", str(tmp_path / "missing")]) == 2
    assert "no such results directory" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["baseline", "update", str(empty), "--golden-dir", str(tmp_path / "g")]) == 2
    assert "no perf samples" in capsys.readouterr().err
    bad = empty / "perf" / "s" / "x.json"
    bad.parent.mkdir(parents=True)
    bad.write_text("{not json")
    assert main(["baseline", "update", str(empty), "--golden-dir", str(tmp_path / "g")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "x.json: not valid JSON" in err
    # an item that measured nothing (e.g. a backend without timer-safe synchronize) is refused
    bad.unlink()
    store.write_sidecar({**record(), "samples": {}, "why_no_samples": "no synchronize"}, empty)
    assert main(["baseline", "update", str(empty), "--golden-dir", str(tmp_path / "g")]) == 1
    assert "refused cpu-float32-b1-s128: no samples (no synchronize)" in capsys.readouterr().err


def test_sidecars_named_by_the_junit_xml_of_the_run(tmp_path, monkeypatch):
    # `harness run --results R` writes R/junit.xml; the check wrote its samples to the configured
    # results dir: the XML's perf_samples detail leads there (and only there: a path outside both
    # is refused, tests/files/test_paths.py).
    monkeypatch.setenv("HARNESS_RESULTS_DIR", str(tmp_path / "elsewhere"))
    side = store.write_sidecar(record(), tmp_path / "elsewhere")
    run = tmp_path / "run"
    run.mkdir()
    (run / "junit.xml").write_text(
        '<testsuites><testsuite name="pytest"><testcase classname="suites.llama-3.1-8b.toml" '
        'name="perf[cpu-float32-b1-s128]"><properties>'
        f'<property name="harness.detail.perf_samples" value="{side}"/></properties></testcase>'
        '</testsuite></testsuites>')
    (taken,) = store.update(run, tmp_path / "g")
    assert taken[1] == ["cpu-float32-b1-s128"]
    side.unlink()
    try:
        store.update(run, tmp_path / "g")
    except store.BaselineError as e:
        assert "are missing" in str(e)
    else:
        raise AssertionError("a sidecar named by the XML but gone must be an error")


def test_append_pools_the_samples_of_several_runs(tmp_path, capsys):
    golden = tmp_path / "golden"
    store.write_sidecar(record(prefill=(0.1, 0.11, 0.12)), tmp_path / "r1")
    store.write_sidecar(record(prefill=(0.2, 0.21, 0.22)), tmp_path / "r2")
    assert main(["baseline", "update", str(tmp_path / "r1"), "--golden-dir", str(golden)]) == 0
    assert main(["baseline", "update", str(tmp_path / "r2"), "--golden-dir", str(golden), "--append"]) == 0
    fp = fpmod.fingerprint(get("cpu"), threads=1)
    item, _ = store.find_baseline("llama-3.1-8b", "cpu-float32-b1-s128", fp, golden)
    assert item["samples"]["prefill_s"] == [0.1, 0.11, 0.12, 0.2, 0.21, 0.22] and item["runs"] == 2
    assert item["reference"]["prefill"]["calib_matmul_s"] == [0.01, 0.01]
    assert item["calibration"]["samples"]["calib_matmul_s"] == [0.01, 0.01]
    assert item["summary"]["prefill_s"]["n"] == 6
    # another workload cannot be pooled
    store.write_sidecar({**record(), "shape": {"batch": 2, "seq": 128}}, tmp_path / "r3")
    assert main(["baseline", "update", str(tmp_path / "r3"), "--golden-dir", str(golden), "--append"]) == 2
    assert "cannot pool a baseline of another workload" in capsys.readouterr().err


def test_documented_workflow_end_to_end_in_a_project_named_perf(tmp_path):
    """Issue #30 item 1, docs/perf.md's sequence through the command line: `harness run --scope nightly
    --check perf`, `harness baseline update RESULTS` (the whole results folder, absolute path), and a
    later run compared with that baseline. The project folder is named perf: the update judged
    sidecars by their absolute path (`<x>/perf/<suite>/<key>.json`), so perf/results/run.json looked
    like one and the update failed ("not a harness perf file of format 1")."""
    import os
    import subprocess
    import sys

    from checks.test_perf import PERF

    from tests_support import REPO_SUITES, TINY_PRUNE

    project = tmp_path / "perf"
    (project / "suites" / "configs").mkdir(parents=True)
    (project / "suites" / "configs" / "Llama-3.1-8B.json").write_bytes(
        (REPO_SUITES / "configs" / "Llama-3.1-8B.json").read_bytes())
    (project / "suites" / "tiny.toml").write_text(PERF.format(prune=TINY_PRUNE))
    (project / "harness.toml").write_text('suites_dir = "suites"\ngolden_dir = "golden"\nresults_dir = "results"\n')
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HARNESS_CONFIG": str(project / "harness.toml")}

    def harness(*args):
        return subprocess.run([sys.executable, "-m", "harness", *args], cwd=project, env=env, capture_output=True,
                              text=True, timeout=300)

    run = ("run", "tiny", "--scope", "nightly", "--check", "perf", "--backend", "cpu", "--dtype", "float32")
    r = harness(*run)
    assert r.returncode == 0 and "1 passed" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    assert "no baseline for tiny" in (project / "results" / "junit.xml").read_text()
    r = harness("baseline", "update", str(project / "results"))
    assert r.returncode == 0, r.stderr
    assert "1 item(s)" in r.stdout and "cpu-float32-b1-s8" in r.stdout
    assert list((project / "golden" / "perf" / "tiny").glob("*.json"))
    r = harness(*run)
    assert r.returncode == 0 and "1 passed" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    junit = (project / "results" / "junit.xml").read_text()
    verdict = next(line for line in junit.split("<property ") if "perf_verdict" in line)
    assert "golden/perf/tiny/" in verdict and "no baseline" not in verdict


def test_samples_that_are_not_times_are_refused_and_a_hand_edited_baseline_is_not_used(tmp_path, capsys):
    """Issue #49: NaN or negative samples were taken as a baseline, after which every perf verdict read
    "unchanged" (a NaN median compares false both ways) and a perf issue could close."""
    fp = fpmod.fingerprint(get("cpu"), threads=1)
    for i, prefill in enumerate([(float("nan"), 0.1, 0.1), (-0.1, 0.1, 0.1), (0.0, 0.1, 0.1), (float("inf"), 0.1, 0.1)]):
        r = tmp_path / f"r{i}"
        store.write_sidecar(record(prefill=prefill), r)
        assert main(["baseline", "update", str(r), "--golden-dir", str(tmp_path / "g")]) == 1
        err = capsys.readouterr().err
        assert "refused cpu-float32-b1-s128: samples of prefill_s hold 1 value(s) that are not times" in err, err
    assert not (tmp_path / "g" / "perf").exists() or not list((tmp_path / "g" / "perf").rglob("*.json"))
    # a calibration sample too
    store.write_sidecar({**record(), "calibration": {"samples": {"calib_matmul_s": [float("nan")]}}}, tmp_path / "rc")
    assert main(["baseline", "update", str(tmp_path / "rc"), "--golden-dir", str(tmp_path / "g")]) == 1
    assert "calibration samples of calib_matmul_s" in capsys.readouterr().err
    # a good baseline, then hand-edited to NaN: never compared, and the reason says so
    store.write_sidecar(record(), tmp_path / "ok")
    assert main(["baseline", "update", str(tmp_path / "ok"), "--golden-dir", str(tmp_path / "g")]) == 0
    path = tmp_path / "g" / "perf" / "llama-3.1-8b" / f"{fpmod.class_key(fp)}.json"
    path.write_text(path.read_text().replace("0.11", "NaN"))
    item, why = store.find_baseline("llama-3.1-8b", "cpu-float32-b1-s128", fp, tmp_path / "g")
    assert item is None and "baseline cpu-float32-b1-s128 not used: samples of prefill_s" in why, why


def test_several_results_dirs_pool_into_one_baseline_of_several_runs(tmp_path, capsys):
    golden = tmp_path / "golden"
    store.write_sidecar(record(prefill=(0.1, 0.11, 0.12)), tmp_path / "r1")
    store.write_sidecar(record(prefill=(0.2, 0.21, 0.22)), tmp_path / "r2")
    store.write_sidecar(record(prefill=(0.3, 0.31, 0.32)), tmp_path / "r3")
    fp = fpmod.fingerprint(get("cpu"), threads=1)
    # one run: one process's samples, and the baseline says so
    assert main(["baseline", "update", str(tmp_path / "r1"), "--golden-dir", str(golden)]) == 0
    item, _ = store.find_baseline("llama-3.1-8b", "cpu-float32-b1-s128", fp, golden)
    assert item["runs"] == 1 and store.runs(item) == 1
    # three runs in one update (one named twice counts once): pooled, replacing the stored one
    dirs = [str(tmp_path / d) for d in ("r1", "r2", "r3", "r2")]
    assert main(["baseline", "update", *dirs, "--golden-dir", str(golden)]) == 0
    assert "1 item(s)" in capsys.readouterr().out
    item, _ = store.find_baseline("llama-3.1-8b", "cpu-float32-b1-s128", fp, golden)
    assert item["runs"] == 3 and item["summary"]["prefill_s"]["n"] == 9
    assert item["samples"]["prefill_s"] == [0.1, 0.11, 0.12, 0.2, 0.21, 0.22, 0.3, 0.31, 0.32]
    assert store.runs({}) == 1 and store.runs({"runs": "x"}) == 1  # older baselines: one process
