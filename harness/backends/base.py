"""What harness needs to know about a device backend, and the registry that holds them.

A backend is data plus a few probes. Built-ins (builtin.py) and a vendor's own backends register
the same way: an entry point in the ``harness.backends`` group whose target is
``register(registry)``, or a ``[[backends]]`` table in ``harness.toml``. Either may declare the
backend's **op lists** (``op_lists``: files, usually shipped in the declaring package, one per plugin
version), which operator coverage reads when the backend is not installed (harness.inspect.coverage).
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from harness.proc import peak_rss_bytes, reset_peak_rss
from harness.registry import NamedRegistry

PROBE_DTYPES = ("float64", "float32", "bfloat16", "float16")


@dataclass
class Backend:
    name: str  # what suites and --backend say: cpu, cuda, npu, ...
    device_type: str  # torch device type: cpu, cuda, xpu, mps, npu (PrivateUse1 renamed), ...
    collective: str  # torch.distributed backend: gloo, nccl, xccl, hccl, mccl, cncl, ...
    module: str | None = None  # out-of-tree package to import first (torch_npu, ...)
    dispatch_key: str | None = None  # dispatcher key of its kernels (CUDA, XPU, PrivateUse1, ...)
    description: str = ""
    source: str = "builtin"  # where it was registered from
    # Declared operator lists (docs/inspect.md format), one per plugin version: a path, or several.
    op_lists: tuple[Path, ...] = ()
    # The torch.compile backend its compiled path uses (a registered dynamo backend name, e.g. a
    # vendor's graph-mode backend); None: inductor; "none": it has no compiler (the compile check
    # is not applicable). docs/compile.md.
    compile_backend: str | None = None
    _avail: tuple[bool, str] | None = field(default=None, repr=False)
    _imported: bool = field(default=False, repr=False)

    def __post_init__(self):
        self.op_lists = _paths(self.op_lists)

    # --- availability -------------------------------------------------------------------------
    def availability(self) -> tuple[bool, str]:
        """(available, reason). Importing the vendor module happens here, once."""
        if self._avail is None:
            self._avail = self._probe_availability()
        return self._avail

    def available(self) -> bool:
        return self.availability()[0]

    def _import_module(self) -> None:
        """Import the vendor module (once): it renames PrivateUse1 to ``device_type`` and registers
        ``torch.<device_type>``, so every device probe needs it first, in every process (an isolated
        item's worker has not run the availability probe)."""
        if self.module and not self._imported:
            importlib.import_module(self.module)
            self._imported = True

    def _probe_availability(self) -> tuple[bool, str]:
        if self.module:
            try:
                self._import_module()
            except Exception as e:  # ImportError, or a vendor module failing on a machine without its driver
                return False, f"backend {self.name}: module {self.module!r} not importable ({type(e).__name__}: {e})"
        if self.device_type == "cpu":
            return True, "cpu is always available"
        mod = getattr(torch, self.device_type, None)
        if mod is None or not hasattr(mod, "is_available"):
            return False, f"backend {self.name}: torch has no '{self.device_type}' device module"
        try:
            ok = bool(mod.is_available())
        except Exception as e:
            return False, f"backend {self.name}: torch.{self.device_type}.is_available() raised {e!r}"
        if not ok:
            return False, f"backend {self.name}: torch.{self.device_type}.is_available() is False (no device or driver)"
        return True, f"{self.device_count()} device(s)"

    # --- devices ------------------------------------------------------------------------------
    def _mod(self):
        if self.device_type != "cpu":
            try:
                self._import_module()
            except Exception:  # unavailable: availability() says why
                return None
        return getattr(torch, self.device_type, None)

    def device_count(self) -> int:
        if self.device_type == "cpu":
            return 1
        mod = self._mod()
        return int(mod.device_count()) if mod and hasattr(mod, "device_count") else 1

    def device(self) -> torch.device:
        """This process's device. Under pytest-xdist, worker gwN takes device N % count so that a
        multi-device machine runs one shard per device."""
        if self.device_type == "cpu":
            return torch.device("cpu")
        self._import_module()  # torch parses a renamed PrivateUse1 type only after the vendor's import
        worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
        idx = int(worker[2:]) if worker[2:].isdigit() else 0
        return torch.device(self.device_type, idx % max(self.device_count(), 1))

    def device_name(self) -> str:
        """The device generation, for per-generation tolerances and the machine fingerprint."""
        if self.device_type == "cpu":
            import platform

            return platform.processor() or platform.machine() or "cpu"
        mod = self._mod()
        try:
            return str(mod.get_device_name(self.device()))
        except Exception:
            return self.device_type

    def synchronize(self) -> None:
        mod = self._mod()
        if self.device_type != "cpu" and mod is not None and hasattr(mod, "synchronize"):
            mod.synchronize()

    # --- memory -------------------------------------------------------------------------------
    def reset_peak_memory(self) -> None:
        if self.device_type == "cpu":
            reset_peak_rss()  # Linux resets VmHWM; elsewhere the peak stays the process's lifetime one
            return
        mod = self._mod()
        if mod is not None and hasattr(mod, "reset_peak_memory_stats"):
            mod.reset_peak_memory_stats(self.device())

    def peak_memory(self) -> int | None:
        """Bytes: the allocator's high-water mark, or on CPU the process peak RSS (harness.proc: VmHWM
        on Linux, the platform's own counter elsewhere, where a /proc read gave nothing)."""
        if self.device_type == "cpu":
            return peak_rss_bytes()
        mod = self._mod()
        if mod is not None and hasattr(mod, "max_memory_allocated"):
            return int(mod.max_memory_allocated(self.device()))
        return None

    # --- dtypes -------------------------------------------------------------------------------
    @functools.cached_property
    def supported_dtypes(self) -> dict[str, str]:
        """Probed, not assumed: dtype -> "ok" or the reason it fails (a matmul and a softmax are
        the smallest thing a transformer needs)."""
        out = {}
        if not self.available():
            return {d: self.availability()[1] for d in PROBE_DTYPES}
        dev = self.device()
        for name in PROBE_DTYPES:
            dt = getattr(torch, name)
            try:
                x = torch.ones(4, 4, dtype=dt, device=dev)
                y = torch.softmax(x @ x, dim=-1).sum()
                self.synchronize()
                if not torch.isfinite(y.float().cpu()):
                    raise RuntimeError("non-finite result")
                out[name] = "ok"
            except Exception as e:
                out[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        return out

    def supports(self, dtype: str) -> tuple[bool, str]:
        r = self.supported_dtypes.get(dtype, f"dtype {dtype} not probed")
        return r == "ok", r


def _paths(value: str | os.PathLike | Iterable[str | os.PathLike] | None) -> tuple[Path, ...]:
    if value is None:
        return ()
    if isinstance(value, (str, os.PathLike)):
        return (Path(value),)
    return tuple(Path(v) for v in value)


class Registry(NamedRegistry[Backend]):
    kind = "backend"
    group = "harness.backends"

    def __init__(self):
        super().__init__()
        self._flavour_lists: dict[str, tuple[Path, ...]] = {}

    def declare_op_list(self, name: str, paths) -> None:
        """Op lists of a coverage-only flavour that is not a backend of its own (``rocm``: ROCm builds
        run as the ``cuda`` backend, their kernel set differs): ``harness inspect --backends`` gets a
        column for it. A registered backend declares its lists in ``Backend.op_lists`` instead."""
        self._flavour_lists[name] = self._flavour_lists.get(name, ()) + _paths(paths)

    def op_lists(self, name: str | None = None) -> dict[str, tuple[Path, ...]]:
        """backend (or flavour) name -> its declared op lists, for one name or every name that has any."""
        out = {n: ps for n, ps in self._flavour_lists.items() if n not in self._items}
        out.update({b.name: b.op_lists for b in self if b.op_lists})
        return {n: ps for n, ps in out.items() if ps and (name is None or n == name)}
