"""From findings to a plan of issue actions: one issue per group, never one per test case.

A *group* is ``suite x backend x kind`` by default (``group_by`` can add ``dtype``, ``check``,
``device`` or drop fields). Its *fingerprint* is a hash of those values, written into the issue
body as a hidden HTML comment, so the next run finds the issue again whatever its title became.

The plan, for each group:

* bad now, no issue known            -> ``create``
* bad now, open issue, same items    -> nothing (three runs of one regression = one issue, silence)
* bad now, open issue, items changed -> ``update``: new body + one comment saying only what changed
* bad now, issue closed (history)    -> ``reopen`` with the new body and one comment
* clean ``close_after`` runs in a row, issue open -> ``close`` with a comment
* two open issues of one fingerprint -> the newer is closed as a duplicate of the older
* an issue labelled ``harness:muted`` is never touched; one whose ``harness`` label a person
  removed (``detached`` in the history) neither

Every action costs at most three API calls; the listing of open issues is one call per run.

The hidden state marker is base64 of UTF-8 JSON, budgeted in encoded characters (which are
bytes too: base64 is ASCII), so non-ASCII test names can never push a body past GitHub's limit.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from harness.compare.scrub import md_code, scrub

if TYPE_CHECKING:  # annotations only: every `harness` command's parser reads this module's constants,
    # and classify brings the history's numpy (~0.1 s at each command's start, measured)
    from harness.compare.classify import Classification, Finding
    from harness.compare.junit import Results

LABEL = "harness"
MUTED_LABEL = "harness:muted"
# infrastructure: one issue per backend for runner and device failures (harness.run.confirm)
# upstream: the canary's regressions against the pinned stack (harness compare --upstream)
FILED_KINDS = ("failure", "error", "precision", "performance", "vanished", "infrastructure", "upstream")
GROUP_BY = ("suite", "backend", "kind")
_FP = re.compile(r"<!-- harness:fingerprint=([0-9a-f]+) -->")
_STATE = re.compile(r"<!-- harness:state=([A-Za-z0-9+/=]*) -->")
_COMMENT = "<!-- harness:comment={} -->"
# ends the line of a comment that only says which run wrote it (its URL, its commit): a comment is
# edited when what it says changed, never because another run said the same (one edit per push)
RUN_LINE = "<!-- harness:run -->"
MARKER_MAX = 17_000  # bytes (= characters: ASCII); the body renderer keeps this much room for it


@dataclass
class Group:
    fingerprint: str
    fields: dict[str, str]
    findings: list[Finding] = field(default_factory=list)

    @property
    def kind(self) -> str:
        return self.fields.get("kind", self.findings[0].kind if self.findings else "regression")

    @property
    def title(self) -> str:
        extra = [v for k, v in self.fields.items() if k not in ("suite", "backend", "kind")]
        if self.kind == "upstream" and self.findings and self.findings[0].stack:
            extra.append(self.findings[0].stack)  # the versions that broke it, pinned -> next
        tail = f" ({', '.join(extra)})" if extra else ""
        quarantined = self.findings and all(f.category == "quarantined" for f in self.findings)
        what = {"flaky": "flaky tests (quarantined)" if quarantined else "flaky tests",
                "improvement": "improvement, update the baseline",
                "infrastructure": "infrastructure (runner or device)"}.get(
            self.kind, f"{self.kind} regression")
        return scrub(f"[harness] {what}: {self.fields.get('suite', '*')} on "
                     f"{self.fields.get('backend', '*')}{tail}")

    @property
    def labels(self) -> list[str]:
        out = [LABEL, f"kind:{self.kind}"]
        for k in ("suite", "backend"):
            if k in self.fields:
                out.append(f"{k}:{self.fields[k]}"[:50])  # GitHub's label length limit
        return out

    def items(self) -> list[str]:
        return sorted({f.item_id for f in self.findings})


@dataclass
class IssueRef:
    """An existing issue as the sink sees it."""
    number: int
    title: str
    body: str
    state: str
    labels: list[str]

    @property
    def fingerprint(self) -> str | None:
        m = _FP.search(self.body or "")
        return m.group(1) if m else None


@dataclass
class Action:
    op: str  # create | update | reopen | close
    fingerprint: str
    title: str
    labels: list[str]
    body: str = ""
    comment: str = ""
    number: int | None = None
    reason: str = ""
    comment_key: str = ""


def said(body: str) -> str:
    """What a comment says: its text without the lines that only name the run (``RUN_LINE``)."""
    return "\n".join(ln for ln in (body or "").strip().splitlines() if not ln.rstrip().endswith(RUN_LINE))


def comment_marker(key: str) -> str:
    """The hidden line that identifies a comment, so a run can tell whether it was posted."""
    return _COMMENT.format(key)


def comment_key(fp: str, op: str, run_key: str) -> str:
    return hashlib.sha256(f"{fp}|{op}|{run_key}".encode()).hexdigest()[:16]


def fingerprint(fields: dict[str, str]) -> str:
    text = ";".join(f"{k}={v}" for k, v in sorted(fields.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def group_fields(f: Finding, group_by: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for k in group_by:
        if k == "suite" and f.kind == "infrastructure":
            continue  # a runner or device failure is the backend's, whichever suites it cost
        out[k] = f.kind if k == "kind" else str(getattr(f, k, "") or getattr(f.case, k, "") or "")
    return out


def build_groups(cls: Classification, current: Results, filed_kinds=FILED_KINDS,
                 group_by=GROUP_BY) -> tuple[dict[str, Group], dict[str, bool]]:
    """Bad groups (confirmed regressions of a filed kind), and ``fingerprint -> bad`` for every
    group that ran in this run (the history needs the clean ones to count clean runs)."""
    groups: dict[str, Group] = {}
    for f in cls.findings:
        # flakes and improvements are not regressions, but may be filed when asked for
        # quarantined items are always filed, as their suite x backend's flaky issue (open while any is
        # quarantined: the visible record of the quarantine); other flakes only when asked for
        if not (f.confirmed and (f.kind in filed_kinds or f.category == "quarantined")
                and (f.regression or f.kind in ("flaky", "improvement", "infrastructure"))):
            continue
        fields = group_fields(f, group_by)
        fp = fingerprint(fields)
        groups.setdefault(fp, Group(fp, fields)).findings.append(f)
    status: dict[str, bool] = {}
    seen: set[tuple] = set()
    for c in current.cases.values():
        sig = tuple(getattr(c, k, "") for k in group_by if k != "kind")
        if sig in seen:
            continue
        seen.add(sig)
        for kind in (*filed_kinds, "flaky"):  # flaky: the quarantine's issues, filed whenever it has items
            fields = {k: (kind if k == "kind" else str(getattr(c, k, "") or "")) for k in group_by
                      if not (k == "suite" and kind == "infrastructure")}  # as _fields groups them
            status[fingerprint(fields)] = False
    for fp in groups:
        status[fp] = True
    return groups, status


def items_digest(items: list[str]) -> str:
    return hashlib.sha256("\n".join(items).encode()).hexdigest()[:16]


def _encode(state: dict) -> str:
    return base64.b64encode(json.dumps(state, separators=(",", ":"), ensure_ascii=False).encode()).decode()


def state_line(state: dict) -> str:
    return f"<!-- harness:state={_encode(state)} -->"


def marker(group: Group, pending: str = "") -> str:
    """Fingerprint and state lines; the state keeps as many item ids as fit in ``MARKER_MAX``
    once encoded (measured, not estimated: a name of 4-byte characters takes 16/3 per character)."""
    items = group.items()
    state = {"digest": items_digest(items), "items": items, "n": len(items)}
    if pending:
        state["pending"] = pending
    limit = MARKER_MAX - 200
    if len(_encode(state)) > limit:
        lo, hi = 0, len(items)  # the most items that fit: binary search on the encoded size
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if len(_encode({**state, "items": items[:mid]})) <= limit:
                lo = mid
            else:
                hi = mid - 1
        state["items"] = items[:lo]
    return f"<!-- harness:fingerprint={group.fingerprint} -->\n{state_line(state)}\n"


def with_pending(body: str, key: str) -> str:
    """The same body with ``pending=key`` in its state marker (for a close: the body is kept)."""
    state = {**read_state(body), "pending": key}
    if _STATE.search(body or ""):
        return _STATE.sub(lambda _m: state_line(state), body, count=1)
    return (body or "") + "\n" + state_line(state)


def read_state(body: str) -> dict:
    m = _STATE.search(body or "")
    if not m:
        return {"digest": "", "items": []}
    try:
        return json.loads(base64.b64decode(m.group(1)))
    except ValueError:
        return {"digest": "", "items": []}


def what_changed(old: list[str], new: list[str], run_line: str) -> str:
    added, gone = sorted(set(new) - set(old)), sorted(set(old) - set(new))
    lines = [f"Changed in {scrub(run_line)}:"]
    for title, items in (("newly regressed", added), ("no longer regressed", gone)):
        if items:
            shown = ", ".join(md_code(i) for i in items[:20])
            more = f" and {len(items) - 20} more" if len(items) > 20 else ""
            lines.append(f"- {title} ({len(items)}): {shown}{more}")
    lines.append(f"- still regressed: {len(set(new) & set(old))}")
    return "\n".join(lines)


class _Planned:
    """The actions of one plan, in the order they are to be applied."""

    def __init__(self, run_key: str):
        self.run_key = run_key
        self.actions: list[Action] = []

    def act(self, op: str, fp: str, title: str, labels: list[str], body: str = "", comment: str = "",
            number: int | None = None, reason: str = "") -> None:
        """An action on an existing issue; one with a comment carries its comment key in the body's
        marker, so a later run can tell whether the comment was posted."""
        key = comment_key(fp, f"{op}#{number}", self.run_key) if comment else ""
        if key and op != "create":
            body = with_pending(body, key)
        self.actions.append(Action(op, fp, title, labels, body, comment, number, reason, key))


def plan(groups: dict[str, Group], status: dict[str, bool | None], existing: list[IssueRef], render,
         run_line: str, known_closed: dict[str, int], clean_streaks: dict[str, int],
         close_after: int = 2, run_key: str = "", leave_alone: frozenset[str] = frozenset()) -> list[Action]:
    """``render(group, reopened: bool) -> body`` (marker included, size-checked; the comment key
    of a change is added to its marker here);
    ``known_closed`` maps fingerprints to closed issue numbers from the history; ``clean_streaks``
    counts this run; ``leave_alone``: fingerprints of issues a person detached from harness.
    ``status[fp]`` is True (bad), False (clean, every regressed item of its issue ran) or None
    (not known this run: a shard is missing)."""
    p = _Planned(run_key)
    open_by_fp = _close_duplicates(existing, p)
    _file_groups(groups, open_by_fp, render, run_line, known_closed, leave_alone, p)
    _close_clean(groups, status, open_by_fp, run_line, clean_streaks, close_after, leave_alone, p)
    return p.actions


def _close_duplicates(existing: list[IssueRef], p: _Planned) -> dict[str, IssueRef]:
    """The open issue of each group (the oldest); a younger open one of the same group is closed as
    its duplicate unless a person muted it."""
    open_by_fp: dict[str, IssueRef] = {}
    for issue in sorted(existing, key=lambda i: i.number):
        fp = issue.fingerprint
        if not fp or issue.state != "open":
            continue
        first = open_by_fp.setdefault(fp, issue)  # the oldest is the issue of the group
        if first is not issue and MUTED_LABEL not in issue.labels:
            p.act("close", fp, issue.title, issue.labels, issue.body, number=issue.number,
                  comment=f"Duplicate of #{first.number}, which tracks the same problem group. Closing.",
                  reason=f"duplicate of #{first.number}")
    return open_by_fp


def _file_groups(groups: dict[str, Group], open_by_fp: dict[str, IssueRef], render, run_line: str,
                 known_closed: dict[str, int], leave_alone: frozenset[str], p: _Planned) -> None:
    """Each bad group's issue: updated when its items changed, reopened when it was closed, else created."""
    for fp, g in sorted(groups.items(), key=lambda kv: kv[1].title):
        issue = open_by_fp.get(fp)
        if fp in leave_alone or (issue is not None and MUTED_LABEL in issue.labels):
            continue
        if issue is not None:
            old = read_state(issue.body)
            if old.get("digest") == items_digest(g.items()):
                continue
            p.act("update", fp, g.title, g.labels, render(g, False), number=issue.number,
                  comment=what_changed(old.get("items", []), g.items(), run_line),
                  reason="the set of regressed items changed")
        elif fp in known_closed:
            p.act("reopen", fp, g.title, g.labels, render(g, True), number=known_closed[fp],
                  comment=f"Regressed again in {scrub(run_line)}: {len(g.items())} item(s). Reopening.",
                  reason="regressed again")
        else:
            p.actions.append(Action("create", fp, g.title, g.labels, render(g, False),
                                    reason=f"{len(g.findings)} regressed items"))


def _close_clean(groups: dict[str, Group], status: dict[str, bool | None], open_by_fp: dict[str, IssueRef],
                 run_line: str, clean_streaks: dict[str, int], close_after: int, leave_alone: frozenset[str],
                 p: _Planned) -> None:
    """An open issue whose group was known clean in the last ``close_after`` runs is closed."""
    for fp, issue in sorted(open_by_fp.items()):
        if fp in groups or fp in leave_alone or MUTED_LABEL in issue.labels or status.get(fp) is not False:
            continue  # still bad, muted, or not known to be clean this time (a missing shard proves nothing)
        if clean_streaks.get(fp, 0) >= close_after:
            p.act("close", fp, issue.title, issue.labels, issue.body, number=issue.number,
                  comment=f"No longer regressed: clean in the last {clean_streaks[fp]} runs "
                          f"(latest: {scrub(run_line)}). Closing; harness reopens it if it comes back.",
                  reason=f"{clean_streaks[fp]} clean runs")
