"""Text from a model, a rank, a file or an exception is printed as text, never read as markup, and
credentials in it never reach an output: through the command line as a user runs it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from tests_support import REPO_SUITES, TINY_PRUNE

TESTS = Path(__file__).resolve().parent.parent
HARNESS = str(Path(sys.executable).with_name("harness"))
TOKEN = "hf_AbCdEfGhIjKlMnOpQrStUvWxYz012345"


def _env(**kw):
    return os.environ | {"HF_HUB_OFFLINE": "1", "COLUMNS": "250",
                         "PYTHONPATH": f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"} | kw


def test_a_suite_name_shaped_like_markup_is_one_error_line(tmp_path):
    (tmp_path / "suites").mkdir()
    r = subprocess.run([HARNESS, "run", "x[/__w/pytorch/gloo]"], cwd=tmp_path, env=_env(), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "MarkupError" not in r.stdout + r.stderr and "Traceback" not in r.stderr
    assert "x[/__w/pytorch/gloo]" in r.stdout


def test_a_backend_reason_shaped_like_markup_prints_as_text(tmp_path):
    cfg = tmp_path / "harness.toml"
    cfg.write_text('[[backends]]\nname = "mydev"\nmodule = "torch_mydev"\ndevice_type = "mydev"\n'
                   'description = "[/__w/x]"\n')
    r = subprocess.run([HARNESS, "backends"], cwd=tmp_path, env=_env(HARNESS_CONFIG=str(cfg)), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stdout + r.stderr
    assert "mydev" in r.stdout


def test_a_hostile_failure_message_reaches_every_output_as_text_without_its_token(tmp_path):
    """A model failing with a gloo location ('[/__w/...]', '[red]') and an hf_ token: the run ends
    with its table, the message is shown verbatim, and the token is in no file and no output;
    then `harness compare` files the issue (file sink) and `harness report` writes the HTML."""
    shutil.copytree(REPO_SUITES / "configs", tmp_path / "suites" / "configs")
    (tmp_path / "suites" / "hostile.toml").write_text(
        'backends = ["cpu"]\ndtypes = ["float32"]\n[model]\nconfig = "configs/Llama-3.1-8B.json"\n'
        'adapter = "faulty_models:hostile_error"\n' + TINY_PRUNE + "\n[checks.smoke]\ngenerate_tokens = 2\n")
    res = tmp_path / "results"
    r = subprocess.run([HARNESS, "run", "--check", "smoke", "--no-isolate", "--results", str(res)], cwd=tmp_path,
                       env=_env(), capture_output=True, text=True, timeout=240)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out  # failed item: a failure, never a crash at the end
    assert "MarkupError" not in out and "Traceback" not in out, out
    assert "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534]" in out
    assert "[red]x[/red]" in out  # shown as the characters it is, not as colour
    assert TOKEN not in out and "Bearer ***" in out
    for name in ("junit.xml", "summary.json", "summary.txt", "journal.jsonl"):
        assert TOKEN not in (res / name).read_text(), name
    msg = ET.parse(res / "junit.xml").getroot().find(".//failure").get("message")
    assert "[/__w/pytorch" in msg and "Bearer ***" in msg
    assert json.loads((res / "summary.json").read_text())["counts"]["failed"] == 1
    # the comparator's outputs
    issues = tmp_path / "issues"
    r = subprocess.run([HARNESS, "compare", str(res / "junit.xml"), "--sink", "file", "--out-dir", str(issues),
                        "--history", str(tmp_path / "h.sqlite"), "--summary", str(tmp_path / "summary.md")],
                       cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=240)
    assert "Traceback" not in r.stderr, r.stdout + r.stderr
    bodies = "".join(p.read_text() for p in issues.rglob("*") if p.is_file())
    assert bodies and TOKEN not in bodies and TOKEN not in r.stdout + r.stderr
    r = subprocess.run([HARNESS, "report", str(res / "junit.xml"), "-o", str(tmp_path / "r.html")], cwd=tmp_path,
                       env=_env(), capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    html = (tmp_path / "r.html").read_text()
    assert TOKEN not in html and "<script" not in html.lower()
