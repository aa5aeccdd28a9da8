"""`harness quarantine list|add|remove`: the quarantine file by hand (harness.compare.quarantine).

The comparator maintains the file (``harness compare --quarantine FILE``: flaky items in, re-enabled
after K clean runs); this command shows it and lets a person quarantine an item ahead of the
comparator (a known flake) or give one back early (the fix landed). TEST is a pytest node id
(``suites/kimi-k2.toml::smoke[npu-bfloat16]``) or the JUnit key the comparator prints
(``suites.kimi-k2.toml::smoke[npu-bfloat16]``).
"""

from __future__ import annotations

import datetime as dt
import sys

from harness.numbers import count


def register(sub) -> None:
    p = sub.add_parser("quarantine", help="list, add or remove quarantined (flaky) items",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("action", choices=["list", "add", "remove"])
    p.add_argument("tests", nargs="*", metavar="TEST", help="node ids or JUnit keys (add, remove)")
    p.add_argument("--reason", default="", help="why (add); shown in the run's report and the issue")
    p.add_argument("--owner", default="", help="who answers for it (add; default: $USER)")
    p.add_argument("--days", type=count(1, 3650), default=None,
                   help="it expires after this many days (add; default 30): nothing stays quarantined for good")
    p.add_argument("--file", default=None, help="quarantine file (default: quarantine_file in harness.toml)")
    p.set_defaults(func=main)


def main(args) -> int:
    from harness.compare import quarantine
    from harness.settings import load_settings

    path = args.file or load_settings().quarantine_file
    if args.action == "list":
        return _list(quarantine, path, args)
    from harness.files.atomic import locked

    with locked(path):  # load, change, save: concurrent adds each keep their entry
        return _edit(quarantine, path, args)


def _load(quarantine, path):
    """The quarantine file, or None after its one-line error."""
    try:
        return quarantine.load(path)
    except quarantine.QuarantineError as e:
        print(f"harness quarantine: {e}", file=sys.stderr)
        return None


def _list(quarantine, path, args) -> int:
    if (q := _load(quarantine, path)) is None:
        return 2
    if args.tests:
        print("harness quarantine: list takes no TEST", file=sys.stderr)
        return 2
    if not q.items:
        print(f"{path}: nothing is quarantined")
    for key, e in sorted(q.items.items()):
        state = "" if e.active() else "EXPIRED "
        print(f"{key}\t{state}since {e.since}, expires {e.expiry()}\tclean runs {e.clean}\towner {e.by}\t{e.reason}")
    return 0


def _edit(quarantine, path, args) -> int:
    if (q := _load(quarantine, path)) is None:
        return 2
    if not args.tests:
        print(f"harness quarantine: {args.action} needs at least one TEST", file=sys.stderr)
        return 2
    keys = [quarantine.key_of(t) for t in args.tests]
    bad = [t for t, k in zip(args.tests, keys, strict=True) if "::" not in k]
    if bad:
        print(f"harness quarantine: not a test id: {', '.join(bad)} (expected suites/NAME.toml::check[...])",
              file=sys.stderr)
        return 2
    if args.action == "add":
        import os

        days = quarantine.EXPIRE_DAYS if args.days is None else args.days
        if days < 1:
            print(f"harness quarantine: --days {days}: at least 1", file=sys.stderr)
            return 2
        today = dt.date.today()
        for k in keys:
            q.items[k] = quarantine.Entry(since=today.isoformat(), reason=args.reason or "added by hand",
                                          by=args.owner or os.environ.get("USER") or "harness quarantine add",
                                          expires=(today + dt.timedelta(days=days)).isoformat())
            print(f"quarantined {k} until {q.items[k].expires}")
    else:
        missing = [k for k in keys if k not in q.items]
        if missing:
            print(f"harness quarantine: not quarantined: {', '.join(missing)}", file=sys.stderr)
            return 1
        for k in keys:
            del q.items[k]
            print(f"re-enabled {k}")
    quarantine.save(path, q)
    return 0
