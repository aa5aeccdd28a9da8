"""The recompile sweep (the compile check's ``recompiles`` step): the model compiled once and run at
the golden's prompt length, the suite's other prompt lengths and a decode-like step, counting the
frames dynamo recompiles (``dynamo.sweep``).

The sweep backend is a shortcut, not the compiler under test: its own failure at a shape (measured:
Nemotron-3-Nano's decode step at batch 2 raises a view error in aot_eager, the default before, and
runs eagerly and under inductor) is no verdict. The sweep is rerun with dynamo's "eager" backend
(guards and recompiles are dynamo's; no compile cost), then with the check's compiler (inductor's
dynamic-shape rebuilds: 100 s there); only the compiler under test raising is a failure, naming the
shape.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from harness.compiler import dynamo as dyn


@dataclass
class SweepResult:
    recompiled: list[dyn.Recompile]
    seconds: dict[str, float]  # shape label -> wall seconds of its call
    kw: dict  # the compile options the sweep ran with (its backend: the one that ran every shape)
    fell: list[tuple[str, dyn.SweepError]] = field(default_factory=list)  # (backend, its error) of those that raised


class CompilerRaised(Exception):
    """The compiler under test raised at a shape (``error``); ``fell``: the sweep backends that raised before."""

    def __init__(self, error: dyn.SweepError, fell: list[tuple[str, dyn.SweepError]]):
        super().__init__(str(error))
        self.error, self.fell = error, fell


def shapes(seq: int, prompt_lens: list[int], decode_step: bool, decode_label: str) -> list[tuple[str, int]]:
    """(label, length) of each call: the golden's prompt first (it compiles), the other lengths, the decode step."""
    out = [(f"golden prompt (length {seq})", seq)] + [(f"prompt length {n}", n) for n in prompt_lens]
    if decode_step:
        out.append((decode_label, 1))
    return out


def ids_maker(ids: torch.Tensor, vocab: int) -> Callable[[int], torch.Tensor]:
    """n -> input ids of length n: a prefix of the golden's, else seeded random ids in its vocabulary
    (one generator across the sweep and its reruns)."""
    seq = ids.shape[1]
    gen = torch.Generator().manual_seed(0)

    def ids_of(n: int) -> torch.Tensor:
        if n <= seq:
            return ids[:, :n]
        return torch.randint(0, vocab, (ids.shape[0], n), generator=gen).to(ids.device)

    return ids_of


def first_kw(compile_kw: dict, sweep_backend: str, compiler: str) -> dict:
    """The sweep's compile options: the sweep backend's (compiler's mode dropped), else the compiler's."""
    kw = dict(compile_kw, backend=sweep_backend or compiler)
    if sweep_backend:
        kw["mode"] = None
    return kw


def fallback_kw(compile_kw: dict, backend: str, compiler: str) -> dict:
    """The compile options of a rerun with ``backend``: the check's own for its compiler, else mode dropped."""
    return dict(compile_kw) if backend == compiler else dict(compile_kw, backend=backend, mode=None)


def run(model: torch.nn.Module, forward: Callable, ids_of: Callable[[int], torch.Tensor],
        calls: list[tuple[str, int]], kw: dict) -> tuple[list[dyn.Recompile], dict[str, float]]:
    """One sweep: ``model`` compiled with ``kw`` in a fresh dynamo, ``forward(compiled, ids)`` per shape."""
    with dyn.fresh():
        compiled = dyn.compile_module(model, **kw)
        return dyn.sweep([(label, lambda n=n: forward(compiled, ids_of(n))) for label, n in calls])


def sweep_with_fallback(model: torch.nn.Module, forward: Callable, ids_of: Callable[[int], torch.Tensor],
                        calls: list[tuple[str, int]], kw: dict, compile_kw: dict, compiler: str) -> SweepResult:
    """The sweep with ``kw``; where its backend raises, rerun with dynamo's eager, then with ``compiler``.
    ``CompilerRaised`` where the compiler under test raises."""
    fell = []
    for backend in dict.fromkeys([kw["backend"], "eager", compiler]):
        if backend != kw["backend"]:
            kw = fallback_kw(compile_kw, backend, compiler)
        try:
            recompiled, seconds = run(model, forward, ids_of, calls, kw)
            return SweepResult(recompiled, seconds, kw, fell)
        except dyn.SweepError as e:
            if backend == compiler:
                raise CompilerRaised(e, fell) from e
            fell.append((backend, e))
    raise AssertionError("unreachable: the compiler under test is the last backend tried")


def fallback_text(fell: list[tuple[str, dyn.SweepError]]) -> str:
    return "; ".join(f"{b} raised at the {x}" for b, x in fell)


def timings(res: SweepResult, dynamic: bool | None) -> str:
    """The sweep's backend and each shape's seconds (the check's detail)."""
    return f"{res.kw['backend']} (dynamic={dynamic}): " + ", ".join(f"{label} {s:.2f} s" for label, s in res.seconds.items())


def over_expected(recompiled: list[dyn.Recompile], want: int, dynamic: bool | None, decode: str) -> tuple[str, dict]:
    """More recompiles than committed: the failure's message and fields, naming the new one (the first
    guard of the model's own, else the first over the expectation)."""
    new = next(iter(dyn.unexplained(recompiled, dynamic, decode)), recompiled[want])
    n = len(recompiled)
    return (f"{n} recompile(s), {want} expected: the {new.shape} recompiled {new.frame}: {new.reason}",
            dict(metric="compile_recompiles", expected=f"<= {want}", observed=n,
                 details="recompiles (dynamo's guard failures):\n" + "\n".join(f"  {r}" for r in recompiled)))
