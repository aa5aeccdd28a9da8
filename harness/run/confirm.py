"""Confirm before filing: a failed or erroring item is run again before anything downstream calls it.

CI systems that file issues learn to distrust one red run (PyTorch's CI reruns a failure before
calling it; a flaky test filed as a regression costs a vendor engineer an afternoon). So an item
that fails is rerun ``reruns`` times on the same runner, inside the same job, each rerun in a fresh
isolated worker (nothing an earlier item left in the process can decide it), and classified:

==================  ==========================================================================
deterministic       every attempt failed: the failure is the item's (reported as the first one)
flaky               some attempts passed: reported as passed, with the failed attempts recorded
                    and the measured rate (failed attempts / attempts); the comparator
                    quarantines it (harness.compare.quarantine)
infrastructure      every failed attempt is the runner's, not the model's: the worker was killed
                    from outside (the kernel's OOM killer: SIGKILL not sent by harness), the
                    device went away (the backend is no longer available after the failure, or
                    the message says the device was lost), or the disk / the isolation pipe
                    failed; reported as an error the comparator files as ``infrastructure``
==================  ==========================================================================

An item that hit its time limit is rerun once at most: each rerun of a hang costs the whole limit.

Every attempt is recorded on the item (``harness.detail.confirm_attempts``: outcome, first line,
seconds), so the JUnit XML carries the reruns (Surefire's ``rerunFailure`` / ``rerunError``
children, which pytest-rerunfailures' readers and harness's comparator understand) and an issue
body can say "failed 3 of 3 attempts".
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

from harness import metrics
from harness.run.isolation import WORKER_DID_NOT_START
from harness.run.rows import ItemResult

BAD = ("failed", "error")
# A worker that died from SIGKILL without harness sending it: the kernel's OOM killer or the runner
# (harness's own kills say "hung: ..." or "exceeded the memory limit", never "crashed").
_KILLED = re.compile(r"^crashed with SIGKILL\b")
# Messages of a device or runner gone, not of a kernel that computed wrong: driver / runtime
# wording of torch's device backends (CUDA, ROCm, XPU, Ascend), and the isolation machinery itself.
_LOST = re.compile(
    r"device (was )?lost|device-side assert is not|no CUDA GPUs are available|CUDA driver version is insufficient|"
    r"cudaErrorDevicesUnavailable|hipErrorNoDevice|DEVICE_LOST|uncorrectable ECC error|"
    r"NPU function error|device not (found|available)|"
    r"could not run in the isolated worker: (OSError|BrokenPipeError|ConnectionError|JSONDecodeError)|"
    r"No space left on device|ENOSPC",
    re.IGNORECASE)


@dataclass
class Attempt:
    outcome: str
    message: str
    seconds: float
    infrastructure: str = ""  # why this failed attempt is the runner's, or ""

    def to_json(self) -> dict:
        out = {"outcome": self.outcome, "message": _cut(self.message, 300), "seconds": round(self.seconds, 2)}
        if self.infrastructure:
            out["infrastructure"] = self.infrastructure
        return out


def infrastructure_cause(result: ItemResult, device_available: Callable[[], bool] | None = None) -> str:
    """Why a failed attempt is the runner's fault rather than the model's, or ''."""
    if result.outcome not in BAD:
        return ""
    if result.message.startswith(WORKER_DID_NOT_START):
        return "the isolated worker could not start on the runner"
    if _KILLED.match(result.message):
        return "the worker was killed from outside (SIGKILL not sent by harness: the OOM killer or the runner)"
    m = _LOST.search(result.message)
    if m:
        return f"the device or the runner failed ({m.group(0)!r} in the message)"
    if device_available is not None:
        try:
            ok = device_available()
        except Exception:  # asking the backend itself failed: the device is gone
            ok = False
        if not ok:
            return "the backend's device was no longer available after the failure"
    return ""


def _timed(run: Callable[[], ItemResult]) -> tuple[ItemResult, float]:
    t = time.perf_counter()
    r = run()
    return r, time.perf_counter() - t


def confirm(first: ItemResult, first_seconds: float, rerun: Callable[[], ItemResult], reruns: int,
            device_available: Callable[[], bool] | None = None, statistical: bool = False) -> ItemResult:
    """``first`` and up to ``reruns`` more attempts of the same item (``rerun``: a fresh worker each
    time), classified; the result to report, with the attempts and the classification recorded.
    ``statistical``: the check's failed verdict is a statistical decision it confirmed itself
    (``Check.statistical_verdict``: perf, comm); such a failure is reported as it is, only an
    error (a crash, a hang) of that check is rerun."""
    if first.outcome not in BAD or reruns <= 0:
        return first
    if statistical and first.outcome == "failed":
        first.properties.append(metrics.detail_property("confirm", "statistical"))
        first.notes.append("not rerun by --confirm: a measured verdict, confirmed by the check's own statistics "
                           "(a rerun would turn a real regression into a 'flaky' pass part of the time)")
        return first
    results = [first]
    attempts = [Attempt(first.outcome, first.message, first_seconds, infrastructure_cause(first, device_available))]
    hung = first.message.startswith("hung:")
    for _ in range(1 if hung else reruns):
        r, s = _timed(rerun)
        results.append(r)
        attempts.append(Attempt(r.outcome, r.message, s, infrastructure_cause(r, device_available)))
    failed = [a for a in attempts if a.outcome in BAD]
    passed = [i for i, a in enumerate(attempts) if a.outcome == "passed"]
    n = len(attempts)
    if failed and all(a.infrastructure for a in failed):
        kind = "infrastructure"
        out = results[0]
        why = failed[0].infrastructure
        out.outcome = "error"
        out.message = f"infrastructure: {out.message}"
        note = (f"infrastructure, not the model: {why}; {len(failed)} of {n} attempts failed that way"
                + (f", {len(passed)} passed" if passed else ""))
    elif passed:
        kind = "flaky"
        out = results[passed[0]]  # the passing attempt's metrics are the item's
        first_bad = failed[0]
        note = (f"flaky: failed {len(failed)} of {n} attempts (rate {len(failed) / n:.2f}); the first failure: "
                f"{first_bad.outcome}: {first_bad.message}")
        out.properties.append(metrics.detail_property("confirm_failure", _cut(first_bad.message, 500)))
    else:
        kind = "deterministic"
        out = results[0]
        same = len({_shape(a.message) for a in failed}) == 1
        note = (f"deterministic: failed {n} of {n} attempts"
                + ("" if same else " (the message differed between attempts)") + " in fresh workers")
    out.properties += [metrics.detail_property("confirm", kind),
                       metrics.detail_property("confirm_attempts", json.dumps([a.to_json() for a in attempts])),
                       metrics.detail_property("confirm_rate", f"{len(failed) / n:.3f}")]
    out.notes.append(note)
    return out


def _shape(message: str) -> str:
    """A failure's message without its numbers: 'logits rel_rmse 0.31 > 0.04' of two attempts agree."""
    return re.sub(r"[-+]?\d[\d.e+-]*", "#", message)


def attempts_of(props: dict) -> list[dict]:
    """The attempts a row recorded (``harness.detail.confirm_attempts``), [] when it was not rerun."""
    raw = props.get(metrics.PREFIX_DETAIL + "confirm_attempts")
    if not raw:
        return []
    try:
        out = json.loads(raw)
    except ValueError:
        return []
    return [a for a in out if isinstance(a, dict)] if isinstance(out, list) else []


def _cut(message: str, n: int) -> str:
    """Scrubbed, then cut: the head of a token cut in two no longer has a token's shape (issue #49)."""
    from harness.compare.scrub import scrub_secrets

    return scrub_secrets(message)[:n]
