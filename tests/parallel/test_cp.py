"""Context parallelism (harness.parallel.cp) through real torchrun launches of gloo ranks on CPU.

One 2-rank launch on llama-3.1-8b with cp2 healthy beside two broken cp layouts - a mask that
ignores the chunk offset on cp rank 1 (caught in the forward at layer 0's attention) and a K/V
gather whose backward skips its all-reduce (forward right, k/v projections' gradients named); one
4-rank launch of cp x dp and cp x tp on llama-3.1-8b, one launch per world size on deepseek-v3 (MLA,
routed experts). Every launch is ``slow`` (~20 s on 2 cores). Refusals ("where the attention
supports it") need no launch.
"""

from __future__ import annotations

import json

import pytest

from harness.checks import CheckFailure, NotApplicable
from harness.checks import parallel as par
from harness.parallel import cp
from harness.parallel.layouts import ArchFacts, Layout, validate
from tests.parallel.helpers import ROOT, details_of, metrics_of, run_variant, suite_with

F32 = par.DEFAULT_TOLERANCES["float32"]


@pytest.fixture(autouse=True)
def _fresh_launch_cache():
    par.reset_launches()
    yield
    par.reset_launches()


def _assert_matches(out, ctx, label):
    assert out is None, f"{label}: {out}"
    m = metrics_of(ctx)
    for q, key in (("logits", "parallel_logits_error"), ("loss", "parallel_loss_error"),
                   ("grads", "parallel_grad_error"), ("weights", "parallel_weight_error"),
                   ("logits_after", "parallel_logits_after_error"), ("activations", "parallel_activation_error")):
        assert m[key] <= F32[q], f"{label}: {key} {m[key]}"
    # No inner module off either (a chunk compared with the wrong piece of the reference is a note).
    assert not [n for n in ctx.notes if "differs by" in n], ctx.notes
    assert m["comm_all_gather_count"] > 0  # K and V gathered over the cp group
    return m


@pytest.mark.slow
def test_cp2_matches_and_broken_mask_and_gather_are_caught():
    ls = suite_with("llama-3.1-8b", memory_seq_len=64, configs=[
        {"cp": 2}, {"cp": 2, "recompute": True}, {"cp": 2, "name": "cp2-mask"}, {"cp": 2, "name": "cp2-gather"},
        {"tp": 2}])
    res = {v: run_variant(ls, v, fault="tests.parallel.faults:cp_faults")
           for v in ("cp2", "cp2-ac", "cp2-mask", "cp2-gather", "tp2")}
    assert [run.result().launches for run, _ in par._LAUNCHES.values()] == [1]
    _assert_matches(*res["cp2"], "cp2")  # healthy beside the broken ones, in the same launch
    # A layout after the cp ones in the same launch builds its model with a config of its own: cp's
    # attention switch stayed on a shared config and every later layout failed ("not set up by apply_cp").
    _assert_matches(*res["tp2"], "tp2")
    # Recomputation re-runs the K/V gathers inside backward: same gradients, lower peak.
    m = _assert_matches(*res["cp2-ac"], "cp2-ac")
    assert m["recompute_peak_ratio"] < 1 and m["recompute_grad_error"] <= F32["grads"]
    # (a) cp rank 1's layer-0 mask ignores its chunk's offset: its queries attend to chunk 0's keys.
    # The attention kernel is no module: the first module with its output is the output projection.
    out, ctx = res["cp2-mask"]
    assert isinstance(out, CheckFailure), out
    assert "First diverging module: model.layers.0.self_attn.o_proj on rank(s) [1]" in str(out), out
    assert "logits differ on rank(s) [1]" in str(out)  # rank 0's chunk never sees the others' keys
    assert details_of(ctx)["first_diverging_module"] == "model.layers.0.self_attn.o_proj"
    # (b) the gather's backward keeps each rank's own queries' share only: forward right, the keys'
    # and values' projections get the wrong gradients.
    out, ctx = res["cp2-gather"]
    assert isinstance(out, CheckFailure), out
    assert "Every module's forward output agrees" in str(out), out
    assert "logits differ" not in str(out)
    worst = details_of(ctx)["worst_gradient"]
    assert worst.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight")), worst


@pytest.mark.slow
def test_cp_with_dp_and_tp_dense():
    ls = suite_with("llama-3.1-8b", configs=[{"cp": 2, "dp": 2}, {"cp": 2, "tp": 2}])
    for label in ("dp2xcp2", "tp2xcp2"):
        m = _assert_matches(*run_variant(ls, label), label)
        assert m["parallel_world_size"] == 4


@pytest.mark.slow
def test_cp_on_mla_moe_deepseek_v3():
    # MLA (K/V expanded from a latent per head) and routed experts: routers compared per batch slice.
    ls = suite_with("deepseek-v3", configs=[{"cp": 2}, {"cp": 2, "dp": 2}, {"cp": 2, "tp": 2}])
    for label in ("cp2", "dp2xcp2", "tp2xcp2"):
        out, ctx = run_variant(ls, label)
        m = _assert_matches(out, ctx, label)
        assert m["parallel_router_error"] <= F32["router"]


# --- where the attention supports it: refusals without a launch -------------------------------------


def _facts_of(config) -> ArchFacts:
    return ArchFacts(moe=False, num_layers=2, attention=cp.attention_facts(config))


def _day0(name: str):
    """A published config of the Day-0 corpus the repository ships (tests/data/day0, sources in its
    SOURCES.md): it once read a folder beside the checkout and skipped wherever that was missing (CI)."""
    from transformers import AutoConfig

    d = json.loads((ROOT / "tests" / "data" / "day0" / f"{name}.json").read_text())
    return AutoConfig.for_model(**d)


def test_refused_attention_kinds_name_their_cause():
    lay = Layout(cp=2)
    why = validate(lay, _facts_of(_day0("gpt-oss-120b")), heads=8, kv_heads=2, seq_lens=(8,))
    assert why and "attention sinks" in why
    why = validate(lay, _facts_of(_day0("Nemotron-3-Nano-30B-A3B-BF16")), heads=8, kv_heads=2, seq_lens=(8,))
    assert why and "linear_attention" in why and "moe" not in why
    why = validate(lay, _facts_of(_day0("Llama-4-Scout-17B-16E-Instruct")), heads=8, kv_heads=2, seq_lens=(8,))
    assert why and "chunked_attention" in why


def test_validate_cp_window_length_and_combinations():
    full = ArchFacts(moe=True, num_layers=2, num_experts=4,
                     attention={"layer_types": ["full_attention"], "sliding_window": None})
    kw = {"heads": 8, "kv_heads": 2, "batch_size": 4}
    assert validate(Layout(cp=2), full, seq_lens=(8,), **kw) is None
    assert validate(Layout(cp=2, dp=2), full, seq_lens=(8,), **kw) is None
    assert validate(Layout(cp=2, tp=2), full, seq_lens=(8,), **kw) is None
    assert "seq_len 9 does not split into 2" in validate(Layout(cp=2), full, seq_lens=(9,), **kw)
    win = ArchFacts(moe=False, num_layers=2, attention={"layer_types": ["full_attention"], "sliding_window": 4})
    assert "sliding_window 4" in validate(Layout(cp=2), win, seq_lens=(8,), **kw)
    assert validate(Layout(cp=2), win, seq_lens=(4,), **kw) is None  # a window no shorter than the sequence
    for lay in (Layout(cp=2, pp=2), Layout(cp=2, fsdp=2), Layout(cp=2, ep=2)):
        assert "context parallelism combines with dp and tp only" in validate(lay, full, seq_lens=(8,), **kw)


def test_sliding_window_suite_and_odd_seq_len_are_skipped_with_the_reason():
    ls = suite_with("qwen3-8b", configs=[{"cp": 2}])
    ls.suite.prune.overrides.update({"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 0})
    out, _ = run_variant(ls, "cp2")
    assert isinstance(out, NotApplicable) and "sliding" in str(out), out
    out, _ = run_variant(suite_with("llama-3.1-8b", seq_len=9, configs=[{"cp": 2}]), "cp2")
    assert isinstance(out, NotApplicable) and "seq_len 9 does not split into 2" in str(out), out
    assert not par._LAUNCHES  # refused before any launch


def test_chunk_losses_sum_to_the_reference_loss():
    import torch

    from harness.parallel.reference import lm_loss

    g = torch.Generator().manual_seed(0)
    logits, ids = torch.randn(3, 8, 11, generator=g), torch.randint(0, 11, (3, 8), generator=g)
    for size in (2, 4):
        parts = [cp.chunk_loss(cp.chunk(logits, size, c), ids, size, c) for c in range(size)]
        torch.testing.assert_close(sum(parts), lm_loss(logits, ids), rtol=1e-6, atol=0)
    assert cp.positions(8, 2, 1).tolist() == [[4, 5, 6, 7]]


def test_ref_piece_takes_the_ranks_sequence_chunk():
    import torch

    from harness.parallel.compare import ref_piece

    B, S = 4, 8
    ref = torch.arange(B * S * 6.0).reshape(B, S, 6)  # [B, S, .]: token (b, s) holds 6 (b S + s) + .
    lay = Layout(dp=2, cp=2)  # mesh (dp, cp): rank 3 = data slice 1, chunk 1
    torch.testing.assert_close(ref_piece(ref, (2, 4, 6), lay, 3), ref[2:4, 4:8])
    # Flattened token rows [B S, .] (experts, routers): the slice's sequences, this chunk of each.
    rows = ref_piece(ref.reshape(B * S, 6), (2 * 4, 6), lay, 3, tokens=(B, S))
    torch.testing.assert_close(rows, ref[2:4, 4:8].reshape(-1, 6))
    # MLA's latent [B, 1, S, .] along its sequence dimension, before tp's last-dimension shard.
    lat = ref.reshape(B, 1, S, 6)
    tp = Layout(tp=2, cp=2)  # mesh (cp, tp): rank 1 = chunk 0, tp shard 1; rank 2 = chunk 1, shard 0
    torch.testing.assert_close(ref_piece(lat, (4, 1, 4, 3), tp, 1, tokens=(B, S)), lat[:, :, :4, 3:])
    torch.testing.assert_close(ref_piece(lat, (4, 1, 4, 3), tp, 2, tokens=(B, S)), lat[:, :, 4:, :3])
