"""The streamed float64 reference: per-layer errors equal an in-memory float64 reference's, a fault is
localized to its layer, only routed experts are read, and host memory stays near one layer."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from harness.models.build import build_model
from harness.precision.compare import tensor_metrics
from harness.precision.stream import capture_layers, float64_rotary, stream_reference
from harness.suite.loader import load_suite
from harness.weights.layout import open_checkpoint
from tests.weights.conftest import make_model, save_checkpoint, small_config, write_suite


def llama_like(layers: int, hidden: int, inter: int) -> dict:
    return small_config("Llama-3.1-8B.json", num_hidden_layers=layers, hidden_size=hidden, intermediate_size=inter,
                        num_attention_heads=4, num_key_value_heads=2, vocab_size=128, bos_token_id=0,
                        eos_token_id=1, torch_dtype="float32")


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    """24 decoder layers of width 32, saved in shards."""
    raw = llama_like(24, 32, 64)
    model = make_model(raw, seed=5)
    root = save_checkpoint(model, raw, tmp_path_factory.mktemp("deep") / "ckpt", shard="100KB")
    return root, raw, model


def _meta(raw):
    from harness.models.build import architecture_class
    from harness.models.config import build_config

    mc = build_config(raw)
    with torch.device("meta"):
        return architecture_class(mc.architecture)(mc.config)


def in_memory_reference(model64, captured):
    """Every layer of the whole float64 model, fed the target's input to it."""
    rot = model64.model.rotary_emb
    out = []
    for layer, io in zip(model64.model.layers, captured, strict=True):
        kw = {k: v for k, v in io.kwargs.items() if k != "position_embeddings"}
        x = io.hidden_in.double()
        kw["position_embeddings"] = tuple(t.double() for t in rot(x, io.kwargs["position_ids"]))
        with torch.no_grad():
            out.append(tensor_metrics(io.hidden_out, layer(x, **kw)))
    return out


def test_streamed_reference_equals_in_memory_and_localizes_a_fault(deep, tmp_path):
    root, raw, target = deep
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    captured = capture_layers(target, ids)
    assert len(captured) == 24
    meta = _meta(raw)
    rep = stream_reference(meta, open_checkpoint(root), captured, tol=1e-4, rotary=float64_rotary(meta))
    model64, _ = build_model(load_suite(write_suite(tmp_path, "d", raw, f'weights = "{root}"\n')), "float64")
    mem = in_memory_reference(model64.eval(), captured)
    for r, m in zip(rep.layers, mem, strict=True):
        assert r.metrics == m, r.layer  # the same float64 numbers, streamed or not
    assert rep.first_divergent is None and 0 < max(r.metrics["rel_rmse"] for r in rep.layers) < 1e-5

    # A fault in layer 13 of the target: layer 13 diverges, every other layer (fed the target's own
    # input) still matches, so the report points at 13 and not at everything after it.
    with torch.no_grad():
        target.model.layers[13].mlp.down_proj.weight.mul_(1.01)
    try:
        faulty = capture_layers(target, ids)
    finally:
        with torch.no_grad():
            target.model.layers[13].mlp.down_proj.weight.div_(1.01)
    rep2 = stream_reference(meta, open_checkpoint(root), faulty, tol=1e-4, rotary=float64_rotary(meta))
    assert rep2.first_divergent == 13
    assert [r.layer for r in rep2.layers if not r.ok] == [13]
    assert "DIVERGES" in rep2.render().splitlines()[14]


def test_moe_layers_read_only_the_routed_experts(kimi_ckpt):
    root, raw, full = kimi_ckpt
    ids = torch.randint(0, 512, (1, 3), generator=torch.Generator().manual_seed(1))  # 3 tokens x top-2
    captured = capture_layers(full, ids)
    meta = _meta(raw)
    ck = open_checkpoint(root)
    rep = stream_reference(meta, ck, captured, tol=1e-4, rotary=float64_rotary(meta))
    assert rep.first_divergent is None
    expert_bytes = 3 * 64 * 32 * 4  # gate, up, down of one expert, float32
    for r in rep.layers[1:]:  # MoE layers: at most 3 tokens x 2 experts of 8 were routed
        assert r.experts_read is not None and r.experts_read <= 6
        layer_keys = [k for k in ck.tensors if k.startswith(f"model.layers.{r.layer}.")]
        all_bytes = sum(ck.tensors[k].nbytes for k in layer_keys)
        assert r.bytes_read <= all_bytes - (8 - r.experts_read) * expert_bytes


MEASURE = textwrap.dedent("""
    import json, sys, torch
    from pathlib import Path
    from safetensors.torch import load_file
    from harness.models.build import architecture_class
    from harness.models.config import build_config
    from harness.weights.layout import open_checkpoint
    from harness.precision.stream import LayerIO, float64_rotary, stream_reference

    root, cap = Path(sys.argv[1]), load_file(sys.argv[2])
    raw = json.loads((root / "config.json").read_text())
    mc = build_config(raw)
    with torch.device("meta"):
        meta = architecture_class(mc.architecture)(mc.config)
    n = raw["num_hidden_layers"]
    captured = [LayerIO(cap[f"in.{i}"], {"position_ids": cap["pos"]}, cap[f"out.{i}"]) for i in range(n)]
    rot, ck = float64_rotary(meta), open_checkpoint(root)

    def status(key):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key):
                return int(line.split()[1]) * 1024

    stream_reference(meta, ck, captured[:2], 1e-4, rot)   # warm up: kernels' code pages, allocator arenas
    import gc; gc.collect()
    Path("/proc/self/clear_refs").write_text("5")         # reset the peak RSS (VmHWM) to the current RSS
    base = status("VmRSS:")
    rep = stream_reference(meta, ck, captured, 1e-4, rot)
    print(json.dumps({"base": base, "peak": status("VmHWM:"), "layers": len(rep.layers),
                      "first_divergent": rep.first_divergent}))
""")


@pytest.mark.slow  # writes a 24-layer, 95 MB checkpoint and streams it in a fresh process (~10 s)
def test_peak_host_memory_stays_within_three_layers(tmp_path):
    from safetensors.torch import save_file

    raw = llama_like(24, 256, 1024)
    model = make_model(raw, seed=6)
    root = save_checkpoint(model, raw, tmp_path / "ckpt", shard="5MB")
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    cap = capture_layers(model, ids)
    layer_f64 = sum(p.numel() for p in model.model.layers[0].parameters()) * 8
    del model
    tensors = {"pos": cap[0].kwargs["position_ids"]}
    for i, io in enumerate(cap):
        tensors[f"in.{i}"], tensors[f"out.{i}"] = io.hidden_in.clone(), io.hidden_out.clone()
    save_file(tensors, str(tmp_path / "cap.safetensors"))
    (tmp_path / "measure.py").write_text(MEASURE)
    r = subprocess.run([sys.executable, str(tmp_path / "measure.py"), str(root), str(tmp_path / "cap.safetensors")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["layers"] == 24 and got["first_divergent"] is None
    whole = 24 * layer_f64
    growth = got["peak"] - got["base"]
    print(f"one layer float64 {layer_f64 / 2**20:.1f} MiB, whole model {whole / 2**20:.0f} MiB, "
          f"peak RSS growth while streaming {growth / 2**20:.1f} MiB ({growth / layer_f64:.2f} layers)")
    assert growth <= 3 * layer_f64
