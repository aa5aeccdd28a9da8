"""Graph breaks and recompiles against the counts a suite commits (the compile check's ``breaks``
and ``recompiles`` steps as library calls; harness/checks/compile.py records what they return).

A count the suite does not commit (a suite ``harness init`` just wrote, a new dtype) is measured and
said, never judged against a number nobody chose; fewer than committed passes with a note to lower
it; more fails, naming the break's reason and user frame, or the shape that recompiled and dynamo's
guard-failure reason.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from harness.compiler import dynamo as dyn
from harness.compiler import numerics as num
from harness.compiler import sweep

DECODE = "decode step (length 1)"


@dataclass
class Counted:
    """What the check records of one count: notes, details (in recording order), and a failure's
    message and fields (None: none)."""

    notes: list[str] = field(default_factory=list)
    details: dict[str, str] = field(default_factory=dict)
    failure: tuple[str, dict] | None = None


def per_dtype(v: int | dict[str, int] | None, dtype: str) -> int | None:
    """The committed count for ``dtype``; None where the suite commits none (for that dtype)."""
    return v if v is None or isinstance(v, int) else v.get(dtype)


def uncommitted(out: Counted, suite: str, dtype: str, what: str, key: str, n: int) -> Counted:
    """No count committed: the measurement is the result - recorded as a metric and said in a note."""
    out.notes.append(f"compile: {n} {what} measured, no expectation committed: add `{key} = {n}` (or "
                     f"{{{dtype} = {n}}}) to [checks.compile] of {suite} to hold it")
    out.details[f"compile_{key}_uncommitted"] = str(n)
    return out


def breaks(breaks: Counter, expected, suite: str, dtype: str, model, ids) -> Counted:
    """The graph breaks of the compiled forward (dynamo's counter, by reason) against the committed
    count; over it, each break's reason and user frame from ``torch._dynamo.explain``."""
    out, n, want = Counted(), sum(breaks.values()), per_dtype(expected, dtype)
    reasons = "; ".join(f"{k} x {r}" for r, k in breaks.most_common())
    if reasons:
        out.details["compile_graph_break_reasons"] = reasons
    if want is None:
        return uncommitted(out, suite, dtype, "graph break(s)", "expected_graph_breaks", n)
    if n < want:
        out.notes.append(f"compile: {n} graph break(s), fewer than the {want} expected: lower "
                         f"[checks.compile] expected_graph_breaks for {dtype} to {n}")
        out.details["compile_graph_breaks_expectation"] = f"can be lowered to {n} (expected {want})"
    if n > want:
        lines, message, fields = dyn.breaks_over_expected(model, {"input_ids": ids, "use_cache": False}, breaks, want)
        out.details["compile_graph_break_frames"] = "\n".join(lines)
        out.failure = (message, fields)
    return out


def run_sweep(model, g, ids, cfg, compile_kw: dict, compiler: str) -> sweep.SweepResult:
    """The recompile sweep over the golden's prompt, the suite's prompt lengths and a decode step
    (``sweep.CompilerRaised`` where the compiler under test raises at a shape)."""
    vocab = int(g.inputs.max().item()) + 1
    calls = sweep.shapes(ids.shape[1], cfg.prompt_lens, cfg.decode_step, DECODE)
    return sweep.sweep_with_fallback(model, num.logits, sweep.ids_maker(ids, vocab), calls,
                                     sweep.first_kw(compile_kw, cfg.sweep_backend, compiler), compile_kw, compiler)


def raised(e: sweep.CompilerRaised, compiler: str) -> tuple[str, dict]:
    """The failure of a compiler that raised at a shape of the sweep: message and fields."""
    return (f"the compiled model ({compiler}) raised at the {e.error}",
            dict(metric="compile_recompiles", expected="every shape runs", observed=type(e.error.error).__name__,
                 details="\n".join(f"  {b} raised at the {x}" for b, x in e.fell)))


def recompiles(res: sweep.SweepResult, expected, dynamic: bool | None, suite: str, dtype: str) -> Counted:
    """The sweep's backend fallbacks, timings and recompiles, and the recompiles against the committed count."""
    out = Counted()
    if res.fell:
        text = sweep.fallback_text(res.fell)
        out.notes.append(f"compile: the recompile sweep's {text}: swept with {res.kw['backend']}")
        out.details["compile_sweep_fallback"] = text
    out.details["compile_sweep"] = sweep.timings(res, dynamic)
    if res.recompiled:
        out.details["compile_recompile_reasons"] = "\n".join(str(r) for r in res.recompiled)
    want, n = per_dtype(expected, dtype), len(res.recompiled)
    if want is None:
        return uncommitted(out, suite, dtype, "recompile(s)", "expected_recompiles", n)
    if n < want:
        out.notes.append(f"compile: {n} recompile(s), fewer than the {want} expected: lower [checks.compile] "
                         f"expected_recompiles for {dtype} to {n}")
    elif n > want:
        out.failure = sweep.over_expected(res.recompiled, want, dynamic, DECODE)
    return out
