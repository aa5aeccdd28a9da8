"""Shared helpers for the precision tests."""

from __future__ import annotations

import json
from pathlib import Path

from harness.backends import get
from harness.checks import CheckContext, CheckFailure, CouldNotRun
from harness.checks.precision import run_precision
from harness.suite.loader import load_suite

REPO = Path(__file__).resolve().parents[2]
GOLDEN = REPO / "golden"
SUITES = ["deepseek-v3", "kimi-k2", "llama-3.1-8b", "mixtral-8x7b", "qwen3-30b-a3b", "qwen3-8b"]


def copy_golden(name: str, dest: Path) -> Path:
    """The committed golden of suite ``name`` copied to ``dest`` in the flat layout (its current
    version's files directly in ``dest``), whatever layout the repository holds: tests damage and
    read those files by name."""
    import shutil

    from harness.golden.store import current_dir

    shutil.copytree(current_dir(GOLDEN / name), dest)
    return dest


def suite(name: str):
    return load_suite(REPO / "suites" / f"{name}.toml")


def run_check(name_or_ls, dtype: str, tmp_path: Path, *, transform=None, context=None, golden_root=GOLDEN,
              force_report=False):
    """(ctx, failure or None) of the precision check on CPU."""
    ls = suite(name_or_ls) if isinstance(name_or_ls, str) else name_or_ls
    ctx = CheckContext(ls, get("cpu"), dtype)
    try:
        run_precision(ctx, transform=transform, context=context, golden_root=golden_root,
                      results_dir=tmp_path / "results", force_report=force_report)
    except (CheckFailure, CouldNotRun) as f:  # CouldNotRun: a bad golden, never blamed on the target
        return ctx, f
    return ctx, None


def props(ctx) -> dict:
    return dict(ctx.properties)


def layer_table(ctx) -> list[dict]:
    return json.loads(props(ctx)["harness.detail.layer_table"])


def cli(argv: list[str]) -> int:
    """Run `harness golden ...` / `harness precision ...` through their own parsers (independent of
    the other subcommands registered in harness.cli)."""
    import argparse

    from harness.cli import golden, precision

    parser = argparse.ArgumentParser(prog="harness")
    sub = parser.add_subparsers()
    golden.register(sub)
    precision.register(sub)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


def modules_dispatching(name: str, op: str, dtype: str = "bfloat16") -> set[str]:
    """Captured modules of the suite whose isolated call (the golden's inputs, the clean target in
    ``dtype``) dispatches ``op`` (``"aten.mm"``): where a fault in that kernel can be born."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from harness.golden.store import load_golden
    from harness.precision.isolate import replay
    from harness.precision.runner import build_target

    ls = suite(name)
    g = load_golden(ls, GOLDEN)
    model, _ = build_target(ls, get("cpu"), dtype, None, g)
    hit: list[bool] = []

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if f"{func.namespace}.{func.overloadpacket.__name__}" == op:
                hit.append(True)
            return func(*args, **(kwargs or {}))

    out = set()
    for n in g.order:
        if n not in g.structures:
            continue
        hit.clear()
        with Seen():
            replay(model, g.structures, g.modules, g.module_inputs, getattr(torch, dtype), "cpu", [n])
        if hit:
            out.add(n)
    return out
