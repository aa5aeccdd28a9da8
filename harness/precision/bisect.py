"""Precision bisection: which modules (or aten ops) must run in higher precision, or on the
reference, for the target's output to come back within tolerance?

* module mode: each candidate module (the captured ones, leaves first) is substituted by the same
  module run in float32 on the target (``with_="float32"``: the "higher precision for critical
  layers" fix) or by the reference model's module on the reference backend/dtype
  (``with_="reference"``: it also fixes a wrong kernel or wrong code in that module);
* op mode (forced fallback): named aten ops are intercepted with a TorchDispatchMode and computed on
  the CPU in float64 from copies of their inputs, then cast back; the op whose fallback restores the
  output is the op whose kernel is wrong.

A set passes when every captured module output is within tolerance (generation is not rerun).
The search finds a small sufficient set by repeated binary search over prefixes (QuickXplain-like):
each step finds the shortest prefix of the remaining candidates that, with the modules already
kept, passes; its last element is necessary.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from harness.anatomy.capture import selected_modules
from harness.golden.store import Golden
from harness.precision.runner import Transform, build_target, compare_run, run_model, tolerances_for
from harness.suite.loader import LoadedSuite


@dataclass
class BisectResult:
    mode: str  # "module" or "op"
    found: list[str] | None  # None: even all candidates together do not fix it
    candidates: list[str]
    baseline_ok: bool
    tests: int = 0
    log: list[str] = field(default_factory=list)


def minimal_set(cands: Sequence[str], test: Callable[[list[str]], bool]) -> list[str] | None:
    if not test(list(cands)):
        return None
    needed: list[str] = []
    remaining = list(cands)
    while not test(needed):
        lo, hi = 1, len(remaining)
        while lo < hi:
            mid = (lo + hi) // 2
            if test(needed + remaining[:mid]):
                hi = mid
            else:
                lo = mid + 1
        needed.append(remaining[lo - 1])
        remaining = remaining[: lo - 1]
    return needed


def _convert(obj, dtype=None, device=None):
    def f(t):
        if not isinstance(t, torch.Tensor):
            return t
        return t.to(device=device or t.device, dtype=dtype if (dtype is not None and t.is_floating_point()) else t.dtype)
    return tree_map(f, obj)


def _first_float_dtype(obj):
    found = []

    def f(t):
        if isinstance(t, torch.Tensor) and t.is_floating_point() and not found:
            found.append(t.dtype)
        return t
    tree_map(f, obj)
    return found[0] if found else None


def substitute(module: torch.nn.Module, impl: torch.nn.Module, dtype: torch.dtype, device) -> None:
    """Make ``module`` compute with ``impl`` (inputs converted to dtype/device, outputs back to the
    dtype of the first float input, or of the module's own weights when it has none: embeddings)."""
    own = next((p.dtype for p in module.parameters() if p.is_floating_point()), None)

    def forward(*args, **kwargs):
        back = _first_float_dtype((args, kwargs)) or own
        home = next((t.device for t in args if isinstance(t, torch.Tensor)), None)
        a, k = _convert((args, kwargs), dtype, device)
        with torch.no_grad():
            out = impl(*a, **k)
        return _convert(out, back, home)
    module.forward = forward


def _candidates(model, patterns, leaves_only: bool) -> list[str]:
    names = [n for n, _ in selected_modules(model, patterns)]
    names += [n for n, _ in model.named_modules() if n == "lm_head"]
    if leaves_only:
        names = [n for n in names if not any(o.startswith(n + ".") for o in names)]
    return names


def bisect_modules(ls: LoadedSuite, golden: Golden, backend, dtype: str, *, with_: str = "reference",
                   transform: Transform | None = None, context=None, candidates: list[str] | None = None
                   ) -> BisectResult:
    from harness.models.build import build_model
    from harness.precision.generate import parse_reference

    tol = tolerances_for(ls, backend, dtype)[0]
    p = ls.suite.checks.precision
    dev = backend.device()
    ref_mods = None
    if with_ == "reference":
        rb, rd = parse_reference(p.reference)
        from harness.backends import get

        rbe = get(rb)
        ref_model, _ = build_model(ls, rd, rbe.device(), seed=p.seed)
        from harness.models import numerics

        numerics.apply(ref_model, golden.manifest.get("numerics"))  # the golden's realistic gains
        ref_model.eval()
        ref_mods, ref_dtype, ref_dev = dict(ref_model.named_modules()), getattr(torch, rd), rbe.device()
    elif with_ != "float32":
        raise ValueError(f"with_ must be 'reference' or 'float32', got {with_!r}")

    probe, _ = build_target(ls, backend, dtype, transform, golden)
    res = BisectResult("module", None, [], False)

    def test(subset: list[str]) -> bool:
        model, _ = build_target(ls, backend, dtype, transform, golden)
        mods = dict(model.named_modules())
        for n in subset:
            if with_ == "reference":
                substitute(mods[n], ref_mods[n], ref_dtype, ref_dev)
            else:
                substitute(mods[n], copy.deepcopy(mods[n]).float(), torch.float32, dev)
        ok = compare_run(golden, run_model(model, golden, ls, dev, context, generate=False), tol).ok
        res.tests += 1
        res.log.append(f"{'pass' if ok else 'fail'}  {len(subset)} module(s): {', '.join(subset[-3:])}")
        return ok

    res.baseline_ok = test([])
    if res.baseline_ok:
        return res
    for leaves in (True, False):
        res.candidates = candidates or _candidates(probe, p.capture, leaves)
        res.found = minimal_set(res.candidates, test)
        if res.found is not None or candidates:
            break
    return res


# --- op level: forced fallback -----------------------------------------------------------------


def op_name(func) -> str:
    return f"{func.namespace}.{func.overloadpacket.__name__}" if hasattr(func, "namespace") else str(func)


class ForcedFallback(TorchDispatchMode):
    """Runs the named aten ops (``aten.mm``, ``aten._softmax``...) on the CPU in float64 instead of
    the backend's kernel, casting results back to what the kernel would have returned. Records
    every op it sees in ``seen`` (first-use order)."""

    def __init__(self, ops: set[str] | None = None, ref_dtype: torch.dtype = torch.float64):
        super().__init__()
        self.ops = set(ops or ())
        self.ref_dtype = ref_dtype
        self.seen: Counter[str] = Counter()
        self.fallbacks = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = op_name(func)
        self.seen[name] += 1
        out = func(*args, **kwargs)
        if name not in self.ops or func._schema.is_mutable or not _float_out(out):
            return out
        a, k = _convert((args, kwargs), self.ref_dtype, torch.device("cpu"))
        ref = func(*a, **k)
        self.fallbacks += 1
        return _cast_like(ref, out)


def _float_out(out) -> bool:
    return _first_float_dtype(out) is not None


def _cast_like(ref, like):
    if isinstance(like, torch.Tensor):
        return ref.to(device=like.device, dtype=like.dtype) if isinstance(ref, torch.Tensor) else like
    if isinstance(like, (tuple, list)):
        return type(like)(_cast_like(r, x) for r, x in zip(ref, like, strict=True))
    return like


FALLBACK_SKIP = {"aten._to_copy", "aten.clone", "aten.copy", "aten.lift_fresh", "aten.detach", "aten.empty",
                 "aten.zeros", "aten.ones", "aten.full", "aten.arange", "aten.scalar_tensor", "aten.empty_like",
                 "aten.zeros_like", "aten.ones_like", "aten.full_like", "aten.new_empty", "aten.new_zeros",
                 "aten.new_ones", "aten.new_full", "aten._local_scalar_dense", "aten.embedding"}


def bisect_ops(ls: LoadedSuite, golden: Golden, backend, dtype: str, *, transform: Transform | None = None,
               context=None, ops: list[str] | None = None) -> BisectResult:
    import contextlib

    tol = tolerances_for(ls, backend, dtype)[0]
    dev = backend.device()
    model, _ = build_target(ls, backend, dtype, transform, golden)
    res = BisectResult("op", None, [], False)

    def run(fallback: set[str]):
        mode = ForcedFallback(fallback)
        outer = context() if context is not None else contextlib.nullcontext()
        with outer, mode:
            r = run_model(model, golden, ls, dev, None, generate=False)
        return compare_run(golden, r, tol).ok, mode

    res.baseline_ok, trace = run(set())
    res.tests += 1
    if res.baseline_ok:
        return res
    res.candidates = ops or [o for o in trace.seen if o not in FALLBACK_SKIP and not o.startswith("prim.")]

    def test(subset: list[str]) -> bool:
        ok, _ = run(set(subset))
        res.tests += 1
        res.log.append(f"{'pass' if ok else 'fail'}  fallback for {len(subset)} op(s): {', '.join(subset[-3:])}")
        return ok

    res.found = minimal_set(res.candidates, test)
    return res
