"""Constants shared by tests (importable because pytest puts tests/ on sys.path in rootdir mode)."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
REPO_SUITES = REPO / "suites"

# A tiny Llama-family prune for tests that need a model but not a particular architecture.
TINY_PRUNE = """
[prune]
num_hidden_layers = 2
hidden_size = 32
intermediate_size = 64
num_attention_heads = 4
num_key_value_heads = 2
vocab_size = 128
"""
