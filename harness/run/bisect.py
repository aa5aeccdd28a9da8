"""``harness bisect``: the first commit at which items went bad, in the repository harness runs in.

The repository is the vendor's project (suites, goldens, ``harness.toml``, its backend plugin or
kernels; or harness itself). Between a good and a bad commit (``git rev-list --ancestry-path``,
oldest first), a binary search; at each step the commit is checked out in a worktree of its own
(``git worktree add --detach``, removed after) and ``harness run`` runs there - the same command,
the same isolation, with the worktree first on ``PYTHONPATH`` so that its own modules (a plugin, or
harness itself) are the ones imported - selecting only the items being bisected.

Steps, as named in the report:

``bad end``   the bad commit first, with every item asked for (or, with none, every item of the
              run arguments): the items that fail there are the ones bisected - the others are
              dropped, said so; none failing: nothing to bisect (exit 1);
``step k``    the middle commit of what is left, only those items: bad if any of them failed or
              errored, good if every one passed, *skipped* if one of them does not exist there or
              the run could not produce results (the search then tries the next commit; git
              bisect's ``skip``);

and the answer: the first bad commit, with every step's verdicts per item. ``log2(n) + 1`` runs for
``n`` commits (32 commits: 6).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

from harness.files import paths
from harness.settings import unset_env

BAD = ("failed", "error")


class BisectError(Exception):
    """Cannot bisect at all (not a repository, unknown commits, no path between them): one line."""


@dataclass
class Step:
    label: str
    commit: str
    subject: str
    verdicts: dict[str, str]  # item -> passed | failed | error | skipped | missing
    verdict: str  # bad | good | skip
    log: str = ""
    messages: dict[str, str] = field(default_factory=dict)  # item -> its failure's first line

    def line(self) -> str:
        items = ", ".join(f"{k} {v}" + (f": {self.messages[k]}" if self.messages.get(k) else "")
                          for k, v in sorted(self.verdicts.items()))
        return f"{self.label:<9} {self.commit[:12]} {self.verdict:<4} {self.subject[:60]}  [{items}]"


@dataclass
class Bisection:
    items: list[str]
    steps: list[Step] = field(default_factory=list)
    first_bad: str | None = None
    message: str = ""

    def report(self) -> str:
        lines = [s.line() for s in self.steps]
        return "\n".join(lines + ["", self.message])


def _git(repo: Path, *args: str) -> str:
    r = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise BisectError(f"git {' '.join(args)}: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else 'failed'}")
    return r.stdout.strip()


def commits(repo: Path, good: str, bad: str) -> list[str]:
    """Commits after ``good`` up to ``bad`` (included), oldest first, on the ancestry path."""
    g, b = _git(repo, "rev-parse", "--verify", f"{good}^{{commit}}"), _git(repo, "rev-parse", "--verify", f"{bad}^{{commit}}")
    if subprocess.run(["git", "-C", str(repo), "merge-base", "--is-ancestor", g, b]).returncode != 0:
        raise BisectError(f"{good} is not an ancestor of {bad}: nothing to bisect between them")
    out = _git(repo, "rev-list", "--reverse", "--ancestry-path", f"{g}..{b}")
    return out.split() if out else []


def item_id(suite: str, name: str) -> str:
    """``tiny::smoke[cpu-float32]``: the suite name and the item's test name (as the summary shows them)."""
    return f"{suite}::{name}"


def read_verdicts(junit: Path, messages: dict[str, str] | None = None) -> dict[str, str]:
    """item -> outcome from a run's junit.xml (``messages``: item -> the first line of a failure's
    or error's message)."""
    out: dict[str, str] = {}
    root = ET.parse(junit).getroot()
    for tc in root.iter("testcase"):
        props = {p.get("name"): p.get("value") for p in tc.iter("property")}
        # "s.tiny.toml" without the property: the file's stem
        suite = props.get("harness.suite") or tc.get("classname", "").removesuffix(".toml").rsplit(".", 1)[-1]
        kids = {c.tag for c in tc}
        outcome = ("failed" if "failure" in kids else "error" if "error" in kids else
                   "skipped" if "skipped" in kids else "passed")
        out[item_id(str(suite), tc.get("name", ""))] = outcome
        bad = next((c for c in tc if c.tag in ("failure", "error")), None)
        if messages is not None and bad is not None:
            messages[item_id(str(suite), tc.get("name", ""))] = (bad.get("message") or "").strip().split("\n")[0][:200]
    return out


def _selection(items: list[str]) -> tuple[list[str], str]:
    """The suites to name and the -k expression that selects exactly these items (by their suite
    file's node and their test name)."""
    suites = sorted({i.split("::", 1)[0] for i in items})
    terms = [f"({i.split('::', 1)[0]}.toml and {i.split('::', 1)[1]})" for i in sorted(items)]
    return suites, " or ".join(terms)


def run_at(repo: Path, commit: str, items: list[str] | None, run_args: list[str], work: Path,
           timeout: float, messages: dict[str, str] | None = None) -> tuple[dict[str, str] | None, str]:
    """``harness run`` at ``commit`` in a worktree of its own: (item -> outcome, or None when the run
    produced no results; the run's last output lines)."""
    # the commit's name comes from git (hex), still joined through the checked helper
    wt = paths.join(work, f"c-{commit[:12]}", source="git rev-list", field="commit")
    _git(repo, "worktree", "add", "--detach", "--force", str(wt), commit)
    results = paths.join(work, f"r-{commit[:12]}", source="git rev-list", field="commit")
    try:
        cmd = [sys.executable, "-m", "harness", "run"]
        if items:
            suites, expr = _selection(items)
            cmd += [*suites, "-k", expr]
        cmd += ["--results", str(results), *run_args]
        env = dict(os.environ)
        unset_env("HARNESS_CONFIG", env)  # the worktree's own harness.toml, not the one of the checkout we run from
        env["PYTHONPATH"] = os.pathsep.join([str(wt), *filter(None, [env.get("PYTHONPATH")])])
        env.setdefault("HF_HUB_OFFLINE", "1")
        try:
            r = subprocess.run(cmd, cwd=wt, env=env, capture_output=True, text=True, timeout=timeout,
                               stdin=subprocess.DEVNULL)
            tail = "\n".join((r.stdout + r.stderr).strip().splitlines()[-5:])
        except subprocess.TimeoutExpired:
            return None, f"harness run did not finish within {timeout:g} s"
        junit = results / "junit.xml"
        if not junit.exists():
            return None, tail
        try:
            return read_verdicts(junit, messages), tail
        except ET.ParseError as e:
            return None, f"{junit}: {e}"
    finally:
        subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(wt)], capture_output=True)


def bisect(repo: Path, good: str, bad: str, items: list[str], run_args: list[str], *,
           timeout: float = 3600.0, say=print) -> Bisection:
    repo = Path(_git(Path(repo), "rev-parse", "--show-toplevel"))
    todo = commits(repo, good, bad)
    if not todo:
        raise BisectError(f"{bad} is {good}: nothing to bisect")
    res = Bisection(list(items))
    with tempfile.TemporaryDirectory(prefix="harness-bisect-") as d:
        work = Path(d)

        def step(label: str, commit: str, wanted: list[str] | None) -> Step:
            msgs: dict[str, str] = {}
            verdicts, tail = run_at(repo, commit, wanted, run_args, work, timeout, msgs)
            subject = _git(repo, "log", "-1", "--format=%s", commit)
            if verdicts is None:
                s = Step(label, commit, subject, {}, "skip", tail)
            else:
                mine = {i: verdicts.get(i, "missing") for i in (wanted or verdicts)}
                v = ("bad" if any(o in BAD for o in mine.values()) else
                     "skip" if any(o in ("missing", "skipped") for o in mine.values()) else "good")
                s = Step(label, commit, subject, mine, v, tail, {i: m for i, m in msgs.items() if i in mine})
            res.steps.append(s)
            say(s.line())
            return s

        first = step("bad end", todo[-1], items or None)
        failing = sorted(i for i, o in first.verdicts.items() if o in BAD)
        if not failing:
            res.message = (f"not reproduced: at {bad} ({todo[-1][:12]}) "
                           + ("no results: " + first.log if first.verdict == "skip" else "every item passed")
                           + "; nothing to bisect")
            return res
        dropped = sorted(set(first.verdicts) - set(failing)) if items else []
        res.items = failing
        # Binary search over todo[:-1] (todo[-1] is bad); lo..hi: the first bad is in todo[lo..hi].
        lo, hi, k = 0, len(todo) - 1, 0
        skipped: set[int] = set()
        while lo < hi:
            cands = [i for i in range(lo, hi) if i not in skipped]
            if not cands:
                break
            mid = min(cands, key=lambda i: abs(i - (lo + hi) // 2))
            k += 1
            s = step(f"step {k}", todo[mid], failing)
            if s.verdict == "bad":
                hi = mid
            elif s.verdict == "good":
                lo = mid + 1
            else:
                skipped.add(mid)
        res.first_bad = todo[hi]
        subject = _git(repo, "log", "-1", "--format=%h %s", todo[hi])
        unsure = [todo[i][:12] for i in sorted(skipped) if lo <= i < hi]
        res.message = (f"first bad commit: {subject} ({len(res.steps)} runs over {len(todo)} commits; items: "
                       f"{', '.join(failing)})"
                       + (f"; or one of the skipped commits before it: {', '.join(unsure)}" if unsure else "")
                       + (f"; passed at the bad end, not bisected: {', '.join(dropped)}" if dropped else ""))
    return res
