"""Tensor parallelism inside fused MoE experts (harness.parallel.tp_experts) through a real 2-rank launch."""

from __future__ import annotations

import pytest
import torch

from harness.checks import CheckFailure
from harness.checks import parallel as par
from tests.parallel.helpers import details_of, metrics_of, run_variant, suite_with


@pytest.fixture(autouse=True)
def _fresh_launch_cache():
    par.reset_launches()
    yield
    par.reset_launches()


def test_gather_reassembles_packed_gate_up_slices():
    """Rank r's [E, 2I/tp, H] slice is [gate rows r, up rows r]: gathering puts gates first, then ups."""
    from harness.parallel.tp_experts import gather_full

    full = torch.arange(2 * 8 * 3, dtype=torch.float32).reshape(2, 8, 3)  # E=2, 2I=8 (I=4), H=3
    k = 2  # I / tp for tp2
    slices = [torch.cat([full[:, r * k:(r + 1) * k], full[:, 4 + r * k:4 + (r + 1) * k]], 1) for r in range(2)]
    halves = [s.chunk(2, 1) for s in slices]
    assert torch.equal(torch.cat([h[0] for h in halves] + [h[1] for h in halves], 1), full)
    # gather_full does the same with the parts all-gathered; on a 1-rank group it is the identity.
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
        try:
            assert torch.equal(gather_full(full, 1, True, None), full)
            assert torch.equal(gather_full(full, 2, False, None), full)
        finally:
            dist.destroy_process_group()


@pytest.mark.slow
def test_fused_experts_split_over_tp_match_and_a_missing_reduction_is_localized():
    ls = suite_with("qwen3-30b-a3b", configs=[{"tp": 2}, {"tp": 2, "name": "tp2-experts-no-ar"},
                                              {"tp": 2, "name": "tp2-experts-no-f"}])
    res = {v: run_variant(ls, v, "float32", fault="tests.parallel.faults:tp_experts_faults")
           for v in par.ParallelCheck().variants(ls, None)}
    out, ctx = res["tp2"]
    assert out is None, out
    assert any("fused experts split over tp2" in n for n in ctx.notes), ctx.notes
    assert not any("packed_colwise" in n or "moe_tp_experts" in n for n in ctx.notes), ctx.notes
    m = metrics_of(ctx)
    assert m["parallel_grad_error"] <= par.DEFAULT_TOLERANCES["float32"]["grads"]
    assert m["tp_param_fraction"] < 0.75, m["tp_param_fraction"]
    out, ctx = res["tp2-experts-no-ar"]
    assert isinstance(out, CheckFailure), out
    assert "First diverging module: model.layers.0.mlp.experts on rank(s) [0, 1]" in str(out), out
    out, ctx = res["tp2-experts-no-f"]
    msg = str(out)
    assert isinstance(out, CheckFailure) and "grads differ" in msg, msg
    assert "Every module's forward output agrees" in msg and "logits differ" not in msg, msg
    assert details_of(ctx)["worst_gradient"].startswith("model.layers.0."), details_of(ctx)


@pytest.mark.slow
def test_three_d_layouts_match_and_a_fault_in_each_is_localized():
    """One 8-rank launch: dp x fsdp x tp (HSDP over TP DTensors, fused experts split over tp) and
    ep x dp x tp, each healthy and with faults of its own (tests/parallel/faults.py:three_d_faults)."""
    healthy = [{"dp": 2, "fsdp": 2, "tp": 2}, {"ep": 2, "dp": 2, "tp": 2}]
    faulty = [{"dp": 2, "fsdp": 2, "tp": 2, "name": "hsdp-tp-skip-ar"},
              {"dp": 2, "fsdp": 2, "tp": 2, "name": "hsdp-tp-mean"},
              {"ep": 2, "dp": 2, "tp": 2, "name": "ep-dp-tp-no-ar"}]
    ls = suite_with("qwen3-30b-a3b", configs=healthy + faulty, max_world=8)
    res = {v: run_variant(ls, v, "float32", fault="tests.parallel.faults:three_d_faults")
           for v in par.ParallelCheck().variants(ls, None)}
    launches = {key: run.result().launches for key, (run, _) in par._LAUNCHES.items()}
    assert list(launches.values()) == [1], launches
    tol = par.DEFAULT_TOLERANCES["float32"]
    for v in ("tp2xdp2xfsdp2", "ep2xtp2xdp2"):
        out, ctx = res[v]
        assert out is None, f"{v}: {out}"
        m = metrics_of(ctx)
        assert m["parallel_world_size"] == 8 and m["parallel_grad_error"] <= tol["grads"], m
    assert metrics_of(res["tp2xdp2xfsdp2"][1])["comm_reduce_scatter_count"] > 0
    assert metrics_of(res["ep2xtp2xdp2"][1])["comm_all_to_all_count"] > 0
    out, _ = res["hsdp-tp-skip-ar"]
    assert isinstance(out, CheckFailure), out
    assert "First diverging module: model.layers.0.self_attn.o_proj on rank(s) [0, 1, 2, 3, 4, 5, 6, 7]" in str(out)
    for v in ("hsdp-tp-mean", "ep-dp-tp-no-ar"):
        out, ctx = res[v]
        msg = str(out)
        assert isinstance(out, CheckFailure) and "grads differ" in msg, f"{v}: {msg}"
        assert "Every module's forward output agrees" in msg and "logits differ" not in msg, msg
    assert ".mlp.experts." in details_of(res["ep-dp-tp-no-ar"][1])["worst_gradient"]
