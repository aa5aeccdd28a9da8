"""The upstream canary's comparison (issue #31 item 6): the next stack's run (pre-release torch /
transformers) against the pinned run as the baseline, `harness compare --upstream`: a regression is
filed as kind `upstream`, its title and body naming the package versions that changed; the stack
each run used comes from the `harness.stack.*` properties `harness run` writes."""

from __future__ import annotations

import io
import json

from harness.compare.pipeline import Options, run_compare

from .junit_factory import item, write_junit

PINNED = {"torch": "2.13.0+cpu", "transformers": "5.24.0", "harness": "0.1.0"}
NEXT = {"torch": "2.14.0.dev20261203+cpu", "transformers": "5.25.0.dev0", "harness": "0.1.0"}


def test_a_break_on_the_next_stack_is_an_upstream_issue_naming_the_versions(tmp_path):
    pinned = write_junit(tmp_path / "pinned.xml", [item("s", "smoke"), item("s", "precision")], stack=PINNED)
    nxt = write_junit(tmp_path / "next.xml", [item("s", "smoke"), item("s", "precision", fail="logits 0.3 > 0.04")],
                      stack=NEXT)
    out = run_compare(Options(results=[nxt], baseline=[pinned], history=None, sink="file",
                              out_dir=str(tmp_path / "issues"), upstream=True), out=io.StringIO())
    (action,) = out.actions
    assert action.title == ("[harness] upstream regression: s on cpu (torch 2.13.0+cpu -> 2.14.0.dev20261203+cpu, "
                            "transformers 5.24.0 -> 5.25.0.dev0)")
    assert "kind:upstream" in action.labels
    assert "stack (pinned -&gt; next)" in action.body or "stack (pinned -> next)" in action.body
    assert "2.14.0.dev20261203" in action.body
    filed = json.loads((tmp_path / "issues" / "issues.json").read_text())
    assert [i["title"] for i in filed.values()] == [action.title]


def test_without_upstream_the_same_results_are_a_plain_failure(tmp_path):
    pinned = write_junit(tmp_path / "pinned.xml", [item("s", "smoke")], stack=PINNED)
    nxt = write_junit(tmp_path / "next.xml", [item("s", "smoke", fail="nan")], stack=NEXT)
    out = run_compare(Options(results=[nxt], baseline=[pinned], history=None), out=io.StringIO())
    assert [a.title for a in out.actions] == ["[harness] failure regression: s on cpu"]
    assert out.current.stack["torch"] == {"2.14.0.dev20261203+cpu"}
