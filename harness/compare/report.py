"""Reports people look at: the job summary markdown and a static HTML page with plots.

* :func:`summary_markdown` -- counts, confirmed regressions, suspects, improvements, flakes, input
  problems and the issue actions; written to ``$GITHUB_STEP_SUMMARY`` when that is set.
* :func:`html_report` -- one self-contained HTML file (plots embedded as PNG): the same tables, the
  error per layer of every failing precision item, and the history of every metric that regressed
  or improved, with its change point marked.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import os
from collections import Counter

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
            "" if f.current is None else f"{f.current:.4g}", change, state or f.note]


_HEAD = ["category", "suite", "backend", "test", "metric", "baseline", "current", "change", "note"]


def _sorted(findings: list[Finding]) -> list[Finding]:
    rank = {c: i for i, c in enumerate(_ORDER)}
    return sorted(findings, key=lambda f: (rank.get(f.category, 99), not f.confirmed, f.suite, f.key))


def summary_markdown(outcome) -> str:
    cls, cur = outcome.classification, outcome.current
    counts = Counter(f.category for f in cls.findings)
    outcomes = Counter(c.outcome for c in cur.cases.values())
    lines = ["## harness compare", "",
             f"{len(cur.cases)} test cases from {len(cur.files)} files: "
             + ", ".join(f"{n} {o}" for o, n in sorted(outcomes.items())), ""]
    if outcome.problems:
        lines += ["### Input problems (this report is partial)", ""]
        lines += [f"- {md_text(p)}" for p in outcome.problems] + [""]
    if getattr(outcome, "warnings", None):
        lines += ["### Input warnings (read whole; these values were left out)", ""]
        lines += [f"- {md_text(w)}" for w in outcome.warnings] + [""]
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
    from harness.compare.triage import markdown as triage_markdown

    lines += triage_markdown(getattr(outcome, "triage", []))
    changes = [c for c in getattr(outcome, "quarantine", []) if c.op != "clean"]
    clean = [c for c in getattr(outcome, "quarantine", []) if c.op == "clean"]
    if changes or clean:
        lines += ["### Quarantine", ""]
        lines += [f"- {md_text(c.key)}: {md_text(c.text)}" for c in changes]
        if clean:
            lines += [f"- {len(clean)} quarantined item(s) ran clean: "
                      + ", ".join(md_text(f"{c.key} ({c.text})") for c in clean[:10])]
        lines.append("")
    if outcome.actions or outcome.log:
        lines += ["### Issue actions", ""]
        lines += [f"- {e['op']} {('#' + str(e['number'])) if e.get('number') else ''} "
                  f"{md_text(e['title'])}: {e['status']}" for e in outcome.log]
        if outcome.api_calls:
            lines += ["", f"{outcome.api_calls} GitHub API calls."]
    return "\n".join(lines) + "\n"


def write_step_summary(text: str) -> str | None:
    path = os.environ.get("GITHUB_STEP_SUMMARY")
    if not path:
        return None
    with open(path, "a", encoding="utf-8") as f:
        f.write(text)
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


def _layer_plot(f: Finding) -> str | None:
    try:
        layers = json.loads(f.case.details.get("layer_table", "[]"))
    except ValueError:
        return None
    if not layers:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    x, y, zeros, tols = layer_series(layers)
    fig, ax = plt.subplots(figsize=(8, 3))
    ax.set_yscale("log")
    if x:
        ax.plot(x, y, "o-", label="rel RMSE")
    if tols is not None:
        ax.plot(range(len(layers)), tols, "--", label="tolerance (rel RMSE)")
    if zeros:  # exact matches: a marker on the axis, not a made-up value
        ax.plot(zeros, [0] * len(zeros), "v", color="green", label="exact (0)",
                transform=ax.get_xaxis_transform(), clip_on=False)
    ax.set_xticks(list(range(len(layers))), [str(r.get("module", ""))[-24:] for r in layers],
                  rotation=60, fontsize=7, **_PLAIN)
    ax.set_title(f"rel RMSE per layer vs its tolerance: {scrub_secrets(f.case.name)}", fontsize=9, **_PLAIN)
    ax.legend(fontsize=7)
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


def html_report(outcome, series=None, title: str = "harness report") -> str:
    """``series``: the history's :class:`~harness.compare.history.SeriesView` (or a plain mapping)."""
    cls = outcome.classification
    esc = _esc
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{esc(title)}</title><style>"
             "body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;font-size:13px}"
             "td,th{border:1px solid #ccc;padding:3px 6px}th{background:#eee}.bad{color:#b00}"
             "</style></head><body>", f"<h1>{esc(title)}</h1>"]
    cur = outcome.current
    parts.append(f"<p>{len(cur.cases)} test cases from {len(cur.files)} files.</p>")
    if outcome.problems:
        parts.append("<h2>Input problems (this report is partial)</h2><ul>"
                     + "".join(f"<li>{esc(scrub(p))}</li>" for p in outcome.problems) + "</ul>")
    if getattr(outcome, "warnings", None):
        parts.append("<h2>Input warnings (read whole; these values were left out)</h2><ul>"
                     + "".join(f"<li>{esc(scrub(w))}</li>" for w in outcome.warnings) + "</ul>")
    counts = Counter(f.category for f in cls.findings)
    parts.append("<table><tr><th>category</th><th>count</th></tr>" + "".join(
        f"<tr><td>{esc(c.replace('_', ' '))}</td><td>{counts[c]}</td></tr>" for c in _ORDER if counts.get(c))
        + "</table>")
    rows = _sorted([f for f in cls.findings if f.category not in ("new_test",)])
    parts.append("<h2>Findings</h2><table><tr>" + "".join(f"<th>{esc(h)}</th>" for h in _HEAD) + "</tr>")
    for f in rows[:2000]:
        klass = " class='bad'" if f.regression and f.confirmed else ""
        parts.append(f"<tr{klass}>" + "".join(f"<td>{esc(x)}</td>" for x in _row(f)) + "</tr>")
    parts.append("</table>")
    parts.append("<h2>Precision: error per layer</h2>")
    for f in [f for f in cls.findings if f.case is not None and "layer_table" in f.case.details
              and f.category in ("new_failure", "still_failing", "precision_drift")][:20]:
        img = _layer_plot(f)
        module = f.case.details.get("first_divergent_module", "?")
        parts.append(f"<h3>{esc(f.case.name)} ({esc(f.case.dtype)}): first divergent module "
                     f"<code>{esc(module)}</code></h3>")
        if img:
            parts.append(f"<img alt='rel RMSE per layer vs its tolerance' src='data:image/png;base64,{img}'>")
    parts.append("<h2>Performance history</h2>")
    for f in [f for f in cls.findings if f.metric and f.category in ("metric_regression", "improvement")][:20]:
        s = (series or {}).get((f.key, f.metric), []) + ([f.current] if f.current is not None else [])
        if f.perf is not None and f.perf.clock == "cpu" and f.case is not None:
            # the perf check decided on the CPU clock: plot that series (its figures are on it),
            # not the wall-clock one beside it
            m = cpu_key(f.metric)
            s = (series or {}).get((f.key, m), []) + ([f.case.metrics[m]] if m in f.case.metrics else [])
        img = _history_plot(f, s)
        if img:
            parts.append(f"<h3>{esc(f.metric)} of {esc(f.key)}</h3><img src='data:image/png;base64,{img}'>")
    parts += _suite_time_plots(outcome, series)
    parts.append("</body></html>")
    return "\n".join(parts)


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
