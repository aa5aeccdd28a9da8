"""Harness edits or closes on GitHub only what its own identity made (issue #49, "Security"): a hidden
marker, a title or a label anyone can copy is no proof. Through ``harness compare`` against the
local GitHub server, which, as GitHub does for a token with write access, lets harness edit what
others wrote: refusing is harness's job."""

from __future__ import annotations

import itertools

import pytest

from harness.cli import main as harness_main
from harness.compare.errors import SinkError
from harness.compare.github_client import GitHubClient, Identity
from harness.compare.triage import MARKER

from .github_server import TOKEN
from .junit_factory import item, write_junit

_n = itertools.count()
COMMENTS = r"/repos/acme/models/issues/comments/\d+"
# What a pull request's author pasted (or an earlier bot left): harness's marker and an all-clear.
ALL_CLEAR = f"{MARKER}\n### harness: whose failures\n\nNo failing item: nothing new in this change, nothing already failing on main."


def clean():
    return [item("kimi-k2", "smoke"), item("kimi-k2", "parallel")]


def broken(what: str = "smoke"):
    return [item("kimi-k2", n, fail="logits differ" if n == what else None) for n in ("smoke", "parallel")]


@pytest.fixture
def compare(tmp_path, github, capsys, monkeypatch):
    """``compare(items, *args)``: `harness compare` of a run against a clean baseline, the github
    sink and one history; returns (exit code, stdout, stderr)."""
    monkeypatch.chdir(tmp_path)
    base = write_junit(tmp_path / "base.xml", clean())

    def run(items, *args):
        n = next(_n)
        argv = ["compare", str(write_junit(tmp_path / f"cur-{n}.xml", items)), "--baseline", str(base),
                "--history", "h.sqlite", "--sink", "github", "--github-url", github.url, "--run-id", f"run-{n}",
                "--mute-file", "", *map(str, args)]
        code = harness_main(argv)
        cap = capsys.readouterr()
        return code, cap.out, cap.err
    return run


def _authors(github, number: int) -> list[str]:
    return [c["user"] for c in github.state.issues[number]["comments"]]


@pytest.mark.parametrize("app", [None, "harness-ci"], ids=["user-token", "app-token"])
def test_a_pr_authors_marker_comment_is_not_edited_harness_posts_its_own(compare, github, app):
    """The battery's case: the author's "No failing item" comment carries the marker; a new failure
    comes. Harness posts its own triage and leaves the author's text as it was. With an app's
    installation token the author is another app's bot (``github-actions[bot]``), same answer."""
    github.state.app = app
    pr = github.state.add_issue("Make attention faster", user="pr-author")
    theirs = github.state.add_comment(pr, ALL_CLEAR, user="github-actions[bot]" if app else "pr-author",
                                      app="github-actions" if app else None)
    code, out, err = compare(broken(), "--pr-comment", pr)
    assert code == 0 and f"pull request #{pr}: triage comment created" in out, out + err
    first, mine = github.state.issues[pr]["comments"]
    assert first["id"] == theirs and first["body"] == ALL_CLEAR and "edits" not in first
    assert mine["user"] == (f"{app}[bot]" if app else "harness-bot") and MARKER in mine["body"]
    assert "new in this change" in mine["body"] and "smoke&#91;cpu-float32&#93;" in mine["body"]
    assert ("PATCH", f"/repos/acme/models/issues/comments/{theirs}") not in github.state.requests
    # the next push edits harness's own comment, still never the author's
    code, out, _ = compare(broken("parallel"), "--pr-comment", pr)
    assert "triage comment updated" in out
    first, mine = github.state.issues[pr]["comments"]
    assert first["body"] == ALL_CLEAR and mine["edits"] == 1 and "parallel&#91;cpu-float32&#93;" in mine["body"]


@pytest.mark.parametrize("status", [403, 404])
def test_a_refused_edit_posts_the_triage_as_a_new_comment(compare, github, status):
    """GitHub refuses the edit of harness's own comment (403: locked conversation, the token's rights;
    404: deleted meanwhile): the new triage is posted as a comment, never lost; the run after edits
    the newest of harness's comments."""
    pr = github.state.add_issue("Make attention faster", user="pr-author")
    compare(clean(), "--pr-comment", pr)
    (old,) = github.state.issues[pr]["comments"]
    assert "No failing item" in old["body"]
    github.state.fail_next(status, method="PATCH", path=COMMENTS, message="Resource not accessible by integration")
    code, out, err = compare(broken(), "--pr-comment", pr)
    assert code == 0 and "triage comment created (the edit was refused" in out and str(status) in out, out + err
    old, new = github.state.issues[pr]["comments"]
    assert "No failing item" in old["body"] and "new in this change" in new["body"]
    compare(broken("parallel"), "--pr-comment", pr)
    old, new = github.state.issues[pr]["comments"]
    assert "No failing item" in old["body"] and new["edits"] == 1 and "parallel&#91;cpu-float32&#93;" in new["body"]


def test_a_person_s_copy_of_harness_s_issue_is_neither_updated_nor_closed(compare, github):
    """A person opens an issue with harness's title, labels and hidden fingerprint (copied from
    harness's): harness updates and closes its own only; it used to close the copy as a duplicate."""
    compare(broken())
    mine = github.state.issues[1]
    copied = mine["body"]
    copy = github.state.add_issue(mine["title"], copied, mine["labels"], user="alice")
    compare(broken("parallel"))  # the items changed: harness's issue is updated
    compare(clean())
    compare(clean())  # clean twice: harness's issue is closed
    assert github.state.issues[1]["state"] == "closed" and len(github.state.issues[1]["changes"]) == 2
    assert github.state.issues[copy]["state"] == "open" and github.state.issues[copy]["comments"] == []
    assert github.state.issues[copy]["body"] == copied
    assert not [r for r in github.state.mutating() if r[1].startswith(f"/repos/acme/models/issues/{copy}")]


def test_an_issue_harness_recorded_but_a_person_made_is_not_reopened_edited_or_closed(compare, github):
    """The history names issue #1 as the group's, but #1 is a person's (a history cached from another
    repository's run, a transferred issue): harness files its own instead of reopening or closing it."""
    compare(broken())
    compare(clean())
    compare(clean())  # #1 closed by harness; the history remembers it
    github.state.issues[1].update(user="alice", app=None)
    body = github.state.issues[1]["body"]
    code, out, err = compare(broken())
    assert code == 0, out + err
    assert github.state.issues[1]["state"] == "closed" and github.state.issues[1]["body"] == body
    (new,) = [n for n in github.state.issues if n != 1]
    assert github.state.issues[new]["user"] == "harness-bot" and github.state.issues[new]["state"] == "open"
    compare(clean())
    compare(clean())
    assert github.state.issues[new]["state"] == "closed" and github.state.issues[1]["body"] == body


def _client(github) -> GitHubClient:
    return GitHubClient("acme/models", TOKEN, enterprise_url=github.url)


def test_identity_is_the_user_or_the_app_s_bot_asked_once_per_run(github):
    c = _client(github)
    assert c.identity() == Identity("harness-bot") and c.identity() == Identity("harness-bot")
    assert github.state.requests == [("GET", "/user")]  # cached
    github.state.app = "harness-ci"  # an installation token: /user is refused, GraphQL's viewer answers
    c = _client(github)
    assert c.identity() == Identity("harness-ci[bot]", "harness-ci")
    # GitHub Enterprise Server: REST under /api/v3, GraphQL at /api/graphql
    assert [p for _, p in github.state.requests[1:]] == ["/user", "/api/graphql"]
    github.state.fail_next(500, path="/user", times=5)
    # the four retries' back-off (1+2+4+8 s) recorded, not slept: they were 15 s of this test's time
    slept: list[float] = []
    with pytest.raises(SinkError, match="who GITHUB_TOKEN is: GET /user answered 500"):
        GitHubClient("acme/models", TOKEN, enterprise_url=github.url, sleep=slept.append).identity()
    assert slept == [1.0, 2.0, 4.0, 8.0]


def test_only_harness_s_own_comments_count_as_posted(github):
    """The outbox asks whether a comment (by its hidden key) was posted: a person's comment quoting
    the key is not harness's."""
    c = _client(github)
    n = c.create("[harness] failure regression: s on cpu", "b", ["harness"])
    github.state.add_comment(n, "quoting <!-- harness:comment=abc -->", user="alice")
    assert c.comments(n) == []
    c.comment(n, "mine <!-- harness:comment=abc -->")
    assert c.comments(n) == ["mine <!-- harness:comment=abc -->"]
