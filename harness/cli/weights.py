"""`harness weights manifest|verify DIR`: record and check shard checksums of a checkpoint (docs/weights.md)."""

from __future__ import annotations

import sys


def register(sub) -> None:
    p = sub.add_parser("weights", help="real-weight checkpoints: record / verify shard checksums")
    ws = p.add_subparsers(dest="weights_command", metavar="ACTION")
    m = ws.add_parser("manifest", help="write DIR/harness-manifest.json (sizes and sha256 of every shard)")
    m.add_argument("dir", help="checkpoint directory (HF layout)")
    m.add_argument("-o", "--output", default=None, help="manifest path (default: DIR/harness-manifest.json)")
    m.add_argument("--allow-pickle", action="store_true", help="accept a pickle-only checkpoint (.bin/.pt)")
    m.set_defaults(func=manifest)
    v = ws.add_parser("verify", help="check shard headers and checksums against the recorded manifest")
    v.add_argument("dir")
    v.add_argument("--manifest", default=None, help="manifest path (default: DIR/harness-manifest.json)")
    v.set_defaults(func=verify)
    p.set_defaults(func=lambda a: (p.print_help(), 2)[1])


def manifest(args) -> int:
    from harness.weights.layout import WeightsError
    from harness.weights.manifest import write_manifest

    try:
        out = write_manifest(args.dir, args.output, allow_pickle=args.allow_pickle)
    except WeightsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


def verify(args) -> int:
    from pathlib import Path

    from harness.weights.layout import WeightsError, open_checkpoint
    from harness.weights.manifest import MANIFEST_NAME, read_manifest
    from harness.weights.manifest import verify as verify_shards

    try:
        ckpt = open_checkpoint(args.dir)
        mpath = Path(args.manifest) if args.manifest else ckpt.root / MANIFEST_NAME
        problems = verify_shards(ckpt, read_manifest(mpath))
    except WeightsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for line in problems:
        print(line)
    print(f"{len(ckpt.shards)} shards, {len(ckpt.tensors)} tensors: " + (f"{len(problems)} problem(s)" if problems
                                                                        else "all match the manifest"))
    return 1 if problems else 0
