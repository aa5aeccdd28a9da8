"""Shared test setup: offline hub, the pytester fixture, and helpers to write suites in tmp dirs."""

from __future__ import annotations

import os
import shutil
import textwrap
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# One intra-op thread per test process: `pytest -n 2` runs two processes on CI's two cores and the test
# models are tiny, so a second thread each only spin-waits (tests/models: 151 s with the default of 2,
# 40 s with 1). Child processes (the harness CLI, torchrun ranks, isolated workers) inherit it; the
# checks on pruned models also set it themselves (harness.models.build.cpu_threads).
os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch  # noqa: E402

torch.set_num_threads(1)

pytest_plugins = ["pytester"]

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "suites" / "configs"


@pytest.fixture
def suite_dir(tmp_path: Path) -> Path:
    """tmp/suites with the real configs copied beside it, like the repository's layout."""
    d = tmp_path / "suites"
    shutil.copytree(CONFIGS, d / "configs")
    return d


@pytest.fixture
def write_suite(suite_dir: Path):
    """write_suite(name, body) -> path of suites/<name>.toml (body is dedented TOML)."""

    def write(name: str, body: str) -> Path:
        p = suite_dir / f"{name}.toml"
        p.write_text(textwrap.dedent(body))
        return p

    return write


@pytest.fixture(autouse=True)
def _private_suite_dirs_record(tmp_path, monkeypatch):
    """`harness init --suites-dir` records the directory in .harness/suite-dirs under the current
    directory; tests must not leave their tmp directories in the repository's record (every later
    "no such suite" message would list them)."""
    monkeypatch.setattr("harness.suite.loader.SUITE_DIRS_FILE", str(tmp_path / ".harness-state" / "suite-dirs"))
