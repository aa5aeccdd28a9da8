"""``harness plan SUITE|CONFIG.json --devices N --device-memory 141GiB``: the feasible
(tp, pp, ep, dp, cp, ZeRO stage, recompute) layouts of the full-size model, with a per-device memory
breakdown and the communication per step, ranked, and the recommendation with its reason. Same
parameter, checkpoint and KV-cache figures as ``harness inspect``. See docs/parallel.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from harness.numbers import amount, count


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="which parallel layouts of the full-size model fit a cluster, ranked",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", help="suite name, suite .toml, or a config.json")
    # --devices/--nodes/--batch/--context: plan.check_inputs bounds them (one line naming the option)
    # A suite's [plan] table (devices, device_memory_gib, nodes, mode) fills what is not given.
    p.add_argument("--devices", type=int, help="devices per node (default: the suite's [plan] devices)")
    p.add_argument("--device-memory", help="memory of one device, e.g. 141GiB or 80GB (default: the suite's "
                   "[plan] device_memory_gib)")
    p.add_argument("--nodes", type=int, help="nodes (default: the suite's [plan] nodes, else 1)")
    p.add_argument("--mode", choices=("inference", "training"), help="default: the suite's [plan] mode, else inference")
    p.add_argument("--batch", type=int, default=1, help="sequences per step (default 1)")
    p.add_argument("--context", type=int, default=4096, help="tokens per sequence (default 4096)")
    p.add_argument("--weights", choices=("checkpoint", "bfloat16", "float32"), default="checkpoint",
                   help="inference weight format: the checkpoint's (quantized where it is), or a dtype")
    p.add_argument("--usable", type=amount(0, 1, low_open=True), default=0.9, help="fraction of device memory a layout may use")
    p.add_argument("--top", type=count(1, 100000), default=12, help="layouts shown")
    p.add_argument("--json", metavar="PATH", help="write the whole plan as JSON ('-' for stdout)")
    # --emit: the launch of the recommended layout (nodes x --devices ranks) on a scheduler (issue #45)
    e = p.add_argument_group("emit a launch of the recommended layout (docs/parallel.md, multi-node checklist)")
    e.add_argument("--emit", choices=("slurm", "k8s"), help="print the sbatch script (slurm) or JobSet manifest (k8s)")
    e.add_argument("--emit-to", metavar="PATH", help="write it to PATH instead of printing it")
    e.add_argument("--run-args", metavar="ARGS", help="what the job runs, shell-split (default: "
                   "'TARGET --check parallel --scope nightly')")
    e.add_argument("--results", default="results", metavar="DIR", help="the job's results folder (default results)")
    e.add_argument("--time-limit", type=amount(0, 366 * 86400, low_open=True), default=3600.0, metavar="SECONDS",
                   help="the job's time limit (default 3600)")
    e.add_argument("--partition", help="slurm: the partition (default: the cluster's)")
    e.add_argument("--image", default="harness:latest", help="k8s: the container image with harness installed")
    # --rehearse: the layout parallelized at the full world size on a fake process group (issue #48)
    p.add_argument("--rehearse", nargs="?", const="best", metavar="LAYOUT",
                   help="rehearse the plan's best layout (or LAYOUT, a parallel-check name such as ep32xtp8xpp4) "
                        "at devices x nodes ranks on the meta device (docs/parallel.md)")
    p.set_defaults(func=run)


def run(args) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from harness.inspect.params import load_target
    from harness.models.config import UnknownArchitectureError
    from harness.parallel.plan import check_inputs, model_facts, parse_bytes, plan, render
    from harness.settings import load_settings
    from harness.suite.loader import SuiteError

    try:
        target = None
        if args.devices is None or args.device_memory is None:  # the suite's [plan] says
            target = load_target(args.target, load_settings().suites_dir)
        cluster_from_suite(args, target)
        mem = parse_bytes(args.device_memory)
        check_inputs(devices_per_node=args.devices, nodes=args.nodes, device_memory=mem, batch=args.batch,
                     context=args.context, usable=args.usable)  # given ones: before the model is even read
        target = target or load_target(args.target, load_settings().suites_dir)
        facts = model_facts(target, args.weights, args.context)
    except (SuiteError, UnknownArchitectureError, ValueError, KeyError) as e:
        print(f"harness plan: {e}", file=sys.stderr)
        return 2
    rep = plan(facts, devices_per_node=args.devices, nodes=args.nodes, device_memory=mem, mode=args.mode,
               batch=args.batch, context=args.context, usable=args.usable)
    if args.emit:
        return _emit(args, rep, target)
    if args.rehearse:
        return _rehearse(args, rep, target)
    if args.json == "-":
        print(json.dumps(rep.to_dict(), indent=1))
        return 0
    if args.json:
        from harness.files import atomic

        atomic.write_json(args.json, rep.to_dict(), newline=False)
    print(render(rep, args.top))
    return 0


def cluster_from_suite(args, target) -> None:
    """--devices / --device-memory / --nodes / --mode not given: the suite's ``[plan]`` table's; a
    ValueError naming what is missing when neither says."""
    plan = getattr(getattr(target, "suite", None), "suite", None)
    plan = getattr(plan, "plan", None)
    if plan is not None:
        if args.devices is None:
            args.devices = plan.devices
        if args.device_memory is None:
            args.device_memory = f"{plan.device_memory_gib}GiB"
        args.nodes = plan.nodes if args.nodes is None else args.nodes
        args.mode = plan.mode if args.mode is None else args.mode
    missing = [o for o, v in (("--devices", args.devices), ("--device-memory", args.device_memory)) if v is None]
    if missing:
        raise ValueError(f"{' and '.join(missing)} not given, and {args.target} has no [plan] table to take "
                         "them from")
    args.nodes = 1 if args.nodes is None else args.nodes
    args.mode = args.mode or "inference"


def _emit(args, rep, target) -> int:
    """The sbatch script or JobSet manifest of the recommended layout: ``--nodes`` nodes x ``--devices``
    ranks; one line and exit 2 when no layout fits or the manifest is refused by its schema."""
    import shlex

    from harness.launch import k8s, slurm

    if not (rep.ranked and rep.ranked[0].fits):
        print(f"harness plan: --emit: {rep.recommendation}", file=sys.stderr)
        return 2
    if args.run_args is None and target.suite is None:
        print(f"harness plan: --emit: {args.target} is a config.json, not a suite: say what the job runs with "
              "--run-args", file=sys.stderr)
        return 2
    run_args = shlex.split(args.run_args) if args.run_args is not None else [args.target, "--check", "parallel",
                                                                              "--scope", "nightly"]
    name = "harness-" + "".join(c if c.isalnum() else "-" for c in rep.model.name.lower()).strip("-")
    try:
        if args.emit == "slurm":
            text = slurm.sbatch_script(run_args, args.nodes, args.devices, args.results, args.time_limit,
                                       name, args.partition)
        else:
            text = k8s.dump(k8s.jobset_manifest(run_args, args.nodes, args.devices, name[:50], args.image,
                                                f"/{args.results.strip('/')}"))
    except (ValueError, k8s.ManifestError) as e:
        print(f"harness plan: --emit {args.emit}: {e}", file=sys.stderr)
        return 2
    layout = rep.ranked[0].layout.name
    if args.emit_to:
        from harness.files import atomic

        atomic.write_text(args.emit_to, text)
        print(f"{args.emit} launch of {layout} ({args.nodes} node(s) x {args.devices}) written to {args.emit_to}")
    else:
        print(text, end="")
    return 0


def _rehearse(args, rep, target) -> int:
    """The rehearsal (harness.parallel.rehearse) of the plan's best layout or ``--rehearse LAYOUT``;
    exit 1 on a divisibility error, a rank that fails to parallelize or a predicted hang."""
    from harness.parallel import rehearse

    try:
        lay, est, notes = rehearse.chosen_layout(args.rehearse, rep.devices, rep, mode=args.mode, batch=args.batch)
    except ValueError as e:
        print(f"harness plan: --rehearse: {e}", file=sys.stderr)
        return 2
    res = rehearse.rehearse(target, lay, batch=args.batch, context=args.context)
    res.notes[:0] = notes
    res.plan_bytes = rehearse.plan_figures(est, rep, args.mode)
    res.plan_messages = rehearse.plan_messages(est)
    res.training = args.mode == "training"
    print(rehearse.render(res))
    return 1 if res.failed else 0
