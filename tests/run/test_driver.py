"""The run summary: one row per suite x check x backend x dtype, variants folded in."""

from __future__ import annotations

import io

from rich.console import Console

from harness.run.rows import Row, counts
from harness.run.table import _key, summary_table


def render(rows):
    c = Console(record=True, width=250, file=io.StringIO())
    c.print(summary_table(rows))
    return c.export_text()


def props(suite, check, backend, dtype, variant=None, **metrics):
    p = {"harness.suite": suite, "harness.check": check, "harness.backend": backend, "harness.dtype": dtype}
    if variant:
        p["harness.variant"] = variant
    p.update({f"metric.{k}": repr(v) for k, v in metrics.items()})
    return p


def test_key_from_properties_even_for_a_skipped_item_and_a_hyphenated_backend():
    # Identity is written at setup, before any skip: nothing parses the test id back, so a backend
    # named with hyphens cannot be split wrongly.
    skipped = Row("suites/kimi-k2.toml::ops[my-npu-bfloat16-aten.mm.default]", "skipped",
                  props("kimi-k2", "ops", "my-npu", "bfloat16", "aten.mm.default"), message="no npu")
    assert _key(skipped) == ("kimi-k2", "ops", "my-npu", "bfloat16", "aten.mm.default")
    load = Row("suites/broken.toml::load", "error", message="suites/broken.toml: x: y")
    assert _key(load)[:2] == ("broken", "load")
    ran = Row("suites/x.toml::smoke[cpu-float32]", "passed", props("kimi-k2", "smoke", "cpu", "float32"))
    assert _key(ran) == ("kimi-k2", "smoke", "cpu", "float32", "")


def test_variants_fold_into_one_row_with_the_worst_outcome_and_first_failure():
    rows = [Row(f"suites/q.toml::ops[cpu-float32-aten.op{i}.default]", "passed",
                props("q", "ops", "cpu", "float32", f"aten.op{i}.default", wall_time_s=0.5)) for i in range(3)]
    rows.append(Row("suites/q.toml::ops[cpu-float32-aten.bad.default]", "failed",
                    props("q", "ops", "cpu", "float32", "aten.bad.default", wall_time_s=0.5),
                    message="aten.bad.default is missing on cpu"))
    rows.append(Row("suites/q.toml::smoke[cpu-float32]", "passed",
                    props("q", "smoke", "cpu", "float32", loss_initial=6.2, loss_final=4.1, wall_time_s=1.0)))
    text = render(rows)
    ops_lines = [line for line in text.splitlines() if " ops " in line]
    assert len(ops_lines) == 1, text
    assert "failed" in ops_lines[0] and "4 items: 3 passed, 1 failed" in ops_lines[0]
    assert "aten.bad.default is missing" in ops_lines[0] and "2.00 s" in ops_lines[0]
    assert "loss_initial=6.2 loss_final=4.1" in text
    assert counts(rows) == {"passed": 4, "failed": 1, "error": 0, "skipped": 0}
