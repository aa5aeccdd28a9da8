"""The golden's ``training`` section: backward, optimizer and loss trajectory of the float64 reference.

What ``golden generate`` stores (``harness.golden.store`` format 3, section ``training``; the check is
``harness.checks.training``, the format and the budgets are described in docs/training.md):

* one forward + backward of the LM loss (``model(input_ids=ids, labels=ids).loss``, the smoke check's
  loss) on the golden's ids: per captured module (``harness.anatomy.capture`` rules, by structure)
  the gradient w.r.t. its output (``gout/<m>``) and w.r.t. its main input as it flows through that
  module (``gin/<m>``), full tensors (an isolated backward replay needs them); the order in which the
  modules' input gradients complete (``backward_order``); per parameter a seeded sketch of its
  gradient among the gradient's *nonzero* entries (``pidx/<p>`` int64 flat indices, ``pgrad/<p>``)
  plus norms and statistics of the whole gradient in the entry;
* ``steps`` AdamW steps on a seeded batch stream from the same weights (a copy): per step loss,
  global grad norm and update norm, and after the steps the weight change at the sketch indices
  (``upd/<p>``); the same AdamW run on seeded synthetic gradients (``opt/<p>``: the optimizer alone);
* each router's choices (``route/<router>``, ``troute/<step>/<router>``): the target runs with them
  forced (``harness.precision.routing.ForcedRouting``), so that a near-tie flip in low precision does
  not send gradient to other experts;
* budgets per low-precision dtype, measured like the forward's (``harness.precision.budgets``): the
  same weights in the dtype run the same backward, replay and optimizer on every draw, and the
  trajectory on several batch streams; per quantity the max clean error (the check uses
  ``budget_k x max + floor``; above the dtype's ceiling a quantity is not resolvable in that dtype);
* per dtype, the clean *signed* row errors of the isolated backward on draw 0 (``signed/<dtype>/gin/<m>``,
  ``signed/<dtype>/param/<p>``): the check's sign test (``harness.precision.signed``) of a biased
  backward kernel whose error stays inside the magnitude budgets.
"""

from __future__ import annotations

import copy
import math
import zlib
from dataclasses import dataclass, field

import torch

from harness.anatomy.capture import decode, module_path, selected_modules
from harness.models.build import seeded_tokens
from harness.precision import kernels

SECTION = "training"
# Floors: a quarter of the unit roundoff (as the forward budgets, harness/precision/budgets.py): they
# matter only where the clean error is (almost) zero. float32: 8 unit roundoffs (2^-21).
FLOORS = {"bfloat16": 2.0 ** -10, "float16": 2.0 ** -13, "float32": 2.0 ** -21}
# Ceilings: a budget above them means the quantity is not resolvable in the dtype (reported, not
# judged) - e.g. plain-bf16 updates of norm weights (1.0, ulp 2^-7) by lr 1e-3 round to zero, clean
# rel_rmse 1. 0.3 in bf16: the measured clean gradient errors of the bundled suites stay below 0.1
# (docs/training.md); 1e-3 in float32, 100x the forward's ceiling (gradients sum over tokens).
CEILINGS = {"bfloat16": 0.3, "float16": 0.1, "float32": 1e-3}
MASTER, MASTER_DTYPES = "+master_fp32", ("bfloat16", "float16")  # budgets key of the mixed-precision variant
STREAM_SEED = 7919  # batch stream: seeded_tokens(..., seed + STREAM_SEED * (draw + 1) + step)


def spec(ls) -> dict | None:
    """The suite's training knobs that shape the section; None when the training check is off (or
    not installed: no ``[checks.training]`` table)."""
    cfg = getattr(ls.suite.checks, "training", None)
    if cfg is None or not cfg.enabled:
        return None
    p = ls.suite.checks.precision
    return {"steps": cfg.steps, "lr": cfg.lr, "weight_decay": cfg.weight_decay, "eps": cfg.eps,
            "betas": list(cfg.betas), "optimizer": cfg.optimizer, "master_fp32": cfg.master_fp32, "sketch_size": cfg.sketch_size, "trajectory_draws": cfg.trajectory_draws,
            "seed": p.seed, "capture": p.capture}


# --- gradient taps -------------------------------------------------------------------------------
class _Tap(torch.autograd.Function):
    """Identity whose backward hands the gradient to ``record``: inserted at one module's input or
    output, it sees exactly the gradient flowing through that module (a clone: the model may modify
    its outputs in place)."""

    @staticmethod
    def forward(ctx, x, record):
        ctx.record = record
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        ctx.record(g)
        return g, None


def _main_input(args, kwargs) -> tuple[str, int | str] | None:
    """Where a module's main input is: the ``hidden_states`` kwarg, else the first floating tensor arg."""
    h = kwargs.get("hidden_states")
    if isinstance(h, torch.Tensor) and h.is_floating_point():
        return ("kw", "hidden_states")
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            return ("arg", i)
    return None


def _floats(out) -> list[torch.Tensor]:
    """The floating tensors of a module's output (a tensor or a plain tuple), in order."""
    items = [out] if isinstance(out, torch.Tensor) else list(out) if isinstance(out, tuple) else []
    return [t for t in items if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _tap_outputs(out, fn):
    """``out`` with its i-th floating tensor t replaced by ``fn(i, t)`` (tensors and plain tuples)."""
    if isinstance(out, torch.Tensor):
        return fn(0, out) if out.is_floating_point() else out
    if not isinstance(out, tuple) or hasattr(out, "_fields"):
        return out
    res, i = [], 0
    for t in out:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            t, i = fn(i, t), i + 1
        res.append(t)
    return tuple(res)


class GradTaps:
    """``with GradTaps(model, patterns) as taps:`` forward + backward; then ``taps.gin[m]`` /
    ``taps.gout[m]`` (CPU, the run dtype) and ``taps.order`` (modules by when their backward finished:
    the input gradient, or for a module without a floating input the output gradient). First call only.
    The output gradient is that of the first floating output that gets one (``taps.gout_index``): a
    router's logits feed only its own weights, the gradient arrives at its routing weights."""

    def __init__(self, model, patterns=None):
        self.mods = selected_modules(model, patterns)
        self.gin: dict[str, torch.Tensor] = {}
        self._gout: dict[str, dict[int, torch.Tensor]] = {}
        self.events: dict[str, dict[str, int]] = {}
        self._n, self._handles, self._called, self._out_called = 0, [], set(), set()

    def _record(self, name: str, kind: str, i: int = 0):
        def rec(g):
            g = g.detach().to("cpu", copy=True)
            if kind == "in":
                self.gin.setdefault(name, g)
            else:
                self._gout.setdefault(name, {}).setdefault(i, g)
            self.events.setdefault(name, {}).setdefault(kind, self._n)
            self._n += 1
        return rec

    def _pre(self, name: str):
        def pre(_m, args, kwargs):
            if name in self._called:
                return None
            self._called.add(name)
            where = _main_input(args, kwargs)
            if where is None or not torch.is_grad_enabled():
                return None
            kind, key = where
            x = kwargs[key] if kind == "kw" else args[key]
            if not x.requires_grad:
                return None
            t = _Tap.apply(x, self._record(name, "in"))
            if kind == "kw":
                return args, {**kwargs, key: t}
            return args[:key] + (t,) + args[key + 1:], kwargs
        return pre

    def _post(self, name: str):
        def post(_m, _args, out):
            if name in self._out_called or not torch.is_grad_enabled():
                return None
            self._out_called.add(name)
            tap = lambda i, t: _Tap.apply(t, self._record(name, "out", i)) if t.requires_grad else t  # noqa: E731
            return _tap_outputs(out, tap)
        return post

    @property
    def gout(self) -> dict[str, torch.Tensor]:
        return {n: by[min(by)] for n, by in self._gout.items()}

    @property
    def gout_index(self) -> dict[str, int]:
        return {n: min(by) for n, by in self._gout.items()}

    @property
    def order(self) -> list[str]:
        done = {n: e.get("in", e.get("out")) for n, e in self.events.items()}
        return sorted(done, key=done.get)

    def __enter__(self):
        for name, mod in self.mods:
            self._handles.append(mod.register_forward_pre_hook(self._pre(name), with_kwargs=True))
            self._handles.append(mod.register_forward_hook(self._post(name)))
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles.clear()


# --- parameters ------------------------------------------------------------------------------------
def unique_params(model) -> list[tuple[str, torch.nn.Parameter, list[str]]]:
    """(name, parameter, tied aliases) once per parameter *object* (lm_head tied to embed_tokens is
    one parameter, compared once under its first name)."""
    seen: dict[int, tuple[str, torch.nn.Parameter, list[str]]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        if not p.requires_grad:
            continue
        if id(p) in seen:
            seen[id(p)][2].append(n)
        else:
            seen[id(p)] = (n, p, [])
    return list(seen.values())


def group_of(p: torch.Tensor) -> str:
    """AdamW parameter group: matrices decay, vectors (norm weights, biases) do not."""
    return "decay" if p.dim() >= 2 else "no_decay"


def sketch_indices(g: torch.Tensor, n: int, key: str) -> torch.Tensor:
    """[<= n] int64 flat indices among the nonzero entries of ``g``, seeded by ``key`` (private
    generator: the same on every machine), sorted. The embedding's row-sparse gradient and the experts
    no token reached are thus compared where the gradient lives."""
    nz = g.detach().flatten().nonzero().flatten().cpu()
    if nz.numel() <= n:
        return nz.to(torch.int64)
    gen = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    return nz[torch.randperm(nz.numel(), generator=gen)[:n]].sort().values.to(torch.int64)


def grad_stats(g: torch.Tensor) -> dict:
    g = g.detach().double()
    return {"norm": g.norm().item(), "absmax": g.abs().max().item(), "mean": g.mean().item(),
            "nnz": int((g != 0).sum()), "numel": g.numel()}


def rel_rmse(a: torch.Tensor | None, r: torch.Tensor | None) -> float:
    """||a - r|| / ||r|| in float64; a missing, misshapen or non-finite ``a`` is inf."""
    if a is None or r is None or a.shape != r.shape:
        return math.inf
    a, r = a.detach().double().cpu(), r.detach().double().cpu()
    if not bool(torch.isfinite(a).all()):
        return math.inf
    nr = r.norm().item()
    d = (a - r).norm().item()
    return d / nr if nr > 0 else (0.0 if d == 0 else math.inf)


# --- one backward ----------------------------------------------------------------------------------
@dataclass
class GradRun:
    loss: float
    gin: dict[str, torch.Tensor]
    gout: dict[str, torch.Tensor]
    order: list[str]
    grads: dict[str, torch.Tensor]  # parameter name -> full gradient (zeros where unused)
    routes: dict[str, torch.Tensor] = field(default_factory=dict)  # router -> chosen experts [T, k]
    gout_index: dict[str, int] = field(default_factory=dict)  # which floating output gout is of
    unforced: list[str] = field(default_factory=list)  # routers whose choice could not be forced


def lm_loss(model, ids: torch.Tensor) -> torch.Tensor:
    """The smoke check's loss: labels are the input ids (transformers shifts them)."""
    return model(input_ids=ids, labels=ids, use_cache=False).loss


def grad_run(model, ids: torch.Tensor, patterns=None, routes: dict | None = None, context=None) -> GradRun:
    """One forward + backward of the LM loss with taps on the captured modules. ``torch.autograd.grad``
    (not ``.backward()``): the model's ``.grad`` stay untouched (the reference is shared). ``routes``:
    force every router to these choices (the golden's); the routers' own choices are recorded."""
    import contextlib

    from harness.precision.routing import ForcedRouting, RouterCapture

    params = unique_params(model)
    rc = RouterCapture(model)
    rc.phase = "step"
    forced = ForcedRouting({"step": routes}, phase="step") if routes else None
    handles = forced.attach(model) if forced else []
    ctx = context() if context is not None else contextlib.nullcontext()
    try:
        with ctx, GradTaps(model, patterns) as taps, torch.enable_grad():
            loss = lm_loss(model, ids)
            grads = torch.autograd.grad(loss, [p for _, p, _ in params], allow_unused=True)
    finally:
        rc.remove()
        for h in handles:
            h.remove()
    full = {n: (g if g is not None else torch.zeros_like(p)).detach().to("cpu")
            for (n, p, _), g in zip(params, grads, strict=True)}
    own = {r: calls[0][0] for r, calls in rc.calls["step"].items()}
    return GradRun(loss.item(), taps.gin, taps.gout, taps.order, full, own, taps.gout_index,
                   sorted(set(forced.unforced)) if forced else [])


# --- isolated backward replay ----------------------------------------------------------------------
def _resolver(outputs: dict, tensors: dict, dtype: torch.dtype, device):
    def resolve(kind, key):
        t = outputs[key] if kind == "o" else tensors[key]
        return t.to(device=device, dtype=dtype) if t.is_floating_point() else t.to(device)
    return resolve


def replay_backward(model, name: str, st: dict, resolve, grad_out: torch.Tensor, out_index: int = 0,
                    skip_params: set[str] = frozenset()) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """(input gradient, {parameter name: gradient}) of one module called on its recorded inputs
    ``st`` (the golden's forward call) with ``grad_out`` as the gradient of its ``out_index``-th
    floating output: its own backward, nothing upstream or downstream of it."""
    mod = dict(model.named_modules())[module_path(name)]
    args = [decode(a, resolve) for a in st["args"]]
    kwargs = {k: decode(v, resolve) for k, v in st["kwargs"].items()}
    where = _main_input(args, kwargs)
    x = None
    if where is not None:
        kind, key = where
        x = (kwargs[key] if kind == "kw" else args[key]).detach().clone().requires_grad_(True)
        if kind == "kw":
            kwargs[key] = x
        else:
            args[key] = x
    prefix = module_path(name) + "."
    # Frozen parameters (Laguna's router `e_score_correction_bias`, an nn.Parameter with
    # requires_grad=False) have no gradient to replay: autograd.grad would refuse the whole module.
    params = [(n, p) for n, p in model.named_parameters() if n.startswith(prefix) and n not in skip_params
              and p.requires_grad]
    with torch.enable_grad():
        outs = _floats(mod(*args, **kwargs))
        y = outs[out_index] if out_index < len(outs) else None
        inputs = ([x] if x is not None else []) + [p for _, p in params]
        if y is None or not y.requires_grad or not inputs:
            return None, {}
        gs = torch.autograd.grad(y, inputs, grad_outputs=grad_out.to(y.device, y.dtype), allow_unused=True)
    gin = gs[0].detach().cpu() if x is not None and gs[0] is not None else None
    rest = gs[1:] if x is not None else gs
    return gin, {n: (g if g is not None else torch.zeros_like(p)).detach().cpu()
                 for (n, p), g in zip(params, rest, strict=True)}


def replay_all(model, structures: dict, outputs: dict, tensors: dict, gout: dict, dtype, device,
               routes: dict | None = None, context=None, skip_params: set[str] = frozenset(),
               gout_index: dict | None = None) -> dict:
    """{module: (input grad, param grads)} of every module with recorded inputs and a golden output
    gradient (of its ``gout_index[m]``-th floating output), routers forced to ``routes``."""
    import contextlib

    from harness.precision.routing import ForcedRouting

    forced = ForcedRouting({"step": routes}, phase="step") if routes else None
    handles = forced.attach(model) if forced else []
    resolve = _resolver(outputs, tensors, dtype, device)
    ctx = context() if context is not None else contextlib.nullcontext()
    res = {}
    try:
        with ctx:
            for name, g in gout.items():
                st = structures.get("logits" if name == "lm_head" else name)
                if st is not None and module_path(name) in dict(model.named_modules()):
                    res[name] = replay_backward(model, name, st, resolve, g, (gout_index or {}).get(name, 0),
                                                skip_params)
    finally:
        for h in handles:
            h.remove()
    return res


# --- optimizer and trajectory ----------------------------------------------------------------------
def make_optimizer(params: list, sp: dict, impl: str = "loop") -> torch.optim.Optimizer:
    """AdamW over two groups (decay: matrices, no_decay: vectors). ``impl``: ``loop`` (the plain
    per-tensor code: the reference's), ``foreach`` or ``fused`` (a backend's fused kernel)."""
    groups = {"decay": [], "no_decay": []}
    for _, p, _ in params:
        groups[group_of(p)].append(p)
    pg = [{"params": ps, "weight_decay": sp["weight_decay"] if g == "decay" else 0.0}
          for g, ps in groups.items() if ps]
    kw = {"fused": True} if impl == "fused" else {"foreach": impl == "foreach"}
    return torch.optim.AdamW(pg, lr=sp["lr"], betas=tuple(sp["betas"]), eps=sp["eps"], **kw)


class Stepper:
    """AdamW over a model's parameters; with ``master``, mixed precision as vendors train: float32
    master copies of the (bf16/fp16) parameters, the gradients cast to float32 (single process: the
    fp32 gradient reduction is that cast), the step on the masters and the parameters set from them."""

    def __init__(self, params: list, sp: dict, impl: str = "loop", master: bool = False):
        self.params, self.master = params, master
        self.masters = [(n, p.detach().float().clone(), t) for n, p, t in params] if master else params
        self.opt = make_optimizer(self.masters, sp, impl)

    def zero_grad(self) -> None:
        for _, p, _ in self.params:
            p.grad = None

    def step(self) -> None:
        if self.master:
            for (_, p, _), (_, m, _) in zip(self.params, self.masters, strict=True):
                m.grad = None if p.grad is None else p.grad.detach().float()
        self.opt.step()
        if self.master:
            with torch.no_grad():
                for (_, p, _), (_, m, _) in zip(self.params, self.masters, strict=True):
                    p.copy_(m)


def batch_stream(vocab: int, batch: int, seq: int, seed: int, draw: int, steps: int) -> list[torch.Tensor]:
    """The training stream of one draw: ``steps`` seeded batches [B, S] (draw 0 is the golden's)."""
    return [seeded_tokens(vocab, batch, seq, seed + STREAM_SEED * (draw + 1) + t) for t in range(steps)]


@dataclass
class Trajectory:
    loss: list[float] = field(default_factory=list)  # per step, before the update
    grad_norm: list[float] = field(default_factory=list)  # global L2 norm of the step's gradients
    update_norm: list[float] = field(default_factory=list)  # global L2 norm of the step's weight change
    delta: dict[str, torch.Tensor] = field(default_factory=dict)  # parameter -> w_N - w_0 (float64)
    routes: list[dict[str, torch.Tensor]] = field(default_factory=list)  # per step: router -> choices


def _global_norm(ts) -> float:
    return math.sqrt(sum(t.detach().double().pow(2).sum().item() for t in ts))


def trajectory(model, batches: list[torch.Tensor], sp: dict, impl: str = "loop", routes: list | None = None,
               context=None, master: bool = False) -> Trajectory:
    """``len(batches)`` AdamW steps of ``model`` (trained in place: pass a copy), routers forced to
    ``routes[t]`` at step t when given (else recorded); ``master``: float32 master weights (Stepper)."""
    import contextlib

    from harness.precision.routing import ForcedRouting, RouterCapture

    params = unique_params(model)
    w0 = {n: p.detach().double().clone() for n, p, _ in params}
    opt = Stepper(params, sp, impl, master)
    tr = Trajectory()
    forced = ForcedRouting({}, phase="step") if routes else None
    handles = forced.attach(model) if forced else []
    ctx = context() if context is not None else contextlib.nullcontext()
    try:
        with ctx, torch.enable_grad():
            for t, ids in enumerate(batches):
                rc = RouterCapture(model)
                rc.phase = "step"
                if forced:
                    forced.force = {"step": routes[t]}
                opt.zero_grad()
                loss = lm_loss(model, ids)
                loss.backward()
                rc.remove()
                tr.routes.append({r: c[0][0] for r, c in rc.calls["step"].items()})
                before = [p.detach().double().clone() for _, p, _ in params]
                tr.loss.append(loss.item())
                tr.grad_norm.append(_global_norm(p.grad for _, p, _ in params if p.grad is not None))
                opt.step()
                tr.update_norm.append(_global_norm(p.detach().double() - b for (_, p, _), b in zip(params, before, strict=True)))
    finally:
        for h in handles:
            h.remove()
    tr.delta = {n: (p.detach().double() - w0[n]).cpu() for n, p, _ in params}
    return tr


def synthetic_grad(p: torch.Tensor, key: str, step: int) -> torch.Tensor:
    """A seeded float64 gradient for ``p`` at ``step``: normal signs and magnitudes log-uniform over
    1e-7..1e-2 (real per-element gradients of the pruned models span this), so that an epsilon
    handled wrongly shows on the small ones and a wrong moment update on the large ones."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{key}/{step}".encode()))
    mag = torch.pow(10.0, torch.empty(p.shape, dtype=torch.float64).uniform_(-7, -2, generator=gen))
    return torch.randn(p.shape, dtype=torch.float64, generator=gen) * mag


def optimizer_alone(model, sp: dict, impl: str = "loop", context=None, master: bool = False) -> dict[str, torch.Tensor]:
    """{parameter: w_N - w_0 (float64)} after ``steps`` AdamW steps on seeded synthetic gradients
    (cast to each parameter's dtype): the optimizer and nothing else. Trains ``model`` in place."""
    import contextlib

    params = unique_params(model)
    w0 = {n: p.detach().double().clone() for n, p, _ in params}
    opt = Stepper(params, sp, impl, master)
    ctx = context() if context is not None else contextlib.nullcontext()
    with ctx:
        for t in range(sp["steps"]):
            for n, p, _ in params:
                p.grad = synthetic_grad(p, n, t).to(p.device, p.dtype)
            opt.step()
    return {n: (p.detach().double() - w0[n]).cpu() for n, p, _ in params}


def at(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return t.detach().flatten()[idx.to(t.device)].cpu()


# --- comparison (shared by budget measurement and the check) --------------------------------------
def module_errors(got: GradRun, gin: dict, gout: dict) -> dict[str, dict[str, float]]:
    """{"gin": {m: rel_rmse}, "gout": {m: rel_rmse}} of a run's module gradients against a reference's."""
    return {"gin": {m: rel_rmse(got.gin.get(m), r) for m, r in gin.items()},
            "gout": {m: rel_rmse(got.gout.get(m), r) for m, r in gout.items()}}


def param_errors(grads: dict[str, torch.Tensor], idx: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]
                 ) -> dict[str, float]:
    """{parameter: rel_rmse of its gradient at the sketch indices} against the reference's values."""
    return {n: rel_rmse(at(grads[n], i) if n in grads else None, ref[n]) for n, i in idx.items()}


def replay_errors(rp: dict, gin: dict, idx: dict, pref: dict) -> dict[str, dict[str, float]]:
    """{"gin": {m: rel_rmse}, "param": {m: worst rel_rmse of the module's parameter sketches}} of an
    isolated backward replay against the reference."""
    out = {"gin": {}, "param": {}}
    for m, (g, pgrads) in rp.items():
        if m in gin:
            out["gin"][m] = rel_rmse(g, gin[m])
        errs = [rel_rmse(at(pg, idx[n]), pref[n]) for n, pg in pgrads.items() if n in idx and len(idx[n])]
        if errs:
            out["param"][m] = max(errs)
    return out


def trajectory_devs(got: Trajectory, ref: dict) -> dict[str, list[float]]:
    """Per step: |loss - ref| (nats), |grad norm / ref - 1|, |update norm / ref - 1|."""
    rel = lambda a, r: abs(a / r - 1) if r else abs(a)  # noqa: E731
    out = {"loss": [abs(a - r) for a, r in zip(got.loss, ref["loss"], strict=True)]}
    for k in ("grad_norm", "update_norm"):
        out[k] = [rel(a, r) for a, r in zip(getattr(got, k), ref[k], strict=True)]
    return {k: [v if math.isfinite(v) else math.inf for v in vs] for k, vs in out.items()}


def budget(clean_max: float, dtype: str, k: float, bound: float | None = None) -> float | None:
    """k x the clean maximum, or the clean errors' prediction bound where that is larger (``bound``:
    their spread over kernel choices and draws, ``clean_and_bounds``), + the dtype's floor; None where
    that is above the dtype's ceiling (the quantity is not resolvable in this dtype: reported, not judged)."""
    b = max(k * clean_max, bound or 0.0) + FLOORS.get(dtype, 0.0)
    return b if math.isfinite(b) and b <= CEILINGS.get(dtype, CEILINGS["float32"]) else None


def widened(golden: float | None, machine: list[float] | None, dtype: str, k: float) -> float | None:
    """The larger of the golden's budget and this machine's own (k x its clean maximum + floor,
    ``machine_update_errors``): a golden's budget None (not resolvable in the dtype) stays None."""
    if golden is None or not machine:
        return golden
    own = budget(max(machine), dtype, k)
    return golden if own is None else max(golden, own)


def envelope(clean_max: list[float], ref: list[float], dtype: str, k: float, relative: bool) -> list[float]:
    """Per step: k x the largest clean deviation over the stream draws + floor (the floor relative to
    the reference's value for the loss, whose deviation is absolute)."""
    f = FLOORS.get(dtype, 0.0)
    return [k * m + (f * abs(r) if not relative else f) for m, r in zip(clean_max, ref, strict=True)]


# --- measurement at golden generate ---------------------------------------------------------------
def _add_samples(acc: dict, vals: dict) -> None:
    """``acc[kind][name]`` extended with this draw's clean error of each quantity of ``vals`` (kind ->
    name -> error): every draw's and every kernel choice's error is kept, the budget comes from their
    spread (``clean_and_bounds``), not from their maximum alone."""
    for kind, by in vals.items():
        for n, v in by.items():
            acc.setdefault(kind, {}).setdefault(n, []).append(v if math.isfinite(v) else math.inf)


def merge_samples(acc: dict, vals: dict) -> dict:
    """``acc`` updated in place with one kernel choice's measurement: sample lists concatenated, the
    trajectory's per-step maxima (``traj``) merged element by element."""
    for kind, by in vals.items():
        if kind == "traj":
            kernels.max_merge(acc.setdefault("traj", {}), by)
            continue
        for n, v in by.items():
            acc.setdefault(kind, {}).setdefault(n, []).extend(v)
    return acc


def clean_and_bounds(acc: dict) -> dict:
    """The budgets entry of one dtype from its samples: per quantity the clean maximum (as before),
    ``bound``: the upper prediction bound of the samples (``harness.precision.budgets.prediction_bound``:
    what one more correct order measures), ``samples``: how many per kind."""
    from harness.precision.budgets import prediction_bound

    out: dict = {"traj": acc["traj"]} if "traj" in acc else {}
    bound: dict = {}
    for kind, by in acc.items():
        if kind == "traj":
            continue
        out[kind] = {n: max(v) for n, v in by.items()}
        bound[kind] = {n: b for n, v in by.items() if (b := prediction_bound(v)) is not None}
        out.setdefault("samples", {})[kind] = max((len(v) for v in by.values()), default=0)
    out["bound"] = bound
    return out


def _draw_reference(ref, d: int, ids: torch.Tensor, sp: dict) -> dict:
    """The reference's gradients on one draw, its sketch indices and its recorded forward inputs."""
    from harness.anatomy.capture import capture_with_inputs

    p = ref.ls.suite.checks.precision
    rr = grad_run(ref.model, ids.to(ref.device), p.capture)
    idx = {n: sketch_indices(g, sp["sketch_size"], n) for n, g in rr.grads.items()}
    if d == 0 and ref.capture is not None:
        outs, cap = ref.outputs, ref.capture
    else:
        outs, cap = capture_with_inputs(ref.model, ids.to(ref.device), p.capture)
    return {"run": rr, "idx": idx, "pref": {n: at(rr.grads[n], i) for n, i in idx.items()},
            "structures": cap.inputs, "outputs": outs, "tensors": cap.input_tensors}


def _dtype_model(ref, dtype: str):
    from harness.models import numerics
    from harness.models.build import build_model

    model, _ = build_model(ref.ls, dtype, "cpu", seed=ref.ls.suite.checks.precision.seed)
    numerics.apply(model, ref.numerics)
    return model.eval()


def _measure_backward(ref, model, dtype: str, draws: list[dict], tied: set[str]) -> dict:
    """The clean errors of every draw (``_add_samples``): module gradients, parameter sketches, isolated replay."""
    from harness.models.build import torch_dtype

    acc: dict = {}
    for i, dr in enumerate(draws):
        rr = dr["run"]
        got = grad_run(model, ref.draws[i], ref.ls.suite.checks.precision.capture, routes=rr.routes)
        _add_samples(acc, module_errors(got, rr.gin, rr.gout))
        _add_samples(acc, {"param": param_errors(got.grads, dr["idx"], dr["pref"])})
        rp = replay_all(model, dr["structures"], dr["outputs"], dr["tensors"], rr.gout, torch_dtype(dtype), "cpu",
                        routes=rr.routes, skip_params=tied, gout_index=rr.gout_index)
        _add_samples(acc, {f"replay_{k}": v for k, v in replay_errors(rp, rr.gin, dr["idx"], dr["pref"]).items()})
    return acc


def _measure_training(ref, model, dtype: str, sp: dict, refs: list[Trajectory], opt_ref: dict, idx: dict,
                      master: bool = False) -> dict:
    """Max over the stream draws of the trajectory's per-step deviations, every stream's weight-change
    errors (``_add_samples``) and the optimizer alone's error (one run: it is deterministic);
    ``master``: float32 master weights."""
    acc: dict = {}
    for d, rt in enumerate(refs):
        got = trajectory(copy.deepcopy(model), _stream(ref, d, sp), sp, sp["optimizer"], routes=rt.routes,
                         master=master)
        devs = trajectory_devs(got, vars(rt))
        for k, vs in devs.items():
            acc.setdefault("traj", {})[k] = [max(a, b) for a, b in zip(acc.get("traj", {}).get(k, [0.0] * len(vs)), vs, strict=True)]
        # every draw's weight changes, though the check compares draw 0's: AdamW's first steps follow
        # each gradient entry's sign, so one stream's maximum is a thin sample of how far a correct
        # backend's order of arithmetic moves the weights (issue #28: 1.07-1.17 of a draw-0 budget)
        _add_samples(acc, {"upd": {n: rel_rmse(at(got.delta[n], i), at(rt.delta[n], i)) for n, i in idx.items()}})
    alone = optimizer_alone(copy.deepcopy(model), sp, sp["optimizer"], master=master)
    _add_samples(acc, {"opt": {n: rel_rmse(at(alone[n], i), at(opt_ref[n], i)) for n, i in idx.items()}})
    return acc


def machine_update_errors(model, batches: list[torch.Tensor], sp: dict, idx: dict, ref_upd: dict,
                          routes: list | None = None, master: bool = False) -> dict[str, list[float]]:
    """{parameter: [rel_rmse of its weight change per kernel choice]}: the check's own trajectory
    (stream 0, ``batches``) of ``model`` (the CPU's, in the target's dtype) once per kernel choice,
    against the golden's ``upd/<name>`` (``ref_upd``). The weight change's clean error is a handful
    of sign-following entries, so it depends on the exact order of the arithmetic: measured on the
    machine that made the golden, its budget is a budget for that machine's BLAS (issue #51: a
    correct test device on an AVX-512 CPU used 1.07 of one made on another CPU; the CPU's own math
    choice there measured 5.75e-06 against the golden machine's 3.1e-06)."""
    out: dict[str, list[float]] = {}
    for kind in kernels.KERNELS:
        with kernels.attention(kind):
            got = trajectory(copy.deepcopy(model), batches, sp, sp["optimizer"], routes, master=master)
        for n, i in idx.items():
            out.setdefault(n, []).append(rel_rmse(at(got.delta[n], i), ref_upd[n]))
    return out


def _f32(d: dict) -> dict:
    return {k: v.float() if v.is_floating_point() else v for k, v in d.items()}


def signed_quantities(rp: dict, gin: dict, idx: dict, pref: dict) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """What the signed-error test compares of an isolated backward replay: ``gin/<m>`` (the module's
    input gradient [.., H], rows over H) and ``param/<p>`` (a parameter's gradient at its sketch
    indices [n] as n rows of one element) -> (target, reference)."""
    out = {}
    for m, (g, pgrads) in rp.items():
        if g is not None and m in gin:
            out[f"gin/{m}"] = (g, gin[m])
        for n, pg in pgrads.items():
            if n in idx and len(idx[n]):
                out[f"param/{n}"] = (at(pg, idx[n]).reshape(-1, 1), pref[n].reshape(-1, 1))
    return out


def _signed_clean(ref, model, dtype: str, dr: dict, tied: set[str]) -> dict[str, torch.Tensor]:
    """``signed/<dtype>/<quantity>``: the clean row errors (harness.precision.signed) of this dtype's
    isolated backward on draw 0, replayed on exactly what the check replays on - the golden's float32
    forward inputs and output gradients - against the float32-rounded reference, so that the
    reference backend itself differs from them by exactly 0."""
    from harness.models.build import torch_dtype
    from harness.precision import signed

    rr = dr["run"]
    gin, gout = _f32(rr.gin), _f32(rr.gout)
    rp = replay_all(model, dr["structures"], _f32(dr["outputs"]), _f32(dr["tensors"]), gout, torch_dtype(dtype),
                    "cpu", routes=rr.routes, skip_params=tied, gout_index=rr.gout_index)
    out = {}
    for q, (got, r) in signed_quantities(rp, gin, dr["idx"], _f32(dr["pref"])).items():
        rows = signed.row_errors(got, r)
        if rows is not None and bool(torch.isfinite(rows).all()):
            out[f"signed/{dtype}/{q}"] = rows
    return out


def _stream(ref, d: int, sp: dict) -> list[torch.Tensor]:
    p = ref.ls.suite.checks.precision
    vocab = ref.model.config.get_text_config().vocab_size
    return [b.to(ref.device) for b in batch_stream(vocab, p.batch_size, p.seq_len, sp["seed"], d, sp["steps"])]


def _rounded(d):
    if isinstance(d, dict):
        return {k: _rounded(v) for k, v in d.items()}
    if isinstance(d, list):
        return [_rounded(v) for v in d]
    return float(f"{d:.4g}") if isinstance(d, float) and math.isfinite(d) else d


def _tensors(rr: GradRun, idx: dict, pref: dict, traj: Trajectory, alone: dict) -> dict[str, torch.Tensor]:
    t: dict[str, torch.Tensor] = {}
    t.update({f"gout/{m}": g for m, g in rr.gout.items()})
    t.update({f"gin/{m}": g for m, g in rr.gin.items()})
    for n, i in idx.items():
        t[f"pidx/{n}"], t[f"pgrad/{n}"] = i, pref[n]
        t[f"upd/{n}"], t[f"opt/{n}"] = at(traj.delta[n], i), at(alone[n], i)
    t.update({f"route/{r}": c for r, c in rr.routes.items()})
    for s, routes in enumerate(traj.routes):
        t.update({f"troute/{s}/{r}": c for r, c in routes.items()})
    return t


def _params_entry(model, rr: GradRun, idx: dict) -> dict:
    return {n: {"group": group_of(p), "tied": tied, "sketch": len(idx[n]), **grad_stats(rr.grads[n])}
            for n, p, tied in unique_params(model)}


def build(ref) -> tuple[dict, dict[str, torch.Tensor]]:
    """(entry, tensors) of the training section for a ``harness.precision.generate.ReferenceRun``."""
    sp = spec(ref.ls)
    model = ref.model  # shared: read only (grad_run uses autograd.grad; training runs on copies)
    draws = [_draw_reference(ref, d, ids, sp) for d, ids in enumerate(ref.draws)]
    rr, idx = draws[0]["run"], draws[0]["idx"]
    refs = [trajectory(copy.deepcopy(model), _stream(ref, d, sp), sp, "loop") for d in range(sp["trajectory_draws"])]
    alone = optimizer_alone(copy.deepcopy(model), sp, "loop")
    tied = {a for _, _, al in unique_params(model) for a in al} | {n for n, _, al in unique_params(model) if al}
    budgets, clean_signed = {}, {}
    for dtype in ref.dtypes:
        m = _dtype_model(ref, dtype)
        clean_signed.update(_signed_clean(ref, m, dtype, draws[0], tied))
        # every clean error measured once per kernel choice a correct backend may make (the CPU's
        # fused attention, the math decomposition, split-K matmuls; harness.precision.kernels) and
        # per draw; the samples' maximum and their spread's prediction bound kept (issue #50: the
        # maximum of a few samples of a spread-out error is no bound for an order not measured)
        acc, master = {}, {}
        for kind in kernels.KERNELS:
            with kernels.attention(kind):
                got = _measure_backward(ref, m, dtype, draws, tied)
                got.update(_measure_training(ref, m, dtype, sp, refs, alone, idx))
                merge_samples(acc, got)
                if sp.get("master_fp32") and dtype in MASTER_DTYPES:
                    merge_samples(master, _measure_training(ref, m, dtype, sp, refs, alone, idx, master=True))
        budgets[dtype] = _rounded(clean_and_bounds(acc))
        if master:
            budgets[dtype + MASTER] = _rounded(clean_and_bounds(master))
    t0 = refs[0]
    entry = {"loss": rr.loss, "labels": "input_ids", "backward_order": rr.order,
             "modules": {m: {"grad_in": m in rr.gin, "grad_out": m in rr.gout, "out_index": rr.gout_index.get(m, 0)}
                         for m in rr.order},
             "params": _params_entry(model, rr, idx), "routers": sorted(rr.routes),
             "trajectory": {"loss": t0.loss, "grad_norm": t0.grad_norm, "update_norm": t0.update_norm},
             "draws": len(draws), "budgets": budgets,
             "order_spread": {"kernels": list(kernels.KERNELS), "statistic": "budgets[dtype].bound: upper 99.9 % "
                              "prediction bound (Student t) of the clean errors over kernel choices x draws; the "
                              "check's budget is max(k x clean max, bound) + floor"}}
    tensors = _tensors(rr, idx, draws[0]["pref"], t0, alone)
    tensors["labels"] = ref.ids.to(torch.int64)
    tensors.update(clean_signed)
    entry["signed"] = {"statistic": "sign test of the isolated backward's per-row mean signed error vs the clean "
                       "dtype run (harness.precision.signed)", "quantities": "gin rows, parameter sketch entries"}
    return entry, tensors
