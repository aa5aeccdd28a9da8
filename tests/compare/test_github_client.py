"""harness.compare.github_client against the local GitHub server, through github3.py itself."""

from __future__ import annotations

import time

import pytest

from harness.compare.github_client import CallBudgetExceeded, GitHubClient, GitHubConfigError
from harness.compare.sinks import IssueGone, SinkError

from .github_server import SECONDARY, TOKEN


def client(server, **kw) -> tuple[GitHubClient, list[float]]:
    slept: list[float] = []
    kw.setdefault("sleep", slept.append)  # record the back-off instead of waiting it out
    return GitHubClient("acme/models", TOKEN, enterprise_url=server.url, **kw), slept


def test_create_list_comment_close_reopen(github):
    c, _ = client(github)
    n = c.create("[harness] failure regression: s on cpu", "body <!-- x -->", ["harness", "kind:failure"])
    c.create("unrelated", "b", ["bug"])
    listed = c.list_issues("harness")
    assert [(i.number, i.title, i.state) for i in listed] == [(n, "[harness] failure regression: s on cpu", "open")]
    assert listed[0].labels == ["harness", "kind:failure"]
    c.comment(n, "what changed")
    c.edit(n, state="closed")
    assert github.state.issues[n]["state"] == "closed"
    assert c.list_issues("harness") == []
    fresh, _ = client(github)  # a new run: the closed issue is fetched by number, then reopened
    fresh.edit(n, body="new body", state="open")
    assert github.state.issues[n]["state"] == "open" and github.state.issues[n]["body"] == "new body"
    assert [x["body"] for x in github.state.issues[n]["comments"]] == ["what changed"]
    # edit sends only what changed: a title edited by a person survives
    assert github.state.issues[n]["title"] == "[harness] failure regression: s on cpu"


def test_listing_paginates_and_counts_calls(github):
    c, _ = client(github)
    for i in range(150):
        github.state.issues[i + 1] = {"title": f"t{i}", "body": "", "labels": ["harness"], "state": "open",
                                      "comments": []}
    before = c.calls
    assert len(c.list_issues("harness")) == 150
    assert c.calls - before == 1 + 2  # who the token is (GET /user), then github3 asks for 100 per page


def test_rate_limit_403_with_reset_is_waited_out_and_retried(github):
    c, slept = client(github)
    github.state.fail_next(403, {"X-RateLimit-Remaining": "0", "X-RateLimit-Reset": str(int(time.time()) + 3)})
    assert c.list_issues("harness") == []
    assert len(slept) == 1 and 1.0 <= slept[0] <= 5.0
    assert c.calls == 2


def test_rate_limit_429_retry_after(github):
    c, slept = client(github)
    github.state.fail_next(429, {"Retry-After": "7"})
    c.create("t", "b", ["harness"])
    assert slept == [7.0]


def test_server_error_500_backs_off_then_succeeds(github):
    c, slept = client(github)
    github.state.fail_next(500, times=2)
    n = c.create("t", "b", ["harness"])  # repository lookup retried twice, then create
    assert n == 1 and slept == [1.0, 2.0]


def test_persistent_500_gives_up_with_a_sink_error(github):
    c, slept = client(github, retries=2)
    github.state.fail_next(500, times=10)
    with pytest.raises(SinkError) as e:
        c.list_issues("harness")
    assert e.value.status == 500 and not e.value.maybe_applied  # a GET changes nothing
    assert len(slept) == 2 and c.calls == 3


def test_a_post_answered_5xx_is_never_retried_and_may_have_been_applied(github):
    c, slept = client(github)
    c.create("first", "b", ["harness"])
    github.state.fail_next(502, after_apply=True, method="POST")
    with pytest.raises(SinkError) as e:
        c.create("second", "b", ["harness"])
    assert e.value.maybe_applied and slept == []
    assert [i["title"] for i in github.state.issues.values()] == ["first", "second"]  # once, not twice


def test_secondary_rate_limit_is_waited_out_even_for_a_post(github):
    c, slept = client(github)
    github.state.fail_next(403, {"Retry-After": "3"}, method="POST", message=SECONDARY)
    c.create("t", "b", ["harness"])  # not processed by GitHub: safe to send again
    assert slept == [3.0] and len(github.state.issues) == 1
    github.state.fail_next(403, method="POST", message=SECONDARY)  # no header: GitHub says wait a minute
    c.create("u", "b", ["harness"])
    assert slept == [3.0, 60.0] and len(github.state.issues) == 2


def test_a_deleted_issue_is_gone(github):
    c, _ = client(github)
    n = c.create("t", "b", ["harness"])
    github.state.delete(n)
    fresh, _ = client(github)
    with pytest.raises(IssueGone, match="410"):
        fresh.get(n)


def test_plain_403_is_not_retried(github):
    c, slept = client(github)
    github.state.fail_next(403, {"X-RateLimit-Remaining": "4000"}, message="Resource not accessible by integration")
    with pytest.raises(SinkError) as e:
        c.list_issues("harness")
    assert slept == [] and e.value.status == 403


def test_call_budget_is_a_hard_cap(github):
    c, _ = client(github, max_calls=2)
    c.create("a", "b", ["harness"])  # repository + create
    with pytest.raises(CallBudgetExceeded):
        c.create("c", "d", ["harness"])
    assert len(github.state.requests) == 2


def test_api_url_layout_and_bad_token(github, monkeypatch):
    c = GitHubClient("acme/models", TOKEN, api_url=github.url + "/")
    assert c.list_issues("harness") == []
    assert github.state.requests[-1] == ("GET", "/repos/acme/models/issues")
    wrong = GitHubClient("acme/models", "ghp_wrong", enterprise_url=github.url)
    with pytest.raises(SinkError) as e:
        wrong.list_issues("harness")
    assert e.value.status == 401 and "ghp_wrong" not in str(e.value)


def test_config_errors_are_clear(monkeypatch):
    monkeypatch.delenv("GITHUB_TOKEN", raising=False)
    monkeypatch.delenv("GITHUB_REPOSITORY", raising=False)
    with pytest.raises(GitHubConfigError, match="GITHUB_REPOSITORY"):
        GitHubClient.from_env()
    with pytest.raises(GitHubConfigError, match="GITHUB_TOKEN"):
        GitHubClient.from_env("acme/models")
    with pytest.raises(GitHubConfigError, match="OWNER/NAME"):
        GitHubClient("nope", "t")


def test_from_env_uses_actions_variables(github, monkeypatch):
    monkeypatch.setenv("GITHUB_API_URL", github.url + "/api/v3")
    c = GitHubClient.from_env()
    c.create("t", "b", ["harness"])
    assert (c.owner, c.name) == ("acme", "models") and github.state.issues[1]["title"] == "t"
    assert TOKEN not in repr(c.session.auth) and TOKEN not in repr(c.gh)
