"""Whose failure is it: each failing item of a run (a pull request's, typically) told apart as new in
this change, already failing on main (with main's issue), flaky, or the runner's.

What a pull request's author needs from the job summary (PyTorch's CI bot says the same in one PR
comment): which red items are theirs. The baseline and history a pull request's comparison reads are
main's (docs/ci.md), so the classification already knows: ``new_failure`` passed on main,
``still_failing`` failed there too; the issue numbers come from the history, where main's
comparisons record the issue of every group they filed.
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.compare.classify import Finding
from harness.compare.issues import fingerprint, group_fields

VERDICT = {
    "new_failure": "new in this change",
    "still_failing": "already failing on main",
    "quarantined": "flaky (quarantined on main)",
    "flaky": "flaky (passed on a rerun)",
    "infrastructure": "infrastructure (the runner or device, not this change)",
}


@dataclass
class Triage:
    key: str
    name: str
    suite: str
    backend: str
    verdict: str
    issue: int | None  # main's issue of this item's group, when the history knows one
    note: str


def triage(findings: list[Finding], issues: dict[str, tuple[int, str]], group_by: tuple[str, ...],
           quarantined_before: set[str] = frozenset()) -> list[Triage]:
    """One row per failing (or flaky) item, new ones first. ``issues``: the history's
    ``fingerprint -> (number, state)``; ``quarantined_before``: the quarantine as this comparison
    found it (an item this run put there flaked here, on the change's own run)."""
    out: dict[str, Triage] = {}
    rank = {c: i for i, c in enumerate(VERDICT)}
    for f in sorted(findings, key=lambda f: (rank.get(f.category, 99), f.key)):
        if f.category not in VERDICT or f.key in out or f.metric:
            continue
        category = "flaky" if f.category == "quarantined" and f.key not in quarantined_before else f.category
        if category == "quarantined" and not (f.case is not None and (f.case.outcome in ("failed", "error")
                                                                       or f.case.flaky)):
            continue  # quarantined, and clean this time: nothing failed
        known = issues.get(fingerprint(group_fields(f, group_by)))
        # a new failure has no issue of its own yet: another item of its group may have one
        number = known[0] if known and category not in ("new_failure", "flaky") and known[1] != "detached" else None
        out[f.key] = Triage(f.key, f.case.name if f.case is not None else f.key, f.suite, f.backend,
                            VERDICT[category], number, f.note)
    return list(out.values())


def markdown(rows: list[Triage]) -> list[str]:
    if not rows:
        return []
    new = sum(r.verdict == VERDICT["new_failure"] for r in rows)
    lines = ["### Whose failures", "",
             f"{new} new in this change, {len(rows) - new} not (already failing on main, flaky or the runner's).",
             "", "| test | suite | backend | verdict | issue | attempts |", "|---|---|---|---|---|---|"]
    from harness.compare.scrub import md_code, md_text

    for r in rows:
        lines.append(f"| {md_code(r.name)} | {md_text(r.suite)} | {md_text(r.backend)} | {r.verdict} | "
                     f"{'#' + str(r.issue) if r.issue else ''} | {md_text(r.note)} |")
    return lines + [""]


MARKER = "<!-- harness:pr-triage -->"  # the one comment harness keeps on a pull request


def comment_body(rows: list[Triage], run_line: str) -> str:
    """The pull request's one comment: the same table as the job summary, edited when it changed."""
    from harness.compare.issues import RUN_LINE
    from harness.compare.limits import COMMENT_MAX, fit
    from harness.compare.scrub import md_text

    table = markdown(rows)
    head = [MARKER, "### harness: whose failures", ""]
    tail = [f"<sub>{md_text(run_line)}</sub> {RUN_LINE}"]  # not compared: a new run alone edits nothing
    if not table:
        return "\n".join([*head, "No failing item: nothing new in this change, nothing already failing on main.", "",
                          *tail])
    # the summary line and the table's header always; its rows, new failures first, as many as fit
    rows_md = [ln for ln in table[6:] if ln]
    # the note names no run (the footer does): a push with the same table must not edit the comment
    return "\n".join(fit([*head, *table[2:6]], rows_md, ["", *tail], COMMENT_MAX, "this run's job summary"))


def pull_request_number(env: dict | None = None) -> int | None:
    """The pull request a GitHub Actions run is for: the event payload's ``pull_request.number``, else
    ``GITHUB_REF`` ``refs/pull/N/merge``; None outside a pull request's run."""
    import json
    import os
    import re

    env = os.environ if env is None else env
    path = env.get("GITHUB_EVENT_PATH")
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                n = (json.load(f).get("pull_request") or {}).get("number")
            if isinstance(n, int) and n > 0:
                return n
        except (OSError, ValueError, AttributeError):
            pass
    m = re.fullmatch(r"refs/pull/(\d+)/(merge|head)", env.get("GITHUB_REF", ""))
    return int(m.group(1)) if m else None
