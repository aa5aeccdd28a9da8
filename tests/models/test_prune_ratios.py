"""Issue #50: pruning keeps every published ratio a kernel groups heads by, or names it; and it finds
the layer count in whatever key the config has it (items 1 and 4).

Real configs of 2026 releases (tests/data/day0/SOURCES.md): Qwen3.5's linear-attention value:key heads
(27B 48:16 = 3:1, 35B-A3B 32:16 = 2:1), Gemma 4's per-layer-type GQA (16 query heads over 8 KV heads on
sliding layers, over 2 on global ones), Nemotron-3's Mamba heads per group (Nano 64:8, Ultra 256:8),
DeepSeek-V4's query heads per output group (64:8), and Nemotron-3-Ultra, whose only layer count is
the 108 entries of ``layers_block_type``.
"""

from __future__ import annotations

import json
from fractions import Fraction

import pytest
import torch

from harness.cli.init import _plan as init_plan
from harness.models.config import build_config
from harness.models.prune import RATIO_CHANGED, plan_config
from harness.suite.schema import PruneSection
from tests_support import REPO

DAY0 = REPO / "tests" / "data" / "day0"
ULTRA = DAY0 / "Nemotron-3-Ultra-550B-A55B-BF16.json"
CONFIGS = sorted(DAY0.glob("*.json")) + sorted((REPO / "suites" / "configs").glob("*.json"))
# (many, few): the published ratio many:few is what a kernel groups by. Written here, not read from
# prune.py, so a pair the pruning forgets is still checked.
PAIRS = [("num_attention_heads", "num_key_value_heads"), ("num_attention_heads", "num_global_key_value_heads"),
         ("num_attention_heads", "o_groups"), ("linear_num_value_heads", "linear_num_key_heads"),
         ("mamba_num_heads", "n_groups")]


def _raw(p) -> dict:
    return json.loads(p.read_text())


def _text(raw: dict, plan) -> dict:
    return raw[plan.part] if plan.part else raw


def _pruned(plan) -> dict:
    return {**plan.prune, **(plan.prune.get("overrides") or {})}


def _fmt(a: int, b: int) -> str:
    f = Fraction(a, b)
    return f"{f.numerator}:{f.denominator}"


def _plan_or_skip(p):
    from harness.cli.init import InitRefused

    try:
        return init_plan(_raw(p), p.name)[0]
    except InitRefused as e:  # refused in one line (tests/models/test_day0.py): no ratio to keep
        pytest.skip(str(e))


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_every_published_ratio_is_kept_or_named(config):
    plan = _plan_or_skip(config)
    text, pruned = _text(_raw(config), plan), _pruned(plan)
    for many, few in PAIRS:
        if not all(isinstance(text.get(k), int) and text[k] > 0 for k in (many, few)):
            continue
        a, b = pruned.get(many, text[many]), pruned.get(few, text[few])
        assert a <= text[many] and b <= text[few], (many, few, a, b)
        if Fraction(a, b) == Fraction(text[many], text[few]):
            continue
        said = [w for w in plan.ratio_changes if f"{_fmt(text[many], text[few])} -> {_fmt(a, b)}" in w]
        assert said, f"{many}:{few} {text[many]}:{text[few]} -> {a}:{b} changed without a word: {plan.why}"


def test_the_ratios_issue_50_found_changed_are_kept():
    def kept(name, many, few):
        plan = plan_config(_raw(DAY0 / name))
        text, pruned = _text(_raw(DAY0 / name), plan), _pruned(plan)
        return (pruned[many], pruned[few]), Fraction(pruned[many], pruned[few]) == Fraction(text[many], text[few])

    assert kept("Qwen3.5-27B.json", "linear_num_value_heads", "linear_num_key_heads") == ((6, 2), True)  # was 4:1
    assert kept("Qwen3.5-35B-A3B.json", "linear_num_value_heads", "linear_num_key_heads") == ((4, 2), True)
    assert kept("gemma-4-26B-A4B.json", "num_attention_heads", "num_global_key_value_heads") == ((8, 1), True)  # was 2:1
    assert kept("gemma-4-26B-A4B.json", "num_attention_heads", "num_key_value_heads") == ((8, 4), True)
    assert kept("Nemotron-3-Nano-30B-A3B-BF16.json", "mamba_num_heads", "n_groups") == ((8, 1), True)  # was 4
    assert kept("Nemotron-3-Ultra-550B-A55B-BF16.json", "mamba_num_heads", "n_groups") == ((32, 1), True)
    assert kept("DeepSeek-V4-Flash.json", "num_attention_heads", "o_groups") == ((16, 2), True)  # was 16 per group


def test_a_flavour_published_with_the_main_heads_keeps_them_when_pruned():
    # MiMo-V2-Flash: swa_num_attention_heads 64 = num_attention_heads, swa KV heads 8 = 2 x 4. transformers
    # builds its sliding layers from num_attention_heads (KV heads doubled), vLLM from the swa_ keys: pruned
    # apart (16 vs 8 query heads) the engine and the reference were two models and vLLM failed loading the
    # sinks ("size of tensor a (8) must match ... (16)"). Kept equal, each keeps its own GQA ratio.
    pruned = _pruned(plan_config(_raw(DAY0 / "MiMo-V2-Flash.json")))
    assert pruned["swa_num_attention_heads"] == pruned["num_attention_heads"] == 16
    assert (pruned["swa_num_key_value_heads"], pruned["num_key_value_heads"]) == (2, 1)  # 8:1 and 16:1, as published


@pytest.mark.parametrize("name", ["Qwen3.5-27B", "gemma-4-26B-A4B", "DeepSeek-V4-Flash",
                                  "Nemotron-3-Nano-30B-A3B-BF16", "Nemotron-3-Ultra-550B-A55B-BF16"])
def test_pruned_models_with_the_kept_ratios_build_and_run(name):
    """transformers takes the kept ratios: the pruned model runs a forward with finite logits, and its
    modules have the published grouping (Gemma 4's global layers: 8 query heads per KV head)."""
    from harness.models.build import architecture_class

    raw = _raw(DAY0 / f"{name}.json")
    plan = init_plan(raw, name)[0]
    mc = build_config(raw, PruneSection.model_validate(plan.prune), architecture=plan.architecture or None)
    torch.manual_seed(0)
    model = architecture_class(mc.architecture)(mc.config).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.randint(0, mc.config.get_text_config().vocab_size, (1, 8))).logits
    assert torch.isfinite(logits).all()
    if name.startswith("gemma"):
        cfg = mc.config.get_text_config()
        glob = cfg.layer_types.index("full_attention")
        attn = model.model.layers[glob].self_attn
        assert attn.k_proj.out_features // attn.head_dim == 1 and attn.q_proj.out_features // attn.head_dim == 8


def test_layer_count_from_the_per_layer_list_alone():
    """Nemotron-3-Ultra has no num_hidden_layers: its 108 layers are the length of layers_block_type.
    Read for a count key alone it was not pruned (issue #50: a float64 golden of ~1e32 activations)."""
    raw = _raw(ULTRA)
    assert not any(k in raw for k in ("num_hidden_layers", "num_layers", "n_layers", "n_layer"))
    plan = plan_config(raw)
    kinds = _pruned(plan)["layers_block_type"]
    assert 2 <= len(kinds) <= 8 and set(kinds) == set(raw["layers_block_type"])
    assert kinds == raw["layers_block_type"][: len(kinds)]  # a prefix: absolute layer indices kept
    assert "num_hidden_layers" not in plan.prune  # the count follows the list, as transformers reads it
    assert any("no layer count: 108 is the length of layers_block_type" in w for w in plan.why)
    mc = build_config(raw, PruneSection.model_validate(plan.prune))
    assert mc.config.num_hidden_layers == len(kinds)


def _init(argv, capsys):
    import argparse

    from harness.cli import init as cli_init

    p = argparse.ArgumentParser()
    cli_init.register(p.add_subparsers())
    args = p.parse_args(["init", *argv])
    rc = args.func(args)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_init_prunes_it_and_says_the_ratio_it_changed(tmp_path, capsys):
    """`harness init` on Nemotron-3-Ultra writes a pruned suite (8 layers, 634k parameters) and prints,
    as the suite says, the one published ratio it does not keep: 32:1 GQA capped at 16:1."""
    import tomllib

    rc, out, err = _init([str(ULTRA), "--suites-dir", str(tmp_path / "s"), "--name", "ultra", "--no-validate"], capsys)
    assert rc == 0, err
    text = (tmp_path / "s" / "ultra.toml").read_text()
    suite = tomllib.loads(text)
    assert len(suite["prune"]["overrides"]["layers_block_type"]) <= 8
    changed = [line.strip() for line in out.splitlines() if line.startswith("note: " + RATIO_CHANGED)]
    assert changed == [f"note: {RATIO_CHANGED} num_attention_heads query:KV heads 32:1 -> 16:1 (capped: more than "
                       "16 query heads per KV head made a pruned float64 golden take minutes)"], out
    assert changed[0].removeprefix("note: ") in text  # the suite's comment says it too
    assert "Mamba heads:groups (mamba_num_heads:n_groups): 256:8 -> 32:1, ratio 32:1 kept" in text
    params = next(int(w.split()[-2].replace(",", "")) for w in text.splitlines() if "pruned model:" in w)
    assert params < 2_500_000  # 2,059,328 with the published head sizes kept (32 Mamba heads of 64, 128 attention)
