"""The perf check on a real (tiny) model: figures, samples sidecar, baseline round trip, a slowdown
that is confirmed and one that is not, and backends whose figures would be wrong."""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import pytest
import torch

from harness.backends import get
from harness.backends.base import Backend
from harness.checks import CheckContext, CheckFailure, NotApplicable, registry
from harness.cli import main
from harness.suite.loader import load_suite
from tests_support import REPO_SUITES, TINY_PRUNE

# Tiny and quick; the threshold is 100% so that the noise of a shared machine never crosses it
# and the ~5x slowdowns below always do.
PERF = """
[model]
config = "configs/Llama-3.1-8B.json"
{prune}
[checks.perf]
enabled = true
width = 0
layers = 1
seq_lens = [8]
decode_tokens = 2
warmup = 1
min_repeats = 8
max_repeats = 8
budget_s = 0.01
calibration_budget_s = 0.01
kernel_sample_s = 0.001
kernel_size = 0.125
remeasure_repeats = 8
threshold = 1.0
thresholds = {{}}
"""


def slow_linears(model, factor=40.0, only_first_prompts=None, seq=8):
    """Extra CPU work after every Linear, `factor` x its own time (the tiny model's time is mostly
    Python, hence 40x: the model as a whole gets ~5x slower); with `only_first_prompts`, only
    during the first that many forward calls on a full prompt (a transient slowdown)."""
    prompts = [0]

    def count(_mod, _args, kwargs):
        ids = kwargs.get("input_ids")
        if ids is not None and ids.shape[1] == seq:
            prompts[0] += 1

    model.register_forward_pre_hook(count, with_kwargs=True)
    t0 = {}

    def pre(mod, _args):
        t0[id(mod)] = time.thread_time()

    def post(mod, _args, _out):
        if only_first_prompts is not None and prompts[0] > only_first_prompts:
            return
        now = time.thread_time()
        end = now + factor * (now - t0[id(mod)])
        while time.thread_time() < end:
            pass

    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_pre_hook(pre)
            m.register_forward_hook(post)


def run(ls, tmp: Path, transform=None):
    ctx = CheckContext(ls, get("cpu"), "float32", "b1-s8", check="perf")
    threads = torch.get_num_threads()
    try:
        registry().get("perf").run(ctx, results_dir=tmp / "results", golden_root=tmp / "golden", transform=transform)
    finally:
        assert torch.get_num_threads() == threads  # pinning is undone whatever happened
    return ctx


def props(ctx):
    p = dict(ctx.properties)
    return p, json.loads(p["harness.detail.perf_verdict"])


@pytest.mark.slow
def test_figures_baseline_and_verdicts(write_suite, tmp_path):
    ls = load_suite(write_suite("tiny", PERF.format(prune=TINY_PRUNE)))

    # 1. no baseline yet: figures, roofline fractions and the samples, and says so
    ctx = run(ls, tmp_path)
    p, v = props(ctx)
    for m in ("prefill_s", "ttft_s", "decode_token_s", "train_step_s", "prefill_cpu_s", "decode_token_cpu_s",
              "prefill_tokens_per_s", "decode_tokens_per_s", "prefill_mfu", "decode_mbu", "train_mfu",
              "calib_matmul_flops_per_s", "calib_copy_bytes_per_s", "prefill_peak_memory_bytes"):
        assert float(p[f"metric.{m}"]) > 0, m
    assert v["status"] == "no-baseline" and "harness baseline update" in v["baseline"]
    assert p["harness.detail.perf_clock"] == "cpu"
    pin = json.loads(p["harness.detail.perf_pinning"])
    assert pin["threads"] == 1 and pin["allocator"]  # what was done to the allocator, in words
    assert float(p["metric.prefill_minor_faults"]) >= 0
    side = Path(p["harness.detail.perf_samples"])
    rec = json.loads(side.read_text())
    assert len(rec["samples"]["prefill_cpu_s"]) == 8 and len(rec["reference"]["prefill"]["calib_matmul_cpu_s"]) == 8
    summary = json.loads(p["harness.detail.perf_summary"])["prefill_s"]
    assert summary["n"] == 8 and summary["ci_low"] <= summary["median"] <= summary["ci_high"]

    # 2. the reviewed run becomes the baseline; the same model again compares without a finding
    assert main(["baseline", "update", str(tmp_path / "results"), "--golden-dir", str(tmp_path / "golden")]) == 0
    p, v = props(run(ls, tmp_path))
    assert v["status"] != "regression", v
    assert set(v["metrics"]) == {"prefill_s", "ttft_s", "decode_token_s", "train_step_s"}
    assert 0 <= float(p["metric.prefill_s_p_value"]) <= 1 and "metric.prefill_s_change" in p

    # 3. every Linear 41x slower: a regression, confirmed on re-measure, fails the item with the figures
    with pytest.raises(CheckFailure) as e:
        run(ls, tmp_path, transform=slow_linears)
    assert "confirmed on re-measure" in e.value.message and e.value.metric
    assert "prefill_mfu" in e.value.details and "baseline:" in e.value.details
    # the verdict is in the sidecar too (the item failed before its properties reached anyone here)
    rec = json.loads(side.read_text())
    pre = rec["verdict"]["metrics"]["prefill_s"]
    assert pre["verdict"] == "regression" and pre["first"]["verdict"] == "regression" and pre["change"] > 1.0
    # the failure table's medians are the ones decided on (CPU clock, re-measured), both sides
    dec = pre["decided"]
    assert dec["clock"] == "cpu" and dec["samples"] == "prefill_cpu_s_remeasured"
    assert dec["now"]["median"] == pytest.approx(statistics.median(rec["remeasured"]["prefill_cpu_s_remeasured"]))
    assert dec["baseline"]["median"] == pytest.approx(dec["now"]["median"] / pre["ratio"])
    assert "medians on the cpu clock" in e.value.details
    assert rec["remeasured"]["prefill_cpu_s_remeasured"]

    # 4. slow only during the first measurement: suspected, re-measured, not confirmed, not reported
    ctx = run(ls, tmp_path, transform=lambda m: slow_linears(m, only_first_prompts=9))
    p, v = props(ctx)
    pre = v["metrics"]["prefill_s"]
    assert pre["first"]["verdict"] == "regression" and pre["verdict"] == "unchanged"
    assert "not confirmed on re-measure" in pre["why"] and v["status"] != "regression"

    # 5. another workload (here more decoded tokens) is never compared with this baseline
    ls.suite.checks.perf = ls.suite.checks.perf.model_copy(update={"decode_tokens": 3})
    p, v = props(run(ls, tmp_path))
    assert v["status"] == "incomparable" and "another workload" in v["baseline"]


def test_a_backend_without_synchronize_reports_that_instead_of_a_number(write_suite):
    ls = load_suite(write_suite("tiny", PERF.format(prune=TINY_PRUNE)))
    fake = Backend(name="fakedev", device_type="fakedev", collective="gloo")  # torch has no torch.fakedev
    ctx = CheckContext(ls, fake, "float32", "b1-s8", check="perf")
    with pytest.raises(NotApplicable, match="has no synchronize"):
        registry().get("perf").run(ctx)
    p = dict(ctx.properties)
    assert "timings would measure kernel launches" in p["harness.detail.perf_timing"]
    assert not any(k.startswith("metric.") for k in p)


def test_nightly_scope_and_one_item_per_shape(write_suite, monkeypatch):
    check = registry().get("perf")
    bundled = load_suite(REPO_SUITES / "llama-3.1-8b.toml")
    monkeypatch.delenv("HARNESS_PERF", raising=False)
    assert check.enabled(bundled) and check.scope(bundled, "b1-s128") == "nightly"
    monkeypatch.setenv("HARNESS_PERF", "1")  # the workflows: perf in any scope
    assert check.scope(bundled, "b1-s128") == "commit"
    monkeypatch.delenv("HARNESS_PERF")
    assert check.variants(bundled, get("cpu")) == ["b1-s128"]
    # a device backend also gets the real model's per-layer size, in the nightly scope too
    dev = Backend(name="npu", device_type="npu", collective="hccl")
    assert check.variants(bundled, dev) == ["b1-s128", "b1-s128-published"]
    ls = load_suite(write_suite("grid", PERF.format(prune=TINY_PRUNE).replace(
        "seq_lens = [8]", 'seq_lens = [8, 16]\nbatch_sizes = [1, 4]\nscope = "commit"\npublished = "never"')))
    assert check.variants(ls, dev) == ["b1-s8", "b1-s16", "b4-s8", "b4-s16"]
    assert check.scope(ls, "b1-s8") == "commit"


def test_bad_table_is_a_suite_error(write_suite):
    from harness.suite.loader import SuiteError

    with pytest.raises(SuiteError, match="checks.perf.seq_lens"):
        load_suite(write_suite("bad", PERF.format(prune=TINY_PRUNE).replace("seq_lens = [8]", "seq_lens = [0]")))
    assert os.environ.get("HF_HUB_OFFLINE") == "1"
