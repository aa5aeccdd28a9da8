"""Duration-balanced shards: ``--harness-shard I/N`` keeps the items of shard I of N.

Longest processing time first: items sorted by expected duration (longest first, then by id) go
one by one to the shard with the least total so far (the lowest index on ties). The expected
duration is the recorded one (``durations.json``, ``harness durations update``); an item without a
record gets an estimate from its check and its suite's pruned size, scaled by how recorded items
of the same check compare with their own estimates. Given the same item ids and records, every
process computes the same assignment: the shards of a CI matrix are disjoint and cover the run.

Why not pytest-split: it balances the same way, but estimates an unrecorded item as the mean of
the recorded ones (a 3-minute perf item and a 0.2 s op item alike) and keeps a durations store of
its own; harness needs one record for both shard balance and item time limits, and estimates
from the model's size.
"""

from __future__ import annotations

import heapq
import statistics
from collections.abc import Iterable

# Seconds for a tiny pruned model's item of each check on one CPU core: the scale of an estimate.
CHECK_SECONDS = {"smoke": 3.0, "precision": 1.5, "quantization": 1.5, "ops": 0.3, "parallel": 15.0,
                 "perf": 30.0, "weights": 5.0, "compile": 30.0}  # compile: 20-65 s cold on a new config
DEFAULT_CHECK_SECONDS = 3.0


def parse(spec: str) -> tuple[int, int]:
    """'2/4' -> (2, 4); 1-based, as CI matrices count."""
    try:
        i, n = (int(x) for x in spec.split("/"))
    except ValueError:
        raise ValueError(f"--shard takes I/N (e.g. 2/4), got {spec!r}") from None
    if not 1 <= i <= n:
        raise ValueError(f"--shard {spec}: I must be between 1 and N")
    return i, n


def size_factor(raw_config: dict, prune) -> float:
    """Relative cost of a suite's pruned model: ~ layers x hidden^2 + vocab x hidden, in millions."""
    def val(key: str, default: float) -> float:
        v = getattr(prune, key, None) if prune is not None else None
        if v is None:
            v = raw_config.get(key, default)
        return float(v) if isinstance(v, (int, float)) else default

    h = val("hidden_size", 64)
    layers = val("num_hidden_layers", 2)
    vocab = val("vocab_size", 512)
    return 1.0 + (12 * layers * h * h + vocab * h) / 1e6


def expected(items: Iterable[tuple[str, str, float]], recorded: dict[str, float]) -> dict[str, float]:
    """(id, check, size factor) -> expected seconds: the record, else a calibrated estimate."""
    items = list(items)
    raw = {i: CHECK_SECONDS.get(check, DEFAULT_CHECK_SECONDS) * size for i, check, size in items}
    by_check: dict[str, list[float]] = {}
    for i, check, _ in items:
        if i in recorded and raw[i] > 0:
            by_check.setdefault(check, []).append(recorded[i] / raw[i])
    every = [r for rs in by_check.values() for r in rs]
    overall = statistics.median(every) if every else 1.0
    out = {}
    for i, check, _ in items:
        if i in recorded:
            out[i] = recorded[i]
        else:
            scale = statistics.median(by_check[check]) if check in by_check else overall
            out[i] = raw[i] * scale
    return out


def assign(durations: dict[str, float], n: int) -> dict[str, int]:
    """id -> shard (1-based), longest first onto the least loaded shard."""
    heap = [(0.0, k) for k in range(1, n + 1)]
    out = {}
    for item in sorted(durations, key=lambda i: (-durations[i], i)):
        load, k = heapq.heappop(heap)
        out[item] = k
        heapq.heappush(heap, (load + durations[item], k))
    return out


def loads(durations: dict[str, float], assignment: dict[str, int], n: int) -> list[float]:
    totals = [0.0] * n
    for item, k in assignment.items():
        totals[k - 1] += durations[item]
    return totals
