"""The markdown body of one issue: what regressed, where, since when, and how to reproduce it.

GitHub refuses bodies over 65,536 characters (422); the body is built section by section against a
budget and says visibly what it left out. The budget is counted in UTF-8 bytes, which are never
fewer than characters, and :func:`full` checks the final body (marker included) once more, so no
mix of names can push it over. Every piece of text that came from a test run goes through
:func:`harness.compare.scrub.scrub` (mentions, secrets) before anything cuts it, and names are
shown with :func:`~harness.compare.scrub.md_code` (no Markdown or HTML injection).
"""

from __future__ import annotations

import json
import math
import os
import platform
from dataclasses import dataclass

from harness.compare.issues import MARKER_MAX, Group, marker
from harness.compare.scrub import code_fence, md_code, md_text, scrub

MAX_BODY = 65_536
_BUDGET = MAX_BODY - MARKER_MAX - 2_000  # bytes; room for the marker, the truncation note and the footer
_MAX_ROWS = 200
_LOG_CHARS = 3_000


@dataclass
class RunContext:
    commit: str = ""
    baseline_commit: str = ""
    run_url: str = ""
    machine: str = ""

    @classmethod
    def from_env(cls, commit: str = "", baseline_commit: str = "", run_url: str = "") -> RunContext:
        env = os.environ
        if not run_url and env.get("GITHUB_RUN_ID") and env.get("GITHUB_REPOSITORY"):
            run_url = (f"{env.get('GITHUB_SERVER_URL', 'https://github.com')}/"
                       f"{env['GITHUB_REPOSITORY']}/actions/runs/{env['GITHUB_RUN_ID']}")
            if env.get("GITHUB_RUN_ATTEMPT"):
                run_url += f"/attempts/{env['GITHUB_RUN_ATTEMPT']}"
        return cls(commit or env.get("GITHUB_SHA", ""), baseline_commit, run_url, machine_fingerprint())

    def run_line(self) -> str:
        parts = [self.run_url or "this run"]
        if self.commit:
            parts.append(f"commit {self.commit[:12]}")
        return ", ".join(parts)


def machine_fingerprint() -> str:
    runner = os.environ.get("RUNNER_NAME", "")
    bits = [platform.system(), platform.machine(), platform.python_version(), f"{os.cpu_count()} cpus"]
    return " / ".join(b for b in [runner, *bits] if b)


def _fmt(v: float | None) -> str:
    if v is None:
        return ""
    if math.isinf(v) or math.isnan(v):
        return str(v)
    return f"{v:.4g}"


def _cell(text: str) -> str:
    return md_text(text)


def _size(text: str) -> int:
    return len(text.encode("utf-8"))


def _rows(group: Group) -> list[str]:
    rows = []
    for f in sorted(group.findings, key=lambda f: (f.key, f.metric)):
        name = f.case.name if f.case is not None else f.key
        if f.metric:
            change = "" if f.change is None else (f"{f.change:+.1%}" if math.isfinite(f.change) else "new")
            rows.append(f"| {md_code(name)} | {_cell(f.metric)} | {_fmt(f.baseline)} | "
                        f"{_fmt(f.current)} | {change} | {_cell(f.threshold)} |")
        else:
            before = {"still_failing": "failed"}.get(f.category, "passed")
            current = {"vanished": "missing"}.get(f.category, f.case.outcome if f.case else "")
            label = f.category.replace("_", " ")
            # the last column: its reruns ("deterministic: failed 3 of 3 attempts", harness.run.confirm)
            rows.append(f"| {md_code(name)} | outcome | {before} | {_cell(current)} | {label} | {_cell(f.note)} |")
    return rows


def _precision(group: Group) -> list[str]:
    out = []
    for f in group.findings:
        d = f.case.details if f.case is not None else {}
        if "first_divergent_module" not in d:
            continue
        dtype = f.case.dtype if f.case else ""
        out.append(f"**{md_code(f.case.name)}** ({_cell(dtype)}): first divergent module "
                   f"{md_code(d['first_divergent_module'])}")
        try:
            layers = json.loads(d.get("layer_table", "[]"))
        except ValueError:
            layers = []
        if layers:
            out.append("\n<details><summary>per-layer error</summary>\n\n"
                       "| module | max abs err | rel RMSE | cosine | tolerance (rel RMSE) | ok |\n"
                       "|---|---|---|---|---|---|")
            for row in layers[:_MAX_ROWS]:
                out.append("| {} | {} | {} | {} | {} | {} |".format(
                    md_code(row.get("module", "")), *(_fmt(_num(row.get(k))) for k in
                                                     ("max_abs_err", "rel_rmse", "cosine", "tolerance")),
                    "yes" if row.get("ok") else "**no**"))
            out.append("\n</details>\n")
    return out


def _secs(v: float | None) -> str:
    """A timing as people read it: 64.2 ms, 1.23 s."""
    if v is None:
        return "n/a"
    return f"{v * 1e3:.4g} ms" if abs(v) < 1 else f"{v:.4g} s"


def _perf_value(metric: str, v: float | None) -> str:
    return _secs(v) if metric.endswith("_s") and not metric.endswith("_per_s") else _fmt(v) or "n/a"


def _perf(group: Group) -> list[str]:
    """The perf check's own figures for each metric it decided (harness.compare.perfverdict):
    baseline and measured medians on the clock it decided on, the spread of the measurement, its
    noise band (threshold and significance level), the calibrated change, p and the decision."""
    found = sorted((f for f in group.findings if f.perf is not None), key=lambda f: (f.key, f.metric))
    if not found:
        return []
    out = ["### Performance: the perf check's verdict", "",
           "Decided by the `perf` check itself (calibrated ratio of medians past its threshold *and* "
           "one-sided Mann-Whitney p below alpha, a suspected regression re-measured once in the same "
           "item); the comparator's generic thresholds were not applied to these timings.", "",
           "| test | metric | clock | baseline median | measured median (IQR; 95% CI) | samples now / baseline "
           "| calibrated change | noise band | p | decision | roofline |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    files = set()
    for f in found[:_MAX_ROWS]:
        g = f.perf
        m = g.metric
        spread = (f"{_perf_value(m, g.q1)}-{_perf_value(m, g.q3)}" if g.q1 is not None and g.q3 is not None
                  else "n/a")
        ci = (f"{_perf_value(m, g.ci_low)}-{_perf_value(m, g.ci_high)}"
              if g.ci_low is not None and g.ci_high is not None else "n/a")
        change = f"{g.change:+.1%}" if g.change is not None else "n/a"
        if g.kernel_ratio is not None and abs(g.kernel_ratio - 1) > 1e-9:
            change += f" (machine {g.kernel_ratio:.3f}x)"
        decision = (f"**{_cell(g.verdict)}**"
                    + _cell((" (confirmed on re-measure)" if g.remeasured else "") + f": {g.why}"))
        roof = f"{g.roofline[0]} {g.roofline[1]:.1%}" if g.roofline else "n/a"
        p = f"{g.p_value:.2g}" if g.p_value is not None else "n/a"
        n = f"{g.n_current if g.n_current is not None else '?'} / {g.n_baseline if g.n_baseline is not None else '?'}"
        out.append("| " + " | ".join([
            md_code(f.case.name if f.case is not None else f.key), _cell(m), _cell(g.clock),
            _cell(_perf_value(m, g.baseline)), _cell(f"{_perf_value(m, g.measured)} ({spread}; {ci})"),
            _cell(n), _cell(change), _cell(g.band), _cell(p), decision, _cell(roof)]) + " |")
        files.add((g.machine_class, g.baseline_file))
    for cls, path in sorted(files):
        out.append(f"\nMachine class {md_code(cls or 'unknown')}; baseline {md_code(path or 'unknown')}.")
    seen = set()
    for f in found[:_MAX_ROWS]:
        w, name = f.perf.where, f.case.name if f.case is not None else f.key
        if not w or name in seen:
            continue
        seen.add(name)
        out += _where(name, w)
    return out


def _where(name: str, w: dict) -> list[str]:
    """The profile comparison the perf check made on a regression: operators and modules whose
    calibrated time grew most, their share of the phase before and after."""
    def pct(x):
        x = _num(x)
        return "new" if x == float("inf") else f"{x:+.0%}" if x is not None else "n/a"

    def share(r):
        a, b = _num(r.get("share_before")), _num(r.get("share_after"))
        return f"{a:.1%} -> {b:.1%}" if a is not None and b is not None else "n/a"

    out = ["", f"**Where {md_code(str(w.get('phase', '?')))} of {md_code(name)} grew** (profile repeats apart "
           "from the timed ones, calibrated to the baseline machine's speed):", "",
           "| operator / module | change | share of the phase before -> after | in module |", "|---|---|---|---|"]
    for r in (w.get("ops") or [])[:_MAX_ROWS]:
        if isinstance(r, dict):
            out.append("| " + " | ".join([md_code(str(r.get("name", "?"))), pct(r.get("change")), share(r),
                                          md_code(str(r.get("module"))) if r.get("module") else ""]) + " |")
    for r in (w.get("modules") or [])[:_MAX_ROWS]:
        if isinstance(r, dict):
            out.append("| " + " | ".join(["module " + md_code(str(r.get("name", "?"))) + " (own time)",
                                          pct(r.get("change")), share(r), ""]) + " |")
    mem = w.get("memory")
    if isinstance(mem, dict) and mem.get("module"):
        out.append(f"\nTensor-memory peak {pct(mem.get('change'))}; at the peak {md_code(str(mem['module']))} "
                   f"holds {_num(mem.get('module_bytes')) or 0:+,.0f} bytes more.")
    return out


def _num(v) -> float | None:
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def repro(group: Group) -> str:
    names = sorted({f.case.name if f.case is not None else f.key.split("::")[-1] for f in group.findings})
    suite = group.fields.get("suite") or (group.findings[0].suite if group.findings else "")
    expr = " or ".join(names[:10]) or "<test>"
    return f'tox -e model-{suite} -- -k "{expr}"'


def _fenced(title: str, text: str) -> str:
    fence = code_fence(text)  # longer than any backtick run in the names
    return f"{title}\n\n{fence}\n{text}\n{fence}"


def render(group: Group, ctx: RunContext, reopened: bool = False) -> str:
    f0 = group.findings[0] if group.findings else None
    cases = [f.case for f in group.findings if f.case is not None]
    dtypes = ", ".join(sorted({c.dtype for c in cases if c.dtype})) or "n/a"
    devices = ", ".join(sorted({c.device for c in cases if c.device})) or "n/a"
    head = []
    if reopened:
        head.append(f"> **Reopened**: regressed again in {scrub(ctx.run_line())}.\n")
    head += [
        f"**{len(group.items())} regressed item(s)** of kind **{group.kind}** in suite "
        f"**{_cell(group.fields.get('suite', f0.suite if f0 else ''))}** on backend "
        f"**{_cell(group.fields.get('backend', f0.backend if f0 else ''))}**.\n",
        "| | |\n|---|---|",
        f"| dtype | {_cell(dtypes)} |", f"| device | {_cell(devices)} |",
        f"| commit | {md_code(ctx.commit[:12] or 'unknown')} |",
        f"| baseline commit | {md_code(ctx.baseline_commit[:12] or 'unknown')} |",
        f"| run | {scrub(ctx.run_url or 'n/a').replace('|', '%7C')} |", f"| machine | {_cell(ctx.machine or 'n/a')} |",
        *([f"| stack (pinned -> next) | {_cell(f0.stack)} |"] if f0 is not None and f0.stack else []),
        "", "### Regressions", "",
        "| test | metric | baseline | current | change | threshold |", "|---|---|---|---|---|---|",
    ]
    rows = _rows(group)
    dropped: list[str] = []
    shown, size = [], sum(_size(h) + 1 for h in head)
    for r in rows[:_MAX_ROWS]:
        if size + _size(r) > _BUDGET // 2:  # leave room for precision tables and logs
            break
        shown.append(r)
        size += _size(r) + 1
    if len(rows) > len(shown):
        dropped.append(f"{len(rows) - len(shown)} table rows")
    sections = ["\n".join(head + shown)]  # the rows belong to the table: no blank line before them
    used = _size(sections[0])
    for section in ("\n".join(_perf(group)), "\n".join(_precision(group)),
                    _fenced("### Reproduce", scrub(repro(group)))):
        if not section:
            continue
        if used + _size(section) > _BUDGET:
            dropped.append("a section (" + section[:40].splitlines()[0] + ")")
            continue
        sections.append(section)
        used += _size(section)
    logs, n_logs = [], 0
    for c in cases:
        if not (c.log or c.message):
            continue
        text = c.log if c.message and c.message in c.log else f"{c.message}\n{c.log}"
        text = scrub(text.strip())[-_LOG_CHARS:]  # scrub first: a cut must not split a secret
        fence = code_fence(text)
        block = (f"<details><summary>log: {_cell(c.name)}</summary>\n\n{fence}\n{text}\n{fence}\n"
                 "\n</details>")
        if used + _size(block) > _BUDGET:
            dropped.append(f"{sum(1 for x in cases if x.log or x.message) - n_logs} log excerpts")
            break
        logs.append(block)
        used += _size(block)
        n_logs += 1
    if logs:
        sections.append("### Logs\n\n" + "\n".join(logs))
    if dropped:
        sections.append(f"> **Truncated** to stay under GitHub's {MAX_BODY:,}-character limit: "
                        f"{'; '.join(dropped)} not shown. The full results are in the run's artifacts.")
    sections.append("---\n<sub>Filed by `harness compare`. Mute it with the `harness:muted` label or "
                    "an entry in the mute file.</sub>")
    return "\n\n".join(sections)


def _cut(text: str, limit: int) -> str:
    """At most ``limit`` UTF-8 bytes of ``text``, cut on a character boundary."""
    return text.encode("utf-8")[:limit].decode("utf-8", errors="ignore")


def full(group: Group, ctx: RunContext, reopened: bool = False, pending: str = "") -> str:
    """Marker + body, checked against GitHub's limit as the final step: whatever the sections
    did, the text sent is at most ``MAX_BODY`` bytes (so also characters)."""
    head, body = marker(group, pending), render(group, ctx, reopened)
    note = "\n\n> **Truncated**: body cut at GitHub's size limit; the full results are in the run's artifacts."
    if _size(head) + _size(body) > MAX_BODY:  # a pathological single section: cut hard, but say so
        body = _cut(body, MAX_BODY - _size(head) - _size(note) - 64) + note
    return head + body
