"""Reading and merging shards: pytest's shape, flakes, and bad input as messages, not crashes."""

from __future__ import annotations

from harness.compare.junit import read_results

from .junit_factory import item, run_pytest_suite, write_junit


def test_reads_properties_outcomes_and_error_vs_failure(tmp_path):
    path = run_pytest_suite(tmp_path / "run", [
        item("qwen3-8b", "smoke", metrics={"wall_time_s": 2.5}, tolerances={"max_abs_err": 0.01}),
        item("qwen3-8b", "precision", fail="too far", details={"first_divergent_module": "lm_head"}),
        item("qwen3-8b", "parallel", error="no such device"),
    ], tmp_path / "junit.xml")
    res = read_results([path])
    assert res.problems == []
    smoke = res.cases["suites.qwen3-8b.toml::smoke[cpu-float32]"]
    assert (smoke.suite, smoke.check, smoke.backend, smoke.dtype, smoke.outcome) == \
        ("qwen3-8b", "smoke", "cpu", "float32", "passed")
    assert smoke.metrics == {"wall_time_s": 2.5} and smoke.tolerances == {"max_abs_err": 0.01}
    prec = res.cases["suites.qwen3-8b.toml::precision[cpu-float32]"]
    assert prec.outcome == "failed" and prec.details["first_divergent_module"] == "lm_head"
    assert "too far" in prec.message + prec.log
    err = res.cases["suites.qwen3-8b.toml::parallel[cpu-float32]"]
    assert err.outcome == "error" and "no such device" in err.message + err.log


def test_shards_merge_and_mixed_attempts_are_flaky(tmp_path):
    (tmp_path / "a").mkdir()  # an attempt folder
    a = write_junit(tmp_path / "a" / "shard-0.xml", [item("s", "smoke", fail="flake"), item("s", "one")])
    b = write_junit(tmp_path / "b.xml", [item("s", "smoke"), item("s", "two")])
    c = write_junit(tmp_path / "c.xml", [item("s", "rerun")], reruns={"rerun[cpu-float32]": 2})
    res = read_results([str(tmp_path / "a"), b, str(tmp_path / "c*.xml")])
    assert res.files == [a, b, c]
    assert set(res.cases) == {f"suites.s.toml::{n}[cpu-float32]" for n in ("smoke", "one", "two", "rerun")}
    smoke = res.cases["suites.s.toml::smoke[cpu-float32]"]
    assert smoke.outcome == "passed" and smoke.flaky and smoke.attempts == 2 and "flake" in smoke.log
    rerun = res.cases["suites.s.toml::rerun[cpu-float32]"]
    assert rerun.flaky and rerun.attempts == 3
    assert not res.cases["suites.s.toml::one[cpu-float32]"].flaky


def test_truncated_file_keeps_complete_cases_and_says_so(tmp_path):
    full = write_junit(tmp_path / "full.xml", [item("s", f"c{i}") for i in range(10)])
    text = open(full).read()
    cut = tmp_path / "cut.xml"
    cut.write_text(text[: text.index('name="c7[')])  # runner killed mid-write
    ok = write_junit(tmp_path / "ok.xml", [item("s", "other")])
    res = read_results([str(cut), ok])
    assert len(res.cases) == 8  # c0..c6 salvaged, plus the good shard
    (problem,) = res.problems
    assert "cut.xml" in problem and "malformed or truncated" in problem and "kept the 7" in problem


def test_garbage_non_junit_and_missing_shards(tmp_path):
    (tmp_path / "garbage.xml").write_text("this is not xml at all <<<")
    (tmp_path / "other.xml").write_text("<coverage><package/></coverage>")
    good = write_junit(tmp_path / "good.xml", [item("s", "smoke")])
    res = read_results([str(tmp_path / "garbage.xml"), str(tmp_path / "other.xml"), good,
                        str(tmp_path / "shard-3.xml")], expect_shards=5)
    assert len(res.cases) == 1
    text = "\n".join(res.problems)
    assert "garbage.xml: malformed or truncated XML" in text and "kept the 0" in text
    assert "other.xml: well-formed XML but not JUnit" in text
    assert "shard-3.xml: shard missing" in text
    assert "expected 5 shard files but found 3" in text  # a named but missing file is no shard
    assert res.partial


def test_empty_input_is_a_message(tmp_path):
    res = read_results([str(tmp_path)])
    assert res.cases == {} and "no JUnit XML files found" in res.problems[0]


def test_case_without_harness_properties_still_reads(tmp_path):
    p = tmp_path / "plain.xml"
    p.write_text('<testsuite name="pytest"><testcase classname="suites.kimi-k2.toml" name="smoke[cpu-float32]">'
                 '<skipped message="no gpu"/></testcase></testsuite>')
    (case,) = read_results([str(p)]).cases.values()
    # old XML without the identity properties: read back from the test id
    assert (case.suite, case.check, case.outcome, case.backend, case.dtype) == \
        ("kimi-k2", "smoke", "skipped", "cpu", "float32")


def test_identity_comes_from_the_properties_and_a_hyphenated_backend_survives(tmp_path):
    p = tmp_path / "j.xml"
    props = "".join(f'<property name="harness.{k}" value="{v}"/>' for k, v in (
        ("suite", "my-model"), ("check", "smoke"), ("backend", "my-npu"), ("dtype", "bfloat16"),
        ("variant", "tp2"), ("device", "my-npu:0")))
    # a suite outside the repository: its node id says nothing the comparator could parse
    p.write_text('<testsuite name="pytest">'
                 f'<testcase classname="elsewhere.x" name="whatever[1]"><properties>{props}</properties>'
                 '<skipped message="no device"/></testcase>'
                 '<testcase classname="suites.old.toml" name="smoke[my-npu-bfloat16]"/></testsuite>')
    new, old = read_results([str(p)]).cases.values()
    assert (new.suite, new.check, new.backend, new.dtype, new.variant, new.device) == \
        ("my-model", "smoke", "my-npu", "bfloat16", "tp2", "my-npu:0")
    # old XML without the properties: the dtype is the part after the last hyphen
    assert (old.suite, old.check, old.backend, old.dtype) == ("old", "smoke", "my-npu", "bfloat16")
