"""Recorded item durations: what the time limit of an isolated item (and, later, shard balance)
is derived from.

``durations.json`` (settings ``durations_file``) maps item ids
(``suites/kimi-k2.toml::smoke[cpu-float32]``) to seconds; ``harness durations update RESULTS``
refreshes it from a results run. A missing or unreadable file is simply no record.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

DEFAULT_TIMEOUT_S = 900.0  # no record, no suite or command-line limit: 15 minutes
FACTOR, FLOOR_S = 10.0, 60.0  # a recorded item may take 10x its record, and at least a minute


def load(path: str | Path) -> dict[str, float]:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    out = {}
    for k, v in (data.get("durations", data) or {}).items():
        if isinstance(k, str) and isinstance(v, (int, float)) and math.isfinite(v) and v >= 0:
            out[k] = float(v)
    return out


def timeout_for(item_id: str, recorded: dict[str, float], override: float | None = None) -> float:
    if override:
        return float(override)
    if item_id in recorded:
        return max(FLOOR_S, FACTOR * recorded[item_id])
    return DEFAULT_TIMEOUT_S


def save(path: str | Path, durations: dict[str, float]) -> None:
    from harness.files import atomic

    atomic.write_json(path, {"durations": dict(sorted(durations.items()))})
