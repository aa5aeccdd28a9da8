"""What a check may say, independent of pytest.

A check *raises* one of these; the pytest plugin (``harness.run.plugin``) is the one place that maps
them to pytest outcomes, and ``run_one`` callers (``harness init``, ``harness precision check``,
scripts) catch them directly:

=================  ===========  ============================================================
outcome            pytest       meaning
=================  ===========  ============================================================
(returns)          passed       the model passed
``CheckFailure``   failed       the check ran and the model (or backend) said no
``KnownGap``       xfailed      a failure the suite declares as known (tracked, not silent)
``NotApplicable``  skipped      nothing to check here (op not used in this dtype, ...)
``CouldNotRun``    error        setup problem: import, adapter, config, weights, golden
=================  ===========  ============================================================

Any other exception out of a check step counts as ``failed`` for steps that exercise the model
and as ``error`` for the steps a check declares as setup (``Check.setup_steps``).
"""

from __future__ import annotations

from typing import Any


class CheckOutcome(Exception):
    """Base of every outcome a check raises. ``str()`` is the one-line message."""

    kind = "outcome"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class CheckFailure(CheckOutcome):
    """The model (not harness) failed a check. Every field shows up in the report."""

    kind = "failed"

    def __init__(self, message: str, *, metric: str | None = None, expected: Any = None,
                 observed: Any = None, tolerance: Any = None, details: str | None = None):
        super().__init__(message)
        self.metric, self.expected = metric, expected
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


class KnownGap(CheckOutcome):
    """A failure the suite declares as known (``known_gaps``): reported as expected failure."""

    kind = "xfailed"


class NotApplicable(CheckOutcome):
    """Nothing to check for this item: reported as skipped with the reason."""

    kind = "skipped"


class CouldNotRun(CheckOutcome):
    """harness could not get as far as asking the model anything: a missing adapter module, an
    architecture nobody knows, weights without safetensors, a bad golden. Reported as *error*,
    never as a failure of the model. ``step`` names where it happened."""

    kind = "error"

    def __init__(self, message: str, *, step: str | None = None):
        super().__init__(message)
        self.step = step
