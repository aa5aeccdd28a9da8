"""The engine's routed experts against the float64 reference's, near-tie aware (issue #46 item 2).

A mixture-of-experts engine returns, per token and MoE layer, the experts its router chose (vLLM:
``enable_return_routed_experts``, ``CompletionOutput.routed_experts`` [positions, layers, top_k]). The
reference's routers run in float64 on the same tokens (the engine's own continuation teacher-forced, as
the log-probabilities are judged) and are read by ``harness.precision.routing.RouterCapture``: the
chosen experts [T, k] and the router's logits [T, E].

Where the two sets differ at a position and layer, the reference says how close the choice was: the
selection score (the router's logit; for a router that adds a correction bias to sigmoid scores -
DeepSeek-V3, Kimi-K2 - that score) of the expert the engine dropped minus that of the expert it added.
Within ``route_tie_margin`` of each other it is a near tie (the engine's dtype may round either way: a
note); further apart it is a failure named by request, position and layer, with both sets. A wrong
top-k or a router kernel that reads the wrong row is named where the route went wrong, before the
log-probabilities it moved.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

_LAYER = re.compile(r"\.layers\.(\d+)\.")


@dataclass
class RouteDiff:
    request: str  # "prompt 0", or a probe's request name
    position: int
    layer: int
    engine: list[int]
    reference: list[int]
    gap: float  # reference score of the dropped expert - of the added one (the smallest such gap)
    tie: bool


@dataclass
class RouteVerdict:
    compared: int = 0  # (position, layer) pairs compared
    diffs: list[RouteDiff] = field(default_factory=list)

    @property
    def flips(self) -> list[RouteDiff]:
        return sorted((d for d in self.diffs if not d.tie), key=lambda d: (d.position, d.layer))

    @property
    def ties(self) -> list[RouteDiff]:
        return [d for d in self.diffs if d.tie]


def is_moe(ls) -> bool:
    """Whether the suite's model routes tokens to experts (the engine is asked for its routes)."""
    from harness.anatomy.moe import num_experts
    from harness.models.build import model_config

    return bool(num_experts(model_config(ls).config))


def layer_of(router: str) -> int | None:
    m = _LAYER.search(f".{router}.")
    return int(m.group(1)) if m else None


def selection_scores(router: torch.nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """What the router ranks experts by: its logits, or sigmoid(logits) + the correction bias where it
    has one (DeepSeek-V3's noaux_tc routing)."""
    bias = getattr(router, "e_score_correction_bias", None)
    if isinstance(bias, torch.Tensor):
        return logits.double().sigmoid() + bias.double().to(logits.device)
    return logits.double()


class ReferenceRoutes:
    """Forward hooks on the reference model's routers: per forward, layer -> (chosen [T, k], scores [T, E])."""

    def __init__(self, model: torch.nn.Module):
        from harness.anatomy.moe import is_router
        from harness.precision.routing import RouterCapture

        self.capture = RouterCapture(model)
        self.capture.phase = "step"
        # the same routers RouterCapture hooks (harness.anatomy.moe.is_router), for their correction bias
        self.routers = {name: mod for name, mod in model.named_modules() if is_router(name)}
        self.chosen: dict[str, torch.Tensor] = {}

    def take(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """The last forward's routes by layer (and forget them); ``chosen``: the same forward's choices by
        router name {router: [T, k]}, what a run forced to them takes (harness.precision.routing)."""
        out = {}
        self.chosen = {name: calls[-1][0].reshape(-1, calls[-1][0].shape[-1])
                       for name, calls in self.capture.calls["step"].items() if calls}
        for name, calls in self.capture.calls["step"].items():
            layer = layer_of(name)
            if layer is None or not calls:
                continue
            idx, lg = calls[-1]
            out[layer] = (idx.reshape(-1, idx.shape[-1]), selection_scores(self.routers[name], lg.reshape(-1, lg.shape[-1])))
        self.capture.calls["step"] = {}
        return out

    def remove(self) -> None:
        self.capture.remove()


def judge_routes(engine: list, reference: dict[int, tuple[torch.Tensor, torch.Tensor]], margin: float,
                 request: str, verdict: RouteVerdict) -> None:
    """Compare one request's engine routes (``engine[p][layer]``: the top-k ids at position p) with the
    reference's (``reference[layer]``: chosen [T, k], scores [T, E]) position by position."""
    for layer, (chosen, scores) in sorted(reference.items()):
        n = min(len(engine), chosen.shape[0])
        for p in range(n):
            if layer >= len(engine[p]) or engine[p][layer] is None:
                continue  # the engine's capture did not run there
            got = {int(e) for e in engine[p][layer]}
            want = {int(e) for e in chosen[p].tolist()}
            verdict.compared += 1
            if got == want:
                continue
            s = scores[p]
            dropped, added = want - got, got - want
            if any(e >= s.shape[0] or e < 0 for e in added):  # an id the router does not have
                gap = float("inf")
            else:
                gap = min(float(s[d]) for d in dropped) - max(float(s[a]) for a in added)
            verdict.diffs.append(RouteDiff(request, p, layer, sorted(got), sorted(want), gap, abs(gap) <= margin))


def describe(d: RouteDiff, margin: float) -> str:
    return (f"{d.request} position {d.position}, layer {d.layer}: the engine routed to experts {d.engine}, the "
            f"reference to {d.reference} (reference score gap {d.gap:.3g} > route tie margin {margin:g})")


def judge_plain(prompts: list[list[int]], results: list[dict], ref_routes: dict, margin: float) -> RouteVerdict | None:
    """The plain run's requests (each prompt alone): None when the engine returned no routes."""
    if not any(r.get("routed_experts") for r in results):
        return None
    v = RouteVerdict()
    for i, (p, r) in enumerate(zip(prompts, results, strict=True)):
        judge_routes(r.get("routed_experts") or [], ref_routes[tuple(p + r["tokens"])], margin, f"prompt {i}", v)
    return v


def record(ctx, v: RouteVerdict | None, margin: float, moe: bool) -> None:
    """Metrics and notes of the route comparison (the check's ``routes`` step)."""
    if v is None:
        if moe:
            ctx.notes.append("the engine returned no routed experts: routes not compared")
        return
    ctx.metric("serve_routes_compared", v.compared)
    if not v.compared:  # returned, but at no position the reference routed: nothing was held to it
        ctx.notes.append("the engine's routed experts covered no routed position of the reference: routes not compared")
    ctx.metric("serve_route_flips", len(v.flips))
    ctx.metric("serve_route_near_ties", len(v.ties))
    gaps = [abs(d.gap) for d in v.ties]
    if gaps:
        ctx.metric("serve_route_tie_gap_max", max(gaps))
    ctx.notes.extend(f"route near tie at {d.request} position {d.position}, layer {d.layer}: engine {d.engine}, "
                     f"reference {d.reference} ({d.gap:.2g} apart, tie margin {margin:g})" for d in v.ties[:5])


def failure_text(v: RouteVerdict, margin: float, engine: str) -> str:
    first, n = v.flips[0], len(v.flips)
    return (f"engine {engine} routed differently from float64: {describe(first, margin)}; first of {n} "
            f"route(s) beyond the tie margin")


def table(v: RouteVerdict, limit: int = 30) -> str:
    lines = ["request    position  layer  engine          reference       gap"]
    for d in v.flips[:limit]:
        lines.append(f"{d.request.replace(' ', '_'):<10} {d.position:<9} {d.layer:<6} {d.engine!s:<15} "
                     f"{d.reference!s:<15} {d.gap:.4g}")
    if len(v.flips) > limit:
        lines.append(f"... {len(v.flips) - limit} more")
    return "\n".join(lines)
