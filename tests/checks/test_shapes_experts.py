"""The shapes check on a grouped GEMM (issue #47, "a grouped GEMM wrong only for one expert count"):
qwen3-30b-a3b's experts run through ``aten._grouped_mm`` with the published 128 experts; the pruned
suite has 8. A kernel wrong only at 128 groups is bit-invisible to the pruned precision check and
caught by the shapes check with the operator, the shape and the experts module named."""

from __future__ import annotations

import pytest
import torch

from harness.checks import CheckFailure, run_one
from harness.suite.loader import load_suite
from tests_support import REPO_SUITES

GROUPS_FAULT = 128  # qwen3-30b-a3b's published num_experts; the pruned suite keeps 8
GROUPED = "aten._grouped_mm.default"


def _suite(tmp, extra: str = ""):
    body = (REPO_SUITES / "qwen3-30b-a3b.toml").read_text().replace(
        'config = "configs/', f'config = "{REPO_SUITES}/configs/')
    (tmp / "suites").mkdir(exist_ok=True)
    p = tmp / "suites" / "experts.toml"
    # every matmul and attention signature (23, the 6 grouped GEMMs among them); 4M-element tensors
    # keep the 128 experts and K and slice N (seconds instead of a minute)
    p.write_text(body + "\n[checks.shapes]\nenabled = true\ntokens = 32\nmax_signatures = 23\n"
                 "max_numel = 4194304\n" + extra)
    return load_suite(p)


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("experts")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HARNESS_CACHE_DIR", str(tmp / "cache"))
        yield _suite(tmp)


class _Seen:
    groups: list[int]
    fired: int


def _only_at_groups(seen: _Seen):
    def make(call):
        def k(ks, *args, **kwargs):
            y = call(ks, *args, **kwargs)
            offs = kwargs.get("offs", args[2] if len(args) > 2 else None)
            n = offs.numel() if isinstance(offs, torch.Tensor) else 0
            seen.groups.append(n)
            if n == GROUPS_FAULT and y.dtype != torch.float64:
                seen.fired += 1
                return y * 1.05  # 5 % high: a wrong scale in one tile schedule
            return y
        return k
    return make


@pytest.fixture
def groups_fault():
    """On the CPU's dispatch key, as `harness certify` installs faults (Fault.register): the seen
    group counts are recorded, so the test shows the pruned model reaches the kernel and the fault
    stays silent there."""
    from harness.backends.faults import Fault

    seen = _Seen()
    seen.groups, seen.fired = [], 0
    fault = Fault("grouped-128", "_grouped_mm 5% high only with 128 groups", "shapes",
                  {"aten::_grouped_mm": _only_at_groups(seen)})
    lib = torch.library.Library("aten", "IMPL")
    assert fault.register(lib, "CPU") == ["aten::_grouped_mm"]
    try:
        yield seen
    finally:
        lib._destroy()


def test_grouped_inputs_keep_the_expert_count_and_route_every_row(suite):
    from harness.checks.ops import _execute, compare_outputs, resolve_op
    from harness.inspect.signatures import (
        budget,
        grouped_mm_reference,
        make_inputs,
        protected_dims,
        resized,
        shrink,
        suite_signatures,
    )

    sigs, _ = suite_signatures(suite, "float32", tokens=32)
    grouped = [s for s in sigs if s.op == GROUPED]
    assert len(grouped) == 6 and all(s.tensors()[2][0] == [GROUPS_FAULT] for s in grouped)
    assert {s.forward > 0 for s in grouped} == {True, False}  # forward and backward (weight and input grads)
    for s in grouped:
        assert GROUPS_FAULT in protected_dims(s)
        plan = shrink(s, 2**22)
        assert GROUPS_FAULT not in plan and plan  # N (or the weight gradient's M) sliced, never the experts
        args, kwargs = resized(s, plan)
        a, k = make_inputs(args, kwargs, 0, s.op)
        offs = a[2]
        # the router's offsets: nondecreasing, every one of the 256 routed rows (32 tokens x top-8) in
        # a group, some experts empty: not the random integers of other int arguments
        assert offs.dtype == torch.int32 and offs.shape == (GROUPS_FAULT,) and offs[-1].item() == 256
        assert bool((offs.diff() >= 0).all()) and bool((offs.diff() == 0).any())
        ref = _execute(grouped_mm_reference, a, k, "cpu", torch.float64)
        assert ref.dtype == torch.float64
        err = compare_outputs(s.op, _execute(resolve_op(s.op), a, k, "cpu"), ref)
        assert 0 < err <= budget(s, args, 8.0)  # float32 kernel vs float64 reference: rounding only


@pytest.fixture(scope="module")
def clean_precision():
    """The pruned suite's precision check with no fault installed (module scope: set up before the
    function-scoped fault)."""
    ls = load_suite(REPO_SUITES / "qwen3-30b-a3b.toml")
    return ls, dict(run_one(ls, "precision", "cpu", "float32", None).properties)


def test_fault_at_one_expert_count_is_caught_and_named(suite, clean_precision, groups_fault):
    # the pruned model (8 experts) runs the same kernel; its precision check is bit-identical
    pruned, clean = clean_precision
    with_fault = dict(run_one(pruned, "precision", "cpu", "float32", None).properties)
    assert 8 in groups_fault.groups and GROUPS_FAULT not in groups_fault.groups and groups_fault.fired == 0
    metrics = {k: v for k, v in with_fault.items() if k.startswith("metric.")}
    assert metrics and metrics == {k: v for k, v in clean.items() if k.startswith("metric.")}

    with pytest.raises(CheckFailure) as e:
        run_one(suite, "shapes", "cpu", "float32", None)
    assert groups_fault.fired > 0
    msg = str(e.value)
    assert msg.startswith(f"{GROUPED} at (float32[") and f"int32[{GROUPS_FAULT}]) on cpu" in msg, msg
    assert "off the cpu float64 reference" in msg and "budget" in msg, msg
    assert "called by model.layers.*.mlp.experts [Qwen3MoeExperts] (e.g. model.layers." in msg, msg
    # every signature over budget is a grouped GEMM at 128 experts; the 17 plain GEMMs and attention pass
    lines = e.value.details.splitlines()
    assert len(lines) == 6 and all(line.startswith(f"{GROUPED} at (") for line in lines), lines


def test_clean_backend_passes_with_the_float64_reference(suite):
    ctx = run_one(suite, "shapes", "cpu", "float32", None)
    props = dict(ctx.properties)
    assert float(props["metric.shapes_checked"]) == 23  # every matmul and attention, grouped included
    assert 0 < float(props["metric.shapes_worst_budget_ratio"]) <= 1
    assert not [n for n in ctx.notes if "_grouped_mm" in n]  # no same-dtype fallback for it any more
    assert f"{GROUPED} 1536->" in props["harness.detail.sliced"]
