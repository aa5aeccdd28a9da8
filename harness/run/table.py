"""The summary table of a run (``harness run``'s console and ``results/summary.txt``): one row per
suite x check x backend x dtype, built from the rows the results writer keeps."""

from __future__ import annotations

import io
import math
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from harness.run.rows import Row, counts


def _key(r: Row) -> tuple[str, str, str, str, str]:
    """(suite, check, backend, dtype, variant) from the identity properties every item writes at
    setup (harness.run.plugin). Only a collection error has none: it is its file's ``load`` row."""
    meta = r.parsed["meta"]
    if "suite" in meta:
        return (meta["suite"], meta.get("check", ""), meta.get("backend", ""), meta.get("dtype", ""),
                meta.get("variant", ""))
    return (r.nodeid.split("::")[0].rsplit("/", 1)[-1].removesuffix(".toml"), "load", "", "", "")


SEVERITY = {"error": 3, "failed": 2, "quarantined": 1.7, "xfailed": 1.5, "passed": 1, "skipped": 0}
STYLE = {"passed": "green", "failed": "red", "error": "red", "skipped": "yellow", "xfailed": "yellow",
         "quarantined": "yellow"}


def summary_table(rows: list[Row]) -> Table:
    """One row per suite x check x backend x dtype; items with variants (one per operator for
    `ops`) are folded into their row with counts, the worst outcome and the first failure."""
    t = Table(title="harness results", show_lines=False)
    for col in ("suite", "check", "backend", "dtype", "outcome", "key metrics", "time", "peak mem", "detail"):
        t.add_column(col, overflow="fold", max_width=60 if col == "detail" else None)
    groups: dict[tuple, list[Row]] = {}
    for r in rows:
        groups.setdefault(_key(r)[:4], []).append(r)
    for (suite, check, backend, dtype), rs in sorted(groups.items()):
        worst = max(rs, key=lambda r: SEVERITY.get(r.outcome, 0))
        m = worst.parsed["metrics"]
        if len(rs) == 1:
            key_metrics, time_s = headline(check, m), m.get("wall_time_s")
        else:
            c = counts(rs)
            key_metrics = f"{len(rs)} items: " + ", ".join(f"{n} {k}" for k, n in c.items() if n)
            time_s = sum(r.parsed["metrics"].get("wall_time_s", 0.0) for r in rs)
        # Every cell is Text, never markup: names and messages come from suites, models, ranks and
        # exceptions ("[/__w/pytorch/...]" in a gloo error is a closing tag to rich's parser).
        cells = [suite, check, backend, dtype, worst.outcome, key_metrics, _fmt(time_s, "s"),
                 _fmt(m.get("peak_memory_bytes"), "B"), worst.message]
        t.add_row(*(Text(str(c), style=STYLE.get(worst.outcome, "") if i == 4 else "")
                    for i, c in enumerate(cells)))
    return t


def headline(check_name: str, m: dict[str, float]) -> str:
    """The few metrics a check names in its ``headline`` attribute, for the summary table."""
    from harness import checks

    try:
        names = checks.registry().get(check_name).headline
    except KeyError:
        return ""
    return " ".join(f"{n}={m[n]:.4g}" for n in names if n in m)


def _fmt(v: float | None, unit: str) -> str:
    if v is None or not math.isfinite(v):
        return ""
    if unit == "B":
        return f"{v / 2**20:.0f} MiB"
    return f"{v:.2f} s"


TOP_WARNINGS = 5


def warnings_block(rows: list[Row], junit: Path | str) -> list[str]:
    """The end of a run's console, once: how many library warnings its items raised and the most
    frequent kinds (category + the first 100 characters), instead of each printed between the
    progress lines. Empty when there were none."""
    kinds: dict[tuple[str, str], int] = {}
    items = 0
    for r in rows:
        items += bool(r.warnings)
        for w in r.warnings:
            key = (str(w.get("category", "")), str(w.get("message", ""))[:100])
            kinds[key] = kinds.get(key, 0) + int(w.get("count", 1))
    if not kinds:
        return []
    total = sum(kinds.values())
    out = [f"{total} library warning{'s' * (total != 1)} in {items} item{'s' * (items != 1)} ({len(kinds)} "
           f"kind{'s' * (len(kinds) != 1)}), recorded with each item in {junit}:"]
    ranked = sorted(kinds.items(), key=lambda kv: (-kv[1], kv[0]))
    width = len(str(ranked[0][1]))
    out += [f"  {n:>{width}} x {cat}: {msg}" for (cat, msg), n in ranked[:TOP_WARNINGS]]
    if len(ranked) > TOP_WARNINGS:
        out.append(f"  ... and {len(ranked) - TOP_WARNINGS} more")
    return out


def render_table(rows: list[Row]) -> str:
    text = Console(record=True, width=160, file=io.StringIO())
    text.print(summary_table(rows))
    return text.export_text()
