"""The serve check's ``server`` variant: vLLM's OpenAI-compatible server instead of its offline API.

Vendors ship ``vllm serve``, and some breaks show only there (vllm-ascend #5544: an accuracy drop
behind the API server, not in ``vllm.LLM``). So the runner, given ``"api": "openai"``, serves the same
request through the server. This file has two roles; like the runner it imports nothing from harness
and, on the runner's side, only the standard library:

* **the client** (``serve``, called by vllm_runner.py in the runner's process): starts this file as the
  server, a child of the runner - inside the runner's ProcessGroup, so a hung server goes with the
  runner's tree at the time limit, nothing left behind - on a free loopback port (127.0.0.1, port 0:
  the kernel picks it and the server reports it back; never a port picked here and bound later, which
  another job on the machine can take in between); waits for ``/health`` (the server dying first is
  raised with its log's tail); sends each prompt alone as ``POST /v1/completions``; maps the answers
  into the offline path's result format, plus ``"api": "openai"``;
* **the server** (``python vllm_server.py REQUEST PORT_FILE STATUS_FILE VLLM_ARGS...``): runs the
  ``preload`` files, then vLLM's API server entry point in this process (what ``vllm serve`` runs).

Where the model runs. vLLM 0.32's API server always runs its engine core in a child process
(``AsyncLLM`` -> ``make_async_mp_client``; it does not read ``VLLM_ENABLE_V1_MULTIPROCESSING``, which
only the offline ``LLM`` honours), started by ``multiprocessing`` with ``spawn`` (its CLI's
``cli_env_setup``). A spawned child imports the parent's main script as ``__mp_main__`` before it
unpickles its target, so the preload files run at this module's top level, in the API server and
again in the engine core (and in any worker the core spawns), before the model is built; with
``fork`` the child inherits them. Either way a preloaded fault lands where the model runs.

The engine core's hooks (``_core_hooks``, run in the spawned core through ``__mp_main__`` as the
preload is): an exception while the core builds the engine is sorted by the runner's own ``_refusal``
(a ``NotImplementedError`` while the model class is built - vLLM's CPU platform lacking what the model
needs - is "unsupported" there too, never the engine failing on the model); every scheduler step
(tokens, requests) and every preemption is recorded, so that a probe can show the feature ran; and the
probes' settings come from the client through a control file (``_Control``).

Probes: all four, as the offline runner serves them, their settings handed to the core before their
requests: the prefix cache emptied; ``chunked``'s token budget per step; ``preempt``'s KV pages (all
but what its requests need, held out of the pool by the core, counted by the runner's own
``_free_blocks``); ``prefix``'s hit request allowed to read the prefix cache though it asks for prompt
log-probabilities (the OpenAI protocol has no way to ask; the core knows it by its prompt). Each group's
requests are posted at once (a thread each, released together), as a server's clients arrive.
Routed experts: vLLM returns them (``routed_experts`` in the response, with
``--enable-return-routed-experts``) only through its aux-output connector, which needs its model
runner V2, which needs Triton: not on CPU (config validation refuses the server). So, as the offline
runner does, the engine core's hook binds the runner's capture (``_Routes``) to every MoE router and
writes each forward's routes as a line; the client reads the lines each plain request added (the
plain requests go one after the other: a request's forwards are its own).
"""

import collections
import functools
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

PRELOAD_ENV = "SERVE_RUNNER_PRELOAD"  # the preload files, a JSON list, for the server and its children
CORE_ENV = "SERVE_RUNNER_CORE"  # {"request", "status", "steps": FILE}: what the engine core's hooks read and write
HOST = "127.0.0.1"


@functools.cache
def _runner():
    """vllm_runner.py, from this file's own directory (its preload and its sorting of refusals)."""
    spec = importlib.util.spec_from_file_location(
        "harness_vllm_runner", os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_runner.py"))
    runner = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(runner)
    return runner


def _preload():
    """Run the preload files in this process, as the runner does in its own: the server's process and,
    through ``__mp_main__``, every process vLLM spawns from it."""
    files = json.loads(os.environ.get(PRELOAD_ENV) or "[]")
    _runner()._preload(files)
    if files:  # the log says in which processes the preload ran (the engine core's is the one that matters)
        print(f"harness: preloaded {len(files)} file(s) in process {os.getpid()} ({__name__})", flush=True)


def _core_hooks():
    """In the engine core (vLLM's spawned child, this file as its ``__mp_main__``): the build's errors
    sorted as the offline path sorts them, the scheduler's steps and preemptions recorded, the probes'
    settings applied (``_Control``), a MoE model's routes captured. Bound to the classes before the core
    unpickles its target (``EngineCoreProc.run_engine_core``, looked up by name: the wrapped one)."""
    spec = json.loads(os.environ.get(CORE_ENV) or "null")
    if not spec:
        return
    _sort_build_errors(spec)
    _watch_scheduler(spec, _Control(spec["control"]))
    if spec.get("routes"):
        _capture_routes(spec)


def _sort_build_errors(spec):
    from vllm.v1.engine.core import EngineCoreProc

    run = EngineCoreProc.run_engine_core

    @functools.wraps(run)
    def run_engine_core(*a, **kw):
        try:
            return run(*a, **kw)
        except Exception as e:  # the model class not buildable here: the runner's "unsupported", in its words
            with open(spec["request"]) as f:
                why = _runner()._refusal(e, json.load(f))
            if why is not None:
                _write(spec["status"], json.dumps(why))
            raise

    EngineCoreProc.run_engine_core = staticmethod(run_engine_core)


def _watch_scheduler(spec, control):
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import Request

    schedule, preempt, skip_reading = Scheduler.schedule, Scheduler._preempt_request, Request.get_skip_reading_prefix_cache
    unit = []

    def record(line):
        with open(spec["steps"], "a") as f:
            f.write(line + "\n")

    def counting_schedule(self, *a, **kw):
        if not unit:  # the prefix cache's hit unit, once (the client grows the prefix probe's shared page to it)
            unit.append(_runner().prefix_unit(self))
            record(f"unit {unit[0] or 0}")
        control.apply(self)
        out = schedule(self, *a, **kw)
        if out.total_num_scheduled_tokens:  # one line a step: its tokens and how many requests it held
            record(f"{int(out.total_num_scheduled_tokens)} {len(out.num_scheduled_tokens)}")
        return out

    def counting_preempt(self, *a, **kw):
        record("preempted")
        return preempt(self, *a, **kw)

    def reading(self):  # a probe's request that is to read the prefix cache (its hit), by its prompt
        return False if control.reads(self.prompt_token_ids) else skip_reading(self)

    Scheduler.schedule, Scheduler._preempt_request = counting_schedule, counting_preempt
    Request.get_skip_reading_prefix_cache = reading
    _finite_placeholders()


def _finite_placeholders():
    """A request that reads the prefix cache and asks for prompt log-probabilities (the prefix probe's
    hit) gets placeholders at its cached positions: vLLM's model runner makes them with
    ``LogprobsTensors.empty_cpu``, uninitialised memory, and the server's JSON encoder refuses the NaN or
    inf that memory may hold ("Out of range float values are not JSON compliant", HTTP 400: the clean
    server test failed so once in three runs). Filled here with the server's own -inf (-9999.0, token 0,
    rank 0); the check never judges those positions (the result's num_cached_tokens says how many)."""
    from vllm.v1.outputs import LogprobsTensors

    empty = LogprobsTensors.empty_cpu

    def filled(*a, **kw):
        t = empty(*a, **kw)
        t.logprob_token_ids.zero_()
        t.logprobs.fill_(-9999.0)
        t.selected_token_ranks.zero_()
        return t

    LogprobsTensors.empty_cpu = staticmethod(filled)


def _capture_routes(spec):
    """A MoE model: the offline runner's capture on every router, bound at construction (before the
    warm-up compile traces the model); each forward's routes, one line, where the client reads them."""
    from vllm.v1.engine.core import EngineCore

    init, routes = EngineCore.__init__, _runner()._Routes()

    def write_routes(step):
        with open(spec["routes"], "a") as f:
            f.write(json.dumps(step) + "\n")

    def watched_init(self, *a, **kw):
        init(self, *a, **kw)
        routes.watch_executor(self.model_executor, write_routes)

    EngineCore.__init__ = watched_init


class _Control:
    """The probes' settings, from the client to the engine core, through a file the client writes
    (atomically) before a probe's requests and removes after them; read at each scheduler step (one
    stat when it did not change). ``{"probe": name, "reset": N, "max_num_scheduled_tokens": ...,
    "free": PROBE, "read": [[ids...], ...]}``: the prefix cache emptied once per ``reset``; the token
    budget per step (chunked prefill); all but the probe's pages taken out of the KV block pool and held
    (the runner's own count, ``_free_blocks``: preemption); the prompts that may read the prefix cache
    though they ask for prompt log-probabilities (the hit). Gone: every setting undone."""

    def __init__(self, path):
        self.path, self.stamp, self.now, self.reset = path, None, {}, None
        self.budget, self.held, self.read = None, [], set()

    def reads(self, ids):
        return tuple(ids) in self.read

    def apply(self, sched):
        try:
            st = os.stat(self.path)
            stamp = (st.st_ino, st.st_mtime_ns, st.st_size)  # each write is a new file (os.replace)
        except FileNotFoundError:
            stamp = None
        if stamp == self.stamp:
            return
        self.stamp = stamp
        now = {}
        if stamp is not None:
            with open(self.path) as f:
                now = json.load(f)
        pool = sched.kv_cache_manager.block_pool
        if self.budget is None:
            self.budget = sched.max_num_scheduled_tokens
        if self.held:
            pool.free_blocks(self.held)
            self.held = []
        if now.get("reset") is not None and now.get("reset") != self.reset:
            self.reset = now["reset"]
            if not sched.reset_prefix_cache():
                raise RuntimeError(f"the engine refused to empty its prefix cache before probe {now.get('probe')}")
        sched.max_num_scheduled_tokens = int(now.get("max_num_scheduled_tokens") or self.budget)
        if now.get("free"):
            free = _runner()._free_blocks(now["free"], sched.cache_config.block_size,
                                          max(1, len(sched.kv_cache_config.kv_cache_groups)))
            self.held = pool.get_new_blocks(max(0, pool.get_num_free_blocks() - int(free)))
        self.read = {tuple(ids) for ids in now.get("read") or []}
        self.now = now


if __name__ in ("__main__", "__mp_main__"):  # the server and what it spawns; never the runner's import
    _preload()
if __name__ == "__mp_main__":
    _core_hooks()


# --- the response -> the runner's result ---------------------------------------------------------------

def _token_id(key):
    """``token_id:123`` (return_tokens_as_token_ids) -> "123"; anything else is a server that ignored it."""
    if not key.startswith("token_id:"):
        raise ValueError(f"the server returned a top-logprob key {key!r}, not token_id:N "
                         "(return_tokens_as_token_ids was not honoured)")
    return str(int(key[len("token_id:"):]))


def _lp(x):
    # the server clamps -inf to -9999.0 (OpenAI's JSON); the offline path returns -inf
    return float("-inf") if float(x) <= -9999.0 else float(x)


def result_of(resp, steps=None):
    """One /v1/completions response (one prompt, n=1) -> the offline path's per-prompt result:
    ``prompt_logprobs`` (per prompt position {"id": logprob}, null for position 0), ``tokens``,
    ``logprobs`` (per generated token {"id": logprob}: the top k and the chosen one), ``num_cached_tokens``."""
    (c,) = resp["choices"]
    if c.get("token_ids") is None or c.get("logprobs") is None or c.get("prompt_logprobs") is None:
        raise ValueError("the server's completion has no token_ids, logprobs or prompt_logprobs "
                         f"(keys: {', '.join(sorted(k for k, v in c.items() if v is not None))})")
    tokens = [int(t) for t in c["token_ids"]]
    # prompt_logprobs: vLLM's own {token id: Logprob} per position, serialized as {"id": {"logprob": ...}}
    plp = [None if d is None else {str(int(t)): _lp(v["logprob"]) for t, v in d.items()} for d in c["prompt_logprobs"]]
    top = c["logprobs"]["top_logprobs"]
    lps = [None if d is None else {_token_id(t): _lp(v) for t, v in d.items()} for d in top]
    if len(lps) != len(tokens) or (steps is not None and len(tokens) != steps):
        raise ValueError(f"the server returned {len(tokens)} token(s) and {len(lps)} logprob entries "
                         f"for {steps} step(s)")
    details = (resp.get("usage") or {}).get("prompt_tokens_details") or {}
    return {"prompt_logprobs": plp, "tokens": tokens, "logprobs": lps,
            "num_cached_tokens": int(details.get("cached_tokens") or 0)}


# --- the client (the runner's process) ---------------------------------------------------------------------

def server_args(req, port=0):
    """vLLM's server arguments: the settings the offline path passes to ``vllm.LLM``, flag for flag."""
    args = ["--model", req["model"], "--dtype", req["dtype"], "--seed", "0", "--skip-tokenizer-init",
            "--max-model-len", str(req.get("max_model_len", 256)), "--block-size", str(req.get("block_size", 32)),
            "--max-num-seqs", str(req.get("max_num_seqs") or max(1, len(req["prompts"]))),
            "--gpu-memory-utilization", str(req.get("gpu_memory_utilization", 0.1)), "--enable-prefix-caching",
            "--model-impl", req.get("model_impl", "auto"), "--host", HOST, "--port", str(port),
            # cached_tokens in the usage (the result's num_cached_tokens); stats every 10 s would fill the log
            "--enable-prompt-tokens-details", "--disable-log-stats"]
    backend, _why = _runner().attention_backend(req)
    return (args + (["--enforce-eager"] if req.get("enforce_eager") else [])
            + (["--attention-backend", backend] if backend else []))


class _Log:
    """The server's output copied line by line into the runner's (engine.log), its tail kept for errors,
    and what the engine said about itself picked out of it."""

    def __init__(self, stream):
        self.tail = collections.deque(maxlen=12)
        self.arch = self.compilation = None
        self.thread = threading.Thread(target=self._pump, args=(stream,), daemon=True)
        self.thread.start()

    def _pump(self, stream):
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="replace")
            sys.stdout.write(line)
            sys.stdout.flush()
            if line.strip():
                self.tail.append(line.strip())
            m = re.search(r"Resolved architecture: (\w+)", line)
            if m:
                self.arch = m.group(1)
            # the engine core's config line: its compilation as the offline path reports it (mode/backend)
            mode, backend = re.search(r"'mode': <CompilationMode\.(\w+)", line), re.search(r"'backend': '(\w*)'", line)
            if "Initializing a V1 LLM engine" in line and mode and backend:
                self.compilation = f"{mode.group(1)}/{backend.group(1) or '-'}"

    def said(self):
        return " / ".join(self.tail)


def _lines(path):
    try:
        with open(path) as f:
            return [line for line in f if line.strip()]
    except FileNotFoundError:
        return []


def _post(url, body, timeout):
    data = json.dumps(body).encode()
    r = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(r, timeout=timeout) as f:
            return json.loads(f.read())
    except urllib.error.HTTPError as e:  # the server's own error message, one line
        text = " ".join(e.read().decode(errors="replace").split())[:400]
        raise RuntimeError(f"POST {url}: HTTP {e.code}: {text}") from None


def _healthy(url):
    try:
        with urllib.request.urlopen(url, timeout=5) as f:
            return f.status == 200
    except (urllib.error.URLError, OSError):
        return False  # not listening yet, or still starting (503)


class Server:
    """vLLM's OpenAI server as this process's child, in a process group of its own (one killpg ends it
    and the engine core it spawned); inside the runner's session, so harness's kill of the runner's
    tree reaches it too."""

    def __init__(self, req, work_dir, python=sys.executable):
        self.port_file = os.path.join(work_dir, "server.port")
        self.status_file = os.path.join(work_dir, "server.status.json")
        self.steps_file = os.path.join(work_dir, "server.steps")
        self.control_file = os.path.join(work_dir, "server.control.json")
        self.routes_file = os.path.join(work_dir, "server.routes.jsonl") if req.get("routed_experts") else None
        req_file = os.path.join(work_dir, "server.request.json")
        for f in (self.port_file, self.status_file, self.steps_file, self.routes_file, self.control_file):
            if f and os.path.exists(f):
                os.unlink(f)
        with open(req_file, "w") as f:
            json.dump(req, f)
        core = {"request": req_file, "status": self.status_file, "steps": self.steps_file, "routes": self.routes_file,
                "control": self.control_file}
        env = dict(os.environ, **{PRELOAD_ENV: json.dumps(list(req.get("preload") or [])), CORE_ENV: json.dumps(core)})
        cmd = [python, os.path.abspath(__file__), req_file, self.port_file, self.status_file, *server_args(req)]
        print("harness: starting the OpenAI server: " + " ".join(cmd[5:]), flush=True)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env, process_group=0)
        self.log = _Log(self.proc.stdout)
        self.base = None

    def status(self):
        """What the server wrote before it died: a refusal of the engine's (the runner's ``refused`` /
        ``unsupported``), else None."""
        try:
            with open(self.status_file) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def wait_ready(self, limit_s=None):
        """Until ``/health`` answers 200. The server dying first is raised with its log's tail; without
        ``limit_s`` the runner's own time limit (harness kills its tree) bounds the wait."""
        t0 = time.monotonic()
        while True:
            rc = self.proc.poll()
            if rc is not None:
                self.log.thread.join(timeout=5)
                return rc
            if self.base is None and os.path.exists(self.port_file):
                with open(self.port_file) as f:
                    self.base = f"http://{HOST}:{int(f.read())}"
                print(f"harness: the OpenAI server listens on {self.base}", flush=True)  # vLLM's own line says :0
            if self.base is not None and _healthy(self.base + "/health"):
                return None
            if limit_s is not None and time.monotonic() - t0 > limit_s:
                raise RuntimeError(f"the OpenAI server did not answer /health within {limit_s:g} s; "
                                   f"its log: {self.log.said()}")
            time.sleep(0.5)

    def complete(self, req, ids, steps, keep=None):
        body = {"model": req["model"], "prompt": list(ids), "max_tokens": steps, "temperature": 0.0,
                "ignore_eos": True, "logprobs": req["k"], "prompt_logprobs": req["k"],
                "return_tokens_as_token_ids": True, "return_token_ids": True}
        resp = _post(self.base + "/v1/completions", body, timeout=600)
        if keep is not None:  # the server's own words beside the result, for a look at what was mapped
            with open(keep, "a") as f:
                f.write(json.dumps(resp) + "\n")
        return resp

    def steps(self):
        """The engine core's record so far: (tokens, requests) a scheduler step, "preempted" a preemption."""
        return [line.strip() if line.startswith("preempted") else tuple(int(x) for x in line.split())
                for line in _lines(self.steps_file) if not line.startswith("unit ")]

    def prefix_unit(self):
        """The engine core's prefix-cache hit unit in tokens (``prefix_unit``; None: not said yet)."""
        said = [int(line.split()[1]) for line in _lines(self.steps_file) if line.startswith("unit ")]
        return (said[0] or None) if said else None

    def control(self, settings):
        """The probes' settings for the engine core (``_Control``); None: none."""
        if settings is None:
            if os.path.exists(self.control_file):
                os.unlink(self.control_file)
        else:
            _write(self.control_file, json.dumps(settings))

    def routes(self):
        """The engine core's captured forwards so far ({layer: per-row ids} each; [] without routes)."""
        return [json.loads(line) for line in _lines(self.routes_file)] if self.routes_file else []

    def stop(self):
        """SIGTERM to the server's group (vLLM shuts its engine core down), SIGKILL after 30 s."""
        if self.proc.poll() is None:
            for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        try:  # the engine core may outlive the server by a moment: the group, whatever is left of it
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.log.thread.join(timeout=5)


def serve(req, work_dir, t0, version, platform):
    """The runner's result for ``req`` served through the OpenAI server (the offline path's format)."""
    t_spawn = time.monotonic()
    server = Server(req, work_dir)
    try:
        rc = server.wait_ready(req.get("server_start_s"))
        if rc is not None:
            said = server.status()
            if said:  # the engine refused what it was asked (its config validation): not the model's failure
                return {"engine": "vllm", "version": version, "api": "openai", **said}
            raise RuntimeError(f"the OpenAI server exited with code {rc} before it was ready; its log: {server.log.said()}")
        t_ready = time.monotonic()
        # each prompt alone, one request after the other: the plain path
        keep = os.path.join(work_dir, "server.responses.jsonl")
        if os.path.exists(keep):
            os.unlink(keep)
        results = []
        for p in req["prompts"]:
            before = len(server.routes())
            results.append(result_of(server.complete(req, p, req["steps"], keep), req["steps"]))
            if server.routes_file:  # the forwards of this request alone: its prefill, then its steps
                captured = server.routes()[before:]
                layers = max((int(k) for step in captured for k in step), default=-1) + 1
                results[-1]["routed_experts"] = _runner().positions(captured, layers)
        t_done = time.monotonic()
        probes = [probe(server, req, p, i + 1) for i, p in enumerate(req.get("probes") or [])]
    finally:
        server.stop()
    # start_s as the offline path counts it (from the runner's start: its own import of vLLM included);
    # server_start_s: the server's process alone, from its spawn to its first healthy answer
    return {"engine": "vllm", "version": version, "platform": platform, "api": "openai", "start_s": t_ready - t0,
            "server_start_s": t_ready - t_spawn,
            "model_impl": server.log.arch, "compilation": server.log.compilation, "generate_s": t_done - t_ready, "results": results,
            "probes": probes, "engine_said": [], "block_size": req.get("block_size", 32),
            **({"attention": why} if (why := _runner().attention_backend(req)[1]) else {})}


def _concurrently(server, req, group):
    """One group's requests posted at once (a thread each, released together by a barrier), as a server's
    clients arrive: the server batches what it holds at a step. Results in the group's order."""
    out, errors = [None] * len(group), []
    go = threading.Barrier(len(group))

    def one(i, r):
        try:
            go.wait()
            out[i] = result_of(server.complete(req, r["ids"], r["steps"]), r["steps"])
        except Exception as e:  # noqa: BLE001 - raised below, the first request's first
            errors.append((i, e))

    threads = [threading.Thread(target=one, args=(i, r), daemon=True) for i, r in enumerate(group)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        i, e = min(errors, key=lambda x: x[0])
        raise RuntimeError(f"request {i} of {len(group)}: {e}") from e
    return out


def probe(server, req, p, n=0):
    """One probe through the server, its settings handed to the engine core first (``_Control``: the
    prefix cache emptied, the token budget, the KV pages left free, the requests that read the prefix
    cache), its groups served in order, each group's requests at once; the result as the offline probe's,
    with the core's steps and preemptions while it ran. ``n``: the probe's number (its cache reset)."""
    print(f"harness: probe {p['name']} starts", flush=True)
    runner, unit = _runner(), server.prefix_unit()
    sent, p = p, runner.fit_prefix(p, unit)
    frees = p.get("free_kv_blocks") is not None or p.get("free_kv_blocks_after_prefill") is not None
    server.control({"probe": p["name"], "reset": n, "max_num_scheduled_tokens": p.get("max_num_scheduled_tokens"),
                    "free": p if frees else None,
                    "read": [r["ids"] for g in p["groups"] for r in g if r.get("read_prefix_cache")]})
    before = len(server.steps())
    t0 = time.monotonic()
    try:
        groups = [_concurrently(server, req, g) for g in p["groups"]]
    except RuntimeError as e:
        raise RuntimeError(f"probe {p['name']}: {e}") from e
    finally:
        server.control(None)
    seconds = time.monotonic() - t0
    seen = server.steps()[before:]
    steps = [x for x in seen if isinstance(x, tuple)]
    print(f"harness: probe {p['name']} done", flush=True)
    return {"name": p["name"], "groups": groups, "seconds": seconds, "preemptions": seen.count("preempted"),
            "scheduled_tokens": [t for t, _ in steps], "scheduled_requests": [n for _, n in steps],
            "prefix_unit": unit, **runner.served_ids(sent, p)}


# --- the server (its own process) ---------------------------------------------------------------------------

def _write(path, text):
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def _server_main(argv):
    req_file, port_file, status_file, vllm_args = argv[1], argv[2], argv[3], argv[4:]
    from vllm.entrypoints.launchers import launcher

    make = launcher.create_server_socket

    def create_server_socket(addr, **kw):  # vLLM binds before it builds the engine: the port, as the kernel chose it
        sock = make(addr, **kw)
        _write(port_file, str(sock.getsockname()[1]))
        return sock

    launcher.create_server_socket = create_server_socket
    from vllm.entrypoints.launchers.api_server.entry import main

    sys.argv = [argv[0], *vllm_args]
    try:
        main()
    except Exception as e:
        # the runner's own sorting of an engine-building error: its config validation refusing the request
        # is the engine's or its input's problem, never the model's failure
        with open(req_file) as f:
            why = _runner()._refusal(e, json.load(f))
        if why is not None:
            _write(status_file, json.dumps(why))
        raise
    return 0


if __name__ == "__main__":
    sys.exit(_server_main(sys.argv))
