"""Issue #50 class 5: pruning covers every per-layer list and every width of every part of a multimodal
wrapper (vision, audio, projector), not only the text decoder; and a wrapper whose only image processor
needs torchvision still runs end to end, its image tensor built from the vision config.

Muse-Glimmer-30B (tests/data/day0, 2026) is the release that was refused: its pruned vision tower kept a
50-entry ``layer_types`` beside one layer, and its projector widths (``out_hidden_size`` 6144 = 4 x the
vision width, ``projector_hidden_size`` 4096) stayed published (a 42.9M-parameter "pruned" model).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from harness.models.config import apply_prune, build_config
from harness.models.prune import plan_config, plan_for, plan_wrapper_vision
from harness.suite.schema import PruneSection
from tests_support import REPO

DAY0 = REPO / "tests" / "data" / "day0"


def _raw(name: str) -> dict:
    return json.loads((DAY0 / f"{name}.json").read_text())


def _params_on_meta(mc) -> int:
    from harness.models.build import architecture_class

    with torch.device("meta"):
        model = architecture_class(mc.architecture)(mc.config)
    return sum(p.numel() for p in model.parameters())


def test_vision_tower_lists_and_projector_widths_of_a_2026_release_are_pruned():
    raw = _raw("Muse-Glimmer-30B")
    plan, arch = plan_for(raw, "Muse-Glimmer-30B.json")
    assert arch == "MuseGlimmerForConditionalGeneration" and plan.part is None  # the whole wrapper
    ov = plan.prune["overrides"]
    # the vision tower: every layer kind of its layer_types kept (3 window + 1 full), the list cut with it
    assert ov["vision_config.num_hidden_layers"] == 4
    assert ov["vision_config.layer_types"] == ["window_attention"] * 3 + ["full_attention"]
    # the projector: out_hidden_size keeps its published 4:1 ratio to the vision width (the merged 2x2
    # patches it reads), projector_hidden_size has none and is cut, each said in the suite comment
    assert ov["out_hidden_size"] == 4 * ov["vision_config.hidden_size"] == 128
    assert ov["projector_hidden_size"] == 64
    assert "wrapper: out_hidden_size 6144 -> 128 (4 x vision_config.hidden_size: the published ratio kept)" in plan.why
    assert any(w.startswith("vision_config: layers: the first 4 of 50 (2 kinds from layer_types)") for w in plan.why)
    mc = build_config(raw, PruneSection.model_validate(plan.prune), architecture=plan.architecture or None)
    vc = mc.config.vision_config
    assert vc.num_hidden_layers == len(vc.layer_types) == 4  # transformers validates this: it refused before
    assert _params_on_meta(mc) < 2_500_000  # 1,924,416 with its head sizes kept at 128 (the hand-fixed suite of the issue: 42.9M)


def _planted() -> dict:
    """A real wrapper config (LFM2-VL) with a planted audio part: per-layer lists (kinds and head counts),
    a width 3x its own, an output width equal to the decoder's; and a wrapper width that is half
    the decoder's. The plan reads their structure, not their names."""
    raw = _raw("LFM2-VL-450M")
    raw["audio_config"] = {
        "d_model": 1280, "encoder_layers": 8, "encoder_ffn_dim": 5120, "adapter_hidden_size": 3840,
        "output_hidden_size": 1024,
        "block_types": ["conv", "conv", "conv", "attn"] * 2, "heads_per_layer": [20] * 8,
        "attention_window_indexes": [3, 7], "patch_size": 16,
    }
    raw["audio_projector_dim"] = 512  # text hidden 1024 / 2
    return raw


def test_every_part_keeps_its_layer_kinds_and_width_ratios():
    raw = _planted()
    plan = plan_config(raw, decoder_only=False)
    ov = plan.prune["overrides"]
    assert ov["audio_config.encoder_layers"] == 4  # the prefix holding both block kinds
    assert ov["audio_config.block_types"] == ["conv", "conv", "conv", "attn"]
    assert ov["audio_config.heads_per_layer"] == [2] * 4  # a per-layer head list: cut and pruned
    assert ov["audio_config.attention_window_indexes"] == [3]  # indices inside the kept layers
    assert ov["audio_config.d_model"] == 32
    assert ov["audio_config.encoder_ffn_dim"] == 64  # its MLP width: the vision MLP rule
    assert ov["audio_config.adapter_hidden_size"] == 3 * 32  # 3 x its own width, as published
    assert ov["audio_config.output_hidden_size"] == ov["text_config.hidden_size"] == 64  # feeds the decoder
    assert ov["audio_projector_dim"] == 32  # text_config.hidden_size / 2
    assert "audio_config.patch_size" not in ov  # an input size, not a width
    # the vision part (one layer kind) is still one layer, and LFM2-VL's projector width is cut
    assert ov["vision_config.num_hidden_layers"] == 1 and ov["projector_hidden_size"] == 64
    pruned = copy.deepcopy(raw)
    apply_prune(pruned, PruneSection.model_validate(plan.prune))
    a = pruned["audio_config"]
    assert len(a["block_types"]) == len(a["heads_per_layer"]) == a["encoder_layers"]


def test_wrapper_variant_prunes_every_part_from_the_effective_config():
    """The smoke check's wrapper variant (plan_wrapper_vision, from what transformers builds): the same
    layer kinds and projector widths as the suite's plan; LFM2-VL's projector, 494,400 parameters when
    its projector_hidden_size 2560 was left as published, is now 12,672."""
    from harness.inspect.params import Target, count_parameters, meta_model
    from harness.models.wrapper import _effective, wrapper_architecture

    raw = _raw("Muse-Glimmer-30B")
    up, why = plan_wrapper_vision(_effective(raw, wrapper_architecture(raw)), 64)
    assert up["vision_config.num_hidden_layers"] == len(up["vision_config.layer_types"]) == 4
    assert up["out_hidden_size"] == 4 * up["vision_config.hidden_size"] and up["projector_hidden_size"] == 64
    raw = _raw("LFM2-VL-450M")
    full = _effective(raw, wrapper_architecture(raw))
    up, why = plan_wrapper_vision(full, 64)
    assert up["projector_hidden_size"] == 64
    d = copy.deepcopy(raw)
    plan, _ = plan_for(raw, "LFM2-VL-450M.json")
    apply_prune(d["text_config"], PruneSection.model_validate(plan.prune))
    for k, v in up.items():
        from harness.models.config import _set_path

        _set_path(d, k, v)
    mc = build_config(d, None, architecture=wrapper_architecture(raw))
    model, _ = meta_model(Target("lfm2", raw), mc=mc, dtype=torch.float32)
    assert count_parameters(model, mc).by_part["projector"] == 12_672


@pytest.fixture(scope="module")
def muse(tmp_path_factory):
    from harness.models.build import model_config
    from harness.models.prune import suite_toml
    from harness.models.wrapper import wrapper_config
    from harness.suite.loader import load_suite

    raw = _raw("Muse-Glimmer-30B")
    plan, _ = plan_for(raw, "Muse-Glimmer-30B.json")
    path = tmp_path_factory.mktemp("s") / "muse.toml"
    path.write_text(suite_toml(str(DAY0 / "Muse-Glimmer-30B.json"), raw, plan.prune, plan.why,
                               architecture=plan.architecture, smoke={"wrapper": True}))
    ls = load_suite(path)
    mc, _ = wrapper_config(ls, model_config(ls))
    return mc.config, mc.architecture


def test_torchvision_only_processor_gets_its_image_tensor_from_the_config(muse):
    """MuseGlimmerImageProcessor is torchvision-only (not installed, and not to be: it is built for
    another torch): the image inputs are built from the vision config in the shape the tower's own
    get_image_features takes, [N, T*C*p*p] patches with image_grid_thw, and the image reaches the logits."""
    from harness.models.config import architecture_class
    from harness.models.wrapper import _torchvision, image_batch

    assert not _torchvision()
    cfg, arch = muse
    vc = cfg.vision_config
    b = image_batch(cfg, 2, 8, 1, architecture=arch)
    assert b.how.startswith("built from the config (MuseGlimmerImageProcessor needs torchvision): patches"), b.how
    g = 2 * vc.merge_size
    assert b.inputs["pixel_values"].shape == (2 * g * g, vc.patch_temporal * 3 * vc.patch_size ** 2)
    assert b.inputs["image_grid_thw"].tolist() == [[1, g, g]] * 2
    assert b.image_tokens == g * g // vc.merge_size ** 2 == 4  # counted by the model's own check
    assert b.inputs["pixel_values"].abs().max() <= 1.0
    again = image_batch(cfg, 2, 8, 1, architecture=arch)
    assert torch.equal(b.inputs["pixel_values"], again.inputs["pixel_values"])  # seeded
    other = image_batch(cfg, 2, 8, 1, image_seed=99, architecture=arch)
    torch.manual_seed(0)
    model = architecture_class(arch)(cfg).float().eval()
    with torch.no_grad():
        a = model(**b.inputs).logits
        c = model(**{**b.inputs, "pixel_values": other.inputs["pixel_values"]}).logits
    assert a.shape[:2] == b.inputs["input_ids"].shape and not torch.allclose(a, c)


def test_no_shape_fits_is_one_line(monkeypatch, tmp_path):
    """A torchvision-only processor whose tower takes inputs no config-built shape makes (LFM2-VL's NaFlex
    tower wants a pixel mask and spatial shapes) is still one line naming the processor and the fix."""
    from harness.models import wrapper
    from harness.models.build import model_config
    from harness.models.prune import suite_toml
    from harness.suite.loader import load_suite

    monkeypatch.setattr(wrapper, "CONFIG_BUILT", {k: v for k, v in wrapper.CONFIG_BUILT.items()
                                                  if k != "Lfm2VlImageProcessor"})
    raw = _raw("LFM2-VL-450M")
    plan, _ = plan_for(raw, "LFM2-VL-450M.json")
    path = tmp_path / "lfm2.toml"
    path.write_text(suite_toml(str(DAY0 / "LFM2-VL-450M.json"), raw, plan.prune, plan.why,
                               architecture=plan.architecture, smoke={"wrapper": True}))
    ls = load_suite(path)
    mc, _ = wrapper.wrapper_config(ls, model_config(ls))
    with pytest.raises(wrapper.WrapperNotApplicable) as e:
        wrapper.image_batch(mc.config, 2, 8, 1, architecture=mc.architecture)
    line = str(e.value)
    assert line.startswith("its image processor Lfm2VlImageProcessor needs torchvision") and "\n" not in line
    assert "pip install torchvision" in line and "get_image_features(" in line
