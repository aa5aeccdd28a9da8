"""Helpers for the parallel tests: a bundled suite with the (opt-in) parallel check switched on."""

from __future__ import annotations

from pathlib import Path

from harness.checks import CheckContext, CheckOutcome, registry
from harness.checks.parallel import ParallelConfig
from harness.suite.loader import load_suite

ROOT = Path(__file__).resolve().parents[2]


def suite_with(name: str, **table):
    """The bundled suite ``name`` with ``[checks.parallel]`` = ``table`` (enabled), validated. Timing
    off unless asked (tests/parallel/test_timing.py times; the numerics tests need none of it)."""
    ls = load_suite(ROOT / "suites" / f"{name}.toml")
    ls.suite.checks.parallel = ParallelConfig.model_validate({"enabled": True, "timing_repeats": 0, **table})
    return ls


def run_variant(ls, variant: str, dtype: str = "float32", **options):
    """(outcome or None, context) of one item; ``options`` reach the check's state (``fault=``)."""
    from harness.backends import get

    ctx = CheckContext(ls, get("cpu"), dtype, variant, check="parallel")
    try:
        registry().get("parallel").run(ctx, **options)
    except CheckOutcome as e:
        return e, ctx
    return None, ctx


def metrics_of(ctx) -> dict[str, float]:
    return {k[len("metric."):]: float(v) for k, v in ctx.properties if k.startswith("metric.")}


def details_of(ctx) -> dict[str, str]:
    return {k[len("harness.detail."):]: v for k, v in ctx.properties if k.startswith("harness.detail.")}
