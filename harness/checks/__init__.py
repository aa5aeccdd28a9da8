"""Checks: what a pytest item runs for one suite x backend x dtype (x variant).

The contract (``base.py``, ``outcomes.py``; walkthrough in docs/adding-a-check.md):

* a check declares its own ``[checks.<name>]`` table (``config_model``, a ``CheckConfig``);
* it runs as a short sequence of named steps and says what happened by raising a harness outcome
  (``CheckFailure``, ``KnownGap``, ``NotApplicable``, ``CouldNotRun``), never a pytest exception;
* built-in checks and a vendor's own register the same way, and only that way: an entry point in
  the ``harness.checks`` group whose target is ``register(registry)`` (harness's own are in its
  pyproject.toml). Items are generated in the checks' ``order`` (cheap smoke items first).

The built-ins, one module each: ``smoke`` (load, forward, backward, a few optimizer steps),
``precision`` (against the float64 golden, module by module), ``compile`` (torch.compile: numerics
against the golden, graph breaks, recompiles, compile time), ``decode`` (the KV-cache decode step
by step against the golden's), ``training`` (gradients module by module, optimizer steps and the
loss trajectory against the golden's), ``quantization`` (quantized weights' error budget), ``ops`` (per-operator conformance), ``shapes`` (the unpruned model's operator signatures at their real shapes against float64), ``longctx`` (prefill, chunked prefill and cached decode at thousands of
positions against float64, error against position), ``width`` (one decoder layer of each kind at the published widths, each module against float64), ``parallel`` (layouts on real process groups), ``rehearse`` (the plan's top layout at the production world size, meta device),
``perf`` (throughput, latency, memory against baselines), ``comm`` (collective bandwidth against baselines),
``weights`` (real checkpoints), ``serve`` (the model through a serving engine against float64).
``collection`` is what the plugin and ``harness validate`` both refuse when items are generated
(unknown backends, variants).
"""

from __future__ import annotations

from harness.checks.base import (
    Check,
    CheckConfig,
    CheckContext,
    add_phase_listener,
    remove_phase_listener,
)
from harness.checks.outcomes import CheckFailure, CheckOutcome, CouldNotRun, KnownGap, NotApplicable
from harness.golden.sections import GoldenSection
from harness.registry import NamedRegistry, of_group

__all__ = ["Check", "CheckConfig", "CheckContext", "CheckFailure", "CheckOutcome", "CheckRegistry",
           "CouldNotRun", "KnownGap", "NotApplicable", "add_phase_listener", "registry",
           "remove_phase_listener", "run_one"]


class CheckRegistry(NamedRegistry[Check]):
    kind = "check"
    group = "harness.checks"
    item_type = Check  # the one interface the runner uses

    def add(self, item: Check, *, replace: bool = False) -> Check:
        if not isinstance(item, Check):
            return super().add(item, replace=replace)  # refused there, naming the type
        name = item.name
        if not name or not name.isidentifier():
            raise ValueError(f"a check needs a name that is a Python identifier (it becomes the "
                             f"[checks.<name>] table), got {name!r} from {self._describe(item)}")
        model = item.config_model
        if not (isinstance(model, type) and issubclass(model, CheckConfig)):
            raise ValueError(f"check {name!r}: config_model must be a harness.checks.CheckConfig subclass, "
                             f"got {model!r}")
        self._check_sections(item, replace)
        return super().add(item, replace=replace)

    def _check_sections(self, item: Check, replace: bool) -> None:
        """Golden sections are declared, one owner each: two checks producing one section would
        overwrite each other's data at `harness golden generate`."""
        owners = {s.name: c.name for c in self._items.values() if not (replace and c.name == item.name)
                  for s in c.golden_sections}
        for sec in item.golden_sections:
            if not isinstance(sec, GoldenSection):
                raise ValueError(f"check {item.name!r}: golden_sections must hold harness.golden.sections."
                                 f"GoldenSection, got {type(sec).__name__}")
            if sec.name in owners:
                raise ValueError(f"check {item.name!r}: golden section {sec.name!r} is already declared by "
                                 f"check {owners[sec.name]!r}")
            owners[sec.name] = item.name

    def load_entry_points(self, group: str | None = None) -> CheckRegistry:
        super().load_entry_points(group)
        # sorted() is stable: equal orders keep the entry points' order
        self._items = {c.name: c for c in sorted(self._items.values(), key=lambda c: c.order)}
        return self




def registry() -> CheckRegistry:
    """Every check of the ``harness.checks`` entry points, built-ins and vendors' alike."""
    return of_group(CheckRegistry.group)  # one per process (harness.registry)


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
