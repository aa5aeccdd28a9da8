"""The nightly rehearse check (issue #48 item 4): the plan's top layout for a suite's [plan] cluster,
rehearsed at its world size (meta device, fake process group), through the same functions as
`harness plan SUITE --rehearse`; findings fail the item by name."""

from __future__ import annotations

import dataclasses
import json

import pytest

from harness.backends import get
from harness.checks import CheckContext, CheckFailure, CouldNotRun, NotApplicable, registry
from harness.suite.loader import SuiteError, load_suite

# A small model of Llama's architecture (its real config, narrower and 4 layers deep): every rank of
# its rehearsal builds and runs in well under a second, where the planted faults need a real run.
SMALL = {"num_hidden_layers": 4, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 8,
         "num_key_value_heads": 4, "vocab_size": 1024}


def _run(ls, backend="cpu", dtype=None, **options):
    ctx = CheckContext(ls, get(backend), dtype or ls.suite.dtypes[0], None, check="rehearse")
    registry().get("rehearse").run(ctx, **options)
    return ctx


def _small_suite(write_suite, suite_dir, plan="devices = 4", checks='layout = "tp2xpp2"\ncontext = 64\nbatch = 2'):
    cfg = json.loads((suite_dir / "configs" / "Llama-3.1-8B.json").read_text()) | SMALL
    (suite_dir / "configs" / "small.json").write_text(json.dumps(cfg))
    return load_suite(write_suite("small", f'[model]\nconfig = "configs/small.json"\n\n'
                                           f"[plan]\n{plan}\ndevice_memory_gib = 80\n\n[checks.rehearse]\n{checks}\n"))


def test_a_bundled_suites_plan_rehearses_clean_and_records_its_metrics():
    # DeepSeek-V3's [plan]: 32 nodes x 8 x 80 GiB, training; the plan's top layout has a pipeline
    # (tp8xpp32 today) over 256 ranks. The fastest bundled suite with pp or ep (measured, docs/parallel.md).
    ls = load_suite("suites/deepseek-v3.toml")
    assert registry().get("rehearse").scope(ls, None) == "nightly"
    ctx = _run(ls)
    p = dict(ctx.properties)
    assert "pp" in p["harness.detail.rehearse_layout"], p
    assert "at 256 ranks (fake process group" in p["harness.detail.rehearsal"]
    assert "no divisibility error, no collective-order mismatch" in p["harness.detail.rehearsal"]
    assert float(p["metric.rehearse_ranks"]) >= 4  # rank 0, the last tp rank, the last stage, the last rank
    assert float(p["metric.rehearse_s"]) > 0
    assert float(p["metric.rehearse_collectives"]) > 0
    assert 1 < float(p["metric.rehearse_param_gib"]) < 80  # a shard of 671B, not the whole model
    assert float(p["metric.rehearse_plan_memory_error"]) < 0.05  # the plan's figures within 5 %


def test_other_items_and_a_suite_without_plan_are_not_applicable(write_suite, suite_dir):
    ls = load_suite("suites/deepseek-v3.toml")
    for backend, dtype in (("cpu", ls.suite.dtypes[1]), ("cuda", ls.suite.dtypes[0])):
        with pytest.raises(NotApplicable, match=rf"once per suite, in its cpu-{ls.suite.dtypes[0]} item") as e:
            _run(ls, backend, dtype)
        assert "\n" not in str(e.value)
    bare = load_suite(write_suite("bare", '[model]\nconfig = "configs/Llama-3.1-8B.json"\n'))
    with pytest.raises(NotApplicable, match=r"no \[plan\] table"):
        _run(bare)


def test_a_layout_that_does_not_divide_the_model_fails_naming_it(write_suite, suite_dir):
    # Mixtral's 8 experts over ep=6: named before any rank is built.
    (suite_dir / "mixtral.toml").write_text('[model]\nconfig = "configs/Mixtral-8x7B-v0.1.json"\n\n[plan]\n'
                                            'devices = 6\ndevice_memory_gib = 80\n\n[checks.rehearse]\n'
                                            'layout = "ep6"\nbatch = 6\n')
    with pytest.raises(CheckFailure) as e:
        _run(load_suite(suite_dir / "mixtral.toml"))
    assert str(e.value) == "divisibility error in ep6 at 6 ranks: 8 experts over ep=6: 2 left over"
    # a layout of another world size than the cluster's is the suite's mistake: could not run, naming both
    with pytest.raises(CouldNotRun, match="tp2xpp2 has 4 ranks, the cluster 8"):
        _run(_small_suite(write_suite, suite_dir, plan="devices = 8"))
    with pytest.raises(SuiteError, match="not a layout name: 'tp2y'"):
        _small_suite(write_suite, suite_dir, checks='layout = "tp2y"')


def _extra_all_gather(rank, rr):
    """Rank 1 (tp1 of stage 0) issues one all-gather more on its tp group than rank 0."""
    if rank == 1:
        tp = [i for i, c in enumerate(rr.collectives) if c.group == "tp"]
        rr.collectives.insert(tp[len(tp) // 2], dataclasses.replace(rr.collectives[tp[0]], kind="all_gather"))


def test_a_planted_collective_order_mismatch_fails_naming_the_hang(write_suite, suite_dir):
    ls = _small_suite(write_suite, suite_dir)
    with pytest.raises(CheckFailure) as e:
        _run(ls, fault=_extra_all_gather)
    msg = str(e.value)
    assert msg.startswith("predicted hang in group tp (2 ranks): collective #"), msg
    assert "rank 1 issues all_gather(tp" in msg and "rank 0 issues all_reduce(tp" in msg
    assert msg.endswith("(tp2xpp2 at 4 ranks)") and "\n" not in msg
    assert "predicted hang" in e.value.details and "rehearsal of small tp2xpp2" in e.value.details
    # the same suite without the fault: clean (the hang is the planted collective, nothing else)
    assert float(dict(_run(ls).properties)["metric.rehearse_ranks"]) == 4


def test_a_rank_that_fails_to_parallelize_is_named_with_its_coordinates(write_suite, suite_dir):
    def fail_last_stage(rank, rr):
        if rank == 3:
            rr.error = "parallelize: ValueError: planted"

    with pytest.raises(CheckFailure) as e:
        _run(_small_suite(write_suite, suite_dir), fault=fail_last_stage)
    assert str(e.value) == "rank 3 [pp1 tp1] of tp2xpp2 at 4 ranks failed to parallelize: ValueError: planted"
