"""The shapes check: the unpruned llama-3.1-8b's operator signatures at their published shapes
(hidden 4096, head_dim 128, intermediate 14336) against float64, and a kernel fault that only a
published shape reaches, caught with the operator, the shape and the calling modules named, while
the pruned-shape ops check passes."""

from __future__ import annotations

import math

import pytest
import torch

from harness.checks import CheckFailure, run_one
from harness.suite.loader import load_suite
from tests_support import REPO_SUITES

K_FAULT = 14336  # llama-3.1-8b's intermediate size: the down_proj's K (and the up/gate backward's)


def _suite(tmp, name: str, extra: str):
    body = (REPO_SUITES / "llama-3.1-8b.toml").read_text().replace(
        'config = "configs/', f'config = "{REPO_SUITES}/configs/')
    (tmp / "suites").mkdir(exist_ok=True)
    p = tmp / "suites" / f"{name}.toml"
    p.write_text(body + "\n[checks.ops]\nenabled = true\nexamples = 2\n\n[checks.shapes]\nenabled = true\n"
                 "tokens = 16\n" + extra)
    return load_suite(p)


@pytest.fixture(scope="module")
def suites(tmp_path_factory):
    """The full check (every signature) and a matmul-first cut of it, sharing the trace cache."""
    tmp = tmp_path_factory.mktemp("shapes")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HARNESS_CACHE_DIR", str(tmp / "cache"))
        yield _suite(tmp, "full", "max_numel = 16777216\n"), _suite(tmp, "gemm", "max_signatures = 8\n")


def test_inventory_has_the_published_shapes(suites):
    from harness.inspect.signatures import suite_signatures

    sigs, meta = suite_signatures(suites[0], "bfloat16", tokens=16)
    assert meta["tokens"] == 16 and len(sigs) > 100
    by = {(s.op, tuple(tuple(t[0]) for t in s.tensors()), s.forward > 0): s for s in sigs}
    down = by[("aten.mm.default", ((16, 14336), (14336, 4096)), True)]  # the forward down_proj, K = 14336
    assert down.tensors()[1][1] == [1, 14336]  # the weight's transposed view: the layout is recorded
    assert down.forward == 32 and "model.layers.*.mlp.down_proj [Linear]" in down.modules
    assert down.example == "model.layers.0.mlp.down_proj"
    attn = [s for s in sigs if s.op == "aten._scaled_dot_product_flash_attention_for_cpu.default"]
    assert [t[0] for t in attn[0].tensors()[:3]] == [[1, 32, 16, 128], [1, 8, 16, 128], [1, 8, 16, 128]]
    assert any(s.backward for s in sigs) and any(s.op.endswith("_backward.default") for s in sigs)
    cached = list((suites[0].path.parent.parent / "cache" / "signatures").glob("full-bfloat16-*.json"))
    assert len(cached) == 1
    again, _ = suite_signatures(suites[0], "bfloat16", tokens=16)  # read back from the cache
    assert [s.__dict__ for s in again] == [s.__dict__ for s in sigs]


def test_shrink_keeps_what_kernels_reduce_over():
    from harness.inspect.signatures import Signature, budget, resized, shrink

    t = lambda s, st, dt="bfloat16": {"T": [s, st, dt]}  # noqa: E731
    emb_bw = Signature("aten.embedding_dense_backward.default", [t([1, 16, 4096], [65536, 4096, 1]),
                       t([1, 16], [16, 1], "int64"), 128256, -1, False], {}, out=t([128256, 4096], [4096, 1]))
    plan = shrink(emb_bw, 2**24)
    assert plan == {128256: 4096}  # the vocabulary, in the shape and in num_weights
    args, _ = resized(emb_bw, plan)
    assert args[2] == 4096 and args[0]["T"][0] == [1, 16, 4096]
    lm_bw = Signature("aten.mm.default", [t([16, 128256], [128256, 1]), t([128256, 4096], [4096, 1])], {})
    assert shrink(lm_bw, 2**24) == {4096: 128}  # K = 128256 kept: N is sliced
    assert shrink(Signature("aten.mm.default", [t([16, 4096], [4096, 1]), t([4096, 4096], [1, 4096])], {}),
                  2**20) is None  # K and N are the same size: nothing to slice without slicing K
    # the budget grows with the reduction length: sqrt(K) of float32 accumulation on bfloat16 output
    mm = Signature("aten.mm.default", [t([16, 14336], [14336, 1]), t([14336, 4096], [1, 14336])], {})
    assert budget(mm, mm.args, 8.0) == pytest.approx(8 * (2**-8 + 2**-24 * math.sqrt(14336)))
    silu = Signature("aten.silu.default", [t([16, 14336], [14336, 1], "float32")], {})
    assert budget(silu, silu.args, 8.0) == pytest.approx(8 * 2 * 2**-24)  # pointwise: R = 1


@pytest.mark.slow  # every signature of the 8B model at its real shapes: ~1-2 min per dtype on 2 cores
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_clean_backend_passes_with_full_coverage(suites, dtype):
    props = dict(run_one(suites[0], "shapes", "cpu", dtype, None).properties)
    assert float(props["metric.shapes_signatures"]) > 100
    assert float(props["metric.shapes_forward_coverage"]) >= 0.95
    assert float(props["metric.shapes_coverage"]) >= 0.95
    assert 0 < float(props["metric.shapes_worst_budget_ratio"]) <= 1
    assert "128256->" in props["harness.detail.sliced"]  # the vocabulary, and only where too large


def _only_at_k(call):
    """A GEMM kernel wrong (5% high) only on the split-K path that K = 14336 takes."""
    from harness.backends.faults import LOW

    def k(ks, *args, **kwargs):
        y = call(ks, *args, **kwargs)
        a = args[-2] if len(args) >= 3 else args[0]  # addmm(bias, a, b): a is args[1]
        return y * 1.05 if y.dtype in LOW and a.shape[-1] == K_FAULT else y
    return k


@pytest.fixture
def k_fault():
    """Installed on the CPU's dispatch key the way `harness certify` installs its faults
    (harness.backends.faults.Fault.register); float64 passes through, so the reference is exact."""
    from harness.backends.faults import Fault

    fault = Fault("split-k-14336", "mm/addmm 5% high only when K == 14336", "shapes",
                  {"aten::mm": _only_at_k, "aten::addmm": _only_at_k})
    lib = torch.library.Library("aten", "IMPL")
    assert fault.register(lib, "CPU") == ["aten::mm", "aten::addmm"]
    try:
        yield fault
    finally:
        lib._destroy()


def test_fault_at_a_published_shape_is_caught_and_named(suites, k_fault):
    with pytest.raises(CheckFailure) as e:
        run_one(suites[1], "shapes", "cpu", "float32", None)
    msg = str(e.value)
    assert msg.startswith("aten.mm.default at (float32[16,14336], float32[14336,4096]") and "on cpu" in msg, msg
    assert "model.layers.*.mlp.down_proj [Linear]" in msg and "model.layers.0.mlp.down_proj" in msg, msg
    assert "error" in msg and "budget" in msg
    # every signature named has K = 14336; the other GEMMs of the cut (K = 4096) pass
    assert all(line.startswith("aten.mm.default at (float32[16,14336]") for line in e.value.details.splitlines())
    # the pruned model's K is 256: the ops check at its shapes passes with the same fault installed
    ctx = run_one(suites[1], "ops", "cpu", "float32", "aten.mm.default")
    props = dict(ctx.properties)
    assert float(props["metric.op_max_rel_error"]) <= float(props["tolerance.op_max_rel_error"])


def test_table_errors_name_the_key(tmp_path):
    from harness.suite.loader import SuiteError

    for bad, key in (("max_numel = 10", "checks.shapes.max_numel"), ("max_signatures = 0", "checks.shapes.max_signatures"),
                     ("scope = \"weekly\"", "checks.shapes.scope"), ("budget = 1.0", "checks.shapes.budget")):
        with pytest.raises(SuiteError, match=key):
            _suite(tmp_path, "bad", bad + "\n")
    ls = _suite(tmp_path, "ok", "")
    from harness.checks import registry

    check = registry().get("shapes")
    assert check.enabled(ls) and check.scope(ls, None) == "nightly"  # full-size operators: nightly by default
