"""Run one item (suite x check x backend x dtype x variant) and say what happened, as data.

``execute`` is the single place where a check's harness outcome (harness/checks/outcomes.py) or an
unexpected exception becomes an :class:`ItemResult`; the pytest plugin maps an ``ItemResult`` to
pytest (``harness.run.plugin``), in-process or from a child process (run integrity), so both paths
report alike. Nothing here imports pytest.
"""

from __future__ import annotations

import time
import traceback

from harness import metrics
from harness.backends.faults import FaultError, install_from_env
from harness.checks import CheckContext, CheckFailure, CouldNotRun, KnownGap, NotApplicable, registry
from harness.messages import first_line
from harness.run.rows import OUTCOMES, ItemResult  # noqa: F401  (re-exported: the item's result)
from harness.settings import SettingsError


def describe(verb: str, suite: str, check: str, backend: str, dtype: str) -> str:
    """'smoke check failed for kimi-k2 on npu in bfloat16': the head line of every report."""
    return f"{check} check {verb} for {suite} on {backend} in {dtype}"


def execute(suite, check_name: str, backend, dtype: str, variant: str | None) -> ItemResult:
    """Run the check; never raises for what the check or the model did."""
    check = registry().get(check_name)
    ctx = CheckContext(suite, backend, dtype, variant, check=check_name)
    where = (suite.name, check_name, backend.name, dtype)
    try:  # `harness certify`: a known wrong kernel on this backend's dispatch key, before anything runs
        fault = install_from_env(backend)
    except (FaultError, SettingsError) as e:
        return ItemResult("error", f"could not install the certify fault: {e}", f"could not install the certify fault: {e}")
    if fault:
        ctx.detail("certify_fault", fault)  # a result produced under a fault says so
    backend.reset_peak_memory()
    t = time.perf_counter()
    result: ItemResult
    try:
        check.run(ctx)
        result = ItemResult("passed")
    except CheckFailure as e:
        result = ItemResult("failed", e.message, e.report(describe("failed", *where)))
    except KnownGap as e:
        result = ItemResult("xfailed", e.message, e.message)
    except NotApplicable as e:
        result = ItemResult("skipped", e.message, e.message)
    except CouldNotRun as e:
        step = e.step or ctx.phase
        cause = "".join(traceback.format_exception(e.__cause__)) if e.__cause__ is not None else ""
        result = ItemResult("error", f"could not run ({step}): {e.message}" if step else f"could not run: {e.message}",
                            describe("could not run", *where) + (f" (step {step!r})" if step else "") + f": {e.message}"
                            + (f"\n\n{cause}" if cause else ""))
    except Exception as e:  # the model or the backend raised: the check ran and the answer is no
        step = getattr(e, "_harness_step", None) or ctx.phase
        msg = f"{type(e).__name__}: {first_line(e, 500)}"
        result = ItemResult("failed", f"{msg} (in step {step})" if step else msg,
                            describe("failed", *where) + f": step {step!r} raised {msg}\n\n"
                            + "".join(traceback.format_exception(e)))
    finally:
        try:
            backend.synchronize()
        except Exception:  # a dead device must not hide the result we already have
            pass
        ctx.metric("wall_time_s", time.perf_counter() - t)
        peak = backend.peak_memory()
        if peak is not None:
            ctx.metric("peak_memory_bytes", peak)
    if ctx.notes:
        ctx.detail("notes", "; ".join(ctx.notes))
    if result.outcome in ("failed", "error") and ctx.phase:
        ctx.detail("phase", ctx.phase)
    result.properties = list(ctx.properties)
    result.notes = list(ctx.notes)
    result.phase = ctx.phase
    return result


def identity_properties(suite: str, check: str, backend: str, dtype: str, variant: str | None,
                        device: str | None = None) -> list[tuple[str, str]]:
    """Written at setup, before anything can skip: nothing needs to parse the test id back."""
    props = [p for p in metrics.meta_properties(suite, check, backend, dtype, device or "", variant)
             if p[0] != "harness.device" or device]
    return props

