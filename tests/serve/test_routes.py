"""harness.serve.routes: the engine's experts against the float64 reference's, position by position and layer
by layer, a difference within the route tie margin a near tie (the engine runs end to end in
tests/checks/test_serve.py: a clean MoE run compares every route, a wrong decode-path top-k fails at its route)."""

from __future__ import annotations

import torch

from harness.serve.routes import RouteVerdict, judge_routes, layer_of, selection_scores


def _ref(chosen: list[list[int]], scores: list[list[float]]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    return {1: (torch.tensor(chosen), torch.tensor(scores, dtype=torch.float64))}


def test_a_swap_within_the_margin_is_a_near_tie_and_beyond_it_a_flip_named_where():
    # layer 1, 3 positions, 4 experts, top-2; the engine leaves layer 0 (dense) uncaptured (None)
    ref = _ref([[0, 1], [2, 3], [0, 2]], [[3.0, 2.0, 1.9999, 0.0], [0.0, 1.0, 2.0, 3.0], [3.0, 0.1, 2.0, 1.0]])
    engine = [[None, [1, 0]], [None, [3, 1]], [None, [0, 2]]]  # p0: order only; p1: 2 -> 1, 1.0 below
    v = RouteVerdict()
    judge_routes(engine, ref, 1e-3, "prompt 0", v)
    assert v.compared == 3 and not v.ties
    (flip,) = v.flips
    assert (flip.position, flip.layer, flip.engine, flip.reference) == (1, 1, [1, 3], [2, 3])
    assert flip.gap == 1.0
    engine[1][1] = [3, 2]
    engine[0][1] = [0, 2]  # p0: 1 -> 2, scores 2.0 vs 1.9999: within the margin
    v = RouteVerdict()
    judge_routes(engine, ref, 1e-3, "prompt 0", v)
    assert not v.flips and len(v.ties) == 1 and abs(v.ties[0].gap - 1e-4) < 1e-9


def test_an_expert_id_the_router_does_not_have_is_a_flip():
    v = RouteVerdict()
    judge_routes([[None, [0, 7]]], _ref([[0, 1]], [[1.0, 0.5, 0.0, 0.0]]), 10.0, "hit", v)
    assert len(v.flips) == 1 and v.flips[0].gap == float("inf")


def test_a_biased_sigmoid_router_is_ranked_by_its_own_selection_score():
    class Router(torch.nn.Module):  # DeepSeek-V3's noaux_tc router: sigmoid(logits) + the correction bias
        def __init__(self):
            super().__init__()
            self.e_score_correction_bias = torch.tensor([0.0, 0.5])

    logits = torch.tensor([[2.0, 0.0]])
    s = selection_scores(Router(), logits)
    assert s[0, 1] > s[0, 0]  # sigmoid(0) + 0.5 = 1.0 > sigmoid(2) = 0.88: the bias decides
    assert torch.equal(selection_scores(torch.nn.Linear(2, 2), logits), logits.double())
    assert layer_of("model.layers.12.mlp.gate") == 12 and layer_of("lm_head") is None


def test_routes_that_cover_no_position_are_said_not_compared_never_passed_silently():
    """Routes returned for positions the reference has none at (the speculative variant's draft once took
    the model's capture buffers: every row came back empty) compare nothing: a note says so."""
    from types import SimpleNamespace

    from harness.serve.routes import record

    ctx = SimpleNamespace(notes=[], metrics={}, metric=lambda k, v: ctx.metrics.__setitem__(k, v))
    record(ctx, RouteVerdict(), 1e-4, True)
    assert ctx.metrics["serve_routes_compared"] == 0
    assert ctx.notes == ["the engine's routed experts covered no routed position of the reference: routes not compared"]
