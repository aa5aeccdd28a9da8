"""harness.serve.verdict: the serve item's failure, the root cause first. No engine: verdicts built from
rows as the judge makes them."""

from __future__ import annotations

from harness.serve.judge import Row, Verdict
from harness.serve.probes import Outcome, speculated
from harness.serve.verdict import failure

SPEC = {"method": "draft_model", "drafted": 12, "accepted": 9, "verify_steps": 4}


def _bad(kind="step", index=1, position=16, name=""):
    return Row(kind, 0, index, position, ref_token=7, err=0.5, budget=1e-4, chosen=7 if kind == "step" else None,
               name=name)


def _ok():
    return Verdict([Row("prompt", 0, 0, 0, 3, 0.0, 1e-4)])


def test_a_clean_item_passes_and_speculation_is_said_with_its_figures():
    assert failure("vllm", _ok(), None, 1e-4, [], speculated({"speculative": SPEC})) is None
    did, problem = speculated({"speculative": SPEC})
    assert did == "draft_model, 12 draft token(s) verified in 4 step(s), 9 accepted" and problem is None
    assert speculated({}) is None  # not speculating: nothing said


def test_speculation_that_drafted_nothing_fails_as_not_run_never_as_passed():
    spec = speculated({"speculative": dict(SPEC, drafted=0, accepted=0, verify_steps=0)})
    f = failure("vllm", _ok(), None, 1e-4, [], spec)
    assert f["message"] == ("speculative decoding did not run: the engine proposed no draft token (draft_model, "
                            "0 draft token(s) verified in 0 step(s), 0 accepted)") and f["metric"] == "serve.speculative"


def test_the_plain_runs_bad_position_leads_and_says_how_the_engine_decoded():
    probe = Outcome("batch", 0.1, "6 requests", verdict=Verdict([_bad(name="prompt 0")]))
    f = failure("vllm", Verdict([_bad()]), None, 1e-4, [probe], speculated({"speculative": SPEC}))
    assert f["message"].startswith("engine vllm differs from float64 (speculative decoding: draft_model, 12 draft "
                                   "token(s) verified in 4 step(s), 9 accepted): prompt 0 decode step 1 (position 16)")
    assert f["message"].endswith("first of 1 position(s) over budget (probes failing: batch)"), f["message"]
    assert f["metric"] == "serve.step1" and f["position"] == 16 and f["tolerance"] == 1e-4


def test_a_probe_fails_only_after_the_plain_run_and_speculation_passed():
    probe = Outcome("prefix", 0.1, "hit: 32 of 40", verdict=Verdict([_bad("prompt", 32, 32, "hit")]))
    f = failure("vllm", _ok(), None, 1e-4, [probe], None)
    assert f["message"].startswith("engine vllm differs from float64 in probe prefix (hit: 32 of 40): hit position 32")
    assert f["metric"] == "serve.prefix.prompt32"
    idle = Outcome("chunked", 0.1, "prefill in 1 chunk(s)", problem="the prompt was prefilled in one step")
    f = failure("vllm", _ok(), None, 1e-4, [idle], None)
    assert f == {"message": "probe chunked did not exercise its feature: the prompt was prefilled in one step "
                            "(prefill in 1 chunk(s)) (probes failing: chunked)", "metric": "serve.chunked"}
