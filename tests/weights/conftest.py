"""Real checkpoints for the weights tests: small models built from the bundled published configs,
written by transformers' own ``save_pretrained`` (several shards + index, per-expert keys as the hub
ships them), then rewritten into FP8 block-quantized and INT4 pack-quantized variants with the same
conventions as DeepSeek-V3 / compressed-tensors checkpoints."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from harness.models.config import architecture_class, build_config

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "suites" / "configs"

# Kimi-K2's published config shrunk in width only: 4 layers (1 dense + 3 MoE), 8 experts.
KIMI_SMALL = dict(num_hidden_layers=4, first_k_dense_replace=1, hidden_size=64, intermediate_size=128,
                  moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
                  num_experts_per_tok=2, n_shared_experts=1, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
                  qk_rope_head_dim=8, v_head_dim=16, vocab_size=512, bos_token_id=0, eos_token_id=1, n_group=1,
                  topk_group=1, num_nextn_predict_layers=0, torch_dtype="float32")


@pytest.fixture(autouse=True)
def one_thread():
    """These models are tiny: with 2 intra-op threads on 2 shared (busy) cores each small matmul waits
    tens of ms at OpenMP barriers; one thread runs them in microseconds."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def small_config(name: str, **over) -> dict:
    raw = json.loads((CONFIGS / name).read_text())
    raw.update(over)
    raw.pop("quantization_config", None)
    raw.pop("auto_map", None)
    return raw


def make_model(raw: dict, seed: int = 0) -> torch.nn.Module:
    mc = build_config(raw)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = architecture_class(mc.architecture)(mc.config)
        # Non-trivial norms and router bias, so a wrongly mapped tensor shows in the logits.
        for _, p in model.named_parameters():
            if p.dim() == 1:
                p.data.uniform_(0.5, 1.5)
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.uniform_(-0.1, 0.1)
    return model.eval()


def save_checkpoint(model: torch.nn.Module, raw: dict, root: Path, shard: str = "60KB") -> Path:
    """``save_pretrained`` in several shards + index, with the published config.json beside it."""
    model.save_pretrained(root, max_shard_size=shard)
    (root / "config.json").write_text(json.dumps(raw))
    return root


def is_quantizable(name: str, t: torch.Tensor) -> bool:
    """Linear weights of attention / MLP / experts (what DeepSeek-V3 ships in FP8)."""
    return (t.dim() == 2 and name.endswith(".weight") and ".layers." in name and "norm" not in name
            and not name.endswith("mlp.gate.weight"))


def rewrite_shards(src: Path, dst: Path, convert, quant_config: dict, select=is_quantizable) -> None:
    """Copy a checkpoint, replacing each weight ``select(name, w)`` picks (default: the quantizable
    ones) by what ``convert(name, w)`` returns."""
    shutil.copytree(src, dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    wm = {}
    for shard in sorted(set(index["weight_map"].values())):
        out = {}
        for name, t in load_file(str(dst / shard)).items():
            out.update(convert(name, t) if select(name, t) else {name: t})
        save_file(out, str(dst / shard), metadata={"format": "pt"})
        wm.update(dict.fromkeys(out, shard))
    index["weight_map"] = wm
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = quant_config
    (dst / "config.json").write_text(json.dumps(cfg))


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' pack_to_int32 for 4 bits, written out independently: offset-code (q + 8),
    eight values per int32 word along the input dim, value i at bits 4i."""
    u = (q.to(torch.int32) + 8)
    rows, cols = u.shape
    pad = math.ceil(cols / 8) * 8 - cols
    u = torch.nn.functional.pad(u, (0, pad)).reshape(rows, -1, 8)
    out = torch.zeros(rows, u.shape[1], dtype=torch.int64)
    for i in range(8):
        out |= u[:, :, i].to(torch.int64) << (4 * i)
    return (out - ((out >> 31) << 32)).to(torch.int32)  # two's complement into int32


def int4_quantize(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric group-wise int4: q in [-8, 7], scale = amax / 7 per group of ``group`` inputs."""
    out_f, in_f = w.shape
    g = w.float().reshape(out_f, in_f // group, group)
    scale = (g.abs().amax(-1) / 7).clamp(min=1e-8).to(torch.bfloat16)
    q = torch.clamp(torch.round(g / scale.float()[..., None]), -8, 7).to(torch.int8).reshape(out_f, in_f)
    return q, scale


@pytest.fixture(scope="package")
def kimi_ckpt(tmp_path_factory) -> tuple[Path, dict, torch.nn.Module]:
    """(checkpoint dir, config dict, the full model it was saved from)."""
    raw = small_config("Kimi-K2-Instruct.json", **KIMI_SMALL)
    model = make_model(raw)
    root = save_checkpoint(model, raw, tmp_path_factory.mktemp("kimi") / "ckpt")
    return root, raw, model


FP8_BLOCK = (32, 32)


@pytest.fixture(scope="package")
def kimi_fp8(kimi_ckpt, tmp_path_factory) -> Path:
    from harness.weights.quant import quantize_fp8_block

    src, _, _ = kimi_ckpt

    def conv(name, t):
        q, s = quantize_fp8_block(t, FP8_BLOCK)
        return {name: q, f"{name}_scale_inv": s}

    dst = tmp_path_factory.mktemp("kimi-fp8") / "ckpt"
    rewrite_shards(src, dst, conv, {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                    "weight_block_size": list(FP8_BLOCK)})
    return dst


INT4_GROUP = 8


@pytest.fixture(scope="package")
def kimi_int4(kimi_ckpt, tmp_path_factory) -> Path:
    src, _, _ = kimi_ckpt

    def conv(name, t):
        q, s = int4_quantize(t, INT4_GROUP)
        base = name  # X.weight -> X.weight_packed / X.weight_scale / X.weight_shape
        return {f"{base}_packed": pack_int4(q), f"{base}_scale": s,
                f"{base}_shape": torch.tensor(list(t.shape), dtype=torch.int32)}

    dst = tmp_path_factory.mktemp("kimi-int4") / "ckpt"
    rewrite_shards(src, dst, conv, {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                    "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "int",
                                                                              "symmetric": True, "strategy": "group",
                                                                              "group_size": INT4_GROUP}}}})
    return dst


def write_suite(d: Path, name: str, config: dict, body: str, top: str = "") -> Path:
    """suites-like dir: d/<name>.json (the published config) + d/<name>.toml (``top``-level keys, then
    [model] with its config and ``body``)."""
    d.mkdir(parents=True, exist_ok=True)
    (d / f"{name}.json").write_text(json.dumps(config))
    p = d / f"{name}.toml"
    p.write_text(f'{top}[model]\nconfig = "{name}.json"\n{body}')
    return p
