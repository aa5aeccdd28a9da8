"""A checkpoint directory in the Hugging Face layout: which shards, which tensor lives where.

Accepted layouts (``config.json`` beside them is optional here; the suite names the config):

* ``model.safetensors`` (one file), or a path to one ``.safetensors`` file;
* ``model-00001-of-00005.safetensors`` ... with ``model.safetensors.index.json``
  (``{"weight_map": {tensor name: shard file}}``);
* several ``*.safetensors`` without an index (the index is rebuilt from the shard headers).

Only safetensors are read. A directory that holds only pickle files (``pytorch_model*.bin``, ``*.pt``)
is refused unless the suite sets ``model.weights_allow_pickle``; then it is read with
``torch.load(weights_only=True)`` (never a full unpickle).

The shard headers are parsed here directly (8-byte little-endian length + JSON) rather than through
``safe_open``: it costs one small read per shard, and lets a truncated shard be named with how many
bytes it should have and has, instead of failing later inside a read.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

INDEX_NAME = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth")

# safetensors dtype codes -> torch dtype names (what the header says).
ST_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
             "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "I64": "int64", "I32": "int32",
             "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool", "U16": "uint16", "U32": "uint32",
             "U64": "uint64", "F8_E8M0": "float8_e8m0fnu", "F4": "float4_e2m1fn_x2"}


class WeightsError(Exception):
    """A checkpoint problem, one line naming the file (and tensor) involved."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shard: str  # file name relative to the checkpoint root
    dtype: str  # torch dtype name, e.g. "bfloat16"
    shape: tuple[int, ...]
    nbytes: int


@dataclass
class Checkpoint:
    root: Path  # the directory (or the single file's directory)
    shards: list[str]  # file names relative to root, sorted
    tensors: dict[str, TensorInfo] = field(default_factory=dict)  # from the shard headers
    index: dict[str, str] | None = None  # the index's weight_map, when there is one
    pickle: bool = False  # read through torch.load(weights_only=True)
    config: dict | None = None  # the checkpoint's own config.json, if present

    @property
    def total_bytes(self) -> int:
        return sum((self.root / s).stat().st_size for s in self.shards)

    def shard_of(self, name: str) -> str:
        info = self.tensors.get(name)
        if info is None:
            raise WeightsError(f"tensor {name} is not in the checkpoint {self.root}"
                               + (f" (the index maps it to {self.index[name]})" if self.index and name in self.index
                                  else ""))
        return info.shard

    def quantization(self) -> dict | None:
        return (self.config or {}).get("quantization_config")


def read_header(path: Path) -> dict[str, dict]:
    """The JSON header of one .safetensors file, checked against the file's size."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise WeightsError(f"{path.name}: truncated shard: {size} bytes, not even a header")
            (n,) = struct.unpack("<Q", head)
            first = f.read(1)
            if first != b"{":
                # A safetensors header is JSON: its first byte is '{'. Anything else (a pickle renamed,
                # a zip from torch.save, a text file behind a symlink) is another format, not a
                # truncated download: saying "re-download it" would send people the wrong way.
                raise WeightsError(f"{path.name}: not a safetensors file ({_looks_like(head + first)}); "
                                   "harness reads safetensors only")
            if n > size - 8:
                raise WeightsError(f"{path.name}: truncated shard: header says {n} bytes of metadata, "
                                   f"the file has {size - 8} after the length")
            meta = json.loads(first + f.read(n - 1))
            if not isinstance(meta, dict) or not all(isinstance(v, dict) for v in meta.values()):
                raise ValueError("the header is not a table of tensors")
    except OSError as e:
        raise WeightsError(f"{path.name}: cannot read: {e.strerror or e}") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise WeightsError(f"{path.name}: not a safetensors file (bad header: {e})") from None
    meta.pop("__metadata__", None)
    end = max((v["data_offsets"][1] for v in meta.values()), default=0)
    if 8 + n + end > size:
        raise WeightsError(f"{path.name}: truncated shard: its header needs {8 + n + end} bytes, "
                           f"the file has {size} (re-download it)")
    return meta


def _looks_like(head: bytes) -> str:
    if head[:1] == b"\x80":
        return "it starts like a pickle"
    if head[:2] == b"PK":
        return "it is a zip archive, e.g. torch.save's"
    return f"it starts with {head[:9]!r}"


def shard_path(root: Path, shard, *, source: Path, field: str) -> Path:
    """``root / shard`` for a shard name read from a file (the index, a manifest), through
    harness.files.paths: a relative path of plain names that stays inside the checkpoint. In the
    Hugging Face cache (``.../models--org--name/snapshots/<rev>/``) files are symlinks into the
    repository's ``blobs/``; that repository folder is the bound there."""
    from harness.files import paths

    within = root.parent.parent if root.parent.name == "snapshots" else root
    try:
        return paths.join(root, shard, source=source, field=field, plain=False, within=within)
    except paths.PathRefused as e:
        raise WeightsError(str(e)) from None


def _infos(root: Path, shard: str) -> dict[str, TensorInfo]:
    out = {}
    for name, v in read_header(root / shard).items():
        a, b = v["data_offsets"]
        out[name] = TensorInfo(name, shard, ST_DTYPES.get(v["dtype"], v["dtype"].lower()), tuple(v["shape"]), b - a)
    return out


def _pickle_infos(root: Path, shard: str) -> dict[str, TensorInfo]:
    import torch

    try:
        sd = torch.load(root / shard, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 - torch.load raises many kinds; all mean "unreadable"
        raise WeightsError(f"{shard}: torch.load(weights_only=True) refused it: {type(e).__name__}: "
                           f"{str(e).splitlines()[0] if str(e) else ''}") from None
    return {k: TensorInfo(k, shard, str(t.dtype).removeprefix("torch."), tuple(t.shape), t.numel() * t.element_size())
            for k, t in sd.items() if hasattr(t, "dtype")}


def open_checkpoint(path: str | Path, *, allow_pickle: bool = False) -> Checkpoint:
    """Discover the shards of a checkpoint and read every shard's header (no tensor data)."""
    path = Path(path)
    if not path.exists():
        raise WeightsError(f"checkpoint not found: {path}")
    root = path if path.is_dir() else path.parent
    config = _read_config(root)
    index = None
    if path.is_file():
        shards, pickled = [path.name], path.suffix in PICKLE_SUFFIXES
    elif (root / INDEX_NAME).is_file():
        index = _read_index(root)
        shards, pickled = sorted(set(index.values())), False
        _require_shards(root, shards)
    else:
        shards, pickled = _glob_shards(root)
    if pickled and not allow_pickle:
        raise WeightsError(f"{root}: only pickle weights ({shards[0]}{', ...' if len(shards) > 1 else ''}); harness "
                           "reads safetensors only. Convert them, or set model.weights_allow_pickle = true to read "
                           "them with torch.load(weights_only=True)")
    if not path.is_file():  # a shard found by glob may be a symlink out of the folder: same rule
        for s in shards:
            shard_path(root, s, source=root / INDEX_NAME if index is not None else root, field="shard")
    ck = Checkpoint(root, shards, index=index, pickle=pickled, config=config)
    for s in shards:
        ck.tensors.update(_pickle_infos(root, s) if pickled else _infos(root, s))
    if index is not None:
        _check_index_kept(ck, index)
    return ck


def _read_config(root: Path) -> dict | None:
    """The checkpoint's config.json, None where there is none readable."""
    if not (root / "config.json").is_file():
        return None
    try:
        return json.loads((root / "config.json").read_text(encoding="utf-8"))
    except ValueError:
        return None


def _read_index(root: Path) -> dict:
    """The safetensors index's weight_map, every shard name in it kept inside the checkpoint."""
    try:
        index = json.loads((root / INDEX_NAME).read_text(encoding="utf-8"))["weight_map"]
        if not isinstance(index, dict):
            raise TypeError("weight_map is not a table")
    except (ValueError, KeyError, TypeError) as e:
        raise WeightsError(f"{root / INDEX_NAME}: not a safetensors index ({e})") from None
    for tname, shard in index.items():  # every shard name is data: it must stay in the checkpoint
        shard_path(root, shard, source=root / INDEX_NAME, field=f"weight_map[{tname!r}]")
    return index


def _require_shards(root: Path, shards: list[str]) -> None:
    missing = [s for s in shards if not (root / s).is_file()]
    if missing:
        raise WeightsError(f"{root}: the index names {len(missing)} shard(s) that are not there, "
                           f"first {missing[0]}")


def _glob_shards(root: Path) -> tuple[list[str], bool]:
    """A folder without an index: its *.safetensors, else its pickle files (shards, pickled)."""
    shards = sorted(p.name for p in root.glob("*.safetensors"))
    if shards:
        return shards, False
    pick = sorted(p.name for p in root.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if not pick:
        raise WeightsError(f"{root}: no *.safetensors (and no index) in this directory")
    return pick, True


def _check_index_kept(ck: Checkpoint, index: dict) -> None:
    """The index is what from_pretrained trusts; a shard that lacks what the index promises is corrupt."""
    for name, shard in index.items():
        info = ck.tensors.get(name)
        if info is None:
            raise WeightsError(f"{shard}: the index maps {name} to this shard but the shard has no such tensor")
        if info.shard != shard:
            raise WeightsError(f"{name}: the index says {shard}, the tensor is in {info.shard}")
