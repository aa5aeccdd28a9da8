"""Project-level settings: ``harness.toml`` at the repository root (or the file named by the
``HARNESS_CONFIG`` environment variable). Every key is declared with type, default and description.

The ``HARNESS_*`` environment variables are settings too, and this module owns them all: each is
declared in :data:`ENV` (name, type, default, description; ``harness validate --schema`` lists
them), read through :func:`env` and passed to child processes through :func:`set_env` /
:func:`unset_env`. No other module names a ``HARNESS_*`` variable (tests/test_settings.py checks).

Example::

    suites_dir = "suites"
    [[backends]]             # a vendor backend harness does not ship
    name = "mydev"
    module = "torch_mydev"   # imported first; absent -> items skip with the import error
    device_type = "mydev"
    collective = "mccl"
    dispatch_key = "PrivateUse1"
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from harness import toml


class CustomBackend(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(description="Name used by suites and --backend.")
    device_type: str = Field(description="torch device type (after any PrivateUse1 rename).")
    collective: str = Field("gloo", description="torch.distributed backend for parallel checks.")
    module: str | None = Field(None, description="Python module to import before use (the vendor's torch plugin).")
    dispatch_key: str | None = Field(None, description="Dispatcher key of its kernels, e.g. PrivateUse1.")
    description: str = Field("", description="Free text shown by `harness backends`.")
    op_list: str | None = Field(
        None, description="Declared operator list (one aten overload per line, see docs/inspect.md), relative "
        "to this file; used by `harness inspect` and the ops check when the backend is not installed.")
    compile_backend: str | None = Field(
        None, description="torch.compile backend of its compiled path (a registered dynamo backend name; unset: "
        "inductor; 'none': no compiler, the compile check is not applicable). docs/compile.md.")


class CustomEngine(BaseModel):
    """A serving-engine build harness does not ship (docs/serving.md, "A vendor's engine")."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(description="The build's name: its environment is .harness/engines/NAME (`harness engine setup "
                      "NAME`).", pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.+-]{0,99}$")
    engine: str = Field("", description="The engine it is a build of, as --engine names it (vllm); empty: NAME.",
                        pattern=r"^([A-Za-z0-9_][A-Za-z0-9_.+-]{0,99})?$")
    backends: list[str] = Field(min_length=1, description="The harness backends it serves (npu).")
    pins: str | None = Field(None, description="pip requirements file, every line pinned, relative to this file: "
                             "harness makes the environment (.harness/engines/NAME). Exactly one of pins and python.")
    python: str | None = Field(None, description="An existing environment's interpreter (a vendor's container, a "
                               "build installed from its own tarball), absolute or relative to this file: setup "
                               "checks that the engine and its plugin import there and installs nothing.")
    runner: str = Field("vllm_runner.py", description="The runner script (request.json in, result.json out; "
                        "docs/serving.md): a bare name is harness's own (vllm_runner.py), else relative to this file.")
    plugin: str | None = Field(None, description="The platform plugin's module (vllm_ascend): imported once at setup.",
                               pattern=r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
    platform: str = Field(description="The platform the engine must report (vLLM: current_platform.device_type, npu); "
                          "a run on another platform (the plugin did not activate) is refused before the model loads.",
                          pattern=r"^[A-Za-z0-9_]+$")
    architectures: list[str] = Field(default_factory=list, description="transformers architectures the serve check "
                                     "drives through it (LlamaForCausalLM, ...); empty: whatever the engine itself "
                                     "serves (its runner asks the engine and says why not, in the engine's words).")
    remove: list[str] = Field(default_factory=list, description="Packages uninstalled after the pins (built for "
                              "another torch, never needed for text models).")
    env: dict[str, str] = Field(default_factory=dict, description="The runner's environment on top of harness's "
                                "(VLLM_*, the vendor's runtime settings).")
    variants: list[Literal["transformers", "eager", "server", "speculative"]] = Field(
        default_factory=list, description="Variants of the serve item it serves besides the plain one (the engine's "
        "own model code, its default mode), each a nightly item: transformers (vLLM's model_impl=\"transformers\"), "
        "eager (enforce_eager: no compilation, no graphs), server (its OpenAI-compatible server over HTTP), "
        "speculative (its speculative decoding with a draft model).")
    description: str = Field("", description="Free text shown by `harness engine show`.")

    @model_validator(mode="after")
    def _pins_or_python(self):
        if bool(self.pins) == bool(self.python):
            raise ValueError("give pins (harness makes its environment) or python (an existing one), not both and "
                             "not neither")
        return self


class KernelMap(BaseModel):
    model_config = ConfigDict(extra="forbid")
    paths: list[str] = Field(description="Globs of repository paths (a vendor's kernel sources: csrc/attention/**).")
    ops: list[str] = Field(description="The operators those paths implement: aten::mm, aten.bmm.default, or "
                           "fnmatch patterns (aten::_scaled_dot_product_*).")


class SelectSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kernels: list[KernelMap] = Field(default_factory=list, description="Kernel paths -> ops: a change under "
                                     "them selects the suites whose op inventory has one of the ops.")
    ignore: list[str] = Field(default_factory=lambda: ["docs/**", "*.md", "**/*.md", "LICENSE*"],
                              description="Paths no item depends on (a change to only these selects nothing).")


class Settings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    suites_dir: str = Field("suites", description="Where suite TOML files live.")
    golden_dir: str = Field("golden", description="Where goldens live.")
    results_dir: str = Field("results", description="Where `harness run` writes JUnit XML and summaries.")
    durations_file: str = Field("durations.json", description="Recorded item durations (`harness durations "
                                "update`): time limits of isolated items and shard balance.")
    backends: list[CustomBackend] = Field(default_factory=list, description="Custom backends.")
    engines: list[CustomEngine] = Field(default_factory=list, description="Serving-engine builds (a vendor's "
                                        "engine with its platform plugin; docs/serving.md).")
    confirm_reruns: int = Field(0, ge=0, le=20, description="Reruns of a failed or erroring item, each in a fresh "
                                "worker, before it is reported: deterministic / flaky / infrastructure "
                                "(`harness run --confirm N`; CI passes 2; docs/ci.md).")
    select: SelectSettings = Field(default_factory=SelectSettings, description="`harness select`: which items "
                                   "a change can affect (docs/ci.md, 'Selection by change').")
    quarantine_file: str = Field("quarantine.json", description="The quarantine (flaky items that report but fail "
                                 "no run): read by `harness run`, maintained by `harness compare --quarantine` "
                                 "and `harness quarantine`.")


class SettingsError(Exception):
    pass


# --- HARNESS_* environment variables ---------------------------------------------------------------
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def _bool(raw: str) -> bool:
    v = raw.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ValueError(f"expected a boolean ({'/'.join(_TRUE)} or {'/'.join(_FALSE[1:])}), got {raw!r}")


def _int(raw: str) -> int:
    v = raw.strip()
    if not v.lstrip("-").isdigit():  # int() would take "1_000" and " 7 "; a setting is plain digits
        raise ValueError(f"expected an integer, got {raw!r}")
    return int(v)


def _paths(raw: str) -> list[Path]:
    return [Path(x) for x in raw.split(os.pathsep) if x.strip()]


_PARSE: dict[str, Callable[[str], Any]] = {
    "str": str, "path": lambda raw: Path(raw), "paths": _paths, "int": _int, "bool": _bool}


@dataclass(frozen=True)
class EnvVar:
    """One ``HARNESS_*`` environment variable (the way tox 4's config loader declares a key)."""

    name: str
    type: str  # str | path | paths (os.pathsep-separated) | int | bool
    default: Any
    description: str
    internal: bool = False  # set by harness for its own child processes, not by users
    range: tuple[int, int] | None = None  # an int's bounds, inclusive (every int variable has them)

    def parse(self, raw: str) -> Any:
        v = _PARSE[self.type](raw)
        if self.range is not None and not self.range[0] <= v <= self.range[1]:
            raise ValueError(f"{v} is outside {self.range[0]} .. {self.range[1]}")
        return v


ENV: dict[str, EnvVar] = {v.name: v for v in (
    EnvVar("HARNESS_CONFIG", "path", None, "The settings file to use instead of ./harness.toml."),
    EnvVar("HARNESS_RESULTS_DIR", "path", None, "Where checks put their files (plots, samples): set by "
           "`harness run` / --harness-results for the run and its workers; else `results_dir`."),
    EnvVar("HARNESS_GOLDEN_DIR", "path", None, "Where goldens are read and written, instead of `golden_dir`."),
    EnvVar("HARNESS_CACHE_DIR", "path", None, "Cache of traced operator inventories "
           "(default: $XDG_CACHE_HOME/harness, else ~/.cache/harness)."),
    EnvVar("HARNESS_SUITES_PATH", "paths", [], "More directories where bare suite names are looked up "
           "(os.pathsep-separated), after `suites_dir` and the ones `harness init --suites-dir` recorded."),
    EnvVar("HARNESS_PERF", "bool", False, "Generate the perf check's items in every scope and for every "
           "suite (the golden-update and nightly workflows set it)."),
    EnvVar("HARNESS_WEIGHTS_VERBOSE", "bool", False, "The real-weights check adds its per-layer report "
           "to the item's notes even when it passes."),
    EnvVar("HARNESS_TORCHRUN_ARGS", "str", None, "Rendezvous arguments for the parallel check's torchrun "
           "launches, replacing `--standalone --nnodes 1` (shell-split; docs/parallel.md)."),
    EnvVar("HARNESS_ENGINE", "str", None, "The serving engine the serve check runs instead of the suite's "
           "`checks.serve.engine` (`harness run --engine`; set for the run's workers by the pytest plugin)."),
    EnvVar("HARNESS_NODES", "int", 1, "Nodes the parallel check's launches span (`harness run --nodes`; set "
           "for the run's workers by the pytest plugin).", range=(1, 4096)),
    EnvVar("HARNESS_NODE_LAUNCHER", "str", None, "How a multi-node launch reaches its nodes: netns, srun or agents "
           "(`harness run --launcher`; harness/launch/nodes.py)."),
    EnvVar("HARNESS_AGENTS_PORT", "int", 29600, "The port of the agents store `harness run --launcher agents` "
           "serves for `harness node-agent` (harness/launch/agents.py).", range=(1, 65535)),
    EnvVar("HARNESS_LAUNCH_STORE", "str", None, "host:port of a multi-node launch's coordinator store, for its "
           "ranks' wrappers (harness/launch/channel.py).", internal=True),
    EnvVar("HARNESS_LAUNCH_NODE", "int", None, "The node index of a multi-node launch's agent (netns; under "
           "srun SLURM_NODEID says it).", internal=True, range=(0, 4095)),
    EnvVar("HARNESS_LEAK_BYTES", "int", None, "Host memory an isolated worker may keep growing by per item "
           "before it is replaced (default: harness.run.isolation.Limits.leak_bytes).", range=(0, 1 << 50)),
    EnvVar("HARNESS_CERTIFY_FAULT", "str", None, "A known kernel fault (`harness certify --list`) that every "
           "process running an item installs on the dispatch key of the backend HARNESS_CERTIFY_BACKEND names, "
           "before the item: what `harness certify` sets; set by hand to reproduce one of its rows."),
    EnvVar("HARNESS_CERTIFY_BACKEND", "str", None, "The backend whose items get HARNESS_CERTIFY_FAULT "
           "(required with it)."),
    EnvVar("HARNESS_CERTIFY_LOG", "path", None, "A file where each process appends one line the first time a "
           "fault's kernel runs (and one per exception its own code raised): `harness certify` reads it."),
    EnvVar("HARNESS_CPU_THREADS", "int", None, "torch intra-op threads while a check whose models are the pruned "
           "test models runs (smoke, precision, decode, training, compile, quantization, ops) and while `golden "
           "generate` builds its references: default 1 (their tensors are too small to split, and a second thread "
           "per process spin-waits: 3-10x slower on a loaded machine); 0 keeps the process's count.", range=(0, 1024)),
    EnvVar("HARNESS_NUM_THREADS", "int", None, "torch threads of an isolated worker: the launching "
           "process's count, passed down by the pytest plugin.", internal=True, range=(1, 1024)),
    EnvVar("HARNESS_ISOLATION_FDS", "str", None, "'command_fd,result_fd' of an isolated worker's pipes.",
           internal=True),
    EnvVar("HARNESS_ISOLATION_STATUS", "path", None, "The status file an isolated worker reports its "
           "phase and module in.", internal=True),
    EnvVar("HARNESS_PREFETCH_PARENT", "int", None, "Process id of the `harness compare` that started a "
           "baseline prefetch child.", internal=True, range=(1, 1 << 22)),
    EnvVar("HARNESS_LAUNCH_GROUP", "str", None, "Space-separated tokens of the supervised launches "
           "(harness.launch) a process belongs to: the group kill finds escaped descendants by it.", internal=True),
)}


def _declared(name: str) -> EnvVar:
    try:
        return ENV[name]
    except KeyError:
        raise KeyError(f"undeclared environment variable {name!r}: declare it in harness.settings.ENV "
                       f"(declared: {', '.join(ENV)})") from None


def check_environment(environ: MutableMapping[str, str] | None = None) -> list[str]:
    """One line per declared variable set to a value it refuses (``HARNESS_CPU_THREADS=-5``): checked
    once where a run starts, so that a bad setting is the run's usage error and never each item's
    failure blamed on the model."""
    out = []
    for name in ENV:
        try:
            env(name, environ)
        except SettingsError as e:
            out.append(str(e))
    return out


def env(name: str, environ: MutableMapping[str, str] | None = None) -> Any:
    """The typed value of a declared ``HARNESS_*`` variable (its default when unset or empty); a
    malformed value is a SettingsError naming the variable."""
    var = _declared(name)
    raw = (os.environ if environ is None else environ).get(name)
    if raw is None or (raw == "" and var.type != "str"):
        return var.default
    try:
        return var.parse(raw)
    except ValueError as e:
        raise SettingsError(f"${name}: {e}") from None


def set_env(name: str, value: Any, environ: MutableMapping[str, str] | None = None) -> None:
    """Set a declared variable, in ``environ`` (a child process's environment) or in this process's."""
    var = _declared(name)
    if var.type == "paths" and not isinstance(value, str):
        text = os.pathsep.join(str(v) for v in value)
    elif var.type == "bool" and not isinstance(value, str):
        text = "1" if value else "0"
    else:
        text = str(value)
    var.parse(text)  # what is written must read back
    (os.environ if environ is None else environ)[name] = text


def unset_env(name: str, environ: MutableMapping[str, str] | None = None) -> None:
    _declared(name)
    (os.environ if environ is None else environ).pop(name, None)


def env_markdown() -> str:
    """The declared variables as a markdown table (``harness validate --schema``)."""
    rows = ["| variable | type | default | description |", "|---|---|---|---|"]
    for v in ENV.values():
        default = "unset" if v.default is None else f"`{v.default!r}`"
        rows.append(f"| `{v.name}` | `{v.type}` | {default} | "
                    f"{'(set by harness) ' if v.internal else ''}{v.description.replace('|', '/')} |")
    return "\n".join(rows)


def settings_path() -> Path | None:
    p = env("HARNESS_CONFIG")
    if p:
        return p
    p = Path("harness.toml")
    return p if p.exists() else None


@functools.cache
def _load(path: str | None) -> Settings:
    if path is None:
        return Settings()
    p = Path(path)
    try:
        data = toml.loads(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise SettingsError(f"{p}: cannot read harness settings: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise SettingsError(f"{p}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    except toml.TOMLDecodeError as e:
        raise SettingsError(f"{p}: not valid TOML: {e}") from None
    try:
        return Settings.model_validate(data)
    except ValidationError as e:
        msgs = [f"{p}: {'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors()]
        raise SettingsError("\n".join(msgs)) from None


def reset_caches() -> None:
    """Forget what was read: a process forked to run a new command (``harness server``) reads
    harness.toml anew, as a fresh process does."""
    _load.cache_clear()


def load_settings() -> Settings:
    p = settings_path()
    return _load(str(p) if p else None)


# --- where things are written -----------------------------------------------------------------------
def results_root(results_dir: str | Path | None = None) -> Path:
    """Where a check puts its files: the explicit directory, else this run's (HARNESS_RESULTS_DIR,
    set by `harness run` / --harness-results), else the configured results_dir."""
    if results_dir is not None:
        return Path(results_dir)
    return env("HARNESS_RESULTS_DIR") or Path(load_settings().results_dir)


def golden_root(root: str | Path | None = None) -> Path:
    """Where goldens are: the explicit directory, else HARNESS_GOLDEN_DIR, else the configured golden_dir."""
    if root is not None:
        return Path(root)
    return env("HARNESS_GOLDEN_DIR") or Path(load_settings().golden_dir)
