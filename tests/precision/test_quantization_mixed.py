"""Mixed-precision releases read module by module (issue #50 class 2): a release that stores its
experts in NVFP4 and its attention in FP8 was simulated as FP8 throughout (its first group only),
NVIDIA's per-layer ``MIXED_PRECISION`` sidecar got no quantization item, the 4-bit activations these
checkpoints declare were not simulated, and NVFP4 items judged top-1 agreement against a bound of
0.0. Real published configs from tests/data/day0 (SOURCES.md there):

* Qwen3.6-35B-A3B-NVFP4/ (NVIDIA ModelOpt): ``quantized_layers`` FP8 on the linear attention,
  W4A16 NVFP4 on the experts, shared expert and lm_head, by the multimodal wrapper's paths;
* DeepSeek-V4-Flash-NVFP4-FP8 (RedHat, compressed-tensors): two ``config_groups`` with regex targets
  by the checkpoint's own names (``attn.wq_b``, ``ffn...up_proj``), FP8 and NVFP4 inputs declared;
* DeepSeek-V4-Flash (DeepSeek): FP8 blocks with ``expert_dtype`` fp4 (the routed experts in FP4).
"""

from __future__ import annotations

import json

import pytest
import torch

from harness.checks import CheckContext, CheckFailure, registry
from harness.precision.quantization import (
    _nvfp4,
    acts,
    budgets,
    formats,
    groups_of,
    layout,
    quantized_model,
)
from harness.suite.loader import load_suite
from tests_support import REPO

DAY0 = REPO / "tests" / "data" / "day0"
QWEN36 = DAY0 / "Qwen3.6-35B-A3B-NVFP4" / "config.json"
REDHAT = DAY0 / "DeepSeek-V4-Flash-NVFP4-FP8.json"
DSV4 = DAY0 / "DeepSeek-V4-Flash.json"


def _pruned(tmp_path, config, name="s"):
    """The suite `harness init` plans for a corpus config, loaded."""
    from harness.cli.init import _plan
    from harness.models.prune import suite_toml

    raw = json.loads(config.read_text())
    plan, _ = _plan(raw, config.name)
    p = tmp_path / f"{name}.toml"
    p.write_text(suite_toml(str(config), raw, plan.prune, plan.why, architecture=plan.architecture))
    return load_suite(p)


def _by_format(ls) -> dict:
    from harness.models.build import build_model

    model, _ = build_model(ls, "float32", "cpu", seed=0)
    out: dict = {}
    for p, g in groups_of(model, layout(ls)).items():
        out.setdefault(g.family if g is not None else None, set()).add(p)
    return out


@pytest.fixture(scope="module")
def qwen36(tmp_path_factory):
    return _pruned(tmp_path_factory.mktemp("q36"), QWEN36, "q36")


def test_modelopts_per_layer_release_is_one_format_per_module(qwen36):
    """The per-layer algorithms name modules by the wrapper's paths; each lands on the text model's."""
    assert formats(qwen36) == ["fp8", "nvfp4"]
    assert acts(qwen36, "fp8") == ["fp8 inputs (per tensor)"]  # ModelOpt FP8 is W8A8, a static input scale
    assert acts(qwen36, "nvfp4") is None  # W4A16_NVFP4: weight only, though config_groups say 4-bit inputs
    by = _by_format(qwen36)
    fp8 = {p for p in by["fp8"] if p.endswith("weight")}
    # the linear attention's projections and the full-attention layer's (layer 3), nothing else
    assert fp8 and all(p.split(".")[-2] in ("in_proj_qkv", "in_proj_z", "out_proj") if ".linear_attn." in p
                       else p.startswith("model.layers.3.self_attn.") for p in fp8), sorted(fp8)
    nv = by["nvfp4"]
    assert "lm_head.weight" in nv  # the release quantizes its head
    assert any(p.endswith("mlp.experts.gate_up_proj") for p in nv)
    assert any(".shared_expert.down_proj" in p for p in nv)
    assert not any(".linear_attn." in p for p in nv)
    kept = by[None]  # what no format names stays in 16 bits: the routers, in_proj_a/b, norms, embeddings
    assert any(p.endswith("mlp.gate.weight") for p in kept) and any("in_proj_b" in p for p in kept)


def test_one_item_per_format_each_quantizing_only_its_own_modules(qwen36):
    from harness.backends import get
    from harness.models.build import build_model

    assert registry().get("quantization").variants(qwen36, get("cpu")) == ["fp8", "nvfp4"]
    clean, _ = build_model(qwen36, "float32", "cpu", seed=qwen36.suite.checks.precision.seed)
    before = dict(clean.named_parameters())
    by = _by_format(qwen36)
    for fam in ("fp8", "nvfp4"):
        model, n = quantized_model(qwen36, None, "float32", scheme=fam)
        changed = {k for k, p in model.named_parameters() if not torch.equal(p, before[k])}
        assert n == len(changed) > 0 and changed <= by[fam], (fam, sorted(changed - by[fam]))


def test_regex_targets_match_the_checkpoints_names_and_declared_4bit_inputs_are_simulated(tmp_path):
    """RedHat's groups target DeepSeek-V4's checkpoint names (``attn.wq_b``, ``ffn.experts...up_proj``);
    the model's are ``self_attn.q_b_proj`` and ``mlp.experts.gate_up_proj``. Its NVFP4 group declares
    4-bit inputs: the experts see their hidden states quantized to e2m1 per 16."""
    ls = _pruned(tmp_path, REDHAT)
    assert formats(ls) == ["fp8", "nvfp4"]
    assert acts(ls, "nvfp4") == ["nvfp4 inputs (per 16)"] and acts(ls, "fp8") == ["fp8 inputs (per 128)"]
    by = _by_format(ls)
    assert any(p.endswith("self_attn.q_b_proj.weight") for p in by["fp8"])
    assert any(p.endswith("self_attn.o_b_proj.weight") for p in by["fp8"])
    assert all(p.endswith(("experts.gate_up_proj", "experts.down_proj")) for p in by["nvfp4"]), by["nvfp4"]
    # vLLM's fused_wqa_wkv is no checkpoint's name: q_a_proj and kv_proj stay unquantized, as read
    assert any(p.endswith("self_attn.q_a_proj.weight") for p in by[None])

    model, n = quantized_model(ls, None, "float32", scheme="nvfp4")
    experts = next(m for k, m in model.named_modules() if k.endswith("layers.0.mlp.experts"))
    seen = {}
    experts.register_forward_pre_hook(lambda _m, args, kwargs: seen.setdefault("raw", (args, kwargs)),
                                      with_kwargs=True, prepend=True)
    ids = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids)
        (x, *rest), kw = seen["raw"]
        hooked = experts(x, *rest, **kw)
        by_hand = experts.forward(_nvfp4(x.reshape(-1, x.shape[-1])).reshape(x.shape), *rest, **kw)
        raw = experts.forward(x, *rest, **kw)
    assert torch.equal(hooked, by_hand) and not torch.equal(hooked, raw)


def test_deepseek_v4s_fp4_experts_beside_its_fp8_blocks(tmp_path):
    ls = _pruned(tmp_path, DSV4)
    assert formats(ls) == ["mxfp4", "fp8"]
    by = _by_format(ls)
    assert by["mxfp4"] and all(".mlp.experts." in p for p in by["mxfp4"])
    assert not any(".experts." in p and ".shared_experts." not in p for p in by["fp8"])
    assert any(".shared_experts." in p for p in by["fp8"])  # shared experts stay FP8, as DeepSeek stores them


def test_top1_agreement_is_judged_only_where_a_bound_could_fail(qwen36):
    """The old derivation gave NVFP4 a min_top1_agreement of 0.0 (nothing can fail it). A bound under
    TOP1_INFORMATIVE is no bound: not judged, and said so in the budget's source."""
    from harness.precision.quantization import TOP1_INFORMATIVE, block_size

    def meas(top1):
        return {"quantization": {"formats": {"nvfp4": {
            "scheme": "nvfp4", "block_size": block_size(qwen36, "nvfp4"), "acts": None, "draws": 4,
            "dtypes": {"float32": {"rel_rmse_max": 0.1, "cosine_min": 0.99, "top1_min": top1, "positions": 16}}}}}}

    low, src = budgets(qwen36, meas(0.3), "float32", "nvfp4")
    assert low["min_top1_agreement"] is None and "top-1 not judged" in src and "30%" in src
    high, src = budgets(qwen36, meas(0.95), "float32", "nvfp4")
    assert high["min_top1_agreement"] >= TOP1_INFORMATIVE and "not judged" not in src
    # a measurement of the other format, or of other inputs, is not this item's budget
    other, src = budgets(qwen36, meas(0.95), "float32", "fp8")
    assert src.startswith("declared budgets")


@pytest.mark.slow
def test_each_format_is_judged_by_its_own_measurement_and_a_wrong_nvfp4_scale_fails_its_item(qwen36, tmp_path):
    """golden generate measures each format alone; the clean items pass against their own budgets and
    an NVFP4 kernel reading its scales one binade low fails the nvfp4 item, by cosine or rel_rmse."""
    from harness.backends import get
    from harness.golden.store import load_golden
    from harness.precision.generate import generate

    root = tmp_path / "golden"
    generate(qwen36, root)
    meas = load_golden(qwen36, root).manifest["quantization"]
    assert set(meas["formats"]) == {"fp8", "nvfp4"}
    assert meas["formats"]["fp8"]["acts"] == ["fp8 inputs (per tensor)"]
    check = registry().get("quantization")
    for fam in ("fp8", "nvfp4"):
        ctx = CheckContext(qwen36, get("cpu"), "float32", fam, check="quantization")
        check.run(ctx, golden_root=root)
        src = dict(ctx.properties)["harness.detail.budget_source"]
        assert src.startswith("measured by golden generate"), src

    def one_binade_low(model):
        with torch.no_grad():
            for k, p in model.named_parameters():
                if ".experts." in k:
                    p.mul_(0.5)
        return model

    ctx = CheckContext(qwen36, get("cpu"), "float32", "nvfp4", check="quantization")
    with pytest.raises(CheckFailure) as e:
        check.run(ctx, golden_root=root, transform=one_binade_low)
    assert str(e.value).startswith("nvfp4 weights exceed the error budget"), str(e.value)


def test_inspect_counts_each_module_in_its_own_format(tmp_path):
    """Read as one format, DeepSeek-V4-Flash's checkpoint was FP8 throughout (its experts are FP4) and
    Qwen3.6's NVFP4 release had no quantized size at all."""
    from harness.inspect.params import inspect_params, load_target

    rep, _ = inspect_params(load_target(str(QWEN36)))
    label = next(k for k in rep.bytes if k.startswith("mixed"))
    parts = rep.bytes[label]
    assert any(k.startswith("float8_e4m3fn (fp8 per-tensor") for k in parts)
    assert any(k.startswith("float4_e2m1") for k in parts)
    assert parts["total"] < 0.4 * rep.bytes["bfloat16"]["total"]
    assert any("several formats by module" in n for n in rep.notes)

    rep, _ = inspect_params(load_target(str(DSV4)))
    mixed = next(v for k, v in rep.bytes.items() if k.startswith("mixed"))["total"]
    fp8_throughout = rep.total  # one byte a parameter, before scales
    assert mixed < 0.6 * fp8_throughout, (mixed, fp8_throughout)
