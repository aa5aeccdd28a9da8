"""``harness init CONFIG.json [--name N]``: write a working suite for a model the project has never
seen (pruning chosen from the architecture: harness/inspect/prune.py), then validate it by running
its smoke check once on the CPU in float32. Exit 0 when the smoke check passes."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("init", help="write and validate a suite for a new model's config.json",
                       description=__doc__)
    p.add_argument("config", help="the model's published config.json")
    p.add_argument("--name", help="suite name (file stem); default: the config's file name, lower-cased")
    p.add_argument("--suites-dir", help="where to write the suite (default: suites_dir of harness.toml)")
    p.add_argument("--force", action="store_true", help="overwrite an existing suite file")
    p.add_argument("--no-validate", action="store_true", help="write the suite without running its smoke check")
    p.set_defaults(func=run)


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-") or "model"


def init_suite(config: str | Path, *, name: str | None = None, suites_dir: str | Path | None = None,
               force: bool = False) -> Path:
    """Write the suite file; raises ValueError / FileExistsError / UnknownArchitectureError."""
    from harness.inspect.prune import choose_prune, suite_toml
    from harness.models.config import architecture_class
    from harness.settings import load_settings

    cfg = Path(config).resolve()
    try:
        raw = json.loads(cfg.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{config}: cannot read config.json: {e}") from None
    if not isinstance(raw, dict) or not raw.get("architectures"):
        raise ValueError(f"{config}: not a config.json with 'architectures'")
    architecture_class(raw["architectures"][0])  # unknown architecture: the error says how to plug one in
    name = slug(name or cfg.stem)
    out_dir = Path(suites_dir or load_settings().suites_dir).resolve()
    out = out_dir / f"{name}.toml"
    if out.exists() and not force:
        raise FileExistsError(f"{out} exists (use --force to overwrite)")
    prune, why = choose_prune(raw)
    out_dir.mkdir(parents=True, exist_ok=True)
    rel = os.path.relpath(cfg, out_dir).replace(os.sep, "/")
    notes = []
    if raw.get("quantization_config"):
        notes.append("quantization_config is dropped for the random-weight build (see the smoke item notes)")
    out.write_text(suite_toml(rel, raw, prune, why, title=name, notes=notes))
    return out


def validate(path: Path) -> tuple[bool, str]:
    from harness.checks import CheckFailure, run_one
    from harness.suite.loader import SuiteError, load_suite

    try:
        ls = load_suite(path)
        ctx = run_one(ls, "smoke", "cpu", "float32")
    except (CheckFailure, SuiteError) as e:
        return False, str(e)
    except Exception as e:  # a model that does not even build: say so, do not traceback
        return False, f"{type(e).__name__}: {e}"
    props = dict(ctx.properties)
    return True, (f"smoke[cpu-float32] passed: loss {props.get('metric.loss_initial', '?')} -> "
                  f"{props.get('metric.loss_final', '?')}, {props.get('metric.parameters', '?')} parameters")


def run(args) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from harness.models.config import UnknownArchitectureError

    try:
        path = init_suite(args.config, name=args.name, suites_dir=args.suites_dir, force=args.force)
    except (ValueError, FileExistsError, UnknownArchitectureError) as e:
        print(f"harness init: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    if args.no_validate:
        return 0
    ok, msg = validate(path)
    print(("ok: " if ok else "FAILED: ") + msg)
    if ok:
        name = path.stem
        print(f"next: `harness golden generate {name}` writes its precision reference (the precision check "
              f"fails until it exists), then `harness run {name}` or `tox -e model-{name}`")
    return 0 if ok else 1
