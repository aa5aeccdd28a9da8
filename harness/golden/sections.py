"""What a check reads from the golden, declared by the check itself, and the one way checks load it.

A golden section (``harness.golden.store``, format 3) is owned by the check that compares against it:
the check lists it in ``Check.golden_sections`` (``GoldenSection(name, spec, build)``) in its own
module, and ``harness golden generate`` (``harness.precision.generate``) asks the registered checks
for their sections. A vendor's check adds a section without editing harness: registering the check
is all it takes (docs/adding-a-check.md).

This module sits below the checks (docs/architecture.md): every check loads the golden through
:func:`load_golden_for` here, none through another check.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from harness.golden.store import Golden, Section

# The forward golden's own files (harness.golden.store.FILES), here without importing the store (torch):
# the check contract imports this module, and registering checks stays free of torch.
RESERVED = ("inputs", "modules", "generation")
DOMAINS = ("ids", "mask", "logprob")  # what GoldenSection.values may say of a tensor


@dataclass(frozen=True)
class GoldenSection:
    """One section of the golden: ``manifest["sections"][name]`` and ``<name>.safetensors``.

    * ``spec(ls) -> dict | None``: the suite's knobs that shape the section (stored with it; a golden
      made with other knobs is refused when read). None: the suite does not want the section (its
      check is disabled), and ``golden generate`` does not make it.
    * ``build(ref) -> (entry, tensors)``: the producer, given the float64 reference run
      (``harness.precision.generate.ReferenceRun``): the manifest entry (whatever the reader needs
      besides tensors: budgets, orders) and the tensors to store.
    """

    name: str
    spec: Callable[[Any], dict | None]
    build: Callable[[Any], tuple[dict, dict]]
    # (tensor-name glob, domain) of its tensors' values beyond "finite": "ids" (token ids inside the
    # vocabulary), "mask" (0/1), "logprob" (<= 0). Checked when the section is read and by `golden
    # verify`: a token id out of range or a corrupted mask is the golden's fault, found before it
    # fails the target (issue #49).
    values: tuple[tuple[str, str], ...] = ()

    def __post_init__(self):
        # The name becomes a file next to the forward golden's: a plain identifier, none of theirs.
        if not (isinstance(self.name, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", self.name)):
            raise ValueError(f"golden section name must be a plain identifier, got {self.name!r}")
        if self.name in RESERVED:
            raise ValueError(f"golden section name {self.name!r} is one of the golden's own files "
                             f"({', '.join(RESERVED)})")
        if not (callable(self.spec) and callable(self.build)):
            raise ValueError(f"golden section {self.name!r}: spec and build must be callables")
        unknown = sorted({d for _g, d in self.values} - set(DOMAINS))
        if unknown:
            raise ValueError(f"golden section {self.name!r}: unknown value domain(s) {unknown} (known: {DOMAINS})")

    def read(self, golden: Golden, ls) -> Section:
        """This section of ``golden`` as the suite now asks for it (``store.GoldenError`` when it is
        missing or was made with other knobs: the golden's problem, see :func:`load_golden_for`)."""
        from harness.golden import store

        sec = golden.section(self.name, self.spec(ls))
        store.check_values(golden, self.name, sec.tensors, self.values)
        return sec


def load_golden_for(ctx, golden_root: str | Path | None = None) -> Golden:
    """The suite's golden for a check's item (``ctx``: its ``CheckContext``). A missing or bad golden
    raises ``store.GoldenError``, which the check contract (``Check.run_steps``) reports as "could not
    run" with the reason as the ``golden_error`` detail: it is the golden's problem (regenerate it),
    never a verdict on the target."""
    from harness.golden import store

    return store.load_golden(ctx.suite, golden_root)

