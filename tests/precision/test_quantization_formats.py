"""The quantization check reads a release's format with the parser `harness inspect` uses
(harness.anatomy.quant), for every format it recognizes (issue #29, item 4): FP8 in any spelling and
granularity, MXFP4, NVFP4 and INT4/INT8 groups are each simulated as stored (the checkpoint's ignore
list honoured), including a format declared only in hf_quant_config.json beside config.json. Real
published configs from tests/data/day0 (SOURCES.md there)."""

from __future__ import annotations

import pytest
import torch

from harness.checks import KnownGap, registry, run_one
from harness.precision.quantization import (
    E2M1,
    _fp8_block,
    _int,
    _mxfp4,
    _nvfp4,
    block_size,
    describe,
    quant_scheme,
    quantize_weights,
)
from harness.suite.loader import load_suite
from tests_support import REPO

DAY0 = REPO / "tests" / "data" / "day0"

CASES = {
    # config: (family, block, inspect's words)
    "DeepSeek-V3.2": ("fp8", [128, 128], "fp8 block 128x128 (checkpoint)"),
    "Qwen3-32B-FP8-Static-PerTensor": ("fp8", None, "fp8 per-tensor (checkpoint)"),  # compressed-tensors
    "gpt-oss-20b": ("mxfp4", [1, 32], "mxfp4 (checkpoint)"),
    "MiniMax-M2.5-NVFP4": ("nvfp4", [1, 16], "nvfp4 group 16 (checkpoint)"),
    "Kimi-K2.5": ("int4", [1, 32], "int4 group 32 (checkpoint)"),  # declared in text_config
    "Laguna-XS.2-FP8": ("fp8", [128, 128], "fp8 block 128x128 (checkpoint)"),  # compressed-tensors blocks
}


def _suite(tmp_path, name: str, extra: str = ""):
    p = tmp_path / f"{name}.toml"
    p.write_text(f'[model]\nconfig = "{DAY0 / (name + ".json")}"\n{extra}')
    return load_suite(p)


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_format_is_inspects_reading(name, tmp_path):
    family, block, words = CASES[name]
    ls = _suite(tmp_path, name)
    assert quant_scheme(ls) == family
    assert describe(ls) == words
    assert block_size(ls) == block


def test_a_format_recognized_but_not_simulated_is_a_known_gap_in_one_line(tmp_path, monkeypatch):
    """The rule for the next format inspect learns before the check does: one line, never no item."""
    import harness.checks.quantization as qc

    monkeypatch.setattr(qc, "SIMULATED", ("fp8",))
    ls = _suite(tmp_path, "gpt-oss-20b")
    assert registry().get("quantization").enabled(ls)
    with pytest.raises(KnownGap) as e:
        run_one(ls, "quantization", "cpu", "float32")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("mxfp4 (checkpoint) weights: the quantization check simulates fp8")


def _w(rows=8, cols=96, seed=0):
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))


def test_mxfp4_is_e2m1_under_one_power_of_two_scale_per_32():
    w = _w()
    q = _mxfp4(w)
    for r in range(w.shape[0]):
        for g in range(3):
            blk, qb = w[r, 32 * g:32 * (g + 1)], q[r, 32 * g:32 * (g + 1)]
            scale = 2.0 ** (torch.floor(torch.log2(blk.abs().max())) - 2)
            assert set((qb / scale).abs().unique().tolist()) <= set(E2M1.tolist())  # e2m1 values times e8m0
            # the widest e2m1 step is 2 (4 -> 6) and the spec's scale lets the top element reach 8 x scale,
            # saturating at 6: at most 2 x scale off
            assert (qb - blk).abs().max() <= 2 * scale
    assert 0.05 < ((q - w).norm() / w.norm()).item() < 0.2  # 4-bit: ~10 % error, not 0, not garbage


def test_nvfp4_scales_are_e4m3_under_an_fp32_global():
    w = _w(seed=1)
    q = _nvfp4(w)
    glob = w.abs().max() / (6 * 448)
    for r in range(w.shape[0]):
        for g in range(6):
            blk, qb = w[r, 16 * g:16 * (g + 1)], q[r, 16 * g:16 * (g + 1)]
            local = (blk.abs().max() / 6 / glob).to(torch.float8_e4m3fn).float()
            assert set((qb / (local * glob)).abs().round(decimals=4).unique().tolist()) <= set(E2M1.tolist())
    # 16-element groups with finer scales: closer than MXFP4's 32 with power-of-two scales
    assert ((q - w).norm() / w.norm()) < ((_mxfp4(w) - w).norm() / w.norm())


def test_int4_groups_symmetric_and_with_a_zero_point():
    w = _w(seed=2) + 0.5  # off-centre rows: a zero point helps
    sym, asym = _int(w, 4, 32, True), _int(w, 4, 32, False)
    for q in (sym, asym):
        for r in range(w.shape[0]):
            for g in range(3):
                assert len(q[r, 32 * g:32 * (g + 1)].unique()) <= 16  # 4 bits per group
    assert ((asym - w).norm() < (sym - w).norm())
    assert ((_int(w, 4, 32, True) - w).norm() < (_int(w, 4, None, True) - w).norm())  # per group < per row


def test_the_checkpoints_ignore_list_is_kept_unquantized(tmp_path):
    """gpt-oss keeps attention, router, embeddings and lm_head in bf16 (modules_to_not_convert): only
    its experts are MXFP4, grouped along their input dimension (its experts are is_transposed)."""
    from harness.anatomy.quant import quant_scheme as stored
    from harness.models.build import build_model
    from harness.precision.quantization import _config

    ls = _pruned_suite(tmp_path, "gpt-oss-20b")
    model, _ = build_model(ls, "float32", "cpu", seed=0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    s = stored(_config(ls))
    n = quantize_weights(model, "mxfp4", block_size(ls), skip=s.skips)
    changed = {k for k, p in model.named_parameters() if not torch.equal(p, before[k])}
    assert n == len(changed) > 0 and all(".mlp.experts." in k for k in changed), sorted(changed)
    gate_up = next(k for k in changed if k.endswith("gate_up_proj"))
    w = before[gate_up][0].transpose(0, 1)  # [out, in]: groups of 32 along the input (hidden) dimension
    assert torch.equal(dict(model.named_parameters())[gate_up][0].transpose(0, 1), _mxfp4(w))


def _pruned_suite(tmp_path, name: str):
    """The suite `harness init` plans for a corpus config (no probes), loaded."""
    import json

    from harness.cli.init import _plan
    from harness.models.prune import suite_toml

    raw = json.loads((DAY0 / f"{name}.json").read_text())
    plan, _ = _plan(raw, f"{name}.json")
    p = tmp_path / f"{name.lower()}.toml"
    p.write_text(suite_toml(str(DAY0 / f"{name}.json"), raw, plan.prune, plan.why, architecture=plan.architecture))
    return load_suite(p)





def test_scheme_none_still_turns_the_items_off(tmp_path):
    assert quant_scheme(_suite(tmp_path, "gpt-oss-20b", "[checks.quantization]\nscheme = \"none\"\n")) is None


def test_per_channel_fp8_has_one_scale_per_output_row():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 40, generator=g)
    w[2] *= 1e5  # one large row: under a tensor-wide scale the others fall into e4m3's subnormals
    per_row = _fp8_block(w, [1, -1])
    per_tensor = _fp8_block(w, None)
    for r in (0, 1, 3):
        assert torch.equal(per_row[r], _fp8_block(w[r:r + 1], None)[0])  # row r quantized on its own scale
    err = lambda q: ((q - w)[[0, 1, 3]].norm() / w[[0, 1, 3]].norm()).item()  # noqa: E731
    assert err(per_row) < 0.05 < 0.3 < err(per_tensor), (err(per_row), err(per_tensor))


def test_a_format_declared_only_in_hf_quant_config_json(tmp_path):
    """NVIDIA's ModelOpt releases (Llama-3.1-70B-Instruct-FP8, Nemotron-3-Super-FP8, the NVFP4 DeepSeek /
    GLM / Qwen3 ones) declare their format only in hf_quant_config.json beside config.json. Before, both
    inspect and the quantization check read config.json alone: bf16, and no quantization item."""
    import json

    from harness.inspect.params import inspect_params, load_target

    cfg = DAY0 / "Llama-3.1-70B-Instruct-FP8" / "config.json"
    assert "quantization_config" not in json.loads(cfg.read_text())
    p = tmp_path / "llama-70b-fp8.toml"
    p.write_text(f'[model]\nconfig = "{cfg}"\n')
    ls = load_suite(p)
    assert quant_scheme(ls) == "fp8" and block_size(ls) is None  # ModelOpt FP8: one scale per tensor
    assert describe(ls) == "fp8 per-tensor (checkpoint)"
    assert registry().get("quantization").enabled(ls)
    assert ls.raw_config["quantization_config"]["_declared_in"] == "hf_quant_config.json"
    target = load_target(str(cfg))
    assert target.name == "Llama-3.1-70B-Instruct-FP8"
    rep, _ = inspect_params(target)
    assert "fp8 per-tensor (checkpoint)" in rep.bytes
    assert any("declared in hf_quant_config.json" in n for n in rep.notes + target.model_config(False).notes)


@pytest.mark.parametrize("name", ["gpt-oss-20b", "MiniMax-M2.5-NVFP4", "Kimi-K2.5"])
def test_fp4_and_int4_are_measured_and_a_wrong_scale_exceeds_the_budget(name, tmp_path):
    """What golden generate measures and the check compares, on the release's own format: the clean
    quantized model is inside k x its measured error; the same weights dequantized with every expert
    scale off by one binade (an FP4 kernel reading e8m0/e4m3 scales one exponent low) are not."""
    from harness.anatomy.capture import forward_logits
    from harness.models.build import build_model, seeded_tokens
    from harness.precision.compare import tensor_metrics
    from harness.precision.quantization import budgets, measure, quantized_model

    ls = _pruned_suite(tmp_path, name)
    ref_model, _ = build_model(ls, "float64", "cpu", seed=ls.suite.checks.precision.seed)
    vocab = ref_model.config.get_text_config().vocab_size
    draws = [seeded_tokens(vocab, 2, 16, s) for s in (1, 2)]
    with torch.no_grad():
        refs = [forward_logits(ref_model.eval(), ids).float() for ids in draws]
    meas = measure(ls, draws, refs, ["float32"], None)
    assert meas["scheme"] == CASES[name][0] and meas["block_size"] == CASES[name][1]
    b, src = budgets(ls, {"quantization": meas}, "float32")
    assert src.startswith("measured by golden generate")
    model, n = quantized_model(ls, None, "float32")
    assert n > 0
    with torch.no_grad():
        clean = tensor_metrics(forward_logits(model, draws[0]).float(), refs[0])["rel_rmse"]
        for pname, p in model.named_parameters():
            if ".experts." in pname and p.dim() == 3:
                p.mul_(0.5)
        faulty = tensor_metrics(forward_logits(model, draws[0]).float(), refs[0])["rel_rmse"]
    assert clean <= b["rel_rmse"] < faulty, (clean, b["rel_rmse"], faulty)


def test_a_skip_list_by_the_wrapper_paths_keeps_those_modules_of_the_text_model_unquantized():
    """Issue #50 class 3: a VL release lists the modules it keeps in BF16 by the wrapper's paths
    (``model.language_model.layers.0.self_attn``, a regex over them, the wrapper's lm_head); the text
    model the checks build names them ``model.layers.0.self_attn``. Those modules stay unquantized, and
    what the list does not name is quantized as before."""
    from harness.anatomy.quant import quant_scheme as stored
    from harness.models.build import build_model
    from harness.suite.loader import load_suite

    ls = load_suite(REPO / "suites" / "llama-3.1-8b.toml")
    q = {"quant_method": "fp8", "weight_block_size": [128, 128],
         "modules_to_not_convert": ["model.language_model.layers.0.self_attn", "model.visual",
                                    r"re:model\.language_model\.layers\.1\.mlp\..*"]}
    s = stored(q)
    assert s.skips("model.layers.0.self_attn.q_proj") and s.skips("model.layers.1.mlp.down_proj")
    assert not s.skips("model.layers.1.self_attn.q_proj") and not s.skips("model.layers.0.mlp.up_proj")
    model, _ = build_model(ls, "float32", "cpu", seed=0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    n = quantize_weights(model, "fp8", (128, 128), skip=s.skips)
    changed = {k for k, p in model.named_parameters() if not torch.equal(p, before[k])}
    kept = {k for k in before if k.endswith(".weight") and (".layers.0.self_attn." in k or ".layers.1.mlp." in k)}
    assert kept and not kept & changed, sorted(kept & changed)
    assert n == len(changed) and any(".layers.1.self_attn." in k for k in changed), sorted(changed)
