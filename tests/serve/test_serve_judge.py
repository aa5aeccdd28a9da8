"""The serve check's float64 reference taken on the engine's own routes (harness.serve.judge).

An engine's routers cannot be forced, and a near tie it rounds the other way (a note of the route
verdict, not a failure) moves every later log-probability of that token by more than rounding. The plain
run of an MoE model whose engine reported its routes is therefore judged against a float64 reference
that took the engine's experts, under a budget measured from harness's own dtype run forced the same
way: the dtype's arithmetic alone (Gemma-4 bfloat16: 0.015 nats, against 0.154 with its own near-tie
flips; the plain rows' budget 0.05 instead of 0.231, docs/serving.md).
"""

from __future__ import annotations

import torch

from harness.serve.export import export
from harness.serve.judge import clean_logprobs, engine_routed, reference_logprobs
from harness.suite.loader import load_suite
from tests_support import REPO


def test_the_engines_routes_replace_the_references_where_it_reported_valid_ones():
    chosen = {"model.layers.0.mlp.gate": torch.tensor([[0, 1], [2, 3], [4, 5]]),
              "model.layers.1.mlp.gate": torch.tensor([[6, 7], [0, 2], [1, 3]])}
    engine = [[[1, 0], [7, 6]],  # the same sets in another order: not moved
              [[2, 4], None],  # layer 0 routed elsewhere; layer 1 not reported
              [[4, 9], [3, 1]]]  # expert 9 does not exist (8 experts): left to the route verdict
    forced, moved = engine_routed(chosen, engine, n_experts=8)
    assert moved == 1
    assert forced["model.layers.0.mlp.gate"].tolist() == [[0, 1], [2, 4], [4, 5]]
    assert forced["model.layers.1.mlp.gate"].tolist() == chosen["model.layers.1.mlp.gate"].tolist()


def test_a_reference_forced_to_other_experts_moves_from_that_position_on_and_not_before(tmp_path):
    ls = load_suite(REPO / "suites" / "qwen3-30b-a3b.toml")
    out = tmp_path / "export"
    export(ls, out, "float32")
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 256, (12,), generator=g).tolist() for _ in range(2)]
    routes, chosen = [], []
    ref = reference_logprobs(out, seqs, routes, chosen)
    assert len(chosen) == 2 and all(v.shape == (12, 2) for v in chosen[0].values())
    # forced to its own choices, the reference is itself; the float32 run forced the same is within rounding
    same = reference_logprobs(out, seqs, force=chosen)
    assert all(torch.equal(a, b) for a, b in zip(same, ref, strict=True))
    clean = clean_logprobs(out, seqs, "float32", force=chosen)
    assert max(float((a - b).abs().max()) for a, b in zip(clean, ref, strict=True)) < 1e-4
    # the engine routed position 5 of the first sequence elsewhere in the first MoE layer
    router = sorted(chosen[0])[0]
    layer = int(router.split(".layers.")[1].split(".")[0])
    row = chosen[0][router][5].tolist()
    other = [e for e in range(8) if e not in row][:2]
    engine = [[None] * (layer + 1) for _ in range(12)]
    engine[5][layer] = other
    force, moved = engine_routed(chosen[0], engine, n_experts=8)
    assert moved == 1
    diff = (reference_logprobs(out, [seqs[0]], force=[force])[0] - ref[0]).abs().amax(-1)  # [12]
    assert float(diff[:5].max()) == 0 and float(diff[5]) > 1e-3, diff.tolist()
