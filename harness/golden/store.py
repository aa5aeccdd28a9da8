"""The ``golden/<suite>/`` directory: safetensors files plus ``manifest.json``.

Layout::

    golden/<suite>/manifest.json          versions, config hash, input spec, per-file sha256, shapes, dtypes
    golden/<suite>/inputs.safetensors     input_ids [batch, seq] (stored, never regenerated)
    golden/<suite>/modules.safetensors    captured module outputs and logits (float32; int64 expert ids)
    golden/<suite>/generation.safetensors greedy tokens, logprobs, top-k candidates

In ``sampled`` mode (large models) ``modules.safetensors`` holds, per tensor, a fixed sample of
elements (``<name>`` values, ``<name>::idx`` flat indices) and the manifest holds per-tensor
statistics of the whole tensor. Writes are atomic: files go to a temporary sibling directory which
replaces the old one with renames; an existing golden is only replaced when asked to.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

FORMAT = 1
FILES = ("inputs", "modules", "generation")
IDX = "::idx"


class GoldenError(Exception):
    """A golden that cannot be used: missing, corrupt, truncated, or made by another config.
    ``str()`` is a one-line message naming the file."""


def _display(p: Path) -> str:
    try:
        return os.path.relpath(p)
    except ValueError:
        return str(p)


def golden_root(root: str | Path | None = None) -> Path:
    if root is not None:
        return Path(root)
    env = os.environ.get("HARNESS_GOLDEN_DIR")
    if env:
        return Path(env)
    from harness.settings import load_settings

    return Path(load_settings().golden_dir)


def golden_dir(suite_name: str, root: str | Path | None = None) -> Path:
    return golden_root(root) / suite_name


def sha256_bytes(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def canonical_hash(obj) -> str:
    return sha256_bytes(json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode())


def config_hash(ls) -> str:
    """What determines the reference numbers besides the input: the published config, the pruning,
    the model section (adapter, architecture, weights path) and the weight seed."""
    s = ls.suite
    return canonical_hash({"config": ls.raw_config, "prune": s.prune.model_dump(mode="json"),
                           "model": s.model.model_dump(mode="json", exclude={"name"}),
                           "seed": s.checks.precision.seed})


def input_spec(ls) -> dict:
    p = ls.suite.checks.precision
    return {"batch_size": p.batch_size, "seq_len": p.seq_len, "input_seed": p.seed + 1,
            "generate_tokens": p.generate_tokens, "capture": p.capture, "mode": p.golden_mode,
            "sample_size": p.sample_size if p.golden_mode == "sampled" else None}


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

    @property
    def order(self) -> list[str]:
        return list(self.manifest["order"])

    @property
    def sampled(self) -> bool:
        return self.manifest["input_spec"].get("mode") == "sampled"


def pack(outputs: dict[str, torch.Tensor], mode: str = "full", sample_size: int = 4096
         ) -> tuple[dict[str, torch.Tensor], dict]:
    """Module outputs -> (tensors to store, manifest 'tensors' entries)."""
    store, meta = {}, {}
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


def write_golden(path: Path, manifest: dict, files: dict[str, dict[str, torch.Tensor]], *,
                 update: bool = False) -> Path:
    """Write atomically: everything into a temp sibling directory, then rename into place. Refuses
    to replace an existing golden unless ``update``."""
    from safetensors.torch import save

    path = Path(path)
    if path.exists() and not update:
        raise GoldenError(f"{_display(path)}: a golden already exists; pass --update to replace it "
                          "(see `harness golden diff` for what would change)")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        manifest = dict(manifest, files={})
        for fname, tensors in files.items():
            data = save(tensors, metadata={"format": "pt"})
            (tmp / f"{fname}.safetensors").write_bytes(data)
            manifest["files"][f"{fname}.safetensors"] = {"sha256": sha256_bytes(data), "bytes": len(data)}
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        old = None
        if path.exists():
            old = path.parent / f".{path.name}.old-{os.getpid()}"
            os.replace(path, old)
        os.replace(tmp, path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def read_manifest(path: Path) -> dict:
    mf = path / "manifest.json"
    if not path.exists():
        raise GoldenError(f"{_display(mf)}: no golden for this suite; create it with "
                          f"`harness golden generate {path.name}`")
    try:
        manifest = json.loads(mf.read_text())
    except FileNotFoundError:
        raise GoldenError(f"{_display(mf)}: missing manifest (incomplete golden); regenerate with "
                          f"`harness golden generate {path.name} --update`") from None
    except (OSError, ValueError) as e:
        raise GoldenError(f"{_display(mf)}: corrupt manifest ({type(e).__name__}: {e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or "files" not in manifest:
        raise GoldenError(f"{_display(mf)}: not a harness golden manifest (format {FORMAT} expected)")
    return manifest


def _load_file(path: Path, fname: str, manifest: dict) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    f = path / fname
    want = manifest["files"].get(fname)
    if want is None:
        raise GoldenError(f"{_display(path / 'manifest.json')}: does not list {fname}")
    try:
        data = f.read_bytes()
    except OSError as e:
        raise GoldenError(f"{_display(f)}: cannot read golden file ({e.strerror})") from None
    if len(data) != want["bytes"]:
        raise GoldenError(f"{_display(f)}: truncated or corrupt golden file ({len(data)} bytes, manifest says "
                          f"{want['bytes']}); regenerate with `harness golden generate {path.name} --update`")
    if sha256_bytes(data) != want["sha256"]:
        raise GoldenError(f"{_display(f)}: corrupt golden file (sha256 differs from the manifest); "
                          f"regenerate with `harness golden generate {path.name} --update`")
    try:
        return load(data)
    except Exception as e:
        raise GoldenError(f"{_display(f)}: unreadable safetensors ({type(e).__name__}: {e})") from None


def load_golden_dir(path: Path) -> Golden:
    """Load and verify (sha256, sizes) without checking which suite it belongs to."""
    path = Path(path)
    manifest = read_manifest(path)
    inputs = _load_file(path, "inputs.safetensors", manifest)
    mods = _load_file(path, "modules.safetensors", manifest)
    gen = _load_file(path, "generation.safetensors", manifest) if "generation.safetensors" in manifest["files"] else {}
    values = {k: v for k, v in mods.items() if not k.endswith(IDX)}
    idx = {k[: -len(IDX)]: v for k, v in mods.items() if k.endswith(IDX)}
    missing = [n for n in manifest.get("order", []) if n not in values]
    if "input_ids" not in inputs or missing:
        raise GoldenError(f"{_display(path)}: golden files do not match the manifest "
                          f"(missing {missing[:3] or ['input_ids']})")
    return Golden(path, manifest, inputs["input_ids"], values, idx, gen)


def load_golden(ls, root: str | Path | None = None) -> Golden:
    """The suite's golden, verified, and checked to come from this suite's config and input spec."""
    path = golden_dir(ls.name, root)
    if not path.exists() and root is None and not path.is_absolute():
        # run from elsewhere: the golden dir beside the suites dir (<repo>/suites -> <repo>/golden)
        beside = ls.path.parent.parent / path
        if beside.exists():
            path = beside
    g = load_golden_dir(path)
    mf = _display(path / "manifest.json")
    if g.manifest.get("config_hash") != config_hash(ls):
        raise GoldenError(f"{mf}: golden was made by another config (config hash "
                          f"{str(g.manifest.get('config_hash'))[:12]} != {config_hash(ls)[:12]} of {ls.name}); "
                          f"regenerate with `harness golden generate {ls.name} --update`")
    spec = input_spec(ls)
    if g.manifest.get("input_spec") != spec:
        raise GoldenError(f"{mf}: golden input spec {g.manifest.get('input_spec')} differs from the suite's "
                          f"{spec}; regenerate with `harness golden generate {ls.name} --update`")
    return g
