"""Issue #46 item 4: the serve item's ``server`` variant - vLLM's OpenAI-compatible server over HTTP
(harness/serve/engines/vllm_server.py), what vendors ship, against float64 as the offline path is.

Two engine starts (module fixtures, each its own results folder):

* qwen3-30b-a3b (MoE) float32 through the server passes the check, and the result says ``api openai``;
  the routes, captured by the engine core's hook on every MoE router, are compared at every routed
  position of both prompts; all four probes ran their feature (the engine core's record: a step that
  held several of the batch's requests posted at once, a prefix-cache hit, a chunked prefill, a
  preemption; their settings handed to the core through its control file) and passed;
* llama-3.1-8b with the batch-dependent reduction (tests/checks/serve_batch_fault.py) and the stale KV
  page after a prefix hit (serve_stale_kv_fault.py) preloaded: the plain run (each prompt alone) passes,
  and the probes they reach fail - batch and preempt (two requests at once) and prefix: the preloads
  reached the process where the model runs, vLLM's engine core, which the API server spawns.

A server that vLLM's config validation refuses writes the runner's own sorting of it (``_refusal``,
tests/serve/test_engine_runs.py) for the runner to return: its test, an engine start of ~30 s that
builds no engine, was left out of CI's time. The engine core's build error sorted the same way (a model
the platform cannot build: NotApplicable) is tests/checks/test_serve_day0.py's DeepSeek-V3.2 server item. And fast tests, no engine: a real /v1/completions response
(tests/serve/data/, captured from the server on the exported llama-3.1-8b) mapped into the runner's
result format, held to the offline engine's result for the same prompt captured on the same checkpoint.

The engine's environment comes from `harness engine setup vllm` (.ci/run runs it); where it is missing
the engine tests skip in one line, in CI they fail.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

from harness.backends import get
from harness.checks import CheckContext, CheckFailure, NotApplicable
from harness.checks.serve import ServeCheck
from harness.serve import engine as eng
from harness.suite.loader import load_suite
from tests_support import REPO

FAULT = REPO / "tests" / "checks" / "serve_batch_fault.py"
STALE_KV = FAULT.with_name("serve_stale_kv_fault.py")
DATA = Path(__file__).resolve().with_name("data")


def _server_module():
    # the file the engine's python runs; it imports only the standard library on the runner's side
    spec = importlib.util.spec_from_file_location("vllm_server_under_test", eng.DATA / "vllm_server.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _no_engine(why: str) -> None:
    msg = f"{why}: run `harness engine setup vllm` (.ci/run does)"
    if os.environ.get("CI"):
        pytest.fail(f"the serve tests cannot run in CI: {msg}", pytrace=False)
    pytest.skip(msg)


MOE = "qwen3-30b-a3b"


def _run(results: Path, suite: str = "llama-3.1-8b", **opts):
    ls = load_suite(REPO / "suites" / f"{suite}.toml")
    ctx = CheckContext(ls, get("cpu"), "float32", "server", check="serve")
    try:
        ServeCheck().run(ctx, results_dir=results, **opts)
    except (CheckFailure, NotApplicable) as e:
        return ctx, e
    return ctx, None


def _engine_ready() -> None:
    state = eng.status(eng.get("vllm"))
    if state != "ready":
        _no_engine(f"the vllm engine environment is {state} ({eng.env_dir(eng.get('vllm'))})")


def _run_dir(results: Path, suite: str = "llama-3.1-8b") -> Path:
    return results / "serve" / "runs" / f"{suite}-cpu-float32-server"


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    _engine_ready()
    results = tmp_path_factory.mktemp("server-clean")
    return (*_run(results, MOE), results)


@pytest.fixture(scope="module")
def faulty(tmp_path_factory):
    _engine_ready()
    results = tmp_path_factory.mktemp("server-fault")
    return (*_run(results, preload=[FAULT, STALE_KV]), results)


def test_the_server_variant_passes_and_says_it_served_over_the_openai_api(clean):
    ctx, failure, results = clean
    assert failure is None, failure.report("serve") if isinstance(failure, CheckFailure) else failure
    p = dict(ctx.properties)
    assert 0 < float(p["metric.serve_worst_budget_use"]) <= 1, p
    assert float(p["metric.serve_greedy_mismatches"]) == 0, p
    assert p["harness.detail.serve_engine"].endswith(", api openai"), p["harness.detail.serve_engine"]
    run = _run_dir(results, MOE)
    res = json.loads((run / "result.json").read_text())
    assert res["api"] == "openai" and len(res["results"]) == 2
    # routes from the server's engine core: every position the engine routed (16 prompt tokens and 7 fed
    # back of the 8 steps) in every layer (all of Qwen3-MoE's are MoE), compared with float64's, none flipped
    layers = json.loads((results / "serve" / "export" / f"{MOE}-float32" / "config.json").read_text())
    layers = layers["num_hidden_layers"]
    for r in res["results"]:
        assert len(r["routed_experts"]) == 16 + 7, r["routed_experts"]
        assert all(len(row) == layers and None not in row for row in r["routed_experts"]), r["routed_experts"]
    assert float(p["metric.serve_routes_compared"]) == 2 * 23 * layers, p
    assert float(p["metric.serve_route_flips"]) == 0, p
    # what the server said, request by request, is kept beside the result (what the mapping read)
    assert len((run / "server.responses.jsonl").read_text().splitlines()) == 2
    # every probe ran its feature through the server, its settings handed to the engine core, and passed
    did = p["harness.detail.serve_probe_batch"]
    assert did.startswith("6 requests, up to ") and int(did.split("up to ")[1].split()[0]) > 1, did
    probe = next(x for x in res["probes"] if x["name"] == "batch")
    assert len(probe["groups"][0]) == 6 and max(probe["scheduled_requests"]) > 1, probe["scheduled_requests"]
    assert p["harness.detail.serve_probe_prefix"].startswith("hit: 32 of "), p["harness.detail.serve_probe_prefix"]
    assert p["harness.detail.serve_probe_chunked"].startswith("prefill in "), p["harness.detail.serve_probe_chunked"]
    assert p["harness.detail.serve_probe_preempt"].startswith("1 preemption"), p["harness.detail.serve_probe_preempt"]
    for probe in ("batch", "prefix", "chunked", "preempt"):
        assert 0 < float(p[f"metric.serve_{probe}_budget_use"]) <= 1, (probe, p)
    assert not (run / "server.control.json").exists()  # every probe's settings taken back
    # the server ended with the runner: nothing listens on its port any more (SO_REUSEADDR: the closed
    # connections' TIME_WAIT does not count; a socket still listening there does)
    port = int((run / "server.port").read_text())
    import socket

    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))


def test_faults_preloaded_in_the_servers_engine_core_fail_the_probes_they_reach(faulty):
    ctx, failure, results = faulty
    assert isinstance(failure, CheckFailure), failure
    assert "in probe batch (6 requests, up to " in failure.message, failure.message
    assert failure.message.endswith("(probes failing: batch, prefix, preempt)"), failure.message
    assert failure.metric.startswith("serve.batch."), failure.metric
    p = dict(ctx.properties)
    assert float(p["metric.serve_worst_budget_use"]) <= 1  # each prompt alone: exact
    assert float(p["metric.serve_chunked_budget_use"]) <= 1  # one request, no cache hit: exact
    assert float(p["metric.serve_prefix_budget_use"]) > 1  # the stale page read at the hit
    # the preload ran in the API server and in the engine core vLLM spawned from it (as __mp_main__)
    log = (_run_dir(results) / "engine.log").read_text()
    assert "harness: preloaded 2 file(s) in process" in log and "(__mp_main__)" in log, log[-2000:]


def test_a_completion_response_maps_into_the_offline_result_format():
    """A real response of vLLM's server (llama-3.1-8b float32, prompt 0, k 5, 8 steps) against the offline
    engine's result for the same prompt on the same checkpoint: the same tokens, the same token ids at
    every position and the same log-probabilities (vLLM's CPU kernels are deterministic for a request)."""
    srv = _server_module()
    resp = json.loads((DATA / "completion_response.json").read_text())
    offline = json.loads((DATA / "offline_result.json").read_text())
    got = srv.result_of(resp, steps=8)
    assert set(got) == {"prompt_logprobs", "tokens", "logprobs", "num_cached_tokens"}
    assert got["prompt_logprobs"][0] is None and len(got["prompt_logprobs"]) == 16
    assert got["tokens"] == offline["tokens"] and len(got["tokens"]) == 8
    assert got["num_cached_tokens"] == 0  # prompt log-probabilities: vLLM reads no prefix cache
    for kind in ("prompt_logprobs", "logprobs"):
        for a, b in zip(got[kind], offline[kind], strict=True):
            assert (a is None) == (b is None)
            if a is not None:  # bit for bit: the same engine, the same request, JSON floats round-trip
                assert a == b, (kind, a, b)
    assert got == offline
    for tok, step in zip(got["tokens"], got["logprobs"], strict=True):
        assert str(tok) in step and 5 <= len(step) <= 6  # the top 5 and the chosen one


def test_a_response_the_mapping_cannot_read_is_a_one_line_error():
    srv = _server_module()
    resp = json.loads((DATA / "completion_response.json").read_text())
    c = resp["choices"][0]
    c["logprobs"]["top_logprobs"][0] = {"hello": -0.1}  # a server that ignored return_tokens_as_token_ids
    with pytest.raises(ValueError, match="not token_id:N"):
        srv.result_of(resp)
    del c["token_ids"]
    with pytest.raises(ValueError, match="has no token_ids, logprobs or prompt_logprobs"):
        srv.result_of(resp)
    resp = json.loads((DATA / "completion_response.json").read_text())
    with pytest.raises(ValueError, match="for 9 step"):
        srv.result_of(resp, steps=9)
    resp["choices"][0]["prompt_logprobs"][1] = {"7": {"logprob": -9999.0, "rank": 9, "decoded_token": None}}
    assert srv.result_of(resp)["prompt_logprobs"][1] == {"7": float("-inf")}  # the server's clamp, undone


def test_the_server_gets_the_offline_paths_settings_on_a_loopback_port_chosen_by_the_kernel():
    srv = _server_module()
    req = {"model": "/m", "dtype": "bfloat16", "prompts": [[1, 2]], "max_model_len": 64, "block_size": 32,
           "max_num_seqs": 6, "gpu_memory_utilization": 0.1, "model_impl": "transformers", "enforce_eager": True}
    args = srv.server_args(req)
    flags = dict(zip(args[::1], args[1:], strict=False))
    assert flags["--model"] == "/m" and flags["--dtype"] == "bfloat16" and flags["--seed"] == "0"
    assert flags["--max-model-len"] == "64" and flags["--block-size"] == "32" and flags["--max-num-seqs"] == "6"
    assert flags["--model-impl"] == "transformers" and flags["--host"] == "127.0.0.1" and flags["--port"] == "0"
    for flag in ("--skip-tokenizer-init", "--enable-prefix-caching", "--enforce-eager", "--enable-prompt-tokens-details"):
        assert flag in args
    assert "--enforce-eager" not in srv.server_args({**req, "enforce_eager": False})
