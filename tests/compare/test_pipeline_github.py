"""The issue life cycle end to end: compare -> github3.py -> local GitHub server.

Three runs of one regression leave one issue and no repeated comment; two clean runs close it;
a recurrence reopens it; a change of what is regressed adds exactly one comment.
"""

from __future__ import annotations

import html
import io
import itertools

from harness.compare.github_client import GitHubClient
from harness.compare.pipeline import Options, run_compare

from .github_server import TOKEN
from .junit_factory import item, write_junit

_runs = itertools.count()


def compare(tmp_path, github, items, baseline=None, sink=None, **kw):
    n = next(_runs)
    cur = write_junit(tmp_path / f"cur-{n}.xml", items)
    base = [write_junit(tmp_path / f"base-{n}.xml", baseline)] if baseline else None
    out = io.StringIO()
    opts = Options(results=[cur], baseline=base, history=str(tmp_path / "history.sqlite"), sink="github",
                   enterprise_url=github.url, run_key=f"run-{n}", commit=f"c0ffee{n:04d}", **kw)
    before = len(github.state.requests)
    outcome = run_compare(opts, sink=sink, out=out)
    outcome.requests = github.state.requests[before:]
    outcome.printed = out.getvalue()
    return outcome


def clean(**kw):
    return [item("kimi-k2", "smoke", **kw), item("kimi-k2", "parallel")]


def broken(**kw):
    return [item("kimi-k2", "smoke", fail="logits differ @alice", **kw), item("kimi-k2", "parallel")]


def comments(github, n):
    return [c["body"] for c in github.state.issues[n]["comments"]]


def test_three_runs_one_issue_two_clean_close_recurrence_reopens(tmp_path, github):
    first = compare(tmp_path, github, broken(), baseline=clean())
    assert [a.op for a in first.actions] == ["create"]
    # listing, the listing again right before creating (another process may have filed it), the
    # repository, the create
    assert first.requests == [("GET", "/repos/acme/models/issues"), ("GET", "/repos/acme/models/issues"),
                              ("GET", "/repos/acme/models"), ("POST", "/repos/acme/models/issues")]
    for _ in range(2):
        again = compare(tmp_path, github, broken(), baseline=clean())
        # the listing, and once per run who the token is (an issue is harness's only if it opened it)
        assert again.actions == [] and again.requests == [("GET", "/repos/acme/models/issues"), ("GET", "/user")]
    assert len(github.state.issues) == 1 and len(github.state.open_issues()) == 1
    (number, issue), = github.state.issues.items()
    assert comments(github, number) == []
    assert issue["labels"] == ["harness", "kind:failure", "suite:kimi-k2", "backend:cpu"]
    assert "@\u200dalice" in issue["body"] and "@alice" not in issue["body"]

    one = compare(tmp_path, github, clean(), baseline=clean())
    assert one.actions == [] and github.state.issues[number]["state"] == "open"
    two = compare(tmp_path, github, clean(), baseline=clean())
    assert [a.op for a in two.actions] == ["close"]
    assert github.state.issues[number]["state"] == "closed"
    assert len(comments(github, number)) == 1 and "clean in the last 2 runs" in comments(github, number)[0]
    assert len(two.requests) == 4  # listing + who the token is + close + comment

    back = compare(tmp_path, github, broken(), baseline=clean())
    assert [a.op for a in back.actions] == ["reopen"]
    assert github.state.issues[number]["state"] == "open" and len(github.state.issues) == 1
    assert "Reopened" in github.state.issues[number]["body"]
    assert len(back.requests) == 5  # listing + get + who the token is + patch + comment
    assert "Regressed again" in comments(github, number)[-1]


def test_changed_items_add_one_comment_saying_what_changed(tmp_path, github):
    compare(tmp_path, github, broken(), baseline=clean())
    worse = [item("kimi-k2", "smoke", fail="x"), item("kimi-k2", "parallel", fail="y")]
    upd = compare(tmp_path, github, worse, baseline=clean())
    assert [a.op for a in upd.actions] == ["update"]
    (number,) = github.state.issues
    (comment,) = map(html.unescape, comments(github, number))
    assert "newly regressed (1)" in comment and "parallel[cpu-float32]" in comment
    assert "still regressed: 1" in comment and "smoke" not in comment.split("still")[0].split("newly")[0]
    assert len(upd.requests) == 4  # listing + who the token is + body + comment
    compare(tmp_path, github, worse, baseline=clean())
    assert len(comments(github, number)) == 1


def test_one_noisy_run_never_files_a_metric_regression(tmp_path, github):
    fast = [item("kimi-k2", "smoke", metrics={"wall_time_s": 1.0})]
    slow = [item("kimi-k2", "smoke", metrics={"wall_time_s": 1.5})]
    for _ in range(4):
        compare(tmp_path, github, fast, baseline=fast)
    noisy = compare(tmp_path, github, slow, baseline=fast)
    assert noisy.actions == [] and not github.state.issues
    assert any(f.category == "metric_regression" and not f.confirmed for f in noisy.classification.findings)
    compare(tmp_path, github, fast, baseline=fast)
    compare(tmp_path, github, slow, baseline=fast)
    assert not github.state.issues  # bad, good, bad: never two in a row
    second = compare(tmp_path, github, slow, baseline=fast)
    assert [a.op for a in second.actions] == ["create"]
    (issue,) = github.state.issues.values()
    body = html.unescape(issue["body"])
    assert "kind:performance" in issue["labels"] and "wall_time_s" in body and "+50.0%" in body


def test_history_change_point_without_baseline(tmp_path, github):
    for v in (1.0, 1.02, 0.99, 1.01, 1.0):
        compare(tmp_path, github, [item("q", "perf", metrics={"step_time_s": v})])
    first_slow = compare(tmp_path, github, [item("q", "perf", metrics={"step_time_s": 1.3})])
    assert not first_slow.actions
    second_slow = compare(tmp_path, github, [item("q", "perf", metrics={"step_time_s": 1.31})])
    assert [a.op for a in second_slow.actions] == ["create"]
    f = next(f for f in second_slow.classification.findings if f.category == "metric_regression")
    assert "change point" in f.note and f.bad_runs == 2


def test_dry_run_plans_but_changes_nothing(tmp_path, github):
    dry = compare(tmp_path, github, broken(), baseline=clean(), dry_run=True)
    assert [a.op for a in dry.actions] == ["create"] and "[dry-run] would create" in dry.printed
    assert github.state.mutating() == [] and not github.state.issues


def test_muted_label_and_mute_file(tmp_path, github):
    compare(tmp_path, github, broken(), baseline=clean())
    (number,) = github.state.issues
    github.state.issues[number]["labels"].append("harness:muted")
    worse = [item("kimi-k2", "smoke", fail="x"), item("kimi-k2", "parallel", fail="y")]
    assert compare(tmp_path, github, worse, baseline=clean()).actions == []
    mute = tmp_path / "mutes.toml"
    mute.write_text('[[mute]]\nbackend = "npu"\nuntil = 2999-01-01\nreason = "driver"\n'
                    '[[mute]]\nbackend = "npu"\nuntil = 2000-01-01\nreason = "old"\n')
    npu = [item("kimi-k2", "smoke", backend="npu", fail="x")]
    res = compare(tmp_path, github, npu, baseline=[item("kimi-k2", "smoke", backend="npu")],
                  mute_file=str(mute))
    assert res.actions == [] and len(res.muted) == 1
    assert any("expired on 2000-01-01" in p for p in res.problems)


def test_api_calls_are_one_listing_plus_at_most_two_per_group(tmp_path, github):
    suites = [f"s{i}" for i in range(5)]
    base = [item(s, "smoke") for s in suites]
    bad = [item(s, "smoke", fail="x") for s in suites]
    created = compare(tmp_path, github, bad, baseline=base)
    assert len(created.requests) == 1 + 1 + 1 + 5  # listing, listing again, repository, one create per group
    closed = [compare(tmp_path, github, base, baseline=base) for _ in range(2)][-1]
    assert len(closed.requests) == 1 + 1 + 2 * 5  # listing, who the token is, close + comment per group


def test_sink_outage_still_reports(tmp_path, github):
    github.state.fail_next(500, times=20)
    slept = []
    sink = GitHubClient("acme/models", TOKEN, enterprise_url=github.url, sleep=slept.append)
    res = compare(tmp_path, github, broken(), baseline=clean(), sink=sink)
    assert any("issue sink unavailable" in p and "500" in p for p in res.problems)
    assert res.classification.by_category("new_failure") and slept == [1.0, 2.0, 4.0, 8.0]
    assert res.api_calls == 5 and TOKEN not in "".join(res.problems)


def test_call_budget_stops_actions_and_says_so(tmp_path, github):
    base = [item(s, "smoke") for s in ("a", "b", "c")]
    bad = [item(s, "smoke", fail="x") for s in ("a", "b", "c")]
    res = compare(tmp_path, github, bad, baseline=base, max_api_calls=4)
    assert [e["status"] for e in res.log] == ["done", "failed", "skipped"]
    assert "budget" in res.log[1]["error"] and len(github.state.issues) == 1
    again = compare(tmp_path, github, bad, baseline=base)  # the next run catches up, no duplicate
    assert [a.op for a in again.actions] == ["create", "create"] and len(github.state.issues) == 3


def test_reopen_of_a_deleted_issue_opens_a_new_one(tmp_path, github):
    compare(tmp_path, github, broken(), baseline=clean())
    for _ in range(2):
        compare(tmp_path, github, clean(), baseline=clean())
    github.state.delete(1)  # someone deleted the closed issue: 410 Gone from now on
    back = compare(tmp_path, github, broken(), baseline=clean())
    assert [a.op for a in back.actions] == ["reopen"] and back.log[0]["status"] == "done"
    assert len(github.state.issues) == 1 and len(github.state.open_issues()) == 1
    assert back.requests[1:] == [("GET", "/repos/acme/models/issues/1"), ("GET", "/repos/acme/models/issues"),
                                 ("GET", "/repos/acme/models"),
                                 ("POST", "/repos/acme/models/issues")]  # 410, then a new issue
    again = compare(tmp_path, github, broken(), baseline=clean())
    assert again.actions == []  # the new number was recorded: no duplicate next run


def test_a_muted_closed_issue_is_not_reopened(tmp_path, github):
    compare(tmp_path, github, broken(), baseline=clean())
    for _ in range(2):
        compare(tmp_path, github, clean(), baseline=clean())
    github.state.issues[1]["labels"].append("harness:muted")
    back = compare(tmp_path, github, broken(), baseline=clean())
    assert github.state.issues[1]["state"] == "closed" and len(github.state.issues) == 1
    assert back.requests == [("GET", "/repos/acme/models/issues"), ("GET", "/repos/acme/models/issues/1"),
                             ("GET", "/user")]
