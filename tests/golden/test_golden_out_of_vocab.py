"""A golden whose greedy tokens lie outside the vocabulary, re-hashed so its sha256 check passes, is a bad
golden: `harness golden verify` refuses it in one line and the precision check does not pass on it.
(It used to verify, and the check passed with generation_top1_agreement 0.0: every mismatch against
a token the model cannot emit was counted as a near tie.) Driven through the harness CLI."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SUITE = "llama-3.1-8b"


def _harness(*args, golden: Path, cwd: Path = REPO) -> subprocess.CompletedProcess:
    env = os.environ | {"HARNESS_GOLDEN_DIR": str(golden), "HF_HUB_OFFLINE": "1", "COLUMNS": "250"}
    return subprocess.run([sys.executable, "-m", "harness", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


@pytest.fixture
def out_of_vocab_golden(tmp_path) -> Path:
    """A copy of the committed golden whose generation tokens are shifted past the vocabulary, with the
    manifest's sha256/bytes of generation.safetensors recomputed as harness.golden.store writes them."""
    from safetensors.torch import load, save

    root = tmp_path / "golden"
    shutil.copytree(REPO / "golden" / SUITE, root / SUITE)
    d = root / SUITE
    if (d / "CURRENT").exists():  # a versioned golden: its files are in the version CURRENT names
        d = d / (d / "CURRENT").read_text().strip()
    mf = json.loads((d / "manifest.json").read_text())
    vocab = mf["tensors"]["logits"]["shape"][-1]
    f = d / "generation.safetensors"
    tensors = load(f.read_bytes())
    assert int(tensors["tokens"].max()) < vocab  # the committed golden is sound
    tensors["tokens"] = tensors["tokens"] + vocab  # every token id now in [vocab, 2 * vocab)
    data = save(tensors, metadata={"format": "pt"})
    f.write_bytes(data)
    mf["files"]["generation.safetensors"] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (d / "manifest.json").write_text(json.dumps(mf, sort_keys=True, indent=1))
    return root


def test_verify_refuses_out_of_vocab_tokens_in_one_line(out_of_vocab_golden):
    r = _harness("golden", "verify", SUITE, golden=out_of_vocab_golden)
    assert r.returncode == 1, r.stdout + r.stderr
    err = r.stderr.strip()
    assert err.count("\n") == 0, err
    assert err.startswith("error: ") and "generation.safetensors" in err and "outside the vocabulary" in err, err
    assert f"harness golden generate {SUITE} --update" in err
    assert "ok " not in r.stdout


@pytest.mark.slow
def test_precision_check_does_not_pass_on_out_of_vocab_golden(out_of_vocab_golden, tmp_path):
    res = tmp_path / "results"
    r = _harness("run", SUITE, "--check", "precision", "--backend", "cpu", "--dtype", "float32",
                 "--results", str(res), golden=out_of_vocab_golden)
    assert r.returncode != 0, r.stdout + r.stderr
    rows = json.loads((res / "summary.json").read_text())["items"]
    assert len(rows) == 1, rows
    row = rows[0]
    assert row["outcome"] == "error", row  # the golden's fault, not a failure of the target
    assert "outside the vocabulary" in row["message"] and "golden" in row["message"], row["message"]
    assert "metric.generation_top1_agreement" not in row["props"]  # never compared against bad tokens


def _corrupt_section(tmp_path, name: str, edit) -> Path:
    """A copy of the committed golden with section ``name``'s tensors edited by ``edit(tensors, vocab)``
    and re-hashed (its sha256 check passes)."""
    from safetensors.torch import load, save

    root = tmp_path / "golden"
    shutil.copytree(REPO / "golden" / SUITE, root / SUITE)
    d = root / SUITE
    if (d / "CURRENT").exists():
        d = d / (d / "CURRENT").read_text().strip()
    mf = json.loads((d / "manifest.json").read_text())
    f = d / f"{name}.safetensors"
    tensors = load(f.read_bytes())
    edit(tensors, mf["tensors"]["logits"]["shape"][-1])
    data = save(tensors, metadata={"format": "pt"})
    f.write_bytes(data)
    mf["files"][f"{name}.safetensors"] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (d / "manifest.json").write_text(json.dumps(mf, sort_keys=True, indent=1))
    return root


def _oov(t, vocab):
    t["padded.ids"] = t["padded.ids"] + vocab


def _mask(t, _vocab):
    t["padded.mask"] = t["padded.mask"] * 2


@pytest.mark.parametrize("edit,what", [(_oov, "outside the vocabulary"), (_mask, "mask with values other than 0 and 1")])
def test_verify_range_checks_the_decode_section(tmp_path, edit, what):
    # issue #49: out-of-vocabulary ids or a corrupted mask in the decode section passed `golden verify`
    # and then failed the target
    root = _corrupt_section(tmp_path, "decode", edit)
    r = _harness("golden", "verify", SUITE, golden=root)
    assert r.returncode == 1, r.stdout + r.stderr
    err = r.stderr.strip()
    assert err.startswith("error: ") and "decode.safetensors" in err and what in err, err
    res = tmp_path / "results"
    r = _harness("run", SUITE, "--check", "decode", "--backend", "cpu", "--dtype", "float32", "-k", "padded",
                 "--results", str(res), golden=root)
    rows = json.loads((res / "summary.json").read_text())["items"]
    assert rows and all(row["outcome"] == "error" and what in row["message"] for row in rows), rows
