"""Kubernetes: a JobSet manifest (jobset.x-k8s.io/v1alpha2) of a multi-node run, validated offline
against the JobSet CRD's own schema (issue #45 item 3).

``jobset_manifest(...)``: one replicated job of ``nodes`` pods (an Indexed Job, ``parallelism =
completions = nodes``). Nothing in a pod can start a process in another pod, so the launch is pulled
(``--launcher agents``, harness/launch/agents.py): pod 0 (``JOB_COMPLETION_INDEX`` 0, the leader) runs
``harness run SELECTION --nodes N --launcher agents`` - the coordinator: it serves the agents store on
``AGENTS_PORT``, starts node 0's share of every launch and writes the results into ``RESULTS`` - and
pods 1..N-1 run ``harness node-agent --coordinator <leader>:AGENTS_PORT`` (their node index: their
``JOB_COMPLETION_INDEX``), which run their node's share of each launch and exit 0 when the run ends.
The leader's DNS name is ``<jobset>-<rjob>-0-0.<jobset>`` (JobSet's headless service gives pod
``<jobset>-<rjob>-<job index>-<pod index>`` that name when ``network.enableDNSHostnames`` is on, under
the subdomain that defaults to the JobSet's name). Each launch's rendezvous and result store then
listen on free ports of the leader, chosen per launch (pods reach each other on any port).

``validate(manifest)``: the JobSet CRD's ``openAPIV3Schema`` (schemas/jobset.x-k8s.io_jobsets.yaml,
copied byte for byte from kubernetes-sigs/jobset, see schemas/README.md) with ``jsonschema``;
``ManifestError`` names the field and says the schema's message. What the API server adds on top
(CEL rules under ``x-kubernetes-validations``, immutability, admission webhooks) is not checked offline.
"""

from __future__ import annotations

import functools
import shlex
from pathlib import Path

from harness import settings
from harness.launch.agents import DEFAULT_PORT

SCHEMA_FILE = Path(__file__).with_name("schemas") / "jobset.x-k8s.io_jobsets.yaml"
API_VERSION = "jobset.x-k8s.io/v1alpha2"
AGENTS_PORT = DEFAULT_PORT  # the leader's agents store: the one port the other pods are told


class ManifestError(ValueError):
    """A manifest the schema refuses: ``<field path>: <the schema's message>``."""


@functools.cache
def schema() -> dict:
    """The v1alpha2 ``openAPIV3Schema`` of the JobSet CRD (libyaml's parser when PyYAML has it: the CRD
    is 0.8 MB, 0.3 s instead of 4 s)."""
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    crd = yaml.load(SCHEMA_FILE.read_text(encoding="utf-8"), Loader=loader)
    for v in crd["spec"]["versions"]:
        if f"{crd['spec']['group']}/{v['name']}" == API_VERSION:
            return v["schema"]["openAPIV3Schema"]
    raise LookupError(f"{SCHEMA_FILE.name} has no {API_VERSION} version")


@functools.cache
def _validator():
    """JSON Schema draft 4 (OpenAPI v3.0's schema objects: boolean exclusiveMaximum, no const), plus
    what a structural CRD does with an unknown field: the API server prunes it silently (a typo such as
    ``replicatedJob`` would vanish), and ``kubectl --validate=strict`` refuses it - so do we, unless the
    object says ``x-kubernetes-preserve-unknown-fields`` or declares ``additionalProperties``."""
    import jsonschema

    base = jsonschema.Draft4Validator.VALIDATORS["properties"]

    def properties(validator, props, instance, schema_):
        yield from base(validator, props, instance, schema_)
        if validator.is_type(instance, "object") and not schema_.get("x-kubernetes-preserve-unknown-fields") \
                and "additionalProperties" not in schema_:
            for key in sorted(set(instance) - set(props)):
                yield jsonschema.ValidationError(f"unknown field {key!r} (known: {_some(sorted(props))})",
                                                 path=[key])

    return jsonschema.validators.extend(jsonschema.Draft4Validator, {"properties": properties})


def _some(names: list[str], n: int = 10) -> str:
    return ", ".join(names[:n]) + (f", ... {len(names) - n} more" if len(names) > n else "")


def validate(manifest: dict) -> None:
    """ManifestError for the first violation (the deepest, most specific one), naming its field."""
    import jsonschema

    if not isinstance(manifest, dict):
        raise ManifestError(f"a manifest is a mapping, got {type(manifest).__name__}")
    if manifest.get("apiVersion") != API_VERSION or manifest.get("kind") != "JobSet":
        raise ManifestError(f"apiVersion/kind: expected {API_VERSION} JobSet, got "
                            f"{manifest.get('apiVersion')!r} {manifest.get('kind')!r}")
    err = jsonschema.exceptions.best_match(_validator()(schema()).iter_errors(manifest))
    if err is not None:
        where = ".".join(str(p) for p in err.absolute_path) or "(the manifest)"
        raise ManifestError(f"{where}: {err.message}")


def jobset_manifest(selection_args: list[str], nodes: int, procs_per_node: int, name: str, image: str,
                    results_dir: str = "/results", *, replicated_job: str = "node", namespace: str | None = None,
                    harness: list[str] | None = None, port: int = AGENTS_PORT) -> dict:
    """The JobSet of ``harness run SELECTION`` on ``nodes`` pods of ``procs_per_node`` ranks each: pod 0
    coordinates and writes the results into ``results_dir``, pods 1..N-1 run node agents (module
    docstring); validated before it is returned."""
    for what, v in (("nodes", nodes), ("procs_per_node", procs_per_node)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{what} must be a positive integer, got {v!r}")
    leader = f"{name}-{replicated_job}-0-0.{name}"
    env: dict[str, str] = {"HF_HUB_OFFLINE": "1"}
    settings.set_env("HARNESS_AGENTS_PORT", port, env)
    exe = harness or ["harness"]
    run = [*exe, "run", *selection_args, "--nodes", str(nodes), "--launcher", "agents",
           "--results", results_dir.rstrip("/") or "/"]
    agent = [*exe, "node-agent", "--coordinator", f"{leader}:{port}"]
    # JOB_COMPLETION_INDEX: Kubernetes sets it in every pod of an Indexed Job (0 .. nodes-1); the agent
    # reads it as its node index. With one node there is nobody to pull: pod 0 runs alone.
    script = (f'if [ "$JOB_COMPLETION_INDEX" = 0 ]; then exec {shlex.join(run)}; '
              f"else exec {shlex.join(agent)}; fi")
    container = {
        "name": "harness",
        "image": image,
        "command": ["bash", "-c", script],
        "env": [{"name": k, "value": v} for k, v in env.items()],
        "ports": [{"containerPort": port, "name": "agents"}],
        "resources": {"requests": {"cpu": str(procs_per_node)}},  # one CPU per rank at least
    }
    manifest = {
        "apiVersion": API_VERSION,
        "kind": "JobSet",
        "metadata": {"name": name, **({"namespace": namespace} if namespace else {})},
        "spec": {
            # the leader's DNS name <jobset>-<rjob>-0-0.<jobset> exists only with DNS hostnames on
            "network": {"enableDNSHostnames": True},
            # the same pod as the leader, said to JobSet: it annotates every pod with its stable endpoint
            "coordinator": {"replicatedJob": replicated_job, "jobIndex": 0, "podIndex": 0},
            "failurePolicy": {"maxRestarts": 0},  # a failed node fails the run: a restart would hide it
            "successPolicy": {"operator": "All"},
            "replicatedJobs": [{
                "name": replicated_job,
                "replicas": 1,
                "template": {"spec": {
                    "parallelism": nodes, "completions": nodes, "completionMode": "Indexed", "backoffLimit": 0,
                    "template": {"spec": {"restartPolicy": "Never", "containers": [container]}},
                }},
            }],
        },
    }
    validate(manifest)
    return manifest


def dump(manifest: dict) -> str:
    import yaml

    return yaml.safe_dump(manifest, sort_keys=False, default_flow_style=False)
