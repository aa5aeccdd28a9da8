"""Run the suite's model on a target backend/dtype over a golden's stored inputs and compare.

``transform`` (model -> model) and ``context`` (() -> context manager around the forward passes)
let tests and tools inject faults or fixes without touching the suite: the golden always comes
from the clean reference, the target starts from the same seeded weights.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from harness.golden.capture import capture_forward, greedy
from harness.golden.store import Golden
from harness.precision import tolerance
from harness.precision.compare import Comparison, compare_generation, compare_modules
from harness.suite.loader import LoadedSuite

Transform = Callable[[torch.nn.Module], torch.nn.Module]


@dataclass
class TargetRun:
    outputs: dict[str, torch.Tensor]
    generation: dict[str, torch.Tensor]
    notes: list[str]


def build_target(ls: LoadedSuite, backend, dtype: str, transform: Transform | None = None):
    from harness.models.build import build_model

    model, mc = build_model(ls, dtype, backend.device(), seed=ls.suite.checks.precision.seed)
    if transform is not None:
        model = transform(model)
    model.eval()
    return model, mc


def run_model(model, golden: Golden, ls: LoadedSuite, device, context=None, generate: bool = True) -> TargetRun:
    p = ls.suite.checks.precision
    ids = golden.inputs.to(device)
    ctx = context() if context is not None else contextlib.nullcontext()
    with ctx:
        outs = capture_forward(model, ids, p.capture)
        n = golden.generation["tokens"].shape[1] if generate and golden.generation else 0
        gen = greedy(model, ids, n) if n else {}
    return TargetRun(outs, gen, [])


def compare_run(golden: Golden, run: TargetRun, tol: dict) -> Comparison:
    res = compare_modules(golden, run.outputs, tol)
    if run.generation:
        compare_generation(golden, run.generation, tol, res)
    return res


def tolerances_for(ls: LoadedSuite, backend, dtype: str) -> tuple[dict, dict]:
    return tolerance.resolve(ls.suite.checks.precision, backend.name, backend.device_name(), dtype)


def check_against_golden(ls: LoadedSuite, golden: Golden, backend, dtype: str, *, transform: Transform | None = None,
                         context=None, tol: dict | None = None) -> tuple[Comparison, dict, TargetRun]:
    tol = tol or tolerances_for(ls, backend, dtype)[0]
    model, mc = build_target(ls, backend, dtype, transform)
    run = run_model(model, golden, ls, backend.device(), context)
    run.notes = list(mc.notes)
    return compare_run(golden, run, tol), tol, run
