"""Issue #46: the ``serve`` check - the suite's model through the serving engine (vLLM, in its own
venv) against transformers in float64 on the same exported checkpoint.

Ten engine starts for the whole file (module fixtures, each used by its tests however pytest-xdist
splits the file). The llama and MoE clean runs are the plain items (vLLM's default mode: compiled); the faults run in
the ``eager`` variant (enforce_eager, vLLM's other mode, a nightly item of its own): its start skips the
warm-up compile (11 s against 24 s on a quiet machine), and each fault is caught there as in the
compiled mode, where these tests ran before:

* clean llama-3.1-8b float32 passes, the plain run and its four probes (batch, prefix-cache hit, chunked
  prefill, preemption: one engine instance);
* faults injected into the engine's own process: its rotary embedding wrong from position 4 on
  (serve_rope_fault.py) fails naming position 4; a decode-only softmax scale 2 % off
  (serve_decode_fault.py: prefill exact, greedy tokens unchanged) fails the teacher-forced decode at
  step 1 while the prompt log-probabilities pass; a stale KV page after a prefix-cache hit
  (serve_stale_kv_fault.py) fails probe prefix only, at the hit's first computed position; a
  batch-dependent reduction (serve_batch_fault.py) fails probe batch at position 0;
* the ``speculative`` variant (vLLM's draft-model speculation, the export's weights perturbed as the
  draft): clean llama-3.1-8b passes with drafts accepted and rejected, and its four probes under speculation; a
  fault in the verification forward only (serve_spec_fault.py: steps without drafts exact) fails it at
  decode step 1, the message saying how the engine decoded;
* MoE: qwen3-30b-a3b through vLLM's CPU fused-MoE experts passes, and with one expert's route dropped
  in that kernel (serve_expert_fault.py) fails at the first position the float64 reference routes to
  it; MLA + MoE: deepseek-v3 under MTP decoding (the ``mtp`` variant: its own MTP layer drafts, weights made
  by the export; bfloat16) passes with drafts verified, its prefix and chunked probes not applicable in the
  engine's words where vLLM picks its CPU_MLA backend (its AMX MLA, on a CPU with AMX, keeps and passes them,
  the prefix probe hitting one of two shared pages under MTP).

The rest needs no engine: a missing engine environment skips in one line naming `harness engine setup
vllm`, an architecture outside the engine's row and other backends skip with the reason, and the
verdict's near-tie rule on real float64 log-probabilities.

The engine's environment comes from `harness engine setup vllm` (.ci/run runs it before pytest); where
it is missing the engine tests skip in one line, in CI they fail.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from harness.backends import get
from harness.checks import CheckContext, CheckFailure, NotApplicable
from harness.checks.serve import ServeCheck
from harness.models.build import model_config
from harness.serve import engine as eng
from harness.suite.loader import load_suite
from tests_support import REPO

FAULT = Path(__file__).resolve().with_name("serve_rope_fault.py")
STALE_KV = FAULT.with_name("serve_stale_kv_fault.py")
BATCH = FAULT.with_name("serve_batch_fault.py")
DECODE = FAULT.with_name("serve_decode_fault.py")
EXPERT = FAULT.with_name("serve_expert_fault.py")
ROUTE = FAULT.with_name("serve_route_fault.py")
SPEC = FAULT.with_name("serve_spec_fault.py")
MOE = "qwen3-30b-a3b"  # an MoE suite through vLLM's CPU fused-MoE experts


def _no_engine(why: str) -> None:
    msg = f"{why}: run `harness engine setup vllm` (.ci/run does)"
    if os.environ.get("CI"):
        pytest.fail(f"the serve tests cannot run in CI: {msg}", pytrace=False)
    pytest.skip(msg)


def _run(name: str, dtype: str = "float32", backend: str = "cpu", variant: str | None = None,
         probes: list[str] | None = None, **opts):
    ls = load_suite(REPO / "suites" / f"{name}.toml")
    if probes is not None:  # a fault judged on the plain run: its probes would only cost the engine's time
        s = ls.suite.model_copy(deep=True)
        s.checks.serve.probes = probes
        ls = type(ls)(ls.path, ls.name, s, ls.config_path, ls.raw_config)
    ctx = CheckContext(ls, get(backend), dtype, variant, check="serve")
    try:
        ServeCheck().run(ctx, **opts)
    except (CheckFailure, NotApplicable) as e:
        return ctx, e
    return ctx, None


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """One results folder for both engine runs: the second reuses the first's export."""
    state = eng.status(eng.get("vllm"))
    if state != "ready":
        _no_engine(f"the vllm engine environment is {state} ({eng.env_dir(eng.get('vllm'))})")
    return tmp_path_factory.mktemp("serve")


@pytest.fixture(scope="module")
def clean(results):
    return _run("llama-3.1-8b", results_dir=results)


@pytest.fixture(scope="module")
def faulty(results):
    return _run("llama-3.1-8b", results_dir=results, preload=[FAULT], variant="eager", probes=[])


@pytest.fixture(scope="module")
def stale_kv(results):
    return _run("llama-3.1-8b", results_dir=results, preload=[STALE_KV], variant="eager")


@pytest.fixture(scope="module")
def batched(results):
    return _run("llama-3.1-8b", results_dir=results, preload=[BATCH], variant="eager")


@pytest.fixture(scope="module")
def decode_only(results):
    return _run("llama-3.1-8b", results_dir=results, preload=[DECODE], variant="eager", probes=[])


@pytest.fixture(scope="module")
def speculative(results):
    return _run("llama-3.1-8b", results_dir=results, variant="speculative")


@pytest.fixture(scope="module")
def speculative_fault(results):
    return _run("llama-3.1-8b", results_dir=results, variant="speculative", preload=[SPEC], probes=[])


@pytest.fixture(scope="module")
def moe_clean(results):
    return _run(MOE, results_dir=results)


@pytest.fixture(scope="module")
def mla_clean(results):
    # the mtp variant (its own MTP layer drafts; one engine start for the MLA test and the MTP test): the MLA
    # prefill, the MLA verify forward of two query tokens, the probes under MTP. bfloat16: on a CPU with AMX
    # vLLM picks its AMX MLA backend, which takes no float32 weights ("expect weight to be bfloat16, float16,
    # int8, fp8_e4m3 or uint8": the engine's failure, reported as such)
    return _run("deepseek-v3", "bfloat16", results_dir=results, variant="mtp")


@pytest.fixture(scope="module")
def moe_dropped(results):
    # judged on the plain run (its failure, and _first_routed reads only the plain run's prompts)
    return _run(MOE, results_dir=results, preload=[EXPERT], variant="eager", probes=[])


@pytest.fixture(scope="module")
def moe_misrouted(results):
    # judged on the plain run; the eager variant's run directory is moe_dropped's, each reads its own ctx
    return _run(MOE, results_dir=results, preload=[ROUTE], variant="eager", probes=[])


def _use(ctx, probe: str) -> float:
    return float(dict(ctx.properties)[f"metric.serve_{probe}_budget_use"])


def test_clean_engine_run_passes(clean, results):
    ctx, failure = clean
    assert failure is None, failure.report("serve") if isinstance(failure, CheckFailure) else failure
    p = dict(ctx.properties)
    assert 0 < float(p["metric.serve_worst_budget_use"]) <= 1
    assert float(p["metric.serve_prompt_logprob_max_abs_diff"]) <= float(p["tolerance.serve_prompt_logprob_max_abs_diff"])
    assert float(p["metric.serve_greedy_mismatches"]) == 0
    assert p["harness.detail.serve_engine"].startswith("vllm 0.32")
    assert float(p["metric.serve_engine_generate_s"]) < float(p["metric.serve_engine_wall_s"])
    # the suite keeps the published head_dim (vLLM's CPU attention refuses 16): the export is the suite's model
    assert any(n.startswith("head_dim 128 (the pruned model's is already the published one)") for n in ctx.notes), ctx.notes
    assert (results / "serve" / "export" / "llama-3.1-8b-float32" / "model.safetensors").is_file()
    # vLLM's model-class inspection is shared by every run of the engine environment, not made per results folder
    cache = results / "serve" / "runs" / "vllm-cache" / "modelinfos"
    assert cache.is_symlink() and cache.resolve() == (eng.env_dir(eng.get("vllm")) / "cache" / "modelinfos").resolve()
    assert (cache / "vllm-model_executor-models-llama-LlamaForCausalLM.json").is_file()


def test_clean_probes_pass_and_show_their_feature_ran(clean):
    """Every probe is judged against float64 within budget, and what the engine did is the feature: a
    batch of 6 in one step, a 32-token prefix-cache hit, a prefill in 4 chunks, a preemption."""
    ctx, failure = clean
    assert failure is None, failure
    p = dict(ctx.properties)
    for probe in ("batch", "prefix", "chunked", "preempt"):
        assert 0 < _use(ctx, probe) <= 1, (probe, p)
        assert float(p[f"metric.serve_{probe}_s"]) > 0
    assert p["harness.detail.serve_probe_batch"].startswith("6 requests"), p
    assert p["harness.detail.serve_probe_prefix"] == "hit: 32 of 40 prompt tokens from the prefix cache", p
    assert p["harness.detail.serve_probe_chunked"] == "prefill in 4 chunk(s) of <= 12 tokens", p
    assert p["harness.detail.serve_probe_preempt"].startswith("1 preemption"), p


@pytest.mark.slow
def test_stale_kv_page_after_a_prefix_hit_fails_probe_prefix_only(stale_kv):
    ctx, failure = stale_kv
    assert isinstance(failure, CheckFailure), failure
    msg = failure.message
    assert "in probe prefix (hit: 32 of 40 prompt tokens" in msg, msg
    assert "hit position 32 (predicting prompt token 33)" in msg and "(probes failing: prefix)" in msg, msg
    assert failure.metric == "serve.prefix.prompt32"
    # the miss that filled the page, the plain run and every other probe are exact
    rows = failure.details.splitlines()[1:]
    assert rows and all(r.split()[0] == "hit" for r in rows if not r.startswith("...")), failure.details
    assert float(dict(ctx.properties)["metric.serve_worst_budget_use"]) <= 1
    assert all(_use(ctx, p) <= 1 for p in ("batch", "chunked", "preempt"))


@pytest.mark.slow
def test_batch_dependent_reduction_fails_probe_batch(batched):
    """Batch-only fault: probe batch fails at position 0. The preemption probe serves two requests at
    once (preemption needs a competitor), so it is batched too and fails as well; the plain run (each
    prompt alone), the prefix and the chunked probes (one request per forward) pass."""
    ctx, failure = batched
    assert isinstance(failure, CheckFailure), failure
    msg = failure.message
    assert "in probe batch (6 requests" in msg and "prompt 0 position 0 (predicting prompt token 1)" in msg, msg
    assert "(probes failing: batch, preempt)" in msg, msg
    assert failure.metric == "serve.batch.prompt0"
    assert float(dict(ctx.properties)["metric.serve_worst_budget_use"]) <= 1
    assert _use(ctx, "prefix") <= 1 and _use(ctx, "chunked") <= 1


def test_fault_in_the_engine_process_fails_at_the_first_bad_position(faulty):
    ctx, failure = faulty
    assert isinstance(failure, CheckFailure), failure
    assert "prompt 0 position 4 (predicting prompt token 5)" in failure.message, failure.message
    assert dict(ctx.properties)["harness.detail.first_divergent_position"] == "4"
    # positions 0-3 are exact: nothing before position 4 is in the failure's table
    rows = failure.details.splitlines()[1:]
    assert rows and all(int(r.split()[3]) >= 4 for r in rows if not r.startswith("...")), failure.details


@pytest.mark.slow
def test_decode_only_fault_fails_the_teacher_forced_decode_at_step_1(decode_only):
    """The engine's decode attention (query length 1) with its softmax scale 2 % off: prefill is exact -
    every prompt position and step 0, which the prefill's last position predicts - and the greedy tokens
    are the reference's; step 1, the first token a decode step predicts, is over budget."""
    ctx, failure = decode_only
    assert isinstance(failure, CheckFailure), failure
    p = dict(ctx.properties)
    assert "engine vllm differs from float64: prompt 0 decode step 1 (position 16)" in failure.message, failure.message
    assert "|logprob diff| of the reference's top-1 token" in failure.message, failure.message
    assert failure.metric == "serve.step1"
    assert float(p["metric.serve_prompt_logprob_max_abs_diff"]) <= float(p["tolerance.serve_prompt_logprob_max_abs_diff"])
    assert float(p["metric.serve_greedy_mismatches"]) == 0
    rows = [r.split() for r in failure.details.splitlines()[1:] if not r.startswith("...")]
    assert rows and all(r[1] == "step" and int(r[2]) >= 1 for r in rows), failure.details


def test_moe_suite_is_served_and_passes(moe_clean):
    """qwen3-30b-a3b (8 experts, top-2) through vLLM's CPU fused-MoE experts, plain run and every probe."""
    ctx, failure = moe_clean
    assert failure is None, failure.report("serve") if isinstance(failure, CheckFailure) else failure
    p = dict(ctx.properties)
    assert 0 < float(p["metric.serve_worst_budget_use"]) <= 1
    assert all(0 < _use(ctx, probe) <= 1 for probe in ("batch", "prefix", "chunked", "preempt")), p
    # the engine's routes read back and held to the reference's: 2 prompts x 23 positions x every MoE layer
    layers = model_config(ctx.suite).config.num_hidden_layers
    assert float(p["metric.serve_routes_compared"]) == 2 * (16 + 8 - 1) * layers, p
    assert float(p["metric.serve_route_flips"]) == 0, p


def test_a_decode_path_top_k_off_by_one_is_named_at_its_route_first(moe_misrouted):
    """vLLM's CPU router gives each decode token's last top-k slot the (k+1)-th expert (prefill exact): the
    failure leads with the route - the first decode position and the first MoE layer, both expert sets and
    the reference's score gap - and only then the log-probabilities it moved."""
    ctx, failure = moe_misrouted
    assert isinstance(failure, CheckFailure), failure
    msg = failure.message
    assert msg.startswith("engine vllm routed differently from float64: prompt 0 position 16, layer 0: the engine "
                          "routed to experts "), msg
    assert "reference score gap" in msg and "route(s) beyond the tie margin" in msg, msg
    rows = [r.split() for r in failure.details.splitlines()[1:] if not r.startswith("...")]
    assert rows and all(int(r[1]) >= 16 for r in rows), failure.details  # prefill routed exactly


@pytest.mark.slow
def test_mla_suite_is_served_and_the_probes_the_engine_turns_off_say_why(mla_clean):
    """deepseek-v3 exported with the published MLA widths (vLLM's CPU MLA decode takes a 512 + 64 latent
    only) passes. Which MLA backend vLLM picks depends on the CPU: its CPU_MLA turns prefix caching and
    chunked prefill off, and those two probes are then not applicable in the engine's own words, never
    failed and never passed on nothing; on a CPU with AMX its AMX MLA keeps both, and they run and pass."""
    ctx, failure = mla_clean
    assert failure is None, failure.report("serve") if isinstance(failure, CheckFailure) else failure
    p = dict(ctx.properties)
    assert any(n.startswith("MLA widths kv_lora_rank 512, qk_rope_head_dim 64") for n in ctx.notes), ctx.notes
    for probe in ("prefix", "chunked"):
        said = p[f"harness.detail.serve_probe_{probe}"]
        if said.startswith("not applicable"):
            assert said.startswith("not applicable: MLA is enabled on a non-GPU platform; forcing chunked prefill "
                                   "and prefix caching to be disabled"), said
            assert f"metric.serve_{probe}_budget_use" not in p
        else:  # the engine kept the feature: the probe ran it (its own "did", never an empty pass)
            # under MTP the engine drops a hit's last page: the probe shares two pages and hits one
            assert said.startswith("hit: 32 of 72" if probe == "prefix" else "prefill in "), said
            assert _use(ctx, probe) <= 1, probe
    assert _use(ctx, "batch") <= 1 and _use(ctx, "preempt") <= 1
    # pages of 16 (CPU MLA's); one preemption in the eager mode, two under MTP (its drafter's pages beside the model's)
    assert int(p["harness.detail.serve_probe_preempt"].split()[0]) >= 1, p["harness.detail.serve_probe_preempt"]


def _first_routed(results, suite: str, expert: int, variant: str = "eager") -> list[int]:
    """Per prompt of the item, the first sequence position whose token the float64 reference routes to
    ``expert`` in any layer (the engine's tokens teacher-forced, the last one excluded: nothing judges what
    it predicts)."""
    import json

    import torch
    from transformers import AutoModelForCausalLM

    # the item's own run directory (a faulty item runs in the eager variant: the plain item's, read before, exists
    # only where the clean MoE test ran in the same pytest worker first)
    run = results / "serve" / "runs" / f"{suite}-cpu-float32-{variant}"
    req, res = (json.loads((run / f).read_text()) for f in ("request.json", "result.json"))
    model = AutoModelForCausalLM.from_pretrained(req["model"], dtype=torch.float64, attn_implementation="eager",
                                                 experts_implementation="eager")
    k, first = model.config.num_experts_per_tok, []
    with torch.no_grad():
        for prompt, r in zip(req["prompts"], res["results"], strict=True):
            seq = (prompt + r["tokens"])[:-1]
            routed = model(torch.tensor([seq]), output_router_logits=True).router_logits
            hit = torch.stack([(lg.topk(k, -1).indices == expert).any(-1) for lg in routed]).any(0)
            first.append(int(hit.nonzero()[0]) if hit.any() else len(seq))
    return first


@pytest.mark.slow
def test_dropped_expert_route_fails_at_the_first_position_routed_to_it(moe_dropped, results):
    """Expert 0's contribution zeroed in vLLM's CPU fused-MoE kernel for the tokens routed to it: in each
    prompt the first failing position is the first one the float64 reference routes to expert 0 (a
    position not routed to it, before that, is exact), and the failure names the earliest."""
    ctx, failure = moe_dropped
    assert isinstance(failure, CheckFailure), failure
    first = _first_routed(results, MOE, 0)
    assert dict(ctx.properties)["harness.detail.first_divergent_position"] == str(min(first)), (first, failure.message)
    assert f"prompt {first.index(min(first))} position {min(first)}" in failure.message, failure.message
    rows = [r.split() for r in failure.details.splitlines()[1:] if not r.startswith("...")]
    for i, f in enumerate(first):  # the table is sorted by position: a prompt's first row is its earliest
        assert next(int(r[3]) for r in rows if r[0] == str(i)) == f, (i, first, failure.details)


def test_missing_engine_environment_skips_in_one_line(tmp_path):
    _, skip = _run("llama-3.1-8b", engines_root=tmp_path / "engines", results_dir=tmp_path)
    assert isinstance(skip, NotApplicable), skip
    msg = str(skip)
    assert "\n" not in msg and msg.endswith("run `harness engine setup vllm`"), msg
    assert "missing" in msg


def test_an_architecture_the_engine_does_not_drive_skips_with_the_reason(tmp_path, monkeypatch):
    """An architecture outside the engine's row (a vendor's engine that has no MoE, say) skips in one line."""
    import dataclasses

    reg = eng.EngineRegistry()
    reg.add(dataclasses.replace(eng.get("vllm"), architectures=frozenset({"LlamaForCausalLM"})))
    monkeypatch.setattr(eng, "registry", lambda: reg)
    _, skip = _run("mixtral-8x7b", engines_root=tmp_path, results_dir=tmp_path)
    assert isinstance(skip, NotApplicable) and "MixtralForCausalLM through vllm" in str(skip), skip
    assert "\n" not in str(skip)


def test_other_backends_skip_until_their_engine_build_is_declared(tmp_path):
    _, skip = _run("llama-3.1-8b", backend="cuda", engines_root=tmp_path, results_dir=tmp_path)
    assert isinstance(skip, NotApplicable) and "no build of engine vllm is declared for backend cuda" in str(skip), skip


def test_the_transformers_implementation_and_eager_mode_are_nightly_variants_of_their_own():
    # vLLM's transformers backend (model_impl="transformers", the Day-0 path for an architecture vLLM has no
    # code for yet) is a second item: a second engine start, so nightly, for the suites on every commit too
    check, llama = ServeCheck(), load_suite(REPO / "suites" / "llama-3.1-8b.toml")
    assert check.variants(llama, get("cpu")) == [None, "transformers", "eager", "server", "speculative", "mtp"]
    assert check.scope(llama, "transformers") == "nightly" and check.scope(llama, None) == "commit"
    assert check.scope(llama, "eager") == "nightly" and check.scope(llama, "server") == "nightly"
    assert check.variants(llama, get("cuda")) == [None]  # no build there: the one item says why


def test_scope_is_commit_for_one_dense_and_one_moe_suite_nightly_for_the_rest():
    check = ServeCheck()
    assert check.scope(load_suite(REPO / "suites" / "llama-3.1-8b.toml"), None) == "commit"
    assert check.scope(load_suite(REPO / "suites" / "qwen3-30b-a3b.toml"), None) == "commit"
    assert check.scope(load_suite(REPO / "suites" / "qwen3-8b.toml"), None) == "nightly"


def test_near_tie_is_a_note_a_clear_mismatch_fails():
    """The verdict on real float64 log-probabilities: position 1's two best tokens 1e-4 nats apart."""
    import torch

    from harness.serve.judge import describe, judge

    logits = torch.zeros(3, 8, dtype=torch.float64)
    logits[0, 2] = 3.0
    logits[1, 5], logits[1, 6] = 2.0, 2.0 - 1e-4  # near tie: 5 is the argmax by 1e-4
    logits[2, 1] = 4.0
    lp = torch.log_softmax(logits, -1)
    prompt = [7, 2]  # position 0 predicts token 2 (the reference's top-1)
    top = lambda p, *ts: {str(t): float(lp[p, t]) for t in ts}  # noqa: E731 - what the engine reports
    res = {"prompt_logprobs": [None, top(0, 2, 3)], "tokens": [6, 1], "logprobs": [top(1, 5, 6), top(2, 1, 0)]}
    v = judge([prompt], [res], [lp], budget=1e-6, tie_margin=1e-3)
    assert not v.bad and [r.index for r in v.ties] == [0]
    v = judge([prompt], [res], [lp], budget=1e-6, tie_margin=1e-5)  # the same choice beyond the margin
    assert [(r.kind, r.index, r.position) for r in v.bad] == [("step", 0, 1)]
    assert "the engine's greedy token 6 is not the reference's 5" in describe(v.bad[0])


def test_a_top1_the_engine_did_not_report_fails_only_where_its_kth_shows_an_error_beyond_the_budget():
    """Gemma-4 in bfloat16 (a flat distribution over 512 tokens): the reference's top-1 sat just below the
    engine's 5 others at one position of the preemption probe, and the item failed on a correct engine.
    Not reported with the engine's k-th within the budget of the reference's value: not judged, counted.
    The engine's k-th further below than the budget: the error is at least that, a failure as before."""
    import torch

    from harness.serve.judge import describe, judge

    lp = torch.log_softmax(torch.tensor([[0.0, 0.01, 0.02, 0.03, -5.0], [3.0, 0.0, 0.0, 0.0, 0.0]],
                                        dtype=torch.float64), -1)
    prompt = [0, 4]  # position 0 predicts token 4 (the prompt's); the reference's top-1 is 3, by 0.01
    # the engine's top 2, and the prompt's own token 4 far below them (vLLM adds it wherever it ranks)
    top2 = {"2": float(lp[0, 3]) - 0.02, "1": float(lp[0, 3]) - 0.03, "4": float(lp[0, 4])}
    close = {"prompt_logprobs": [None, top2], "tokens": [0], "logprobs": [{"0": float(lp[1, 0])}]}
    v = judge([prompt], [close], [lp], budget=0.05, tie_margin=1e-3, k=2)
    assert not v.bad and [r.unordered for r in v.rows] == [True, False] and v.rows[0].use == 0.0
    assert judge([prompt], [close], [lp], budget=0.05, tie_margin=1e-3).bad  # k unknown: fails as before
    far = {**close, "prompt_logprobs": [None, {**top2, "2": float(lp[0, 3]) - 0.2, "1": float(lp[0, 3]) - 0.3}]}
    v = judge([prompt], [far], [lp], budget=0.05, tie_margin=1e-3, k=2)
    assert [(r.kind, r.position) for r in v.bad] == [("prompt", 0)] and v.bad[0].use == float("inf")
    assert "is not among the engine's top-k" in describe(v.bad[0])


def test_the_budget_takes_the_models_own_dtype_run_where_it_is_above_the_floor():
    import torch

    from harness.serve.judge import clean_error, measured_budget

    ref = torch.log_softmax(torch.tensor([[2.0, 0.0, 0.0]], dtype=torch.float64), -1)
    assert clean_error(ref, ref + torch.tensor([[0.07, -0.3, 0.0]], dtype=torch.float64)) == pytest.approx(0.07)
    budget, said = measured_budget(0.05, 0.0697, 1.5, "bfloat16")  # Gemma-4 bf16's own run
    assert budget == pytest.approx(0.10455) and "1.5 x the model's own bfloat16 run" in said[0]
    assert measured_budget(0.05, 0.0085, 1.5, "bfloat16") == (0.05, [])  # llama-3.1-8b bf16: the floor, as before


def test_a_probe_whose_feature_did_not_run_fails_naming_it():
    """A prefix probe whose hit request came back with 0 cached tokens probed nothing: a failure of its
    own, even with every log-probability exact (here the float64 reference itself)."""
    import torch

    from harness.serve.probes import build, judge_probe

    seq = iter(range(1000))
    tokens = lambda n, length, i: [[next(seq) % 50 for _ in range(length)] for _ in range(n)]  # noqa: E731
    (prefix,) = build(["prefix"], [[1] * 16], tokens, steps=2, block_size=32, fillers=4, chunk_tokens=12)
    miss, hit = (g[0] for g in prefix["groups"])
    assert miss["ids"][:32] == hit["ids"][:32] and miss["ids"][32:] != hit["ids"][32:] and hit["read_prefix_cache"]
    ref, groups = {}, []
    for r in (miss, hit):  # the engine's answer = the reference's own top-2 at every position
        lp = torch.log_softmax(torch.randn(len(r["ids"]) + 2, 50, dtype=torch.float64, generator=torch.Generator().manual_seed(len(ref))), -1)
        top = lambda p, lp=lp: {str(int(t)): float(lp[p, t]) for t in lp[p].topk(2).indices}  # noqa: E731
        toks = [int(lp[len(r["ids"]) - 1 + s].argmax()) for s in range(2)]
        ref[tuple(r["ids"] + toks)] = lp
        groups.append([{"prompt_logprobs": [None] + [top(p) for p in range(len(r["ids"]) - 1)], "tokens": toks,
                        "logprobs": [top(len(r["ids"]) - 1 + s) for s in range(2)], "num_cached_tokens": 0}])
    o = judge_probe(prefix, {"name": "prefix", "groups": groups, "seconds": 0.1}, ref, 1e-9, 1e-9)
    assert not o.verdict.bad and not o.ok
    assert o.problem == "the engine served the hit request from 0 cached tokens", o.problem
    groups[1][0]["num_cached_tokens"] = 32
    o = judge_probe(prefix, {"name": "prefix", "groups": groups, "seconds": 0.1}, ref, 1e-9, 1e-9)
    assert o.ok and min(r.position for r in o.verdict.rows if r.name == "hit") == 32


def test_a_batch_probe_is_exercised_only_where_a_step_held_two_of_its_requests():
    """The server's batch probe posts its requests at once, but clients are batched only when they
    arrive together: the engine core's step record (requests per step) decides, never the token count
    alone (a long filler's prefill step outnumbers a short prompt's tokens with one request in it)."""
    from harness.serve.probes import _exercised, build

    tokens = lambda n, length, i: [[i % 50] * length for _ in range(n)]  # noqa: E731
    (batch,) = build(["batch"], [[1] * 16, [2] * 16], tokens, steps=8, block_size=32, fillers=4, chunk_tokens=12)
    alone = {"scheduled_tokens": [32, 16, 19, 8, 3] + [1] * 40, "scheduled_requests": [1] * 45}
    did, problem = _exercised(batch, alone)
    assert problem == "no step held more than one request" and did.startswith("6 requests, up to 1 in one step"), did
    did, problem = _exercised(batch, {"scheduled_tokens": [51, 20, 4], "scheduled_requests": [2, 6, 4]})
    assert problem is None and did == "6 requests, up to 6 in one step (51 tokens)", did
    # the offline runner's results before the count: the tokens rule
    assert _exercised(batch, {"scheduled_tokens": [94, 6]})[1] is None


@pytest.mark.slow
def test_speculative_decoding_is_served_drafts_verified_and_judged_as_the_plain_run(speculative):
    """The draft is the export with its weights perturbed: every verify step proposes 3 tokens, greedy
    accepts those the model would choose and rejects the others (both paths taken), so the continuation is
    the plain run's and is judged the same way, position by position; the probes run under speculation."""
    ctx, failure = speculative
    assert failure is None, failure.report("serve") if isinstance(failure, CheckFailure) else failure
    p = dict(ctx.properties)
    assert float(p["metric.serve_spec_drafted"]) > float(p["metric.serve_spec_accepted"]) > 0, p
    assert p["harness.detail.serve_speculative"].startswith("draft_model, "), p["harness.detail.serve_speculative"]
    assert float(p["metric.serve_worst_budget_use"]) <= 1 and float(p["metric.serve_greedy_mismatches"]) == 0, p
    for probe in ("batch", "prefix", "chunked", "preempt"):
        assert _use(ctx, probe) <= 1, probe


@pytest.mark.slow
def test_mtp_decoding_drafts_with_the_models_own_layers_and_is_judged_as_the_plain_run(mla_clean, results):
    """deepseek-v3 (one MTP layer, num_nextn_predict_layers) served with vLLM's mtp method: the export's MTP
    weights (harness.serve.export.cached_mtp) draft one token a step and the model's forward verifies it,
    so the continuation is the model's own, judged position by position against float64. Under an
    EAGLE-style drafter the engine drops a prefix hit's last page: the prefix probe shares two pages and
    hits one (where the engine's MLA backend keeps prefix caching: the MLA test). A model without MTP layers
    is not applicable, before any engine starts."""
    ctx, failure = mla_clean
    assert failure is None, failure.report("serve") if isinstance(failure, CheckFailure) else failure
    p = dict(ctx.properties)
    assert p["harness.detail.serve_speculative"].startswith("mtp, "), p["harness.detail.serve_speculative"]
    assert float(p["metric.serve_spec_drafted"]) > 0, p
    assert float(p["metric.serve_worst_budget_use"]) <= 1 and float(p["metric.serve_greedy_mismatches"]) == 0, p
    _, na = _run("llama-3.1-8b", variant="mtp", results_dir=results)
    assert isinstance(na, NotApplicable) and str(na).startswith("the model has no multi-token-prediction layers"), na


@pytest.mark.slow
def test_a_fault_in_the_verification_forward_fails_the_speculative_item_at_decode_step_1(speculative_fault):
    """serve_spec_fault.py: 2 % on the softmax scale of the forwards that verify drafts. The prompt (the
    prefill, no drafts) is exact; the first token the engine verified is decode step 1."""
    ctx, failure = speculative_fault
    assert isinstance(failure, CheckFailure), failure
    msg = failure.message
    assert msg.startswith("engine vllm differs from float64 (speculative decoding: draft_model, "), msg
    assert "decode step 1 (position 16)" in msg and failure.metric == "serve.step1", (msg, failure.metric)
    assert float(dict(ctx.properties)["metric.serve_prompt_logprob_max_abs_diff"]) <= 1e-4
