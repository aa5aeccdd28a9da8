"""``harness inspect SUITE|CONFIG.json``: the unpruned model on the meta device - parameters
(total, activated, per module kind), checkpoint bytes per dtype (FP8 block-quantized included), FLOPs
and KV-cache bytes per token, the aten operator inventory of one forward + backward, and each
backend's coverage of it (missing ops first, with the modules that need them). See docs/inspect.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from harness.files import atomic
from harness.numbers import count


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="parameters, FLOPs, op inventory and backend coverage of a model "
                       "(meta device, no weights)", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", nargs="*", help="suite name, suite .toml, or a config.json (several, or none for "
                   "every bundled suite, with --backends)")
    p.add_argument("--backends", metavar="LIST|all",
                   help="coverage matrix: models x backends (comma-separated, or 'all': cpu and every backend with "
                   "an op list); prints the missing/host-fallback ops first, --json/--markdown write it")
    p.add_argument("--markdown", metavar="PATH", help="with --backends: write the matrix as a Markdown table "
                   "(also appended to $GITHUB_STEP_SUMMARY when set)")
    p.add_argument("--backend", "-b", action="append", metavar="NAME",
                   help="backends to report coverage for (repeat or comma-separate; default: the suite's "
                   "backends, or cpu)")
    p.add_argument("--trace", choices=("full", "pruned", "none"), default=None,
                   help="trace the full model (default), the suite's pruned model (the default with --backends: "
                   "same operators), or nothing")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16", "float64"),
                   help="dtype of the traced model (default bfloat16, the checkpoints' dtype)")
    p.add_argument("--seq", type=count(1, 2**24), default=16, help="tokens per sequence in the trace")
    p.add_argument("--batch", type=count(1, 2**20), default=1, help="sequences in the trace")
    p.add_argument("--prefill-len", type=count(1, 2**27), default=4096, help="prompt length for prefill FLOPs")
    p.add_argument("--context", type=count(1, 2**27), default=4096, help="context length for decode FLOPs")
    p.add_argument("--json", metavar="PATH", help="write the whole report as JSON ('-' for stdout)")
    p.add_argument("--inventory-json", metavar="PATH", help="write the op inventory as JSON")
    p.add_argument("--no-table", action="store_true", help="omit the per-op inventory table")
    p.add_argument("--fail-on-missing", action="store_true",
                   help="exit 1 when a backend misses an op that is not a suite known gap")
    p.add_argument("--dump-op-list", metavar="DISPATCH_KEY",
                   help="print every aten overload with a kernel for this dispatch key (CPU, CUDA, "
                   "PrivateUse1, ...) in the installed torch: an op list to ship for that backend")
    p.set_defaults(func=run)


def _split(values):
    return [v.strip() for vs in values or [] for v in vs.split(",") if v.strip()]


def run(args) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.dump_op_list:
        from harness.inspect.coverage import dump_dispatcher_op_list

        sys.stdout.write(dump_dispatcher_op_list(args.dump_op_list))
        return 0
    if args.backends or len(args.target) > 1:
        return _run_matrix(args)
    if not args.target:
        print("harness inspect: give a suite name, a suite .toml or a config.json", file=sys.stderr)
        return 2
    args.target, args.trace = args.target[0], args.trace or "full"
    import torch

    from harness.inspect.params import load_target
    from harness.inspect.report import inspect, missing_summary, render_text
    from harness.models.config import UnknownArchitectureError
    from harness.settings import load_settings
    from harness.suite.loader import SuiteError

    try:
        target = load_target(args.target, load_settings().suites_dir)
        backends = _split(args.backend)
        if not backends:
            sb = target.suite.suite.backends if target.suite is not None else ["*"]
            backends = ["cpu"] if "*" in sb else sb
        rep = inspect(target, backends=backends, trace=args.trace, batch=args.batch, seq=args.seq,
                      prefill_len=args.prefill_len, decode_context=args.context,
                      dtype=getattr(torch, args.dtype))
    except (SuiteError, UnknownArchitectureError, ValueError, KeyError) as e:
        print(f"harness inspect: {e}", file=sys.stderr)
        return 2
    if args.inventory_json and rep.inventory is not None:
        rep.inventory.to_json(args.inventory_json)
    if args.json == "-":
        print(json.dumps(rep.to_dict(), indent=1))
    else:
        if args.json:
            atomic.write_json(args.json, rep.to_dict(), newline=False)
        print(render_text(rep, show_inventory=not args.no_table))
    if args.fail_on_missing and missing_summary(rep.coverages):
        return 1
    return 0


def _run_matrix(args) -> int:
    """``--backends``: the coverage matrix of several models (default: every bundled suite)."""
    import torch

    from harness.inspect.params import load_target
    from harness.inspect.report import all_backends, coverage_matrix
    from harness.models.config import UnknownArchitectureError
    from harness.settings import load_settings
    from harness.suite.loader import SuiteError, discover

    suites_dir = load_settings().suites_dir
    names = args.target or [str(p) for p in discover(suites_dir)]
    spec = args.backends or "all"
    backends = all_backends() if spec.strip() == "all" else _split([spec])
    if args.trace == "none":
        print("harness inspect: --backends needs a trace (--trace pruned or full)", file=sys.stderr)
        return 2
    targets, refused = [], {}
    for n in names:  # one bad suite or config is its own line; the others keep their rows
        try:
            targets.append(load_target(n, suites_dir))
        except (SuiteError, UnknownArchitectureError, ValueError, KeyError) as e:
            refused[n] = str(e)
            print(f"harness inspect: {e}", file=sys.stderr)
    try:
        mat = coverage_matrix(targets, backends, dtype=getattr(torch, args.dtype), seq=args.seq,
                              trace=args.trace or "pruned", refused=refused)
    except (SuiteError, UnknownArchitectureError, ValueError, KeyError) as e:
        print(f"harness inspect: {e}", file=sys.stderr)
        return 2
    md = mat.render_markdown()
    if args.json == "-":
        print(json.dumps(mat.to_dict(), indent=1))
    else:
        if args.json:
            atomic.write_json(args.json, mat.to_dict(), newline=False)
        print(mat.render_text())
    if args.markdown:
        atomic.write_text(args.markdown, md)
    summary = os.environ.get("GITHUB_STEP_SUMMARY")
    if summary:
        with open(summary, "a", encoding="utf-8") as f:
            f.write(md)
    if mat.refused:  # every other model's row is out; the run still says that these are not
        return 2
    return 1 if args.fail_on_missing and mat.missing() else 0
