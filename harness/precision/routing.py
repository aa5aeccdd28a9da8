"""Routing-aware comparison for mixture-of-experts layouts.

A router's top-k is a discontinuous function: at a token whose k-th and (k+1)-th experts are nearly
tied, a layout's different reduction order (a tp partial sum, a data-parallel average) rounded to
bf16 can move the router logits by one unit in the last place and flip the choice. Everything after
that token's flip then differs from the single-process reference by far more than rounding - the
gradient of an expert that only that token reached most of all - although the layout computed right.

What the check does about it (``docs/parallel.md``, "Routing-aware MoE"):

1. every router's chosen experts are captured, on the reference and on every rank (``RouterCapture``;
   per phase: ``step`` = the training forward, ``after`` = the forward after the optimizer step),
   and reassembled to the whole batch (``layout_routing``);
2. where they differ from the reference's anywhere, the reference step is **recomputed with the
   layout's routing** (``ForcedRouting``: the router's own top-k call returns the layout's experts;
   its weights are then computed by the architecture's own code from them). Each router of that run
   also records what it would have chosen itself at that point - with the layout's routing upstream,
   so a flip in layer 0 does not count again in layer 1;
3. each flipped token is judged where the flip was made (``judge``): *legitimate* when the
   recomputed reference's router-logit margin between an expert dropped and one added is within
   ``2 x`` the dtype's router-logit noise (two logits each move by it), or, for a router that selects
   by something other than its logits (DeepSeek-V3's bias-corrected, group-limited choice), when the
   precision check's ``SelectionJudge`` finds the reference router selects the layout's experts with
   the logits moved by that noise. A flip at a wider margin is a failure named at the router;
4. with only legitimate flips, *everything* - logits, loss, every gradient (the experts' included,
   none left out), weights, logits after the step, module outputs - is compared with the recomputed
   reference: the same arithmetic as the layout's up to reduction order.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from torch.overrides import TorchFunctionMode

from harness.anatomy.capture import EXPERTS_SUFFIX, router_outputs
from harness.anatomy.moe import is_router

PHASES = ("step", "after")
# The name a forced router's wrapper carries (its ``__qualname__``): dynamo names the function it skips
# in a graph break's reason, so the compile check tells its own router breaks from the model's.
FORCED_MARK = "harness_forced_router"


def _indices(out) -> torch.Tensor | None:
    """The chosen expert ids of a router's output (transformers 5: (logits, weights, indices), in the
    router's own order). A router without an index output (Llama-4: (scores, logits), ``scores`` the
    sigmoid of the top-k logits scattered into zeros) chose the nonzero places of its sparse scores:
    read as capture does (``harness.anatomy.capture.router_outputs``), ids sorted per token. Without
    this, such a router was neither recorded nor forced, and a near-tie flip failed the training and
    compile checks' backward as a kernel fault."""
    if isinstance(out, (tuple, list)):
        idx = [t for t in out if isinstance(t, torch.Tensor) and not t.is_floating_point()]
        if idx and idx[-1].dim() == 2:
            return idx[-1]
        if not idx:
            return router_outputs("r", out).get("r" + EXPERTS_SUFFIX)
    return None


def _logits(out) -> torch.Tensor | None:
    """The router's dense logits [T, E] (Llama-4's second output: its first is the sparse scores)."""
    if isinstance(out, (tuple, list)):
        if not any(isinstance(t, torch.Tensor) and not t.is_floating_point() for t in out):
            got = router_outputs("r", out)
            if "r" + EXPERTS_SUFFIX in got:
                return got["r"]
        out = next((t for t in out if isinstance(t, torch.Tensor)), None)
    return out if isinstance(out, torch.Tensor) and out.is_floating_point() else None


def _out_features(router: torch.nn.Module) -> int:
    """Experts of a router without a count attribute: rows of its weight [E, H] (Gemma-4's ``proj``)."""
    w = getattr(router, "weight", None)
    w = w if isinstance(w, torch.Tensor) else next(p for p in router.parameters() if p.dim() == 2)
    return w.shape[0]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class RouterCapture:
    """Forward hooks on every router (``*.gate`` / ``*.router`` returning expert indices): per phase
    and router, the list of calls' (indices [T, k] int64, logits [T, E]). ``phase = None`` records
    nothing (recomputation's re-run forwards, the memory comparison)."""

    def __init__(self, model: torch.nn.Module, name_of=lambda n: n):
        self.calls: dict[str, dict[str, list[tuple[torch.Tensor, torch.Tensor]]]] = {p: {} for p in PHASES}
        self.phase: str | None = None
        self.handles = []
        for name, mod in model.named_modules():
            if is_router(name_of(name)):
                self.handles.append(mod.register_forward_hook(self._hook(name_of(name))))

    def _hook(self, name: str):
        def hook(_m, _a, out):
            idx, lg = _indices(out), _logits(out)
            if self.phase is None or idx is None or lg is None:
                return
            self.calls[self.phase].setdefault(name, []).append(
                (_local(idx).detach().to("cpu", torch.int64).clone(), _local(lg).detach().to("cpu", copy=True)))
        return hook

    def tensors(self, last: int | None = None) -> dict[str, torch.Tensor]:
        """``route/<phase>/<router>`` [T, k] and ``rlogits/<phase>/<router>`` [T, E], the calls of a
        phase concatenated in call order (pipeline microbatches; ``last``: keep only the last calls -
        a pipeline stage's first forward is a shape-inference run)."""
        out = {}
        for phase, by in self.calls.items():
            for name, calls in by.items():
                calls = calls[-last:] if last else calls
                out[f"route/{phase}/{name}"] = torch.cat([c[0] for c in calls])
                out[f"rlogits/{phase}/{name}"] = torch.cat([c[1].reshape(-1, c[1].shape[-1]) for c in calls])
        return out

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


class _ForceTopK(TorchFunctionMode):
    """Inside one router call: the top-k over all experts (``[T, E]``, k = the layout's k) returns the
    layout's experts ``forced`` [T, k], with the input's values at them; what it would have returned
    is kept in ``natural``. Other top-k calls (DeepSeek-V3's group scores) are left alone."""

    def __init__(self, forced: torch.Tensor, n_experts: int):
        super().__init__()
        self.forced, self.n_experts, self.natural = forced, n_experts, None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in (torch.topk, torch.Tensor.topk) and self.natural is None:
            x = args[0]
            k = args[1] if len(args) > 1 else kwargs.get("k")
            dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
            if (k == self.forced.shape[1] and x.dim() == 2 and tuple(x.shape) == (self.forced.shape[0], self.n_experts)
                    and dim in (-1, 1)):
                self.natural = out[1].detach().clone()
                idx = self.forced.to(device=x.device, dtype=out[1].dtype)
                out = torch.return_types.topk((x.gather(-1, idx), idx))
        return out


@dataclass
class ForcedCall:
    natural: torch.Tensor  # [T, k] what the router chose itself
    logits: torch.Tensor  # [T, E]
    hidden: torch.Tensor  # the router's input (for the selection-space judge)
    router: torch.nn.Module  # float64 copy of the router as it was at the call
    args: tuple = ()  # every positional input of the call (MiniMax-M2's router also takes its bias)
    kwargs: dict = field(default_factory=dict)


@dataclass
class ForcedRouting:
    """Run a model with every router's choice replaced by ``force[phase][router]`` [T, k]; set
    ``phase`` before each forward. ``calls[phase][router]`` records each router's own view."""

    force: dict[str, dict[str, torch.Tensor]]
    phase: str | None = None
    calls: dict[str, dict[str, ForcedCall]] = field(default_factory=lambda: {p: {} for p in PHASES})
    unforced: list[str] = field(default_factory=list)  # routers whose top-k could not be replaced

    def attach(self, model: torch.nn.Module, eager: bool = False) -> list:
        """Wrap every router's forward (an instance attribute; ``.remove()`` on each returned handle
        restores it). The top-k mode is entered around the call, so an exception cannot leave it on.
        ``eager``: the wrapped router is also kept out of any compiled graph (``torch._dynamo.disable``,
        recursive: the router and all it calls; dynamo does not trace the top-k mode), and nothing else
        is: the rest of the model, an instance forward someone else set included, is compiled as it
        would be unforced."""
        handles = []
        for name, mod in model.named_modules():
            if is_router(name):
                prev = mod.__dict__.get("forward")  # an instance forward of someone else's: put back

                def remove(m=mod, prev=prev):
                    if prev is None:
                        m.__dict__.pop("forward", None)
                    else:
                        m.forward = prev

                mod.forward = self._wrap(name, mod, mod.forward)
                if eager:
                    mod.forward = torch._dynamo.disable(mod.forward)
                handles.append(SimpleNamespace(remove=remove))
        return handles

    def _wrap(self, name: str, mod: torch.nn.Module, forward):
        def wrapped(*args, **kwargs):
            forced = (self.force.get(self.phase) or {}).get(name)
            if forced is None:
                return forward(*args, **kwargs)
            hidden = args[0] if args else next(iter(kwargs.values()))
            n_e = int(getattr(mod, "num_experts", 0) or getattr(mod, "n_routed_experts", 0) or _out_features(mod))
            router64 = copy.deepcopy(mod).double()
            router64.__dict__.pop("forward", None)  # the bare router, for the judge
            for d in (router64._forward_hooks, router64._forward_pre_hooks):
                d.clear()
            with _ForceTopK(forced, n_e) as mode:
                out = forward(*args, **kwargs)
            idx = _indices(out)
            if mode.natural is None or idx is None or not torch.equal(idx.long().sort(-1).values,
                                                                       forced.long().sort(-1).values):
                self.unforced.append(name)
            else:
                keep = lambda a: a.detach().clone() if isinstance(a, torch.Tensor) else a  # noqa: E731
                self.calls[self.phase][name] = ForcedCall(mode.natural.long(), _logits(out).detach().clone(),
                                                          hidden.detach().clone(), router64,
                                                          tuple(keep(a) for a in args),
                                                          {k: keep(v) for k, v in kwargs.items()})
            return out
        wrapped.__name__ = wrapped.__qualname__ = f"{FORCED_MARK}[{name}]"
        return wrapped


def layout_routing(ranks, lay, routers: list[str]) -> tuple[dict[str, dict[str, torch.Tensor]], dict, list[str]]:
    """The layout's routing reassembled to the whole batch: ``{phase: {router: [T, k]}}`` (of the
    first rank of each batch slice), each rank's own choice ``{(phase, router): {rank: (rows, [t, k])}}``,
    and notes (ranks of one batch slice that disagree - tp ranks compute the router on replicated
    inputs and should not; each rank's own choice is judged)."""
    d = lay.data_degree
    routes: dict[str, dict[str, torch.Tensor]] = {p: {} for p in PHASES}
    own: dict = {}
    notes = []
    for phase in PHASES:
        for gate in routers:
            key = f"route/{phase}/{gate}"
            have = [rd for rd in ranks if key in rd.tensors]
            if not have:
                continue
            parts = []
            for i in range(d):
                mine = [rd for rd in have if lay.data_index(rd.rank) == i]
                if not mine:
                    parts = []
                    break
                first = mine[0].tensors[key]
                for rd in mine[1:]:
                    if not same_sets(rd.tensors[key], first):
                        notes.append(f"{gate} ({phase}): ranks {mine[0].rank} and {rd.rank} of one batch slice chose "
                                     f"different experts; the reference is rerun with rank {mine[0].rank}'s")
                parts.append(first)
            if not parts:
                continue
            routes[phase][gate] = torch.cat(parts)
            n = parts[0].shape[0]
            own[(phase, gate)] = {rd.rank: (slice(lay.data_index(rd.rank) * n, (lay.data_index(rd.rank) + 1) * n),
                                            rd.tensors[key]) for rd in have}
    return routes, own, notes


def same_sets(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.sort(-1).values, b.sort(-1).values)


@dataclass
class Judgement:
    near_tie: int = 0  # flipped (token, router, phase) judged legitimate
    wide: list[str] = field(default_factory=list)  # one message per router and forward with wide flips
    first_wide: str | None = None  # the router (reference module order) of the first wide flip, training forward
    wide_ranks: list[int] = field(default_factory=list)
    per_router: dict[str, int] = field(default_factory=dict)


def legit_flips(gate: str, call: ForcedCall, rows: slice, got: torch.Tensor, lim: float | torch.Tensor,
           dtype: torch.dtype | None = None):
    """(flipped [t], legitimate [t], margin [t]) of one rank's choice ``got`` for rows ``rows``; ``lim``
    one noise limit, or one per token [t] (the streamed reference measures it per token).
    ``dtype``: the choice was computed in it (the streamed reference's target), so the selection judge
    also asks a correct router in that dtype (its second witness, harness.precision.isolate)."""
    from harness.precision.isolate import SelectionJudge, flip_margins

    nat, lg = call.natural[rows], call.logits.reshape(call.natural.shape[0], -1)[rows]
    flipped, margin = flip_margins(nat, got, lg)
    ok = flipped & (margin <= lim)
    if bool((flipped & ~ok).any()):
        # Wide in logits; for a router that selects by something else (bias-corrected, group-limited)
        # maybe a tie where it selects: the precision check's judge, on the reference router.
        h = call.hidden.reshape(call.natural.shape[0], -1)[rows]
        # The router's call as it was made, the hidden states cut to ``rows`` (other inputs - a bias the
        # router takes as an argument - as they were).
        tensors, spec = {"h": h}, {"args": [{"t": "h"}], "kwargs": {}}
        for i, a in enumerate(call.args[1:], 1):
            tensors[f"a{i}"] = a
            spec["args"].append({"t": f"a{i}"} if isinstance(a, torch.Tensor) else {"v": a})
        for k, v in call.kwargs.items():
            tensors[f"k{k}"] = v
            spec["kwargs"][k] = {"t": f"k{k}"} if isinstance(v, torch.Tensor) else {"v": v}
        sel = SelectionJudge(lambda: SimpleNamespace(named_modules=lambda: [(gate, call.router)]),
                             {gate: spec}, {gate: lg}, tensors, dtype=dtype).legit(
            gate, flipped, got, nat, lim[flipped & ~ok].max().item() if isinstance(lim, torch.Tensor) else lim)
        if sel is not None:
            ok = ok | sel
    return flipped, ok, margin


def judge(trace: ForcedRouting, own: dict, order: list[str], limits: dict[str, float]) -> Judgement:
    """Every rank's choice, per router and forward, against what the rerun reference's router chose
    itself at those tokens, judged as the module docstring says."""
    j = Judgement()
    rank_of = {n: i for i, n in enumerate(order)}
    for phase in PHASES:
        for gate in sorted(trace.calls[phase], key=lambda g: rank_of.get(g, len(order))):
            call, lim = trace.calls[phase][gate], limits[gate]
            n_t = call.natural.shape[0]
            legit, bad_ranks, bad_tokens, first = torch.zeros(n_t, dtype=torch.bool), [], set(), None
            for r, (rows, got) in sorted(own.get((phase, gate), {}).items()):
                flipped, ok, margin = legit_flips(gate, call, rows, got, lim)
                legit[rows] |= ok
                bad = flipped & ~ok
                if bad.any():
                    bad_ranks.append(r)
                    idx = bad.nonzero()[:, 0] + rows.start
                    bad_tokens.update(idx.tolist())
                    if first is None:
                        t = int(bad.nonzero()[0, 0])
                        first = (t + rows.start, margin[t].item())
            n_ok = int(legit.sum())
            j.near_tie += n_ok
            j.per_router[gate] = j.per_router.get(gate, 0) + n_ok
            if bad_ranks:
                what = "training forward" if phase == "step" else "forward after the step"
                j.wide.append(f"router {gate} ({what}): {len(bad_tokens)} token(s) routed to other experts at a "
                              f"wide margin on rank(s) {bad_ranks} (token {first[0]}: reference margin "
                              f"{first[1]:.3g} > noise limit {lim:.3g})")
                if j.first_wide is None and phase == "step":
                    # Where a divergence is born: a wide flip in the forward after the step only
                    # (the training forward routed right) follows from wrong weights, not a router.
                    j.first_wide, j.wide_ranks = gate, bad_ranks
    return j


def router_limits(trace: ForcedRouting, tol: float) -> dict[str, float]:
    """Per router: ``2 x`` the router-logit noise, ``tol`` (scale-relative, measured clean) times the
    largest logit of that router - the most two logits can move towards each other by rounding."""
    out: dict[str, float] = {}
    for by in trace.calls.values():
        for gate, call in by.items():
            out[gate] = max(out.get(gate, 0.0), 2 * tol * call.logits.abs().max().item())
    return out
