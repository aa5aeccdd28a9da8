"""The machine a measurement came from, and which machines it may be compared with.

A fingerprint records everything that can change a timing: backend, device name and count,
driver, torch and vendor-plugin versions, CPU model and cores, the thread count and affinity used.
Only some of it defines the *class* of machine (:data:`CLASS_KEYS`): the same device model, count
and backend, and for the host side the same CPU model and the same number of threads. Versions of
torch, the driver or the plugin are deliberately *not* in the class: a new torch that makes the
model slower is exactly what a baseline must catch. A baseline from another class is never
compared ("incomparable"), and :func:`compare` says which field differs.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
from importlib import metadata

import torch

CLASS_KEYS = ("backend", "device_type", "device_name", "device_count", "cpu_model", "threads")


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux; platform elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _driver(backend) -> str | None:
    if backend.device_type == "cpu":
        return None
    v = getattr(torch.version, backend.device_type, None)  # torch.version.cuda / .xpu / hip
    if backend.device_type == "cuda" and getattr(torch.version, "hip", None):
        v = f"hip {torch.version.hip}"
    return str(v) if v else None


def fingerprint(backend, threads: int, cpus: list[int] | None = None) -> dict:
    """What this measurement ran on. ``threads``/``cpus`` as fixed by ``timing.pinned``."""
    fp = {
        "backend": backend.name,
        "device_type": backend.device_type,
        "device_name": backend.device_name() if backend.device_type != "cpu" else cpu_model(),
        "device_count": backend.device_count(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count() or 0,
        "threads": int(threads),
        "cpus": list(cpus or []),
        "driver": _driver(backend),
        "torch": torch.__version__,
        "plugin": None,
        "python": platform.python_version(),
        "machine": platform.machine(),
    }
    if backend.module:
        dist = backend.module.replace("_", "-")
        fp["plugin"] = f"{backend.module} {_version(dist) or _version(backend.module) or '?'}"
    return fp


def class_of(fp: dict) -> dict:
    return {k: fp.get(k) for k in CLASS_KEYS}


def class_key(fp: dict) -> str:
    """A readable, file-name-safe name of the class: ``cpu-amd-epyc-2t-1a2b3c4d``. The hash
    covers every class field, the words are for people."""
    cls = class_of(fp)
    digest = hashlib.sha256(json.dumps(cls, sort_keys=True).encode()).hexdigest()[:8]
    words = re.sub(r"[^a-z0-9]+", "-", str(cls.get("device_name") or "").lower()).strip("-")[:40]
    return f"{cls.get('backend')}-{words or 'device'}-x{cls.get('device_count')}-{cls.get('threads')}t-{digest}"


def compare(baseline: dict, current: dict) -> tuple[bool, str]:
    """(comparable, why). Comparable machines share every class field."""
    diffs = [f"{k}: baseline {baseline.get(k)!r}, now {current.get(k)!r}" for k in CLASS_KEYS
             if baseline.get(k) != current.get(k)]
    if diffs:
        return False, "incomparable machine (" + "; ".join(diffs) + ")"
    changed = [f"{k} {baseline.get(k)} -> {current.get(k)}" for k in ("torch", "driver", "plugin")
               if baseline.get(k) != current.get(k)]
    return True, "same machine class" + (f" (software changed: {', '.join(changed)})" if changed else "")
