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
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

Direction = Literal["lower", "higher", "none"]

PREFIX_META = "harness."
PREFIX_DETAIL = "harness.detail."
PREFIX_METRIC = "metric."
PREFIX_TOLERANCE = "tolerance."


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
    # "_per_s" before "_s": tokens_per_s is a throughput, not a time.
    if name.endswith(("_per_s", "_cosine", "_agreement")):
        return "higher"
    if name.endswith(("_s", "_bytes", "_error", "_err", "_rmse")):
        return "lower"
    return "none"


def all_specs() -> dict[str, MetricSpec]:
    return dict(_REGISTRY)


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
