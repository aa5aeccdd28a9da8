"""`harness plan --emit k8s`: a JobSet manifest validated offline against the JobSet CRD's own schema
(the copied file is the upstream one, byte for byte); broken manifests are refused naming the field.
Pod 0 coordinates (`harness run --launcher agents`), pods 1..N-1 run `harness node-agent` pointed at it."""

from __future__ import annotations

import hashlib
import re
import subprocess

import pytest
import yaml

from harness.cli import main
from harness.launch import k8s


def _manifest(nodes=2):
    return k8s.jobset_manifest(["llama-3.1-8b", "--check", "parallel", "--scope", "nightly"], nodes, 4,
                               "harness-nightly", "registry.example/harness:1")


def test_the_schema_is_the_upstream_file_recorded_in_its_readme():
    readme = (k8s.SCHEMA_FILE.parent / "README.md").read_text()
    sha = re.search(r"sha256 `([0-9a-f]{64})`", readme).group(1)
    assert hashlib.sha256(k8s.SCHEMA_FILE.read_bytes()).hexdigest() == sha
    assert k8s.schema()["properties"]["spec"]["properties"]["replicatedJobs"]["type"] == "array"


def test_the_manifest_validates_pod_0_coordinates_and_the_others_pull_from_it():
    m = _manifest(3)
    k8s.validate(m)
    rjob = m["spec"]["replicatedJobs"][0]
    job = rjob["template"]["spec"]
    assert (rjob["replicas"], job["parallelism"], job["completions"], job["completionMode"]) == (1, 3, 3, "Indexed")
    container = job["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert "HARNESS_TORCHRUN_ARGS" not in env and env["HARNESS_AGENTS_PORT"] == "29600"
    assert container["ports"] == [{"containerPort": 29600, "name": "agents"}]
    assert m["spec"]["network"]["enableDNSHostnames"] is True
    # the one script of every pod, run by a real shell as each pod's index: which command it execs
    script = container["command"][2]
    ran = {}
    for index in range(3):
        shim = f'exec() {{ printf "%s\\n" "$@"; }}; JOB_COMPLETION_INDEX={index}; {script}'
        ran[index] = subprocess.run(["bash", "-c", shim], capture_output=True, text=True, check=True).stdout.split()
    assert ran[0] == ["harness", "run", "llama-3.1-8b", "--check", "parallel", "--scope", "nightly", "--nodes", "3",
                      "--launcher", "agents", "--results", "/results"]
    leader = "harness-nightly-node-0-0.harness-nightly:29600"  # pod 0's name under JobSet's headless service
    assert ran[1] == ran[2] == ["harness", "node-agent", "--coordinator", leader]
    # what pod 0 runs is a valid `harness run` command line, and `node-agent` one too
    from harness.cli import build_parser

    run = build_parser().parse_args(ran[0][1:])
    assert (run.nodes, run.launcher) == (3, "agents")
    assert build_parser().parse_args(ran[1][1:]).coordinator == leader


@pytest.mark.parametrize("break_it, field, says", [
    (lambda m: m["spec"]["replicatedJobs"][0].__setitem__("replicas", "two"), "spec.replicatedJobs.0.replicas",
     "'two' is not of type 'integer'"),
    (lambda m: m["spec"]["replicatedJobs"][0].pop("name"), "spec.replicatedJobs.0", "'name' is a required property"),
    (lambda m: m["spec"].__setitem__("replicatedJob", []), "spec.replicatedJob", "unknown field 'replicatedJob'"),
])
def test_a_broken_manifest_is_refused_naming_the_field(break_it, field, says):
    m = _manifest()
    break_it(m)
    with pytest.raises(k8s.ManifestError) as e:
        k8s.validate(m)
    assert str(e.value).startswith(f"{field}: ") and says in str(e.value), str(e.value)


def test_plan_emits_a_valid_jobset(tmp_path, capsys):
    out = tmp_path / "jobset.yaml"
    rc = main(["plan", "llama-3.1-8b", "--devices", "2", "--device-memory", "80GiB", "--nodes", "2",
               "--emit", "k8s", "--emit-to", str(out), "--image", "registry.example/harness:1"])
    assert rc == 0, capsys.readouterr()
    m = yaml.safe_load(out.read_text())
    k8s.validate(m)
    assert m["spec"]["replicatedJobs"][0]["template"]["spec"]["parallelism"] == 2
    # a model that fits nowhere has nothing to launch: one line, exit 2
    rc = main(["plan", "llama-3.1-8b", "--devices", "1", "--device-memory", "1GiB", "--emit", "k8s"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("harness plan: --emit: no layout fits") and err.count("\n") == 1
