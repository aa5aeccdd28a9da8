"""Multimodal wrappers end to end (issue #12 item 3): the smoke check's `wrapper` variant on every
wrapper config of the Day-0 corpus, with a tiny vision tower and a seeded synthetic image.

`harness init` enables the variant; it passes for every corpus wrapper transformers 5.24 can run
(forward, backward with a gradient in every part, training steps, bit-identical reruns), says
NotApplicable in one line where transformers cannot (Llama 4's wrapper forward), and fails naming
the wrapper part when the vision path is broken (an injected fault in the real model).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from harness.checks import CheckContext, CheckFailure, NotApplicable, registry, run_one
from harness.cli.init import init_suite
from harness.models.wrapper import image_batch, is_wrapper, wrapper_config
from harness.suite.loader import load_suite
from tests_support import REPO

DAY0 = REPO / "tests" / "data" / "day0"
WRAPPERS = sorted(p.stem for p in DAY0.glob("*.json") if is_wrapper(json.loads(p.read_text())))
# transformers 5.24's Llama4ForConditionalGeneration.forward reads `image_outputs` from its language
# model's output, which has none: the wrapper cannot run at all in this version (text-only input too).
NOT_RUNNABLE = {"Llama-4-Scout-17B-16E-Instruct": "cannot run Llama4ForConditionalGeneration.forward"}
# A wrapper whose only image processor is a torchvision one, with no config-built layout, is skipped in
# one line naming the processor (test_torchvision_only_processor_is_one_line). None of the corpus's is:
# LFM2-VL's Lfm2VlImageProcessor is built from the config (test_lfm2_vl_layout_is_the_processors).
NEEDS_TORCHVISION: dict[str, str] = {}
# Built from init's plan without init's probes (a default-item backward each: 10-20 s on this machine;
# init itself is exercised on Kimi-K2.5 and Llama 4 here and on every config by test_day0.py).
PLAN_ONLY = {"gemma-4-26B-A4B", "Qwen3-VL-30B-A3B-Instruct", "Qwen3.5-35B-A3B", "Qwen3.5-27B", "Muse-Glimmer-30B"}
# Slow-marked: Gemma 4's item (~4 s alone: its processor fills at least 70 soft tokens, 630 patches).
SLOW = {"gemma-4-26B-A4B"}


def _params():
    for name in WRAPPERS:
        yield pytest.param(name, id=name, marks=[pytest.mark.slow] if name in SLOW else [])


@pytest.fixture(scope="module")
def suites(tmp_path_factory):
    """`harness init` for a corpus config, once per module (the suite is what the CLI would write)."""
    out = tmp_path_factory.mktemp("suites")
    made: dict[str, object] = {}

    def get(name):
        if name not in made:
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            if name in PLAN_ONLY:  # what init writes, without its probes (a default-item backward each: 10-20 s)
                made[name] = load_suite(_plan_suite(name, out))
            else:
                made[name] = load_suite(init_suite(DAY0 / f"{name}.json", suites_dir=out, name=name.lower()))
        return made[name]

    return get


def _plan_suite(name, out):
    """The suite `harness init` writes for a corpus config (its plan, `wrapper = true`), without init's
    size guard and backward probes."""
    from harness.cli.init import _plan
    from harness.models.prune import suite_toml

    cfg = DAY0 / f"{name}.json"
    raw = json.loads(cfg.read_text())
    plan, _ = _plan(raw, cfg.name)
    path = out / f"{name.lower()}.toml"
    path.write_text(suite_toml(str(cfg), raw, plan.prune, plan.why, architecture=plan.architecture,
                               smoke={"wrapper": True}))
    return path


@pytest.fixture(scope="module")
def variant(suites):
    """The wrapper item's metrics (cpu, float32), run once per config."""
    done: dict[str, dict] = {}

    def get(name):
        if name not in done:
            ctx = run_one(suites(name), "smoke", "cpu", "float32", "wrapper")
            done[name] = {k: float(v) for k, v in ctx.properties if k.startswith("metric.")}
        return done[name]

    return get


def _decoder_parameters(ls) -> int:
    """Parameters of the suite's own (default item's) model, counted on the meta device."""
    from harness.inspect.params import Target, meta_model

    model, _ = meta_model(Target(ls.name, ls.raw_config, ls, ls.path), pruned=True, dtype=torch.float32)
    return sum(p.numel() for p in model.parameters())


def test_corpus_wrappers_are_the_ones_with_a_text_config():
    assert set(WRAPPERS) == {"gemma-4-26B-A4B", "Kimi-K2.5", "Llama-4-Scout-17B-16E-Instruct",
                             "Qwen3-VL-30B-A3B-Instruct", "Qwen3.5-35B-A3B", "Qwen3.5-27B", "LFM2-VL-450M",
                             "Muse-Glimmer-30B"}


@pytest.mark.parametrize("name", list(_params()))
def test_wrapper_variant_end_to_end(name, suites, variant):
    ls = suites(name)
    assert ls.suite.checks.smoke.wrapper is True  # init (or its plan, for the slow ones) enabled the variant
    assert registry().get("smoke").variants(ls, None) == [None, "wrapper"]
    if name in NOT_RUNNABLE:
        with pytest.raises(NotApplicable) as e:
            run_one(ls, "smoke", "cpu", "float32", "wrapper")
        line = str(e.value)
        assert NOT_RUNNABLE[name] in line and "\n" not in line and "Traceback" not in line
        assert "transformers" in line and "AttributeError" in line
        assert NOT_RUNNABLE[name] in ls.path.read_text()  # init said so in the suite's comment
        return
    if name in NEEDS_TORCHVISION:
        with pytest.raises(NotApplicable) as e:
            run_one(ls, "smoke", "cpu", "float32", "wrapper")
        line = str(e.value)
        assert f"its image processor {NEEDS_TORCHVISION[name]} needs torchvision" in line and "\n" not in line
        assert NEEDS_TORCHVISION[name] in ls.path.read_text()  # init said so in the suite's comment
        return
    p = variant(name)
    for part in ("text", "vision", "projector"):
        assert p[f"metric.parameters_{part}"] > 0 and p[f"metric.grad_norm_{part}"] > 0, part
    assert p["metric.parameters"] < 4_000_000  # a few layers, small widths (Gemma-4: 3.05M, its head sizes published)
    assert p["metric.image_tokens"] >= 4 and p["metric.image_logit_change"] > 0
    assert p["metric.loss_final"] < p["metric.loss_initial"] and p["metric.logits_bitwise_equal"] == 1.0
    # the wrapper's language model is the suite's own decoder, parameter for parameter (the default item
    # builds it alone as the causal LM), except where the suite already builds the whole wrapper
    if ls.suite.model.architecture:
        assert p["metric.parameters_text"] == _decoder_parameters(ls)
    assert sum(p[f"metric.parameters_{part}"] for part in ("text", "vision", "projector")) == p["metric.parameters"]


@pytest.mark.parametrize("name", [n for n in _params() if n.values[0] not in {**NOT_RUNNABLE, **NEEDS_TORCHVISION}])
def test_inspect_parts_agree_with_what_the_variant_builds(name, suites, variant):
    """`harness inspect CONFIG.json` splits the full-size wrapper into the same parts, by the same module
    paths, as the variant's pruned wrapper; and on the pruned one its per-part totals are the variant's."""
    from harness.inspect.params import Target, count_parameters, inspect_params, meta_model
    from harness.models.build import model_config

    ls = suites(name)
    raw = json.loads((DAY0 / f"{name}.json").read_text())
    full, _ = inspect_params(Target(name, raw, None, DAY0 / f"{name}.json"))
    mc, _ = wrapper_config(ls, model_config(ls))
    model, _ = meta_model(Target(name, raw), mc=mc, dtype=torch.float32)
    pruned = count_parameters(model, mc)
    assert set(full.by_part) == set(pruned.by_part) == {"text", "vision", "projector", "overall"}
    p = variant(name)
    for part in ("text", "vision", "projector"):
        assert pruned.by_part[part] == p[f"metric.parameters_{part}"], part
    assert full.by_part["vision"] > 100 * pruned.by_part["vision"]  # the full tower was really pruned


def _run_with(ls, transform):
    ctx = CheckContext(ls, __import__("harness.backends", fromlist=["get"]).get("cpu"), "float32", "wrapper",
                       check="smoke")
    registry().get("smoke").run(ctx, transform=transform)
    return ctx


def zero_projector(model):
    """Fault: the multimodal projector's output is zeroed (a broken projection kernel)."""
    model.model.mm_projector.register_forward_hook(lambda m, a, out: out * 0)
    return model


def drop_one_image_feature(model):
    """Fault: the vision path returns one image feature too few for the last image (a merge that
    emits a different token count than the processor's layout)."""
    inner = model.model.get_image_features

    def short(*args, **kwargs):
        out = inner(*args, **kwargs)
        out.pooler_output = (*out.pooler_output[:-1], out.pooler_output[-1][:-1])
        return out

    model.model.get_image_features = short
    return model


def test_zeroed_projector_fails_naming_the_projector(suites):
    ls = suites("Kimi-K2.5")
    _run_with(ls, None)  # the same suite passes without the fault
    with pytest.raises(CheckFailure) as e:
        _run_with(ls, zero_projector)
    msg = str(e.value)
    assert "the image does not reach the logits" in msg and "projector module model.mm_projector" in msg
    assert e.value.metric == "image_logit_change"


def test_image_token_count_mismatch_fails_naming_the_parts(suites):
    ls = suites("Kimi-K2.5")
    with pytest.raises(CheckFailure) as e:
        _run_with(ls, drop_one_image_feature)
    msg = str(e.value)
    assert "image features do not match the image tokens" in msg and "4 image tokens per sequence" in msg
    assert "model.mm_projector" in msg and e.value.metric == "image_tokens"


def test_image_layout_follows_the_processor(tmp_path):
    """Qwen's PIL image processor makes the pixels; the model's own placeholder check counts the image
    tokens, which is the processor's formula grid / merge²."""
    from harness.models.build import model_config

    ls = load_suite(_plan_suite("Qwen3.5-35B-A3B", tmp_path))

    mc, why = wrapper_config(ls, model_config(ls))
    b = image_batch(mc.config, 2, 16, 1, architecture=mc.architecture)
    assert b.how.startswith("processor Qwen2VLImageProcessorPil") and "counted by the model's own check" in b.how
    grid = b.inputs["image_grid_thw"]
    assert b.image_tokens == 4 == int(grid[0].prod()) // mc.config.vision_config.spatial_merge_size ** 2
    ids = b.inputs["input_ids"]
    assert ids.shape == (2, 20) and int((ids == mc.config.image_token_id).sum()) == 8
    assert (b.labels == -100).sum() == 8 and b.inputs["mm_token_type_ids"].sum() == 8
    assert mc.config.vision_config.out_hidden_size == mc.config.text_config.hidden_size == 64
    b2 = image_batch(mc.config, 2, 16, 1, architecture=mc.architecture)
    assert torch.equal(b.inputs["pixel_values"], b2.inputs["pixel_values"])  # seeded


def test_non_wrapper_suite_with_wrapper_true_is_not_applicable(write_suite):
    from tests_support import TINY_PRUNE

    ls = load_suite(write_suite("flat", '[model]\nconfig = "configs/Llama-3.1-8B.json"\n' + TINY_PRUNE
                                + "\n[checks.smoke]\nwrapper = true\n"))
    with pytest.raises(NotApplicable, match="not a multimodal wrapper"):
        run_one(ls, "smoke", "cpu", "float32", "wrapper")


@pytest.mark.slow
def test_wrapper_item_through_the_cli(tmp_path):
    """`harness init` then `harness run --check smoke`: the wrapper item is collected and passes."""
    (tmp_path / "harness.toml").write_text('suites_dir = "suites"\ngolden_dir = "golden"\nresults_dir = "results"\n')
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HARNESS_CONFIG": str(tmp_path / "harness.toml")}

    def harness(*args):
        return subprocess.run([sys.executable, "-m", "harness", *args], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=600)

    r = harness("init", str(DAY0 / "Kimi-K2.5.json"), "--name", "kimi-k2.5")
    assert r.returncode == 0 and "smoke[cpu-float32-wrapper] passed" in r.stdout, r.stdout + r.stderr
    r = harness("run", "kimi-k2.5", "--check", "smoke", "--backend", "cpu", "--dtype", "bfloat16")
    assert r.returncode == 0 and "0 failed, 0 errors" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]
    junit = (tmp_path / "results" / "junit.xml").read_text()
    assert "smoke[cpu-bfloat16-wrapper]" in junit and "smoke[cpu-bfloat16]" in junit


def projector_returns_none(model):
    """Fault: the projector returns nothing; transformers then raises AttributeError in its own code."""
    model.model.mm_projector.register_forward_hook(lambda m, a, out: _Nothing())
    return model


class _Nothing:
    """Stands for a missing projector output: transformers' `.squeeze` on it raises AttributeError."""


def test_broken_vision_path_inside_transformers_fails_not_skips(suites):
    """An AttributeError in transformers' code is "this transformers cannot run the wrapper" only when the
    wrapper's own forward fails on text alone too (Llama 4 in 5.24); a broken image path is a failure."""
    ls = suites("Kimi-K2.5")
    with pytest.raises(AttributeError, match="squeeze"):
        _run_with(ls, projector_returns_none)


@pytest.mark.parametrize(("name", "processor", "tokens"), [
    ("Qwen3-VL-30B-A3B-Instruct", "processor Qwen2VLImageProcessorPil (registered for qwen3_vl)", 4),
    ("gemma-4-26B-A4B", "processor Gemma4ImageProcessorPil", None),
    ("Kimi-K2.5", "built from the config (Kimi_K25ImageProcessor needs torchvision)", 4),
    ("LFM2-VL-450M", "built from the config (Lfm2VlImageProcessor needs torchvision)", 4),
], ids=["qwen3_vl_moe", "gemma4", "kimi_k25", "lfm2_vl"])
def test_image_layout_is_derived_not_listed(name, processor, tokens, tmp_path):
    """Issue #29 item 2: the layout comes from transformers' own image-processor registry for the
    wrapper's model type (a model type without an entry takes its family's: qwen3_vl_moe -> qwen3_vl),
    its knobs from the pruned vision config, its budget the smallest the processor accepts (Gemma 4:
    70 soft tokens), and the image-token count from the model's own placeholder check. Torchvision-only
    processors are built from the config where harness reproduces them, else a one-line skip."""
    from harness.models.build import model_config
    from harness.models.wrapper import image_layout

    ls = load_suite(_plan_suite(name, tmp_path))
    mc, _ = wrapper_config(ls, model_config(ls))
    b = image_batch(mc.config, 2, 8, 1, architecture=mc.architecture)
    assert b.how.startswith(processor), b.how
    if name == "gemma-4-26B-A4B":  # the processor's own count of soft tokens is the model's
        assert b.image_tokens == int(b.inputs["num_soft_tokens_per_image"][0]) if "num_soft_tokens_per_image" in \
            b.inputs else b.image_tokens <= 70
        assert b.image_tokens <= 70 and b.inputs["pixel_values"].shape[1] <= 70 * 9
    else:
        assert b.image_tokens == tokens
    assert int((b.inputs["input_ids"] == mc.config.image_token_id).sum()) == 2 * b.image_tokens
    layout, why = image_layout("no_such_vl")
    assert layout is None and "registers no image processor for model_type 'no_such_vl'" in why


def _upstream(module: str, *names: str) -> dict:
    """Functions of a transformers module that cannot be imported here (its torchvision import), taken
    from its source by name and run as they are: the processor's own arithmetic to compare with."""
    import ast
    import math

    spec = importlib.util.find_spec(module)
    tree = ast.parse(open(spec.origin).read())
    fns = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
    assert {f.name for f in fns} == set(names), names
    for f in fns:
        f.decorator_list = []
    ns: dict = {"torch": torch, "math": math}
    exec(compile(ast.Module(body=fns, type_ignores=[]), spec.origin, "exec"), ns)
    return ns


def test_lfm2_vl_layout_is_the_processors(tmp_path):
    """LFM2-VL (issue #29 item 2): its only processor needs torchvision, so its inputs are built from the
    config. The patches and padding are what transformers' own convert_image_to_patches and
    pad_along_first_dim make of the same normalized image, the tower's mask hides the padding (other
    values there change nothing), and the model's own check counts 4 tokens per image."""
    from harness.models.build import model_config
    from harness.models.config import architecture_class
    from harness.models.wrapper import _image

    ls = load_suite(_plan_suite("LFM2-VL-450M", tmp_path))
    mc, _ = wrapper_config(ls, model_config(ls))
    b = image_batch(mc.config, 2, 8, 3, architecture=mc.architecture)
    px, mask, shapes = b.inputs["pixel_values"], b.inputs["pixel_attention_mask"], b.inputs["spatial_shapes"]
    up = _upstream("transformers.models.lfm2_vl.image_processing_lfm2_vl", "convert_image_to_patches",
                   "pad_along_first_dim")
    p, f = mc.config.vision_config.patch_size, mc.config.downsample_factor
    side = p * f * 2
    imgs = torch.stack([_image(3 + i, side).float() / 255 for i in range(2)])
    imgs = (imgs - 0.5) / 0.5  # the processor's rescale 1/255 and IMAGENET_STANDARD mean / std 0.5
    want, want_mask = up["pad_along_first_dim"](up["convert_image_to_patches"](imgs, p), px.shape[1])
    assert torch.equal(px, want) and torch.equal(mask, torch.stack([want_mask] * 2))
    assert shapes.tolist() == [[side // p, side // p]] * 2 and int(mask.sum()) == 2 * (side // p) ** 2
    assert b.image_tokens == 4 and b.inputs["input_ids"].shape == (2, 12)
    torch.manual_seed(0)
    model = architecture_class(mc.architecture)(mc.config).float().eval()
    noisy = px.clone()
    noisy[mask == 0] = 7.0  # padding patches: the mask keeps them out of every real token
    with torch.no_grad():
        a = model(**b.inputs).logits
        c = model(**{**b.inputs, "pixel_values": noisy}).logits
        d = model(**{**b.inputs, "pixel_values": px.flip(0)}).logits  # the images swapped: a real change
    assert torch.equal(a, c) and not torch.allclose(a, d)


def test_torchvision_only_processor_is_one_line(monkeypatch):
    """A wrapper whose only image processor needs torchvision and has no config-built layout gets its
    image inputs in the shape its own tower takes (issue #50: Muse-Glimmer); where no shape built from
    the config fits, one line naming the processor and the fix (tests/models/test_prune_subconfigs.py)."""
    from harness.models import wrapper

    monkeypatch.setattr(wrapper, "_torchvision", lambda: False)
    monkeypatch.setattr(wrapper, "CONFIG_BUILT", {k: v for k, v in wrapper.CONFIG_BUILT.items()
                                                  if k != "Lfm2VlImageProcessor"})
    layout, why = wrapper.image_layout("lfm2_vl")
    assert layout.func is wrapper._from_shapes and why == "built from the config (Lfm2VlImageProcessor needs torchvision)"
    raw = json.loads((DAY0 / "LFM2-VL-450M.json").read_text())
    assert wrapper.supported(raw) is None  # decided when the tower is tried: the item, not the collection
