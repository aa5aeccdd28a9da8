"""Where a suite's weights are, or why there are none here.

``model.weights`` is a checkpoint directory (or one .safetensors file) relative to the suite file, or
``"$VAR"`` / ``"${VAR}"``; ``model.weights_env = "VAR"`` says the same. An environment variable lets CI
runners keep checkpoints in different places; when it is unset, or names a path that is not there, the
weight checks skip with that reason and the other checks run on seeded random weights.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from harness.suite.loader import LoadedSuite


@dataclass(frozen=True)
class Located:
    path: Path | None
    reason: str  # why path is None ("" when found)
    declared: bool  # the suite asks for weights at all


def locate(ls: LoadedSuite) -> Located:
    m = ls.suite.model
    if m.weights:
        p = ls.weights_path
        return Located(p, "" if p else f"model.weights {m.weights} not found", True)
    if m.weights_env:
        val = os.environ.get(m.weights_env, "").strip()
        if not val:
            return Located(None, f"weights not available: ${m.weights_env} is not set", True)
        p = ls.weights_path
        if p is None:
            return Located(None, f"weights not available: ${m.weights_env} = {val} does not exist", True)
        return Located(p, "", True)
    return Located(None, "the suite has no model.weights (random weights)", False)


def has_weights(ls: LoadedSuite) -> bool:
    """The suite declares weights (they may still be absent on this machine)."""
    m = ls.suite.model
    return bool(m.weights or m.weights_env)
