"""Op conformance check (``ops``): one item per aten overload the pruned model executes.

Variants come from the op inventory of the pruned model (a real CPU trace of one forward + backward
per suite dtype, cached on disk: see :func:`harness.inspect.trace.suite_op_names`), so items read
``ops[cpu-float32-aten.mm.default]`` and shard and report like every other check.

The trace applies the suite's realistic-numerics gains (:func:`harness.inspect.trace.trace_numerics`:
the committed golden's when one exists for this config, else calibrated the same way; detail
``numerics`` says which), so the model's own op inputs have trained-model-like scales: attention
logits with std ~3 (the temperature is SDPA's ``scale`` argument, e.g. 16.3 instead of 0.25 in
llama-3.1-8b), not the near-uniform attention of the bare std-0.02 initialisation.
``[checks.ops] realistic = false`` gives the bare trace and the generic kinds only.

Each item:

1. classifies the op for the backend (:mod:`harness.inspect.coverage`). A ``missing`` op fails
   with the op, the reason and the modules that need it; one listed under the suite's
   ``known_gaps.<backend>`` is an expected failure (tracked, not silent);
2. runs the op on the backend with the inputs the model itself passed it (its own shapes, dtypes
   and values: the pruned model *is* the scaled-down shape) and compares with a CPU float64
   reference (the same op, floating inputs upcast; ops without a float64 CPU kernel, such as
   ``_grouped_mm``, fall back to the CPU in the run dtype, noted);
3. lets hypothesis vary the floating inputs and compares again: the generic kinds (zeros, large
   magnitudes, negatives, denormals, normal values) and, drawn from each input's captured statistics,
   ``observed`` (normal values at the tensor's own RMS) and ``outliers`` (the same plus a few outlier
   channels along the last dimension, 1 in 32, at the larger of the observed absmax and 20x the RMS,
   as the outlier features of trained LLM activations). Each sample is run once with every input
   ``observed`` and once with every input ``outliers`` (explicit examples), then on
   ``[checks.ops] examples`` draws from all kinds, derandomized so that every backend sees the same
   values. Detail ``input_kinds`` counts the cases per kind.

Error: ``max |out - ref| / max(max |ref|, 1)`` with non-finite values required at the same places.
It must be within ``[checks.ops] tolerance[dtype]``, or no worse than twice the CPU's own error in
the same dtype (so that a backend is not blamed for what the dtype itself cannot represent).
Integer outputs must match exactly (except the indices of sort/topk, where ties are legal);
uninitialized or random outputs (``empty*``, ``new_empty*``) are compared by shape and dtype only.
"""

from __future__ import annotations

import math
from collections import Counter

import torch
from pydantic import Field
from torch.utils._pytree import tree_flatten, tree_map

from harness import metrics
from harness.checks import (
    Check,
    CheckConfig,
    CheckContext,
    CheckFailure,
    CheckRegistry,
    KnownGap,
    NotApplicable,
)

metrics.declare("op_max_rel_error", "", "lower", "worst max|out-ref|/max(|ref|,1) of an op over its inputs")
metrics.declare("op_cases", "", "none", "inputs an op was compared on (model's own + hypothesis examples)")

# Outputs that are uninitialized memory or random: shape and dtype only.
UNDEFINED_OUTPUT = ("aten.empty", "aten.empty_like", "aten.empty_strided", "aten.new_empty", "aten.new_empty_strided",
                    "aten.rand", "aten.randn", "aten.randint", "aten.bernoulli", "aten.native_dropout")
# Ops whose index outputs may legally differ at ties; and ops whose results are discrete functions of
# float inputs (bins, ranks) and so are only checked on the model's own inputs.
TIE_INDICES = ("aten.sort", "aten.topk", "aten.max", "aten.min", "aten.argsort", "aten.kthvalue", "aten.mode")
DISCRETE = TIE_INDICES + ("aten.histc", "aten.argmax", "aten.argmin", "aten.bucketize", "aten.searchsorted",
                          "aten.floor_divide", "aten.eq", "aten.ne", "aten.gt", "aten.lt", "aten.ge", "aten.le")
VALUE_KINDS = ("model", "zeros", "normal", "large", "negative", "denormal")
# Kinds drawn from the captured statistics of the model's own input (its RMS and absmax).
STAT_KINDS = ("observed", "outliers")
# LLM activations carry a few outlier feature channels far above the rest (LLM.int8(), Dettmers et
# al. 2022: up to 20x the other dimensions); "outliers" puts 1 channel in OUTLIER_EVERY there.
OUTLIER_RMS = 20.0
OUTLIER_EVERY = 32
MAX_VARIED_NUMEL = 1 << 21


class OpsConfig(CheckConfig):
    """Per-op conformance against CPU float64, one item per aten op of the pruned model."""

    enabled: bool = Field(
        False, description="Generate one conformance item per aten op of the pruned model (opt-in: the "
        "op inventory is traced once per suite and cached on disk).")
    examples: int = Field(6, ge=0, description="Hypothesis examples per op beyond the model's own inputs "
                          "(zeros, large magnitudes, negatives, denormals).")
    realistic: bool = Field(
        True, description="Trace the model with the suite's realistic-numerics gains (the golden's, else "
        "calibrated) and add input kinds drawn from each input's captured statistics (observed scale, "
        "outlier channels); false: the bare initialisation and the generic kinds only.")
    tolerance: dict[str, float] = Field(
        default_factory=lambda: {"float64": 1e-10, "float32": 1e-5, "bfloat16": 3e-2, "float16": 3e-3},
        description="Max |out - ref| / max(|ref|, 1) per dtype against the CPU float64 reference.")
    skip: list[str] = Field(default_factory=list, description="Ops not to generate items for (aten.x.overload).")


def _n_float(sample) -> int:
    return sum(1 for x in tree_flatten((sample.args, sample.kwargs))[0]
               if isinstance(x, torch.Tensor) and x.is_floating_point())


def _base(op: str) -> str:
    return op.rsplit(".", 1)[0]


def resolve_op(op: str):
    ns, name, overload = op.split(".", 2)
    return getattr(getattr(getattr(torch.ops, ns), name), overload)


def _to(x, device, float_dtype=None):
    if isinstance(x, torch.Tensor):
        dt = float_dtype if float_dtype is not None and x.is_floating_point() else x.dtype
        return x.detach().to(device=device, dtype=dt, copy=True)  # in-place ops must not touch the sample
    if isinstance(x, torch.device):
        return torch.device(device)
    return x


def _execute(func, args, kwargs, device, float_dtype=None):
    a, k = tree_map(lambda x: _to(x, device, float_dtype), (args, kwargs))
    out = func(*a, **k)
    return tree_map(lambda x: x.detach().cpu() if isinstance(x, torch.Tensor) else x, out)


def _error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max|out-ref| / max(max|ref|, 1) on a common float64 view; inf if non-finite patterns differ."""
    ref_c = ref.to(out.dtype).double() if out.is_floating_point() else ref.double()
    o = out.double()
    if o.shape != ref_c.shape:
        return math.inf
    fo, fr = torch.isfinite(o), torch.isfinite(ref_c)
    if not torch.equal(fo, fr):
        return math.inf
    nf = ~fr
    if nf.any() and not torch.equal(o[nf].nan_to_num(0.0), ref_c[nf].nan_to_num(0.0)):  # inf signs, nan places
        return math.inf
    if not fr.any():
        return 0.0
    scale = max(ref_c[fr].abs().max().item(), 1.0)
    return (o[fr] - ref_c[fr]).abs().max().item() / scale


class _Mismatch(Exception):
    pass


def compare_outputs(op: str, out, ref) -> float:
    """Worst float error; raises _Mismatch for structural/integer differences."""
    fo, _ = tree_flatten(out)
    fr, _ = tree_flatten(ref)
    if len(fo) != len(fr):
        raise _Mismatch(f"{len(fo)} outputs vs {len(fr)} in the reference")
    worst = 0.0
    undefined = _base(op) in UNDEFINED_OUTPUT
    for i, (o, r) in enumerate(zip(fo, fr, strict=True)):
        if not isinstance(o, torch.Tensor):
            if isinstance(o, (int, float, bool)) and o != r and not (isinstance(o, float) and math.isclose(o, r)):
                raise _Mismatch(f"output {i}: {o!r} vs reference {r!r}")
            continue
        if tuple(o.shape) != tuple(r.shape):
            raise _Mismatch(f"output {i}: shape {tuple(o.shape)} vs reference {tuple(r.shape)}")
        if undefined:
            continue
        if o.is_floating_point() or o.is_complex():
            worst = max(worst, _error(o, r))
        elif _base(op) in TIE_INDICES:
            continue
        elif not torch.equal(o, r.to(o.dtype)):
            n = (o != r.to(o.dtype)).sum().item()
            raise _Mismatch(f"output {i} ({o.dtype}): {n} of {o.numel()} elements differ from the reference")
    return worst


def observed_scale(t: torch.Tensor) -> tuple[float, float]:
    """(rms, absmax) of the tensor's finite values (masks hold -inf); (0, 0) if there are none."""
    x = t.detach().double()
    x = x[torch.isfinite(x)]
    if not x.numel():
        return 0.0, 0.0
    return x.pow(2).mean().sqrt().item(), x.abs().max().item()


def _vary(t: torch.Tensor, kind: str, seed: int) -> torch.Tensor:
    if kind == "model" or not t.is_floating_point():
        return t
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(t.shape, generator=g, dtype=torch.float64)
    fi = torch.finfo(t.dtype)
    if kind in STAT_KINDS:
        rms, absmax = observed_scale(t)  # t: the model's own value of this input
        v = base * rms
        if kind == "outliers" and v.numel():
            peak = min(max(absmax, OUTLIER_RMS * rms), fi.max / 4)
            if v.dim() == 0:
                v = v.new_tensor(peak)
            else:
                n = v.shape[-1]
                ch = torch.randperm(n, generator=g)[:max(1, n // OUTLIER_EVERY)]  # [c] channels
                sign = torch.randint(0, 2, (*v.shape[:-1], len(ch)), generator=g, dtype=torch.float64) * 2 - 1
                v[..., ch] = sign * peak
    elif kind == "zeros":
        v = torch.zeros_like(base)
    elif kind == "normal":
        v = base
    elif kind == "large":
        v = base * (1e2 if fi.max < 1e5 else 1e3)
    elif kind == "negative":
        v = -base.abs()
    else:  # denormal: below the smallest normal, above zero
        v = torch.rand(t.shape, generator=g, dtype=torch.float64) * fi.smallest_normal
    v = v.to(t.dtype)
    try:  # keep the model's memory layout (transposed views reach other kernels)
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype).copy_(v)
    except RuntimeError:
        return v


class OpsCheck(Check):
    cpu_threads = 1  # the pruned test models: one intra-op thread (harness.models.build.cpu_threads)
    name = "ops"
    order = 40
    config_model = OpsConfig
    headline = ("op_max_rel_error", "op_cases")  # `harness run`'s table
    steps = ("inventory", "coverage", "model_inputs", "varied_inputs", "record")
    setup_steps = ("inventory",)

    def variants(self, suite, backend) -> list[str | None]:
        from harness.inspect.trace import suite_op_names

        names = suite_op_names(suite, list(suite.suite.dtypes), realistic=suite.suite.checks.ops.realistic)
        skip = set(suite.suite.checks.ops.skip)
        return sorted({op for ops in names.values() for op in ops} - skip)

    def new_state(self, ctx: CheckContext):
        from types import SimpleNamespace

        return SimpleNamespace(worst=0.0, cases=0, notes=set(), kinds=Counter())

    def inventory(self, ctx: CheckContext, st) -> None:
        """The op's recorded calls in the pruned model (real CPU trace, cached on disk)."""
        from harness.inspect.trace import real_inventory

        st.op, st.cfg = ctx.variant, ctx.config
        if not st.op:
            raise CheckFailure("the ops check needs an op variant (ops[<backend>-<dtype>-aten.x.overload])")
        inv = real_inventory(ctx.suite, ctx.dtype, realistic=st.cfg.realistic)
        st.samples = inv.samples.get(st.op, [])
        if inv.ops.get(st.op) is None:
            raise NotApplicable(f"{st.op} is not executed by the model in {ctx.dtype}")
        st.modules = inv.modules_of(st.op)
        ctx.detail("modules", "; ".join(st.modules))
        ctx.detail("numerics", inv.meta.get("numerics", {}).get("detail", "bare initialisation"))
        scales = []
        for sample in st.samples:  # what the stat kinds are drawn from
            ts = [x for x in tree_flatten((sample.args, sample.kwargs))[0]
                  if isinstance(x, torch.Tensor) and x.is_floating_point()]
            scales.append(", ".join("rms {:.3g} absmax {:.3g}".format(*observed_scale(t)) for t in ts))
        if any(scales):
            ctx.detail("input_scale", "; ".join(f"[{s}]" for s in scales))

    def coverage(self, ctx: CheckContext, st) -> None:
        """Does the backend have a kernel? Missing fails (or is a declared known gap)."""
        from harness.inspect.coverage import (
            MISSING,
            backend_source,
            backend_version,
            classify_op,
            known_gap,
            shipped_op_list,
        )

        op, be = st.op, ctx.backend
        key, oplist, source = backend_source(be.name)
        status, how = classify_op(op, dispatch_key=key, op_list=oplist)
        ctx.detail("coverage", f"{status} ({how}; {source})")
        shipped = shipped_op_list(be.name) if key is not None else None
        if shipped is not None:
            # real dispatch against the op list the backend ships (what machines without it read)
            listed, _ = classify_op(op, op_list=shipped)
            ctx.detail("coverage_op_list", f"{listed} ({shipped.describe()})")
            if listed != status:
                ctx.notes.append(f"the shipped op list {shipped.path.name if shipped.path else ''} says {listed}, the "
                                 f"dispatcher {status}: regenerate it (harness oplist update --backend {be.name} "
                                 "--from dispatcher)")
        if status == MISSING:
            msg = (f"{op} is missing on backend {be.name}: {how} [{source}]; "
                   f"needed by {len(st.modules)} module(s): {', '.join(st.modules)}")
            if known_gap(ctx.suite, be.name, op, backend_version(be.name, oplist)):  # version-aware entries
                raise KnownGap(f"known gap (suite known_gaps.{be.name}): {msg}")
            raise CheckFailure(msg, metric="op_status", expected="native, composite or cpu-fallback",
                               observed=MISSING, details="modules:\n  " + "\n  ".join(st.modules))
        st.func = resolve_op(op)
        st.tol = st.cfg.tolerance.get(ctx.dtype, 1e-5)
        ctx.tolerance("op_max_rel_error", st.tol)

    def model_inputs(self, ctx: CheckContext, st) -> None:
        """The op on the inputs the model itself passed it (its own shapes, dtypes and values)."""
        for sample in st.samples:
            n = _n_float(sample)
            self._case(ctx, st, sample, ("model",) * n, (0,) * n)

    def varied_inputs(self, ctx: CheckContext, st) -> None:
        """hypothesis varies the floating inputs (zeros, large, negative, denormal, normal)."""
        for sample in st.samples:
            n_float = _n_float(sample)
            numel = sum(x.numel() for x in tree_flatten((sample.args, sample.kwargs))[0]
                        if isinstance(x, torch.Tensor))
            if not n_float or not st.cfg.examples or _base(st.op) in DISCRETE or numel > MAX_VARIED_NUMEL:
                continue
            self._hypothesis(lambda s, k, seeds: self._case(ctx, st, s, k, seeds), sample, n_float,
                             st.cfg.examples, st.cfg.realistic)

    def record(self, ctx: CheckContext, st) -> None:
        ctx.metric("op_max_rel_error", st.worst)
        ctx.metric("op_cases", st.cases)
        if st.kinds:
            ctx.detail("input_kinds", ", ".join(f"{k} {st.kinds[k]}" for k in VALUE_KINDS + STAT_KINDS
                                                if st.kinds[k]))
        ctx.notes.extend(sorted(st.notes))

    def _case(self, ctx: CheckContext, st, sample, kinds: tuple[str, ...], seeds: tuple[int, ...]) -> None:
        op, func, tol, dev, be = st.op, st.func, st.tol, ctx.device, ctx.backend
        it = iter(zip(kinds, seeds, strict=False))

        def vary(x):
            if isinstance(x, torch.Tensor) and x.is_floating_point():
                k, s = next(it, ("model", 0))
                return _vary(x, k, s)
            return x

        args, kwargs = tree_map(vary, (sample.args, sample.kwargs))
        label = f"inputs {sample.signature}" + (f" with values {list(kinds)}" if any(
            k != "model" for k in kinds) else " (the model's own values)")
        try:
            out = _execute(func, args, kwargs, dev)
        except Exception as e:
            raise CheckFailure(f"{op} raised on {be.name} for {label}: {type(e).__name__}: "
                               f"{str(e).splitlines()[0][:300] if str(e) else ''}", metric="op_runs",
                               expected="runs", observed="raises",
                               details="modules:\n  " + "\n  ".join(st.modules)) from None
        try:
            ref = _execute(func, args, kwargs, "cpu", torch.float64)
            ref_name = "cpu float64"
        except Exception as e:
            ref = _execute(func, args, kwargs, "cpu")
            ref_name = f"cpu {ctx.dtype}"
            st.notes.add(f"{op}: no float64 CPU reference ({type(e).__name__}); compared with cpu {ctx.dtype}")
        try:
            err = compare_outputs(op, out, ref)
            if err > tol and ref_name == "cpu float64":  # no worse than the dtype itself allows
                own = compare_outputs(op, _execute(func, args, kwargs, "cpu"), ref)
                if err <= 2 * own + tol:
                    st.notes.add(f"{op}: error {err:.3g} > tolerance but within 2x the CPU's own "
                                 f"{ctx.dtype} error {own:.3g}")
                    err = min(err, tol)
        except _Mismatch as m:
            raise CheckFailure(f"{op} on {be.name} differs from the {ref_name} reference for {label}: {m}",
                               metric="op_output", expected="equal", observed=str(m)) from None
        st.cases += 1
        st.kinds.update(set(kinds) or {"model"})  # cases per kind (a case with two kinds counts for both)
        st.worst = max(st.worst, err)
        if err > tol:
            raise CheckFailure(f"{op} on {be.name} is off the {ref_name} reference for {label}",
                               metric="op_max_rel_error", expected=f"<= {tol}", observed=f"{err:.6g}",
                               tolerance=tol)

    @staticmethod
    def _hypothesis(check_case, sample, n_float: int, examples: int, realistic: bool = True) -> None:
        from hypothesis import HealthCheck, Phase, example, given, settings
        from hypothesis import strategies as st

        pool = VALUE_KINDS[1:] + (STAT_KINDS if realistic else ())
        kinds = st.lists(st.sampled_from(pool), min_size=n_float, max_size=n_float)
        seeds = st.lists(st.integers(0, 2**31 - 1), min_size=n_float, max_size=n_float)

        def prop(k, s):
            check_case(sample, tuple(k), tuple(s))

        prop = given(kinds, seeds)(prop)
        if realistic:  # always both stat kinds on every input, whatever hypothesis draws next
            for i, kind in enumerate(STAT_KINDS):
                prop = example([kind] * n_float, [1000 * (i + 1) + j for j in range(n_float)])(prop)
        settings(max_examples=examples, deadline=None, derandomize=True, database=None, report_multiple_bugs=False,
                 phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))(prop)()


def register(registry: CheckRegistry) -> None:
    registry.add(OpsCheck())
