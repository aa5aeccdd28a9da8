"""harness's test device: a PrivateUse1 backend whose memory is on the host (docs/backends.md,
"Testing your backend before hardware arrives").

Importing this module builds the C++ extension (``csrc/testdev.cpp``) with
``torch.utils.cpp_extension.load`` into a build folder (``$TESTDEV_BUILD_DIR``, else the checkout's
``testdev/.build/torch-<version>``, else for an installed copy
``$XDG_CACHE_HOME/harness-testdev/torch-<version>/<hash of its folder>`` or ``~/.cache/...``; an
unchanged source is not rebuilt), renames PrivateUse1 to ``hdev`` and registers ``torch.hdev``, a device module with
what a vendor's has: device count and selection, ``synchronize``, seeding and a Generator per device,
the allocator's statistics, plus the per-op counts of the CPU fallback every op without a native
kernel goes through. A build that cannot happen (no C++ compiler, a failed compile) raises
ImportError with one line saying why, which is what ``harness backends`` shows.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
from pathlib import Path

import torch

DEVICE_TYPE = "hdev"
BACKEND_NAME = "testdev"
HERE = Path(__file__).resolve().parent
SOURCES = [HERE / "csrc" / "testdev.cpp"]


def build_directory() -> Path:
    explicit = os.environ.get("TESTDEV_BUILD_DIR")
    if explicit:
        return Path(explicit)
    # the repository's copy builds inside the repository (testdev/.build, ignored by git): nothing is
    # written outside the checkout; an installed copy (site-packages may be read-only) uses the user's cache
    checkout = HERE.parent
    if (checkout / "pyproject.toml").is_file() and os.access(checkout, os.W_OK):
        return checkout / ".build" / f"torch-{torch.__version__}"
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    # one folder per installed copy: ninja's build file names the sources' paths, so two copies
    # (the repository's and an installed one) sharing a folder would rebuild each other's
    where = hashlib.sha1(str(HERE).encode()).hexdigest()[:10]
    return cache / "harness-testdev" / f"torch-{torch.__version__}" / where


def _compiler() -> str | None:
    cxx = os.environ.get("CXX", "c++")
    return shutil.which(cxx.split()[0]) if cxx else None


def _build():
    if _compiler() is None:
        raise ImportError(f"harness_testdev: no C++ compiler ({os.environ.get('CXX', 'c++')!r} not on PATH) to build the test device")
    # One ninja for every process: the venv's (pip) when there is one, else the one on PATH. Two
    # ninja versions take turns otherwise (a process started with the venv's bin on PATH, another
    # without): ninja 1.12+ hashes commands differently from 1.11, so each reads the other's log as a
    # changed command and rebuilds (22-33 s each time; measured: 9 rebuilds in one day of test runs).
    beside = Path(sys.executable).parent / "ninja"
    if beside.exists():
        os.environ["PATH"] = f"{beside.parent}{os.pathsep}{os.environ.get('PATH', '')}"
    elif shutil.which("ninja") is None:
        raise ImportError("harness_testdev: ninja not found (pip install ninja) to build the test device")
    from torch.utils import cpp_extension

    out = build_directory()
    out.mkdir(parents=True, exist_ok=True)
    try:
        return cpp_extension.load(name="harness_testdev_C", sources=[str(s) for s in SOURCES],
                                  build_directory=str(out), extra_cflags=["-O1"], verbose=False)
    except Exception as e:  # a compile error: its first line, and where the log is
        first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
        raise ImportError(f"harness_testdev: C++ build failed in {out} ({first[:200]})") from e


_C = _build()

if torch._C._get_privateuse1_backend_name() != DEVICE_TYPE:
    torch.utils.rename_privateuse1_backend(DEVICE_TYPE)

from harness_testdev import device as _device  # noqa: E402  (needs _C and the renamed key)

if not hasattr(torch, DEVICE_TYPE):
    torch._register_device_module(DEVICE_TYPE, _device)
    torch.utils.generate_methods_for_privateuse1_backend(for_tensor=True, for_module=True, for_storage=True)

fallback_counts = _device.fallback_counts
reset_fallback_counts = _device.reset_fallback_counts

# the device's torch.distributed backend, "hdccl" (collectives on host copies through gloo)
from harness_testdev import distributed as _distributed  # noqa: E402

COLLECTIVE = _distributed.NAME
collective_counts = _distributed.collective_counts
reset_collective_counts = _distributed.reset_collective_counts


def _log_fallbacks(path: str) -> None:
    """At exit, one JSON line {pid, argv, counts, collectives} appended to ``$TESTDEV_FALLBACK_LOG``:
    the ops each process (harness's isolated item workers and parallel ranks included) ran through the
    CPU fallback, and the hdccl collectives it issued per kind."""
    import json

    counts, colls = fallback_counts(), collective_counts()
    if counts or colls:
        line = json.dumps({"pid": os.getpid(), "argv": sys.argv[:3], "counts": counts, "collectives": colls},
                          sort_keys=True)
        with open(path, "a") as f:
            f.write(line + "\n")


if os.environ.get("TESTDEV_FALLBACK_LOG"):
    import atexit

    atexit.register(_log_fallbacks, os.environ["TESTDEV_FALLBACK_LOG"])


__all__ = ["DEVICE_TYPE", "BACKEND_NAME", "COLLECTIVE", "build_directory", "fallback_counts", "reset_fallback_counts",
           "collective_counts", "reset_collective_counts"]
