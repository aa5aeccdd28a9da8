"""What one item ended with (``ItemResult``: no torch here, so the isolated worker's parent can start
it before importing torch), one finished item as the results writer keeps it (a row of the journal,
of junit.xml and of the summary table), and the outcome counts."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from harness import metrics

OUTCOMES = ("passed", "failed", "error", "skipped", "xfailed")
# A row's outcome can also be "quarantined": the item failed, and it is in the quarantine
# (harness.compare.quarantine): reported (a failure in the JUnit XML), never failing the run.


@dataclass
class ItemResult:
    outcome: str  # one of OUTCOMES
    message: str = ""  # one line: what a table row / CI log line shows
    report: str = ""  # the full text for the failure report (details, layer table, traceback)
    properties: list[tuple[str, str]] = field(default_factory=list)  # JUnit properties recorded by the check
    notes: list[str] = field(default_factory=list)
    phase: str = ""  # the step the item was in when it ended
    # what libraries warned while it ran, counted: [{category, message, source, count}]
    # (harness.run.execute.LibraryWarnings); plain JSON, so it crosses the worker's pipe as it is
    warnings: list[dict] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> ItemResult:
        d = dict(d)
        d["properties"] = [tuple(p) for p in d.get("properties", [])]
        return cls(**d)


@dataclass
class Row:
    nodeid: str
    outcome: str  # passed / failed / error / skipped / xfailed / not run
    props: dict = field(default_factory=dict)
    message: str = ""
    duration: float = 0.0
    longrepr: str = ""
    warnings: list[dict] = field(default_factory=list)  # ItemResult.warnings: in junit.xml's <system-err>

    @property
    def parsed(self) -> dict:
        return metrics.parse_properties(self.props)


def warning_line(w: dict) -> str:
    """One distinct warning as junit.xml's ``<system-err>`` has it (one line each; the HTML report
    shows that text): ``3 x UserWarning: message [torch/_dynamo/eval_frame.py:502]``."""
    return f"{w.get('count', 1)} x {w.get('category', '')}: {w.get('message', '')} [{w.get('source', '')}]"


def counts(rows: list[Row]) -> dict[str, int]:
    out = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    for r in rows:
        out[r.outcome] = out.get(r.outcome, 0) + 1
    return out
