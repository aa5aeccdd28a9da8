"""One finished item as the results writer keeps it (a row of the journal, of junit.xml and of the
summary table), and the outcome counts."""

from __future__ import annotations

from dataclasses import dataclass, field

from harness import metrics


@dataclass
class Row:
    nodeid: str
    outcome: str  # passed / failed / error / skipped / xfailed / not run
    props: dict = field(default_factory=dict)
    message: str = ""
    duration: float = 0.0
    longrepr: str = ""

    @property
    def parsed(self) -> dict:
        return metrics.parse_properties(self.props)


def counts(rows: list[Row]) -> dict[str, int]:
    out = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    for r in rows:
        out[r.outcome] = out.get(r.outcome, 0) + 1
    return out
