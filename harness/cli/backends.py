"""`harness backends`: what backends exist here, and why the absent ones are absent."""

from __future__ import annotations

import sys


def register(sub) -> None:
    p = sub.add_parser("backends", help="table of registered backends, availability and probed dtypes")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=main)


def main(args) -> int:
    import json

    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from harness.backends import registry
    from harness.compare.scrub import scrub_secrets

    rows = []
    for b in registry():
        ok, why = b.availability()
        dtypes = [d for d, r in b.supported_dtypes.items() if r == "ok"] if ok else []
        rows.append({"name": b.name, "available": ok, "reason": why, "device_type": b.device_type,
                     "devices": b.device_count() if ok else 0, "device": b.device_name() if ok else "",
                     "dtypes": dtypes, "collective": b.collective, "dispatch_key": b.dispatch_key,
                     "module": b.module, "source": b.source})
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    t = Table(title="harness backends")
    for c in ("backend", "available", "devices", "device", "dtypes", "collective", "dispatch key", "module",
              "source", "reason"):
        t.add_column(c, overflow="fold")
    for r in rows:
        # cells are Text: a reason is an exception's message ("[/__w/...]" is not a closing tag)
        cells = [r["name"], "yes" if r["available"] else "no", str(r["devices"]), r["device"],
                 " ".join(r["dtypes"]), r["collective"], r["dispatch_key"] or "", r["module"] or "", r["source"],
                 scrub_secrets(r["reason"] or "")]
        t.add_row(*(Text(str(c), style=("green" if r["available"] else "yellow") if i == 1 else "")
                    for i, c in enumerate(cells)))
    Console(width=None if sys.stdout.isatty() else 200).print(t)
    return 0
