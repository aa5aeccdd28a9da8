"""The weights check on the test device (issue #28): a real safetensors checkpoint (transformers'
``save_pretrained``, several shards) whose full model is streamed on ``hdev`` against the host's
float64 recomputation layer by layer, and a wrong kernel on the device's dispatch key named at its layer. (The layout variant
reads headers only and runs once per suite, on cpu.)"""

from __future__ import annotations

import json

import torch
from testdev_support import ROOT, run_items

from harness.models.config import architecture_class, build_config

# Llama-3.1-8B's published config, narrowed: the stream variant runs it whole
SMALL = dict(num_hidden_layers=3, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, vocab_size=256, bos_token_id=0, eos_token_id=1, torch_dtype="float32")


def _checkpoint(root):
    raw = json.loads((ROOT / "suites" / "configs" / "Llama-3.1-8B.json").read_text())
    raw.update(SMALL)
    mc = build_config(raw)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = architecture_class(mc.architecture)(mc.config)
    ckpt = root / "ckpt"
    model.save_pretrained(ckpt, max_shard_size="100KB")
    (ckpt / "config.json").write_text(json.dumps(raw))
    (root / "small.json").write_text(json.dumps(raw))
    (root / "small.toml").write_text(f'backends = ["testdev"]\ndtypes = ["float32"]\n[model]\nconfig = "small.json"\n'
                                     f'weights = "{ckpt}"\n[checks.weights]\nseq_len = 6\n')
    return root / "small.toml", ckpt


def _weights(env, suite, results):
    items = run_items(env, results, str(suite), "--backend", "testdev", "--check", "weights", "--scope", "nightly")
    return {v: i for (b, c, v), i in items.items() if c == "weights"}


# its device-free half (the placement's mem_get_info) is in tests/weights/test_place.py
def test_weights_stream_on_the_device_passes_and_names_a_wrong_kernels_layer(env, tmp_path):
    suite, ckpt = _checkpoint(tmp_path)
    got = _weights(env, suite, tmp_path / "clean")
    assert set(got) == {"layout", "stream"}, got
    # the layout reads headers only, once per suite (on cpu): on another backend it says so
    assert got["layout"]["outcome"] == "skipped" and "once per suite (cpu" in got["layout"]["message"], got["layout"]
    assert got["stream"]["outcome"] == "passed", got["stream"]["message"]
    stream = got["stream"]["props"]
    assert stream["harness.device"].startswith("hdev"), stream
    assert float(stream["metric.stream_layers"]) == 3 and float(stream["metric.stream_first_divergent_layer"]) == -1

    # a wrong activation kernel on the device's own dispatch key (harness certify's activation-slope,
    # installed by the item's worker): the stream names the first decoder layer
    fault = dict(env, HARNESS_CERTIFY_FAULT="activation-slope", HARNESS_CERTIFY_BACKEND="testdev")
    s = _weights(fault, suite, tmp_path / "fault")["stream"]
    assert s["outcome"] == "failed" and "decoder layer 0 diverges" in s["message"], s["message"]
