"""`harness export SUITE DIR`: the suite's pruned, seeded model as a checkpoint a serving engine loads
(save_pretrained; the published head_dim kept: docs/serving.md)."""

from __future__ import annotations

import sys


def register(sub) -> None:
    p = sub.add_parser("export", help="write a suite's pruned model (seeded weights) as a checkpoint for a serving engine")
    p.add_argument("suite", help="suite name or file")
    p.add_argument("dir", help="output directory (config.json, model.safetensors, generation_config.json, README.txt)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="dtype of the written weights (default float32)")
    p.set_defaults(func=export)


def export(args) -> int:
    from harness.models.config import ModelBuildError
    from harness.serve.export import export as write
    from harness.settings import load_settings
    from harness.suite.loader import SuiteError, load_suite, resolve_names

    try:
        (path,) = resolve_names([args.suite], load_settings().suites_dir)
        info = write(load_suite(path), args.dir, args.dtype)
    except (SuiteError, ModelBuildError, OSError) as e:
        print(f"harness: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.dir}: {info['architecture']} {info['dtype']}, head_dim {info['head_dim'] or 'per layer'}; "
          + "; ".join(info["kept"]))
    return 0
