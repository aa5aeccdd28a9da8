"""One vLLM run for harness's `serve` check: a JSON request in, a JSON result out.

    ENGINE_VENV/bin/python vllm_runner.py REQUEST.json RESULT.json

Runs in the engine's own venv (`harness engine setup vllm`), which does not have harness: this file
imports nothing from it (standard library and vLLM only). The request:

    {"model": DIR, "dtype": "float32", "prompts": [[ids...], ...], "k": 5, "steps": 8,
     "max_model_len": 64, "gpu_memory_utilization": 0.1, "preload": [FILE, ...]}

``preload``: Python files run in this process before vLLM builds the engine (a vendor's platform
hooks; the tests' injected faults, e.g. a rotary embedding that is wrong from position 4 on).

The result: per prompt, ``prompt_logprobs`` (one {token id: logprob} per prompt position, null for
position 0: nothing predicts it), ``tokens`` (the greedy continuation) and ``logprobs`` (one
{token id: logprob} per generated token: the top k and the chosen one), plus the engine's version
and its start-up and generate times. Written atomically (a reader never sees half a file).
"""

import importlib.util
import json
import os
import sys
import time


def _logprob_dict(d):
    """vLLM's {token id: Logprob} -> {"id": float} (JSON keys are strings)."""
    return None if d is None else {str(t): float(lp.logprob) for t, lp in d.items()}


def run(req):
    t0 = time.monotonic()
    for i, path in enumerate(req.get("preload") or []):
        # a real module in sys.modules: vLLM's compiler looks up the module of what it traces by name
        spec = importlib.util.spec_from_file_location(f"serve_preload_{i}", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
    import vllm
    from vllm import LLM, SamplingParams

    llm = LLM(model=req["model"], skip_tokenizer_init=True, dtype=req["dtype"], seed=0,
              gpu_memory_utilization=req.get("gpu_memory_utilization", 0.1),
              max_model_len=req.get("max_model_len", 256), max_num_seqs=max(1, len(req["prompts"])))
    t_ready = time.monotonic()
    sp = SamplingParams(max_tokens=req["steps"], temperature=0.0, prompt_logprobs=req["k"], logprobs=req["k"],
                        ignore_eos=True, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": list(p)} for p in req["prompts"]], sp, use_tqdm=False)
    t_done = time.monotonic()
    results = []
    for o in outs:
        c = o.outputs[0]
        results.append({"prompt_logprobs": [_logprob_dict(d) for d in (o.prompt_logprobs or [])],
                        "tokens": [int(t) for t in c.token_ids],
                        "logprobs": [_logprob_dict(d) for d in (c.logprobs or [])]})
    return {"engine": "vllm", "version": vllm.__version__, "start_s": t_ready - t0,
            "generate_s": t_done - t_ready, "results": results}


def main(argv):
    if len(argv) != 3:
        print("usage: vllm_runner.py REQUEST.json RESULT.json", file=sys.stderr)
        return 2
    with open(argv[1]) as f:
        req = json.load(f)
    out = run(req)
    tmp = argv[2] + ".tmp"
    with open(tmp, "w") as f:
        json.dump(out, f)
    os.replace(tmp, argv[2])
    return 0


if __name__ == "__main__":  # vLLM's workers may start this file again (spawn): only the main process runs
    sys.exit(main(sys.argv))
