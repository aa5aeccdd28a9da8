"""What an issue sink raises (every sink, GitHub's client included): its own module, so that the
client and the sink registry both import it and neither imports the other."""

from __future__ import annotations


class SinkError(RuntimeError):
    """An issue operation failed. ``maybe_applied``: the request may have taken effect anyway
    (a 5xx or a lost answer to a POST), so it must not simply be sent again."""

    def __init__(self, message: str, status: int | None = None, maybe_applied: bool = False):
        super().__init__(message)
        self.status, self.maybe_applied = status, maybe_applied


class IssueGone(SinkError):
    """The issue does not exist (any more): deleted on GitHub (410 Gone), or unknown (404)."""


class BudgetExhausted(SinkError):
    """The per-run API call budget is used up: stop, the next run goes on."""


class SinkConfigError(SinkError):
    """The sink cannot be used at all (no token, no repository)."""
