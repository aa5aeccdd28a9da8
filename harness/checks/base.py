"""The check contract: a config table, a context, and a short sequence of named steps.

A check is a class with

* ``name`` - the ``[checks.<name>]`` table, the item id (``<name>[cpu-float32]``), the marker;
* ``config_model`` - a :class:`CheckConfig` subclass: the table's keys with type, default and
  description. The suite schema's ``checks`` table is assembled from the registered checks, so a
  vendor's ``[checks.mycheck]`` is validated with file/field errors like the built-ins;
* ``steps`` - names of methods ``step(ctx, state)`` run in order (torchtitan's
  ``apply_tp -> apply_ac -> apply_fsdp`` is the model). ``state`` is one object the steps share
  (``new_state``). ``setup_steps`` are the ones where an unexpected exception means "could not
  run" (error) rather than "the model failed";
* optionally ``variants(suite, backend)`` (one item per variant: an op, a parallel layout),
  ``headline`` (metric names for ``harness run``'s table), ``exclusive`` and ``order``;
* optionally ``golden_sections`` - the golden sections it compares against
  (:class:`harness.golden.sections.GoldenSection`: name, the suite's spec of it, its producer):
  ``harness golden generate`` makes the sections the registered checks declare, so a check's
  golden data is declared in its own module like its config table and its metrics.

The runner (plugin, driver, table) uses a check only through this class's attributes and methods,
all of which have defaults here: it never probes a check with ``getattr``/``hasattr``.

Steps record metrics through ``ctx.metric`` and raise the outcomes of :mod:`harness.checks.outcomes`.
``ctx.step(name)`` marks the phase the item is in (``build``, ``forward``, ...): the run-integrity
launcher reports it when an item hangs or crashes, and an exception is annotated with it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, ClassVar

from harness import metrics
from harness.checks.outcomes import CheckOutcome, CouldNotRun
from harness.messages import first_line
from harness.suite.schema import CheckConfig  # the [checks.<name>] table's base: the suite format owns it

if TYPE_CHECKING:
    from harness.backends.base import Backend
    from harness.golden.sections import GoldenSection
    from harness.suite.loader import LoadedSuite


# Phase listeners: the run-integrity layer registers one to learn which step an item is in
# (so a hang can be reported as "hung in forward"). Called with (phase, detail).
PhaseListener = Callable[[str, str], None]
_PHASE_LISTENERS: list[PhaseListener] = []


def add_phase_listener(fn: PhaseListener) -> None:
    _PHASE_LISTENERS.append(fn)


def remove_phase_listener(fn: PhaseListener) -> None:
    if fn in _PHASE_LISTENERS:
        _PHASE_LISTENERS.remove(fn)


@dataclass
class CheckContext:
    suite: LoadedSuite
    backend: Backend
    dtype: str
    variant: str | None = None
    check: str = ""
    properties: list[tuple[str, str]] = field(default_factory=list)  # -> item.user_properties
    notes: list[str] = field(default_factory=list)  # shown in the report and summary
    phase: str = ""

    @property
    def device(self):
        return self.backend.device()

    @property
    def config(self) -> Any:
        """This check's own ``[checks.<name>]`` table, validated."""
        return getattr(self.suite.suite.checks, self.check)

    def metric(self, name: str, value: float) -> float:
        self.properties.append(metrics.metric_property(name, value))
        return value

    def tolerance(self, name: str, value: float) -> None:
        self.properties.append(metrics.tolerance_property(name, value))

    def detail(self, key: str, value: str) -> None:
        self.properties.append(metrics.detail_property(key, value))

    def set_phase(self, phase: str, detail: str = "") -> None:
        self.phase = phase
        for fn in list(_PHASE_LISTENERS):
            fn(phase, detail)

    @contextmanager
    def step(self, name: str) -> Iterator[None]:
        self.set_phase(name)
        try:
            yield
        except CheckOutcome:
            raise
        except Exception as e:
            # Which step raised is the first thing a reader needs; add it once.
            if not getattr(e, "_harness_step", None):
                e._harness_step = name  # type: ignore[attr-defined]
            raise


class Check:
    """Base class for checks (built-in and vendor). Subclass, set ``name``, ``config_model`` and
    ``steps``, and write one method per step."""

    name: ClassVar[str] = ""
    config_model: ClassVar[type[CheckConfig]] = CheckConfig
    description: ClassVar[str] = ""  # one line, for the schema reference
    steps: ClassVar[tuple[str, ...]] = ()
    setup_steps: ClassVar[tuple[str, ...]] = ()
    headline: ClassVar[tuple[str, ...]] = ()
    # Measures time: its items run alone on the machine, no other item of the run at the same time
    # (xdist workers wait; harness/run/exclusive.py).
    exclusive: ClassVar[bool] = False
    # Its failed verdict is a statistical decision already confirmed inside the item (perf: a suspected
    # regression re-measured; its detection and false-alarm rates are measured for one item run).
    # `harness run --confirm` then reruns only its errors: rerunning the verdict would turn a
    # regression detected 95 % of the time into a "flaky" pass 14 % of the time (0.95^3 = 0.86 that all
    # three attempts see it), and into the quarantine after that.
    statistical_verdict: ClassVar[bool] = False
    # Position among the checks: items are generated in this order (cheap ones first). Built-ins use
    # 10..70; a vendor's check keeps the default and comes after them.
    order: ClassVar[int] = 100
    # torch intra-op threads while the steps run (harness.models.build.cpu_threads): 1 for checks on the
    # pruned test models; None leaves the process's count (perf pins its own, weights loads real
    # checkpoints). $HARNESS_CPU_THREADS overrides it.
    cpu_threads: ClassVar[int | None] = None
    # The golden sections this check reads, and produces at `harness golden generate`
    # (harness.golden.sections; the reference run calls each one's ``build``).
    golden_sections: ClassVar[tuple[GoldenSection, ...]] = ()
    source: str = "builtin"  # where it was registered from: "<distribution> (<module:attr>)" for a vendor's

    def config(self, suite: LoadedSuite) -> CheckConfig:
        """This check's validated ``[checks.<name>]`` table in ``suite`` (a field of the assembled schema)."""
        return getattr(suite.suite.checks, self.name)

    def enabled(self, suite: LoadedSuite) -> bool:
        return bool(self.config(suite).enabled)

    def variants(self, suite: LoadedSuite, backend: Backend) -> list[str | None]:
        return [None]

    def scope(self, suite: LoadedSuite, variant: str | None) -> str:
        """'commit' or 'nightly' for one item; a check may put some variants (full-size shapes, the
        full parallel matrix) in the nightly scope only."""
        return self.config(suite).scope

    def new_state(self, ctx: CheckContext) -> Any:
        return SimpleNamespace()

    def run(self, ctx: CheckContext, **options: Any) -> Any:
        """Run the steps in order and return the state. ``options`` (e.g. a fault ``transform`` in
        tests, a ``golden_root``) are set on the state before the first step."""
        ctx.check = ctx.check or self.name
        state = self.new_state(ctx)
        for k, v in options.items():
            setattr(state, k, v)
        if self.cpu_threads is None:
            self.run_steps(ctx, state)
            return state
        from harness.models.build import cpu_threads

        with cpu_threads(self.cpu_threads):
            self.run_steps(ctx, state)
        return state

    def run_steps(self, ctx: CheckContext, state: Any) -> None:
        for name in self.steps:
            try:
                with ctx.step(name):
                    getattr(self, name)(ctx, state)
            except CheckOutcome:
                raise
            except Exception as e:
                unusable = _golden_unusable(ctx, e, name)
                if unusable is not None:
                    raise unusable from None
                if name in self.setup_steps:
                    raise CouldNotRun(f"{type(e).__name__}: {first_line(e)}", step=name) from e
                raise


def _golden_unusable(ctx: CheckContext, e: Exception, step: str) -> CouldNotRun | None:
    """A golden that cannot be used (missing, corrupt, made by another config, a section made with other
    knobs), in any step of any check: "could not run", the reason as the ``golden_error`` detail. It is
    the golden's problem (regenerate it), never a verdict on the target."""
    store = sys.modules.get("harness.golden.store")  # not imported: no golden was read (and torch stays out)
    if store is None or not isinstance(e, store.GoldenError):
        return None
    ctx.detail("golden_error", str(e))
    return CouldNotRun(f"golden unusable: {e}", step=step)
