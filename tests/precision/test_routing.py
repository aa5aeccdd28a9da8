"""Issue #11: routing-aware MoE comparison. A near-tie routing flip (golden router margin within the
dtype's measured router noise) leaves its tokens out of the isolated comparison and is counted; a
flip at a wide margin fails the check at the router."""

from __future__ import annotations

import pytest
import torch

from harness.anatomy.capture import EXPERTS_SUFFIX
from harness.golden.store import load_golden
from harness.precision.isolate import Replayed, flip_margins, routing_mask
from precision import faults
from precision.helpers import GOLDEN, props, run_check, suite

GATE = "model.layers.1.mlp.gate"


def test_clean_bf16_run_with_routing_flips_passes(tmp_path):
    """qwen3-30b-a3b in bf16 routes 6 tokens differently from the golden at near ties: with the old
    check its propagated experts output was 0.36 rel_rmse > 0.04 (the issue's false alarm)."""
    ctx, failure = run_check("qwen3-30b-a3b", "bfloat16", tmp_path, force_report=True)
    assert failure is None, failure.report("clean")
    p = props(ctx)
    assert float(p["metric.routing_flips_near_tie"]) > 0
    assert float(p["metric.router_expert_agreement"]) < 1.0
    assert float(p["metric.worst_module_rel_rmse"]) > 0.04  # propagated: reported, not the verdict


def test_flip_legitimacy_judged_by_golden_margin():
    g = load_golden(suite("mixtral-8x7b"), GOLDEN)
    chosen, logits = g.modules[GATE + EXPERTS_SUFFIX], g.modules[GATE]
    # margin between the k-th chosen and the best unchosen expert, per token
    srt = logits.double().sort(-1, descending=True).values
    k = chosen.shape[-1]
    margin = srt[:, k - 1] - srt[:, k]
    near, far = int(margin.argmin()), int(margin.argmax())
    got = chosen.clone()
    for t in (near, far):  # swap the weakest chosen expert for the best unchosen one
        order = logits[t].double().argsort(descending=True)
        got[t] = torch.stack([order[i] for i in range(k - 1)] + [order[k]]).sort().values
    flipped, m = flip_margins(chosen, got, logits)
    assert flipped.nonzero().flatten().tolist() == sorted([near, far])
    assert abs(m[near].item() - margin[near].item()) < 1e-6 and abs(m[far].item() - margin[far].item()) < 1e-6
    rp = Replayed(inner_choices={"model.layers.1.mlp": {GATE: got}})
    limit = (margin[near].item() + margin[far].item()) / 2
    keep, legit, wide = routing_mask("model.layers.1.mlp", rp, g.modules, {GATE: limit})
    assert legit == 1 and len(wide) == 1 and "wide router margin" in wide[0]
    assert not keep[near] and not keep[far] and int(keep.sum()) == keep.numel() - 2
    # with a noise above both margins both flips are near ties
    _, legit, wide = routing_mask("model.layers.1.mlp", rp, g.modules, {GATE: margin.max().item() * 2})
    assert legit == 2 and not wide


def test_wrong_topk_kernel_fails_at_the_router(tmp_path):
    """A top-k kernel that picks the wrong expert flips routing at wide margins while the router logits
    stay right: the check fails at the first router, not at the experts."""
    cfg = suite("mixtral-8x7b").raw_config
    ctx, failure = run_check("mixtral-8x7b", "bfloat16", tmp_path,
                             context=lambda: faults.WrongTopK(4, cfg["num_experts_per_tok"]))
    assert failure is not None
    assert failure.message.startswith("model.layers.0.mlp.gate diverges"), failure.message
    assert "wide router margin" in failure.message


def _biased_router():
    """A real DeepSeek-V4 top-k router (selection: top-k of score_fn(logits) + e_score_correction_bias)
    in float64, with its bias set so that for token 0 an unchosen expert ``b`` is 1e-6 below the
    weakest chosen expert ``a`` in selection space while their logits are far apart."""
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4TopKRouter

    cfg = DeepseekV4Config(hidden_size=64, num_local_experts=8, num_experts_per_tok=2)
    torch.manual_seed(0)
    router = DeepseekV4TopKRouter(cfg).double().eval()
    with torch.no_grad():
        router.weight.normal_(0, 0.3)
        router.e_score_correction_bias.zero_()
        h = torch.randn(1, 6, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        logits = router(h)[0]
        scores = router.score_fn(logits[0])
        order = scores.argsort(descending=True)
        a = order[1]  # weakest chosen (k = 2)
        b = max(order[2:].tolist(), key=lambda e: abs(logits[0, e] - logits[0, a]).item())  # farthest in logits
        router.e_score_correction_bias[b] = scores[a] - scores[b] - 1e-6
        logits, _, idx = router(h)
    return router, h, logits, idx.sort(-1).values, int(a), int(b)


def test_flip_judged_in_the_routers_selection_space():
    """The DeepSeek-V4-Flash false alarm: a flip between two experts tied in the router's selection
    space (bias-corrected scores) but far apart in logits is legitimate; a flip that no noise-sized
    move of the logits explains is still wide."""
    from harness.precision.isolate import SelectionJudge

    router, h, logits, chosen, a, b = _biased_router()
    assert a in chosen[0].tolist() and b not in chosen[0].tolist()
    got = chosen.clone()
    got[0] = torch.tensor(sorted([e for e in chosen[0].tolist() if e != a] + [b]))
    far = 1
    unchosen = [e for e in range(8) if e not in chosen[far].tolist()]
    worst = min(unchosen, key=lambda e: router.score_fn(logits[far, e]).item())  # last in selection space
    got[far] = torch.tensor(sorted([chosen[far, 0].item(), worst]))
    gate = "gate"
    outputs = {gate: logits, gate + EXPERTS_SUFFIX: chosen}
    limit = 0.02  # 2 k x router noise: each swapped logit may move by 0.01
    flipped, margin = flip_margins(chosen, got, logits)
    assert margin[0] > 10 * limit  # wide in logits: the old rule calls it a wrong kernel
    rp = Replayed(inner_choices={"mlp": {gate: got}})
    _, legit, wide = routing_mask("mlp", rp, outputs, {gate: limit})
    assert legit == 0 and "token 0" in wide[0]

    holder = torch.nn.Module()
    holder.gate = router
    judge = SelectionJudge(lambda: holder, {gate: {"args": [{"t": "h"}], "kwargs": {}}}, outputs, {"h": h})
    keep, legit, wide = routing_mask("mlp", rp, outputs, {gate: limit}, judge)
    assert legit == 1 and len(wide) == 1 and f"token {far}" in wide[0]
    assert not keep[0] and not keep[far]


@pytest.fixture(scope="module")
def dsv4_suite(tmp_path_factory):
    """DeepSeek-V4-Flash's suite as `harness init` writes it, once for both seeds (in this process,
    without init's own smoke run: the test needs the suite file, not its validation)."""
    from harness.cli.init import init_suite
    from tests_support import REPO

    return init_suite(REPO / "tests/data/day0/DeepSeek-V4-Flash.json", name="dsv4",
                      suites_dir=tmp_path_factory.mktemp("s"))


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1000, 1007])
def test_deepseek_v4_bf16_flip_from_selection_rounding_is_legitimate(tmp_path, seed, dsv4_suite):
    """DeepSeek-V4-Flash (the Day-0 config), bfloat16. Weight seed 1000: a token flips at a logit
    margin of 0.0137 against a noise limit of 0.0098 because the router adds its correction bias to
    score_fn(logits) in bf16 (3 of 3 clean reruns failed before); the reference router computed in
    the run dtype picks what the target picked: legitimate. Seed 1007 (1 false alarm in the Day-0
    10-rerun sweep): experts 0, 2 and 5 of token 30 in layer 4 tie within one bf16 step of their
    scores, and the target kept 5 at logit margin 0.0111 against 0.00998; only the run-dtype router
    on an input moved within the noise picks 5. A wrong top-k kernel still fails at a router."""
    from harness.precision.generate import generate
    from harness.suite.loader import load_suite

    ls = load_suite(dsv4_suite)
    s = ls.suite.model_copy(deep=True)
    s.checks.precision.seed = seed
    # the golden this test reads: the forward's (precision and its signed_error section) in bfloat16;
    # the decode and training sections took most of the generation (about 85 %)
    s.dtypes = ["bfloat16"]
    s.checks.decode.enabled = s.checks.training.enabled = False
    ls = type(ls)(ls.path, ls.name, s, ls.config_path, ls.raw_config)
    generate(ls, tmp_path / "golden")
    ctx, failure = run_check(ls, "bfloat16", tmp_path, golden_root=tmp_path / "golden")
    assert failure is None, failure.report("clean")
    assert float(props(ctx)["metric.routing_flips_near_tie"]) > 0
    if seed != 1000:
        return  # the fault half once is enough
    from harness.models.build import model_config

    cfg = model_config(ls).config  # the pruned config: 8 routed experts, top-2
    n_e = getattr(cfg, "n_routed_experts", None) or cfg.num_local_experts
    k = cfg.num_experts_per_tok
    _, failure = run_check(ls, "bfloat16", tmp_path, golden_root=tmp_path / "golden",
                           context=lambda: faults.WrongTopK(n_e, k))
    assert failure is not None and "wide router margin" in failure.message, failure


def test_router_without_an_index_output_is_recorded_and_forced():
    """Llama-4's router returns (scores, logits): the sigmoid of its top-k logits scattered into zeros,
    and no expert ids. Its choice is the nonzero places of the scores; RouterCapture records it and
    ForcedRouting forces it (it was neither, so training and compile checks ran it unforced)."""
    from transformers import Llama4TextConfig
    from transformers.models.llama4.modeling_llama4 import Llama4Router

    from harness.precision.routing import ForcedRouting, RouterCapture

    torch.manual_seed(0)
    cfg = Llama4TextConfig(hidden_size=16, num_local_experts=8, num_experts_per_tok=2)
    model = torch.nn.ModuleDict({"mlp": torch.nn.ModuleDict({"router": Llama4Router(cfg)})})
    x = torch.randn(5, 16)
    natural = model["mlp"]["router"](x)[1].topk(2, dim=-1).indices.sort(-1).values
    cap = RouterCapture(model)
    cap.phase = "step"
    model["mlp"]["router"](x)
    cap.remove()
    assert torch.equal(cap.calls["step"]["mlp.router"][0][0], natural)
    assert cap.calls["step"]["mlp.router"][0][1].shape == (5, 8)  # the dense logits, not the sparse scores

    want = (natural + 1) % 8
    forced = ForcedRouting({"step": {"mlp.router": want}}, phase="step")
    handles = forced.attach(model)
    scores, _ = model["mlp"]["router"](x)
    for h in handles:
        h.remove()
    assert forced.unforced == []
    assert torch.equal((scores != 0).int().topk(2, dim=-1).indices.sort(-1).values, want.sort(-1).values)
    assert torch.equal(forced.calls["step"]["mlp.router"].natural.sort(-1).values, natural)
