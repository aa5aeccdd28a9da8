"""Reports people look at: the job summary markdown and a static HTML page with plots.

* :func:`summary_markdown` -- the run at a glance (the suite x check x backend x dtype matrix, every
  failure with its message and the module it names), then counts, confirmed regressions, suspects,
  improvements, flakes, input problems and the issue actions; written to ``$GITHUB_STEP_SUMMARY``
  when that is set.
* :func:`html_report` -- one self-contained HTML file (plots embedded as PNG, no network): the
  matrix; each failure and error with its message, the module it names, its plots, its details, log
  and captured library warnings (collapsed); the per-module / per-step budget use of the precision,
  training and decode items (error per layer against its budget, the training trajectory inside its
  envelope, the decode step by step); the findings against the baseline and history; perf items
  against their baseline and history, with change points.

What the plots read (``harness.detail.*`` properties the checks record): ``layer_table`` (precision,
on failure: each module's rel RMSE and budget), ``module_budget_use`` (precision and training,
always: ``[[module, error / budget], ...]``), ``trajectory`` (training: ``{quantity: [[deviation,
envelope], ...per step]}``) and ``step_budget_use`` (decode: ``[["step N", use], ...]``).
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import os
import re
from collections import Counter
from dataclasses import dataclass

from harness.compare.classify import Finding
from harness.compare.perfverdict import cpu_key
from harness.compare.scrub import md_text, scrub, scrub_secrets

_MAX_ROWS = 50
_ORDER = ["new_failure", "still_failing", "infrastructure", "vanished", "precision_drift", "metric_regression",
          "improvement", "flaky", "quarantined", "fixed", "new_test", "dropped", "not_run", "perf_not_compared"]


def _esc(text) -> str:
    """Untrusted text (names, messages, modules) in HTML: credentials cut, then every tag character
    escaped, quotes included (attribute values too)."""
    return html.escape(scrub_secrets(str(text)), quote=True)


# Plot labels are text, never mathtext: a module or test named "a$x^2$" would render as math, and
# an unbalanced "$" raises in matplotlib's parser and loses the whole report.
_PLAIN = {"parse_math": False}


def _row(f: Finding) -> list[str]:
    name = f.case.name if f.case is not None else f.key
    change = "" if f.change is None or not math.isfinite(f.change) else f"{f.change:+.1%}"
    state = "" if f.confirmed else f"suspected ({f.bad_runs} bad run)"
    return [f.category.replace("_", " "), f.suite, f.backend, name, f.metric,
            "" if f.baseline is None else f"{f.baseline:.4g}",
            "" if f.current is None else f"{f.current:.4g}", change, state or f.note or _said(f)]


def _said(f: Finding) -> str:
    """A failure's own first line, where the finding has no note of its own."""
    if f.case is None or f.case.outcome not in ("failed", "error"):
        return ""
    return first_line(f.case.message)[:200]


_HEAD = ["category", "suite", "backend", "test", "metric", "baseline", "current", "change", "note"]


def _sorted(findings: list[Finding]) -> list[Finding]:
    rank = {c: i for i, c in enumerate(_ORDER)}
    return sorted(findings, key=lambda f: (rank.get(f.category, 99), not f.confirmed, f.suite, f.key))


# --- the run at a glance: the matrix and the failures (both reports) --------------------------

# worst first; a flaky pass ranks above a clean one
_SEVERITY = {"error": 4, "failed": 3, "flaky": 2, "passed": 1, "skipped": 0}
# details that name where an item went wrong, in the order a reader wants them
_WHERE = [("first_divergent_module", "first divergent module"),
          ("first_divergent_backward_module", "first divergent module (backward)"),
          ("first_divergent_layer", "first divergent layer"), ("first_divergent_step", "first divergent step"),
          ("first_nonfinite_module", "first non-finite module"), ("first_diverging_module", "first diverging module"),
          ("first_diverging_ranks", "on ranks"), ("image_path_break", "image path breaks at"),
          ("worst_gradient", "worst gradient"), ("worst_weight", "worst weight"),
          ("last_module", "last module entered"), ("phase", "phase")]
# details the plots draw or that are long JSON: not repeated as text
_BULKY = {"layer_table", "layer_amplification", "propagated_table", "module_budget_use", "trajectory",
          "step_budget_use", "confirm_attempts", "comm_table", "comm_verdict", "timing", "layout"}
_WARNING_LINE = re.compile(r"^\s*(\d+) x ([A-Za-z_][\w.]*): (.*)$")
_MAX_DETAIL = 100  # failures shown whole; the rest are in the matrix and the findings


@dataclass
class MatrixRow:
    """One suite x check x backend x dtype: its items (variants folded), worst outcome first."""

    suite: str
    check: str
    backend: str
    dtype: str
    cases: list

    @property
    def worst(self):
        return self.cases[0]

    @property
    def outcome(self) -> str:
        return _state(self.worst)

    def time_s(self) -> float:
        return sum(_time(c) for c in self.cases)

    def key_metrics(self, headlines: dict | None) -> str:
        head = headline(self.worst, headlines)
        if len(self.cases) == 1:
            return head
        n = Counter(_state(c) for c in self.cases)
        text = f"{len(self.cases)} items: " + ", ".join(f"{n[k]} {k}" for k in _SEVERITY if n.get(k))
        return text + (f"; worst: {head}" if head else "")

    def message(self) -> str:
        c = self.worst
        return first_line(c.message) if c.outcome in ("failed", "error") else ""


def _state(c) -> str:
    return "flaky" if c.outcome == "passed" and c.flaky else c.outcome


def _time(c) -> float:
    v = c.metrics.get("wall_time_s")
    return v if v is not None and math.isfinite(v) else c.time


def matrix(cases) -> list[MatrixRow]:
    """One row per suite x check x backend x dtype, as ``harness run``'s table folds them."""
    groups: dict[tuple, list] = {}
    for c in cases:
        groups.setdefault((c.suite, c.check, c.backend, c.dtype), []).append(c)
    return [MatrixRow(*k, sorted(cs, key=lambda c: (-_SEVERITY.get(_state(c), 0), c.key)))
            for k, cs in sorted(groups.items())]


def headline(case, headlines: dict | None) -> str:
    """The metrics the item's check names in its ``headline`` (``headlines``: check -> names, from
    the check registry, which this layer cannot import); without it, its budget-use metrics."""
    names = (headlines or {}).get(case.check)
    if names is None:
        names = [n for n in sorted(case.metrics) if n.endswith(("_budget_use", "_envelope_use"))][:2]
    return " ".join(f"{n}={case.metrics[n]:.4g}" for n in names if n in case.metrics)


def first_line(text: str) -> str:
    return next((ln.strip() for ln in str(text).splitlines() if ln.strip()), "")


def where(case) -> list[tuple[str, str]]:
    """(label, value) of every detail that names where the item went wrong."""
    return [(label, case.details[k]) for k, label in _WHERE if case.details.get(k)]


def warning_lines(case) -> list[str]:
    """The library warnings captured in the item's <system-err>
    (``<count> x <Category>: <message> [<source>]``)."""
    return [ln.strip() for ln in case.stderr.splitlines() if _WARNING_LINE.match(ln)]


def _bad(cases) -> list:
    return sorted((c for c in cases if c.outcome in ("failed", "error")),
                  key=lambda c: (-_SEVERITY[c.outcome], c.suite, c.key))


def _md_matrix(cur, headlines) -> list[str]:
    rows = matrix(cur.cases.values())
    lines = ["| suite | check | backend | dtype | outcome | key metrics | time | detail |", "|---|---|---|---|---|---|---|---|"]
    for r in rows[:_MAX_ROWS]:
        lines.append("| " + " | ".join(md_text(x) for x in (
            r.suite, r.check, r.backend, r.dtype, r.outcome.upper() if r.outcome in ("failed", "error") else r.outcome,
            r.key_metrics(headlines), f"{r.time_s():.2f} s", r.message()[:200])) + " |")
    if len(rows) > _MAX_ROWS:
        lines.append(f"\n_{len(rows) - _MAX_ROWS} more rows in the HTML report (`harness report`)._")
    lines.append("")
    bad = _bad(cur.cases.values())
    if bad:
        lines += [f"### Failures and errors ({len(bad)})", ""]
        for c in bad[:_MAX_ROWS]:
            loc = "; ".join(f"{label} <code>{md_text(v)}</code>" for label, v in where(c))
            lines.append(f"- **{md_text(c.key)}** ({c.outcome}): {md_text(first_line(c.message)[:300])}"
                         + (f" ({loc})" if loc else ""))
        if len(bad) > _MAX_ROWS:
            lines.append(f"- _{len(bad) - _MAX_ROWS} more_")
        lines.append("")
    return lines


def summary_markdown(outcome, headlines: dict | None = None) -> str:
    """``headlines``: check name -> the metric names of its ``headline`` (harness.cli passes them)."""
    cur = outcome.current
    outcomes = Counter(c.outcome for c in cur.cases.values())
    lines = ["## harness compare", "",
             f"{len(cur.cases)} test cases from {len(cur.files)} files: "
             + ", ".join(f"{n} {o}" for o, n in sorted(outcomes.items())), ""]
    if cur.cases:
        lines += _md_matrix(cur, headlines)
    lines += ["### Against the baseline and history", ""]
    lines += _md_input_notes(outcome)
    lines += _md_findings(outcome)
    from harness.compare.triage import markdown as triage_markdown

    lines += triage_markdown(getattr(outcome, "triage", []))
    lines += _md_quarantine(outcome)
    lines += _md_issue_actions(outcome)
    return "\n".join(lines) + "\n"


def _md_input_notes(outcome) -> list[str]:
    """The input problems (the report is partial) and warnings (values left out)."""
    lines: list[str] = []
    if outcome.problems:
        lines += ["### Input problems (this report is partial)", ""]
        lines += [f"- {md_text(p)}" for p in outcome.problems] + [""]
    if getattr(outcome, "warnings", None):
        lines += ["### Input warnings (read whole; these values were left out)", ""]
        lines += [f"- {md_text(w)}" for w in outcome.warnings] + [""]
    return lines


def _md_findings(outcome) -> list[str]:
    """Counts per category, the findings table, and the notes on improvements and muted findings."""
    cls = outcome.classification
    counts = Counter(f.category for f in cls.findings)
    lines: list[str] = []
    nonzero = [c for c in _ORDER if counts.get(c)]
    if nonzero:
        lines += ["| category | count |", "|---|---|"]
        lines += [f"| {c.replace('_', ' ')} | {counts[c]} |" for c in nonzero] + [""]
    else:
        lines += ["Nothing changed against the baseline and the history.", ""]
    shown = [f for f in _sorted(cls.findings) if f.category not in ("new_test", "not_run")]
    if shown:
        lines += ["| " + " | ".join(_HEAD) + " |", "|" + "---|" * len(_HEAD)]
        for f in shown[:_MAX_ROWS]:
            lines.append("| " + " | ".join(md_text(x) for x in _row(f)) + " |")
        if len(shown) > _MAX_ROWS:
            lines.append(f"\n_{len(shown) - _MAX_ROWS} more rows not shown._")
        lines.append("")
    improved = counts.get("improvement", 0)
    if improved:
        lines += [f"{improved} metric(s) improved past the threshold: update the golden / baseline "
                  "so later regressions are measured from the new level.", ""]
    if outcome.muted:
        lines += [f"{len(outcome.muted)} findings muted by the mute file.", ""]
    return lines


def _md_quarantine(outcome) -> list[str]:
    """Quarantine changes, and the quarantined items that ran clean (towards re-enabling them)."""
    changes = [c for c in getattr(outcome, "quarantine", []) if c.op != "clean"]
    clean = [c for c in getattr(outcome, "quarantine", []) if c.op == "clean"]
    if not (changes or clean):
        return []
    lines = ["### Quarantine", ""]
    lines += [f"- {md_text(c.key)}: {md_text(c.text)}" for c in changes]
    if clean:
        lines += [f"- {len(clean)} quarantined item(s) ran clean: "
                  + ", ".join(md_text(f"{c.key} ({c.text})") for c in clean[:10])]
    lines.append("")
    return lines


def _md_issue_actions(outcome) -> list[str]:
    """What was done on GitHub: each issue action with its status, and the API calls spent."""
    if not (outcome.actions or outcome.log):
        return []
    lines = ["### Issue actions", ""]
    lines += [f"- {e['op']} {('#' + str(e['number'])) if e.get('number') else ''} "
              f"{md_text(e['title'])}: {e['status']}" for e in outcome.log]
    if outcome.api_calls:
        lines += ["", f"{outcome.api_calls} GitHub API calls."]
    return lines


def write_step_summary(text: str, where: str = "") -> str | None:
    """Append ``text`` to the job summary, fitted into GitHub's 1 MiB (harness.compare.limits)."""
    from harness.compare.limits import STEP_SUMMARY_MAX, fit_text

    path = os.environ.get("GITHUB_STEP_SUMMARY")
    if not path:
        return None
    try:
        have = os.path.getsize(path)  # earlier steps' text in the same file counts against the limit
    except OSError:
        have = 0
    with open(path, "a", encoding="utf-8") as f:
        f.write(fit_text(text, max(4096, STEP_SUMMARY_MAX - have), where))
    return path


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode()


def layer_series(layers: list[dict]) -> tuple[list[int], list[float], list[int], list[float] | None]:
    """What the per-layer plot draws: the relative RMSE of each layer, the quantity its tolerance
    bounds (harness.precision.align: ``ok`` is ``rel_rmse <= tolerance``), split into layers with a
    positive error (drawn on the log axis) and layers with exactly zero error (marked apart: a
    log axis has no zero, and drawing them at 1e-30 invents a value). Returns
    ``(x, rel_rmse, x_of_zeros, tolerance or None)``."""
    x, y, zeros = [], [], []
    for i, r in enumerate(layers):
        v = _num(r.get("rel_rmse"))
        if v is None or math.isnan(v):
            continue
        (x.append(i), y.append(v)) if v > 0 else zeros.append(i)
    tols = [_num(r.get("tolerance")) for r in layers]
    return x, y, zeros, (tols if all(t is not None for t in tols) else None)


def _num(v) -> float | None:
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _details_json(case, key: str):
    """A JSON detail, or None where it is absent or not what the check writes (never raises)."""
    try:
        v = json.loads(case.details.get(key) or "null")
    except ValueError:
        return None
    return v


def _item_plots(case) -> list[tuple[str, str]]:
    """(alt text, base64 PNG) of every plot the item's details allow; a plot that cannot be drawn is
    left out, never the report."""
    out = []
    for alt, fn in (("rel RMSE per layer vs its tolerance", _layer_plot),
                    ("budget use per module", _module_use_plot),
                    ("training trajectory inside its envelope", _trajectory_plot),
                    ("decode budget use per step", _step_use_plot)):
        try:
            img = fn(case)
        except Exception:  # malformed detail values from a foreign run: the plot only
            img = None
        if img:
            out.append((alt, img))
    return out


def _layer_plot(case) -> str | None:
    layers = _details_json(case, "layer_table")
    if not isinstance(layers, list) or not layers or not all(isinstance(r, dict) for r in layers):
        return None
    plt = _plt()
    x, y, zeros, tols = layer_series(layers)
    fig, ax = plt.subplots(figsize=(8, 3))
    ax.set_yscale("log")
    bad = [i for i, r in enumerate(layers) if r.get("ok") is False]
    if x:
        ax.plot(x, y, "o-", label="rel RMSE")
    if bad:
        ax.plot(bad, [_num(layers[i].get("rel_rmse")) or 1 for i in bad], "o", color="red", label="over budget")
    if tols is not None:
        ax.plot(range(len(layers)), tols, "--", label="budget (rel RMSE)")
    if zeros:  # exact matches: a marker on the axis, not a made-up value
        ax.plot(zeros, [0] * len(zeros), "v", color="green", label="exact (0)",
                transform=ax.get_xaxis_transform(), clip_on=False)
    ax.set_xticks(list(range(len(layers))), [_label(str(r.get("module", ""))) for r in layers],
                  rotation=60, ha="right", fontsize=7, **_PLAIN)
    ax.set_title(f"rel RMSE per layer vs its tolerance: {scrub_secrets(case.name)}", fontsize=9, **_PLAIN)
    ax.legend(fontsize=7)
    data = _png(fig)
    plt.close(fig)
    return data


def _use_pairs(case, key: str) -> list[tuple[str, float]]:
    v = _details_json(case, key)
    if not isinstance(v, list):
        return []
    return [(str(p[0]), float(p[1])) for p in v if isinstance(p, list) and len(p) == 2 and _num(p[1]) is not None]


def _use_bars(pairs, title: str, xlabel: str = "") -> str | None:
    """Budget use (error / budget) as bars on a log axis, the budget (1) as a line, over-budget bars
    red; exact zeros as markers on the axis (a log axis has no zero)."""
    if not pairs:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(6, min(14, 0.3 * len(pairs))), 3))
    pos = [(i, u) for i, (_, u) in enumerate(pairs) if u > 0 and not math.isnan(u)]
    finite = [u for _, u in pos if math.isfinite(u)]
    top = max([*finite, 2.0]) * 2
    # a pass reads best on a linear axis from 0 (how close to the budget); a fault 2000x over needs a log one
    if len(finite) < len(pos) or max(finite, default=0) > 3:
        ax.set_yscale("log")
    else:
        ax.set_ylim(0, max(1.1, *finite, 0) * 1.05)
    if pos:
        ax.bar([i for i, _ in pos], [u if math.isfinite(u) else top for _, u in pos],
               color=["tab:red" if u > 1 else "tab:blue" for _, u in pos])
    zeros = [i for i, (_, u) in enumerate(pairs) if u == 0]
    if zeros:
        ax.plot(zeros, [0] * len(zeros), "v", color="green", label="exact (0)",
                transform=ax.get_xaxis_transform(), clip_on=False)
    ax.axhline(1.0, color="red", linestyle="--", label="budget (use = 1)")
    ax.set_xticks(list(range(len(pairs))), [_label(n) for n, _ in pairs],
                  rotation=60, ha="right", fontsize=7, **_PLAIN)
    ax.set_ylabel("error / budget", fontsize=8)
    if xlabel:
        ax.set_xlabel(xlabel, fontsize=8)
    ax.set_title(scrub_secrets(title), fontsize=9, **_PLAIN)
    ax.legend(fontsize=7)
    data = _png(fig)
    plt.close(fig)
    return data


def _label(name: str) -> str:
    name = name.removeprefix("model.")
    return name if len(name) <= 40 else "..." + name[-37:]


def _module_use_plot(case) -> str | None:
    if "layer_table" in case.details and case.check == "precision":
        return None  # the layer table's plot above draws the same error against the same budget
    what = "backward (worst of input, output and parameter gradients)" if case.check == "training" else "forward"
    return _use_bars(_use_pairs(case, "module_budget_use"), f"{what} budget use per module: {case.name}")


def _step_use_plot(case) -> str | None:
    return _use_bars(_use_pairs(case, "step_budget_use"), f"decode budget use per step: {case.name}", "decode step")


def _trajectory_plot(case) -> str | None:
    traj = _details_json(case, "trajectory")
    if not isinstance(traj, dict) or not traj:
        return None
    series = {k: v for k, v in traj.items() if isinstance(v, list) and v
              and all(isinstance(p, list) and len(p) == 2 and all(_num(x) is not None for x in p) for p in v)}
    if not series:
        return None
    plt = _plt()
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, len(series), figsize=(3.2 * len(series), 2.6), squeeze=False)
    for ax, (k, pts) in zip(axes[0], sorted(series.items()), strict=True):
        steps = list(range(len(pts)))
        dev = [float(p[0]) for p in pts]
        env = [float(p[1]) for p in pts]
        ax.fill_between(steps, 0, env, color="tab:green", alpha=0.2, label="envelope")
        ax.plot(steps, env, "--", color="tab:green")
        ax.plot(steps, dev, "o-", color="tab:blue", label="deviation")
        out = [i for i in steps if not dev[i] <= env[i]]
        if out:
            ax.plot(out, [dev[i] for i in out], "o", color="red", label="outside")
        ax.set_title(str(k), fontsize=8, **_PLAIN)
        ax.set_xlabel("optimizer step", fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.tick_params(labelsize=7)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(scrub_secrets(f"training trajectory: deviation from the golden inside its envelope: {case.name}"),
                 fontsize=9, y=1.04, **_PLAIN)
    data = _png(fig)
    plt.close(fig)
    return data


def _history_plot(f: Finding, series: list[float]) -> str | None:
    if len(series) < 2:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 2.5))
    ax.plot(range(len(series)), series, "o-")
    # bad_runs counts the runs at the new level (change point or streak vs the baseline)
    if 0 < f.bad_runs < len(series):
        ax.axvline(len(series) - f.bad_runs - 0.5, color="red", linestyle="--", label="change point")
        ax.legend(fontsize=7)
    if f.baseline is not None:
        ax.axhline(f.baseline, color="gray", linestyle=":", label="baseline / earlier level")
    ax.set_title(scrub_secrets(f"{f.metric}: {f.case.name if f.case else f.key}"), fontsize=9, **_PLAIN)
    ax.set_xlabel("run (oldest first)")
    data = _png(fig)
    plt.close(fig)
    return data


_CSS = ("body{font-family:system-ui,sans-serif;margin:1.5em 2em;color:#222;max-width:1400px}"
        "table{border-collapse:collapse;font-size:13px;margin:.5em 0}td,th{border:1px solid #ccc;padding:3px 6px;"
        "text-align:left;vertical-align:top}th{background:#eee}.bad{color:#b00}"
        ".o-failed,.o-error{background:#fdd;color:#900;font-weight:bold}.o-passed{background:#dfd;color:#060}"
        ".o-flaky{background:#ffd;color:#860}.o-skipped{background:#f4f4f4;color:#777}"
        ".banner{padding:.6em 1em;font-size:1.2em;border-radius:4px}.banner.o-passed{font-weight:bold}"
        ".item{border-left:4px solid #b00;padding:.2em 1em;margin:1em 0}.item.passed{border-color:#ccc}"
        ".msg{font-family:monospace;white-space:pre-wrap;background:#fff4f4;padding:.5em}"
        "pre{background:#f6f6f6;padding:.5em;overflow-x:auto;font-size:12px;max-height:30em}"
        "summary{cursor:pointer;color:#036}img{max-width:100%}.none{color:#777;font-style:italic}"
        "nav a{margin-right:1em}td.t{white-space:nowrap}img.plot{display:inline-block;margin:0 1em .5em 0;"
        "vertical-align:top}")


def html_report(outcome, series=None, title: str = "harness report", headlines: dict | None = None) -> str:
    """``series``: the history's :class:`~harness.compare.history.SeriesView` (or a plain mapping);
    ``headlines``: check name -> the metric names of its ``headline`` (harness.cli passes them)."""
    cls = outcome.classification
    esc = _esc
    cur = outcome.current
    cases = list(cur.cases.values())
    states = Counter(_state(c) for c in cases)
    bad = _bad(cases)
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{esc(title)}</title>"
             f"<style>{_CSS}</style></head><body>", f"<h1>{esc(title)}</h1>"]
    verdict = (f"{states.get('failed', 0)} failed, {states.get('error', 0)} errors" if bad
               else "all items passed" if cases else "no test case could be read")
    parts.append(f"<p class='banner o-{'failed' if bad or not cases else 'passed'}'>{esc(verdict)}</p>")
    parts.append(f"<p>{len(cases)} items from {len(cur.files)} file(s): "
                 + esc(", ".join(f"{states[k]} {k}" for k in _SEVERITY if states.get(k))) + ".</p>")
    parts.append("<nav><a href='#matrix'>matrix</a><a href='#failures'>failures</a><a href='#budgets'>budget use</a>"
                 "<a href='#findings'>baseline and history</a><a href='#perf'>performance</a>"
                 "<a href='#warnings'>library warnings</a></nav>")
    if outcome.problems:
        parts.append("<h2>Input problems (this report is partial)</h2><ul>"
                     + "".join(f"<li>{esc(scrub(p))}</li>" for p in outcome.problems) + "</ul>")
    if getattr(outcome, "warnings", None):
        parts.append("<h2>Input warnings (read whole; these values were left out)</h2><ul>"
                     + "".join(f"<li>{esc(scrub(w))}</li>" for w in outcome.warnings) + "</ul>")
    parts += _html_matrix(cases, headlines)
    plotted: set[str] = set()
    parts.append(f"<h2 id='failures'>Failures and errors ({len(bad)})</h2>")
    if not bad:
        parts.append("<p class='none'>No item failed.</p>")
    for c in bad[:_MAX_DETAIL]:
        parts += _item_detail(c, plotted)
    if len(bad) > _MAX_DETAIL:
        parts.append(f"<p>{len(bad) - _MAX_DETAIL} more failures: see the matrix and the findings.</p>")
    parts += _budget_section(cases, plotted)
    parts += _findings_section(cls)
    parts += _perf_section(outcome, cases, series, headlines)
    parts += _suite_time_plots(outcome, series)
    parts += _warnings_section(cases, {c.key for c in bad[:_MAX_DETAIL]})
    parts.append("</body></html>")
    return "\n".join(parts)


def _html_matrix(cases, headlines) -> list[str]:
    rows = matrix(cases)
    out = [f"<h2 id='matrix'>Matrix: suite x check x backend x dtype ({len(rows)} rows)</h2>"]
    if not rows:
        return out + ["<p class='none'>No items.</p>"]
    out.append("<table><tr>" + "".join(f"<th>{h}</th>" for h in (
        "suite", "check", "backend", "dtype", "outcome", "key metrics", "time", "warnings", "detail")) + "</tr>")
    for r in rows[:5000]:
        nwarn = sum(len(warning_lines(c)) for c in r.cases)
        out.append("<tr>" + "".join(f"<td>{_esc(x)}</td>" for x in (r.suite, r.check, r.backend, r.dtype))
                   + f"<td class='o-{_esc(r.outcome)}'>{_esc(r.outcome)}</td>"
                   + f"<td>{_esc(r.key_metrics(headlines))}</td><td class='t'>{r.time_s():.2f} s</td>"
                   + f"<td>{nwarn or ''}</td><td>{_esc(r.message()[:300])}</td></tr>")
    out.append("</table>")
    if len(rows) > 5000:
        out.append(f"<p>{len(rows) - 5000} more rows not shown.</p>")
    return out


def _item_detail(c, plotted: set[str]) -> list[str]:
    """One failing item whole: message, the module it names, its plots, then (collapsed) its other
    details, its log and its captured library warnings."""
    out = [f"<div class='item'><h3>{_esc(c.key)} <span class='o-{_esc(c.outcome)}'>{_esc(c.outcome)}</span></h3>",
           f"<div class='msg'>{_esc(c.message or first_line(c.log) or '(no message)')}</div>"]
    loc = where(c)
    if loc:
        out.append("<ul>" + "".join(f"<li>{_esc(label)}: <code>{_esc(v)}</code></li>" for label, v in loc) + "</ul>")
    for alt, img in _item_plots(c):
        out.append(f"<img class='plot' alt='{_esc(alt)}' src='data:image/png;base64,{img}'>")
        plotted.add(c.key)
    rest = {k: v for k, v in c.details.items() if k not in _BULKY and k not in dict(_WHERE)}
    if rest:
        out.append(f"<details><summary>details ({len(rest)})</summary><table>" + "".join(
            f"<tr><th>{_esc(k)}</th><td><pre>{_esc(v[:3000])}</pre></td></tr>" for k, v in sorted(rest.items()))
            + "</table></details>")
    if c.log:
        out.append(f"<details><summary>log</summary><pre>{_esc(c.log)}</pre></details>")
    out += _warnings_block(c)
    return out + ["</div>"]


def _warnings_block(c) -> list[str]:
    lines = warning_lines(c)
    if not lines:
        return []
    return [f"<details class='warnings'><summary>{len(lines)} library warning(s)</summary><pre>"
            + _esc("\n".join(lines)) + "</pre></details>"]


def _budget_section(cases, plotted: set[str]) -> list[str]:
    """The precision, training and decode items' budget use, plotted (failing items are above)."""
    items = [c for c in cases if c.key not in plotted and c.outcome != "skipped"
             and any(k in c.details for k in ("layer_table", "module_budget_use", "trajectory", "step_budget_use"))]
    out = ["<h2 id='budgets'>Budget use: precision, training and decode</h2>",
           "<p>Each module's (or step's) error divided by its budget: above 1 fails. "
           "Failing items are plotted with their failure above.</p>"]
    if not items and not plotted:
        return out + ["<p class='none'>No item in these results recorded per-module or per-step budget use "
                      "(precision, training and decode record it).</p>"]
    shown = 0
    for c in sorted(items, key=lambda c: (c.suite, c.check, c.key)):
        if shown >= 40:
            out.append(f"<p>{len(items) - shown} more items not plotted.</p>")
            break
        plots = _item_plots(c)
        if plots:
            shown += 1
            out.append(f"<h3>{_esc(c.key)} <span class='o-{_esc(_state(c))}'>{_esc(_state(c))}</span></h3>")
            out += [f"<img class='plot' alt='{_esc(alt)}' src='data:image/png;base64,{img}'>" for alt, img in plots]
    return out


def _findings_section(cls) -> list[str]:
    counts = Counter(f.category for f in cls.findings)
    out = ["<h2 id='findings'>Against the baseline and history</h2>"]
    rows = _sorted([f for f in cls.findings if f.category not in ("new_test",)])
    if not rows:
        return out + ["<p class='none'>Nothing changed against the baseline and the history.</p>"]
    out.append("<table><tr><th>category</th><th>count</th></tr>" + "".join(
        f"<tr><td>{_esc(c.replace('_', ' '))}</td><td>{counts[c]}</td></tr>" for c in _ORDER if counts.get(c))
        + "</table>")
    out.append("<table><tr>" + "".join(f"<th>{_esc(h)}</th>" for h in _HEAD) + "</tr>")
    for f in rows[:2000]:
        klass = " class='bad'" if f.regression and f.confirmed else ""
        out.append(f"<tr{klass}>" + "".join(f"<td>{_esc(x)}</td>" for x in _row(f)) + "</tr>")
    out.append("</table>")
    if len(rows) > 2000:
        out.append(f"<p>{len(rows) - 2000} more findings not shown.</p>")
    return out


def _perf_section(outcome, cases, series, headlines) -> list[str]:
    """Perf items' headline metrics against the baseline, and the history of each (with the
    change point) plus every other metric that regressed or improved."""
    cls = outcome.classification
    out = ["<h2 id='perf'>Performance history: perf items against their baseline and history</h2>"]
    perf = sorted((c for c in cases if c.check == "perf" and c.outcome != "skipped"), key=lambda c: c.key)
    base = outcome.baseline.cases if getattr(outcome, "baseline", None) is not None else {}
    if perf:
        out.append("<table><tr><th>item</th><th>outcome</th><th>metric</th><th>current</th><th>baseline</th>"
                   "<th>change</th></tr>")
        for c in perf[:200]:
            names = (headlines or {}).get("perf") or [n for n in sorted(c.metrics) if n.endswith(("_s", "_mfu"))][:3]
            b = base.get(c.key)
            for n in [n for n in names if n in c.metrics]:
                bv = b.metrics.get(n) if b is not None else None
                ch = (f"{c.metrics[n] / bv - 1:+.1%}" if bv not in (None, 0) and math.isfinite(c.metrics[n] / bv)
                      else "")
                out.append(f"<tr><td>{_esc(c.key)}</td><td class='o-{_esc(_state(c))}'>{_esc(_state(c))}</td>"
                           f"<td>{_esc(n)}</td><td>{c.metrics[n]:.4g}</td>"
                           f"<td>{'' if bv is None else f'{bv:.4g}'}</td><td>{_esc(ch)}</td></tr>")
        out.append("</table>")
    moved = [f for f in cls.findings if f.metric and f.category in ("metric_regression", "improvement")]
    drawn = set()
    for f in moved[:20]:
        s = (series or {}).get((f.key, f.metric), []) + ([f.current] if f.current is not None else [])
        if f.perf is not None and f.perf.clock == "cpu" and f.case is not None:
            # the perf check decided on the CPU clock: plot that series (its figures are on it),
            # not the wall-clock one beside it
            m = cpu_key(f.metric)
            s = (series or {}).get((f.key, m), []) + ([f.case.metrics[m]] if m in f.case.metrics else [])
        img = _history_plot(f, s)
        if img:
            drawn.add((f.key, f.metric))
            out.append(f"<h3>{_esc(f.metric)} of {_esc(f.key)}</h3><img src='data:image/png;base64,{img}'>")
    for c in perf[:20]:
        for n in (headlines or {}).get("perf", ())[:2]:
            if (c.key, n) in drawn or n not in c.metrics:
                continue
            f = Finding("history", "perf", c.key, c.suite, c.backend, case=c, metric=n, current=c.metrics[n],
                        bad_runs=0)
            img = _history_plot(f, list((series or {}).get((c.key, n), [])) + [c.metrics[n]])
            if img:
                out.append(f"<h3>{_esc(n)} of {_esc(c.key)}</h3><img src='data:image/png;base64,{img}'>")
    if not perf and not moved:
        out.append("<p class='none'>No perf items in these results (`harness run --scope nightly --check perf`) "
                   "and no metric moved past its threshold against the baseline or history.</p>")
    return out


def _warnings_section(cases, shown: set[str]) -> list[str]:
    """Library warnings of the items not shown whole above, each item's collapsed."""
    items = [c for c in cases if c.key not in shown and warning_lines(c)]
    out = ["<h2 id='warnings'>Library warnings</h2>"]
    if not items:
        return out + ["<p class='none'>No other item captured library warnings.</p>"]
    for c in sorted(items, key=lambda c: c.key)[:500]:
        lines = warning_lines(c)
        out.append(f"<details><summary>{_esc(c.key)}: {len(lines)} warning(s)</summary><pre>"
                   + _esc("\n".join(lines)) + "</pre></details>")
    return out


def _suite_time_plots(outcome, series) -> list[str]:
    """Total ``wall_time_s`` of each suite x backend over the runs, with its change point."""
    if series is None or not hasattr(series, "run_totals"):
        return []
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from harness.compare.changepoint import detect
    groups: dict[tuple[str, str], list] = {}
    for c in outcome.current.cases.values():
        if "wall_time_s" in c.metrics:
            groups.setdefault((c.suite, c.backend), []).append(c)
    out = ["<h2>Wall time per suite</h2>"] if groups else []
    for (suite, backend), cases in sorted(groups.items())[:30]:
        values = series.run_totals([c.key for c in cases], "wall_time_s")
        values.append(sum(c.metrics["wall_time_s"] for c in cases))
        fig, ax = plt.subplots(figsize=(6, 2.5))
        ax.plot(range(len(values)), values, "o-")
        cp = detect(values, "lower", 0.10)
        if cp is not None:
            ax.axvline(cp.index - 0.5, color="red", linestyle="--",
                       label=f"change point ({cp.rel_change:+.0%})")
            ax.legend(fontsize=7)
        ax.set_title(f"{suite} on {backend}: total wall time (s)", fontsize=9, **_PLAIN)
        ax.set_xlabel("run (oldest first, this run last)")
        note = (f"change point {cp.runs_after} runs ago: {cp.before:.4g} s -> {cp.after:.4g} s "
                f"({cp.rel_change:+.0%})" if cp else "no change point")
        out.append(f"<h3>{_esc(suite)} on {_esc(backend)}: {note}</h3>"
                   f"<img src='data:image/png;base64,{_png(fig)}'>")
        plt.close(fig)
    return out
