"""Where the plan of issue actions goes.

Every sink answers the same five questions as :class:`harness.github_client.GitHubClient`
(``list_issues``, ``create``, ``get``, ``edit``, ``comment``), so the planner cannot tell them apart:

* ``github`` -- the real thing (needs ``GITHUB_TOKEN``);
* ``file``   -- one markdown file per issue plus ``issues.json`` (their state) and
  ``actions.json`` (a log of every action), in a folder CI can upload as an artifact; it keeps
  state between runs exactly as GitHub would, so dedupe/close/reopen behave the same;
* ``stdout`` -- prints the actions; knows of no earlier issues.

:func:`execute` applies a plan to a sink, or only prints it with ``dry_run``.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import sys
from typing import TextIO

from harness.compare.issues import MUTED_LABEL, Action, IssueRef


class FileSink:
    def __init__(self, folder: str):
        self.folder = folder
        self.calls = 0
        os.makedirs(folder, exist_ok=True)
        self._state_path = os.path.join(folder, "issues.json")
        self._log_path = os.path.join(folder, "actions.json")
        self.issues: dict[int, dict] = {}
        if os.path.exists(self._state_path):
            with open(self._state_path, encoding="utf-8") as f:
                self.issues = {int(k): v for k, v in json.load(f).items()}

    def list_issues(self, label: str, state: str = "open") -> list[IssueRef]:
        return [IssueRef(n, i["title"], i["body"], i["state"], i["labels"])
                for n, i in sorted(self.issues.items())
                if label in i["labels"] and state in ("all", i["state"])]

    def get(self, number: int) -> IssueRef:
        i = self.issues[number]
        return IssueRef(number, i["title"], i["body"], i["state"], i["labels"])

    def create(self, title: str, body: str, labels: list[str]) -> int:
        number = max(self.issues, default=0) + 1
        self.issues[number] = {"title": title, "body": body, "state": "open", "labels": labels,
                               "comments": []}
        self._save(number, {"op": "create", "title": title})
        return number

    def edit(self, number: int, body: str | None = None, state: str | None = None) -> None:
        if body is not None:
            self.issues[number]["body"] = body
        if state is not None:
            self.issues[number]["state"] = state
        self._save(number, {"op": "edit", "state": state, "body_changed": body is not None})

    def comment(self, number: int, body: str) -> None:
        self.issues[number]["comments"].append(body)
        self._save(number, {"op": "comment", "body": body})

    def _save(self, number: int, entry: dict) -> None:
        i = self.issues[number]
        with open(os.path.join(self.folder, f"issue-{number}.md"), "w", encoding="utf-8") as f:
            f.write(f"# {i['title']}\n\nstate: {i['state']} | labels: {', '.join(i['labels'])}\n\n")
            f.write(i["body"])
            for c in i["comments"]:
                f.write(f"\n\n---\n**comment**\n\n{c}")
        with open(self._state_path, "w", encoding="utf-8") as f:
            json.dump(self.issues, f, indent=1)
        log = []
        if os.path.exists(self._log_path):
            with open(self._log_path, encoding="utf-8") as f:
                log = json.load(f)
        log.append({"time": dt.datetime.now(dt.timezone.utc).isoformat(), "issue": number, **entry})
        with open(self._log_path, "w", encoding="utf-8") as f:
            json.dump(log, f, indent=1)


class StdoutSink:
    """Prints what it is asked to do; remembers nothing, so every bad group reads as new."""

    persistent = False  # its issue numbers are made up: never record them in the history

    def __init__(self, out: TextIO | None = None):
        self.out = out or sys.stdout
        self.calls = 0
        self._n = 0

    def list_issues(self, label: str, state: str = "open") -> list[IssueRef]:
        return []

    def get(self, number: int) -> IssueRef:
        return IssueRef(number, "", "", "closed", [])

    def create(self, title: str, body: str, labels: list[str]) -> int:
        self._n += 1
        print(f"\n=== new issue: {title}  [{', '.join(labels)}]\n{body}", file=self.out)
        return self._n

    def edit(self, number: int, body: str | None = None, state: str | None = None) -> None:
        print(f"\n=== issue #{number}: state={state or 'unchanged'}"
              f"{'' if body is None else ', new body:'}\n{body or ''}", file=self.out)

    def comment(self, number: int, body: str) -> None:
        print(f"\n=== comment on #{number}:\n{body}", file=self.out)


def execute(actions: list[Action], sink, dry_run: bool = False, out: TextIO | None = None,
            on_issue=None) -> list[dict]:
    """Apply each action (at most two calls each); a failure stops only that action. Returns a log
    entry per action. ``on_issue(fingerprint, number, state)`` records the outcome (history)."""
    out = out or sys.stdout
    log = []
    for i, a in enumerate(actions):
        entry = {"op": a.op, "title": a.title, "number": a.number, "reason": a.reason,
                 "fingerprint": a.fingerprint}
        if dry_run:
            print(f"[dry-run] would {a.op} {('#' + str(a.number)) if a.number else 'issue'}: "
                  f"{a.title} ({a.reason})", file=out)
            log.append({**entry, "status": "planned"})
            continue
        try:
            number, state = _apply(a, sink)
            if on_issue is not None:
                on_issue(a.fingerprint, number, state)
            log.append({**entry, "number": number, "status": "done"})
        except Exception as e:  # noqa: BLE001 - one failed action must not stop the others
            log.append({**entry, "status": "failed", "error": f"{type(e).__name__}: {e}"})
            print(f"harness compare: could not {a.op} '{a.title}': {type(e).__name__}: {e}", file=out)
            if type(e).__name__ == "CallBudgetExceeded":
                for rest in actions[i + 1:]:
                    log.append({"op": rest.op, "title": rest.title, "status": "skipped",
                                "error": "API call budget used up; retried next run"})
                break
    return log


def _apply(a: Action, sink) -> tuple[int, str]:
    if a.op == "create":
        return sink.create(a.title, a.body, a.labels), "open"
    if a.op == "update":
        sink.edit(a.number, body=a.body)
        sink.comment(a.number, a.comment)
        return a.number, "open"
    if a.op == "reopen":
        try:
            closed = sink.get(a.number)  # on GitHub this fetch is the one the edit needs anyway
        except Exception as e:
            # deleted on GitHub (github3's NotFoundError) or unknown to this sink: open a new one
            if not isinstance(e, KeyError) and type(e).__name__ != "NotFoundError":
                raise
            return sink.create(a.title, a.body, a.labels), "open"
        if MUTED_LABEL in closed.labels:
            return a.number, closed.state  # muted by a person: leave it as it is
        sink.edit(a.number, body=a.body, state="open")
        return a.number, "open"
    if a.op == "close":
        sink.comment(a.number, a.comment)
        sink.edit(a.number, state="closed")
        return a.number, "closed"
    raise ValueError(f"unknown action {a.op!r}")
