"""Issue bodies: size cap with a visible note, mentions and secrets neutralised, reproduction line."""

from __future__ import annotations

import html
import json

from harness.compare.body import MAX_BODY, RunContext, render, repro
from harness.compare.classify import Finding
from harness.compare.issues import Group, fingerprint, marker, read_state
from harness.compare.junit import Case
from harness.compare.scrub import code_fence, scrub


def case(name, log="", details=None, outcome="failed"):
    return Case(key=f"suites.kimi-k2.toml::{name}", name=name, classname="suites.kimi-k2.toml",
                outcome=outcome, suite="kimi-k2", check=name.split("[")[0], backend="npu", dtype="bfloat16",
                device="Ascend 910B", variant="", metrics={}, tolerances={}, details=details or {},
                message="assert failed", log=log)


def group(findings):
    fields = {"suite": "kimi-k2", "backend": "npu", "kind": "failure"}
    return Group(fingerprint(fields), fields, findings)


def fail(name, **kw):
    c = case(name, **kw)
    return Finding("new_failure", "failure", c.key, "kimi-k2", "npu", c)


def test_huge_input_stays_under_the_limit_and_says_it_was_cut():
    g = group([fail(f"op_{i:05d}[npu-bfloat16]", log="x" * 50_000) for i in range(2_000)])
    body = marker(g) + render(g, RunContext())
    assert len(body) < MAX_BODY
    assert "**Truncated**" in body and "table rows" in body and "log excerpts" in body
    assert read_state(body)["digest"]  # the marker survives at the top


def test_mentions_and_secrets_are_neutralised(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_supersecretvalue123")
    text = scrub("ping @octocat and @acme/team; token hf_supersecretvalue123; ghp_" + "A" * 36
                 + "; Authorization: Bearer abcdefghijklmnopqrstu; mail me at a@b")
    assert "@octocat" not in text and "@\u200docto" in text and "@\u200dacme/team" in text
    assert "hf_supersecret" not in text and "ghp_AAAA" not in text and "abcdefghijklmnop" not in text
    g = group([fail("smoke[npu-bfloat16]", log="cc @maintainer\nHF_TOKEN=hf_supersecretvalue123")])
    body = render(g, RunContext(commit="abc", run_url="https://ci/1", machine="m"))
    assert "@maintainer" not in body and "hf_supersecretvalue123" not in body


def test_log_cannot_break_out_of_its_code_block():
    log = "```\n## I am a heading now\n````"
    assert code_fence(log) == "`````"
    body = render(group([fail("smoke[npu-bfloat16]", log=log)]), RunContext())
    assert "`````\n" in body


def test_body_names_everything_needed_to_act():
    layers = [{"module": "model.layers.0.self_attn", "max_abs_err": 0.5, "rel_rmse": 0.1, "cosine": 0.9,
               "tolerance": 0.01, "ok": False}]
    f = fail("precision[npu-bfloat16]", details={"first_divergent_module": "model.layers.0.self_attn",
                                                 "layer_table": json.dumps(layers)})
    body = render(group([f]), RunContext(commit="1234567890abcdef", baseline_commit="fedcba",
                                         run_url="https://github.com/a/b/actions/runs/9", machine="runner-7"))
    for needle in ("kimi-k2", "npu", "bfloat16", "Ascend 910B", "1234567890ab", "fedcba",
                   "https://github.com/a/b/actions/runs/9", "runner-7", "model.layers.0.self_attn",
                   "| test | metric | baseline | current | change | threshold |"):
        assert needle in html.unescape(body)  # names are entity-escaped in the markdown
    assert repro(group([f, fail("smoke[npu-bfloat16]")])) == \
        'tox -e model-kimi-k2 -- -k "precision[npu-bfloat16] or smoke[npu-bfloat16]"'


def test_run_url_and_commit_from_actions_environment(monkeypatch):
    monkeypatch.setenv("GITHUB_SERVER_URL", "https://ghe.example.com")
    monkeypatch.setenv("GITHUB_REPOSITORY", "org/repo")
    monkeypatch.setenv("GITHUB_RUN_ID", "77")
    monkeypatch.setenv("GITHUB_RUN_ATTEMPT", "2")
    monkeypatch.setenv("GITHUB_SHA", "deadbeef")
    ctx = RunContext.from_env()
    assert ctx.run_url == "https://ghe.example.com/org/repo/actions/runs/77/attempts/2"
    assert ctx.commit == "deadbeef" and ctx.machine


def test_repro_for_a_vanished_test_known_only_by_its_id():
    f = Finding("vanished", "vanished", "suites.kimi-k2.toml::moe[npu-bfloat16]", "kimi-k2", "npu")
    assert repro(group([f])) == 'tox -e model-kimi-k2 -- -k "moe[npu-bfloat16]"'
