"""Load suite TOML files into validated ``Suite`` objects.

Every error names the file, the field path and what was expected, e.g.
``suites/kimi-k2.toml: prune.num_hidden_layers: must be >= 1, got 0``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ValidationError

from harness import toml
from harness.messages import display
from harness.suite.schema import Suite, suite_model


class SuiteError(Exception):
    """A malformed suite. ``str()`` is the full human message (file: field: problem)."""

    def __init__(self, path: Path | str, problems: list[str]):
        self.path = Path(path)
        self.problems = problems
        shown = display(self.path)
        super().__init__("\n".join(f"{shown}: {p}" for p in problems))


@dataclass(frozen=True)
class LoadedSuite:
    path: Path  # the suite file
    name: str  # suite name (file stem unless model.name says otherwise)
    suite: Suite
    config_path: Path  # resolved path of the real config.json
    raw_config: dict  # config.json as published

    @property
    def weights_path(self) -> Path | None:
        """The checkpoint path: model.weights, or the path in $model.weights_env when it exists
        (None: random weights; harness.weights.source.locate says why)."""
        m = self.suite.model
        w = m.weights or (os.environ.get(m.weights_env, "").strip() if m.weights_env else "")
        if not w:
            return None
        p = (self.path.parent / os.path.expanduser(w)).resolve()
        return p if m.weights or p.exists() else None




def _fmt_loc(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (("." if out else "") + str(part))
    return out or "(top level)"


def _fields_at(model: type[BaseModel], loc: tuple) -> list[str]:
    """Known keys of the table an unknown key sits in, for 'expected one of' hints."""
    cur: type[BaseModel] | None = model
    for part in loc[:-1]:
        field = cur.model_fields.get(str(part)) if cur else None
        ann = field.annotation if field else None
        cur = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
    return sorted(cur.model_fields) if cur else []


def _explain(err: dict) -> str:
    kind, ctx, got = err["type"], err.get("ctx") or {}, err.get("input")
    if kind == "missing":
        return "required key is missing"
    if kind == "extra_forbidden":
        known = _fields_at(suite_model(), err["loc"])
        return "unknown key" + (f" (expected one of: {', '.join(known)})" if known else "")
    if kind in ("greater_than_equal", "greater_than", "less_than_equal", "less_than"):
        op = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}[kind]
        bound = next(iter(ctx.values()))
        return f"must be {op} {bound}, got {got!r}"
    if kind.endswith("_type") or kind.endswith("_parsing"):
        return f"{err['msg'].lower()}, got {type(got).__name__} {got!r}"
    if kind == "literal_error":
        return f"must be one of {ctx.get('expected')}, got {got!r}"
    msg = err["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    return msg


def load_suite(path: str | Path) -> LoadedSuite:
    path = Path(path).resolve()
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise SuiteError(path, [f"cannot read suite file: {e.strerror}"]) from None
    except UnicodeDecodeError as e:
        raise SuiteError(path, [f"not UTF-8 text (byte {e.start}: {e.reason}); TOML files must be UTF-8"]) from None
    try:
        data = toml.loads(text)
    except toml.TOMLDecodeError as e:
        raise SuiteError(path, [f"not valid TOML: {e}"]) from None
    try:
        suite: Suite = suite_model().model_validate(data)
    except ValidationError as e:
        raise SuiteError(path, [f"{_fmt_loc(err['loc'])}: {_explain(err)}" for err in e.errors()]) from None

    problems = []
    config_path = (path.parent / suite.model.config).resolve()
    raw: dict = {}
    if not config_path.is_file():
        problems.append(f"model.config: file not found: {display(config_path)}")
    else:
        try:
            raw = json.loads(config_path.read_text(encoding="utf-8"))
            if not isinstance(raw, dict):
                raise ValueError("top level is not a JSON object")
        except (ValueError, OSError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            raw = {}
            problems.append(f"model.config: {display(config_path)} is not a valid config.json: {e}")
    if raw and not (raw.get("architectures") or suite.model.architecture):
        problems.append("model.config: config.json has no 'architectures'; set model.architecture")
    if suite.model.weights:
        w = (path.parent / suite.model.weights).resolve()
        if not w.exists():
            problems.append(f"model.weights: not found: {display(w)}")
        elif w.is_file() and w.suffix != ".safetensors" and not (
                suite.model.weights_allow_pickle and w.suffix in (".bin", ".pt", ".pth")):
            problems.append(f"model.weights: only safetensors weights are loaded (never pickles), got {w.name}; "
                            "set model.weights_allow_pickle = true to read a pickle with torch.load(weights_only=True)")
    if problems:
        raise SuiteError(path, problems)
    raw = with_declared_quantization(raw, config_path)  # FP8 / NVFP4 declared in hf_quant_config.json
    return LoadedSuite(path, suite.model.name or path.stem, suite, config_path, raw)


# `harness init --suites-dir DIR` records DIR here (one absolute path a line) when it is not the
# configured suites_dir, so that later `harness golden generate NAME` / `harness run NAME` find it.
SUITE_DIRS_FILE = ".harness/suite-dirs"


def discover(root: str | Path = "suites") -> list[Path]:
    """Suite files under ``root`` (not recursive: suites/configs holds the JSON configs)."""
    return sorted(Path(root).glob("*.toml"))


def resolve_names(names: list[str], root: str | Path = "suites") -> list[Path]:
    """Turn CLI arguments (suite names or paths) into suite files; unknown names raise SuiteError.

    A bare name is looked up in ``root``, then in the directories `harness init --suites-dir` wrote
    to (SUITE_DIRS_FILE), then in those listed in ``HARNESS_SUITES_PATH`` (os.pathsep-separated)."""
    extra: list[Path] = []
    rec = Path(SUITE_DIRS_FILE)
    if rec.is_file():
        extra += [Path(x) for x in rec.read_text().splitlines() if x.strip()]
    from harness.settings import env

    extra += env("HARNESS_SUITES_PATH")
    out = []
    for n in names:
        p = Path(n)
        if p.suffix == ".toml" or p.exists():
            out.append(p)
            continue
        cand = Path(root) / f"{n}.toml"
        found = next((d / f"{n}.toml" for d in [Path(root), *extra] if (d / f"{n}.toml").is_file()), None)
        if found is None:
            known = ", ".join(x.stem for x in discover(root)) or "none"
            where = ", ".join(dict.fromkeys(display(d) for d in [Path(root), *extra]))
            raise SuiteError(cand, [f"no such suite {n!r} in {where} (known in {display(Path(root))}: {known})"])
        out.append(found)
    return out


def sidecar_paths(config_path: Path) -> list[Path]:
    """Where a release declares its quantization outside config.json: NVIDIA ModelOpt's
    ``hf_quant_config.json`` beside it (a model directory), or a renamed copy's ``<name>_hf_quant_config.json``
    / ``<name>.hf_quant_config.json`` (aiconfigurator vendors ``<x>_config.json`` + ``<x>_hf_quant_config.json``)."""
    stem = config_path.stem
    out = [config_path.with_name("hf_quant_config.json")] if config_path.name == "config.json" else []
    base = stem[: -len("_config")] if stem.endswith("_config") else stem
    return out + [config_path.with_name(f"{base}_hf_quant_config.json"), config_path.with_name(f"{stem}.hf_quant_config.json")]


def with_declared_quantization(raw: dict, config_path: Path | None) -> dict:
    """``raw`` with the quantization a sidecar declares as its ``quantization_config`` when config.json
    has none (top level or text_config): NVIDIA's FP8 and NVFP4 releases of Llama-3.1-70B-Instruct,
    Nemotron-3-Super/Ultra, DeepSeek-V3.x, GLM-5 and Qwen3-235B declare theirs only in
    hf_quant_config.json, so a reader of config.json alone saw bf16 and the quantization check made no
    item. ``_declared_in`` names the file. An unreadable sidecar is left alone (config.json stands)."""
    import json

    if config_path is None or raw.get("quantization_config") or \
            isinstance(raw.get("text_config"), dict) and raw["text_config"].get("quantization_config"):
        return raw
    for p in sidecar_paths(Path(config_path)):
        if not p.is_file():
            continue
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        q = data.get("quantization") if isinstance(data, dict) else None
        if isinstance(q, dict) and q.get("quant_algo"):
            producer = (data.get("producer") or {}).get("name") or "modelopt"
            return {**raw, "quantization_config": {"quant_method": producer, **q, "_declared_in": p.name}}
    return raw
