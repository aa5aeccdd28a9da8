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
import sys
from pathlib import Path

DEFAULT_TIMEOUT_S = 1800.0  # no record, no suite or command-line limit: 30 minutes
FACTOR, FLOOR_S = 30.0, 900.0  # a recorded item may take 30x its record, and at least 15 minutes
STALL_S = 60.0  # no progress for a minute is a hang (the suite's stall_s wins)


MAX_RECORD_S = 86400.0  # a day: more is no item's duration (1e308 once switched the time limit off)
_SAID: set[str] = set()  # files already said to be unusable (load runs in several places of one run)


def valid(seconds) -> float | None:
    """A recorded duration as harness may use it: a finite number of seconds in [0, MAX_RECORD_S]."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        return None
    s = float(seconds)
    return s if math.isfinite(s) and 0 <= s <= MAX_RECORD_S else None


def load(path: str | Path) -> dict[str, float]:
    """The recorded durations; a missing file is no record. A file of another shape, or entries that
    are not durations, are left out with one line on stderr naming the file: a bad durations file
    costs the time limits and shard balance it would have given, never an item's result."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError:
        return {}
    try:
        data = json.loads(text)
    except ValueError as e:
        return _unusable(path, f"not JSON ({e})")
    table = data.get("durations", data) if isinstance(data, dict) else None
    if not isinstance(table, dict):
        return _unusable(path, 'not {"durations": {item id: seconds}}')
    out, bad = {}, 0
    for k, v in table.items():
        s = valid(v)
        if isinstance(k, str) and "::" in k and s is not None:
            out[k] = s
        else:
            bad += 1
    if bad:
        _unusable(path, f"{bad} entr{'y' if bad == 1 else 'ies'} left out (not an item id with 0-{MAX_RECORD_S:g} s)")
    return out


def _unusable(path, why: str) -> dict:
    if str(path) not in _SAID:
        _SAID.add(str(path))
        print(f"harness: {path}: {why}; items without a record get the default time limit", file=sys.stderr)
    return {}


def timeout_for(item_id: str, recorded: dict[str, float], override: float | None = None) -> float:
    if override:
        return float(override)
    if item_id in recorded:
        return max(FLOOR_S, FACTOR * recorded[item_id])
    return DEFAULT_TIMEOUT_S


def save(path: str | Path, durations: dict[str, float]) -> None:
    """Only valid records are written (JSON has no NaN or Infinity)."""
    from harness.files import atomic

    kept = {k: s for k, v in durations.items() if (s := valid(v)) is not None}
    atomic.write_json(path, {"durations": dict(sorted(kept.items()))})
