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


def write_junit(path, items: list[dict], reruns: dict[str, int] | None = None) -> str:
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
                + "".join(rows) + "</testsuite></testsuites>")
    return os.fspath(path)


def _esc(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
