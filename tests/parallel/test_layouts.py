"""Layouts, names, meshes, the check's table and the comparison arithmetic (no processes)."""

from __future__ import annotations

import pytest
import torch

from harness.checks.parallel import ParallelCheck, layouts_of, tolerances
from harness.parallel.compare import ref_piece, rel_err
from harness.parallel.layouts import ArchFacts, Layout, default_layouts, parse_name, validate
from harness.suite.loader import SuiteError, load_suite
from tests.parallel.helpers import suite_with


def test_names_round_trip_and_world():
    for name, world in (("tp2", 2), ("ep2xtp2", 4), ("tp2xdp2", 4), ("fsdp2-ac", 2), ("pp2", 2), ("tp2xfsdp2", 4),
                        ("dp2xfsdp2", 4), ("ep2xdp2", 4)):
        lay = parse_name(name)
        assert lay.label == name and lay.world == world
    assert parse_name("fsdp2-ac").recompute
    for bad in ("tp", "tp2xtp2", "zz2", "tp0"):
        with pytest.raises(ValueError, match="not a layout name"):
            parse_name(bad)


def test_mesh_coordinates_put_tp_innermost_and_slice_data():
    lay = Layout(tp=2, dp=2)
    assert lay.mesh_shape() == (("dp", "tp"), (2, 2))
    assert [lay.coords(r)["tp"] for r in range(4)] == [0, 1, 0, 1]
    assert [lay.data_index(r) for r in range(4)] == [0, 0, 1, 1]
    assert [Layout(ep=2, tp=2).data_index(r) for r in range(4)] == [0, 0, 1, 1]
    # HSDP: replicate (dp) outer, shard (fsdp) inner; every rank its own batch slice.
    assert Layout(dp=2, fsdp=2).mesh_shape() == (("dp", "fsdp"), (2, 2))
    assert Layout(tp=2, fsdp=2).mesh_shape() == (("fsdp", "tp"), (2, 2))
    lay = Layout(ep=2, dp=2)
    assert lay.mesh_shape() == (("dp", "ep"), (2, 2)) and lay.label == "ep2xdp2"
    assert [lay.data_index(r) for r in range(4)] == [0, 1, 2, 3]
    assert [lay.coords(r)["ep"] for r in range(4)] == [0, 1, 0, 1]  # experts [0, E/2) on ranks 0 and 2


def test_default_matrix_per_architecture_and_validation():
    dense = [lay.label for lay in default_layouts(ArchFacts(moe=False, num_layers=2))]
    assert dense == ["tp2", "pp2", "dp2", "fsdp2-ac", "tp2xdp2"]
    moe = [lay.label for lay in default_layouts(ArchFacts(moe=True, num_layers=2, num_experts=8))]
    assert moe == dense + ["ep2", "ep2xtp2"]
    facts = ArchFacts(moe=False, num_layers=1)
    assert "decoder layers" in validate(Layout(pp=2), facts, heads=8, kv_heads=2)
    assert "mixture-of-experts" in validate(Layout(ep=2), facts, heads=8, kv_heads=2)
    assert "does not divide" in validate(Layout(tp=4), facts, heads=8, kv_heads=2)
    assert validate(Layout(tp=2), facts, heads=8, kv_heads=1) is None  # MQA: KV replicated over tp
    moe = ArchFacts(moe=True, num_layers=2, num_experts=8)
    # 2-D layouts: fsdp x tp (FSDP2 + TP), dp x fsdp (HSDP), ep x dp
    for lay in (Layout(tp=2, fsdp=2), Layout(dp=2, fsdp=2), Layout(ep=2, dp=2), Layout(ep=2, tp=2)):
        assert validate(lay, moe, heads=8, kv_heads=2) is None, lay.label
    assert validate(Layout(ep=2, fsdp=2), moe, heads=8, kv_heads=2) is None  # dp_shard_in_ep
    assert "ep x fsdp combines with nothing else" in validate(Layout(ep=2, fsdp=2, tp=2), moe, heads=8, kv_heads=2)
    # pp x tp, pp x fsdp, pp x fsdp x tp, recomputation inside stages; pp with ep or dp with more refused
    for lay in (Layout(pp=2, tp=2), Layout(pp=2, fsdp=2), Layout(pp=2, recompute=True),
                Layout(pp=2, fsdp=2, recompute=True), Layout(pp=2, fsdp=2, tp=2)):
        assert validate(lay, moe, heads=8, kv_heads=2) is None, lay.label
    assert "with ep" in validate(Layout(pp=2, ep=2), moe, heads=8, kv_heads=2)
    assert "pp x dp combines with nothing else" in validate(Layout(pp=2, dp=2, tp=2), moe, heads=8, kv_heads=2)
    # pp x dp: DDP per stage; 2 data slices x 2 microbatches
    lay = parse_name("pp2xdp2")
    assert lay.world == 4 and lay.mesh_shape() == (("pp", "dp"), (2, 2))
    assert [lay.data_index(r) for r in range(4)] == [0, 1, 0, 1]  # ranks 0, 2: stages of replica 0
    assert validate(lay, moe, heads=8, kv_heads=2, batch_size=4) is None
    assert "4 equal slices" in validate(lay, moe, heads=8, kv_heads=2, batch_size=2)
    assert validate(Layout(dp=2, fsdp=2, tp=2), moe, heads=8, kv_heads=2) is None  # HSDP + TP runs since 579d422
    # 4 data slices need a batch of a multiple of 4 sequences
    assert "does not split into 4 equal slices" in validate(Layout(ep=2, dp=2), moe, heads=8, kv_heads=2, batch_size=2)
    assert validate(Layout(ep=2, dp=2), moe, heads=8, kv_heads=2, batch_size=8) is None


def test_suite_table_variants_and_errors(write_suite):
    ls = suite_with("mixtral-8x7b")
    assert ParallelCheck().variants(ls, None) == ["tp2", "pp2", "dp2", "fsdp2-ac", "tp2xdp2", "ep2", "ep2xtp2"]
    ls = suite_with("llama-3.1-8b", configs=[{"tp": 2, "recompute": True}, {"pp": 2, "microbatches": 4,
                                                                          "name": "deep"}])
    assert [lay.label for lay in layouts_of(ls, ls.suite.checks.parallel)] == ["tp2-ac", "deep"]
    bad = write_suite("bad", """
        [model]
        config = "configs/Llama-3.1-8B.json"
        [checks.parallel]
        enabled = true
        [[checks.parallel.configs]]
        tp = 0
    """)
    with pytest.raises(SuiteError, match=r"checks\.parallel\.configs\[0\]\.tp: must be >= 1"):
        load_suite(bad)


def test_tolerances_are_per_dtype_and_overridable():
    ls = suite_with("llama-3.1-8b", tolerances={"bfloat16": {"grads": 0.25}})
    cfg = ls.suite.checks.parallel
    assert tolerances(cfg, "float32")["grads"] < tolerances(cfg, "bfloat16")["grads"] == 0.25


def test_reference_pieces_follow_data_and_tp_shards():
    ref = torch.arange(4 * 3 * 8, dtype=torch.float32).reshape(4, 3, 8)
    lay = Layout(tp=2, dp=2)
    # rank 3: data index 1 (rows 2..3), tp index 1 (last half of the features)
    piece = ref_piece(ref, (2, 3, 4), lay, 3)
    assert torch.equal(piece, ref[2:, :, 4:])
    assert ref_piece(ref, (4, 3, 8), lay, 3) is ref
    assert ref_piece(ref, (3, 3, 8), lay, 0) is None
    assert rel_err(ref, ref) == 0.0
    assert rel_err(ref + 1, ref) == pytest.approx(1 / ref.abs().max().item())
    assert rel_err(torch.full_like(ref, float("nan")), ref) == float("inf")


def test_plan_recommendation_becomes_a_layout_at_pruned_scale():
    ls = suite_with("llama-3.1-8b", configs=[{"dp": 2}],
                    plan={"devices": 8, "device_memory": "80GiB", "mode": "training", "batch": 64})
    names = ParallelCheck().variants(ls, None)
    # harness plan recommends dp8 with ZeRO-2 and recomputation for training on one 8-device node:
    # checked as dp2 with ZeRO-2 and recomputation
    assert names == ["dp2", "plan-dp2-zero2-ac"]


def test_zero_stages_name_validate_and_reject_bad_input(write_suite):
    for name, zero in (("dp2-zero1", 1), ("dp2-zero2", 2), ("dp4-zero2-ac", 2)):
        lay = parse_name(name)
        assert lay.label == name and lay.zero == zero and lay.world == lay.dp
    facts = ArchFacts(moe=False, num_layers=2)
    assert validate(Layout(dp=2, zero=1), facts, heads=8, kv_heads=2) is None
    assert validate(Layout(dp=2, zero=2), facts, heads=8, kv_heads=2) is None
    for lay in (Layout(zero=1), Layout(tp=2, dp=2, zero=1), Layout(dp=2, fsdp=2, zero=2)):
        assert "dp dimension alone" in validate(lay, facts, heads=8, kv_heads=2), lay
    ls = suite_with("llama-3.1-8b", configs=[{"dp": 2, "zero": 1}, {"dp": 2, "zero": 2}])
    assert ParallelCheck().variants(ls, None) == ["dp2-zero1", "dp2-zero2"]
    bad = write_suite("bad", """
        [model]
        config = "configs/Llama-3.1-8B.json"
        [checks.parallel]
        enabled = true
        [[checks.parallel.configs]]
        dp = 2
        zero = 3
    """)
    with pytest.raises(SuiteError, match=r"checks\.parallel\.configs\[0\]\.zero: .*0, 1 or 2"):
        load_suite(bad)
