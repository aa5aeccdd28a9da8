"""The `weights` check through the pytest plugin: two suites in one run, one broken checkpoint."""

from __future__ import annotations

import json
import shutil
import xml.etree.ElementTree as ET

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.weights.conftest import write_suite

ONLY = "[checks.weights]\nvariants = [\"layout\"]\n"
DTYPES = 'dtypes = ["float32"]\nbackends = ["cpu"]\n'


def _cases(path):
    out = {}
    for tc in ET.parse(path).getroot().iter("testcase"):
        res = next((c for c in tc if c.tag in ("failure", "error", "skipped")), None)
        out[f'{tc.get("classname")}::{tc.get("name")}'] = (res.tag if res is not None else "passed", (res.get("message") or "") if res is not None else "")
    return out


@pytest.mark.slow  # one in-process pytest run over six suites (~25 s on 2 shared cores)
def test_broken_checkpoints_fail_alone_and_absent_ones_skip(pytester, kimi_ckpt, monkeypatch):
    from harness.weights.manifest import write_manifest

    root, raw, _ = kimi_ckpt
    d = pytester.path / "suites"
    good = pytester.path / "good"
    shutil.copytree(root, good)
    write_manifest(good)
    trunc = pytester.path / "trunc"
    shutil.copytree(good, trunc)
    shard = sorted(trunc.glob("model-*.safetensors"))[3]
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 8)
    flipped = pytester.path / "flipped"
    shutil.copytree(good, flipped)
    fshard = sorted(flipped.glob("model-*.safetensors"))[1]
    b = bytearray(fshard.read_bytes())
    b[-3] ^= 1
    fshard.write_bytes(bytes(b))
    missing = pytester.path / "missing"
    shutil.copytree(good, missing)
    idx = json.loads((missing / "model.safetensors.index.json").read_text())
    victim = "model.layers.3.mlp.experts.6.up_proj.weight"
    mshard = idx["weight_map"].pop(victim)
    sd = load_file(str(missing / mshard))
    del sd[victim]
    save_file(sd, str(missing / mshard), metadata={"format": "pt"})
    (missing / "model.safetensors.index.json").write_text(json.dumps(idx))
    write_manifest(missing)  # a consistent download of an incomplete export: the layout catches it
    for name, w in (("good", good), ("trunc", trunc), ("flipped", flipped), ("missing", missing)):
        write_suite(d, name, raw, f'weights = "../{w.name}"\n{ONLY}', top=DTYPES)
    write_suite(d, "absent", raw, f'weights = "$HARNESS_WEIGHTS_ABSENT"\n{ONLY}', top=DTYPES)
    write_suite(d, "random", raw, ONLY, top=DTYPES)  # no weights: no weights items at all
    monkeypatch.delenv("HARNESS_WEIGHTS_ABSENT", raising=False)
    pytester.makeini("[pytest]\naddopts = --harness-check=weights --harness-scope=nightly -p no:cacheprovider\n")
    r = pytester.runpytest("suites", "--harness-backend=cpu", "--junitxml=j.xml")
    cases = _cases(pytester.path / "j.xml")
    by_suite = {k.split("::")[0].split(".")[1]: v for k, v in cases.items()}
    assert set(by_suite) == {"good", "trunc", "flipped", "missing", "absent"}, r.stdout.str()
    assert by_suite["good"] == ("passed", ""), by_suite["good"]
    assert by_suite["trunc"][0] == "failure" and f"{shard.name}: truncated shard" in by_suite["trunc"][1]
    assert by_suite["flipped"][0] == "failure" and f"{fshard.name}: checksum mismatch" in by_suite["flipped"][1]
    assert by_suite["missing"][0] == "failure"
    assert f"1 missing, 0 unexpected, 0 mismatched; first: missing {victim}" in by_suite["missing"][1]
    assert by_suite["absent"] == ("skipped", "weights not available: $HARNESS_WEIGHTS_ABSENT is not set")


def _ctx(ls, variant, dtype="float32"):
    from harness.backends import get
    from harness.checks import CheckContext

    return CheckContext(ls, get("cpu"), dtype, variant, check="weights")


def test_stream_variant_passes_and_names_the_faulty_layer(kimi_ckpt, tmp_path):
    from harness.checks import CheckFailure, registry
    from harness.suite.loader import load_suite

    root, raw, _ = kimi_ckpt
    ls = load_suite(write_suite(tmp_path, "k", raw, f'weights = "{root}"\n[checks.weights]\nseq_len = 6\n'))
    check = registry().get("weights")
    ctx = _ctx(ls, "stream")
    check.run(ctx)
    props = dict(ctx.properties)
    assert float(props["metric.stream_layers"]) == 4 and float(props["metric.stream_first_divergent_layer"]) == -1
    assert float(props["metric.stream_worst_rel_rmse"]) < 1e-5
    assert float(props["metric.stream_devices"]) == 1

    def fault(model):  # the target's layer 2 attention output projection is off by 2 %
        with torch.no_grad():
            model.model.layers[2].self_attn.o_proj.weight.mul_(1.02)

    with pytest.raises(CheckFailure, match="decoder layer 2 diverges from the float64 reference") as e:
        check.run(_ctx(ls, "stream"), transform=fault)
    assert e.value.details.splitlines()[3].split()[-1] == "DIVERGES"


def test_stream_variant_skips_when_the_model_does_not_fit(kimi_ckpt, tmp_path):
    from harness.checks import NotApplicable, registry
    from harness.suite.loader import load_suite

    root, raw, _ = kimi_ckpt
    ls = load_suite(write_suite(tmp_path, "k", raw, f'weights = "{root}"\n[checks.weights]\nmemory_fraction = 1e-9\n'))
    with pytest.raises(NotApplicable, match=r"does not fit: the embeddings and head alone need .* GiB, cpu has 0.0 GiB "
                       r"usable \(memory_fraction 1e-09 of each device's free memory on cpu\)"):
        registry().get("weights").run(_ctx(ls, "stream"))


def test_stream_variant_follows_the_targets_routing_and_names_a_wrong_top_k(kimi_ckpt, tmp_path):
    """The reference follows the target's routing (near-tie flips counted, not failed); a target router that
    picks the lowest-scoring experts fails at its layer, named as a routing fault, not as a numeric drift."""
    from harness.checks import CheckFailure, registry
    from harness.suite.loader import load_suite

    root, raw, _ = kimi_ckpt
    ls = load_suite(write_suite(tmp_path, "k", raw, f'weights = "{root}"\n[checks.weights]\nseq_len = 6\n'))
    check = registry().get("weights")
    ctx = _ctx(ls, "stream", "bfloat16")
    check.run(ctx)
    props = dict(ctx.properties)
    assert float(props["metric.stream_near_tie_flips"]) >= 0 and float(props["metric.stream_first_divergent_layer"]) == -1

    def wrong_top_k(model):  # layer 2's router: the k lowest-scoring experts for every token
        def hook(_m, _a, out):
            logits, weights, idx = out
            return logits, weights, logits.float().argsort(-1)[:, : idx.shape[-1]].to(idx.dtype)
        model.model.layers[2].mlp.gate.register_forward_hook(hook)

    with pytest.raises(CheckFailure, match=r"decoder layer 2: router mlp.gate: \d+ token\(s\) routed to other experts "
                                           r"than the float64 reference at a wide margin") as e:
        check.run(_ctx(ls, "stream", "bfloat16"), transform=wrong_top_k)
    assert "ROUTING" in e.value.details


def test_stream_variant_names_a_router_whose_logits_are_off(kimi_ckpt, tmp_path):
    """A router computing its logits 10 % too large: its own noise is not taken as the near-tie allowance
    (its logit error is beyond the layer tolerance: a note), so the experts it chose otherwise are a routing
    fault at its layer."""
    from harness.checks import CheckFailure, registry
    from harness.suite.loader import load_suite

    root, raw, _ = kimi_ckpt
    ls = load_suite(write_suite(tmp_path, "k", raw, f'weights = "{root}"\n[checks.weights]\nseq_len = 6\n'))

    def scaled_router(model):
        with torch.no_grad():
            model.model.layers[1].mlp.gate.weight.mul_(1.1)

    ctx = _ctx(ls, "stream", "bfloat16")
    with pytest.raises(CheckFailure, match=r"decoder layer 1: router mlp.gate: \d+ token\(s\) routed to other experts"):
        registry().get("weights").run(ctx, transform=scaled_router)
    assert any("router mlp.gate: logits differ from the float64 router's" in n for n in ctx.notes), ctx.notes
