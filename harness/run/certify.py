"""``harness certify``: known kernel faults on a backend's own dispatch key, one at a time, and
whether the checks that should catch them do.

A clean run first (the checks the faults need, no fault): a backend that is not green there cannot
be certified. Then one ``harness run`` per fault, each a fresh process tree whose every item
process installs the fault on the backend's dispatch key (``HARNESS_CERTIFY_FAULT``,
harness.backends.faults), and the item of the fault's check read back from that run's
``summary.json``. A fault is

* **caught** when the check failed by its own judgment (a ``CheckFailure``, not an exception the device
  or the model raised: a lost device is no catch) and the fault's kernel ran (the failure is its doing);
* **missed** when the check passed (or only a declared known gap failed): harness would have called
  this backend green with the wrong kernel; ``ran`` says whether the kernel was called at all (a model
  path that never reaches the op, e.g. a fused kernel harness does not know, is missed as well);
* **error** when the check could not judge: it errored or skipped, the run died, the fault's own
  code raised, or the check failed although none of the fault's kernels ran.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from harness.backends.faults import Fault
from harness.files import atomic, paths
from harness.messages import first_line
from harness.settings import results_root, set_env, unset_env

DTYPE = "float32"  # the faults' own dtype, and the cheapest that resolves them all
# Where a check names the module at fault (harness.detail.<key>), in order of preference.
MODULE_DETAILS = ("first_divergent_module", "first_divergent_backward_module", "first_nonfinite_module",
                  "first_diverging_module", "first_divergent_layer", "last_module")


@dataclass
class Item:
    check: str
    outcome: str  # passed / failed / error / skipped / xfailed, or "absent" (the run produced no item)
    message: str = ""
    module: str = ""  # the module the check named
    seconds: float = 0.0
    raised: str = ""  # the exception type when the item failed by raising, not by a check's judgment


@dataclass
class Row:
    fault: str
    summary: str
    ops: list[str]  # the overloads it replaces
    check: str
    verdict: str = ""  # caught / missed / error
    outcome: str = ""
    module: str = ""
    ran: list[str] = field(default_factory=list)  # the overloads whose wrong kernel actually ran
    message: str = ""
    seconds: float = 0.0
    reproduce: str = ""


@dataclass
class Report:
    backend: str
    dispatch_key: str
    suite: str
    dtype: str = DTYPE
    baseline: list[Item] = field(default_factory=list)
    faults: list[Row] = field(default_factory=list)

    @property
    def green(self) -> bool:
        return bool(self.baseline) and all(i.outcome == "passed" for i in self.baseline)

    def counts(self) -> dict[str, int]:
        c = {"caught": 0, "missed": 0, "error": 0}
        for r in self.faults:
            c[r.verdict] = c.get(r.verdict, 0) + 1
        return c

    def exit_code(self) -> int:
        return 0 if self.green and self.faults and all(r.verdict == "caught" for r in self.faults) else 1

    def to_json(self) -> dict:
        return {"backend": self.backend, "dispatch_key": self.dispatch_key, "suite": self.suite, "dtype": self.dtype,
                "green": self.green, "baseline": [asdict(i) for i in self.baseline],
                "faults": [asdict(r) for r in self.faults], "counts": self.counts()}


def _module(props: dict) -> str:
    for k in MODULE_DETAILS:
        v = props.get(f"harness.detail.{k}")
        if v:
            return v
    return ""


def run_checks(suite: str, backend: str, checks: list[str], results: Path, environ: dict,
               timeout: float | None = None) -> tuple[dict[str, Item], str]:
    """``harness run SUITE --backend B --check C... --dtype float32`` in a fresh process; the items by
    check, and the run's output tail (for a run that produced no summary)."""
    cmd = [sys.executable, "-m", "harness", "run", suite, "--backend", backend, "--dtype", DTYPE,
           "--results", str(results)]
    for c in checks:
        cmd += ["--check", c]
    if timeout:
        cmd += ["--timeout", str(timeout)]
    r = subprocess.run(cmd, env=environ, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    tail = (r.stdout + r.stderr).strip()[-2000:]
    items: dict[str, Item] = {}
    summary = results / "summary.json"
    if summary.exists():
        for it in json.loads(summary.read_text())["items"]:
            props = it.get("props", {})
            if props.get("harness.backend") != backend:
                continue
            c = props.get("harness.check", "")
            items[c] = Item(c, it["outcome"], first_line(it.get("message") or "", 300), _module(props),
                            round(float(it.get("duration") or 0.0), 2), props.get("harness.detail.raised", ""))
    return items, tail


def _read_log(path: Path) -> tuple[list[str], list[str]]:
    ran, raised = [], []
    for line in path.read_text().splitlines() if path.exists() else []:
        rec = json.loads(line)
        if rec["event"] == "ran" and rec["op"] not in ran:
            ran.append(rec["op"])
        elif rec["event"] == "raised":
            raised.append(f"{rec['op']}: {rec['error']}")
    return ran, raised


def judge(item: Item | None, ran: list[str], raised: list[str], tail: str) -> tuple[str, str]:
    """(verdict, why): caught / missed / error, from the fault's item and its kernel log."""
    if raised:
        return "error", f"the fault's own kernel raised ({raised[0]}): not a catch"
    if item is None:
        return "error", f"the run produced no item for the check: {first_line(tail, 300) or '(no output)'}"
    if item.outcome == "failed":
        if not ran:
            return "error", f"failed, but none of the fault's kernels ran: not its doing ({item.message})"
        if item.raised:  # the device or the model raised: no check judged anything (a lost device is no catch)
            return "error", f"the run raised {item.raised} under the fault, no check judged it: not a catch ({item.message})"
        return "caught", item.message
    if item.outcome in ("passed", "xfailed"):
        why = item.message or ("passed with the wrong kernel" if ran else
                               "passed; the fault's kernels never ran: the model's path on this backend does "
                               "not call the ops it replaces")
        return "missed", why
    return "error", f"{item.outcome}: {item.message}"


def fault_env(fault: str, backend: str) -> dict[str, str]:
    """The variables that make every item process of a run install ``fault`` on ``backend``."""
    e: dict[str, str] = {}
    set_env("HARNESS_CERTIFY_FAULT", fault, e)
    set_env("HARNESS_CERTIFY_BACKEND", backend, e)
    return e


def reproduce(fault: str, backend: str, suite: str, check: str) -> str:
    """The command line that reruns one fault's row by hand."""
    return " ".join(f"{k}={v}" for k, v in fault_env(fault, backend).items()) + (
        f" harness run {suite} --backend {backend} --check {check} --dtype {DTYPE}")


def certify(backend, faults: list[Fault], suite: str, *, check: str | None = None, results: Path | None = None,
            timeout: float | None = None, say: Callable[[str], None] = lambda _s: None) -> Report:
    """The clean run, then each fault in its own run; ``check`` replaces every fault's own check."""
    report = Report(backend.name, backend.dispatch_key or "", suite)
    # under the results directory (never a temporary folder outside it: the house's write rule), kept
    root = Path(results) if results is not None else results_root() / "certify"
    atomic.make_dirs(root)
    base_env = dict(os.environ)
    unset_env("HARNESS_CERTIFY_FAULT", base_env)  # a clean baseline, whatever the caller's environment
    unset_env("HARNESS_CERTIFY_BACKEND", base_env)
    unset_env("HARNESS_CERTIFY_LOG", base_env)
    checks = list(dict.fromkeys(check or f.check for f in faults))
    t0 = time.monotonic()
    items, tail = run_checks(suite, backend.name, checks, root / "baseline", base_env, timeout)
    report.baseline = [items.get(c) or Item(c, "absent", first_line(tail, 300)) for c in checks]
    say(f"baseline ({', '.join(checks)}, no fault): "
        + ", ".join(f"{i.check} {i.outcome}" for i in report.baseline) + f" ({time.monotonic() - t0:.0f} s)")
    if not report.green:
        return report
    for f in faults:
        c = check or f.check
        log = paths.join(root, f"{f.name}.log", source="harness certify", field="fault")
        log.unlink(missing_ok=True)
        e = base_env | fault_env(f.name, backend.name)
        set_env("HARNESS_CERTIFY_LOG", log.resolve(), e)
        t0 = time.monotonic()
        out = paths.join(root, f.name, source="harness certify", field="fault")
        items, tail = run_checks(suite, backend.name, [c], out, e, timeout)
        ran, raised = _read_log(log)
        item = items.get(c)
        verdict, why = judge(item, ran, raised, tail)
        row = Row(f.name, f.summary, list(f.ops), c, verdict, item.outcome if item else "absent",
                  item.module if item and verdict == "caught" else "", ran, why,
                  round(time.monotonic() - t0, 1), reproduce(f.name, backend.name, suite, c))
        report.faults.append(row)
        say(f"{f.name}: {verdict}" + (f" by {c} at {row.module}" if row.module else f" ({c} {row.outcome})")
            + f" ({row.seconds:.0f} s)")
    return report
