"""Run one item (suite x check x backend x dtype x variant) and say what happened, as data.

``execute`` is the single place where a check's harness outcome (harness/checks/outcomes.py) or an
unexpected exception becomes an :class:`ItemResult`; the pytest plugin maps an ``ItemResult`` to
pytest (``harness.run.plugin``), in-process or from a child process (run integrity), so both paths
report alike. Nothing here imports pytest.

What libraries warn while an item runs (``warnings.warn``, torch's C++ ``TORCH_WARN`` that torch turns
into Python warnings, ``logging`` records of WARNING level from torch/transformers/... loggers) is
counted with the item (:class:`LibraryWarnings`, ``ItemResult.warnings``), not printed between the
progress lines (torch.compile's "global module hooks" warning on every compiled call, dynamo's
lru_cache notes with their stack context). harness's own warnings (raised from a ``harness`` module,
or of a harness warning class) are shown as before.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import traceback
import warnings

from harness import metrics
from harness.backends.faults import FaultError, install_from_env
from harness.checks import CheckContext, CheckFailure, CouldNotRun, KnownGap, NotApplicable, registry
from harness.messages import display, first_line
from harness.run.rows import OUTCOMES, ItemResult  # noqa: F401  (re-exported: the item's result)
from harness.settings import SettingsError


def describe(verb: str, suite: str, check: str, backend: str, dtype: str) -> str:
    """'smoke check failed for kimi-k2 on npu in bfloat16': the head line of every report."""
    return f"{check} check {verb} for {suite} on {backend} in {dtype}"


class HarnessWarning(UserWarning):
    """A warning harness itself raises: shown as raised, never folded into an item's warnings."""


MAX_KINDS = 100  # distinct warnings kept per item (a message with a step number in it is a new kind each time)
MESSAGE_CHARS = 300  # of a warning's first line, as kept


def _is_harness(module: str) -> bool:
    return module == "harness" or module.startswith("harness.")


_HARNESS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def is_harness_warning(category, filename: str) -> bool:
    """A warning of harness's own: a harness warning class, or one raised in a harness file."""
    return _is_harness(getattr(category, "__module__", "")) or os.path.abspath(filename).startswith(_HARNESS_DIR)


def _pattern(regex) -> str:
    """A filter's message or module as ``filterwarnings`` takes it: a compiled pattern's source, a
    string (a filter some code appended to ``warnings.filters`` itself) as it is."""
    return getattr(regex, "pattern", regex) or ""


def _where(filename: str, lineno: int) -> str:
    """``torch/_dynamo/eval_frame.py:502``: a library file from its package on, a file of the project
    relative to it, anything else as it is."""
    for mark in ("site-packages/", "dist-packages/"):
        if mark in filename:
            return f"{filename.rsplit(mark, 1)[1]}:{lineno}"
    rel = display(filename)
    return f"{filename if rel.startswith('..') else rel}:{lineno}"


class LibraryWarnings:
    """While open: every warning and library WARNING log record of this process is counted by
    (category, first line, where), not printed; ``records()`` gives them, most frequent first.

    Counted, not de-duplicated away: inside, the filters that show a warning once ("default",
    "module", "once") show it always, so a warning raised 500 times says 500; "ignore" and "error"
    keep their meaning (an ignore torch set at import stays, ``-W error`` still raises). Not
    thread-safe against another ``catch_warnings`` (no warnings capture is), and not reentrant."""

    def __init__(self):
        self.counts: dict[tuple, int] = {}  # (category, first line, file or logger, line or None) -> count
        self.dropped = 0  # occurrences of kinds past MAX_KINDS
        self._shown: set = set()

    def __enter__(self) -> LibraryWarnings:
        self._catch = warnings.catch_warnings()  # restores filters and showwarning on the way out
        self._catch.__enter__()
        old = list(warnings.filters)
        warnings.resetwarnings()
        warnings.simplefilter("always")
        for action, message, category, module, lineno in reversed(old):  # inserted at the front: same order
            action = "always" if action in ("default", "module", "once") else action
            try:
                warnings.filterwarnings(action, _pattern(message), category, _pattern(module), lineno)
            except (AssertionError, TypeError, ValueError):  # a malformed filter some code appended by hand
                pass
        self._previous = warnings.showwarning  # pytest's recorder in-process, stderr in the worker
        warnings.showwarning = self._warning
        # A logger's own handlers print (torch's and transformers' write to stderr themselves, not
        # through the root logger), and torch adds loggers as it imports: every record passes
        # through Logger.handle, whichever logger and handler, so that is where it is taken.
        self._handle = logging.Logger.handle
        outer = self

        def handle(logger, record):
            if (logging.WARNING <= record.levelno < logging.ERROR and not _is_harness(record.name)
                    and not logger.disabled and logger.filter(record)):
                try:
                    text = record.getMessage()
                except Exception:  # a library's bad format arguments: the template still says what
                    text = str(record.msg)
                outer._count("logging.WARNING", text, record.name, None)
                return None
            return outer._handle(logger, record)  # ERROR and above stay on the console: the crash's story

        logging.Logger.handle = handle
        return self

    def __exit__(self, *exc) -> None:
        logging.Logger.handle = self._handle
        self._catch.__exit__(*exc)

    def _warning(self, message, category, filename, lineno, file=None, line=None) -> None:
        if _is_harness(getattr(category, "__module__", "")) or self._raised_by_harness():
            key = (category, str(message), filename, lineno)
            if key not in self._shown:  # once per item, as the default filter would
                self._shown.add(key)
                self._previous(message, category, filename, lineno, file, line)
            return
        self._count(getattr(category, "__name__", str(category)), str(message), filename, lineno)

    @staticmethod
    def _raised_by_harness() -> bool:
        """Whose code called ``warnings.warn``: the first frame up the stack outside warnings.py and
        this module. Not the warning's location: a library's ``stacklevel=2`` names its caller, often
        harness code (torch.compile's "global module hooks" warning points at the check)."""
        f = sys._getframe(2)
        while f is not None and f.f_globals.get("__name__") in ("warnings", "_py_warnings", __name__):
            f = f.f_back
        return f is not None and _is_harness(f.f_globals.get("__name__", ""))

    def _count(self, category: str, text: str, where: str, lineno: int | None) -> None:
        # The first line only (dynamo appends the stack it came from), cut well past what is kept:
        # scrubbed for secrets before the final cut (records()), never after. Nothing else per
        # occurrence: a warning in a hot loop costs a dict update (the path is shortened once, below).
        head = text.lstrip().partition("\n")[0][:4 * MESSAGE_CHARS]
        key = (category, head, where, lineno)
        if key in self.counts or len(self.counts) < MAX_KINDS:
            self.counts[key] = self.counts.get(key, 0) + 1
        else:
            self.dropped += 1

    def records(self) -> list[dict]:
        """``[{category, message, source, count}]``, most frequent first: what ItemResult carries."""
        from harness.compare.scrub import scrub_secrets

        merged: dict[tuple[str, str, str], int] = {}
        for (category, head, where, lineno), n in self.counts.items():
            source = where if lineno is None else _where(where, lineno)  # a logger's name, or file:line
            key = (category, first_line(scrub_secrets(head), MESSAGE_CHARS), source)
            merged[key] = merged.get(key, 0) + n
        out = [{"category": c, "message": m, "source": s, "count": n}
               for (c, m, s), n in sorted(merged.items(), key=lambda kv: -kv[1])]
        if self.dropped:
            out.append({"category": "Warning", "message": f"warnings of more kinds than the {MAX_KINDS} kept "
                        "per item", "source": "harness", "count": self.dropped})
        return out


def execute(suite, check_name: str, backend, dtype: str, variant: str | None) -> ItemResult:
    """Run the check; never raises for what the check or the model did. What libraries warned
    meanwhile is in the result's ``warnings``."""
    with LibraryWarnings() as caught:
        result = _execute(suite, check_name, backend, dtype, variant)
    result.warnings = caught.records()
    return result


def _execute(suite, check_name: str, backend, dtype: str, variant: str | None) -> ItemResult:
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
    try:
        result = _run_check(check, ctx, where)
    finally:  # also for what escapes _run_check (KeyboardInterrupt): the cost is measured either way
        _record_cost(ctx, backend, t)
    _attach_context(result, ctx)
    return result


def _run_check(check, ctx: CheckContext, where: tuple[str, str, str, str]) -> ItemResult:
    """Run the check and map how it ended to an outcome: each harness exception to its own, any
    other exception to ``failed`` (the model or the backend raised: the check ran and the answer is no)."""
    try:
        check.run(ctx)
        return ItemResult("passed")
    except CheckFailure as e:
        return ItemResult("failed", e.message, e.report(describe("failed", *where)))
    except KnownGap as e:
        return ItemResult("xfailed", e.message, e.message)
    except NotApplicable as e:
        return ItemResult("skipped", e.message, e.message)
    except CouldNotRun as e:
        step = e.step or ctx.phase
        cause = "".join(traceback.format_exception(e.__cause__)) if e.__cause__ is not None else ""
        return ItemResult("error", f"could not run ({step}): {e.message}" if step else f"could not run: {e.message}",
                          describe("could not run", *where) + (f" (step {step!r})" if step else "") + f": {e.message}"
                          + (f"\n\n{cause}" if cause else ""))
    except Exception as e:  # the model or the backend raised: the check ran and the answer is no
        step = getattr(e, "_harness_step", None) or ctx.phase
        from harness.compare.scrub import scrub_secrets

        # scrub, then cut: the head of a token cut at 500 characters no longer has a token's shape
        msg = f"{type(e).__name__}: {first_line(scrub_secrets(str(e)), 500)}"
        # said apart from a check's judgment (a CheckFailure): `harness certify` counts only a judgment as a
        # catch, never a device that raised under a fault (a lost device had read "2/2 caught")
        ctx.detail("raised", type(e).__name__)
        return ItemResult("failed", f"{msg} (in step {step})" if step else msg,
                          describe("failed", *where) + f": step {step!r} raised {msg}\n\n"
                          + "".join(traceback.format_exception(e)))


def _record_cost(ctx: CheckContext, backend, t: float) -> None:
    """Wall time since ``t`` and the backend's peak memory, after the device finished its work."""
    try:
        backend.synchronize()
    except Exception:  # a dead device must not hide the result we already have
        pass
    ctx.metric("wall_time_s", time.perf_counter() - t)
    peak = backend.peak_memory()
    if peak is not None:
        ctx.metric("peak_memory_bytes", peak)


def _attach_context(result: ItemResult, ctx: CheckContext) -> None:
    """What the check recorded on its context (properties, notes, the phase it reached) onto the result."""
    if ctx.notes:
        ctx.detail("notes", "; ".join(ctx.notes))
    if result.outcome in ("failed", "error") and ctx.phase:
        ctx.detail("phase", ctx.phase)
    result.properties = list(ctx.properties)
    result.notes = list(ctx.notes)
    result.phase = ctx.phase


def identity_properties(suite: str, check: str, backend: str, dtype: str, variant: str | None,
                        device: str | None = None) -> list[tuple[str, str]]:
    """Written at setup, before anything can skip: nothing needs to parse the test id back."""
    props = [p for p in metrics.meta_properties(suite, check, backend, dtype, device or "", variant)
             if p[0] != "harness.device" or device]
    return props

