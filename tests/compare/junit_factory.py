"""pytest-shaped JUnit XML for the comparator's tests.

``run_pytest_suite`` runs a real pytest (``--junitxml``) over a generated ``suites/<suite>.toml``
whose items record the harness properties, so the XML is what a harness run writes (classname
``suites.<suite>.toml``, name ``check[backend-dtype]``) without depending on the model code.
``write_junit`` writes the same shape directly, for tests that need many variants quickly.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
import textwrap
from xml.sax.saxutils import quoteattr

_CONFTEST = textwrap.dedent('''
    import json, tomllib, pytest

    def pytest_collect_file(parent, file_path):
        if file_path.suffix == ".toml" and file_path.parent.name == "suites":
            return SuiteFile.from_parent(parent, path=file_path)

    class SuiteFile(pytest.File):
        def collect(self):
            spec = json.loads(tomllib.loads(self.path.read_text())["spec"])
            for item in spec:
                yield SuiteItem.from_parent(self, name=item["name"], spec=item)

    class SuiteItem(pytest.Item):
        def __init__(self, *, spec, **kw):
            super().__init__(**kw)
            self.spec = spec

        def setup(self):
            if self.spec.get("error"):
                raise RuntimeError(self.spec["error"])

        def runtest(self):
            for k, v in self.spec["props"]:
                self.user_properties.append((k, v))
            if self.spec.get("fail"):
                print(self.spec.get("log", ""))
                raise AssertionError(self.spec["fail"])

        def reportinfo(self):
            return self.path, 0, self.name
''')


def item(suite: str, check: str, backend: str = "cpu", dtype: str = "float32",
         metrics: dict | None = None, tolerances: dict | None = None, details: dict | None = None,
         fail: str = "", error: str = "", log: str = "", device: str = "cpu") -> dict:
    """One harness test item, as the spec of the generated suite and of ``write_junit``."""
    props = [["harness.suite", suite], ["harness.check", check], ["harness.backend", backend],
             ["harness.dtype", dtype], ["harness.device", device]]
    props += [[f"metric.{k}", repr(float(v))] for k, v in (metrics or {}).items()]
    props += [[f"tolerance.{k}", repr(float(v))] for k, v in (tolerances or {}).items()]
    props += [[f"harness.detail.{k}", v] for k, v in (details or {}).items()]
    return {"suite": suite, "name": f"{check}[{backend}-{dtype}]", "props": props, "fail": fail,
            "error": error, "log": log}


def run_pytest_suite(folder, items: list[dict], junit_path) -> str:
    """Run real pytest over the items (all of one suite) and return the JUnit XML path."""
    folder = os.fspath(folder)
    os.makedirs(os.path.join(folder, "suites"), exist_ok=True)
    with open(os.path.join(folder, "conftest.py"), "w") as f:
        f.write(_CONFTEST)
    with open(os.path.join(folder, "pytest.ini"), "w") as f:
        f.write("[pytest]\n")
    suite = items[0]["suite"]
    spec = json.dumps(items).replace("'''", "")
    with open(os.path.join(folder, "suites", f"{suite}.toml"), "w") as f:
        f.write(f"spec = '''{spec}'''\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "GITHUB_"))}
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:harness",
                    "-p", "no:xdist", "-p", "no:hypothesispytest", f"--junitxml={junit_path}", "-o", "junit_family=xunit1",
                    "-o", "junit_logging=system-out",
                    "suites"], cwd=folder, env=env, capture_output=True, check=False, timeout=120)
    assert os.path.exists(junit_path), "pytest wrote no JUnit XML"
    return os.fspath(junit_path)


def write_junit(path, items: list[dict], reruns: dict[str, int] | None = None, stack: dict | None = None) -> str:
    """pytest-shaped JUnit XML without running pytest (fast; for the many-variant tests)."""
    rows = []
    for it in items:
        props = "".join(f"<property name={quoteattr(k)} value={quoteattr(v)}/>" for k, v in it["props"])
        extra = ""
        if it.get("error"):
            extra = f"<error message={quoteattr('failed on setup: ' + it['error'])}>{_esc(it['error'])}</error>"
        elif it.get("fail"):
            extra = f"<failure message={quoteattr(it['fail'])}>{_esc(it.get('log', '') + it['fail'])}</failure>"
        extra += "<rerunFailure message='flaky'/>" * (reruns or {}).get(it["name"], 0)
        rows.append(f"<testcase classname={quoteattr('suites.' + it['suite'] + '.toml')} "
                    f"name={quoteattr(it['name'])} time=\"0.5\"><properties>{props}</properties>{extra}</testcase>")
    fails = sum(1 for it in items if it.get("fail"))
    # pytest stamps every file with the time it was written: two runs never give the same bytes
    stamp = dt.datetime.now(dt.timezone.utc).isoformat()
    with open(path, "w", encoding="utf-8") as f:
        f.write('<?xml version="1.0" encoding="utf-8"?><testsuites name="pytest tests">'
                f'<testsuite name="pytest" errors="0" failures="{fails}" skipped="0" tests="{len(items)}" '
                f'timestamp="{stamp}" hostname="ci-runner">'
                + ("<properties>" + "".join(f"<property name={quoteattr('harness.stack.' + k)} value={quoteattr(v)}/>"
                                            for k, v in stack.items()) + "</properties>" if stack else "")
                + "".join(rows) + "</testsuite></testsuites>")
    return os.fspath(path)


def _esc(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


PERF_CLASS = "cpu-amd-epyc-x1-1t-0a7880fd"


def perf_samples(level: float, n: int = 20) -> list[float]:
    """``n`` CPU-clock samples around ``level`` seconds, +-0.4%, deterministic."""
    return [level * (1 + 0.004 * (((i * 7) % 11) - 5) / 5) for i in range(n)]


def perf_item(suite: str, cur: list[float], base: list[float] | None, *, wall: float = 2.2,
              baseline_file: str = "", roofline: float = 0.81, memory: float = 3.0e8,
              decided: bool = True) -> tuple[dict, object]:
    """A ``perf`` item as the check records it (harness/checks/perf.py ``record``/``verdict``), its
    verdict made by the check's own decision rule (harness.perf.decide) on CPU-clock samples
    ``cur`` against ``base`` (None: no baseline). ``wall``: the wall-clock samples are the CPU ones
    times this (a loaded runner stretches wall time, not CPU time). A confirmed regression is
    re-measured (the same samples again, as an interleaved re-run that agrees) and fails the item.
    ``decided``: the verdict names the samples it decided on, both sides (what the check records
    since the clock-mix fix); False: a record of before. Returns ``(item, decision)``."""
    from harness.perf.decide import decide
    from harness.perf.stats import summarize

    samples = {"prefill_cpu_s": cur, "prefill_s": [v * wall for v in cur]}
    entries, decision = {}, None
    if base is None:
        status = "no-baseline"
        why = f"no baseline for llama-3.1-8b cpu-float32-b1-s128 on {PERF_CLASS}; run harness baseline update"
    else:
        decision = first = decide("prefill_s", cur, base, direction="lower", threshold=0.05, alpha=0.01,
                                  kernel_ratio=1.0)
        entry = decision.to_dict()
        if first.verdict == "regression":  # checks/perf.py _remeasure: once more, interleaved
            samples["prefill_cpu_s_remeasured"] = list(cur)
            samples["prefill_s_remeasured"] = [v * wall for v in cur]
            decision = decide("prefill_s", cur, base, direction="lower", threshold=0.05, alpha=0.01,
                              kernel_ratio=1.0)
            entry = decision.to_dict()
            entry["first"] = first.to_dict()
        entry["summary"] = summarize(samples["prefill_s"]).to_dict()
        if decided:
            key = "prefill_cpu_s_remeasured" if "first" in entry else "prefill_cpu_s"
            entry["decided"] = {"clock": "cpu", "samples": key, "now": summarize(cur).to_dict(),
                                "baseline": summarize(base).to_dict()}
        entries["prefill_s"] = entry
        status = decision.verdict if decision.verdict in ("regression", "improvement") else "unchanged"
        why = baseline_file or f"golden/perf/{suite}/{PERF_CLASS}.json (same machine class)"
    summary = {k: summarize(v).to_dict() for k, v in samples.items()}
    verdict = {"status": status, "baseline": why, "class": PERF_CLASS, "metrics": entries,
               "roofline": {"prefill_mfu": roofline}}
    wall_med, cpu_med = summary["prefill_s"]["median"], summary["prefill_cpu_s"]["median"]
    metrics = {"prefill_s": wall_med, "prefill_cpu_s": cpu_med, "prefill_tokens_per_s": 128 / wall_med,
               "prefill_mfu": roofline, "prefill_peak_memory_bytes": memory, "wall_time_s": 14.0}
    if decision is not None:
        metrics.update({"prefill_s_p_value": decision.p_value, "prefill_s_change": decision.change})
    details = {"perf_verdict": json.dumps(verdict, separators=(",", ":")),
               "perf_summary": json.dumps({k: {f: s[f] for f in ("n", "median", "q1", "q3", "iqr", "ci_low",
                                                                    "ci_high")} for k, s in summary.items()}),
               "perf_clock": "cpu", "perf_class": PERF_CLASS}
    fail = ""
    if status == "regression":
        fail = (f"prefill_s regressed {decision.change:+.1%} (calibrated, p={decision.p_value:.2g}, confirmed on "
                "re-measure) against the baseline of this machine class")
    it = item(suite, "perf", metrics=metrics, details=details, fail=fail)
    it["name"] = "perf[cpu-float32-b1-s128]"
    it["props"].append(["harness.variant", "b1-s128"])
    return it, decision
