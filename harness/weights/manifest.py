"""Shard checksums: recorded once (``harness weights manifest DIR``), verified by the ``weights`` check.

A corrupted or partial download is the most common real-weight failure and the hardest to see: the
model loads and produces plausible garbage. The manifest records every shard's size and SHA-256
(and the tensor count) in ``DIR/harness-manifest.json``; verification names each shard that is
missing, has another size, or another digest.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from harness.weights.layout import Checkpoint, WeightsError, open_checkpoint, shard_path

MANIFEST_NAME = "harness-manifest.json"
CHUNK = 16 << 20


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def build_manifest(ckpt: Checkpoint) -> dict:
    files = list(ckpt.shards)
    if ckpt.index is not None:
        files.append("model.safetensors.index.json")
    return {"format": 1, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "tensors": len(ckpt.tensors),
            "files": {f: {"bytes": (ckpt.root / f).stat().st_size, "sha256": sha256_file(ckpt.root / f)}
                      for f in files}}


def write_manifest(path: str | Path, out: str | Path | None = None, *, allow_pickle: bool = False) -> Path:
    ckpt = open_checkpoint(path, allow_pickle=allow_pickle)
    target = Path(out) if out else ckpt.root / MANIFEST_NAME
    from harness.files import atomic

    atomic.write_json(target, build_manifest(ckpt), sort_keys=True)
    return target


def read_manifest(path: Path) -> dict:
    try:
        m = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(m.get("files"), dict):
            raise ValueError("no 'files' table")
        return m
    except (OSError, ValueError) as e:
        raise WeightsError(f"{path}: not a harness weights manifest ({e})") from None


def verify(ckpt: Checkpoint, manifest: dict, *, checksums: bool = True) -> list[str]:
    """One line per problem: a shard missing, resized, altered, or not in the manifest."""
    problems = []
    files = manifest["files"]
    present = set(ckpt.shards) | ({"model.safetensors.index.json"} if ckpt.index is not None else set())
    for name, rec in sorted(files.items()):
        try:  # a name in the manifest is data: it must name a file inside the checkpoint
            p = shard_path(ckpt.root, name, source=ckpt.root / MANIFEST_NAME, field=f"files[{name!r}]")
        except WeightsError as e:
            problems.append(str(e))
            continue
        if not isinstance(rec, dict) or not isinstance(rec.get("bytes"), int) or not isinstance(rec.get("sha256"), str):
            problems.append(f"{name}: the manifest's record is not {{bytes, sha256}}: {str(rec)[:80]}")
            continue
        if not p.is_file():
            problems.append(f"{name}: in the manifest, not in the checkpoint")
            continue
        size = p.stat().st_size
        if size != rec["bytes"]:
            problems.append(f"{name}: {size} bytes, the manifest recorded {rec['bytes']} (truncated or replaced)")
        elif checksums and sha256_file(p) != rec["sha256"]:
            problems.append(f"{name}: checksum mismatch (sha256 {rec['sha256'][:12]}... recorded); re-download it")
    for name in sorted(present - set(files)):
        problems.append(f"{name}: in the checkpoint, not in the manifest (re-run `harness weights manifest`)")
    return problems


def manifest_digest(path: Path) -> str | None:
    """SHA-256 of the recorded manifest (identifies the exact checkpoint a golden came from)."""
    root = path if path.is_dir() else path.parent
    m = root / MANIFEST_NAME
    return hashlib.sha256(m.read_bytes()).hexdigest() if m.is_file() else None
