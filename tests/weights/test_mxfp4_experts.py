"""gpt-oss checkpoints: routed experts stored fused and MXFP4-quantized (``experts.gate_up_proj_blocks`` /
``_scales`` [E, out, in/32, ...], plain biases [E, out]), loaded into a pruned model with the kept experts
only, transposed into ``GptOssExperts``' [E, in, out] as transformers' own loader does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from harness.models.build import build_model
from harness.suite.loader import load_suite
from harness.weights import quant
from tests.weights.conftest import make_model, rewrite_shards, save_checkpoint, write_suite

DAY0 = Path(__file__).resolve().parents[1] / "data" / "day0" / "gpt-oss-20b.json"
# gpt-oss-20b's published config, narrowed: 4 layers (sliding, full, sliding, full), 8 experts, top-2.
# hidden != intermediate, unlike the real model (2880 both), so a missing transpose also changes shapes.
SMALL = dict(num_hidden_layers=4, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, num_local_experts=8, num_experts_per_tok=2, experts_per_token=2, vocab_size=256,
             pad_token_id=0, eos_token_id=1, sliding_window=8, torch_dtype="float32")
PRUNE = ('[prune]\nnum_hidden_layers = 2\nnum_experts = 4\n'
         '[prune.overrides]\nlayer_types = ["sliding_attention", "full_attention"]\n')
E2M1 = torch.tensor(quant.FP4_VALUES, dtype=torch.float64)


def gpt_oss_config(**over) -> dict:
    raw = json.loads(DAY0.read_text())
    raw.update(SMALL, **over)
    raw["layer_types"] = raw["layer_types"][: raw["num_hidden_layers"]]
    return raw


def mxfp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., K] float -> (blocks uint8 [..., K/32, 16], scales uint8 [..., K/32]), written out independently
    of harness: a shared power-of-two scale per 32 values (amax / 2^e in [4, 8), e2m1's largest is 6),
    nearest e2m1 code, two codes a byte, low nibble first; scale stored as e + 127 (e8m0)."""
    xb = w.double().reshape(*w.shape[:-1], w.shape[-1] // 32, 32)
    e = torch.floor(torch.log2(xb.abs().amax(-1).clamp(min=2**-100))) - 2
    idx = ((xb / torch.exp2(e)[..., None])[..., None] - E2M1).abs().argmin(-1)
    return (idx[..., 0::2] | (idx[..., 1::2] << 4)).to(torch.uint8), (e + 127).to(torch.uint8)


def write_mxfp4_checkpoint(src: Path, dst: Path) -> None:
    """A save_pretrained gpt-oss checkpoint rewritten as OpenAI ships it: each fused expert matrix of the
    model ([E, in, out]) stored as [E, out, in] in MXFP4 blocks and scales; everything else unchanged."""
    def convert(name, t):
        blocks, scales = mxfp4_quantize(t.transpose(1, 2).contiguous())
        return {f"{name}_blocks": blocks, f"{name}_scales": scales}

    rewrite_shards(src, dst, convert, gpt_oss_config()["quantization_config"],
                   select=lambda name, t: name.endswith(("experts.gate_up_proj", "experts.down_proj")))


@pytest.fixture(scope="module")
def gpt_oss_mxfp4(tmp_path_factory) -> tuple[Path, dict]:
    raw = gpt_oss_config()
    plain = {k: v for k, v in raw.items() if k != "quantization_config"}
    d = tmp_path_factory.mktemp("gpt-oss")
    src = save_checkpoint(make_model(plain, seed=11), plain, d / "bf16", shard="60KB")
    keys = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.3.mlp.experts.gate_up_proj" in keys  # transformers keeps gpt-oss experts fused
    write_mxfp4_checkpoint(src, d / "mxfp4")
    return d / "mxfp4", raw


def _transformers_dequantized(root: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint as transformers' gpt-oss loader makes it (convert_moe_packed_tensors:
    dequantize, then transpose dims 1 and 2), float32 (exact: e2m1 times a power of two)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    raw: dict[str, torch.Tensor] = {}
    for f in sorted(root.glob("*.safetensors")):
        raw |= load_file(str(f))
    out = {}
    for k, v in raw.items():
        if k.endswith("_blocks"):
            out[k.removesuffix("_blocks")] = convert_moe_packed_tensors(v, raw[k.replace("_blocks", "_scales")],
                                                                        dtype=torch.float32)
        elif not k.endswith("_scales"):
            out[k] = v
    return out


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_pruned_gpt_oss_takes_the_kept_experts_dequantized_and_transposed(gpt_oss_mxfp4, tmp_path, dtype):
    root, raw = gpt_oss_mxfp4
    body = f'weights = "{root}"\nweights_experts = [5, 0, 3, 6]\n{PRUNE}'
    model, mc = build_model(load_suite(write_suite(tmp_path, "g", raw, body)), dtype)
    note = next(n for n in mc.notes if n.startswith("real weights"))
    assert "layers [0, 1] of 4, experts [5, 0, 3, 6] of 8" in note  # sliding + full attention layer
    assert any("4 mxfp4 tensors" in n for n in mc.notes), mc.notes
    ref = _transformers_dequantized(root)
    sel = torch.tensor([5, 0, 3, 6])
    p = model.state_dict()
    for k, v in p.items():
        want = ref[k]
        if ".experts." in k or ".router." in k:
            want = want[sel]
        assert v.shape == want.shape and torch.equal(v, want.to(v.dtype)), k
    assert p["model.layers.1.mlp.experts.gate_up_proj"].shape == (4, 64, 192)  # [E, H, 2I]
    assert p["model.layers.1.mlp.experts.down_proj"].shape == (4, 96, 64)  # [E, I, H]


def test_only_the_kept_experts_rows_are_read(gpt_oss_mxfp4, tmp_path):
    from harness.models.build import model_config
    from harness.weights.layout import open_checkpoint
    from harness.weights.load import build_plan, fill, instantiate_empty
    from harness.weights.reader import ShardReader

    root, raw = gpt_oss_mxfp4
    body = f'weights = "{root}"\nweights_experts = [5, 0, 3, 6]\n{PRUNE}'
    ls = load_suite(write_suite(tmp_path, "g", raw, body))
    mc = model_config(ls)
    model = instantiate_empty(ls, mc, torch.float32)
    ck = open_checkpoint(root)
    reader = ShardReader(ck)
    fill(model, build_plan(model, ls, mc, ck), ck, reader)
    kept = 0  # checkpoint bytes of layers 0 and 1 (expert-indexed tensors: 4 of 8 rows) and the rest
    for k, info in ck.tensors.items():
        if k.startswith("model.layers.") and not k.startswith(("model.layers.0.", "model.layers.1.")):
            continue
        kept += info.nbytes // 2 if (".experts." in k or ".router." in k) else info.nbytes
    assert reader.bytes_read == kept


def test_unpruned_gpt_oss_equals_transformers_from_pretrained(gpt_oss_mxfp4, tmp_path):
    """The same checkpoint through transformers' own MXFP4 loader (dequantized on CPU): identical
    tensors and logits."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    root, raw = gpt_oss_mxfp4
    ours, _ = build_model(load_suite(write_suite(tmp_path, "g", raw, f'weights = "{root}"\n')), "float32")
    theirs = AutoModelForCausalLM.from_pretrained(str(root), dtype=torch.float32,
                                                  quantization_config=Mxfp4Config(dequantize=True))
    a, b = ours.state_dict(), theirs.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k].to(a[k].dtype)), k
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(ours.eval()(ids).logits, theirs.eval()(ids).logits)


def test_layout_check_and_streamed_reference_read_the_mxfp4_experts(gpt_oss_mxfp4, tmp_path):
    """The nightly weights check on the same checkpoint: the layout matches the config (MXFP4 experts
    in the model's order), and the streamed float64 reference equals the in-memory float64 build."""
    from harness.models.build import architecture_class
    from harness.models.config import build_config
    from harness.precision.stream import capture_layers, float64_rotary, stream_reference
    from harness.weights.expected import compare
    from harness.weights.layout import open_checkpoint
    from tests.weights.test_stream import in_memory_reference

    root, raw = gpt_oss_mxfp4
    mc = build_config(raw)
    with torch.device("meta"):
        meta = architecture_class(mc.architecture)(mc.config)
    rep = compare(meta, open_checkpoint(root))
    assert (rep.missing, rep.mismatched, rep.unexpected) == ([], [], []), rep
    target, _ = build_model(load_suite(write_suite(tmp_path, "g", raw, f'weights = "{root}"\n')), "float32")
    model64, _ = build_model(load_suite(write_suite(tmp_path, "g", raw, f'weights = "{root}"\n')), "float64")
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    captured = capture_layers(target.eval(), ids)
    streamed = stream_reference(meta, open_checkpoint(root), captured, tol=1e-4, rotary=float64_rotary(meta))
    mem = in_memory_reference(model64.eval(), captured)
    for r, m in zip(streamed.layers, mem, strict=True):
        assert r.metrics == m, r.layer
    assert streamed.first_divergent is None


def test_streamed_reference_reads_only_the_routed_rows_of_fused_mxfp4_experts(gpt_oss_mxfp4, tmp_path):
    """Two tokens x top-2 route to at most 4 of the 8 experts of a layer: the streamed reference reads those
    experts' rows of the fused blocks, scales and biases only (each expert's bytes are left unread
    otherwise), and still equals the in-memory float64 build, whose every expert is loaded."""
    from harness.models.build import architecture_class
    from harness.models.config import build_config
    from harness.precision.stream import capture_layers, float64_rotary, stream_reference
    from harness.weights.layout import open_checkpoint
    from tests.weights.test_stream import in_memory_reference

    root, raw = gpt_oss_mxfp4
    mc = build_config(raw)
    with torch.device("meta"):
        meta = architecture_class(mc.architecture)(mc.config)
    target, _ = build_model(load_suite(write_suite(tmp_path, "g", raw, f'weights = "{root}"\n')), "float32")
    model64, _ = build_model(load_suite(write_suite(tmp_path, "g", raw, f'weights = "{root}"\n')), "float64")
    ids = torch.tensor([[5, 77]])
    captured = capture_layers(target.eval(), ids)
    ck = open_checkpoint(root)
    streamed = stream_reference(meta, ck, captured, tol=1e-4, rotary=float64_rotary(meta))
    mem = in_memory_reference(model64.eval(), captured)
    for r, m in zip(streamed.layers, mem, strict=True):
        assert r.metrics == m, r.layer
    assert streamed.first_divergent is None
    ne = raw["num_local_experts"]
    for r in streamed.layers:
        assert r.experts_read is not None and r.experts_read <= 4
        fused = [k for k in ck.tensors if k.startswith(f"model.layers.{r.layer}.mlp.experts.")]
        assert len(fused) == 6  # gate_up / down: blocks, scales, bias
        per_expert = sum(ck.tensors[k].nbytes for k in fused) // ne
        layer_bytes = sum(ck.tensors[k].nbytes for k in ck.tensors if k.startswith(f"model.layers.{r.layer}."))
        assert r.bytes_read == layer_bytes - (ne - r.experts_read) * per_expert, r.layer
