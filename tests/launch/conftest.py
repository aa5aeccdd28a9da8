"""Fixtures of the launch tests: a real one-host Slurm (tests/launch/slurm_cluster.py)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.launch import slurm_cluster


@pytest.fixture(scope="session")
def slurm():
    """A one-host Slurm for the session (slurm_cluster.start), stopped at its end; where it cannot start
    (not installed, not root) the test skips in one line saying why. Its folder is directly under /tmp:
    munged wants every folder above its socket traversable by all, which pytest's 0700 base is not."""
    why = slurm_cluster.unavailable()
    if why:
        pytest.skip(why)
    old = os.environ.get("SLURM_CONF")
    root = Path(tempfile.mkdtemp(prefix="harness-slurm-"))
    try:
        c = slurm_cluster.start(root)
        try:
            yield c
        finally:
            slurm_cluster.stop(c)
    finally:
        if old is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old
        shutil.rmtree(root, ignore_errors=True)
