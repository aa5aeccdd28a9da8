"""The op inventory: a meta trace agrees with what really executes on the CPU."""

from __future__ import annotations

import json

import pytest
import torch

from harness.golden.store import current_dir
from harness.inspect.params import load_target, meta_model
from harness.inspect.trace import Inventory, general_module, signature, trace_model
from harness.models.build import build_model
from tests_support import REPO_SUITES

# aten.lift_fresh: the identity op torch.tensor(data) runs for a *CPU* tensor built from Python data
# (transformers' KV-cache init); building on meta skips it.
HOST_ONLY = {"aten.lift_fresh.default"}
# transformers feeds histc floats on cpu/mps and ints on any other device type (meta included): same
# overloads, other dtypes, so these signatures differ by design.
DEVICE_BRANCH = {"aten.histc.default", "aten.cumsum.default", "aten._to_copy.default"}


@pytest.mark.parametrize("suite,dtype", [("deepseek-v3", "float32"), ("mixtral-8x7b", "bfloat16"),
                                         ("qwen3-8b", "float32")])
def test_meta_trace_equals_real_cpu_trace(suite, dtype):
    target = load_target(REPO_SUITES / f"{suite}.toml")
    real_model, mc = build_model(target.suite, dtype, "cpu")
    real = trace_model(real_model, mc.config.vocab_size, batch=2, seq=16)
    meta_m, _ = meta_model(target, pruned=True, dtype=getattr(torch, dtype))
    meta = trace_model(meta_m, mc.config.vocab_size, batch=2, seq=16)
    assert meta.meta["device"] == "meta" and real.meta["device"] == "cpu"
    assert set(real.ops) - HOST_ONLY == set(meta.ops)
    for op, r in meta.ops.items():
        c = real.ops[op]
        assert (r.forward, r.backward) == (c.forward, c.backward), op
        assert r.modules == c.modules, op
        if op not in DEVICE_BRANCH:
            assert r.signatures == c.signatures, op
    # the fused attention kernel the CPU picks is what the meta trace reports, not the math fallback
    if suite != "deepseek-v3":  # MLA has d_qk != d_v: the CPU takes the math path there too
        assert "aten._scaled_dot_product_flash_attention_for_cpu.default" in meta.ops


def test_inventory_modules_forward_and_backward():
    target = load_target(REPO_SUITES / "deepseek-v3.toml")
    model, mc = meta_model(target, pruned=True)
    inv = trace_model(model, mc.config.vocab_size)
    gm = inv.ops["aten._grouped_mm.default"]
    assert gm.modules == {"model.layers.*.mlp.experts [DeepseekV3Experts]"}
    assert gm.forward == 2 and gm.backward == 4  # one MoE layer: gate_up + down, and both grads of each
    assert inv.modules_of("aten.embedding_dense_backward.default") == ["model.embed_tokens [Embedding]"]
    assert "model.layers.*.mlp.gate [DeepseekV3TopkRouter]" in inv.ops["aten.sigmoid_backward.default"].modules
    assert any("bf16[" in s for s in gm.signatures)
    # JSON round trip
    back = Inventory.from_dict(json.loads(inv.to_json()))
    assert back.names() == inv.names() and back.ops["aten.mm.default"].count == inv.ops["aten.mm.default"].count


def test_real_trace_keeps_samples_with_values():
    target = load_target(REPO_SUITES / "llama-3.1-8b.toml")
    model, mc = build_model(target.suite, "float32", "cpu")
    inv = trace_model(model, mc.config.vocab_size, keep_samples=True)
    s = inv.samples["aten.embedding.default"][0]
    assert s.args[1].dtype == torch.int64 and s.args[1].max() < 512  # real token ids
    assert s.module == "model.embed_tokens [Embedding]"


def test_helpers():
    assert general_module("model.layers.12.mlp.experts") == "model.layers.*.mlp.experts"
    assert signature((torch.zeros(2, 3), 1, [4, 5]), {"dtype": torch.bfloat16}) == "(f32[2,3], 1, [4,5], dtype=bf16)"


# --- realistic numerics in the real trace (issue #11, item 5) -----------------------------------------
SDPA = "aten._scaled_dot_product_flash_attention_for_cpu.default"


def _logit_std(sample) -> float:
    """Std of the causal attention logits q.k * scale of one recorded SDPA call."""
    q, k = sample.args[0].double(), sample.args[1].double()
    k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
    w = (q @ k.transpose(-2, -1)) * (sample.kwargs.get("scale") or q.shape[-1] ** -0.5)  # [B, H, S, S]
    return w[..., torch.ones(w.shape[-2:], dtype=torch.bool).tril()].std().item()


def test_real_trace_has_the_goldens_realistic_scale(monkeypatch):
    """The ops check's trace applies the committed golden's gains: its attention logits have the
    calibrated std (bare initialisation: ~0.05), read from the golden's own manifest."""
    from harness.inspect.trace import real_inventory, trace_numerics
    from harness.suite.loader import load_suite
    from tests_support import REPO

    monkeypatch.setenv("HARNESS_GOLDEN_DIR", str(REPO / "golden"))
    ls = load_suite(REPO_SUITES / "llama-3.1-8b.toml")
    manifest = json.loads((current_dir(REPO / "golden" / "llama-3.1-8b") / "manifest.json").read_text())
    want = [v["logit_std"] for v in manifest["numerics"]["stats"]["realistic"]["attention"].values()]
    num = trace_numerics(ls)
    assert num.source == "golden" and "golden/llama-3.1-8b" in num.detail
    inv = real_inventory(ls, "float32")
    assert inv.meta["numerics"]["source"] == "golden"
    got = sorted(_logit_std(s) for s in inv.samples[SDPA])  # one sample per layer (their scales differ)
    assert len(got) == len(want)
    for g, w in zip(got, sorted(want), strict=True):  # other input ids than the golden's: near, not equal
        assert g == pytest.approx(w, rel=0.25)
    bare = real_inventory(ls, "float32", realistic=False)
    assert bare.meta["numerics"]["source"] == "init"
    assert max(_logit_std(s) for s in bare.samples[SDPA]) < 0.2 * min(want)
    assert set(bare.ops) == set(inv.ops)  # the same ops: only the values change


def test_trace_cache_key_follows_the_numerics(tmp_path, monkeypatch):
    """A golden with other gains, no golden, or bare init: each its own cache key (no stale trace)."""
    from harness.inspect.trace import suite_key, trace_numerics
    from harness.suite.loader import load_suite
    from tests_support import REPO

    ls = load_suite(REPO_SUITES / "qwen3-8b.toml")
    root = tmp_path / "golden"
    (root / "qwen3-8b").mkdir(parents=True)
    manifest = json.loads((current_dir(REPO / "golden" / "qwen3-8b") / "manifest.json").read_text())
    monkeypatch.setenv("HARNESS_GOLDEN_DIR", str(root))

    def key_with(m):
        (root / "qwen3-8b" / "manifest.json").write_text(json.dumps(m))
        num = trace_numerics(ls)
        return num, suite_key(ls, "bfloat16", "2x16")

    golden, k_golden = key_with(manifest)
    assert golden.source == "golden" and golden.gains["attention_gain"] == {
        i: float(v) for i, v in manifest["numerics"]["attention_gain"].items()}
    other = json.loads(json.dumps(manifest))
    other["numerics"]["attention_gain"]["0"] *= 2
    assert key_with(other)[1] != k_golden
    stale = dict(manifest, config_hash="0" * 64)
    num, k_stale = key_with(stale)
    assert num.source == "calibrated" and "is for another config" in num.detail
    bad = json.loads(json.dumps(manifest))
    bad["numerics"]["residual_gain"]["0"] = "x"  # not data the trace applies
    assert key_with(bad)[0].detail == num.detail.replace("is for another config", "has no usable numerics gains")
    (root / "qwen3-8b" / "manifest.json").unlink()
    (root / "qwen3-8b").rmdir()
    assert "no golden" in trace_numerics(ls).detail and suite_key(ls, "bfloat16", "2x16") == k_stale
    bare = trace_numerics(ls, realistic=False)
    assert bare.source == "init" and len({k_golden, k_stale, suite_key(ls, "bfloat16", "2x16", bare.key)}) == 3
