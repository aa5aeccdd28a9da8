"""One engine run: the runner script in the engine's venv, supervised.

The runner runs as a ``harness.launch.ProcessGroup`` (its own session, death with the item, the whole
tree killed at the time limit, nothing left behind after it exits, its temporary files in a folder of
harness's removed after it) and talks through two files in the
run directory: ``request.json`` in, ``result.json`` out; its output goes to ``engine.log``, whose tail
is in every error.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from harness.files import atomic
from harness.files.scratch import scratch_dir
from harness.launch.group import ProcessGroup
from harness.launch.status import log_tail
from harness.serve.engine import Engine, env_dir, python


class EngineRunError(Exception):
    """The engine did not produce a result: how it ended and its log's tail, one line."""


class EngineRefused(EngineRunError):
    """The engine's runner refused before loading the model: it runs on another platform than its build
    declares, or the engine's own config validation refused the request (vLLM's ``ModelConfig`` ...).
    A problem of the engine's or of its input, never the model's failure."""


class EngineUnsupported(EngineRunError):
    """The engine has no model code for the checkpoint's architecture (vLLM: not in its ModelRegistry;
    the transformers variant: no such class in the engine's transformers), in the engine's words: the
    item is not applicable there."""


ENGINE_TMP = "harness-engine-"  # prefix of an engine run's temporary folder (scratch_dir: swept if orphaned)


def engine_env(run_dir: Path, engine: Engine | None = None, tmp: Path | None = None) -> dict:
    """The runner's environment: the build's own settings (vLLM on CPU: KV cache space in GiB, its
    OpenMP threads unbound; a vendor's: its runtime's), unless the user set them; then the engine core
    in this process (one process to supervise, and a preloaded file's patches apply to the model that
    runs), no usage statistics, the hub offline. Its caches live beside the run directory, shared by the
    runs of one results folder (never the user's ~/.cache), and its compile cache is off: a compiled graph
    from another run (made before a kernel changed, or with a fault injected) must never stand in for this
    run's. vLLM's model-class inspection is shared wider (``share_inspection``). ``tmp``: the engine's
    temporary folder (TMPDIR), harness's, removed after the run: vLLM puts its file:// rendezvous
    (``vllm_dist_<hex>``) and its ZMQ sockets in the system's, and an engine killed at its time limit or
    by a fault left them there (18 in this machine's /tmp in one day). A short path: a socket's is
    limited to 107 bytes, which a results folder's depth would pass."""
    env = dict(os.environ)
    if tmp is not None:
        env["TMPDIR"] = str(tmp)
    for k, v in (engine.env if engine is not None else ()):
        env.setdefault(k, v)
    env["VLLM_CACHE_ROOT"] = str(run_dir.parent / "vllm-cache")
    env["VLLM_CONFIG_ROOT"] = str(run_dir / "vllm-config")
    env["VLLM_DISABLE_COMPILE_CACHE"] = "1"
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("VLLM_DO_NOT_TRACK", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.pop("PYTHONPATH", None)  # harness's own path must not leak into the engine's venv
    return env


def share_inspection(run_dir: Path, shared: Path) -> None:
    """vLLM's model-class inspection (``VLLM_CACHE_ROOT/modelinfos``: whether the class is a hybrid, takes
    pipeline stages ...) is a subprocess of ~7 s on a start that finds no entry for the class. An entry
    is keyed by the hash of vLLM's own model file, so it depends on the engine's code and never on the
    checkpoint, a run, or a fault preloaded into one: every run of one engine environment shares it
    (``shared``, a folder in harness's folder for that engine). vLLM writes an entry atomically and
    re-inspects where one is stale or unreadable. Where the link cannot be made, the run keeps its own."""
    link = run_dir.parent / "vllm-cache" / "modelinfos"
    if link.exists() or link.is_symlink():
        return
    try:
        shared.mkdir(parents=True, exist_ok=True)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(shared.resolve(), target_is_directory=True)
    except OSError:  # a read-only engines folder, or another run made the link first
        pass


def _during(log: Path) -> str:
    """`` during probe NAME`` where the runner had started a probe and not finished it (it prints ``harness:
    probe NAME starts`` and ``... done``): a probe that hangs is named even when the engine's own lines
    push it out of the log's tail."""
    import re

    try:
        marks = re.findall(r"^harness: probe (\w+) (starts|done)$", log.read_text(errors="replace"), re.M)
    except OSError:
        return ""
    return f" during probe {marks[-1][0]}" if marks and marks[-1][1] == "starts" else ""


def run_engine(engine: Engine, request: dict, run_dir: str | Path, timeout_s: float, root=None) -> dict:
    """Write ``request``, run the engine on it, return its result (EngineRunError when there is none)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    req, res = run_dir / "request.json", run_dir / "result.json"
    res.unlink(missing_ok=True)
    (run_dir / "engine.log").unlink(missing_ok=True)
    atomic.write_json(req, request)
    cmd = [str(python(engine, root)), str(engine.runner_path), str(req), str(res)]
    share_inspection(run_dir, env_dir(engine, root) / "cache" / "modelinfos")
    tmp = scratch_dir(ENGINE_TMP)
    try:
        with ProcessGroup.start(cmd, run_dir, env=engine_env(run_dir, engine, tmp), log_name="engine.log") as group:
            ended = group.wait(deadline_s=timeout_s)
            if not ended.ok or not res.is_file():
                tail = " / ".join(log_tail(group.log, 4))
                how = (f"killed at its time limit ({timeout_s:g} s){_during(group.log)}" if ended.how == "timeout"
                       else f"exited with code {ended.code} and no result" if ended.how == "exited" else ended.how)
                raise EngineRunError(f"engine {engine.name} {how}" + (f"; engine.log: {tail}" if tail else ""))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # the group is gone: nothing of the engine still writes there
    out = json.loads(res.read_text())
    if out.get("unsupported"):
        raise EngineUnsupported(f"engine {engine.name} ({out.get('engine')} {out.get('version')}) does not serve this "
                                f"model: {out['unsupported']}")
    if out.get("refused"):
        raise EngineRefused(f"engine {engine.name} refused to run: {out['refused']}")
    return out
