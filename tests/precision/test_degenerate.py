"""Issue #50 item 1: `golden generate` refuses a float64 reference that says nothing (non-finite or
vanishing logits, activations that grow without bound, a top-k without information) in one line
saying why, and writes nothing; the bundled suites' references are not refused."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from harness.golden import store
from harness.precision.degenerate import ACTIVATION_RMS_MAX, LAYER_GROWTH_MAX, why_degenerate
from harness.precision.generate import DegenerateReference, generate
from harness.suite.loader import load_suite
from precision.helpers import GOLDEN, REPO, SUITES, suite


def _golden(name: str):
    g = store.load_golden(suite(name), GOLDEN)
    return {k: v.double() if v.is_floating_point() else v for k, v in g.modules.items()}, dict(g.generation)


@pytest.mark.parametrize("name", SUITES)
def test_the_bundled_references_say_something(name):
    """Every committed golden passes the test a degenerate one fails (no false refusal)."""
    outs, gen = _golden(name)
    assert why_degenerate(outs, gen) is None


def test_each_kind_of_degenerate_reference_is_named_in_one_line():
    """A real reference (qwen3-8b's golden) made degenerate one way at a time: each says its own why."""
    outs, gen = _golden("qwen3-8b")
    layers = sorted(n for n in outs if n.startswith("model.layers.") and n.count(".") == 2)
    cases = {
        "not finite": ({**outs, "logits": outs["logits"].clone().index_fill_(-1, torch.tensor([3]), float("nan"))}, gen),
        "vanish": ({**outs, "logits": torch.zeros_like(outs["logits"])}, gen),
        "constant over the vocabulary": ({**outs, "logits": outs["logits"][..., :1].expand_as(outs["logits"]).clone()},
                                         gen),
        f"> {ACTIVATION_RMS_MAX:.0e}": ({**outs, "model.norm": outs["model.norm"] * 1e7}, gen),
        f"> {LAYER_GROWTH_MAX:.0e} in one layer": ({**outs, layers[-1]: outs[layers[-1]] * 3e4}, gen),
        "carries no information": (outs, {**gen, "top_logprobs": torch.full_like(gen["top_logprobs"], -6.2)}),
    }
    for needle, (o, g) in cases.items():
        why = why_degenerate(o, g)
        assert why is not None and needle in why and "\n" not in why, (needle, why)
    # a nearly flat but informative top-k (a pruned random model's: first candidates within 0.09 nats) passes
    lp = gen["top_logprobs"]
    near = lp[..., :1] - 1e-6 * torch.arange(lp.shape[-1], dtype=lp.dtype)
    assert why_degenerate(outs, {**gen, "top_logprobs": near}) is None


def _plant(tmp_path, name: str, *, adapter: str | None = None, precision: str = ""):
    d = tmp_path / "suites"
    d.mkdir(exist_ok=True)
    (d / f"{name}.toml").write_text(
        f'[model]\nconfig = "{REPO / "suites" / "configs" / "Llama-3.1-8B.json"}"\n'
        + (f'adapter = "{adapter}"\n' if adapter else "")
        + "\n[prune]\nnum_hidden_layers = 2\nhidden_size = 32\nintermediate_size = 64\nnum_attention_heads = 4\n"
          "num_key_value_heads = 2\nvocab_size = 128\n"
        + (f"\n[checks.precision]\n{precision}\n" if precision else ""))
    return d / f"{name}.toml"


@pytest.mark.parametrize("kind,plant,needle", [
    # a real knob: realistic numerics asked for a residual stream that grows 1e5x per layer
    ("growth", {"precision": "residual_growth = 1e5"}, "activations grow without bound"),
    ("silent", {"adapter": "precision.degenerate_models:silent_head"}, "the reference logits vanish"),
    ("one-row", {"adapter": "precision.degenerate_models:one_row_head"}, "constant over the vocabulary"),
    ("overflow", {"adapter": "precision.degenerate_models:overflow"}, "are not finite"),
])
def test_generate_refuses_a_planted_degenerate_reference_and_writes_nothing(kind, plant, needle, tmp_path):
    ls = load_suite(_plant(tmp_path, f"plant-{kind}", **plant))
    root = tmp_path / "golden"
    with pytest.raises(DegenerateReference) as e:
        generate(ls, root)
    msg = str(e.value)
    assert needle in msg and f"plant-{kind}: refused" in msg and "no golden written" in msg and "\n" not in msg
    assert not root.exists() or not any(root.iterdir())  # not even a hidden half-written folder


def test_golden_generate_cli_refuses_one_suite_in_one_line_and_writes_the_others(tmp_path):
    """Through the command line: the planted suite gets one line and no golden, the good one its golden."""
    _plant(tmp_path, "silent", adapter="precision.degenerate_models:silent_head")
    _plant(tmp_path, "good")
    (tmp_path / "harness.toml").write_text('suites_dir = "suites"\ngolden_dir = "golden"\nresults_dir = "results"\n')
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HARNESS_CONFIG": str(tmp_path / "harness.toml"),
           "PYTHONPATH": f"{REPO / 'tests'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    r = subprocess.run([sys.executable, "-m", "harness", "golden", "generate", "silent", "good"], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 1, r.stdout + r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "silent: refused" in errors[0] and "vanish" in errors[0], r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "golden" / "silent").exists()
    assert "wrote golden/good" in r.stdout and store.exists(tmp_path / "golden" / "good")
