"""``torch.compile`` of a model and what dynamo reports about it: graph breaks and recompiles.

Everything here reads dynamo's own records, nothing is inferred:

* graph breaks: ``torch._dynamo.utils.counters["graph_break"]`` (reason -> count, filled by every
  compile, whatever the backend) counts them; ``torch._dynamo.explain`` gives each break's reason
  with the user stack where it happened (:func:`explain_breaks`, used when a count is over its
  expectation: it traces the model once more, ~1-5 s);
* recompiles: ``torch._dynamo.utils.get_compilation_metrics()``, one record per frame compile,
  whose ``recompile_reason`` is dynamo's guard-failure reason (the text ``TORCH_LOGS=recompiles``
  prints) for every compile of a frame that already had a cache entry.

Dynamo's caches are process-wide: :func:`fresh` resets them around one item, so that guards on a
previous item's model are never counted as this one's recompiles.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

DEFAULT = "inductor"
NONE = "none"  # a harness backend's declaration that it has no torch.compile backend


def usable(name: str, device_type: str) -> tuple[bool, str]:
    """(usable, why) for the torch.compile backend ``name`` on ``device_type``."""
    import torch._dynamo

    if name == NONE:
        return False, "the backend declares no compiler (compile_backend = 'none')"
    known = torch._dynamo.list_backends(exclude_tags=())
    if name not in known:
        return False, f"no torch.compile backend {name!r} is registered (registered: {', '.join(sorted(known))})"
    if name != "inductor":
        return True, f"torch.compile backend {name!r}"
    if device_type == "cpu":
        from torch._inductor import cpp_builder

        try:
            cxx = cpp_builder.get_cpp_compiler()
        except Exception as e:  # no compiler on PATH, or one inductor cannot use
            return False, f"inductor's C++ code generation needs a C++ compiler: {type(e).__name__}: {e}"
        return True, f"inductor (C++ code generation, {cxx})"
    from torch._inductor.codegen.common import get_scheduling_for_device, init_backend_registration

    init_backend_registration()
    if get_scheduling_for_device(device_type) is None:
        return False, f"inductor has no code generator registered for device type {device_type!r}"
    if device_type in ("cuda", "xpu"):
        from torch.utils._triton import has_triton

        if not has_triton():
            return False, f"inductor on {device_type} generates Triton kernels, and triton is not installed"
    return True, f"inductor ({device_type})"


# The compiler's front end, run without its code generation: what a commit run of a suite whose code
# generation is nightly compiles with (the compile check's ``frontend`` variant). For inductor it is
# PyTorch's own debugging backend for telling front-end faults from code generation: dynamo's graph,
# AOTAutograd's joint graph and partition, inductor's decomposition table, the FX graphs then run
# eagerly. A cold inductor compile of DeepSeek-V4-Flash's pruned model (5 layers, float32, 2-core
# CPU): forward 73 s, forward + backward 145 s; this front end: 9.5 s and 18 s (no C++ code generation).
FRONTENDS = {"inductor": "aot_eager_decomp_partition"}
GENERIC_FRONTEND = "aot_eager"  # another compiler's front end: dynamo + AOTAutograd (its own decompositions unknown)


def frontend(name: str) -> tuple[str | None, str]:
    """(the dynamo backend that runs ``name``'s front end, why) - None where there is no compiler (a
    backend that declares none, a name nobody registered)."""
    import torch._dynamo

    if name == NONE:
        return None, "the backend declares no compiler (compile_backend = 'none')"
    known = torch._dynamo.list_backends(exclude_tags=())
    if name not in known and name not in FRONTENDS:
        return None, f"no torch.compile backend {name!r} is registered (registered: {', '.join(sorted(known))})"
    fe = FRONTENDS.get(name, GENERIC_FRONTEND)
    what = f"{name}'s decompositions" if name in FRONTENDS else "no compiler-specific decompositions"
    return fe, f"front end of {name}: dynamo, AOTAutograd (forward and backward graphs), {what}; no code generation"


def compile_module(module: torch.nn.Module, backend: str, mode: str | None, dynamic: bool | None):
    """``torch.compile(module, ...)``; ``mode`` only when set (a backend other than inductor may not take one)."""
    kw = {"mode": mode} if mode else {}
    return torch.compile(module, backend=backend, dynamic=dynamic, **kw)


@contextlib.contextmanager
def fresh() -> Iterator[None]:
    """Dynamo's caches and compilation records empty before the block, and again after it."""
    import torch._dynamo
    from torch._dynamo.utils import clear_compilation_metrics

    torch._dynamo.reset()
    clear_compilation_metrics()
    try:
        yield
    finally:
        torch._dynamo.reset()
        clear_compilation_metrics()


# --- graph breaks ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Break:
    reason: str  # dynamo's first line ("Unsupported Tensor.item() call with capture_scalar_outputs=False")
    where: str = ""  # the innermost user frame: "file:line in function"

    def __str__(self) -> str:
        return f"{self.reason} at {self.where}" if self.where else self.reason


def first(text: str) -> str:
    return (text.strip().splitlines() or [""])[0].strip()


def break_counter() -> Counter:
    """Dynamo's graph-break counter now, by first line of the reason."""
    from torch._dynamo.utils import counters

    out: Counter = Counter()
    for reason, n in counters["graph_break"].items():
        out[first(reason)] += n
    return out


def break_reasons() -> Counter:
    """Dynamo's graph-break counter now, by whole reason (it names the function a break skips)."""
    from torch._dynamo.utils import counters

    return Counter(counters["graph_break"])


def unique_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def user_frame(stack) -> str:
    """The innermost frame of a break's user stack that is not torch's own (module call plumbing)."""
    frames = [f for f in stack or [] if not f.filename.startswith(_TORCH_DIR)] or list(stack or [])
    if not frames:
        return ""
    from harness.messages import display

    f = frames[-1]
    return f"{display(f.filename)}:{f.lineno} in {f.name}"


def explain_breaks(module: torch.nn.Module, kwargs: dict) -> list[Break]:
    """Every graph break of one call of ``module(**kwargs)`` with its reason and user frame, from
    ``torch._dynamo.explain`` (which resets dynamo's caches first)."""
    import torch._dynamo

    out = torch._dynamo.explain(module)(**kwargs)
    return [Break(first(r.reason), user_frame(r.user_stack)) for r in out.break_reasons]


# --- recompiles --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Recompile:
    shape: str  # the call that recompiled ("prompt length 8", "decode step (length 1)")
    frame: str  # "function (file:line)" of the recompiled frame
    reason: str  # dynamo's guard-failure reason

    def __str__(self) -> str:
        return f"{self.shape}: {self.frame} recompiled: {self.reason}"



def unexplained(recompiles: list[Recompile], dynamic: bool | None, decode: str) -> list[Recompile]:
    """The recompiles that dynamo's own shape handling does not explain: with ``dynamic=False`` every
    new shape recompiles; with automatic dynamic shapes (None) a frame's first recompile makes the
    changed size dynamic; a dynamic size seen as 1 (the ``decode`` call) recompiles for the 0/1
    specialisation. What is left is a guard of the model's own (a Python branch on a size, ...)."""
    if dynamic is False:
        return []
    out, seen = [], set()
    for r in recompiles:
        first_of_frame = r.frame not in seen
        seen.add(r.frame)
        if r.shape == decode or (dynamic is None and first_of_frame):
            continue
        out.append(r)
    return out


class SweepError(Exception):
    """A call of the sweep raised: ``label`` names the shape, ``error`` is what it raised."""

    def __init__(self, label: str, error: BaseException):
        super().__init__(f"{label}: {type(error).__name__}: {first(str(error))}")
        self.label, self.error = label, error


def sweep(calls: list[tuple[str, Callable[[], object]]]) -> tuple[list[Recompile], dict[str, float]]:
    """Run each ``(label, call)`` in order (the first compiles); the recompiles each call caused, and
    the wall seconds of each call (its compile included). A call that raises: ``SweepError`` naming it."""
    from torch._dynamo.utils import get_compilation_metrics

    seen = {id(r) for r in get_compilation_metrics()}
    out, seconds = [], {}
    for label, call in calls:
        t = time.perf_counter()
        try:
            call()
        except Exception as e:  # noqa: BLE001 - the compiled model's own error, reported with its shape
            raise SweepError(label, e) from e
        seconds[label] = time.perf_counter() - t
        for r in get_compilation_metrics():
            if id(r) in seen:
                continue
            seen.add(id(r))
            if r.recompile_reason:
                where = f"{r.co_name} ({os.path.basename(r.co_filename or '')}:{r.co_firstlineno})"
                out.append(Recompile(label, where, first(r.recompile_reason)))
    return out, seconds


def can_emulate_precision(backend: str) -> bool:
    """Whether the compiler has inductor's ``emulate_precision_casts`` (inductor itself)."""
    return backend == "inductor"


def emulated_precision():
    """Inductor compiling with the low-precision roundings eager does between ops (a context)."""
    import torch._inductor.config as inductor_config

    return inductor_config.patch(emulate_precision_casts=True)


def breaks_over_expected(module: torch.nn.Module, kwargs: dict, breaks: Counter, want: int) -> tuple[list[str], str, dict]:
    """More graph breaks than committed: each break's reason and user frame (``explain_breaks``: it
    traces the forward again and resets dynamo), and the failure's message and fields."""
    located = explain_breaks(module, kwargs)
    lines = [str(b) for b in located] or [f"{n} x {r}" for r, n in breaks.most_common()]
    new = located[0] if located else Break(next(iter(breaks)))
    n = sum(breaks.values())
    return lines, f"{n} graph break(s), {want} expected: {new}", dict(
        metric="compile_graph_breaks", expected=f"<= {want}", observed=n,
        details="graph breaks (torch._dynamo.explain):\n" + "\n".join(f"  {x}" for x in lines))
