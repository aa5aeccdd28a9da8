"""Checks: what a pytest item runs for one suite x backend x dtype (x variant).

A check is a small object with a ``name``, ``enabled(suite)``, ``variants(suite, backend)``,
``run(ctx)`` and optionally ``headline`` (metric names for `harness run`'s table). ``run`` records
metrics through ``ctx.metric`` and raises ``CheckFailure`` (with the metric, expected, observed and
tolerance) when the model misbehaves. Built-in checks and a vendor's own register the same way: an
entry point in the ``harness.checks`` group whose target is ``register(registry)``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, Protocol

from harness import metrics
from harness.backends.base import Backend
from harness.registry import NamedRegistry
from harness.suite.loader import LoadedSuite


class CheckFailure(AssertionError):
    """The model (not harness) failed a check. Every field shows up in the pytest report."""

    def __init__(self, message: str, *, metric: str | None = None, expected: Any = None,
                 observed: Any = None, tolerance: Any = None, details: str | None = None):
        super().__init__(message)
        self.message, self.metric, self.expected = message, metric, expected
        self.observed, self.tolerance, self.details = observed, tolerance, details

    def report(self, header: str) -> str:
        lines = [f"{header}: {self.message}"]
        for label, value in (("metric", self.metric), ("expected", self.expected),
                             ("observed", self.observed), ("tolerance", self.tolerance)):
            if value is not None:
                lines.append(f"  {label + ':':<11}{value}")
        if self.details:
            lines += ["", self.details]
        return "\n".join(lines)


@dataclass
class CheckContext:
    suite: LoadedSuite
    backend: Backend
    dtype: str
    variant: str | None = None
    properties: list[tuple[str, str]] = field(default_factory=list)  # -> item.user_properties
    notes: list[str] = field(default_factory=list)  # shown in the report and summary
    started: float = field(default_factory=time.perf_counter)

    @property
    def device(self):
        return self.backend.device()

    def metric(self, name: str, value: float) -> float:
        self.properties.append(metrics.metric_property(name, value))
        return value

    def tolerance(self, name: str, value: float) -> None:
        self.properties.append(metrics.tolerance_property(name, value))

    def detail(self, key: str, value: str) -> None:
        self.properties.append(metrics.detail_property(key, value))


class Check(Protocol):
    name: str

    def enabled(self, suite: LoadedSuite) -> bool: ...

    def variants(self, suite: LoadedSuite, backend: Backend) -> list[str | None]: ...

    def run(self, ctx: CheckContext) -> None: ...


class CheckRegistry(NamedRegistry[Check]):
    kind = "check"


_REGISTRY: CheckRegistry | None = None


def registry() -> CheckRegistry:
    global _REGISTRY
    if _REGISTRY is None:
        reg = CheckRegistry()
        eps = list(entry_points(group="harness.checks"))
        if not eps:  # source tree never pip-installed
            from harness.checks import smoke

            smoke.register(reg)
        for ep in eps:
            ep.load()(reg)
        _REGISTRY = reg
    return _REGISTRY


def run_one(suite: LoadedSuite, check: str = "smoke", backend: str = "cpu", dtype: str = "float32",
            variant: str | None = None) -> CheckContext:
    """Run one check outside pytest (``harness init`` validates a new suite this way). Raises
    ``CheckFailure`` when the model fails; returns the context with the recorded properties."""
    from harness.backends import get

    be = get(backend)
    ok, why = be.availability()
    if not ok:
        raise RuntimeError(why)
    ctx = CheckContext(suite, be, dtype, variant)
    registry().get(check).run(ctx)
    return ctx
