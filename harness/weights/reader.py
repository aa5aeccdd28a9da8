"""Lazy, selective reads of checkpoint tensors through safetensors' own ``safe_open``.

``safe_open`` memory-maps each shard and copies out only the tensors (or the slices, through
``get_slice``) that are asked for, so a pruned load reads about the bytes it keeps. The reader counts
those bytes (``bytes_read``) so that benchmarks and tests can state the ratio; the operating system's
own count (``/proc/self/io`` ``read_bytes``) is what benchmarks/bench_weights.py reports next to it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from harness.weights.layout import Checkpoint, WeightsError, shard_path


def _runs(idx: list[int]) -> list[tuple[int, int]]:
    """[3, 4, 5, 9] -> [(3, 6), (9, 10)]: contiguous runs, each one get_slice call."""
    out: list[tuple[int, int]] = []
    for i in idx:
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


class ShardReader:
    """Open shards on first use; read whole tensors or rows of them."""

    def __init__(self, ckpt: Checkpoint):
        self.ckpt = ckpt
        self._handles: dict[str, object] = {}
        self._pickled: dict[str, dict[str, torch.Tensor]] = {}
        self.bytes_read = 0
        self.tensors_read = 0

    def _path(self, shard: str):
        # once per shard (handles are cached): the shard name came from the index or a glob
        return shard_path(self.ckpt.root, shard, source=self.ckpt.root, field="shard")

    def _handle(self, shard: str):
        h = self._handles.get(shard)
        if h is None:
            from safetensors import safe_open

            try:
                h = safe_open(str(self._path(shard)), framework="pt", device="cpu")
            except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
                raise WeightsError(f"{shard}: cannot open: {type(e).__name__}: {e}") from None
            self._handles[shard] = h
        return h

    def _pickle(self, shard: str) -> dict[str, torch.Tensor]:
        sd = self._pickled.get(shard)
        if sd is None:
            # weights_only=True: tensors and plain containers only, never arbitrary objects;
            # mmap=True keeps it lazy like safetensors.
            sd = self._pickled[shard] = torch.load(self._path(shard), map_location="cpu",
                                                   weights_only=True, mmap=True)
        return sd

    def _count(self, t: torch.Tensor) -> torch.Tensor:
        self.bytes_read += t.numel() * t.element_size()
        self.tensors_read += 1
        return t

    def get(self, name: str) -> torch.Tensor:
        shard = self.ckpt.shard_of(name)
        if self.ckpt.pickle:
            return self._count(self._pickle(shard)[name].clone())
        try:
            return self._count(self._handle(shard).get_tensor(name))
        except WeightsError:
            raise
        except Exception as e:  # noqa: BLE001
            raise WeightsError(f"{shard}: cannot read {name}: {type(e).__name__}: {e}") from None

    def rows(self, name: str, idx: list[int]) -> torch.Tensor:
        """``tensor[idx]`` along dim 0, reading only those rows (one get_slice per contiguous run)."""
        shard = self.ckpt.shard_of(name)
        if self.ckpt.pickle:
            return self._count(self._pickle(shard)[name][idx].clone())
        sl = self._handle(shard).get_slice(name)
        try:
            parts = [sl[a:b] for a, b in _runs(idx)]
        except Exception as e:  # noqa: BLE001
            raise WeightsError(f"{shard}: cannot read rows of {name}: {type(e).__name__}: {e}") from None
        return self._count(parts[0] if len(parts) == 1 else torch.cat(parts))

    def release(self, shard: str) -> None:
        """Unmap one shard: the file pages safe_open's map touched count in this process's resident memory
        for as long as it is mapped (a full load would otherwise hold a model's worth of them at its end)."""
        self._handles.pop(shard, None)
        self._pickled.pop(shard, None)

    def close(self) -> None:
        self._handles.clear()
        self._pickled.clear()


def file_read_bytes() -> int | None:
    """This process's ``read_bytes`` from /proc/self/io (bytes fetched from storage), or None."""
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None
