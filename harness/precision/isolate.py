"""Isolated comparison: run each captured module of the target on the *golden's* inputs.

The golden records what every captured module was called with (``Capture(inputs=True)``: a
structure of args/kwargs whose tensor leaves point at stored tensors). Here each module of the
target model is called on those inputs, converted to the run dtype, so its error is its own and not
the sum of everything upstream (the propagated comparison shows the latter).

Routing: a module that contains a router (an MoE block, a decoder layer of an MoE model) may choose
other experts than the golden for a token whose router scores are near-tied. ``routing_mask``
decides per token whether such a flip is legitimate - the golden's router-logit margin between the
experts swapped is within the dtype's router noise (measured when the golden was made) - and the
comparison then leaves those tokens out and counts them; a flip at a wide margin is a failure.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from harness.anatomy.capture import (
    EXPERTS_SUFFIX,
    decode,
    first_tensor,
    module_path,
    router_outputs,
)
from harness.anatomy.moe import ROUTER_SUFFIXES


@dataclass
class Replayed:
    outputs: dict[str, torch.Tensor] = field(default_factory=dict)  # module -> its isolated output
    inner_choices: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # module -> gate -> chosen
    inner_logits: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # module -> gate -> logits
    skipped: dict[str, str] = field(default_factory=dict)


def replay(model: torch.nn.Module, structures: dict[str, dict], outputs: dict[str, torch.Tensor],
           tensors: dict[str, torch.Tensor], dtype: torch.dtype, device, names: list[str],
           context=None) -> Replayed:
    """Call each module in ``names`` on its recorded inputs (``structures``; leaves resolved from the
    reference ``outputs`` / ``tensors``; floating tensors converted to ``dtype`` on ``device``)."""
    import contextlib

    mods = dict(model.named_modules())
    res = Replayed()
    # every router's output during one module's call: which experts the routers *inside* that module
    # chose (a flip there is judged per token by routing_mask, not counted as the module's error)
    seen: dict[str, tuple] = {}
    handles = _hook_routers(mods, seen)
    resolve = _resolver(outputs, tensors, dtype, device)
    ctx = context() if context is not None else contextlib.nullcontext()
    try:
        with ctx, torch.no_grad():
            for name in names:
                _replay_one(name, structures.get(name), mods, resolve, seen, res)
    finally:
        for h in handles:
            h.remove()
    return res


def _hook_routers(mods: dict[str, torch.nn.Module], seen: dict[str, tuple]) -> list:
    """Forward hooks that record each router's first output into ``seen`` (cleared per replayed module)."""
    def router_hook(name):
        def hook(_m, _a, out):
            if name not in seen:
                seen[name] = out
        return hook

    routers = [n for n in mods if n.endswith(ROUTER_SUFFIXES) and n]
    return [mods[n].register_forward_hook(router_hook(n)) for n in routers]


def _resolver(outputs: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor], dtype: torch.dtype, device):
    """``resolve(kind, key)`` for :func:`decode`: a recorded leaf in the run dtype on the device,
    converted once (the same residual stream feeds many modules)."""
    cache: dict[tuple, torch.Tensor] = {}

    def resolve(kind, key):
        got = cache.get((kind, key))
        if got is None:
            t = outputs[key] if kind == "o" else tensors[key]
            got = t.to(device=device, dtype=dtype) if t.is_floating_point() else t.to(device)
            cache[(kind, key)] = got
        return got
    return resolve


def _replay_one(name: str, st: dict | None, mods: dict[str, torch.nn.Module], resolve, seen: dict[str, tuple],
                res: Replayed) -> None:
    """Replay one module on its recorded inputs; its output and its inner routers' choices go to ``res``."""
    mod = mods.get("lm_head" if name == "logits" else module_path(name))
    if st is None or mod is None:
        res.skipped[name] = "no recorded inputs" if st is None else "module not in the target"
        return
    args = [decode(a, resolve) for a in st["args"]]
    kwargs = {k: decode(v, resolve) for k, v in st["kwargs"].items()}
    seen.clear()
    out = mod(*args, **kwargs)
    if name.endswith(ROUTER_SUFFIXES):
        for k, v in router_outputs(name, out).items():
            res.outputs[k] = v.detach().to("cpu")
    else:
        t = first_tensor(out)
        if t is not None:
            res.outputs[name] = t.detach().to("cpu")
    inner = {g: router_outputs(g, o) for g, o in seen.items()}
    res.inner_choices[name] = {g: d[g + EXPERTS_SUFFIX].to("cpu") for g, d in inner.items()
                               if g + EXPERTS_SUFFIX in d}
    res.inner_logits[name] = {g: d[g].detach().to("cpu") for g, d in inner.items() if g in d}


def flip_margins(ref_chosen: torch.Tensor, got_chosen: torch.Tensor, ref_logits: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(flipped token mask [T], golden margin per token [T]): for a token whose chosen expert set
    differs, the largest golden router-logit gap between an expert the golden chose and the target
    did not and one the target chose and the golden did not (how far from a tie the flip was)."""
    ref_chosen, got_chosen = ref_chosen.reshape(-1, ref_chosen.shape[-1]), got_chosen.reshape(-1, got_chosen.shape[-1])
    lg = ref_logits.reshape(ref_chosen.shape[0], -1).double()
    n_e = lg.shape[-1]
    ref_set = torch.zeros(lg.shape, dtype=torch.bool).scatter_(1, ref_chosen.long().clamp(0, n_e - 1), True)
    got_set = torch.zeros(lg.shape, dtype=torch.bool).scatter_(1, got_chosen.long().clamp(0, n_e - 1), True)
    flipped = (ref_set != got_set).any(-1)
    dropped = ref_set & ~got_set
    added = got_set & ~ref_set
    inf = torch.tensor(float("inf"), dtype=lg.dtype)
    hi = torch.where(dropped, lg, inf).min(-1).values  # weakest expert the target dropped
    lo = torch.where(added, lg, -inf).max(-1).values  # strongest expert the target added
    margin = torch.where(flipped, (hi - lo).abs(), torch.zeros_like(hi))
    return flipped, margin


class SelectionJudge:
    """Whether routing flips are within noise *in the router's own selection space*.

    A router selects by something else than its logits: DeepSeek-V3/V4 take the top-k of
    ``score_fn(logits) + e_score_correction_bias`` (group-limited for V3), so two experts far apart
    in logits can be tied in what the router compares. The test, for each flipped token: move each
    swapped expert's golden logit by the measured noise toward the target's choice (the experts the
    target added up by ``limit / 2``, those it dropped down by as much; ``limit`` = 2 k x router
    noise, as in the logit-space rule), and ask the *reference* router (float64, the golden's
    weights) what it selects from those logits. The flip is legitimate when it selects what the
    target did. For a plain top-k of logits (or of a monotone function of them) this is the
    logit-margin rule; for biased and group-limited selection it is the same rule in the right space.

    The logits are moved through the router's input: routers compute ``logits = h @ W.T`` (plus a
    bias for some), so ``h + d @ pinv(W).T`` gives logits + d exactly (W has full row rank: experts <
    hidden size). A router that is not affine in its input (checked on the call) or whose weight is
    not found is judged by the logit margin (``None``)."""

    STEPS = (0.0, 0.25, 0.5, 0.75, 1.0)  # the run-dtype witness's input moves, in units of the noise shift
    RANDOM = 16  # and this many seeded random noise-sized moves

    def __init__(self, reference_model_fn, structures: dict, golden_outputs: dict, tensors: dict,
                 dtype: torch.dtype | None = None):
        self._model_fn, self._model = reference_model_fn, None
        self.structures, self.outputs, self.tensors = structures, golden_outputs, tensors
        self.dtype = dtype  # the run's: a correct router computed in it is the second witness

    def _router(self, gate: str):
        if self._model is None:
            self._model = self._model_fn()
        return dict(self._model.named_modules()).get(gate)

    def legit(self, gate: str, flipped: torch.Tensor, got: torch.Tensor, ref: torch.Tensor,
              limit: float) -> torch.Tensor | None:
        """[T] bool (flipped tokens judged legitimate), or None where this router cannot be judged so."""
        call = self._call(gate)
        if call is None:
            return None
        router, w, args, kwargs, pos = call
        h, n_e = args[pos], self.outputs[gate].shape[-1]
        ref2, got2 = ref.reshape(-1, ref.shape[-1]).long(), got.reshape(-1, got.shape[-1]).long()
        n_t = ref2.shape[0]
        if h.numel() != n_t * w.shape[1]:
            return None
        # the golden's logits moved by the noise toward the target's choice, through the router's
        # input (its logits are affine in it), so the router's own selection rule judges the flip
        d = _toward_target(ref2, got2, flipped, n_t, n_e, limit)
        pinv_t = torch.linalg.pinv(w.detach().to(torch.float64)).T  # [E, H]
        dh = d @ pinv_t  # [T, H]: moves logits by d
        chosen = _moved_choice(gate, router, args, kwargs, pos, dh, d, n_t, n_e)
        if chosen is None:
            return None  # not affine in its input (or no choice to read): the logit-margin rule
        same = (chosen.reshape(n_t, -1).long() == got2).all(-1)
        if self.dtype is not None and self.dtype.itemsize < 4 and bool((flipped.reshape(-1) & ~same).any()):
            # a selection that rounds in the run dtype needs a witness computed in it
            same = self._low_precision_witness(gate, router, args, kwargs, pos, h, dh, pinv_t, flipped, limit,
                                               got2, same)
        return flipped.reshape(-1) & same

    def _call(self, gate: str) -> tuple | None:
        """(router, weight [E, H], float64 args, kwargs, position of the hidden state) of the reference
        router's recorded call, or None where it has no recorded call, weight or hidden-state input.
        The structure is looked at first: the reference model is built only for a router with one."""
        st = self.structures.get(gate)
        if st is None:
            return None
        router = self._router(gate)
        w = getattr(router, "weight", None) if router is not None else None
        n_e = self.outputs[gate].shape[-1]
        if not isinstance(w, torch.Tensor) or w.dim() != 2 or w.shape[0] != n_e or w.shape[1] <= n_e:
            return None

        def resolve(kind, key):
            t = self.outputs[key] if kind == "o" else self.tensors[key]
            return t.to(torch.float64) if t.is_floating_point() else t

        args = [decode(a, resolve) for a in st["args"]]
        kwargs = {k: decode(v, resolve) for k, v in st["kwargs"].items()}
        pos = next((i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.is_floating_point()), None)
        if pos is None or args[pos].shape[-1] != w.shape[1]:
            return None
        return router, w, args, kwargs, pos

    def _low_precision_witness(self, gate: str, router, args: list, kwargs: dict, pos: int, h: torch.Tensor,
                               dh: torch.Tensor, pinv_t: torch.Tensor, flipped: torch.Tensor, limit: float,
                               got2: torch.Tensor, same: torch.Tensor) -> torch.Tensor:
        """``same`` widened by the tokens where the reference router in the run dtype, on an input
        within the noise of the golden's, selects what the target did.

        The selection itself rounds in the run dtype: DeepSeek-V4 adds the correction bias to
        score_fn(logits) in bf16 (steps of 2^-8 at scores near 1), which moving the logits by their
        noise does not cover (measured: a flip at logit margin 0.0137 against a limit of 0.0098, 3 of
        3 clean bf16 reruns). So a second witness: the reference router in the run dtype (a correct
        implementation: the same weights rounded as the target's). The target has both effects at
        once - its router's input is off by the upstream noise *and* its selection rounds, which is
        not monotone in the input: experts within one rounding step tie, and which one a top-k keeps
        depends on where the others round (measured: DeepSeek-V4-Flash seed 1007, token 30: experts
        0, 2 and 5 at float64 scores 0.8536, <0.8536, 0.8503 all round to 0.8516-0.8555 in bf16; the
        target kept 5, at logit margin 0.0111 against a limit of 0.00998). So the low-precision
        router is asked on the golden's input and on inputs moved by noise-sized shifts: toward the
        target's choice by fractions of the noise (STEPS) and in RANDOM seeded directions (each logit
        moved uniformly within +-limit / 2). A correct router in the run dtype whose input is within
        the measured noise picks what the target did: legitimate. A wrong top-k or router kernel
        picks experts no such input reaches."""
        import copy

        n_t, n_e = dh.shape[0], pinv_t.shape[0]  # tokens, experts
        low = copy.deepcopy(router).to(self.dtype)
        la = [a.to(self.dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
        lk = {k: v.to(self.dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
              for k, v in kwargs.items()}
        g = torch.Generator().manual_seed(0)
        rows = flipped.reshape(-1, 1).double()
        shifts = [t * dh for t in self.STEPS] + [
            ((torch.rand(n_t, n_e, generator=g, dtype=torch.float64) - 0.5) * limit * rows) @ pinv_t
            for _ in range(self.RANDOM)]
        for shift in shifts:
            la[pos] = (h + shift.reshape(h.shape)).to(self.dtype)
            with torch.no_grad():
                own = router_outputs(gate, low(*la, **lk)).get(gate + EXPERTS_SUFFIX)
            if own is not None and own.numel() == got2.numel():
                same = same | (own.reshape(n_t, -1).long() == got2).all(-1)
        return same


def _toward_target(ref2: torch.Tensor, got2: torch.Tensor, flipped: torch.Tensor, n_t: int, n_e: int,
                   limit: float) -> torch.Tensor:
    """[T, E] float64: each flipped token's logit move by the noise toward the target's choice (the
    experts it added up by ``limit / 2``, those it dropped down by as much); zero elsewhere."""
    ref_set = torch.zeros(n_t, n_e, dtype=torch.bool).scatter_(1, ref2.clamp(0, n_e - 1), True)
    got_set = torch.zeros(n_t, n_e, dtype=torch.bool).scatter_(1, got2.clamp(0, n_e - 1), True)
    d = torch.zeros(n_t, n_e, dtype=torch.float64)
    d[got_set & ~ref_set] = limit / 2
    d[ref_set & ~got_set] = -limit / 2
    d[~flipped.reshape(-1)] = 0
    return d


def _moved_choice(gate: str, router, args: list, kwargs: dict, pos: int, dh: torch.Tensor, d: torch.Tensor,
                  n_t: int, n_e: int) -> torch.Tensor | None:
    """The experts the float64 reference router selects with its input moved by ``dh`` (logits moved
    by ``d``), or None where it reports no choice or its logits did not move by ``d`` (not affine in
    its input). ``args[pos]`` is left moved."""
    h = args[pos]
    with torch.no_grad():
        base = router_outputs(gate, router(*args, **kwargs))
        args[pos] = h + dh.reshape(h.shape)
        moved = router_outputs(gate, router(*args, **kwargs))
    chosen = moved.get(gate + EXPERTS_SUFFIX)
    if chosen is None or gate not in base:
        return None
    shift = moved[gate].reshape(n_t, n_e).double() - base[gate].reshape(n_t, n_e).double()
    # routers that compute in float32 (DeepSeek-V3's) round the shift at ~1e-7 of the logits
    if not torch.allclose(shift, d, rtol=1e-2, atol=1e-5 * (1 + base[gate].abs().max().item())):
        return None
    return chosen


def routing_mask(name: str, replayed: Replayed, golden_outputs: dict[str, torch.Tensor],
                 noise: dict[str, float], judge: SelectionJudge | None = None
                 ) -> tuple[torch.Tensor | None, int, list[str]]:
    """(tokens to keep [T] or None, legitimate flips, wide-flip messages) for one isolated module."""
    choices = replayed.inner_choices.get(name) or {}
    keep, legit, wide = None, 0, []
    for gate, got in choices.items():
        ref = golden_outputs.get(gate + EXPERTS_SUFFIX)
        logits = golden_outputs.get(gate)
        if ref is None or logits is None or ref.shape != got.shape:
            continue
        flipped, margin = flip_margins(ref, got, logits)
        if not flipped.any():
            continue
        lim = noise.get(gate)
        ok = flipped & (margin <= lim) if lim is not None else torch.zeros_like(flipped)
        if lim is not None and judge is not None and bool((flipped & ~ok).any()):
            sel = judge.legit(gate, flipped, got, ref, lim)  # wide in logits: maybe a tie where it selects
            if sel is not None:
                ok = sel
        bad = flipped & ~ok
        legit += int(ok.sum())
        if bad.any():
            t = int(bad.nonzero()[0, 0])
            wide.append(f"{gate}: {int(bad.sum())} token(s) routed to other experts at a wide router margin "
                        f"(token {t}: golden margin {margin[t].item():.3g} > noise "
                        f"{'unmeasured' if lim is None else f'{lim:.3g}'})")
        keep = ~flipped if keep is None else keep & ~flipped
    return keep, legit, wide


def keep_tokens(t: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """Rows of ``t`` (viewed as [tokens, ...]) for the kept tokens; unchanged when ``t`` is not
    token-major or nothing is left out."""
    if keep is None or bool(keep.all()):
        return t
    n = keep.numel()
    if t.numel() % n or t.dim() == 0:
        return t
    flat = t.reshape(n, -1) if t.shape[0] != n else t.reshape(n, -1)
    return flat[keep]
