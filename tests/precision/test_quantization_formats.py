"""The quantization check reads a release's format with the parser `harness inspect` uses
(harness.anatomy.quant), for every format it recognizes (issue #29, item 4): FP8 in any spelling and
granularity is simulated as stored; MXFP4, NVFP4 and INT4 are a known gap in one line, never a suite
without quantization items. Real published configs from tests/data/day0 (SOURCES.md there)."""

from __future__ import annotations

import pytest
import torch

from harness.checks import KnownGap, run_one
from harness.precision.quantization import _fp8_block, block_size, describe, quant_scheme
from harness.suite.loader import load_suite
from tests_support import REPO

DAY0 = REPO / "tests" / "data" / "day0"

CASES = {
    # config: (family, block, inspect's words)
    "DeepSeek-V3.2": ("fp8", [128, 128], "fp8 block 128x128 (checkpoint)"),
    "Qwen3-32B-FP8-Static-PerTensor": ("fp8", None, "fp8 per-tensor (checkpoint)"),  # compressed-tensors
    "gpt-oss-20b": ("mxfp4", [128, 128], "mxfp4 (checkpoint)"),
    "MiniMax-M2.5-NVFP4": ("nvfp4", [128, 128], "nvfp4 group 16 (checkpoint)"),
    "Kimi-K2.5": ("int4", [128, 128], "int4 group 32 (checkpoint)"),  # declared in text_config
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
    if family == "fp8":
        assert block_size(ls) == block


@pytest.mark.parametrize("name", ["gpt-oss-20b", "MiniMax-M2.5-NVFP4", "Kimi-K2.5"])
def test_a_format_not_simulated_is_a_known_gap_in_one_line(name, tmp_path):
    """Before: no quantization item at all for these releases (the check knew fp8 spellings only, and
    only at the top level of config.json)."""
    ls = _suite(tmp_path, name)
    with pytest.raises(KnownGap) as e:
        run_one(ls, "quantization", "cpu", "float32")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(CASES[name][2] + " weights: the quantization check simulates fp8")
    assert f"{CASES[name][0]} is not checked against the golden yet" in msg


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
