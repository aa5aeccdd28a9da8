"""`harness validate --schema`: every suite key, arrays of tables down to their entries' keys."""

from __future__ import annotations

from harness.cli.validate import schema_markdown


def test_schema_lists_the_keys_of_array_of_table_entries():
    rows = schema_markdown().splitlines()
    keys = {r.split("|")[1].strip().strip("`") for r in rows[2:] if r.startswith("| `")}
    # [[checks.parallel.configs]] and [[checks.precision.overrides]] entries: their own keys, typed
    assert {"[[checks.parallel.configs]]", "checks.parallel.configs[].zero", "checks.parallel.configs[].tp",
            "[[checks.precision.overrides]]", "checks.precision.overrides[].backend"} <= keys
    zero = next(r for r in rows if "`checks.parallel.configs[].zero`" in r)
    assert "ZeroRedundancyOptimizer" in zero and "| `0` |" in zero
