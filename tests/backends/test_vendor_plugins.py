"""A vendor package registers a check, a backend with its op list, a model builder and an issue sink
through real entry points (a dist-info on PYTHONPATH), and the harness CLI uses all four the way it
uses its own built-ins; a broken entry point is one named error and costs nothing else."""

from __future__ import annotations

import json
import shutil
import xml.etree.ElementTree as ET

import pytest
from vendor_plugin import harness, vendor_site

from tests_support import REPO_SUITES, TINY_PRUNE

SUITE = 'backends = ["cpu"]\ndtypes = ["float32", "bfloat16"]\n[model]\nconfig = "configs/Llama-3.1-8B.json"\n' \
        'adapter = "vendormodel"\n' + TINY_PRUNE


@pytest.fixture
def project(tmp_path):
    shutil.copytree(REPO_SUITES / "configs", tmp_path / "suites" / "configs")
    (tmp_path / "suites" / "tiny.toml").write_text(SUITE)
    return tmp_path


def test_a_vendor_backend_declares_its_op_list(tmp_path):
    site = vendor_site(tmp_path)
    be = harness("backends", "--json", cwd=tmp_path, site=site)
    assert be.returncode == 0, be.stderr
    row = next(r for r in json.loads(be.stdout) if r["name"] == "mydev")
    assert row["source"] == "harness-mydev (harness_mydev:register_backends)" and not row["available"]
    show = harness("oplist", "show", "--backend", "mydev", cwd=tmp_path, site=site)
    assert show.returncode == 0, show.stderr
    assert "mydev 1.0: mydev-1.0.txt, 3 ops, unlisted ops missing" in show.stdout
    assert "declared by harness-mydev (harness_mydev:register_backends)" in show.stdout
    assert "source: vendorx/torch_mydev" in show.stdout
    everything = harness("oplist", "show", cwd=tmp_path, site=site).stdout
    assert "npu 2.13.0" in everything and "mydev 1.0" in everything  # the built-ins declare theirs alike
    # the ops check and `harness inspect` read the declared list (not installed: no dispatcher)
    code = ("from harness.inspect.coverage import backend_source, classify_op\n"
            "from harness.inspect.report import all_backends\n"
            "key, ol, src = backend_source('mydev')\n"
            "print(src); print(classify_op('aten.mm.default', op_list=ol)[0], "
            "classify_op('aten.add.Tensor', op_list=ol)[0], classify_op('aten.topk.default', op_list=ol)[0])\n"
            "print('mydev' in all_backends())\n")
    import os
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env={k: v for k, v in os.environ.items() if k != "HARNESS_CONFIG"} | {"PYTHONPATH": str(site)})
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "mydev-1.0.txt" in lines[0] and lines[1] == "native cpu-fallback missing" and lines[2] == "True"


@pytest.mark.slow
def test_vendor_check_builder_and_sink_through_the_cli(project):
    site = vendor_site(project)
    v = harness("validate", "--no-build", cwd=project, site=site)
    assert "ok    suites/tiny.toml" in v.stdout, v.stdout + v.stderr
    # without the package, the builder's name is an error that lists the registered builders
    v = harness("validate", "--no-build", cwd=project)
    assert "model.adapter: unknown model builder 'vendormodel' (registered: hf)" in v.stdout, v.stdout
    r = harness("run", "tiny", "--check", "vendorcheck", "--no-isolate", cwd=project, site=site)
    assert "1 passed, 1 failed, 0 errors, 0 skipped" in r.stdout, r.stdout + r.stderr
    assert "vendor kernel mismatch in bfloat16" in r.stdout  # the builder ran: float32 passed
    row = next(line for line in r.stdout.splitlines() if "│" in line and "vendorcheck" in line and "passed" in line)
    assert "vendor_params=" in row
    junit = project / "results" / "junit.xml"
    checks = {p.get("value") for p in ET.parse(junit).getroot().iter("property") if p.get("name") == "harness.check"}
    assert checks == {"vendorcheck"}
    out = project / "issues"
    c = harness("compare", str(junit), "--sink", "vendorlog", "--out-dir", str(out), cwd=project, site=site)
    assert c.returncode == 0, c.stdout + c.stderr
    logged = [json.loads(line) for line in (out / "vendor-sink.jsonl").read_text().splitlines()]
    assert logged and all(e["op"] == "create" for e in logged) and "tiny on cpu" in logged[0]["title"]
    bad = harness("compare", str(junit), "--sink", "vendorlog", cwd=project)  # not installed
    assert bad.returncode == 2 and "unknown issue sink 'vendorlog' (registered: github, file, stdout)" in bad.stderr, \
        bad.stderr


def test_a_broken_entry_point_is_one_named_error_and_costs_nothing_else(tmp_path):
    site = vendor_site(tmp_path, broken=True)
    r = harness("backends", "--json", cwd=tmp_path, site=site)
    assert "mydev" in {b["name"] for b in json.loads(r.stdout)}  # the vendor's backend still loads
    s = harness("validate", "--schema", cwd=tmp_path, site=site)
    assert "`checks.vendorcheck.enabled`" in s.stdout and "`checks.smoke.steps`" in s.stdout  # the other checks
    errors = [line for line in s.stderr.splitlines() if line.startswith("harness: error:")]
    assert errors == ["harness: error: broken harness.checks entry point brokencheck = harness_broken_not_there:register "
                      "(from harness-broken): ModuleNotFoundError: No module named 'harness_broken_not_there'"], s.stderr
    assert s.returncode == 1
