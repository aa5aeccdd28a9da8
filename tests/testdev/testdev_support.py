"""Helpers of the test device's tests (fixtures in conftest.py): declare it, its environment, run harness."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from harness.toml import loads as toml_loads

ROOT = Path(__file__).resolve().parents[2]
TESTDEV = ROOT / "testdev"
BUILD_TIMEOUT_S = 600


def declare(meta: Path) -> None:
    """The package's dist-info, from its own pyproject.toml (name, version, entry points)."""
    project = toml_loads((TESTDEV / "pyproject.toml").read_text())["project"]
    info = meta / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
    lines = []
    for group, entries in project["entry-points"].items():
        lines.append(f"[{group}]")
        lines += [f"{k} = {v}" for k, v in entries.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")


def device_env(meta: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(TESTDEV), str(meta)] + [p for p in [env.get("PYTHONPATH")] if p])
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # the venv's harness, ninja
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", COLUMNS="250")
    env.pop("HARNESS_CONFIG", None)
    env.update(extra)
    return env


def py(env, code: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def harness_cli(env, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([str(Path(sys.executable).parent / "harness"), *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def run_items(env, results: Path, *args: str, timeout: float = 600) -> dict:
    """``harness run ARGS --results RESULTS`` -> {(backend, check, variant or ""): item of summary.json}."""
    r = harness_cli(env, "run", *args, "--results", str(results), timeout=timeout)
    summary = json.loads((results / "summary.json").read_text()) if (results / "summary.json").exists() else None
    assert summary is not None, r.stdout[-3000:] + r.stderr[-3000:]
    return {(i["props"].get("harness.backend"), i["props"].get("harness.check"), i["props"].get("harness.variant", "")): i
            for i in summary["items"]}


def fallback_totals(log: Path) -> dict[str, int]:
    """Per-op CPU fallback counts summed over every process that wrote to ``TESTDEV_FALLBACK_LOG``."""
    counts: dict[str, int] = {}
    for line in log.read_text().splitlines() if log.exists() else []:
        for op, n in json.loads(line)["counts"].items():
            counts[op] = counts.get(op, 0) + n
    return counts
