"""Suite loading: bundled suites are valid; malformed ones name the file, the field and the problem."""

from __future__ import annotations

import pytest

from harness.suite.loader import SuiteError, discover, load_suite, resolve_names
from tests_support import REPO_SUITES  # noqa: F401  (see tests/tests_support.py)

GOOD = """
[model]
config = "configs/Llama-3.1-8B.json"
[prune]
num_hidden_layers = 2
"""


def test_bundled_suites_are_valid():
    paths = discover(REPO_SUITES)
    assert {p.stem for p in paths} >= {"llama-3.1-8b", "qwen3-8b", "qwen3-30b-a3b", "mixtral-8x7b",
                                       "deepseek-v3", "kimi-k2"}
    for p in paths:
        ls = load_suite(p)
        assert ls.name == p.stem
        assert ls.raw_config["architectures"]


def test_good_suite_defaults(write_suite):
    ls = load_suite(write_suite("good", GOOD))
    assert ls.suite.backends == ["*"]
    assert ls.suite.dtypes == ["float32", "bfloat16"]
    assert ls.suite.model.trust_remote_code is False
    assert ls.suite.checks.smoke.steps == 3


MALFORMED = [
    # (name, body, expected message after "suites/<name>.toml: ")
    ("zero-layers", GOOD.replace("num_hidden_layers = 2", "num_hidden_layers = 0"),
     "prune.num_hidden_layers: must be >= 1, got 0"),
    ("no-config", "[model]\nname = 'x'\n", "model.config: required key is missing"),
    ("missing-config-file", "[model]\nconfig = 'configs/Nope.json'\n", "model.config: file not found:"),
    ("typo-key", GOOD + "num_hiden_layers = 3\n", "prune.num_hiden_layers: unknown key (expected one of:"),
    ("bad-dtype", "dtypes = ['float32', 'fp8']\n" + GOOD, "dtypes[1]: must be one of"),
    ("gqa", GOOD + "num_attention_heads = 6\nnum_key_value_heads = 4\n",
     "prune: num_attention_heads (6) must be a multiple of num_key_value_heads (4)"),
    ("topk", GOOD + "num_experts = 4\nnum_experts_per_tok = 8\n",
     "prune: num_experts_per_tok (8) must be <= num_experts (4)"),
    ("bad-adapter", GOOD.replace("[prune]", "adapter = 'mymodule'\n[prune]"),
     "model.adapter: unknown model builder 'mymodule' (registered: hf); or name one as 'package.module:callable'"),
    ("bad-adapter-string", GOOD.replace("[prune]", "adapter = 'mymodule:'\n[prune]"),
     "model.adapter: must be a model builder's name or 'package.module:callable', got 'mymodule:'"),
    ("wrong-type", GOOD.replace("num_hidden_layers = 2", "num_hidden_layers = 'two'"),
     "prune.num_hidden_layers: input should be a valid integer"),
    ("bad-toml", "[model\nconfig = 1", "not valid TOML"),
    ("empty-backends", "backends = []\n" + GOOD, "backends: must list at least one entry"),
    ("pickle-weights", GOOD.replace("[prune]", "weights = 'w.bin'\n[prune]"), "model.weights: not found"),
    ("negative-steps", GOOD + "[checks.smoke]\nsteps = -1\n", "checks.smoke.steps: must be >= 1, got -1"),
]


@pytest.mark.parametrize("name,body,message", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_suite_names_file_and_field(write_suite, name, body, message):
    path = write_suite(name, body)
    with pytest.raises(SuiteError) as e:
        load_suite(path)
    text = str(e.value)
    assert f"{name}.toml: " in text, text
    assert message in text, text
    assert "Traceback" not in text


def test_weights_must_be_safetensors(write_suite, suite_dir):
    (suite_dir / "w.bin").write_bytes(b"\x80\x02}q\x00.")  # a pickle: never loaded
    path = write_suite("pkl", GOOD.replace("[prune]", "weights = 'w.bin'\n[prune]"))
    with pytest.raises(SuiteError, match="only safetensors weights are loaded"):
        load_suite(path)


def test_config_without_architectures(write_suite, suite_dir):
    (suite_dir / "configs" / "bare.json").write_text('{"model_type": "llama"}')
    with pytest.raises(SuiteError, match="config.json has no 'architectures'; set model.architecture"):
        load_suite(write_suite("bare", "[model]\nconfig = 'configs/bare.json'\n"))


def test_resolve_names(suite_dir, write_suite):
    write_suite("a", GOOD)
    assert resolve_names(["a"], suite_dir) == [suite_dir / "a.toml"]
    with pytest.raises(SuiteError, match=r"no such suite 'b' in .*suites \(known in .*suites: a\)"):
        resolve_names(["b"], suite_dir)
