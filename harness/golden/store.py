"""The ``golden/<suite>/`` directory: safetensors files plus ``manifest.json``.

Layout::

    golden/<suite>/manifest.json          versions, config hash, input spec, per-file sha256, shapes, dtypes
    golden/<suite>/inputs.safetensors     input_ids [batch, seq] (stored, never regenerated)
    golden/<suite>/modules.safetensors    captured module outputs and logits (float32; int64 expert ids)
    golden/<suite>/generation.safetensors greedy tokens, logprobs, top-k candidates

Format 2 also stores, for the isolated comparison, what each captured module was called with:
``manifest["module_inputs"][module]`` is a structure of its args/kwargs whose tensor leaves are
``{"o": module}`` (another module's stored output) or ``{"t": key}`` (``<key>::in`` in
``modules.safetensors``, float32 copies of the float64 reference values), and the clean-error
``budgets`` measured per low-precision dtype (``harness.precision.budgets``), and the realistic
``numerics`` gains (``harness.models.numerics``).

Format 3 adds *sections*: what a check beyond the forward pass compares against (``training``:
gradients, optimizer steps, loss trajectory; ``decode``: the cached decode step by step). Each is
``manifest["sections"][name]`` - a dict owned by its producer (the check that declares it: ``harness.golden.sections``)
with at least ``spec`` (the suite knobs it was made with) and ``tensors`` (shape and storage dtype of
each tensor) - and the file ``<name>.safetensors``. A check reads its section with
:meth:`Golden.section`, which refuses a section made with other knobs, so changing a training knob
never invalidates the forward golden's use by the precision check.

Everything loaded is validated as data: names are plain identifiers, every tensor matches the
manifest's shape and storage dtype and is finite, every entry the check needs is present.

In ``sampled`` mode (large models) ``modules.safetensors`` holds, per tensor, a fixed sample of
elements (``<name>`` values, ``<name>::idx`` flat indices) and the manifest holds per-tensor
statistics of the whole tensor.

Writes are atomic in one step, so no kill -9 at any moment leaves a suite without a golden: a new
golden is written into a version folder ``golden/<suite>/v-<time>-<id>/`` (files and folder
fsync'd), and ``golden/<suite>/CURRENT`` (one line: that folder's name) is replaced by one rename;
readers follow ``CURRENT``. Until the rename they read the old version, after it the new one;
then the versions no longer current are pruned. A suite's first golden is built in a hidden
sibling (``.<suite>.tmp-...``) renamed into place whole. A golden without ``CURRENT`` (files
directly in ``golden/<suite>/``, the layout before versions) is read as it is and replaced the
same way. An existing golden is only replaced when asked to. What a killed write leaves behind is
hidden (``.*.tmp-*``, ignored by git) or an unreferenced ``v-*`` folder, and both are removed by
the next write.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from harness.messages import display
from harness.settings import golden_root

FORMAT = 3
FILES = ("inputs", "modules", "generation")
IDX = "::idx"
IN = "::in"
GENERATION_KEYS = ("tokens", "logprobs", "top_ids", "top_logprobs")


class GoldenError(Exception):
    """A golden that cannot be used: missing, corrupt, truncated, or made by another config.
    ``str()`` is a one-line message naming the file."""


def check_name(name: str, source="suite") -> str:
    """A golden's name as a plain path component (harness.files.paths, the one rule for every
    data-derived name)."""
    from harness.files import paths

    why = paths.problem(name)
    if why:
        raise GoldenError(f"{source}: model.name: golden name {why}; not a plain identifier: set a plain "
                          "model.name in the suite")
    return name


def golden_dir(suite_name: str, root: str | Path | None = None) -> Path:
    """``<root>/<suite_name>``, refusing any name that would resolve outside the root (symlinks too)."""
    from harness.files import paths

    base = golden_root(root)
    check_name(suite_name)
    try:
        return paths.join(base, suite_name, source=base, field="golden name")
    except paths.PathRefused as e:
        raise GoldenError(str(e)) from None


def sha256_bytes(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def canonical_hash(obj) -> str:
    return sha256_bytes(json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode())


def config_hash(ls) -> str:
    """What determines the reference numbers besides the input: the published config, the pruning,
    the model section (adapter, architecture, weights path) and the weight seed."""
    s = ls.suite
    p = s.checks.precision
    h = {"config": ls.raw_config, "prune": s.prune.model_dump(mode="json"),
         "model": s.model.model_dump(mode="json", exclude={"name"}), "seed": p.seed}
    if p.numerics != "init":  # the weights' rescaling changes every reference number
        h["numerics"] = [p.numerics, p.attention_logit_std, p.residual_growth]
    return canonical_hash(h)


def input_spec(ls) -> dict:
    p = ls.suite.checks.precision
    return {"batch_size": p.batch_size, "seq_len": p.seq_len, "input_seed": p.seed + 1,
            "generate_tokens": p.generate_tokens, "capture": p.capture, "mode": p.golden_mode,
            "sample_size": p.sample_size if p.golden_mode == "sampled" else None,
            "budget_draws": p.budget_draws}


def sample_indices(numel: int, k: int) -> torch.Tensor:
    """A fixed, scattered, duplicate-free sample of flat indices (no RNG: a multiplicative hash)."""
    if numel <= k:
        return torch.arange(numel)
    prime = 2_654_435_761
    while numel % prime == 0:
        prime += 2
    return (torch.arange(k, dtype=torch.int64) * prime) % numel


def stats(t: torch.Tensor) -> dict:
    x = t.detach().double().flatten()
    if not x.numel():
        return {}
    return {"mean": x.mean().item(), "std": x.std().item() if x.numel() > 1 else 0.0,
            "absmax": x.abs().max().item(), "l2": x.norm().item()}


@dataclass
class Golden:
    path: Path
    manifest: dict
    inputs: torch.Tensor
    modules: dict[str, torch.Tensor]  # values (sampled: only the sample)
    indices: dict[str, torch.Tensor] = field(default_factory=dict)  # sampled mode: flat indices
    generation: dict[str, torch.Tensor] = field(default_factory=dict)
    module_inputs: dict[str, torch.Tensor] = field(default_factory=dict)  # <key> -> stored input tensor
    section_tensors: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # section -> its file

    def section(self, name: str, spec: dict | None = None) -> Section:
        """The section a check compares against; a missing one, or one made with other knobs than
        ``spec`` (the suite's now), is the golden's problem: one line naming the command that fixes it."""
        entry = (self.manifest.get("sections") or {}).get(name)
        fix = f"regenerate with `harness golden generate {self.path.name} --update`"
        if entry is None:
            raise GoldenError(f"{display(self.path / 'manifest.json')}: golden has no {name} section (made before "
                              f"the {name} check, or with it disabled); {fix}")
        if spec is not None and jsonable(spec) != entry.get("spec"):
            raise GoldenError(f"{display(self.path / 'manifest.json')}: the golden's {name} section was made with "
                              f"{entry.get('spec')}, the suite asks for {jsonable(spec)}; {fix}")
        return Section(entry, self.section_tensors.get(name, {}))

    @property
    def structures(self) -> dict[str, dict]:
        """module -> its recorded call (see harness.precision.isolate); empty for format-1/sampled goldens."""
        return self.manifest.get("module_inputs") or {}

    def budgets(self, dtype: str) -> dict:
        return (self.manifest.get("budgets") or {}).get(dtype) or {}

    @property
    def order(self) -> list[str]:
        return list(self.manifest["order"])

    @property
    def sampled(self) -> bool:
        return self.manifest["input_spec"].get("mode") == "sampled"


@dataclass
class Section:
    """One section of a golden: its manifest entry (``spec``, ``tensors`` and whatever its producer
    stores: budgets, orders) and its tensors."""

    entry: dict
    tensors: dict[str, torch.Tensor]


def jsonable(obj):
    """``obj`` as it reads back from the manifest (tuples become lists), for comparing specs."""
    return json.loads(json.dumps(obj, default=str))


def pack_section(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict]:
    """A section's tensors -> (tensors to store, the entry's ``tensors`` table): floating tensors as
    float32, booleans as bool, other integers as int64 (as :func:`pack` stores module outputs)."""
    store, meta = {}, {}
    for key, t in tensors.items():
        if not SECTION_KEY.fullmatch(key):
            raise GoldenError(f"section tensor name {key[:80]!r} is not printable data (letters, digits, ._:@[],/-)")
        t = t.detach().cpu()
        v = t.float() if t.is_floating_point() else (t if t.dtype == torch.bool else t.to(torch.int64))
        store[key] = v.contiguous()
        meta[key] = {"shape": list(t.shape), "dtype": str(v.dtype).removeprefix("torch.")}
    return store, meta


# a section's tensor keys are data the producer makes from module names: printable, no path meaning
SECTION_KEY = re.compile(r"[A-Za-z0-9_.:@\[\],/-]{1,300}")


def pack(outputs: dict[str, torch.Tensor], mode: str = "full", sample_size: int = 4096,
         inputs: dict[str, torch.Tensor] | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """Module outputs (and recorded module-input tensors) -> (tensors to store, manifest 'tensors'
    entries). Floating tensors are stored as float32, integers as int64, booleans as bool."""
    store, meta = {}, {}
    for key, t in (inputs or {}).items():
        t = t.detach().cpu()
        v = t.float() if t.is_floating_point() else (t if t.dtype == torch.bool else t.to(torch.int64))
        store[key + IN] = v.contiguous()
        meta[key + IN] = {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
    for name, t in outputs.items():
        t = t.detach().cpu()
        entry = {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
        v = t.float() if t.is_floating_point() else t.to(torch.int64)
        if t.is_floating_point():
            entry["stats"] = stats(t)
        if mode == "sampled" and t.is_floating_point() and t.numel() > sample_size:
            idx = sample_indices(t.numel(), sample_size)
            store[name] = v.flatten()[idx].contiguous()
            store[name + IDX] = idx
            entry["sampled"] = len(idx)
        else:
            store[name] = v.contiguous()
        meta[name] = entry
    return store, meta


CURRENT = "CURRENT"
VERSION_RX = re.compile(r"v-[0-9TZ]+-[0-9a-f]+")


def exists(path: Path) -> bool:
    """A golden is there: a ``CURRENT`` pointer, or the files of the layout before versions (a bare
    folder a killed first write could not leave, but a person can, is no golden)."""
    return (Path(path) / CURRENT).exists() or (Path(path) / "manifest.json").exists()


def current_dir(path: Path) -> Path:
    """The folder holding the golden's files: the version ``CURRENT`` names, else ``path`` itself."""
    path = Path(path)
    try:
        name = (path / CURRENT).read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return path
    except (OSError, UnicodeDecodeError) as e:
        raise GoldenError(f"{display(path / CURRENT)}: unreadable golden pointer ({e})") from None
    if not VERSION_RX.fullmatch(name):  # data, not a path: it never leads out of the golden
        raise GoldenError(f"{display(path / CURRENT)}: names {name[:60]!r}, not a version folder (v-<time>-<id>); "
                          f"regenerate with `harness golden generate {path.name} --update`")
    return path / name


def _new_version() -> str:
    import secrets
    import time as _time

    return f"v-{_time.strftime('%Y%m%dT%H%M%SZ', _time.gmtime())}-{secrets.token_hex(4)}"


def _write_version(folder: Path, manifest: dict, files: dict[str, dict[str, torch.Tensor]]) -> None:
    from safetensors.torch import save

    from harness.files import atomic

    atomic.make_dirs(folder)
    manifest = dict(manifest, files={})
    for fname, tensors in files.items():
        data = save(tensors, metadata={"format": "pt"})
        atomic.write_bytes(folder / f"{fname}.safetensors", data)
        manifest["files"][f"{fname}.safetensors"] = {"sha256": sha256_bytes(data), "bytes": len(data)}
    atomic.write_json(folder / "manifest.json", manifest, sort_keys=True)  # last: the version is whole


def prune(path: Path) -> list[Path]:
    """Remove what is not the current version: older ``v-*`` folders, the files of the layout before
    versions, and the leftovers of killed writes. Under the golden's lock (see ``write_golden``)."""
    from harness.files import atomic

    path = Path(path)
    if not (path / CURRENT).exists():
        return []
    keep = current_dir(path).name
    removed = atomic.clean_leftovers(path)
    for p in path.iterdir():
        old_version = p.is_dir() and VERSION_RX.fullmatch(p.name) and p.name != keep
        flat = p.is_file() and (p.name == "manifest.json" or p.name.endswith(".safetensors"))
        if old_version or flat:
            shutil.rmtree(p) if p.is_dir() else p.unlink()
            removed.append(p)
    return removed


def write_golden(path: Path, manifest: dict, files: dict[str, dict[str, torch.Tensor]], *,
                 update: bool = False) -> Path:
    """Write a new version and make it current in one rename (module docstring). Refuses to
    replace an existing golden unless ``update``."""
    import fcntl

    from harness.files import atomic

    path = Path(path)
    check_name(path.name)  # every write stays under <root>/<plain name>
    if ".." in path.parts:
        raise GoldenError(f"{path}: a golden path must not contain '..' (writes stay under the golden root)")
    if exists(path) and not update:
        raise GoldenError(f"{display(path)}: a golden already exists; pass --update to replace it "
                          "(see `harness golden diff` for what would change)")
    atomic.make_dirs(path.parent)
    atomic.clean_leftovers(path.parent)  # what older or killed writers left beside the goldens
    version = _new_version()
    if not exists(path):
        if path.is_dir() and not any(path.iterdir()):
            path.rmdir()  # an empty folder (a person's mkdir): nothing to keep
        tmp = atomic.tmp_name(path)
        try:
            _write_version(tmp / version, manifest, files)
            atomic.write_text(tmp / CURRENT, version + "\n")
            atomic.fsync_dir(tmp)
            os.rename(tmp, path)  # fails if a golden appeared meanwhile: never replaced unasked
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        atomic.fsync_dir(path.parent)
        return path
    # Replace: one writer at a time per golden (a second one's prune must not take the first one's
    # new version away between its rename and its pointer swap). The lock is on the folder itself.
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        staging = atomic.tmp_name(path / version)
        try:
            _write_version(staging, manifest, files)
            os.rename(staging, path / version)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        atomic.write_text(path / CURRENT, version + "\n")  # the one step: old before, new after
        prune(path)
    finally:
        os.close(fd)  # releases the lock
    return path


def read_manifest(path: Path) -> dict:
    suite = path  # messages name the suite's folder (and `generate <suite>`), not the version's
    if path.exists():
        path = current_dir(path)
    mf = path / "manifest.json"
    if not path.exists():
        raise GoldenError(f"{display(mf)}: no golden for this suite; create it with "
                          f"`harness golden generate {suite.name}`")
    try:
        manifest = json.loads(mf.read_text())
    except FileNotFoundError:
        raise GoldenError(f"{display(mf)}: missing manifest (incomplete golden); regenerate with "
                          f"`harness golden generate {suite.name} --update`") from None
    except (OSError, ValueError) as e:
        raise GoldenError(f"{display(mf)}: corrupt manifest ({type(e).__name__}: {e})") from None
    if not isinstance(manifest, dict) or "files" not in manifest or not isinstance(manifest["files"], dict):
        raise GoldenError(f"{display(mf)}: not a harness golden manifest")
    if manifest.get("format") != FORMAT:
        raise GoldenError(f"{display(mf)}: golden format {manifest.get('format')!r}, this harness reads format "
                          f"{FORMAT}; regenerate with `harness golden generate {suite.name} --update`")
    need = [k for k in ("order", "tensors", "input_spec", "config_hash", "reference") if k not in manifest]
    if need:
        raise GoldenError(f"{display(mf)}: manifest lacks {', '.join(need)}; regenerate with "
                          f"`harness golden generate {suite.name} --update`")
    return manifest


def _load_file(path: Path, fname: str, manifest: dict) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    f = current_dir(path) / fname
    want = manifest["files"].get(fname)
    if want is None:
        raise GoldenError(f"{display(path / 'manifest.json')}: does not list {fname}")
    try:
        data = f.read_bytes()
    except OSError as e:
        raise GoldenError(f"{display(f)}: cannot read golden file ({e.strerror})") from None
    if len(data) != want["bytes"]:
        raise GoldenError(f"{display(f)}: truncated or corrupt golden file ({len(data)} bytes, manifest says "
                          f"{want['bytes']}); regenerate with `harness golden generate {path.name} --update`")
    if sha256_bytes(data) != want["sha256"]:
        raise GoldenError(f"{display(f)}: corrupt golden file (sha256 differs from the manifest); "
                          f"regenerate with `harness golden generate {path.name} --update`")
    try:
        return load(data)
    except Exception as e:
        raise GoldenError(f"{display(f)}: unreadable safetensors ({type(e).__name__}: {e})") from None


def load_golden_dir(path: Path) -> Golden:
    """Load and verify (sha256, sizes, every tensor against the manifest) without checking which
    suite it belongs to."""
    path = Path(path)
    manifest = read_manifest(path)
    spec = manifest["input_spec"] if isinstance(manifest["input_spec"], dict) else {}
    inputs = _load_file(path, "inputs.safetensors", manifest)
    mods = _load_file(path, "modules.safetensors", manifest)
    n_gen = spec.get("generate_tokens") or 0
    if n_gen and "generation.safetensors" not in manifest["files"]:
        # never a silent skip: the suite asks for greedy tokens, so the golden must have them
        raise GoldenError(f"{display(path / 'manifest.json')}: lists no generation.safetensors but the input spec "
                          f"asks for {n_gen} greedy tokens; regenerate with `harness golden generate {path.name} --update`")
    gen = _load_file(path, "generation.safetensors", manifest) if "generation.safetensors" in manifest["files"] else {}
    values = {k: v for k, v in mods.items() if not k.endswith((IDX, IN))}
    idx = {k[: -len(IDX)]: v for k, v in mods.items() if k.endswith(IDX)}
    mins = {k[: -len(IN)]: v for k, v in mods.items() if k.endswith(IN)}
    sections = manifest.get("sections") or {}
    if not isinstance(sections, dict) or not all(isinstance(e, dict) for e in sections.values()):
        raise GoldenError(f"{display(path / 'manifest.json')}: sections is not a table of tables; regenerate with "
                          f"`harness golden generate {path.name} --update`")
    tensors = {}
    for name in sections:
        check_name(name, source="golden manifest section")
        tensors[name] = _load_file(path, f"{name}.safetensors", manifest)
    g = Golden(path, manifest, inputs.get("input_ids"), values, idx, gen, mins, tensors)
    validate(g)
    return g


def _bad(g: Golden, fname: str, what: str) -> GoldenError:
    return GoldenError(f"{display(g.path / fname)}: {what}; the golden is bad, not the target: regenerate with "
                       f"`harness golden generate {g.path.name} --update`")


def _check_tensor(g: Golden, fname: str, name: str, t: torch.Tensor | None, shape: list | None,
                  kind: str, allow_inf: bool = False) -> None:
    """``kind``: 'float' (stored float32, finite; ``allow_inf``: +-inf allowed, NaN never), 'int'
    (int64), 'bool' or 'any'."""
    if t is None:
        raise _bad(g, fname, f"{name} is in the manifest but not in the file")
    if shape is not None and list(t.shape) != list(shape):
        raise _bad(g, fname, f"{name} has shape {list(t.shape)}, the manifest says {list(shape)}")
    want = {"float": (torch.float32,), "int": (torch.int64,), "bool": (torch.bool,),
            "any": (torch.float32, torch.int64, torch.bool)}[kind]
    if t.dtype not in want:
        raise _bad(g, fname, f"{name} is stored as {str(t.dtype).removeprefix('torch.')}, expected "
                   f"{'/'.join(str(w).removeprefix('torch.') for w in want)}")
    if t.is_floating_point():
        bad = torch.isnan(t) if allow_inf else ~torch.isfinite(t)
        if bool(bad.any()):
            raise _bad(g, fname, f"{name} has {int(bad.sum())} {'NaN' if allow_inf else 'non-finite'} value(s)"
                       f"{'' if allow_inf else ' (NaN/inf)'}")


def _kind(dtype_name: str) -> str:
    if dtype_name == "bool":
        return "bool"
    return "float" if dtype_name.startswith(("float", "bfloat", "complex")) else "int"


def validate(g: Golden) -> None:
    """Every tensor the check will read agrees with the manifest (shape, storage dtype, finite) and
    every entry it needs is present; a disagreement is the golden's fault (GoldenError)."""
    spec = _check_manifest_order(g)
    _check_tensor(g, "inputs.safetensors", "input_ids", g.inputs, [spec.get("batch_size"), spec.get("seq_len")], "int")
    _check_modules(g)
    _check_module_inputs(g)
    _check_generation(g, spec)
    _check_ranges(g)
    _check_sections(g)
    _check_budgets(g)


def _check_manifest_order(g: Golden) -> dict:
    """The manifest's order, tensors and input spec are of the right types and agree; returns the spec."""
    mf = g.manifest
    spec = mf["input_spec"]
    order, meta = mf["order"], mf["tensors"]
    if not isinstance(order, list) or not isinstance(meta, dict) or not isinstance(spec, dict):
        raise _bad(g, "manifest.json", "order / tensors / input_spec have the wrong type")
    for name in order:
        if not isinstance(name, str) or name not in meta:
            raise _bad(g, "manifest.json", f"{name!r} is in the order but has no tensors entry")
    if "logits" not in order:
        raise _bad(g, "manifest.json", "no logits entry")
    return spec


def _check_modules(g: Golden) -> None:
    """Each module output in the order (a sampled one: its sample and in-range indices)."""
    meta = g.manifest["tensors"]
    for name in g.manifest["order"]:
        m = meta[name]
        kind = _kind(str(m.get("dtype", "")))
        shape = [m["sampled"]] if m.get("sampled") else m.get("shape")
        _check_tensor(g, "modules.safetensors", name, g.modules.get(name), shape, kind)
        if m.get("sampled"):
            _check_tensor(g, "modules.safetensors", name + IDX, g.indices.get(name), [m["sampled"]], "int")
            if int(g.indices[name].max()) >= math.prod(m["shape"]) or int(g.indices[name].min()) < 0:
                raise _bad(g, "modules.safetensors", f"{name + IDX} points outside the tensor")


def _check_module_inputs(g: Golden) -> None:
    """Each stored module input is in the manifest, and every input a structure refers to is stored."""
    meta = g.manifest["tensors"]
    for key, t in g.module_inputs.items():
        m = meta.get(key + IN)
        if m is None:
            raise _bad(g, "modules.safetensors", f"{key + IN} is not in the manifest")
        # module inputs may hold -inf legitimately (an additive attention mask), never NaN
        _check_tensor(g, "modules.safetensors", key + IN, t, m.get("shape"), _kind(str(m.get("dtype", ""))),
                      allow_inf=True)
    from harness.anatomy.capture import leaves

    for mod, st in g.structures.items():
        for leaf in leaves(st):
            ok = leaf.get("t") in g.module_inputs if "t" in leaf else leaf.get("o") in g.modules
            if not ok:
                raise _bad(g, "manifest.json", f"module_inputs of {mod} refer to {leaf}, which the golden lacks")


def _check_generation(g: Golden, spec: dict) -> None:
    """The generated tokens and their log-probabilities, where the golden generated any."""
    n_gen = spec.get("generate_tokens") or 0
    if not n_gen:
        return
    b = spec.get("batch_size")
    k = g.generation.get("top_ids").shape[-1] if g.generation.get("top_ids") is not None else None
    for key, shape, kind in (("tokens", [b, n_gen], "int"), ("logprobs", [b, n_gen], "float"),
                             ("top_ids", [b, n_gen, k], "int"), ("top_logprobs", [b, n_gen, k], "float")):
        t = g.generation.get(key)
        if t is not None and t.dtype == torch.float64 and kind == "float":
            t = t.float()  # generation logprobs are stored in float64
        _check_tensor(g, "generation.safetensors", key, t, shape, kind)


def _check_budgets(g: Golden) -> None:
    for dtype, b in (g.manifest.get("budgets") or {}).items():
        for mod, e in (b.get("modules") or {}).items() if isinstance(b, dict) else ():
            v = e.get("budget") if isinstance(e, dict) else None
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise _bad(g, "manifest.json", f"budget of {mod} in {dtype} is {v!r}, not a positive number")


def _check_sections(g: Golden) -> None:
    """Every tensor a section's entry lists is in its file with that shape and storage dtype, and
    finite: the section's check reads them without further checks."""
    for name, entry in (g.manifest.get("sections") or {}).items():
        fname = f"{name}.safetensors"
        meta = entry.get("tensors")
        if not isinstance(meta, dict) or "spec" not in entry:
            raise _bad(g, "manifest.json", f"section {name} lacks its spec or tensors table")
        have = g.section_tensors.get(name, {})
        for key, m in meta.items():
            if not isinstance(m, dict):
                raise _bad(g, "manifest.json", f"section {name}: tensor entry {key!r} is not a table")
            _check_tensor(g, fname, key, have.get(key), m.get("shape"), _kind(str(m.get("dtype", ""))))
        extra = sorted(set(have) - set(meta))
        if extra:
            raise _bad(g, fname, f"holds {len(extra)} tensor(s) the manifest does not list, e.g. {extra[0]}")


def _check_ranges(g: Golden) -> None:
    """Values, not only hashes: a manifest re-hashed over edited files passes the sha256 check, so
    token ids must lie inside the vocabulary (the logits' last dimension) and log-probabilities be
    <= 0. An id out of range would make every generation mismatch look like a near tie."""
    shape = (g.manifest["tensors"].get("logits") or {}).get("shape")
    if not (isinstance(shape, list) and shape and isinstance(shape[-1], int) and shape[-1] > 0):
        raise _bad(g, "manifest.json", f"logits shape {shape!r} names no vocabulary size")
    vocab = shape[-1]
    for fname, key, t in (("inputs.safetensors", "input_ids", g.inputs),
                          ("generation.safetensors", "tokens", g.generation.get("tokens")),
                          ("generation.safetensors", "top_ids", g.generation.get("top_ids"))):
        if t is not None and t.numel() and (int(t.min()) < 0 or int(t.max()) >= vocab):
            raise _bad(g, fname, f"{key} holds token ids in [{int(t.min())}, {int(t.max())}], outside the "
                       f"vocabulary [0, {vocab})")
    for key in ("logprobs", "top_logprobs"):
        t = g.generation.get(key)
        if t is not None and t.numel() and float(t.max()) > 1e-6:
            raise _bad(g, "generation.safetensors", f"{key} has a log-probability {float(t.max()):.4g} > 0")


def check_values(g: Golden, name: str, tensors: dict[str, torch.Tensor], values) -> None:
    """A section's tensors against the value domains its check declares (``GoldenSection.values``:
    glob -> ids | mask | logprob); GoldenError naming the tensor and what it holds."""
    import fnmatch

    vocab = ((g.manifest["tensors"].get("logits") or {}).get("shape") or [0])[-1]
    fname = f"{name}.safetensors"
    for key, t in tensors.items():
        for pattern, domain in values:
            if not fnmatch.fnmatchcase(key, pattern) or not t.numel():
                continue
            lo, hi = float(t.min()), float(t.max())
            if domain == "ids" and (t.is_floating_point() or lo < 0 or hi >= vocab):
                raise _bad(g, fname, f"{key} holds token ids in [{lo:g}, {hi:g}], outside the vocabulary [0, {vocab})")
            if domain == "mask" and not bool(((t == 0) | (t == 1)).all()):
                raise _bad(g, fname, f"{key} is a mask with values other than 0 and 1 (in [{lo:g}, {hi:g}])")
            if domain == "logprob" and hi > 1e-6:
                raise _bad(g, fname, f"{key} has a log-probability {hi:.4g} > 0")


def _check_weights(recorded: dict | None, ls, mf: str) -> None:
    """A golden made from real weights compared with a run on random ones (the runner lacks the
    checkpoint) or on another checkpoint (its manifest digest changed), or the other way round, would
    fail every module for nothing: refused in one line. Goldens without the record (older) pass."""
    if not isinstance(recorded, dict):
        return
    from harness.weights import weights_provenance

    now = weights_provenance(ls)
    was, is_ = recorded.get("weights"), now.get("weights")
    if was != is_:
        if was == "real":
            from harness.weights.source import locate

            why = locate(ls).reason or "no weights"
            raise GoldenError(f"{mf}: golden was made from real weights ({recorded.get('checkpoint')}) but this run "
                              f"has none ({why}); give the run the checkpoint, or regenerate with "
                              f"`harness golden generate {ls.name} --update`")
        raise GoldenError(f"{mf}: golden was made from random weights but this run loads real ones "
                          f"({now.get('checkpoint')}); regenerate with `harness golden generate {ls.name} --update`")
    a, b = recorded.get("manifest_sha256"), now.get("manifest_sha256")
    if was == "real" and a and b and a != b:
        raise GoldenError(f"{mf}: golden was made from another checkpoint (manifest sha256 {a[:12]} != {b[:12]}); "
                          f"regenerate with `harness golden generate {ls.name} --update`")


def load_golden(ls, root: str | Path | None = None) -> Golden:
    """The suite's golden, verified, and checked to come from this suite's config and input spec."""
    path = golden_dir(ls.name, root)
    if not path.exists() and root is None and not path.is_absolute():
        # run from elsewhere: the golden dir beside the suites dir (<repo>/suites -> <repo>/golden)
        beside = ls.path.parent.parent / path
        if beside.exists():
            path = beside
    g = load_golden_dir(path)
    mf = display(path / "manifest.json")
    if g.manifest.get("config_hash") != config_hash(ls):
        raise GoldenError(f"{mf}: golden was made by another config (config hash "
                          f"{str(g.manifest.get('config_hash'))[:12]} != {config_hash(ls)[:12]} of {ls.name}); "
                          f"regenerate with `harness golden generate {ls.name} --update`")
    _check_weights(g.manifest.get("weights"), ls, mf)
    spec = input_spec(ls)
    if g.manifest.get("input_spec") != spec:
        raise GoldenError(f"{mf}: golden input spec {g.manifest.get('input_spec')} differs from the suite's "
                          f"{spec}; regenerate with `harness golden generate {ls.name} --update`")
    return g
