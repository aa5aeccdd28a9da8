"""The suite file writer of `harness init` (harness/models/prune.py suite_toml): every value kind a
plan or a check table can hold reads back through tomllib as written (issue #44 item 5: the hand-written
writer wrote None, dicts, tuples and multi-line strings as invalid TOML), with its comments kept."""

from __future__ import annotations

import json

import pytest

from harness import toml
from harness.models.prune import plan_for, suite_toml
from tests_support import REPO

AWKWARD = {
    "multi_line": 'first line\nsecond "quoted" line\\ with a backslash\n\ttabbed',
    "a_tuple": (1, 2, 3),
    "nested_tuple": [(1, 2), (3, 4)],
    "a_dict": {"inner": 1, "deeper": {"x": [0.5, 1e-30], "y": "z"}},
    "dotted.key": True,
    "key with spaces": -3,
    "unicode": "café ✓",
    "empty_list": [],
    "big": 2**62,
    "inf": float("inf"),
}


def _roundtrip(**kw) -> tuple[str, dict]:
    text = suite_toml("configs/x.json", {"architectures": ["XForCausalLM"], "model_type": "x"}, **kw)
    return text, toml.loads(text)  # tomllib (tomli on Python 3.10)


def test_every_value_kind_reads_back_as_written():
    prune = {"num_hidden_layers": 2, "overrides": dict(AWKWARD)}
    text, got = _roundtrip(prune=prune, why=["a reason\nthat spans two lines"], smoke=dict(AWKWARD),
                           smoke_comments=["one", "two\nthree"], checks={"compile": (dict(AWKWARD), ["why this"])})
    want = {k: ([list(x) for x in v] if k == "nested_tuple" else list(v) if isinstance(v, tuple) else v)
            for k, v in AWKWARD.items()}
    assert got["prune"] == {"num_hidden_layers": 2, "overrides": want}
    assert got["checks"]["smoke"] == want
    assert got["checks"]["compile"] == want
    assert got["model"] == {"config": "configs/x.json"}
    # the comments are kept, each line of a multi-line one commented
    assert "#   - a reason\n# that spans two lines\n" in text
    assert "# two\n# three\n" in text and "# why this\n" in text


def test_none_is_left_out_and_none_in_an_array_is_one_line_error():
    _, got = _roundtrip(prune={"num_hidden_layers": 1, "overrides": {"sliding_window": None, "keep": 1}}, why=[],
                        smoke={"seed": None})
    # TOML has no null: an absent key reads back as unset
    assert got["prune"]["overrides"] == {"keep": 1}
    assert "checks" not in got or got["checks"]["smoke"] == {}
    with pytest.raises(ValueError, match=r"^prune\.overrides\.layer_types: an array cannot hold None"):
        _roundtrip(prune={"overrides": {"layer_types": ["full", None]}}, why=[])


@pytest.mark.parametrize("name", ["gpt-oss-20b", "Qwen3-VL-30B-A3B-Instruct", "DeepSeek-V4-Flash"])
def test_a_real_plan_reads_back_as_planned(name):
    raw = json.loads((REPO / "tests" / "data" / "day0" / f"{name}.json").read_text())
    plan, _ = plan_for(raw, name)
    _, got = _roundtrip(prune=plan.prune, why=plan.why, architecture=plan.architecture)
    want = {k: v for k, v in plan.prune.items() if k != "overrides" or v}
    assert json.loads(json.dumps(got["prune"])) == json.loads(json.dumps(want))
    assert got["model"].get("architecture") == plan.architecture
