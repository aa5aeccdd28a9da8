"""Operators judged on their own profile repeats (issue #51 item 2, harness/perf/judge.py
``operator_verdicts``): the tiny model's attention kernel made slower at the dispatcher while its phase
stays under the phase threshold is named in the failure's first line; a clean rerun against the same
baseline (taken by `harness baseline update`) files nothing."""

from __future__ import annotations

import contextlib
import json
import statistics
import time

import pytest
import torch
from checks.test_perf import PERF

from harness.backends import get
from harness.checks import CheckContext, CheckFailure, registry
from harness.cli import main
from harness.suite.loader import load_suite
from tests_support import TINY_PRUNE

SDPA = "aten::_scaled_dot_product_flash_attention_for_cpu"
# Training is left out: the planted kernel has no backward. The phase threshold stays the shared tiny
# suite's 100%: the wrapper's own Python moves the tiny model's phases by up to ~30% on a loaded machine.
# A 1024-token prompt: at 8 tokens the tiny model's attention kernel is ~17 us, under the default
# op_min_time (1 ms, the profiler's own overhead is as large as such a kernel); at 512 it was ~2 ms on
# this project's first CI machine and 0.94 ms on an AVX-512/AMX one (both tests failed there: nothing over
# the floor); at 1024 it is about 4x that (quadratic in the prompt), over the floor on either.
# Prefill only: the kernel's decode calls are microseconds, under the floor, and decode at 1024 tokens costs time.
SUITE = PERF.format(prune=TINY_PRUNE).replace("seq_lens = [8]", "seq_lens = [1024]") + 'phases = ["prefill"]\n'
KEY = "cpu-float32-b1-s1024"


@contextlib.contextmanager
def slow_kernel(name: str, share: float):
    """The operator ``aten::<name>`` ``share`` slower: busy work for that share of the CPU time its CPU
    kernel just took, registered at the dispatcher's BackendSelect key (every operator passes it, right
    above the CPU kernel it redispatches to), so whatever times the operator - the profiler, the
    check's CPU-clock dispatch mode - times the busy work with it, as it would a slower kernel."""
    op = getattr(torch.ops.aten, name).default

    def slow(keyset, *args, **kwargs):
        t0 = time.thread_time()
        out = op.redispatch(keyset.remove(torch._C.DispatchKey.BackendSelect), *args, **kwargs)
        now = time.thread_time()
        end = now + share * (now - t0)
        while time.thread_time() < end:
            pass
        return out

    lib = torch.library.Library("aten", "IMPL")
    lib.impl(name, slow, "BackendSelect", with_keyset=True)
    try:
        yield
    finally:
        lib._destroy()


def _run(ls, tmp):
    ctx = CheckContext(ls, get("cpu"), "float32", "b1-s1024", check="perf")
    registry().get("perf").run(ctx, results_dir=tmp / "results", golden_root=tmp / "golden")
    return ctx


def _verdict(ctx) -> dict:
    return json.loads(dict(ctx.properties)["harness.detail.perf_verdict"])


@pytest.fixture(scope="module")
def baselined(tmp_path_factory):
    """The tiny perf suite (prefill) with a baseline of one clean run, profile included."""
    tmp = tmp_path_factory.mktemp("opverdicts")
    (tmp / "configs").mkdir()
    from tests_support import REPO_SUITES

    (tmp / "configs" / "Llama-3.1-8B.json").write_bytes((REPO_SUITES / "configs" / "Llama-3.1-8B.json").read_bytes())
    (tmp / "tiny.toml").write_text(SUITE)
    ls = load_suite(tmp / "tiny.toml")
    _run(ls, tmp)
    assert main(["baseline", "update", str(tmp / "results"), "--golden-dir", str(tmp / "golden")]) == 0
    base = json.loads(next((tmp / "golden" / "perf" / "tiny").glob("*.json")).read_text())
    prof = base["items"][KEY]["profile"]["prefill"]
    assert len(prof["op_samples"][SDPA]) == prof["repeats"] == 5  # per repeat, stored with the baseline
    return ls, tmp, statistics.median(prof["op_samples"][SDPA]) * 1e-6


def test_a_slower_attention_kernel_is_named_though_its_phase_stays_under_threshold(baselined):
    """The CPU attention kernel made 2x slower at the dispatcher (``slow_kernel``: busy work for as long
    as the kernel itself just took, ~4-8 ms at 1024 tokens, over the op_min_time floor): the operator's
    verdict fails the item, naming it and its module in the first line, while prefill (the kernel is
    about half of it) stays under its 100% threshold. 2x, not the bench's 40%: on a loaded machine the
    tiny model's microsecond operators move by up to ~50% in one profile, and the share hold then
    needs a large step to tell the kernel from them (a +50% kernel was held so in 1 of 6 runs)."""
    from harness.checks.perf import PerfConfig

    ls, tmp, sdpa_s = baselined
    assert sdpa_s >= PerfConfig().op_min_time  # judged at all: the kernel is over the default floor
    for _ in range(3):  # the tiny suite's 10 ms calibration can find a loaded machine incomparable: said, not judged
        try:
            with slow_kernel(SDPA.removeprefix("aten::"), 1.0):
                _run(ls, tmp)
        except CheckFailure as failure:
            e = failure
            break
        rec = json.loads((tmp / "results" / "perf" / "tiny" / f"{KEY}.json").read_text())
        if rec["verdict"]["status"] != "incomparable":
            pytest.fail(f"not named: {json.dumps(rec['verdict']['operators'])[:3000]}")
    else:
        pytest.fail(f"incomparable three times: {rec['verdict']['baseline']}")
    first = e.message.splitlines()[0]
    assert first.startswith(f"operator {SDPA} in model.layers.*.self_attn regressed +"), first
    assert "under the 100% threshold" in first and "confirmed on re-profile" in first, first
    assert e.metric.endswith("_worst_op_change") and SDPA in e.details
    # the phases themselves: no regression of their own (the sidecar's verdict)
    rec = json.loads((tmp / "results" / "perf" / "tiny" / f"{KEY}.json").read_text())
    assert all(m["verdict"] != "regression" for m in rec["verdict"]["metrics"].values()), rec["verdict"]
    ops = rec["verdict"]["operators"]
    hit = [x for ph in ops.values() for x in ph["regressions"] if x["name"] == SDPA]
    assert hit and all(x["change"] > 0.25 and x["first_change"] > 0.25 for x in hit), ops
    assert max(ph.get("worst_op_change", 0) for ph in ops.values()) > 0.25


def test_a_clean_rerun_against_the_same_baseline_files_no_operator(baselined):
    """The same code again: every operator of at least 2% of its phase and over the op_min_time floor
    judged, none confirmed; the tiny model's microsecond operators left to the floor."""
    ls, tmp, _ = baselined
    for _ in range(3):  # as above: an incomparable machine judges nothing, and this test needs a judgement
        ctx = _run(ls, tmp)
        if _verdict(ctx)["status"] != "incomparable":
            break
    ops = _verdict(ctx)["operators"]
    assert all(rec["regressions"] == [] for rec in ops.values()), ops
    assert ops["prefill"]["judged"] >= 1 and "worst_op_change" in ops["prefill"], ops
    assert f"operator {SDPA}" not in ops["prefill"]["under_floor"], ops
    assert "operator aten::mm" in ops["prefill"]["under_floor"], ops
    assert "metric.prefill_worst_op_change" in dict(ctx.properties)


def _profile(repeats: int, mm: list[float], other: list[float]) -> dict:
    """A phase profile of two operators, per repeat (microseconds), as profile.profile_phase stores it."""
    return {"repeats": repeats, "total_us": statistics.mean(mm) + statistics.mean(other),
            "ops": {"aten::mm": statistics.mean(mm), "aten::add": statistics.mean(other)},
            "op_samples": {"aten::mm": mm, "aten::add": other},
            "total_samples": [a + b for a, b in zip(mm, other, strict=True)],
            "op_modules": {"aten::mm": {"model.layers.*.mlp": statistics.mean(mm)}}}


def test_the_rule_holds_a_machine_that_slowed_everything_and_says_when_repeats_cannot_decide():
    """Both operators 40% slower (the machine, not an operator: their shares unchanged) is held as too
    noisy; one of them 40% slower alone is confirmed; three repeats a side cannot reach p < 0.01."""
    from harness.checks.perf import PerfConfig
    from harness.perf.judge import Comparison, operator_verdicts

    cfg = PerfConfig(op_min_time=0.0)  # the rule itself: these operators are microseconds, under the floor
    base = _profile(5, [100, 101, 99, 102, 98], [50, 51, 49, 50, 52])
    c = Comparison(base_profile={"prefill": base}, ratios={"prefill_s": 1.0})
    both = _profile(5, [140, 141, 139, 142, 138], [70, 71, 69, 70, 73])
    rec = operator_verdicts(c, {"prefill": both}, cfg, lambda ph: both)["prefill"]
    assert rec["regressions"] == [] and "the phase moved with it" in rec["held"]["operator aten::mm"], rec
    one = _profile(5, [140, 141, 139, 142, 138], [50, 51, 49, 50, 52])
    rec = operator_verdicts(c, {"prefill": one}, cfg, lambda ph: one)["prefill"]
    assert [x["name"] for x in rec["regressions"]] == ["aten::mm"] and rec["worst_op_change"] > 0.35, rec
    assert rec["regressions"][0]["module"] == "model.layers.*.mlp"
    # every operator of a wider profile past the threshold at once: the profile's noise, said, not filed
    wide = {f"aten::op{i}": [10.0 + i % 3 * 0.1] * 5 for i in range(10)}
    grown = {k: [v * 1.6 + i * 0.01 for i, v in enumerate(vs)] for k, vs in wide.items()}
    wide["aten::mm"], grown["aten::mm"] = [100.0, 101, 99, 102, 98], [100.0, 101, 99, 102, 98]

    def prof(ops):
        return {"repeats": 5, "total_us": sum(statistics.mean(v) for v in ops.values()),
                "ops": {k: statistics.mean(v) for k, v in ops.items()}, "op_samples": ops,
                "total_samples": [sum(v[i] for v in ops.values()) for i in range(5)]}

    cw = Comparison(base_profile={"prefill": prof(wide)}, ratios={"prefill_s": 1.0})
    rec = operator_verdicts(cw, {"prefill": prof(grown)}, cfg, None)["prefill"]
    assert rec["regressions"] == [] and rec["moved"] == 10 and "too noisy to judge operators" in rec["note"], rec
    c3 = Comparison(base_profile={"prefill": _profile(3, [100, 101, 99], [50, 51, 49])}, ratios={"prefill_s": 1.0})
    rec = operator_verdicts(c3, {"prefill": _profile(3, [140, 141, 139], [50, 51, 49])}, cfg, None)["prefill"]
    assert rec["judged"] == 0 and "cannot reach p < 0.01" in rec["note"], rec


def test_an_operator_under_the_time_floor_is_not_judged_however_much_it_grew():
    """aten::add at 50 us per phase call and 10% of it, twice as slow alone: under op_min_time it is
    not judged (listed under the floor); with the floor at 0 the same samples are a confirmed regression,
    so only the floor keeps it out. The same at 2 ms per phase call in 40 calls: under op_min_call_time."""
    from harness.checks.perf import PerfConfig
    from harness.perf.judge import Comparison, operator_verdicts

    base = _profile(5, [450, 451, 449, 452, 448], [50, 51, 49, 50, 52])
    now = _profile(5, [450, 451, 449, 452, 448], [100, 102, 98, 100, 104])
    c = Comparison(base_profile={"prefill": base}, ratios={"prefill_s": 1.0})
    cfg = PerfConfig(op_min_time=1e-4)
    rec = operator_verdicts(c, {"prefill": now}, cfg, lambda ph: now)["prefill"]
    assert rec["regressions"] == [] and rec["judged"] == 1 and rec["under_floor"] == ["operator aten::add"], rec
    rec = operator_verdicts(c, {"prefill": now}, cfg.model_copy(update={"op_min_time": 0.0}), lambda ph: now)
    assert [x["name"] for x in rec["prefill"]["regressions"]] == ["aten::add"], rec
    # per call: 2 ms per phase call (over op_min_time) made of 40 calls of 50 us (under op_min_call_time)
    big = {k: [v * 40 for v in vs] for k, vs in base["op_samples"].items()}
    base40 = dict(_profile(5, big["aten::mm"], big["aten::add"]), calls={"aten::mm": 1, "aten::add": 40})
    now40 = dict(_profile(5, big["aten::mm"], [v * 40 for v in now["op_samples"]["aten::add"]]), calls=base40["calls"])
    c40 = Comparison(base_profile={"prefill": base40}, ratios={"prefill_s": 1.0})
    rec = operator_verdicts(c40, {"prefill": now40}, PerfConfig(), lambda ph: now40)["prefill"]
    assert rec["regressions"] == [] and rec["under_floor"] == ["operator aten::add"], rec
    rec = operator_verdicts(c40, {"prefill": now40}, PerfConfig(op_min_call_time=0.0), lambda ph: now40)["prefill"]
    assert [x["name"] for x in rec["regressions"]] == ["aten::add"], rec


def test_a_module_that_waits_is_not_slower_on_the_cpu_clock():
    """profile_phase on a small model whose first layer sleeps 20 ms after its forward (as a process the
    scheduler paused waits): the profiler's wall clock puts the 20 ms in the layer's own time, the CPU
    clock the verdicts read does not; a layer that spins as long is slower on both."""
    from harness.backends import get
    from harness.perf.profile import profile_phase

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
    x = torch.randn(64, 256)

    def profiled(extra):
        h = model[0].register_forward_hook(lambda *_: extra())
        try:
            with torch.no_grad():
                return profile_phase(lambda: model(x), model, get("cpu"), repeats=3)
        finally:
            h.remove()

    def spin():
        end = time.thread_time() + 0.02
        while time.thread_time() < end:
            pass

    waits, spins = profiled(lambda: time.sleep(0.02)), profiled(spin)
    assert waits["clock"] in ("thread_cpu", "process_cpu") and len(waits["op_samples"]["aten::addmm"]) == 3
    assert waits["modules_self"]["0"] > 19_000  # the profiler's (wall) own time holds the sleep
    assert max(waits["modules_self_samples"]["0"]) < 10_000, waits["modules_self_samples"]  # the CPU clock's not
    assert min(spins["modules_self_samples"]["0"]) > 19_000, spins["modules_self_samples"]
