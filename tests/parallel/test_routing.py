"""harness.precision.routing on a real pruned MoE model in one process: the reference rerun with
another routing follows it exactly (the architecture's own weights), records what each router would
have chosen itself, and the judge tells a near-tie flip from a wide one, per rank."""

from __future__ import annotations

import pytest
import torch

from harness.models.build import build_model
from harness.parallel.compare import RankData
from harness.parallel.layouts import Layout
from harness.parallel.reference import batch, run_reference
from harness.precision.routing import ForcedRouting, judge, layout_routing, router_limits
from tests.parallel.helpers import suite_with


def _step(ls, forced=None):
    model, mc = build_model(ls, "float32", "cpu", seed=0)
    ids = batch(mc.config.vocab_size, 2, 8, 1)
    return run_reference(model, ids, 0.5, forced)


@pytest.mark.slow
def test_rerun_with_other_routing_follows_it_and_flips_are_judged_by_margin():
    ls = suite_with("qwen3-30b-a3b")
    ref, order = _step(ls)
    gate = "model.layers.0.mlp.gate"
    routes = {p: {k.split("/", 2)[2]: v for k, v in ref.items() if k.startswith(f"route/{p}/")}
              for p in ("step", "after")}
    assert gate in routes["step"] and routes["step"][gate].shape == (16, 2)
    # Token 3 of layer 0 takes its 3rd-best expert instead of its 2nd, in the training forward.
    logits = ref[f"rlogits/step/{gate}"]
    best = logits.argsort(-1, descending=True)
    flipped = routes["step"][gate].clone()
    flipped[3] = torch.stack([best[3, 0], best[3, 2]])
    routes["step"][gate] = flipped
    trace = ForcedRouting(routes)
    rerun, _ = _step(ls, trace)
    assert not trace.unforced
    assert torch.equal(rerun[f"route/step/{gate}"], flipped)  # followed, weights by its own code
    assert torch.equal(trace.calls["step"][gate].natural.sort(-1).values, ref[f"route/step/{gate}"].sort(-1).values)
    assert not torch.equal(rerun[f"grad/{gate}.weight"], ref[f"grad/{gate}.weight"])
    own = layout_routing([RankData(0, {}, {f"route/{p}/{g}": t for p in routes for g, t in routes[p].items()})],
                         Layout(), sorted(routes["step"]))[1]
    margin = (logits[3, best[3, 1]] - logits[3, best[3, 2]]).item()
    # layer 0's flip is judged by its margin; layer 1 routes the changed hidden state by itself, and a token
    # of it may flip as a consequence (at the published head_dim one does, by less than either limit here)
    wide = judge(trace, own, order, {g: margin / 2 for g in routes["step"]})
    assert wide.wide and wide.first_wide == gate and wide.wide_ranks == [0] and wide.per_router[gate] == 0, wide
    assert len(wide.wide) == 1 and f"router {gate} (training forward): 1 token(s)" in wide.wide[0]
    tie = judge(trace, own, order, {g: margin * 2 for g in routes["step"]})
    assert not tie.wide and tie.per_router[gate] == 1 and tie.near_tie == sum(tie.per_router.values()), tie
    assert set(router_limits(trace, 2**-18)) == set(routes["step"])
