"""GitHub's documented limits on what harness posts, and the one way bodies are fitted into them.

* a comment (and an issue) body: 65,536 characters (the API answers 422 above: a pull request with
  1,500 failing items used to get no triage at all);
* a job summary (``$GITHUB_STEP_SUMMARY``): 1 MiB per step (GitHub drops a larger one: 12,000 failing
  items used to lose the whole summary).

A body is fitted by dropping whole lines from the end of its droppable part (the rows, already most
important first: new failures before old ones), never the head or the footer, and saying visibly how
many were left out and where the full report is. Sizes are counted in UTF-8 bytes, never fewer than
characters, so the character limit holds whatever the text.
"""

from __future__ import annotations

COMMENT_MAX = 65_536  # characters
STEP_SUMMARY_MAX = 1 << 20  # bytes
_MARGIN = 1_024  # room for the note saying what was left out


def size(lines: list[str]) -> int:
    return len("\n".join(lines).encode("utf-8"))


def fit(head: list[str], rows: list[str], tail: list[str], limit: int, where: str = "") -> list[str]:
    """``head + rows + tail`` within ``limit`` bytes: the rows kept from the first, one line saying
    how many were left out (and ``where`` the full report is) in their place."""
    if size(head + rows + tail) <= limit:
        return head + rows + tail
    budget = limit - _MARGIN - size(head + tail)
    kept, used = [], 0
    for r in rows:
        n = len(r.encode("utf-8")) + 1
        if used + n > budget:
            break
        kept.append(r)
        used += n
    left = len(rows) - len(kept)
    note = f"... {left} more row(s) not shown: GitHub's limit is {limit:,} bytes here" + (
        f"; the full report: {where}" if where else "; the full report is in the run's results")
    return head + kept + ["", note, ""] + tail


def fit_text(text: str, limit: int, where: str = "") -> str:
    """A markdown text (the job summary) within ``limit`` bytes: whole lines from the top, one line
    saying what was left out."""
    lines = text.split("\n")
    return "\n".join(fit([], lines, [], limit, where))
