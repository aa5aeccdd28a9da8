"""Pull-request triage (issue #31 item 5): the job summary of a pull request's comparison says, for
each failing item, whether it is new in the change, already failing on main (with main's issue),
flaky (quarantined on main, or passed on a rerun) or the runner's; through `harness compare` with
main's history and quarantine, as ci.yml's compare-pr job runs it."""

from __future__ import annotations

import html
import json

from harness.cli import main as cli

from .junit_factory import item, write_junit


def compare(tmp_path, junit, sink: str, run_id: str, capsys) -> str:
    argv = ["compare", str(junit), "--history", str(tmp_path / "h.sqlite"), "--sink", sink,
            "--out-dir", str(tmp_path / "issues"), "--run-id", run_id, "--summary", str(tmp_path / f"{run_id}.md"),
            "--quarantine", str(tmp_path / "q.json")]
    assert cli(argv) == 0
    capsys.readouterr()
    return (tmp_path / f"{run_id}.md").read_text()


def test_each_failure_says_whose_it_is(tmp_path, capsys):
    # main: s::a fails (its issue is filed), everything else passes; t::e is quarantined on main
    (tmp_path / "q.json").write_text(json.dumps({"format": 1, "items": {"suites.t.toml::e[cpu-float32]": {
        "since": "2026-12-01", "reason": "flaky: failed 1 of 3 attempts (rate 0.33)", "rate": 0.333}}}))
    main = write_junit(tmp_path / "main.xml", [item("s", "a", fail="logits 0.3 > 0.04"), item("s", "b"),
                                               item("s", "c"), item("t", "d"), item("t", "e")])
    compare(tmp_path, main, "file", "main-1", capsys)
    filed = json.loads((tmp_path / "issues" / "issues.json").read_text())
    (number,) = [n for n, i in filed.items() if i["title"].startswith("[harness] failure regression: s")]
    (flaky_issue,) = [n for n, i in filed.items() if i["title"] == "[harness] flaky tests (quarantined): t on cpu"]
    # the pull request: a still fails, b is newly broken, c flaked and passed on a rerun, d lost its
    # worker to the OOM killer in every attempt, e (quarantined) failed again
    flaky = {"confirm": "flaky", "confirm_attempts": json.dumps(
        [{"outcome": "failed", "message": "x", "seconds": 1}, {"outcome": "passed", "message": "", "seconds": 1},
         {"outcome": "passed", "message": "", "seconds": 1}])}
    three = json.dumps([{"outcome": "error", "message": "crashed with SIGKILL", "seconds": 1}] * 3)
    pr = write_junit(tmp_path / "pr.xml", [
        item("s", "a", fail="logits 0.3 > 0.04"), item("s", "b", fail="loss is nan"), item("s", "c", details=flaky),
        item("t", "d", error="infrastructure: crashed with SIGKILL",
             details={"confirm": "infrastructure", "confirm_attempts": three}),
        item("t", "e", fail="loss is nan")])
    text = compare(tmp_path, pr, "stdout", "pr-1", capsys)
    table = text.split("### Whose failures")[1].split("\n\n", 2)
    assert table[1] == "1 new in this change, 4 not (already failing on main, flaky or the runner's)."
    rows = {html.unescape(line.split("|")[1]).strip().removeprefix("<code>").removesuffix("</code>"):
            [c.strip() for c in line.split("|")[4:7]] for line in table[2].splitlines() if line.startswith("| <code>")}
    assert rows["b[cpu-float32]"][:2] == ["new in this change", ""]
    assert rows["a[cpu-float32]"][:2] == ["already failing on main", f"#{number}"]
    assert rows["e[cpu-float32]"][:2] == ["flaky (quarantined on main)", f"#{flaky_issue}"]
    assert rows["c[cpu-float32]"][:2] == ["flaky (passed on a rerun)", ""]
    assert rows["c[cpu-float32]"][2].startswith("flaky: failed 1 of 3 attempts")
    assert rows["d[cpu-float32]"][0] == "infrastructure (the runner or device, not this change)"
    assert rows["d[cpu-float32]"][2] == "infrastructure: failed 3 of 3 attempts"
    assert list(rows)[0] == "b[cpu-float32]"  # the new item first: what the author has to look at


def test_a_clean_run_has_no_triage(tmp_path, capsys):
    clean = write_junit(tmp_path / "c.xml", [item("s", "a"), item("s", "b")])
    assert "Whose failures" not in compare(tmp_path, clean, "stdout", "pr-2", capsys)


def test_one_comment_on_the_pull_request_is_kept_up_to_date(tmp_path, capsys, github, monkeypatch):
    """`--pr-comment auto` in a pull request's run: one comment, created once and edited after (never a
    second one); a token the API refuses costs one line, never the comparison."""
    # the pull request: to the issues API (comments) a pull request is an issue
    github.state.issues[7] = {"title": "Make attention faster", "body": "", "labels": [], "state": "open",
                              "comments": [], "changes": []}
    monkeypatch.setenv("GITHUB_REF", "refs/pull/7/merge")
    # no history here: each of a pull request's runs reads main's, restored afresh and never saved
    argv = ["--history", "", "--sink", "stdout", "--pr-comment", "auto",
            "--api-url", github.url, "--summary", str(tmp_path / "s.md")]

    def run(junit, key):
        assert cli(["compare", str(junit), *argv, "--run-id", key]) == 0
        return capsys.readouterr()

    out = run(write_junit(tmp_path / "1.xml", [item("s", "a", fail="loss is nan"), item("s", "b")]), "pr-1")
    assert "pull request #7: triage comment created" in out.out
    (c,) = github.state.issues[7]["comments"]
    assert "<!-- harness:pr-triage -->" in c["body"] and "new in this change" in c["body"]
    out = run(write_junit(tmp_path / "2.xml", [item("s", "a"), item("s", "b", fail="loss is nan")]), "pr-2")
    assert "triage comment updated" in out.out
    (c,) = github.state.issues[7]["comments"]  # still one
    assert c["edits"] == 1 and "b&#91;cpu-float32&#93;" in c["body"] and "a&#91;cpu-float32&#93;" not in c["body"]
    out = run(write_junit(tmp_path / "3.xml", [item("s", "a"), item("s", "b", fail="loss is nan", log="x")]), "pr-3")
    assert "triage comment unchanged" in out.out and github.state.issues[7]["comments"][0]["edits"] == 1
    github.state.fail_next(403, message="Resource not accessible by integration")  # a fork's read-only token
    out = run(write_junit(tmp_path / "4.xml", [item("s", "a", fail="x"), item("s", "b")]), "pr-4")
    assert "could not comment on pull request #7" in out.err and "Traceback" not in out.err
