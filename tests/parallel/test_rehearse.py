"""harness plan --rehearse (harness.parallel.rehearse): the full-size model parallelized by the parallel
check's own steps at its world size on torch's fake process group, the meta device standing for memory."""

from __future__ import annotations

import dataclasses

import pytest

from harness.inspect.params import load_target
from harness.parallel import rehearse
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
