"""harness plan --rehearse (harness.parallel.rehearse): the full-size model parallelized by the parallel
check's own steps at its world size on torch's fake process group, the meta device standing for memory."""

from __future__ import annotations

import dataclasses

import pytest

from harness.inspect.params import load_target
from harness.parallel import plan, rehearse
from harness.parallel.layouts import parse_name


@pytest.fixture(scope="module")
def dsv3():
    return load_target("deepseek-v3", "suites")


def test_divisibility_errors_are_named(dsv3):
    rep = rehearse.rehearse(dsv3, parse_name("ep7xpp64"), batch=64, context=128)
    assert "256 experts over ep=7: 4 left over" in rep.errors
    assert "61 layers over pp=64 stages: 3 stage(s) without a layer" in rep.errors
    assert not rep.ranks  # nothing is parallelized that cannot divide
    assert "divisibility error: 256 experts over ep=7" in rehearse.render(rep)


def test_samples_every_pipeline_stage_and_each_dimensions_last_rank():
    lay = parse_name("tp8xpp4xfsdp8")  # mesh pp, fsdp, tp: 256 ranks
    got = rehearse.sample_ranks(lay)
    assert {0, 64, 128, 192} <= set(got)  # every stage
    assert {7, 56, 255} <= set(got)  # last tp rank, last fsdp rank, the last rank
    assert len(got) <= rehearse.MAX_SAMPLED_RANKS


@pytest.fixture(scope="module")
def llama_tp2():
    # The real Llama-3.1-8B at tp2: two ranks that share the tp group, forward + backward on meta.
    return rehearse.rehearse(load_target("llama-3.1-8b", "suites"), parse_name("tp2"), batch=1, context=64)


def test_tp_ranks_issue_the_same_collectives(llama_tp2):
    assert [r.rank for r in llama_tp2.ranks] == [0, 1]
    for rr in llama_tp2.ranks:
        assert rr.recorded == "forward+backward", rr.recorded
        assert not rr.error
        # Megatron's two all-reduces per layer in forward (attention, MLP), two more in backward
        assert rr.summary().get("all_reduce:tp", 0) >= 4 * 32
        # 8B over tp2: the local shards, not the whole model (embedding and lm_head are not in the plan)
        assert 4e9 < rr.param_bytes < 12e9
    assert llama_tp2.hangs == []


def test_planted_extra_all_gather_is_a_named_hang(llama_tp2):
    ranks = [dataclasses.replace(r, collectives=list(r.collectives)) for r in llama_tp2.ranks]
    last = ranks[-1]
    extra = dataclasses.replace(last.collectives[-1], kind="all_gather")
    last.collectives.insert(len(last.collectives) // 2, extra)
    (hang,) = rehearse.order_mismatches(ranks)
    assert "predicted hang in group tp (2 ranks)" in hang
    assert "rank 1 issues all_gather(tp" in hang and "rank 0 issues all_reduce(tp" in hang


@pytest.fixture(scope="module")
def llama_pp2xfsdp2():
    # Ranks 0, 1 (stage 0, the two fsdp ranks) and 2 (stage 1): a pipeline link and an FSDP2 group,
    # each rank in a forked child of its own.
    return rehearse.rehearse(load_target("llama-3.1-8b", "suites"), parse_name("pp2xfsdp2"), batch=4, context=64,
                             ranks=[0, 1, 2])


def test_every_pipeline_stage_and_fsdp2_run_forward_and_backward_on_meta(llama_pp2xfsdp2):
    for rr in llama_pp2xfsdp2.ranks:
        assert rr.recorded == "forward+backward", (rr.rank, rr.recorded)  # stage 0 too (its grad buffers)
        got = rr.summary()
        # FSDP2's own all-gathers (forward and again in backward) and reduce-scatters, on meta
        assert got.get("all_gather:fsdp", 0) > got.get("reduce_scatter:fsdp", 0) > 0, got
        assert got.get("send:pp") and got.get("recv:pp"), got
        # 8B over pp2 x fsdp2: a quarter of the model per rank, not a gathered copy
        assert 3.4 * 2**30 < rr.param_bytes < 4.2 * 2**30, rr.param_bytes
    assert llama_pp2xfsdp2.hangs == []


def test_groups_resolve_to_this_worlds_ranks(llama_pp2xfsdp2):
    # Stage 1's collectives name its own fsdp group (2, 3): in one process the previous rank's
    # meshes leaked into it and its reductions showed as "0 ranks" on a destroyed group.
    stage1 = next(r for r in llama_pp2xfsdp2.ranks if r.rank == 2)
    assert {c.ranks for c in stage1.collectives if c.kind not in ("send", "recv")} == {(2, 3)}
    assert all(c.group != "0 ranks" for r in llama_pp2xfsdp2.ranks for c in r.collectives)
    assert {c.ranks for c in stage1.collectives if c.kind in ("send", "recv")} == {(0, 2), (2, 0)}


def test_missing_pipeline_send_is_a_named_hang(llama_pp2xfsdp2):
    ranks = [dataclasses.replace(r, collectives=list(r.collectives)) for r in llama_pp2xfsdp2.ranks]
    first = ranks[0]
    last_send = max(i for i, c in enumerate(first.collectives) if c.kind == "send")
    del first.collectives[last_send]
    (hang,) = rehearse.order_mismatches(ranks)
    assert hang.startswith("predicted hang on the pp link 0->2: collective #"), hang
    assert "rank 2 issues recv(pp" in hang and "rank 0 issues none" in hang


def test_plan_memory_matches_the_rehearsed_largest_stage(dsv3):
    # DeepSeek-V3 tp8 x pp8 x fsdp4 (256 ranks): the stage split_stage gives the most layers (the
    # last: 8 of 61 layers and lm_head) - the uniform model was 23 % under it (lm_head whole on every
    # tp rank, MLA's low-rank projections not split by tp, 8 layers where 61 / 8 were counted) - and
    # a middle stage (it computes no loss: the check's pipeline step once failed there).
    lay = parse_name("tp8xpp8xfsdp4")
    stage = rehearse.largest_stage(dsv3.model_config(False).config, lay)
    assert stage == lay.pp - 1
    per_stage = lay.world // lay.pp
    middle, rr = rehearse.rehearse(dsv3, lay, batch=8, context=64, ranks=[per_stage, stage * per_stage]).ranks
    assert middle.recorded == rr.recorded == "forward+backward", (middle.recorded, rr.recorded)
    facts = plan.model_facts(dsv3, "checkpoint", 64)
    est = plan.estimate(facts, plan.Layout(8, 8, 4, 1, 1, 3, False), mode="training", batch=8, context=64,
                        device_memory=2**40, devices_per_node=8)
    for planned, got in ((est.weights, rr.param_bytes), (est.gradients, rr.grad_bytes), (est.optimizer, rr.optim_bytes)):
        assert abs(planned - got) / got < 0.05, (planned / 2**30, got / 2**30)
    uniform = plan.estimate(dataclasses.replace(facts, layer_kinds=[], ends={}), plan.Layout(8, 8, 4, 1, 1, 3, False),
                            mode="training", batch=8, context=64, device_memory=2**40, devices_per_node=8)
    assert (rr.param_bytes - uniform.weights) / rr.param_bytes > 0.15  # what the stage facts correct


def test_plan_takes_the_cluster_from_the_suites_plan_table(capsys):
    from harness.cli import main

    # suites/deepseek-v3.toml [plan]: 32 nodes x 8 x 80 GiB, training: the plan's best layout at 256
    # ranks, rehearsed, with the plan's figures against the rehearsed largest rank.
    assert main(["plan", "deepseek-v3", "--batch", "256", "--context", "64", "--rehearse"]) == 0
    out = capsys.readouterr().out
    assert "at 256 ranks (fake process group, meta device)" in out
    lines = [x for x in out.splitlines() if x.startswith("  plan vs rehearsal") and "per device" in x]
    assert len(lines) == 3, out  # weights, gradients, optimizer state (the collective counts follow their own lines)
    for line in lines:  # "... 7.70 vs 7.71 GiB (-0.1%)"
        assert abs(float(line.rsplit("(", 1)[1].rstrip("%)"))) < 5, line
    # a config.json has no [plan]: the options it lacks are named
    assert main(["plan", "suites/configs/Llama-3.1-8B.json", "--device-memory", "80GiB"]) == 2
    assert "--devices not given, and suites/configs/Llama-3.1-8B.json has no [plan] table" in capsys.readouterr().err
