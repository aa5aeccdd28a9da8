"""The secret scrubber (issue #49, "Security"): passwords in URLs, PEM private-key blocks and the
common cloud key shapes are cut from every output harness writes, from `harness run`'s files and
console to `harness compare`'s issues, pull-request comment and job summary."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from harness.cli import main as harness_main
from harness.compare.scrub import md_text, scrub_secrets
from tests_support import REPO_SUITES, TINY_PRUNE

TESTS = Path(__file__).resolve().parent.parent
HARNESS = str(Path(sys.executable).with_name("harness"))

# One secret of each shape (made up, never in the environment), and what must be left of its line.
PEM_BODY = "MIIEowIBAAKCAQEA7xQvZk3pQn5c9Rt1sYh0Lw2uVb8XmN4aJdKe6fGiHoPqTrSyUz"
SECRETS = {
    "url password": ("GET https://ci-bot:Sup3rS3cretPw@artifacts.example.com/m.bin", "Sup3rS3cretPw",
                     "GET https://***@artifacts.example.com/m.bin"),
    "url token": ("git clone https://oauth2:glq7Xv2Lm9Np4Rs8Tw1Yz@git.example.com/x.git", "glq7Xv2Lm9Np4Rs8Tw1Yz",
                  "git clone https://***@git.example.com/x.git"),
    "pem": (f"-----BEGIN RSA PRIVATE KEY-----\n{PEM_BODY}\n{PEM_BODY[::-1]}\n-----END RSA PRIVATE KEY-----",
            PEM_BODY, "***"),
    "pkcs8 in a repr": (f"key='-----BEGIN PRIVATE KEY-----\\n{PEM_BODY}\\n-----END PRIVATE KEY-----\\n'",
                        PEM_BODY, "key='***\\n'"),
    "google": ("maps?key=AIzaSyB7xQ2mN9pL4kR8tW1vZ3cY6hJ0dF5gS_e", "AIzaSyB7xQ2mN9pL4kR8tW1vZ3cY6hJ0dF5gS_e",
               "maps?key=***"),
    "aws key id": ("aws_access_key_id AKIAQ7W2E9R4T1Y8U3I6 ", "AKIAQ7W2E9R4T1Y8U3I6", "aws_access_key_id *** "),
    "aws secret": ("aws_secret_access_key=wJalrXUtnFEMI/K7MDENG/bPxRfiCYzq8Nw2Lk", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYzq8Nw2Lk",
                   "aws_secret_access_key=***"),
    "github": ("ghs_" + "R5tY7uI9oP1aS3dF5gH7jK9lZ2xC4vB6nM8q", "R5tY7uI9oP1aS3dF5gH7jK9lZ2xC4vB6nM8q", "***"),
    "github pat": ("github_pat_11AB2CD3E0" + "k" * 20 + "_Q9w8E7r6T5y4U3i2O1p0", "11AB2CD3E0" + "k" * 20, "***"),
    "slack": ("xoxb-2048163972-5120487316-Hk3Lm9Np2Qr7St4Vw", "Hk3Lm9Np2Qr7St4Vw", "***"),
    "bearer": ("curl -H 'Authorization: Bearer Zq8Nw2LkRt5Yp1Vx'", "Zq8Nw2LkRt5Yp1Vx", "curl -H 'Authorization: Bearer ***'"),
    "bearer alone": ("sent Bearer ZqNwLkRtYpVxJhGf to the proxy", "ZqNwLkRtYpVxJhGf", "sent Bearer *** to the proxy"),
}


@pytest.mark.parametrize("shape", list(SECRETS))
def test_each_shape_is_scrubbed_and_its_context_kept(shape):
    text, secret, left = SECRETS[shape]
    out = scrub_secrets(text)
    assert secret not in out and out == left
    assert scrub_secrets(out) == out  # idempotent: every writer may scrub again
    assert secret not in md_text(text)  # what GitHub gets, escaped after scrubbing


def test_a_pem_block_whose_end_was_cut_goes_to_the_end_of_the_text():
    out = scrub_secrets(f"loading key\n-----BEGIN EC PRIVATE KEY-----\n{PEM_BODY}\n{PEM_BODY}")
    assert out == "loading key\n***"


@pytest.mark.parametrize("text", [
    "ssh://git@github.com:22/acme/models.git",  # an account, no password
    "http://127.0.0.1:8080/v1/completions",  # a port is not a password
    "see https://docs.github.com/rest/users/users#get-the-authenticated-user",
    "the bearer of bad news; Bearer authentication failed",
    "-----BEGIN PUBLIC KEY-----",  # public keys are not secret
    "AIza is a prefix; AKIA too short AKIA123",
    "num_tokens: 1024, mask-xoxb shape",
])
def test_ordinary_text_is_left_alone(text):
    assert scrub_secrets(text) == text


# --- every output, end to end -------------------------------------------------------------------
# The first line (junit.xml's message, the console's detail) carries the one-line shapes and ends
# with a GitHub token straddling the 500th character, where the failure's first line is cut: a cut
# before the scrub would leave the token's first 16 characters; the PEM blocks follow.
_HEAD = "LEAKCHECK download failed: " + " | ".join(
    t for k, (t, _, _) in SECRETS.items() if k not in ("github", "github pat", "pem", "pkcs8 in a repr")) + " | "
MESSAGE = (_HEAD + "." * (480 - len(_HEAD)) + SECRETS["github"][0] + " (in the token cache)\n"
           + SECRETS["github pat"][0] + "\n" + SECRETS["pkcs8 in a repr"][0] + "\n" + SECRETS["pem"][0])
assert 0 < 480 - len(_HEAD) and MESSAGE.index("ghs_") == 480
ADAPTER = f'''
from transformers import LlamaForCausalLM

MESSAGE = {MESSAGE!r}


def leaky(config, dtype, device):
    """A forward that fails with every secret shape in its message (a download error, a config dump)."""
    m = LlamaForCausalLM(config)

    def fail(mod, args):
        raise RuntimeError(MESSAGE)

    m.model.layers[0].mlp.register_forward_pre_hook(fail)
    return m
'''


def _leaks(text: str) -> list[str]:
    """The secrets (or a head or tail of one: a cut must not leave one behind) found in ``text``."""
    return [shape for shape, (_, secret, _) in SECRETS.items()
            if secret in text or secret[:12] in text or secret[-12:] in text]


def test_no_secret_reaches_any_output_of_run_and_compare(tmp_path, github, capsys, monkeypatch):
    """A model failing with every shape above in its message: `harness run` (junit.xml, summary.json,
    summary.txt, journal.jsonl, its console), then `harness compare` (issue body, pull-request
    comment, --summary, the job summary, its console) carry the failure, and none of the secrets."""
    shutil.copytree(REPO_SUITES / "configs", tmp_path / "suites" / "configs")
    (tmp_path / "leaky.py").write_text(ADAPTER)
    (tmp_path / "suites" / "leaky.toml").write_text(
        'backends = ["cpu"]\ndtypes = ["float32"]\n[model]\nconfig = "configs/Llama-3.1-8B.json"\n'
        'adapter = "leaky:leaky"\n' + TINY_PRUNE + "\n[checks.smoke]\ngenerate_tokens = 2\n")
    res = tmp_path / "results"
    env = os.environ | {"HF_HUB_OFFLINE": "1", "COLUMNS": "250", "PYTHONPATH": os.pathsep.join(
        [str(tmp_path), str(TESTS), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([HARNESS, "run", "--check", "smoke", "--results", str(res)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=240)
    outputs = {"run console": r.stdout + r.stderr}
    assert r.returncode == 1 and "LEAKCHECK" in outputs["run console"], outputs["run console"]
    assert "Bearer ***" in outputs["run console"]  # the last one-line shape reached the console, scrubbed
    for name in ("junit.xml", "summary.json", "summary.txt", "journal.jsonl"):
        outputs[name] = (res / name).read_text()
    failure = ET.parse(res / "junit.xml").getroot().find(".//failure")
    assert "LEAKCHECK" in failure.get("message") and "https://***@artifacts.example.com" in failure.text
    assert "https://***@artifacts.example.com" in json.loads(outputs["summary.json"])["items"][0]["longrepr"]

    pr = github.state.add_issue("Make attention faster", user="pr-author")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(tmp_path / "step.md"))
    code = harness_main(["compare", str(res / "junit.xml"), "--history", "h.sqlite", "--sink", "github",
                         "--github-url", github.url, "--mute-file", "", "--summary", "summary.md",
                         "--pr-comment", str(pr)])
    cap = capsys.readouterr()
    assert code == 0, cap.out + cap.err
    (issue,) = [i for n, i in github.state.issues.items() if n != pr]
    (comment,) = github.state.issues[pr]["comments"]
    outputs |= {"compare console": cap.out + cap.err, "issue body": issue["title"] + issue["body"],
                "pr comment": comment["body"], "summary.md": (tmp_path / "summary.md").read_text(),
                "job summary": (tmp_path / "step.md").read_text()}
    for where, text in outputs.items():
        assert _leaks(text) == [], where
    # the failure did reach the outputs that show it: the check above is not vacuous
    shown = [w for w, text in outputs.items() if "LEAKCHECK" in text]
    assert {"run console", "junit.xml", "summary.json", "summary.txt", "journal.jsonl", "compare console",
            "issue body", "summary.md", "job summary"} <= set(shown), shown
    assert "smoke&#91;cpu-float32&#93;" in outputs["pr comment"]
