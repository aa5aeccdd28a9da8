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
needs - is "unsupported" there too, never the engine failing on the model), and every scheduler step
is recorded (tokens, requests) so that a probe can show the feature ran.

Probes. ``batch`` is served as a client makes a server batch: the group's requests posted at once, one
thread each, and the core's step record shows that steps held more than one of them. The others reach
into the scheduler's token budget, the prefix cache's reads (a request asking for prompt log-
probabilities skips them, and the OpenAI protocol cannot ask otherwise) and the KV block pool of an
engine in their own process: each comes back as skipped, saying why.
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
PROBE_SKIPPED = ("the server mode serves over HTTP; the probe needs the engine in-process (run the plain item)")
HTTP_PROBES = ("batch",)  # the probes a client of the server can drive


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
    sorted as the offline path sorts them, and the scheduler's steps recorded. Bound to the classes
    before the core unpickles its target (``EngineCoreProc.run_engine_core``, looked up by name: the
    wrapped one)."""
    spec = json.loads(os.environ.get(CORE_ENV) or "null")
    if not spec:
        return
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore, EngineCoreProc

    schedule, run, init = Scheduler.schedule, EngineCoreProc.run_engine_core, EngineCore.__init__
    # a MoE model: the offline runner's capture on every router, bound at construction (before the
    # warm-up compile traces the model); each forward's routes, one line, where the client reads them
    routes = _runner()._Routes() if spec.get("routes") else None

    def write_routes(step):
        with open(spec["routes"], "a") as f:
            f.write(json.dumps(step) + "\n")

    def watched_init(self, *a, **kw):
        init(self, *a, **kw)
        routes.watch_executor(self.model_executor, write_routes)

    def counting_schedule(self, *a, **kw):
        out = schedule(self, *a, **kw)
        if out.total_num_scheduled_tokens:  # one line a step: its tokens and how many requests it held
            with open(spec["steps"], "a") as f:
                f.write(f"{int(out.total_num_scheduled_tokens)} {len(out.num_scheduled_tokens)}\n")
        return out

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

    Scheduler.schedule = counting_schedule
    EngineCoreProc.run_engine_core = staticmethod(run_engine_core)
    if routes is not None:
        EngineCore.__init__ = watched_init


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
    return args + (["--enforce-eager"] if req.get("enforce_eager") else [])


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
        self.routes_file = os.path.join(work_dir, "server.routes.jsonl") if req.get("routed_experts") else None
        req_file = os.path.join(work_dir, "server.request.json")
        for f in (self.port_file, self.status_file, self.steps_file, self.routes_file):
            if f and os.path.exists(f):
                os.unlink(f)
        with open(req_file, "w") as f:
            json.dump(req, f)
        core = {"request": req_file, "status": self.status_file, "steps": self.steps_file, "routes": self.routes_file}
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
        """The engine core's scheduler steps so far: (tokens, requests) each."""
        return [tuple(int(x) for x in line.split()) for line in _lines(self.steps_file)]

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
        probes = [probe(server, req, p) for p in req.get("probes") or []]
    finally:
        server.stop()
    # start_s as the offline path counts it (from the runner's start: its own import of vLLM included);
    # server_start_s: the server's process alone, from its spawn to its first healthy answer
    return {"engine": "vllm", "version": version, "platform": platform, "api": "openai", "start_s": t_ready - t0,
            "server_start_s": t_ready - t_spawn,
            "model_impl": server.log.arch, "compilation": server.log.compilation, "generate_s": t_done - t_ready, "results": results,
            "probes": probes, "engine_said": [], "block_size": req.get("block_size", 32)}


def probe(server, req, p):
    """One probe through the server: ``batch``'s group posted at once (a thread each, released together),
    the server batching them as it batches any clients'; the result as the offline probe's, with the
    core's steps while it ran. The other probes: skipped, saying why."""
    if p["name"] not in HTTP_PROBES:
        return {"name": p["name"], "skipped": PROBE_SKIPPED, "groups": [], "seconds": 0.0}
    print(f"harness: probe {p['name']} starts", flush=True)
    (group,) = p["groups"]
    before, out, errors = len(server.steps()), [None] * len(group), []
    go = threading.Barrier(len(group))

    def one(i, r):
        try:
            go.wait()
            out[i] = result_of(server.complete(req, r["ids"], r["steps"]), r["steps"])
        except Exception as e:  # noqa: BLE001 - raised below, the first request's first
            errors.append((i, e))

    threads = [threading.Thread(target=one, args=(i, r), daemon=True) for i, r in enumerate(group)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.monotonic() - t0
    if errors:
        i, e = min(errors, key=lambda x: x[0])
        raise RuntimeError(f"probe {p['name']}: request {i} of {len(group)}: {e}") from e
    steps = server.steps()[before:]
    print(f"harness: probe {p['name']} done", flush=True)
    return {"name": p["name"], "groups": [out], "seconds": seconds, "preemptions": 0,
            "scheduled_tokens": [t for t, _ in steps], "scheduled_requests": [n for _, n in steps]}


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
