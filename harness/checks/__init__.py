"""Checks: what a pytest item runs for one suite x backend x dtype (x variant).

The contract (``base.py``, ``outcomes.py``; walkthrough in docs/adding-a-check.md):

* a check declares its own ``[checks.<name>]`` table (``config_model``, a ``CheckConfig``);
* it runs as a short sequence of named steps and says what happened by raising a harness outcome
  (``CheckFailure``, ``KnownGap``, ``NotApplicable``, ``CouldNotRun``), never a pytest exception;
* built-in checks and a vendor's own register the same way: an entry point in the
  ``harness.checks`` group whose target is ``register(registry)``.
"""

from __future__ import annotations

from importlib.metadata import entry_points

from harness.checks.base import (
    Check,
    CheckConfig,
    CheckContext,
    add_phase_listener,
    remove_phase_listener,
)
from harness.checks.outcomes import CheckFailure, CheckOutcome, CouldNotRun, KnownGap, NotApplicable
from harness.registry import NamedRegistry

__all__ = ["Check", "CheckConfig", "CheckContext", "CheckFailure", "CheckOutcome", "CheckRegistry",
           "CouldNotRun", "KnownGap", "NotApplicable", "add_phase_listener", "registry",
           "remove_phase_listener", "run_one"]


class CheckRegistry(NamedRegistry[Check]):
    kind = "check"

    def add(self, item: Check, *, replace: bool = False) -> Check:
        name = getattr(item, "name", "")
        if not name or not name.isidentifier():
            raise ValueError(f"a check needs a name that is a Python identifier (it becomes the "
                             f"[checks.<name>] table), got {name!r} from {self._describe(item)}")
        model = getattr(item, "config_model", CheckConfig)
        if not (isinstance(model, type) and issubclass(model, CheckConfig)):
            raise ValueError(f"check {name!r}: config_model must be a harness.checks.CheckConfig subclass, "
                             f"got {model!r}")
        return super().add(item, replace=replace)


_REGISTRY: CheckRegistry | None = None

# Built-ins are declared as entry points like a vendor's (pyproject.toml), and registered from this
# list so that their order is fixed and a source tree that was never pip-installed has them too.
BUILTIN = ("harness.checks.smoke", "harness.checks.precision", "harness.checks.quantization",
           "harness.checks.ops", "harness.checks.parallel", "harness.checks.perf", "harness.checks.weights")


def registry() -> CheckRegistry:
    global _REGISTRY
    if _REGISTRY is None:
        import importlib

        reg = CheckRegistry()
        # Built-ins first, in BUILTIN's order (cheap smoke items before the rest), whether or not
        # the source tree was pip-installed; then every other package's entry points.
        for mod in BUILTIN:
            importlib.import_module(mod).register(reg)
        eps = [ep for ep in entry_points(group="harness.checks") if ep.value.split(":")[0] not in BUILTIN]
        for ep in eps:
            before = set(reg.names())
            ep.load()(reg)
            for n in set(reg.names()) - before:
                if ep.dist is not None and not ep.value.startswith("harness."):
                    reg.get(n).source = f"{ep.dist.name} ({ep.value})"
        _REGISTRY = reg
    return _REGISTRY


def run_one(suite, check: str = "smoke", backend: str = "cpu", dtype: str = "float32",
            variant: str | None = None) -> CheckContext:
    """Run one check outside pytest (``harness init`` validates a new suite this way). Raises the
    check's outcome (``CheckFailure``, ``KnownGap``, ``NotApplicable``, ``CouldNotRun``) and never a
    pytest exception; returns the context with the recorded properties when the model passes."""
    from harness.backends import get

    try:
        be = get(backend)
    except KeyError as e:
        raise CouldNotRun(str(e).strip("'\"")) from None
    ok, why = be.availability()
    if not ok:
        raise NotApplicable(why)
    ctx = CheckContext(suite, be, dtype, variant, check=check)
    registry().get(check).run(ctx)
    return ctx
