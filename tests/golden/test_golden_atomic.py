"""Golden writes through the command line: one atomic step (a version folder and a CURRENT pointer
swapped by one rename), kill -9 at any moment leaves the old or the new golden, a read-only golden
folder is refused before anything is built, new folders honour the umask."""

from __future__ import annotations

import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests_support import read_only

REPO = Path(__file__).resolve().parents[2]
SUITE = "llama-3.1-8b"
HARNESS = str(Path(sys.executable).with_name("harness"))
ENV = os.environ | {"HF_HUB_OFFLINE": "1"}

# A writer that replaces the golden again and again with real tensors (the stored golden's, with a
# changing input so each version differs), as `golden generate --update` does at its end: the
# loop spends its time in the write itself, where a kill is the dangerous moment.
WRITER = r'''
import sys, time
from harness.golden import store
path = store.golden_dir(sys.argv[2], sys.argv[1])
g = store.load_golden_dir(path)
files = {"inputs": {"input_ids": g.inputs}, "modules": {**g.modules, **{k + store.IN: v for k, v in g.module_inputs.items()}},
         "generation": g.generation, **g.section_tensors}
manifest = {k: v for k, v in g.manifest.items() if k != "files"}
print("ready", flush=True)
n = 0
while True:
    n += 1
    store.write_golden(path, dict(manifest, created=str(n)), files, update=True)
'''


def _cli(*args, timeout=300):
    return subprocess.run([HARNESS, *args], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def golden_root(tmp_path_factory) -> Path:
    """One real golden made by the command line with umask 022 (shared by the tests below)."""
    root = tmp_path_factory.mktemp("golden")
    old = os.umask(0o022)
    try:
        r = _cli("golden", "generate", SUITE, "--golden-dir", str(root / "g"))
    finally:
        os.umask(old)
    assert r.returncode == 0, r.stdout + r.stderr
    return root / "g"


def test_a_new_golden_folder_honours_the_umask(golden_root):
    suite_dir = golden_root / SUITE
    version = suite_dir / (suite_dir / "CURRENT").read_text().strip()
    for d in (suite_dir, version):
        assert stat.S_IMODE(d.stat().st_mode) == 0o755, d  # mkdtemp made it 0700
    assert stat.S_IMODE((version / "modules.safetensors").stat().st_mode) == 0o644


def test_kill_9_at_random_moments_always_leaves_an_intact_golden(golden_root, tmp_path):
    """Each kill is checked as it lands (in process), then the user's check: the command line's verify,
    and the generate that cleans up after the kills. (One loop for both: the writers' imports are most
    of its time, and a second loop of its own for the per-kill check cost 6 more of them.)"""
    from harness.golden import store

    root = tmp_path / "g"
    shutil.copytree(golden_root, root, symlinks=True)
    rng = random.Random(24)
    kills = 6  # each a writer process of its own (its imports are most of its time)
    for _ in range(kills):
        p = subprocess.Popen([sys.executable, "-c", WRITER, str(root), SUITE], cwd=REPO, env=ENV,
                             stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.0, 0.25))  # a write takes ~10-30 ms: each kill lands somewhere in one
        p.send_signal(signal.SIGKILL)
        p.wait()
        p.stdout.close()
        g = store.load_golden_dir(root / SUITE)  # sha256 and every tensor against the manifest
        assert g.order and "logits" in g.modules
    r = _cli("golden", "verify", SUITE, "--golden-dir", str(root))
    assert r.returncode == 0 and r.stdout.startswith("ok "), r.stdout + r.stderr
    # the last generate cleans what the kills left: one version, no temporary folders
    r = _cli("golden", "generate", SUITE, "--update", "--golden-dir", str(root))
    assert r.returncode == 0, r.stdout + r.stderr
    left = sorted(p.name for p in (root / SUITE).iterdir())
    assert len(left) == 2 and left[0] == "CURRENT" and left[1].startswith("v-"), left
    assert not [p for p in root.iterdir() if p.name.startswith(".")]
    assert _cli("golden", "verify", SUITE, "--golden-dir", str(root)).returncode == 0


def test_a_read_only_golden_folder_is_refused_before_anything_is_built(tmp_path):
    with read_only(tmp_path / "ro") as ro:
        t0 = time.monotonic()
        r = _cli("golden", "generate", SUITE, "--golden-dir", str(ro))
        elapsed = time.monotonic() - t0
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stdout + r.stderr
    assert len(err) == 1 and err[0].startswith(f"error: golden directory {ro} is not writable: "), r.stderr
    assert "Traceback" not in r.stderr
    assert elapsed < 15  # nothing built: the reference alone takes longer on this machine


def test_legacy_flat_golden_is_read_and_replaced_in_one_step(golden_root, tmp_path):
    """A golden of the layout before versions (files directly in golden/<suite>/, as committed)
    reads as before, and --update replaces it by the pointer swap (flat files pruned after)."""
    from harness.golden import store

    root = tmp_path / "g"
    flat = root / SUITE
    src = store.current_dir(golden_root / SUITE)
    shutil.copytree(src, flat)
    assert store.load_golden_dir(flat).order
    leftover = root / f".{SUITE}.tmp-{2**22 + 5}-1-ab12cd34"  # a killed writer's, dead pid
    leftover.mkdir()
    r = _cli("golden", "generate", SUITE, "--update", "--golden-dir", str(root))
    assert r.returncode == 0, r.stdout + r.stderr
    names = sorted(p.name for p in flat.iterdir())
    assert names[0] == "CURRENT" and len(names) == 2 and not leftover.exists(), names
    assert _cli("golden", "verify", SUITE, "--golden-dir", str(root)).returncode == 0
