"""Quantized checkpoints: exact dequantization, and pruned models built from FP8 / INT4 shards."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from harness.models.build import build_model
from harness.suite.loader import load_suite
from harness.weights import quant
from harness.weights.layout import open_checkpoint
from tests.weights.conftest import FP8_BLOCK, INT4_GROUP, int4_quantize, pack_int4, write_suite


def test_fp8_block_dequantization_is_exact_per_block_and_within_e4m3_rounding():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(72, 100, generator=g) * torch.logspace(-3, 1, 100)  # partial blocks, wide dynamic range
    q, s = quant.quantize_fp8_block(w, FP8_BLOCK)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (3, 4)
    deq = quant.dequant_fp8_block(q, s, FP8_BLOCK)
    bo, bi = FP8_BLOCK
    for i in range(3):  # block (i, j) is q * its own scale, exactly
        for j in range(4):
            blk = (slice(i * bo, (i + 1) * bo), slice(j * bi, (j + 1) * bi))
            assert torch.equal(deq[blk], q[blk].double() * s[i, j].double())
    # e4m3 has 3 mantissa bits: round-to-nearest is within 2^-4 relative, 2^-10 * scale in the subnormals.
    bound = w.double().abs() * 2**-4 + s.double().repeat_interleave(bo, 0)[:72].repeat_interleave(bi, 1)[:, :100] * 2**-10
    assert ((deq - w.double()).abs() <= bound).all()
    # without weight_block_size in the config: 128x128 (DeepSeek-V3 / Kimi-K2) when it tiles the weight
    q2, s2 = quant.quantize_fp8_block(w[:, :64].repeat(4, 3), (128, 128))  # [288, 192]: partial blocks
    assert torch.equal(quant.dequant_fp8_block(q2, s2), quant.dequant_fp8_block(q2, s2, (128, 128)))


def test_int4_pack_quantized_dequantization_within_half_a_step():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(24, 40, generator=g)
    q, s = int4_quantize(w, INT4_GROUP)
    packed = pack_int4(q)
    assert packed.dtype == torch.int32 and packed.shape == (24, 5)
    assert torch.equal(quant.unpack_int4(packed, 40), q)
    deq = quant.dequant_int4_pack(packed, s, (24, 40))
    step = s.double().repeat_interleave(INT4_GROUP, 1)
    assert torch.equal(deq, q.double() * step)  # exact: int4 times a bf16 scale
    clipped = (w.double() / step).round() < -8  # amax/7 scaling can clip the negative end by one step
    assert (((deq - w.double()).abs() <= step / 2 + 1e-12) | clipped).all()


def test_int4_asymmetric_zero_point():
    q = torch.randint(-8, 8, (16, 16), generator=torch.Generator().manual_seed(2)).to(torch.int8)
    z = torch.randint(-3, 3, (16, 2), generator=torch.Generator().manual_seed(3)).to(torch.int8)
    s = torch.rand(16, 2, dtype=torch.float32) + 0.5
    zp = pack_int4(z.t().contiguous()).t()  # compressed-tensors packs zero points along dim 0
    deq = quant.dequant_int4_pack(pack_int4(q), s, (16, 16), zp)
    ref = (q.double() - z.double().repeat_interleave(8, 1)) * s.double().repeat_interleave(8, 1)
    assert torch.equal(deq, ref)


def test_mxfp4_known_values_and_rounding():
    # one row, one block of 32 values: nibble codes 0..15 twice, scale exponent 2^(128-127) = 2
    codes = torch.arange(32) % 16
    blocks = (codes[0::2] | (codes[1::2] << 4)).to(torch.uint8).reshape(1, 1, 16)
    scales = torch.tensor([[128]], dtype=torch.uint8)
    out = quant.dequant_mxfp4(blocks, scales)
    assert out.shape == (1, 32)
    assert out[0].tolist() == [2 * quant.FP4_VALUES[c] for c in codes.tolist()]
    # a float reference rounded to e2m1 with a shared power-of-two scale is reproduced exactly
    g = torch.Generator().manual_seed(4)
    x = torch.randn(4, 64, generator=g, dtype=torch.float64)
    lut = torch.tensor(quant.FP4_VALUES, dtype=torch.float64)
    xb = x.reshape(4, 2, 32)
    e = torch.floor(torch.log2(xb.abs().amax(-1))) - 2  # amax / 2^e in [4, 8): largest e2m1 is 6
    y = xb / torch.exp2(e)[..., None]
    idx = (y[..., None] - lut).abs().argmin(-1)
    packed = (idx[..., 0::2] | (idx[..., 1::2] << 4)).to(torch.uint8)
    deq = quant.dequant_mxfp4(packed, (e + 127).to(torch.uint8))
    assert torch.equal(deq, (lut[idx] * torch.exp2(e)[..., None]).reshape(4, 64))
    # rounding: half the largest e2m1 step (4 -> 6) is 1; amax up to 8 clips to 6: at most 2, times the scale
    assert ((deq - x).abs() <= torch.exp2(e).repeat_interleave(32, -1) * 2.0).all()


def _dequantized_reference(ckpt_dir):
    """Every logical tensor of a quantized checkpoint, dequantized independently of the loader."""
    ck = open_checkpoint(ckpt_dir)
    out = {}
    for shard in ck.shards:
        out.update(load_file(str(ck.root / shard)))
    return ck, out


def test_pruned_model_from_fp8_checkpoint_equals_dequantized_tensors(kimi_fp8, kimi_ckpt, tmp_path):
    _, raw, _ = kimi_ckpt
    ls = load_suite(write_suite(tmp_path, "k", raw, f'weights = "{kimi_fp8}"\n[prune]\nnum_hidden_layers = 2\n'
                                                    "num_experts = 4\n"))
    model, mc = build_model(ls, "float64")
    assert any("fp8_block tensors" in n for n in mc.notes)
    _, sd = _dequantized_reference(kimi_fp8)
    p = model.state_dict()
    name = "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"  # [24, 64]: a partial 32x32 block row
    ref = sd[name].double() * sd[f"{name}_scale_inv"].double().repeat_interleave(32, 0)[:24].repeat_interleave(32, 1)
    assert torch.equal(p[name], ref)
    e2 = "model.layers.1.mlp.experts.2.up_proj.weight"
    up = sd[e2].double() * sd[f"{e2}_scale_inv"].double().repeat_interleave(32, 0).repeat_interleave(32, 1)
    assert torch.equal(p["model.layers.1.mlp.experts.gate_up_proj"][2, 32:], up)
    ids = torch.randint(0, 512, (1, 8))
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()


def test_pruned_model_from_int4_checkpoint_equals_dequantized_tensors(kimi_int4, kimi_ckpt, tmp_path):
    _, raw, full = kimi_ckpt
    ls = load_suite(write_suite(tmp_path, "k", raw, f'weights = "{kimi_int4}"\n[prune]\nnum_hidden_layers = 2\n'
                                                    "num_experts = 4\n"))
    model, mc = build_model(ls, "float64")
    assert any("int4_pack tensors" in n for n in mc.notes)
    p = model.state_dict()
    w = full.state_dict()["model.layers.1.self_attn.o_proj.weight"]
    q, s = int4_quantize(w, INT4_GROUP)
    assert torch.equal(p["model.layers.1.self_attn.o_proj.weight"], q.double() * s.double().repeat_interleave(8, 1))
    # the unquantized tensors (norms, router, embeddings) are the originals
    assert torch.equal(p["model.layers.1.mlp.gate.weight"], full.state_dict()["model.layers.1.mlp.gate.weight"][:4].double())


def test_native_fp8_linear_matches_the_dequantized_reference():
    from harness.weights.native import Fp8BlockLinear, native_fp8

    ok, why = native_fp8("cpu")
    assert ok, why  # torch 2.13's CPU build has _scaled_mm with row-wise scales
    g = torch.Generator().manual_seed(7)
    w = torch.randn(96, 160, generator=g)  # ragged last 128-block along K and N
    q, s = quant.quantize_fp8_block(w, (128, 128))
    lin = Fp8BlockLinear(q, s, (128, 128), None)
    x = torch.randn(3, 5, 160, generator=g)
    ref = x.double() @ quant.dequant_fp8_block(q, s, (128, 128)).t()
    y = lin(x)
    assert y.shape == (3, 5, 96) and y.dtype == torch.float32
    # only the activations' e4m3 rounding (2^-4 relative per element) separates the two
    rel = (y.double() - ref).norm() / ref.norm()
    assert 1e-4 < rel < 2**-5
    lin.to(torch.bfloat16)  # build_model casts the model: the payload and scales must survive it
    assert lin.q_bits.dtype == torch.uint8 and lin.scale_bits.dtype == torch.int32


def test_native_fp8_suite_keeps_linears_quantized(tmp_path):
    """A suite that asks for native FP8 runs its Linear layers through _scaled_mm and stays close to the
    dequantized build of the same checkpoint (FP8 block 128x128 on real-width layers: wide model here)."""
    from harness.weights.native import Fp8BlockLinear
    from tests.weights.conftest import make_model, rewrite_shards, save_checkpoint, small_config

    raw = small_config("Llama-3.1-8B.json", num_hidden_layers=2, hidden_size=256, intermediate_size=512,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=128, bos_token_id=0,
                       eos_token_id=1, torch_dtype="float32")
    src = save_checkpoint(make_model(raw, seed=8), raw, tmp_path / "f32", shard="1MB")

    def conv(name, t):
        q, s = quant.quantize_fp8_block(t, (128, 128))
        return {name: q, f"{name}_scale_inv": s}

    fp8 = tmp_path / "fp8"
    rewrite_shards(src, fp8, conv, {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]})
    deq, _ = build_model(load_suite(write_suite(tmp_path, "d", raw, f'weights = "{fp8}"\n')), "float32")
    nat, mc = build_model(load_suite(write_suite(tmp_path, "n", raw, f'weights = "{fp8}"\nweights_quantized = '
                                                                     '"native"\n')), "float32")
    assert any("14 Linear layers kept in FP8" in n for n in mc.notes), mc.notes
    assert isinstance(nat.model.layers[1].mlp.down_proj, Fp8BlockLinear)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = nat.eval()(ids).logits.double(), deq.eval()(ids).logits.double()
    rel = ((a - b).norm() / b.norm()).item()
    assert 0 < rel < 0.05, rel


def _int4_asym(w: torch.Tensor, group: int):
    """Asymmetric group-wise int4 as compressed-tensors writes it: q = clamp(round(w / s) + z, -8, 7),
    w = (q - z) * s, with s = (max - min) / 15 and the integer z that puts min at -8."""
    out_f, in_f = w.shape
    g = w.double().reshape(out_f, in_f // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    s = ((hi - lo) / 15).clamp(min=1e-8).to(torch.bfloat16)
    z = torch.clamp(-8 - torch.round(lo / s.double()), -8, 7).to(torch.int8)
    q = torch.clamp(torch.round(g / s.double()[..., None]) + z.double()[..., None], -8, 7).to(torch.int8)
    return q.reshape(out_f, in_f), s, z


def test_native_int4_linear_matches_the_dequantized_reference():
    from harness.weights.native import Int4GroupLinear, native_int4

    ok, why = native_int4("cpu")
    assert ok, why  # torch 2.13's CPU build has _weight_int4pack_mm_for_cpu
    g = torch.Generator().manual_seed(9)
    w = torch.randn(48, 128, generator=g)
    q, s, z = _int4_asym(w, 32)
    ref_w = quant.dequant_int4_pack(pack_int4(q), s, (48, 128), pack_int4(z.t().contiguous()).t())  # float64
    lin = Int4GroupLinear(q.to(torch.int32) + 8, s.double(), -z.double() * s.double(), 32, None)
    assert torch.equal(lin.dequantized(), ref_w)  # the kernel's weight is the checkpoint's, exactly
    x = torch.randn(3, 5, 128, generator=g, requires_grad=True)
    y = lin(x)
    ref = x.double() @ ref_w.t()
    assert y.shape == (3, 5, 48) and y.dtype == torch.float32
    assert ((y.double() - ref).norm() / ref.norm()).item() < 1e-6  # float32 accumulation only
    dy = torch.randn(3, 5, 48, generator=g)
    y.backward(dy)  # the kernel has no derivative: the module's own input gradient
    assert torch.allclose(x.grad.double(), dy.double() @ ref_w, rtol=1e-5, atol=1e-5)
    xb = x.detach().bfloat16()
    rel = ((lin(xb).double() - xb.double() @ ref_w.t()).norm() / ref.norm()).item()
    assert rel < 2**-6  # bf16 scales/zeros and output rounding
    lin.to(torch.bfloat16)  # build_model casts the model: packed weight and scales must survive it
    assert lin.w_int4pack.dtype == torch.uint8 and lin.scales_and_zeros.dtype == torch.int32


def test_native_int4_suite_keeps_linears_quantized(tmp_path):
    """weights_quantized = "native" on a group-wise INT4 checkpoint (group 32, asymmetric): the Linear layers
    run on the INT4 kernel, the logits match the dequantized build of the same checkpoint to float32
    accumulation, and the smoke check (forward, backward, training) runs on it."""
    from harness.checks import run_one
    from harness.weights.native import Int4GroupLinear
    from tests.weights.conftest import make_model, rewrite_shards, save_checkpoint, small_config

    # width 256: long enough dot products that the kernel's float32 summation order shows (at K = 64 it
    # happens to equal the dense matmul's, bit for bit)
    raw = small_config("Llama-3.1-8B.json", num_hidden_layers=2, hidden_size=256, intermediate_size=512,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=128, bos_token_id=0,
                       eos_token_id=1, torch_dtype="float32")
    src = save_checkpoint(make_model(raw, seed=8), raw, tmp_path / "f32", shard="1MB")

    def conv(name, t):
        q, s, z = _int4_asym(t, 32)
        return {f"{name}_packed": pack_int4(q), f"{name}_scale": s, f"{name}_zero_point":
                pack_int4(z.t().contiguous()).t().contiguous(), f"{name}_shape": torch.tensor(list(t.shape), dtype=torch.int32)}

    int4 = tmp_path / "int4"
    rewrite_shards(src, int4, conv, {"quant_method": "compressed-tensors", "format": "pack-quantized"})
    deq, _ = build_model(load_suite(write_suite(tmp_path, "d", raw, f'weights = "{int4}"\n')), "float32")
    ls = load_suite(write_suite(tmp_path, "n", raw, f'weights = "{int4}"\nweights_quantized = "native"\n'))
    nat, mc = build_model(ls, "float32")
    assert any("14 Linear layers kept in INT4" in n for n in mc.notes), mc.notes
    assert isinstance(nat.model.layers[1].self_attn.k_proj, Int4GroupLinear)  # N = 128
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = nat.eval()(ids).logits.double(), deq.eval()(ids).logits.double()
    assert 0 < ((a - b).norm() / b.norm()).item() < 1e-5
    ctx = run_one(ls, "smoke", "cpu", "float32")
    assert float(dict(ctx.properties)["metric.loss_drop"]) > 0
    ref, mc64 = build_model(ls, "float64")  # the reference build of a native suite: dequantized, exact
    assert not any(isinstance(m, Int4GroupLinear) for m in ref.modules())
    assert any("the float64 build is the dequantized reference" in n for n in mc64.notes), mc64.notes
