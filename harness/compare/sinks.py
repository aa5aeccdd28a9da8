"""Where the plan of issue actions goes, and how it is applied so that no call is lost or doubled.

Every sink answers the same six questions as :class:`harness.compare.github_client.GitHubClient`
(``list_issues``, ``create``, ``get``, ``edit``, ``comment``, ``comments``), so the planner cannot
tell them apart, and reports trouble with the errors defined here (:class:`SinkError`; a deleted
issue is :class:`IssueGone`; an exhausted call budget :class:`BudgetExhausted`):

* ``github`` -- the real thing (needs ``GITHUB_TOKEN``);
* ``file``   -- one markdown file per issue plus ``issues.json`` (their state) and
  ``actions.json`` (a log of every action), in a folder CI can upload as an artifact; it keeps
  state between runs exactly as GitHub would, so dedupe/close/reopen behave the same;
* ``stdout`` -- prints the actions; knows of no earlier issues.

Sinks register like every other extension (harness/registry.py): an entry point in the
``harness.sinks`` group whose target is ``register(registry)`` adds :class:`SinkType` objects, a name
and ``make(options, out) -> sink``; the three above are harness's own entry point (:func:`register`).
``harness compare --sink NAME`` picks one by name.

:func:`execute` applies a plan to a sink, or only prints it with ``dry_run``. Its rules, because
GitHub can apply a request and still answer 5xx, and a run can stop between two calls:

* **create** is never retried blindly: right before the first create of a run, and after a create
  whose answer was lost, the open issues are listed again and the group's fingerprint looked for;
* **a state change and its comment**: the change (a PATCH carrying ``pending=<comment key>`` in the
  hidden state marker) goes first, the comment (carrying the same key) second, and the comment is
  written to the :class:`Outbox` (the history) before either. A later run finds comments still
  owed, checks that their state change landed (the key in the body) and that the comment is not
  already there (the key in the issue's comments), and posts it then: exactly one comment per
  change, whatever call was lost.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import sys
from typing import TextIO

from harness.compare.errors import BudgetExhausted, IssueGone, SinkConfigError, SinkError  # noqa: F401 (part of the sink interface)
from harness.compare.issues import LABEL, MUTED_LABEL, Action, IssueRef, comment_marker, read_state
from harness.compare.scrub import scrub, scrub_secrets
from harness.registry import NamedRegistry, of_group


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
        if number not in self.issues:
            raise IssueGone(f"issue #{number} does not exist in {self.folder}")
        i = self.issues[number]
        return IssueRef(number, i["title"], i["body"], i["state"], i["labels"])

    def comments(self, number: int) -> list[str]:
        self.get(number)
        return list(self.issues[number]["comments"])

    def create(self, title: str, body: str, labels: list[str]) -> int:
        number = max(self.issues, default=0) + 1
        self.issues[number] = {"title": title, "body": body, "state": "open", "labels": labels,
                               "comments": []}
        self._save(number, {"op": "create", "title": title})
        return number

    def edit(self, number: int, body: str | None = None, state: str | None = None) -> None:
        self.get(number)
        if body is not None:
            self.issues[number]["body"] = body
        if state is not None:
            self.issues[number]["state"] = state
        self._save(number, {"op": "edit", "state": state, "body_changed": body is not None})

    def comment(self, number: int, body: str) -> None:
        self.get(number)
        self.issues[number]["comments"].append(body)
        self._save(number, {"op": "comment", "body": body})

    def _save(self, number: int, entry: dict) -> None:
        from harness.files import atomic

        i = self.issues[number]
        text = (f"# {i['title']}\n\nstate: {i['state']} | labels: {', '.join(i['labels'])}\n\n" + i["body"]
                + "".join(f"\n\n---\n**comment**\n\n{c}" for c in i["comments"]))
        atomic.write_text(os.path.join(self.folder, f"issue-{number}.md"), scrub_secrets(text))
        atomic.write_json(self._state_path, self.issues, newline=False)
        log = []
        if os.path.exists(self._log_path):
            with open(self._log_path, encoding="utf-8") as f:
                log = json.load(f)
        log.append({"time": dt.datetime.now(dt.timezone.utc).isoformat(), "issue": number, **entry})
        atomic.write_json(self._log_path, log, newline=False)


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
        raise IssueGone(f"the stdout sink knows no issue #{number}")

    def comments(self, number: int) -> list[str]:
        return []

    def create(self, title: str, body: str, labels: list[str]) -> int:
        self._n += 1
        print(f"\n=== new issue: {title}  [{', '.join(labels)}]\n{body}", file=self.out)
        return self._n

    def edit(self, number: int, body: str | None = None, state: str | None = None) -> None:
        print(f"\n=== issue #{number}: state={state or 'unchanged'}"
              f"{'' if body is None else ', new body:'}\n{body or ''}", file=self.out)

    def comment(self, number: int, body: str) -> None:
        print(f"\n=== comment on #{number}:\n{body}", file=self.out)


# --- the registry of sink types ---------------------------------------------------------------------
class SinkType:
    """A named kind of sink: ``make(options, out)`` returns the sink for one ``harness compare`` run
    (``options``: :class:`harness.compare.pipeline.Options`, e.g. ``out_dir``, ``repo``; ``out``: where
    the run prints)."""

    def __init__(self, name: str, make, description: str = "", source: str = "builtin"):
        self.name, self.make, self.description, self.source = name, make, description, source

    def __repr__(self) -> str:
        return f"SinkType({self.name!r}, source={self.source!r})"


class SinkRegistry(NamedRegistry[SinkType]):
    kind = "issue sink"
    group = "harness.sinks"
    item_type = SinkType


def _github(opts, out):
    from harness.compare.github_client import GitHubClient  # the only networked module

    return GitHubClient.from_env(opts.repo, api_url=opts.api_url or None, enterprise_url=opts.enterprise_url,
                                 max_calls=opts.max_api_calls)


def register(registry: SinkRegistry) -> None:
    """harness's own sinks (the ``harness.sinks`` entry point in its pyproject.toml)."""
    registry.add(SinkType("github", _github, "GitHub issues (GITHUB_TOKEN, --repo / $GITHUB_REPOSITORY)"))
    registry.add(SinkType("file", lambda opts, out: FileSink(opts.out_dir),
                          "markdown per issue + issues.json + actions.json in --out-dir"))
    registry.add(SinkType("stdout", lambda opts, out: StdoutSink(out), "prints the actions; remembers nothing"))




def registry() -> SinkRegistry:
    return of_group(SinkRegistry.group)  # one per process (harness.registry)


def make(name: str, opts, out: TextIO):
    """The sink named ``name``; an unknown name is a SinkConfigError listing the registered ones."""
    try:
        kind = registry().get(name)
    except KeyError as e:
        raise SinkConfigError(str(e).strip("'\"")) from None
    return kind.make(opts, out)


class MemoryOutbox:
    """The outbox of a run without a history: comments owed are retried within the run only."""

    def __init__(self):
        self.entries: dict[str, tuple[int, str, str]] = {}

    def owe(self, key: str, number: int, fingerprint: str, text: str) -> None:
        self.entries[key] = (number, fingerprint, text)

    def settle(self, key: str) -> None:
        self.entries.pop(key, None)

    def owed(self) -> list[tuple[str, int, str, str]]:
        return [(k, n, fp, t) for k, (n, fp, t) in self.entries.items()]


class Executor:
    """Applies a plan to a sink (see the module docstring for the rules); one per run."""

    def __init__(self, sink, outbox=None, on_issue=None, out: TextIO | None = None):
        self.sink, self.out = sink, out or sys.stdout
        self.outbox = outbox if outbox is not None else MemoryOutbox()
        self.on_issue = on_issue or (lambda fp, n, s: None)
        self._relisted: dict[str, int] | None = None  # fingerprint -> open issue, listed again
        # issues whose owed comment could not be posted this run: no new change on them until it is,
        # or the next change would hide whether the earlier one landed
        self.blocked: set[int] = set()

    # ---- comments owed from earlier runs -------------------------------------------------------
    def settle_owed(self) -> list[dict]:
        """Post the comments earlier runs owe (their state change landed, the comment did not)."""
        log = []
        for key, number, fp, text in self.outbox.owed():
            entry = {"op": "comment", "title": f"owed comment on #{number}", "number": number,
                     "fingerprint": fp, "reason": "its state change landed in an earlier run"}
            try:
                issue = self.sink.get(number)
                if read_state(issue.body).get("pending") != key:
                    self.outbox.settle(key)  # the change never landed: the plan redoes it
                    continue
                self._comment(number, key, text)
                log.append({**entry, "status": "done"})
            except IssueGone:
                self.outbox.settle(key)
            except BudgetExhausted:
                log.append({**entry, "status": "skipped", "error": "API call budget used up"})
                raise
            except SinkError as e:
                self.blocked.add(number)
                log.append({**entry, "status": "failed", "error": scrub(str(e))})
        return log

    def _comment(self, number: int, key: str, text: str) -> None:
        """Post the comment unless it is already there; settle the outbox entry."""
        mark = comment_marker(key)
        if any(mark in c for c in self.sink.comments(number)):
            self.outbox.settle(key)
            return
        self.sink.comment(number, text + "\n\n" + mark)
        self.outbox.settle(key)

    def _change_then_comment(self, a: Action, number: int, **edit) -> None:
        """One state change and its comment, in the order that survives a lost call."""
        self.outbox.owe(a.comment_key, number, a.fingerprint, a.comment)
        self.sink.edit(number, **edit)
        try:
            self.sink.comment(number, a.comment + "\n\n" + comment_marker(a.comment_key))
        except BudgetExhausted:
            raise
        except SinkError as e:
            if e.maybe_applied:
                return  # maybe posted: the next run looks before posting again
            raise
        self.outbox.settle(a.comment_key)

    # ---- creating without duplicates -----------------------------------------------------------
    def _open_by_fingerprint(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for i in sorted(self.sink.list_issues(LABEL, "open"), key=lambda i: i.number):
            if i.fingerprint:
                out.setdefault(i.fingerprint, i.number)
        return out

    def _create(self, a: Action) -> tuple[int, str]:
        if self._relisted is None:  # another process (another workflow's history) may have filed it
            self._relisted = self._open_by_fingerprint()
        if a.fingerprint in self._relisted:
            return self._relisted[a.fingerprint], "open"
        for attempt in range(2):
            try:
                number = self.sink.create(a.title, a.body, a.labels)
                self._relisted[a.fingerprint] = number
                return number, "open"
            except SinkError as e:
                if not e.maybe_applied or isinstance(e, BudgetExhausted):
                    raise
                # The answer was lost: look before creating again.
                self._relisted = self._open_by_fingerprint()
                if a.fingerprint in self._relisted:
                    return self._relisted[a.fingerprint], "open"
                if attempt:
                    raise
        raise AssertionError("unreachable")

    # ---- the plan ------------------------------------------------------------------------------
    def apply(self, a: Action) -> tuple[int, str]:
        if a.number in self.blocked:
            raise SinkError(f"issue #{a.number} still owes a comment from an earlier run; retried next run")
        if a.op == "create":
            return self._create(a)
        if a.op == "update":
            try:
                self._change_then_comment(a, a.number, body=a.body)
            except IssueGone:  # deleted since the listing: file it again
                return self._create(a)
            return a.number, "open"
        if a.op == "reopen":
            try:
                closed = self.sink.get(a.number)  # on GitHub this fetch is the one the edit needs anyway
            except IssueGone:  # deleted (410 Gone) or unknown to this sink: open a new one
                self.on_issue(a.fingerprint, a.number, "gone")
                return self._create(a)
            if MUTED_LABEL in closed.labels:
                return a.number, "muted"  # muted by a person: leave it as it is
            if LABEL not in closed.labels:
                # A person took the issue out of harness's hands by removing the label: leave it,
                # and remember that, so later runs neither fetch nor patch it again.
                return a.number, "detached"
            self._change_then_comment(a, a.number, body=a.body, state="open")
            return a.number, "open"
        if a.op == "close":
            try:
                self._change_then_comment(a, a.number, body=a.body, state="closed")
            except IssueGone:
                return a.number, "gone"
            return a.number, "closed"
        raise ValueError(f"unknown action {a.op!r}")


def execute(actions: list[Action], sink, dry_run: bool = False, out: TextIO | None = None,
            on_issue=None, outbox=None) -> list[dict]:
    """Apply each action; a failure stops only that action (a used-up budget stops the rest).
    Returns a log entry per action. ``on_issue(fingerprint, number, state)`` records the outcome
    (history); ``outbox`` keeps the comments owed across runs (history; in memory without one)."""
    out = out or sys.stdout
    log: list[dict] = []
    if dry_run:
        for a in actions:
            print(f"[dry-run] would {a.op} {('#' + str(a.number)) if a.number else 'issue'}: "
                  f"{a.title} ({a.reason})", file=out)
            log.append({"op": a.op, "title": a.title, "number": a.number, "reason": a.reason,
                        "fingerprint": a.fingerprint, "status": "planned"})
        return log
    ex = Executor(sink, outbox, on_issue, out)
    try:
        log += ex.settle_owed()
    except BudgetExhausted:
        return log + _skipped(actions)
    for i, a in enumerate(actions):
        entry = {"op": a.op, "title": a.title, "number": a.number, "reason": a.reason,
                 "fingerprint": a.fingerprint}
        try:
            number, state = ex.apply(a)
            ex.on_issue(a.fingerprint, number, state)
            log.append({**entry, "number": number, "status": "done" if state in ("open", "closed")
                        else state})
        except (SinkError, OSError) as e:  # one failed action must not stop the others
            msg = scrub(f"{type(e).__name__}: {e}")
            log.append({**entry, "status": "failed", "error": msg})
            print(f"harness compare: could not {a.op} '{a.title}': {msg}", file=out)
            if isinstance(e, BudgetExhausted):
                log += _skipped(actions[i + 1:])
                break
    return log


def _skipped(actions: list[Action]) -> list[dict]:
    return [{"op": a.op, "title": a.title, "number": a.number, "fingerprint": a.fingerprint,
             "status": "skipped", "error": "API call budget used up; retried next run"} for a in actions]
