"""GitHub's documented limits (issue #49): a pull request with 1,500 failing items got no triage at all
(the comment exceeded 65,536 characters: 422), 12,000 lost the whole job summary (over 1 MiB). Bodies
are fitted: the most important rows first, the rest counted, never an oversized post."""

from __future__ import annotations

from harness.compare.limits import COMMENT_MAX, STEP_SUMMARY_MAX
from harness.compare.report import write_step_summary
from harness.compare.triage import VERDICT, Triage, comment_body


def _rows(n: int) -> list[Triage]:
    # new failures first (as triage() orders them), long names: 1,500 of them are far over the limit
    return [Triage(f"k{i}", f"suite-{i}::precision[cpu-bfloat16-variant-with-a-long-name-{i}]", "suite", "cpu",
                   VERDICT["new_failure" if i < 10 else "still_failing"], None if i < 10 else 100 + i,
                   "a note that takes its room " * 3) for i in range(n)]


def test_a_comment_for_1500_failing_items_fits_with_the_new_ones_first():
    body = comment_body(_rows(1500), "https://github.com/o/r/actions/runs/1")
    assert len(body) <= COMMENT_MAX and len(body.encode()) <= COMMENT_MAX, len(body)
    assert "10 new in this change, 1490 not" in body  # the summary line counts every item
    assert all(f"long-name-{i}&#93;" in body for i in range(10))  # every new failure is shown
    assert "more row(s) not shown" in body and "the full report: this run's job summary" in body
    shown = body.count("| <code>suite-")
    assert 10 < shown < 1500 and f"... {1500 - shown} more row(s) not shown" in body, shown


def test_a_small_comment_is_left_whole():
    body = comment_body(_rows(3), "run")
    assert "not shown" not in body and body.count("| <code>suite-") == 3


def test_the_job_summary_of_12000_items_stays_under_1_mib(tmp_path, monkeypatch):
    f = tmp_path / "summary.md"
    f.write_text("# an earlier step's part\n" * 1000)  # what is already in this step's file counts
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(f))
    text = "\n".join(["## harness", "", "| item | outcome |", "|---|---|"]
                     + [f"| suite::precision[cpu-bfloat16-{i}] | failed: budget use 1.{i:05d} |" for i in range(12000)]
                     + ["", "end"])
    assert len(text.encode()) > STEP_SUMMARY_MAX // 2
    big = text * 3  # ~1.9 MiB
    assert write_step_summary(big, "https://example/run") == str(f)
    assert f.stat().st_size <= STEP_SUMMARY_MAX, f.stat().st_size
    out = f.read_text()
    assert "## harness" in out and "more row(s) not shown" in out and "https://example/run" in out
