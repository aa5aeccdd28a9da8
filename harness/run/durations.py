"""Recorded item durations: what the wall-clock backstop of an isolated item (and shard balance)
is derived from.

A hang is found by the lack of progress (harness.run.isolation._Progress: no CPU time used by the
item's processes and no phase or module entered for ``STALL_S``), not by the wall clock: the first
run of a compile item on a loaded 2-core machine took 10x its record (110-150 s against 14 s) and was
killed as "hung" while inductor was still generating code. The wall-clock limit is only the
backstop for what keeps spinning, so it is generous; a limit the user sets (``--timeout``, the
suite's ``timeout_s``) is kept as given.

``durations.json`` (settings ``durations_file``) maps item ids
(``suites/kimi-k2.toml::smoke[cpu-float32]``) to seconds; ``harness durations update RESULTS``
refreshes it from a results run. A missing or unreadable file is simply no record.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

DEFAULT_TIMEOUT_S = 1800.0  # no record, no suite or command-line limit: 30 minutes
FACTOR, FLOOR_S = 30.0, 900.0  # a recorded item may take 30x its record, and at least 15 minutes
STALL_S = 60.0  # no progress for a minute is a hang (the suite's stall_s wins)


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
