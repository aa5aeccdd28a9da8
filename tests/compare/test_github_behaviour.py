"""`harness compare` against GitHub as it really behaves (issue #10): one test per failure found.

Every test drives the command line (``harness.cli.main([...])`` in-process, or the real
``harness`` executable where processes matter) against the local GitHub server, which enforces
what GitHub does: 65,536-character bodies (422), 410 Gone for deleted issues, faults that happen
after the write was applied, paginated listings, secondary rate limits. No sink is passed in: the
paths users run are the paths tested.
"""

from __future__ import annotations

import html
import itertools
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time

import pytest

from harness.cli import main as harness_main

from .github_server import MAX_BODY, TOKEN
from .junit_factory import item, write_junit

_n = itertools.count()
ISSUES = "/repos/acme/models/issues"
WHO = ("GET", "/user")  # who the token is: asked once per run, before harness judges an issue its own


class Run:
    def __init__(self, code, out, err, requests):
        self.code, self.out, self.err, self.requests = code, out, err, requests


@pytest.fixture
def cli(tmp_path, github, capsys, monkeypatch):
    """``cli(items, *args, baseline=..., shards=...)``: write the run's XML, run `harness compare`
    with the github sink against the local server and one history, return what it did."""
    monkeypatch.chdir(tmp_path)

    def run(items=None, *args, baseline=None, files=None, url=True, history="h.sqlite"):
        n = next(_n)
        paths = files or [write_junit(tmp_path / f"cur-{n}.xml", items)]
        argv = ["compare", *map(str, paths), "--history", history, "--sink", "github",
                "--run-id", f"run-{n}", "--mute-file", ""]
        if url:
            argv += ["--github-url", github.url]
        if baseline is not None:
            argv += ["--baseline", write_junit(tmp_path / f"base-{n}.xml", baseline)]
        before = len(github.state.requests)
        code = harness_main(argv + list(map(str, args)))
        cap = capsys.readouterr()
        return Run(code, cap.out, cap.err, github.state.requests[before:])
    return run


def clean():
    return [item("kimi-k2", "smoke"), item("kimi-k2", "parallel")]


def broken():
    return [item("kimi-k2", "smoke", fail="logits differ"), item("kimi-k2", "parallel")]


def worse():
    return [item("kimi-k2", "smoke", fail="logits differ"), item("kimi-k2", "parallel", fail="hangs")]


def comments(github, n):
    return [c["body"] for c in github.state.issues[n]["comments"]]


# 1 -----------------------------------------------------------------------------------------------
def test_1_github_api_url_alone_points_the_client_at_the_server(cli, github, monkeypatch):
    """GitHub Enterprise Server runners set only GITHUB_API_URL: it must be used (and the token
    must go nowhere else)."""
    monkeypatch.setenv("GITHUB_API_URL", github.url + "/api/v3")
    r = cli(broken(), baseline=clean(), url=False)
    assert r.code == 0 and "issue sink unavailable" not in r.err
    assert r.requests[0] == ("GET", ISSUES) and len(github.state.open_issues()) == 1


# 2 -----------------------------------------------------------------------------------------------
def _shards(tmp_path, n, precision_fails=True, drop=None):
    """Shard 0: the precision items of kimi-k2 on cpu; shard 1: its smoke item."""
    prec = [item("kimi-k2", "precision", dtype=d, fail="rel_rmse 0.2 > 0.01" if precision_fails else "",
                 details={"first_divergent_module": "model.layers.1.mlp"} if precision_fails else None)
            for d in ("float32", "bfloat16")]
    paths = [tmp_path / f"r{n}-shard-0.xml", tmp_path / f"r{n}-shard-1.xml"]
    write_junit(paths[0], prec)
    write_junit(paths[1], [item("kimi-k2", "smoke")])
    if drop == "missing":
        os.remove(paths[0])
    elif drop == "truncated":  # the runner died mid-write: the precision cases are cut off
        text = paths[0].read_text()
        paths[0].write_text(text[: text.index("<testcase")] + text[text.index("<testcase"):][:40])
    return paths


def test_2_a_missing_or_truncated_shard_neither_closes_nor_files_vanished(cli, github, tmp_path):
    base = [item("kimi-k2", "smoke")] + [item("kimi-k2", "precision", dtype=d) for d in ("float32", "bfloat16")]
    first = cli(files=_shards(tmp_path, 0), baseline=base)
    assert first.code == 0 and len(github.state.open_issues()) == 1
    (issue,) = github.state.open_issues()
    assert "kind:precision" in issue["labels"]
    for n, drop in ((1, "missing"), (2, "truncated"), (3, "missing")):
        r = cli(None, "--expect-shards", 2, files=_shards(tmp_path, n, drop=drop), baseline=base)
        assert r.code == 0
        if drop == "missing":
            assert "expected 2 shard files but found 1" in r.err  # a named, missing file is no shard
        else:
            assert "truncated" in r.err
    # three runs without the precision results: nothing proves the problem is gone
    assert [i["labels"][1] for i in github.state.open_issues()] == ["kind:precision"]
    assert issue["state"] == "open" and not any(i["labels"][1] == "kind:vanished"
                                                for i in github.state.issues.values())
    assert comments(github, 1) == []


# 3 -----------------------------------------------------------------------------------------------
def test_3_a_create_answered_5xx_after_github_applied_it_leaves_one_issue(cli, github):
    github.state.fail_next(502, after_apply=True, method="POST", path=ISSUES)
    r = cli(broken(), baseline=clean())
    assert r.code == 0 and len(github.state.issues) == 1, github.state.requests
    assert r.requests.count(("POST", ISSUES)) == 1  # looked (listing) instead of posting again
    again = cli(broken(), baseline=clean())
    assert again.requests == [("GET", ISSUES), WHO] and len(github.state.issues) == 1


# 4 -----------------------------------------------------------------------------------------------
def test_4_a_deleted_issue_410_is_filed_again_when_the_regression_returns(cli, github):
    cli(broken(), baseline=clean())
    cli(clean(), baseline=clean())
    cli(clean(), baseline=clean())
    assert github.state.issues[1]["state"] == "closed"
    github.state.delete(1)  # an admin deleted it: 410 Gone from now on
    back = cli(broken(), baseline=clean())
    assert ("GET", ISSUES + "/1") in back.requests and len(github.state.open_issues()) == 1
    (new,) = github.state.open_issues()
    assert "logits differ" in new["body"]
    quiet = cli(broken(), baseline=clean())  # the new number is kept: no third issue
    assert quiet.requests == [("GET", ISSUES), WHO] and len(github.state.issues) == 1


# 5 -----------------------------------------------------------------------------------------------
def test_5_an_update_whose_comment_was_lost_is_commented_once_next_run(cli, github):
    cli(broken(), baseline=clean())
    # the budget ends between the body PATCH and the comment
    cut = cli(worse(), "--max-api-calls", 3, baseline=clean())
    assert cut.requests == [("GET", ISSUES), WHO, ("PATCH", ISSUES + "/1")] and comments(github, 1) == []
    cli(worse(), baseline=clean())
    (comment,) = comments(github, 1)
    assert "newly regressed (1)" in comment and "parallel" in comment
    # a comment that GitHub stored but answered 502 for is not posted twice either
    github.state.fail_next(502, after_apply=True, method="POST", path=ISSUES + "/1/comments")
    cli(broken(), baseline=clean())
    cli(broken(), baseline=clean())
    cli(broken(), baseline=clean())
    assert len(comments(github, 1)) == 2 and "no longer regressed (1)" in comments(github, 1)[1]


# 6 -----------------------------------------------------------------------------------------------
def test_6_non_ascii_names_still_fit_githubs_body_limit(cli, github):
    check = "精度检查" * 12  # 48 CJK characters: 1 character, 3 UTF-8 bytes, 6 JSON-escaped characters
    bad = [item("s0", f"{check}{i:04d}", fail="x") for i in range(600)]
    r = cli(bad, baseline=[item("s0", f"{check}{i:04d}") for i in range(600)])
    assert r.code == 0 and len(github.state.issues) == 1, r.out
    (issue,) = github.state.issues.values()
    assert len(issue["body"]) <= MAX_BODY and "Truncated" in issue["body"]


# 7 -----------------------------------------------------------------------------------------------
def test_7_secrets_are_scrubbed_before_any_cut_and_on_stderr(cli, github, tmp_path):
    secret = "ghp_" + "Q7wZ" * 9  # a token echoed by a failing test, not in this environment
    log = "x" * 100 + secret + "y" * 2976  # the body keeps the last 3,000 characters: 20 of the token
    cli([item("kimi-k2", "smoke", fail="boom", log=log)], baseline=[item("kimi-k2", "smoke")])
    (issue,) = github.state.issues.values()
    assert secret[-20:] not in issue["body"] and "***" in issue["body"]
    # a proxy that echoes the request's credentials in its error message
    github.state.fail_next(403, method="GET", path=ISSUES, echo_auth=True, message="blocked")
    summary = tmp_path / "summary.md"
    r = cli(broken(), "--summary", summary, baseline=clean())
    assert "issue sink unavailable" in r.err and "blocked" in r.err
    for text in (r.out, r.err, summary.read_text()):
        assert TOKEN not in text and TOKEN[-20:] not in text


# 8 -----------------------------------------------------------------------------------------------
def test_8_test_names_cannot_inject_markdown_or_html(cli, github):
    name = "smoke`<img src=x onerror=alert(1)>`**x**"
    cli([item("kimi-k2", name, fail="x")], baseline=[item("kimi-k2", name)])
    (issue,) = github.state.issues.values()
    # outside fenced code (where everything is literal text, like the reproduction line)
    body = re.sub(r"(?ms)^(`{3,})\n.*?\n\1$", "", issue["body"])
    assert "<img" not in body and "`<" not in body and "**x**" not in body
    assert f"{name}[cpu-float32]" in html.unescape(body)  # shown as itself


# 9 -----------------------------------------------------------------------------------------------
def test_9_an_issue_whose_label_a_person_removed_is_left_alone(cli, github):
    cli(broken(), baseline=clean())
    github.state.issues[1]["labels"].remove("harness")
    first = cli(worse(), baseline=clean())  # one look to learn what happened, nothing written
    assert first.requests == [("GET", ISSUES), ("GET", ISSUES + "/1"), WHO]
    for items in (broken(), worse()):
        r = cli(items, baseline=clean())
        assert r.requests == [("GET", ISSUES)]  # neither fetched nor patched again
    assert "Reopened" not in github.state.issues[1]["body"] and len(github.state.issues) == 1
    assert comments(github, 1) == []


# 10 ----------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_10_two_compares_at_once_on_one_history_file_one_issue_both_runs_recorded(github, tmp_path):
    env = {**os.environ, "GITHUB_TOKEN": TOKEN, "GITHUB_REPOSITORY": "acme/models"}
    env.pop("GITHUB_API_URL", None)
    history = tmp_path / "h.sqlite"
    github.state.latency = 0.2  # a real round trip: the two runs' listings overlap
    for trial in range(2):
        procs = []
        for k in range(2):
            cur = write_junit(tmp_path / f"t{trial}-{k}.xml", broken() if trial == 0 else worse())
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "harness", "compare", cur, "--history", str(history),
                 "--sink", "github", "--github-url", github.url, "--run-id", f"t{trial}-{k}",
                 "--baseline", write_junit(tmp_path / f"b{trial}-{k}.xml", clean()), "--mute-file", ""],
                cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err
            assert "UNIQUE constraint" not in err and "could not record" not in err, err
    assert len(github.state.issues) == 1 and len(comments(github, 1)) == 1  # one update, one comment
    with sqlite3.connect(history) as db:
        keys = sorted(k for (k,) in db.execute("SELECT run_key FROM runs WHERE kind = 'run'"))
    assert keys == ["t0-0", "t0-1", "t1-0", "t1-1"]


# 11 ----------------------------------------------------------------------------------------------
def test_11_timing_noise_below_the_floor_never_files_whatever_the_history(cli, github):
    base = [item("kimi-k2", "smoke", metrics={"wall_time_s": 0.1256})]
    # unchanged code on a busy machine: one outlier, then ordinary jitter around 0.13-0.14 s
    for v in (0.1301, 0.3012, 0.1404, 0.1391, 0.1398, 0.1262, 0.1410, 0.1402):
        r = cli([item("kimi-k2", "smoke", metrics={"wall_time_s": v})], baseline=base)
        assert r.code == 0
    assert github.state.issues == {}


# 12 ----------------------------------------------------------------------------------------------
def test_12_report_after_compare_counts_the_run_once_and_plots_rel_rmse(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fast = [item("kimi-k2", "smoke", metrics={"wall_time_s": 1.0})]
    layers = ('[{"module": "a", "rel_rmse": 0.0, "max_abs_err": 0.5, "tolerance": 0.01, "ok": true},'
              ' {"module": "b", "rel_rmse": 0.2, "max_abs_err": 0.001, "tolerance": 0.01, "ok": false}]')
    prec = item("kimi-k2", "precision", fail="rel_rmse 0.2 > 0.01",
                details={"first_divergent_module": "b", "layer_table": layers})
    base = write_junit(tmp_path / "base.xml", fast + [item("kimi-k2", "precision")])
    for i in range(4):
        harness_main(["compare", write_junit(tmp_path / f"r{i}.xml", fast), "--history", "h.sqlite",
                      "--sink", "stdout", "--run-id", f"r{i}", "--baseline", base])
    slow = write_junit(tmp_path / "slow.xml", [item("kimi-k2", "smoke", metrics={"wall_time_s": 1.5}), prec])
    harness_main(["compare", slow, "--history", "h.sqlite", "--sink", "stdout", "--baseline", base])
    capsys.readouterr()
    assert harness_main(["report", slow, "--history", "h.sqlite", "-o", "r.html", "--baseline", base]) == 0
    page = (tmp_path / "r.html").read_text()
    assert "suspected (1 bad run)" in page  # one slow run, not two: the compare's record is this run
    assert "rel RMSE per layer vs its tolerance" in page


def test_12_the_layer_plot_draws_what_the_tolerance_bounds_and_no_invented_zeros():
    from harness.compare.report import layer_series
    x, y, zeros, tol = layer_series([{"rel_rmse": 0.0, "max_abs_err": 0.5, "tolerance": 0.01},
                                     {"rel_rmse": 0.2, "max_abs_err": 1e-3, "tolerance": 0.01}])
    assert (x, y, zeros, tol) == ([1], [0.2], [0], [0.01, 0.01])


def _children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    return out


def _big_baseline(path, n: int) -> None:
    rows = "".join(
        f'<testcase classname="suites.s.toml" name="op_{i:06d}[cpu-float32]" time="0.01"><properties>'
        '<property name="harness.suite" value="s"/><property name="harness.check" value="ops"/>'
        '<property name="harness.backend" value="cpu"/><property name="harness.dtype" value="float32"/>'
        f'<property name="metric.wall_time_s" value="0.01"/><property name="metric.max_abs_err" value="1e-05"/>'
        f'<property name="harness.detail.note" value="{"z" * 300}"/></properties></testcase>'
        for i in range(n))
    path.write_text(f'<testsuites><testsuite name="pytest" tests="{n}">{rows}</testsuite></testsuites>')


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc") or (os.cpu_count() or 1) < 2,
                    reason="the baseline child process needs a second core and /proc")
def test_12_killing_compare_ends_its_prefetch_child(tmp_path):
    _big_baseline(tmp_path / "base.xml", 60_000)  # ~45 MiB: seconds of parsing for the child
    cur = write_junit(tmp_path / "cur.xml", [item("s", "ops")])
    parent = subprocess.Popen([sys.executable, "-m", "harness", "compare", cur, "--baseline",
                               str(tmp_path / "base.xml"), "--history", str(tmp_path / "h.sqlite")],
                              cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    kids: list[int] = []
    while not kids and time.monotonic() < deadline and parent.poll() is None:
        kids = _children(parent.pid)
        time.sleep(0.02)
    assert kids, "compare started no prefetch child"
    time.sleep(1.0)  # let it get well into the parse: the case of a compare killed mid-run
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    t = time.monotonic()
    while any(os.path.exists(f"/proc/{k}") and _alive(k) for k in kids) and time.monotonic() - t < 10:
        time.sleep(0.02)
    gone_after = time.monotonic() - t
    assert gone_after < 1.0, f"the child outlived its parent by {gone_after:.1f} s"
    with sqlite3.connect(tmp_path / "h.sqlite") as db:
        assert db.execute("SELECT COUNT(*) FROM runs").fetchone()[0] == 0  # it wrote nothing


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except OSError:
        return False
