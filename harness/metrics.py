"""The one naming convention for results, shared by every check and by the comparator.

Every harness test item records JUnit ``<property>`` elements (through pytest's ``user_properties``):

==========================  =====================================================================
property name               value
==========================  =====================================================================
``harness.suite``           suite name, e.g. ``kimi-k2`` (the suite file's stem)
``harness.check``           check name, e.g. ``smoke``, ``precision``, ``parallel``, ``ops``
``harness.backend``         backend name, e.g. ``cpu``, ``cuda``, ``npu``
``harness.dtype``           run dtype, e.g. ``float32``, ``bfloat16``
``harness.device``          device description (``cpu``, ``NVIDIA H200``): the device generation
``harness.variant``         optional: what else distinguishes the item (``tp2``, an op name, ...)
``harness.detail.<key>``    optional free text the check wants in the report (first bad module, ...)
``metric.<name>``           a number; ``<name>`` is declared below with unit and direction
``tolerance.<name>``        the tolerance the check applied to ``metric.<name>``, when it has one
==========================  =====================================================================

The test id is ``<suite file>::<check>[<backend>-<dtype>]`` (plus ``-<variant>`` when set), so
``tox -e model-kimi-k2 -- -k "smoke and cpu"`` reproduces one item.

A metric's *direction* tells the comparator which way is a regression: ``lower`` means lower is
better (time, memory, error), ``higher`` means higher is better (throughput, cosine similarity),
``none`` means informational only.

The results carry each metric's meaning themselves: the run that wrote them adds one testsuite-level
property ``harness.meaning.<name>`` per metric used in that file (:func:`meaning_property`; JSON
``{"unit", "direction", "description"}``), so the comparator judges a metric by what the run that
measured it declared, never by which check modules the comparing process happens to have imported.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Literal

Direction = Literal["lower", "higher", "none"]

PREFIX_META = "harness."
PREFIX_DETAIL = "harness.detail."
PREFIX_METRIC = "metric."
PREFIX_TOLERANCE = "tolerance."
PREFIX_MEANING = "harness.meaning."  # testsuite-level: one per metric used in the file
DIRECTIONS = ("lower", "higher", "none")


@dataclass(frozen=True)
class MetricSpec:
    name: str
    unit: str
    direction: Direction
    description: str


_REGISTRY: dict[str, MetricSpec] = {}


def declare(name: str, unit: str, direction: Direction, description: str) -> MetricSpec:
    """Declare a metric once (checks call this at import). Re-declaring identically is harmless."""
    spec = MetricSpec(name, unit, direction, description)
    old = _REGISTRY.get(name)
    if old is not None and old != spec:
        raise ValueError(f"metric {name!r} declared twice with different specs: {old} vs {spec}")
    _REGISTRY[name] = spec
    return spec


def spec(name: str) -> MetricSpec | None:
    return _REGISTRY.get(name)


def direction(name: str) -> Direction:
    """Direction of a metric; unknown metrics guess from the name suffix, else ``none``."""
    s = _REGISTRY.get(name)
    if s is not None:
        return s.direction
    return guess_direction(name)


def guess_direction(name: str) -> Direction:
    """The name-suffix rule alone (for metrics nobody declared)."""
    # "_per_s" before "_s": tokens_per_s is a throughput, not a time.
    if name.endswith(("_per_s", "_cosine", "_agreement")):
        return "higher"
    if name.endswith(("_s", "_bytes", "_error", "_err", "_rmse")):
        return "lower"
    return "none"


def all_specs() -> dict[str, MetricSpec]:
    return dict(_REGISTRY)


def meaning_of(name: str) -> MetricSpec:
    """What the results say ``name`` means: its declaration, or for a metric no loaded module
    declared, the name-suffix guess, saying so (so a reader knows the direction is not the check's)."""
    return _REGISTRY.get(name) or _guessed(name, "not declared; direction guessed from the name")


def _guessed(name: str, description: str) -> MetricSpec:
    unit = "s" if name.endswith("_s") and not name.endswith("_per_s") else \
        "bytes" if name.endswith("_bytes") else ""
    return MetricSpec(name, unit, guess_direction(name), description)


class Meanings:
    """Each metric's meaning as the results recorded it (``harness.meaning.*``; the first mapping
    given wins: the current run's over the baseline's). A metric the results say nothing about
    (XML written before they carried meanings) falls back to this process's registry, else the
    name-suffix rule, and is kept in ``fallback`` so the comparator says so instead of guessing
    silently: that answer depends on which checks this process imported."""

    def __init__(self, *recorded: dict[str, MetricSpec]):
        self._known: dict[str, MetricSpec] = {}
        for r in recorded:
            for k, v in r.items():
                self._known.setdefault(k, v)
        self.fallback: set[str] = set()

    def spec(self, name: str) -> MetricSpec:
        s = self._known.get(name)
        if s is None:
            self.fallback.add(name)
            s = self._known[name] = _REGISTRY.get(name) or _guessed(name, "")
        return s

    def direction(self, name: str) -> Direction:
        return self.spec(name).direction

    def is_time(self, name: str) -> bool:
        return self.spec(name).unit == "s"

    def fallback_note(self) -> str:
        """One line naming the metrics judged without a recorded meaning; '' when there were none."""
        if not self.fallback:
            return ""
        names = sorted(self.fallback)
        shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
        return (f"{len(names)} metric(s) have no meaning (unit, direction) recorded in the results, which an "
                f"older harness wrote: judged by this process's declarations or the name's suffix: {shown}")


def meaning_property(s: MetricSpec) -> tuple[str, str]:
    # compact JSON: a description may hold any character, and one value keeps the three together
    value = json.dumps({"unit": s.unit, "direction": s.direction, "description": s.description},
                       separators=(",", ":"), ensure_ascii=False)
    return (PREFIX_MEANING + s.name, value)


def parse_meaning(prop: str, value: str) -> MetricSpec | str:
    """``harness.meaning.<name>`` and its JSON back to a spec, or a one-line reason it is not one."""
    name = prop[len(PREFIX_MEANING):] if prop.startswith(PREFIX_MEANING) else ""
    if not name:
        return f"{prop!r} is not a metric meaning"
    try:
        d = json.loads(value)
    except ValueError:
        d = None
    if not isinstance(d, dict) or d.get("direction") not in DIRECTIONS:
        shown = value if len(value) <= 60 else value[:60] + "..."
        return f"metric {name!r}: meaning {shown!r} is not {{unit, direction (lower|higher|none), description}}"
    return MetricSpec(name, str(d.get("unit", "")), d["direction"], str(d.get("description", "")))


def meta_properties(suite: str, check: str, backend: str, dtype: str, device: str,
                    variant: str | None = None) -> list[tuple[str, str]]:
    props = [
        ("harness.suite", suite),
        ("harness.check", check),
        ("harness.backend", backend),
        ("harness.dtype", dtype),
        ("harness.device", device),
    ]
    if variant:
        props.append(("harness.variant", variant))
    return props


def metric_property(name: str, value: float) -> tuple[str, str]:
    # repr() of a float round-trips exactly; JUnit stores strings.
    v = float(value)
    return (PREFIX_METRIC + name, repr(v) if math.isfinite(v) else str(v))


def tolerance_property(name: str, value: float) -> tuple[str, str]:
    return (PREFIX_TOLERANCE + name, repr(float(value)))


def detail_property(key: str, value: str) -> tuple[str, str]:
    return (PREFIX_DETAIL + key, str(value))


def parse_properties(props: list[tuple[str, str]] | dict[str, str]) -> dict:
    """Split a flat property list into ``{"meta": {...}, "metrics": {...}, "tolerances": {...},
    "details": {...}}``; the comparator's reader uses this."""
    items = props.items() if isinstance(props, dict) else props
    out: dict = {"meta": {}, "metrics": {}, "tolerances": {}, "details": {}}
    for k, v in items:
        if k.startswith(PREFIX_DETAIL):
            out["details"][k[len(PREFIX_DETAIL):]] = v
        elif k.startswith(PREFIX_META):
            out["meta"][k[len(PREFIX_META):]] = v
        elif k.startswith(PREFIX_METRIC):
            out["metrics"][k[len(PREFIX_METRIC):]] = _to_float(v)
        elif k.startswith(PREFIX_TOLERANCE):
            out["tolerances"][k[len(PREFIX_TOLERANCE):]] = _to_float(v)
    return out


def _to_float(v: str) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


# Metrics every check may record.
declare("wall_time_s", "s", "lower", "wall time of the whole check item")
declare("peak_memory_bytes", "bytes", "lower",
        "peak device memory (allocator high-water mark; on CPU the process peak RSS since the item started)")


def budget_use_json(pairs) -> str:
    """``[[name, use], ...]`` with 3 significant digits: a compact ``harness.detail`` for plots
    (precision, training and decode record their per-module / per-step budget use with it)."""
    return json.dumps([[n, float(f"{u:.3g}")] for n, u in pairs], separators=(",", ":"))
