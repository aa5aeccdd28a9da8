"""Perf regressions that say where (issue #30 items 2 and 3): a slowed operator registered at the
dispatcher, a slowed module and a module that keeps extra copies of its output, each on the real tiny
model against a baseline taken by `harness baseline update`, each named in the verdict."""

from __future__ import annotations

import json
import time

import pytest
import torch
from checks.test_perf import PERF

from harness.backends import get
from harness.checks import CheckContext, CheckFailure, registry
from harness.cli import main
from harness.perf.profile import explain, pattern, profile_phase
from harness.suite.loader import load_suite
from tests_support import TINY_PRUNE


def _busy(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def _run(ls, tmp, transform=None):
    ctx = CheckContext(ls, get("cpu"), "float32", "b1-s8", check="perf")
    registry().get("perf").run(ctx, results_dir=tmp / "results", golden_root=tmp / "golden", transform=transform)
    return ctx


@pytest.fixture(scope="module")
def baselined(tmp_path_factory):
    """The tiny perf suite with a baseline of one clean run (profile included)."""
    tmp = tmp_path_factory.mktemp("perf")
    (tmp / "configs").mkdir()
    from tests_support import REPO_SUITES

    (tmp / "configs" / "Llama-3.1-8B.json").write_bytes((REPO_SUITES / "configs" / "Llama-3.1-8B.json").read_bytes())
    (tmp / "tiny.toml").write_text(PERF.format(prune=TINY_PRUNE))
    ls = load_suite(tmp / "tiny.toml")
    ctx = _run(ls, tmp)
    side = json.loads(open(dict(ctx.properties)["harness.detail.perf_samples"]).read())
    assert set(side["profile"]) == {"prefill", "decode", "train"}
    assert main(["baseline", "update", str(tmp / "results"), "--golden-dir", str(tmp / "golden")]) == 0
    base = json.loads(next((tmp / "golden" / "perf" / "tiny").glob("*.json")).read_text())
    assert base["items"]["cpu-float32-b1-s8"]["profile"]["prefill"]["ops"]  # stored with the baseline
    return ls, tmp


def test_profile_of_a_phase_attributes_operators_to_modules():
    ls = load_suite(__import__("tests_support").REPO_SUITES / "llama-3.1-8b.toml")
    from harness.models.build import build_model, seeded_tokens

    model, _ = build_model(ls, "float32", "cpu", seed=0)
    ids = seeded_tokens(model.config.vocab_size, 1, 8, 1)
    p = profile_phase(lambda: model(ids), model, get("cpu"), repeats=2)
    assert p["repeats"] == 2 and p["total_us"] > 0
    assert "aten::mm" in p["ops"] or "aten::addmm" in p["ops"]
    assert "model.layers.*.mlp" in p["modules"] and "model.layers.*.self_attn" in p["modules"]
    mm = p["op_modules"].get("aten::mm") or p["op_modules"]["aten::addmm"]
    assert any(m.startswith("model.layers.*.") or m == "lm_head" for m in mm)
    assert p["memory"]["peak_bytes"] > 0 and "lm_head" in p["memory"]["at_peak"]  # the logits [1, 8, vocab]
    assert pattern("model.layers.12.mlp.experts.3") == "model.layers.*.mlp.experts.*"
    assert explain(p, p)["ops"][0]["delta_us"] == pytest.approx(0)


def test_a_slow_operator_registered_at_the_dispatcher_is_named(baselined):
    """aten::rsqrt (every RMSNorm) replaced at the dispatcher's CPU key by a correct but slow kernel:
    the confirmed prefill regression names aten::rsqrt and the norm modules it runs in."""
    ls, tmp = baselined
    lib = torch.library.Library("aten", "IMPL")

    def slow_rsqrt(x):
        _busy(0.001)
        return 1.0 / torch.sqrt(x)

    lib.impl("rsqrt", slow_rsqrt, "CPU")
    try:
        with pytest.raises(CheckFailure) as e:
            _run(ls, tmp)
    finally:
        lib._destroy()
    msg, details = e.value.message, e.value.details
    # attributed to one of the norms it runs in (input/post-attention layernorm, the final norm)
    assert "where: aten::rsqrt +" in msg and "norm)" in msg.split("where:")[1].split(";")[0], msg
    assert "aten::rsqrt" in details and "share before -> after" in details
    assert details.index("aten::rsqrt") < details.index("module (forward, own time)")  # the top operator


def test_a_slow_module_is_named(baselined):
    """The first decoder layer's MLP spends extra time in Python after its forward (no operator of
    its own grows): the verdict names the module."""
    ls, tmp = baselined

    def slow_mlp(model):
        model.model.layers[0].mlp.register_forward_hook(lambda *_: _busy(0.003))

    with pytest.raises(CheckFailure) as e:
        _run(ls, tmp, transform=slow_mlp)
    assert "module model.layers.*.mlp +" in e.value.message, e.value.message
    assert "model.layers.*.mlp" in e.value.details


def test_a_module_keeping_copies_of_its_output_is_a_memory_regression_named_by_module(baselined):
    """Timing unchanged within the threshold, but the MLP holds four extra copies of its output until its
    next call: the tensor-memory peak grows and the failure names the module holding the bytes."""
    ls, tmp = baselined

    def hoard(model):
        mlp = model.model.layers[0].mlp

        def keep(mod, _args, out):
            mod.kept = [out.detach().clone() for _ in range(4)]

        mlp.register_forward_hook(keep)

    with pytest.raises(CheckFailure) as e:
        _run(ls, tmp, transform=hoard)
    assert "tensor-memory peak grew" in e.value.message and "model.layers.*.mlp holds" in e.value.message, \
        e.value.message
    assert e.value.metric.endswith("_tensor_peak_bytes")
    # in the verdict the comparator reads, as a regression of that metric: filed as a performance finding
    rec = json.loads((tmp / "results" / "perf" / "tiny" / "cpu-float32-b1-s8.json").read_text())
    entry = rec["verdict"]["metrics"][e.value.metric]
    assert entry["verdict"] == "regression" and "model.layers.*.mlp holds" in entry["why"]
