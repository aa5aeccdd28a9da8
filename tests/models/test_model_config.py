"""Day-0 config resolution and pruning, on the real published configs."""

from __future__ import annotations

import json

import pytest
import torch

from harness.models.build import AdapterError, build_model, load_adapter
from harness.models.config import UnknownArchitectureError, build_config
from harness.suite.loader import load_suite
from harness.suite.schema import PruneSection
from tests_support import REPO_SUITES, TINY_PRUNE

CONFIGS = REPO_SUITES / "configs"


def raw(name: str) -> dict:
    return json.loads((CONFIGS / name).read_text())


def test_kimi_k2_runs_as_deepseek_v3():
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    assert "kimi_k2" not in CONFIG_MAPPING  # the premise: transformers does not register it
    with pytest.raises(ValueError):
        transformers.AutoConfig.for_model("kimi_k2")
    mc = build_config(raw("Kimi-K2-Instruct.json"), PruneSection(num_hidden_layers=2, num_experts=8))
    assert mc.resolved_via == "architectures"
    assert type(mc.config).__name__ == "DeepseekV3Config"
    assert mc.model_type == "kimi_k2"
    assert mc.config.n_routed_experts == 8 and mc.config.num_hidden_layers == 2
    assert any("kimi_k2" in n and "DeepseekV3ForCausalLM" in n for n in mc.notes)


def test_kimi_k2_suite_builds_and_runs_forward():
    ls = load_suite(REPO_SUITES / "kimi-k2.toml")
    model, mc = build_model(ls, "float32")
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    # the distinctive parts survive pruning: one dense layer, then MoE with a shared expert; MLA
    layers = model.model.layers
    assert not hasattr(layers[0].mlp, "experts") and hasattr(layers[1].mlp, "experts")
    assert hasattr(layers[1].mlp, "shared_experts")
    assert hasattr(layers[0].self_attn, "kv_a_proj_with_mqa")
    out = model(input_ids=torch.randint(0, mc.config.vocab_size, (1, 8)))
    assert out.logits.shape == (1, 8, mc.config.vocab_size)


def test_fp8_quantization_config_is_dropped_and_recorded():
    r = raw("DeepSeek-V3.json")
    mc = build_config(r, PruneSection(num_hidden_layers=1))
    assert mc.quantization == {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                               "weight_block_size": [128, 128]}
    assert getattr(mc.config, "quantization_config", None) is None
    assert "quantization_config" in r  # the published dict is not modified


def test_unknown_architecture_says_how_to_plug_in_an_adapter():
    r = raw("Llama-3.1-8B.json") | {"model_type": "brand_new", "architectures": ["BrandNewForCausalLM"]}
    with pytest.raises(UnknownArchitectureError) as e:
        build_config(r, None)
    msg = str(e.value)
    assert "tried architectures[0] 'BrandNewForCausalLM': no such class; model_type 'brand_new': not in the " \
           "config mapping" in msg
    assert "model.architecture" in msg and "model.adapter" in msg and "module:build" in msg
    assert "\n" not in msg


def test_registered_model_type_under_another_class_name():
    """Kimi-K2.5: architectures[0] KimiK25ForConditionalGeneration is not a transformers class, but its
    model_type kimi_k25 maps to Kimi_K25ForConditionalGeneration through the image-text-to-text mapping."""
    import json

    from tests_support import REPO

    r = json.loads((REPO / "tests" / "data" / "day0" / "Kimi-K2.5.json").read_text())
    mc = build_config(r, None)
    assert mc.architecture == "Kimi_K25ForConditionalGeneration" and "image-text-to-text" in mc.resolved_via
    assert any("maps to Kimi_K25ForConditionalGeneration" in n for n in mc.notes)
    assert mc.quantization["quant_method"] == "compressed-tensors"  # found in text_config
    # its language decoder: text_config names DeepseekV3ForCausalLM (model_type kimi_k2 is unregistered)
    mc = build_config(r, PruneSection(num_hidden_layers=2, vocab_size=64), architecture="DeepseekV3ForCausalLM")
    assert mc.part == "text_config" and type(mc.config).__name__ == "DeepseekV3Config"
    assert mc.config.num_hidden_layers == 2 and mc.config.pad_token_id < 64


def test_prune_maps_experts_and_token_ids():
    mc = build_config(raw("Mixtral-8x7B-v0.1.json"), PruneSection(num_experts=4, vocab_size=16))
    assert mc.config.num_local_experts == 4
    mc = build_config(raw("Qwen3-30B-A3B.json"), PruneSection(num_experts=4, vocab_size=64))
    assert mc.config.num_experts == 4
    assert mc.config.bos_token_id < 64 and mc.config.eos_token_id < 64
    mc = build_config(raw("Llama-3.1-8B.json"), PruneSection(num_experts=4))
    assert any("no routed experts" in n for n in mc.notes)


def test_prune_overrides_set_any_key():
    mc = build_config(raw("Llama-3.1-8B.json"), PruneSection(overrides={"rms_norm_eps": 1e-3}))
    assert mc.config.rms_norm_eps == 1e-3


def test_same_seed_same_weights_across_dtypes():
    ls = load_suite(REPO_SUITES / "qwen3-8b.toml")
    m32, _ = build_model(ls, "float32", seed=3)
    m64, _ = build_model(ls, "float64", seed=3)
    other, _ = build_model(ls, "float32", seed=4)
    w32 = m32.model.layers[0].mlp.up_proj.weight
    assert torch.equal(w32.double(), m64.model.layers[0].mlp.up_proj.weight)
    assert not torch.equal(w32, other.model.layers[0].mlp.up_proj.weight)


def test_adapter_errors_are_clear():
    with pytest.raises(AdapterError, match="cannot import 'no_such_pkg.mod': No module named 'no_such_pkg'"):
        load_adapter("no_such_pkg.mod:build")
    with pytest.raises(AdapterError, match="has no callable 'nothing'"):
        load_adapter("json:nothing")


def test_local_safetensors_weights_load(write_suite, suite_dir):
    """Real weights load exactly; a checkpoint that lacks tensors the model needs is an error that
    names the tensor (no silent mix of real and random weights; docs/weights.md)."""
    from safetensors.torch import save_file

    from harness.weights import WeightsError

    body = "[model]\nconfig = 'configs/Llama-3.1-8B.json'\n" + TINY_PRUNE
    model, _ = build_model(load_suite(write_suite("rand", body)), "float32", seed=0)
    full = {k: v.clone() * 2 for k, v in model.state_dict().items()}
    save_file(full, str(suite_dir / "w.safetensors"))
    ls = load_suite(write_suite("local", body.replace("[prune]", "weights = 'w.safetensors'\n[prune]")))
    loaded, mc = build_model(ls, "float32", seed=0)
    for k, v in full.items():
        assert torch.equal(loaded.state_dict()[k], v), k
    part = {k: v for k, v in full.items() if k.startswith("model.layers.0")}
    save_file(part, str(suite_dir / "part.safetensors"))
    ls = load_suite(write_suite("partial", body.replace("[prune]", "weights = 'part.safetensors'\n[prune]")))
    with pytest.raises(WeightsError, match="missing from the checkpoint"):
        build_model(ls, "float32", seed=0)
