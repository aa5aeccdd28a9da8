"""Constants shared by tests (importable because pytest puts tests/ on sys.path in rootdir mode)."""

import contextlib
import os
import subprocess
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


def smoke_suite(adapter: str | None = None) -> str:
    """A tiny Llama suite on the cpu in float32 with a short smoke check, built by ``adapter``
    (``module:function``) or by transformers."""
    model = '[model]\nconfig = "configs/Llama-3.1-8B.json"\n' + (f'adapter = "{adapter}"\n' if adapter else "")
    return ('backends = ["cpu"]\ndtypes = ["float32"]\n' + model + TINY_PRUNE
            + "\n[checks.smoke]\nsteps = 2\ngenerate_tokens = 2\n")


@contextlib.contextmanager
def read_only(folder: Path):
    """A folder nobody can write to, root included: root writes through mode bits, so as root it is
    a read-only tmpfs mounted there (skips the test where mounting is not allowed)."""
    import pytest

    folder.mkdir(parents=True, exist_ok=True)
    mounted = False
    if os.geteuid() == 0:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(folder)],
                                 capture_output=True).returncode == 0
        if not mounted:
            pytest.skip("root without mount: mode bits do not stop root")
    else:
        folder.chmod(0o555)
    try:
        yield folder
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(folder)], capture_output=True)
        else:
            folder.chmod(0o755)

