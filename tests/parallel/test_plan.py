"""``harness plan`` against public deployment facts, and its figures against ``harness inspect``."""

from __future__ import annotations

import json

import pytest

from harness.cli import main
from harness.inspect.params import inspect_params, load_target
from harness.parallel.plan import model_facts, parse_bytes, plan
from tests.parallel.helpers import ROOT

GiB = 2**30
L405 = str(ROOT / "suites" / "configs" / "Llama-3.1-405B.json")


@pytest.fixture(scope="module")
def deepseek():
    return model_facts(load_target("deepseek-v3", ROOT / "suites"))


@pytest.fixture(scope="module")
def llama405():
    return model_facts(load_target(L405, ROOT / "suites"))


def test_deepseek_v3_fp8_needs_more_than_8x80_and_fits_8x141(deepseek):
    assert deepseek.weight_format.startswith("fp8 block 128x128")
    assert not plan(deepseek, devices_per_node=8, nodes=1, device_memory=80 * GiB).ranked[0].fits
    rep = plan(deepseek, devices_per_node=8, nodes=1, device_memory=141 * GiB)
    best = rep.ranked[0]
    assert best.fits and best.layout.tp * best.layout.pp * best.layout.dp * best.layout.cp == 8
    assert rep.recommendation.startswith(best.layout.name + ": fits")


def test_llama_405b_bf16_needs_more_than_one_8x80_node(llama405):
    assert llama405.weight_format == "bfloat16" and 400e9 < llama405.total_params < 410e9
    one = plan(llama405, devices_per_node=8, nodes=1, device_memory=80 * GiB)
    assert not any(e.fits for e in one.ranked) and one.recommendation.startswith("no layout fits")
    two = plan(llama405, devices_per_node=8, nodes=2, device_memory=80 * GiB)
    assert two.ranked[0].fits and two.ranked[0].layout.tp <= 8  # tensor parallelism stays within a node


def test_llama_8b_bf16_fits_one_80gib_device_and_weights_match_inspect():
    target = load_target("llama-3.1-8b", ROOT / "suites")
    facts = model_facts(target)
    rep = plan(facts, devices_per_node=1, nodes=1, device_memory=80 * GiB)
    (only,) = rep.ranked
    assert only.fits and only.layout.name == "single"
    params, _ = inspect_params(target)
    assert only.weights == params.bytes["bfloat16"]["total"]  # same bytes as `harness inspect`
    train = plan(facts, devices_per_node=8, nodes=1, device_memory=80 * GiB, mode="training", batch=8,
                 context=4096)
    z3 = next(e for e in train.ranked if e.layout.dp == 8 and e.layout.zero == 3 and not e.layout.recompute)
    z0 = next(e for e in train.ranked if e.layout.dp == 8 and e.layout.zero == 0 and not e.layout.recompute)
    assert z3.optimizer == pytest.approx(z0.optimizer / 8) and z3.weights == pytest.approx(z0.weights / 8)
    rc = next(e for e in train.ranked if e.layout.dp == 8 and e.layout.zero == 3 and e.layout.recompute)
    assert rc.activations < z3.activations


def test_quantized_weight_bytes_match_inspect(deepseek):
    params, _ = inspect_params(load_target("deepseek-v3", ROOT / "suites"))
    total = params.bytes[deepseek.weight_format]["total"]
    assert sum(deepseek.weight_bytes.values()) + deepseek.buffer_bytes == pytest.approx(total, rel=1e-9)
    rep = plan(deepseek, devices_per_node=1, nodes=1, device_memory=2**50)
    single = next(e for e in rep.ranked if e.layout.name == "single")
    assert single.weights == pytest.approx(total, rel=1e-9)


def test_cli(capsys, tmp_path):
    assert main(["plan", "llama-3.1-8b", "--devices", "2", "--device-memory", "80GB", "--json", "-"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["layouts"][0]["fits"] and data["device_memory"] == 80 * 10**9
    assert main(["plan", "llama-3.1-8b", "--devices", "1", "--device-memory", "lots"]) == 2
    assert "not a memory size: 'lots'" in capsys.readouterr().err
    assert main(["plan", "no-such-suite", "--devices", "1", "--device-memory", "1GiB"]) == 2
    assert capsys.readouterr().err.startswith("harness plan: ")
    assert parse_bytes("141GiB") == 141 * GiB and parse_bytes("1.5T") == int(1.5 * 2**40)


def test_every_collective_pays_the_link_latency(llama405):
    """The alpha-beta model: each group's collectives per step cost the latency of the link they
    cross, beside their bytes; a layout without communication pays none."""
    from harness.parallel.plan import DDP_BUCKET_BYTES, Layout, estimate

    kw = dict(mode="training", batch=8, context=4096, device_memory=2**50, devices_per_node=8)
    layers = llama405.layers  # 126

    def comm(lay, **lat):
        return estimate(llama405, lay, **kw, **lat)

    single = comm(Layout(1, 1, 1, 1, 1, 0, False))
    assert single.comm_messages == 0 and single.comm_latency_s == 0 and single.comm_time_s == 0
    tp = Layout(8, 1, 1, 1, 1, 0, False)
    no_lat, lat = comm(tp, intra_latency=0.0), comm(tp, intra_latency=1e-3)
    # as the check's tp plan issues them: forward one per rowwise Linear (o_proj, down_proj), backward
    # one per colwise Linear's input gradient (q, k, v, gate, up): 7 a layer
    assert lat.comm_messages == layers * 7
    assert lat.comm_latency_s == pytest.approx(layers * 7 * 1e-3)
    assert lat.comm_time_s == pytest.approx(no_lat.comm_time_s + layers * 7 * 1e-3)
    # tp8 x pp2 on 8 devices a node: the pipeline's boundary spans the nodes, its sends and receives pay
    # the inter-node latency; the tensor-parallel group stays within a node, its 7 a layer repeated by
    # each of the 8 microbatches
    tp_pp = comm(Layout(8, 2, 1, 1, 1, 0, False), intra_latency=1e-3, inter_latency=1.0)
    assert tp_pp.comm_messages_by == {"tp": (layers // 2) * 7 * 8, "pp": 2 * 2 * 8}  # receive + send, 2 passes
    assert tp_pp.comm_latency_s == pytest.approx((layers // 2) * 7 * 8 * 1e-3 + 2 * 2 * 8 * 1.0)
    # data parallelism: DDP's buckets of 25 MiB; ZeRO-3 three per layer
    dp = comm(Layout(1, 1, 8, 1, 1, 0, False), intra_latency=1.0)
    assert dp.comm_messages == pytest.approx(-(-dp.gradients // DDP_BUCKET_BYTES))
    z3 = comm(Layout(1, 1, 8, 1, 1, 3, False), intra_latency=1.0)
    assert z3.comm_messages == 3 * layers
