"""Kubernetes: a JobSet manifest (jobset.x-k8s.io/v1alpha2) of a multi-node run, validated offline
against the JobSet CRD's own schema (issue #45 item 3).

``jobset_manifest(...)``: one replicated job of ``nodes`` pods (an Indexed Job, ``parallelism =
completions = nodes``), each running the same ``harness run SELECTION`` whose torchrun launches join a
c10d rendezvous at the leader pod's DNS name, ``<jobset>-<rjob>-0-0.<jobset>`` (JobSet's headless
service gives pod ``<jobset>-<rjob>-<job index>-<pod index>`` that name when
``network.enableDNSHostnames`` is on, under the subdomain that defaults to the JobSet's name), through
``HARNESS_TORCHRUN_ARGS`` (``harness.launch.group.Rendezvous``: the rendezvous arguments every node's
agent is given). Each pod writes its results under ``RESULTS/node-$JOB_COMPLETION_INDEX``.
Pods have no ``srun`` to start agents for a coordinator (``--launcher srun``): they run as peers.

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

SCHEMA_FILE = Path(__file__).with_name("schemas") / "jobset.x-k8s.io_jobsets.yaml"
API_VERSION = "jobset.x-k8s.io/v1alpha2"
RDZV_PORT = 29500  # torchrun's default master port; the leader's agent serves the c10d store on it


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
                    harness: list[str] | None = None, port: int = RDZV_PORT) -> dict:
    """The JobSet of ``harness run SELECTION`` on ``nodes`` pods of ``procs_per_node`` ranks each, results
    under ``RESULTS_DIR/node-<index>`` (module docstring); validated before it is returned."""
    for what, v in (("nodes", nodes), ("procs_per_node", procs_per_node)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{what} must be a positive integer, got {v!r}")
    leader = f"{name}-{replicated_job}-0-0.{name}"
    env: dict[str, str] = {"HF_HUB_OFFLINE": "1"}
    settings.set_env("HARNESS_TORCHRUN_ARGS", f"--nnodes {nodes} --rdzv-backend c10d "
                     f"--rdzv-endpoint {leader}:{port} --rdzv-id {name}", env)
    cmd = [*(harness or ["harness"]), "run", *selection_args]
    # JOB_COMPLETION_INDEX: Kubernetes sets it in every pod of an Indexed Job (0 .. nodes-1)
    script = "exec " + shlex.join(cmd) + " --results " + shlex.quote(results_dir.rstrip("/")) + '/node-"$JOB_COMPLETION_INDEX"'
    container = {
        "name": "harness",
        "image": image,
        "command": ["bash", "-c", script],
        "env": [{"name": k, "value": v} for k, v in env.items()],
        "ports": [{"containerPort": port, "name": "rdzv"}],
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
