"""The rehearsal (harness.parallel.rehearse) on the Day-0 corpus's hard cases: a multimodal wrapper
(Kimi-K2.5: its language decoder split, the vision tower on the first stage), weights held as the
checkpoint stores them (INT4 / FP8 / NVFP4 against the plan's figures), and GLM-5's DSA layers that hand
their top-k keys to the next layer (a pipeline stand-in layer passes them on; a cut before a "shared"
layer is named)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from harness.inspect.params import StoredBytes, Target, count_parameters, load_target, meta_model
from harness.parallel import cp, plan, rehearse
from harness.parallel.layouts import parse_name

DAY0 = Path(__file__).resolve().parents[1] / "data" / "day0"


def test_kimi_k25_wrapper_rehearses_its_decoder_and_each_stage_holds_the_plans_int4_weights_within_5_percent():
    # Before: every rank failed in split_stage ("'Kimi_K25Model' object has no attribute 'layers'") and the
    # plan fell back to its uniform model. INT4 experts beside bf16 attention; the first stage also holds the
    # vision tower, the last the lm_head. tp8 x pp8, its first and last rank.
    target = load_target(DAY0 / "Kimi-K2.5.json")
    lay = parse_name("tp8xpp8")
    rep = rehearse.rehearse(target, lay, batch=lay.microbatches, context=64, ranks=[0, 63])
    assert not rep.failed, rehearse.render(rep)
    assert any("its language decoder DeepseekV3ForCausalLM is what the layout splits" in n for n in rep.notes)
    assert [r.recorded for r in rep.ranks] == ["forward+backward"] * 2, rehearse.render(rep)
    m = plan.model_facts(target, "checkpoint", 64)
    assert m.weight_format.startswith("int4")
    predicted = plan.stage_bytes(m.weight_bytes, plan.Layout(8, 8, 1, 1, 1, 0, False), m)
    for rr, stage in zip(rep.ranks, (0, 7), strict=True):
        assert rr.stored_bytes < 0.5 * rr.param_bytes  # INT4 experts: stored well below the bf16 build
        err = (predicted[stage] + m.buffer_bytes - rr.stored_bytes) / rr.stored_bytes
        assert abs(err) < 0.05, (stage, err, predicted[stage], rr.stored_bytes)
    vision = sum(plan.language_decoder(target).extra.values())
    assert vision > 1e8 and rep.ranks[0].param_bytes - 2 * vision > 0  # the vision tower on stage 0 only


@pytest.mark.parametrize("config", ["Kimi-K2.5.json", "DeepSeek-V4-Flash-NVFP4-FP8.json", "Laguna-XS.2-FP8.json"])
def test_stored_bytes_of_the_whole_model_are_inspects_checkpoint_bytes(config):
    # The rehearsal sums StoredBytes over each rank's shards; over the unsplit model it must be exactly
    # what inspect says the checkpoint weighs (INT4 groups, mixed NVFP4 + FP8, FP8 blocks), buffers aside.
    target = load_target(DAY0 / config)
    model, mc = meta_model(target, pruned=False, dtype=torch.bfloat16)
    sb = StoredBytes(model, mc)
    got = sum(sb.of(n, p) for n, p in model.named_parameters())
    rep = count_parameters(model, mc)
    (label,) = [k for k in rep.bytes if k not in ("float32", "bfloat16")]
    scenario = rep.bytes[label]
    assert got == scenario["total"] - scenario["float32 (buffers)"]
    assert sum(rep.stored_by_kind.values()) == got
    assert got < 0.75 * rep.bytes["bfloat16"]["bfloat16"]  # quantized, not the bf16 build
    # a shard: a tp-split [out / 8, in] slice of a quantized weight (or fused experts' [E / 8, ...] under ep)
    # stores an eighth of its weights
    name, p = next((n, p) for n, p in model.named_parameters() if n in sb.by_name)
    shard = torch.empty(p.shape[0] // 8, *p.shape[1:], dtype=p.dtype, device="meta")
    assert sb.of(name, shard) < sb.of(name, p) / 4


def _glm5(tmp_path, **changes) -> Target:
    raw = json.loads((DAY0 / "GLM-5.json").read_text())
    raw.update(changes)
    path = tmp_path / "GLM-5.json"
    path.write_text(json.dumps(raw))
    return load_target(path)


def test_glm5_dsa_stages_run_forward_and_backward_and_a_cut_before_a_shared_layer_is_named(tmp_path):
    # GLM-5's decoder layers return (hidden, topk_indices), handed on as the next layer's prev_topk_indices;
    # the stand-in for another stage's layer returned the hidden states alone ("not enough values to
    # unpack"), so no stage ran its forward.
    lay = parse_name("pp32")  # 78 layers: stages of 2-3 layers, rank 0 and the last
    rep = rehearse.rehearse(_glm5(tmp_path), lay, batch=32, context=64, ranks=[0, 31])
    assert not rep.failed, rehearse.render(rep)
    assert [r.recorded for r in rep.ranks] == ["forward+backward"] * 2, rehearse.render(rep)
    # Planted: layer 2 (stage 1's first) reuses layer 1's top-k: the cut separates it from its indexer.
    kinds = ["full"] * 78
    kinds[2] = "shared"
    rep = rehearse.rehearse(_glm5(tmp_path, indexer_types=kinds), lay, batch=32, context=64, ranks=[])
    assert rep.errors == ["pipeline stage 1 starts at layer 2, a 'shared' DSA layer: its top-k keys come from "
                          "layer 1's indexer on stage 0, and a stage sends its neighbour hidden states only "
                          "(indexer_types; cut the stages at a 'full' layer)"], rep.errors


@pytest.mark.parametrize("config", ["GLM-5.json", "DeepSeek-V3.2.json"])
def test_context_parallelism_refuses_a_dsa_indexer_in_one_line(config):
    # The indexer reads attention_mask[:, 0]; cp builds its mask inside the attention call, so the model
    # has none to give (GLM-5's ranks stopped in forward at "'NoneType' object is not subscriptable").
    cfg = load_target(DAY0 / config).model_config(False).config
    why = cp.refusal(cp.attention_facts(cfg), 2, (64,))
    assert why is not None and why.startswith("context parallelism does not support sparse attention's indexer "
                                              "(DSA, index_topk 2048"), why
    dense = dict(cp.attention_facts(cfg), indexer_topk=None)
    assert "indexer" not in (cp.refusal(dense, 2, (64,)) or "")


def test_the_plans_collective_count_is_what_the_rehearsed_rank_issues():
    # The plan counted "two tp all-reduces per layer and pass" (128 a step for Llama-3.1-8B at tp2); the
    # check's steps issue 2 forward (rowwise), 5 backward (each colwise input's gradient): 224. It now
    # counts by the tp plan's own styles, and the rehearsal holds it to what the rank issued.
    target = load_target("llama-3.1-8b", "suites")
    lay = parse_name("tp2")
    rep = rehearse.rehearse(target, lay, batch=1, context=64, ranks=[1])
    m = plan.model_facts(target, "checkpoint", 64)
    est = plan.estimate(m, plan.Layout(2, 1, 1, 1, 1, 0, False), mode="training", batch=1, context=64,
                        device_memory=80 * 2**30, devices_per_node=8)
    rep.plan_messages, rep.training = est.comm_messages_by, True
    assert est.comm_messages_by["tp"] == 32 * (2 + 5)
    assert rehearse.rehearsed_messages(rep, rep.ranks[0]) == {"tp": 224.0}
    assert "plan vs rehearsal, tp collectives per step (busiest rank): 224 vs 224 (+0.0%)" in rehearse.render(rep)


@pytest.mark.parametrize(("config", "layout", "rank"), [
    # its tp plan splits the fused experts only ("the tensor-parallel plan matches no Linear layer" before)
    ("DeepSeek-V4-Flash.json", "tp2", 0),
    # the base model's loop reads block_type off every layer, the stand-ins for other stages' too
    ("Nemotron-3-Nano-30B-A3B-BF16.json", "pp8", 7),
])
def test_day0_architectures_parallelize_and_run_a_step(config, layout, rank):
    lay = parse_name(layout)
    rep = rehearse.rehearse(load_target(DAY0 / config), lay, batch=lay.microbatches, context=64, ranks=[rank])
    (rr,) = rep.ranks
    assert not rr.error and rr.recorded == "forward+backward", rehearse.render(rep)
