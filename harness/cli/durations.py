"""`harness durations update RESULTS...`: record item durations from a results run.

The recorded durations (settings ``durations_file``, default ``durations.json``) set the time
limit of isolated items (10x the record, at least 60 s) and balance shards. RESULTS are results
directories (their ``summary.json``) or JUnit XML files; items that did not run (skipped, not run)
keep their old record.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser("durations", help="record item durations from a results run (time limits, shards)")
    p.add_argument("action", choices=["update", "show"])
    p.add_argument("results", nargs="*", type=Path, help="results directories or JUnit XML files")
    p.add_argument("--file", type=Path, default=None, help="durations file (default: settings durations_file)")
    p.set_defaults(func=main)


def read(path: Path) -> dict[str, float]:
    """nodeid -> seconds of the items that ran (passed, failed or error) in one results source."""
    out: dict[str, float] = {}
    if path.is_dir():
        path = path / "summary.json" if (path / "summary.json").exists() else path / "junit.xml"
    if path.suffix == ".json":
        data = json.loads(path.read_text(encoding="utf-8"))
        for r in data.get("items", []):
            if r.get("outcome") in ("passed", "failed", "error") and "::" in r.get("nodeid", ""):
                out[r["nodeid"]] = float(r.get("duration", 0.0))
        return out
    for tc in ET.parse(path).getroot().iter("testcase"):
        if tc.find("skipped") is not None:
            continue
        cls, name = tc.get("classname", ""), tc.get("name", "")
        # pytest's mangling: suites.x.toml -> suites/x.toml (the last two dots are the file name's)
        head, _, file = cls.rpartition(".toml")[0].rpartition(".")
        nodeid = f"{head.replace('.', '/')}/{file}.toml::{name}" if head else f"{file}.toml::{name}"
        out[nodeid] = float(tc.get("time", 0.0))
    return out


def main(args) -> int:
    from harness.run import durations
    from harness.settings import load_settings

    target = args.file or Path(load_settings().durations_file)
    known = durations.load(target)
    if args.action == "show":
        for k, v in sorted(known.items(), key=lambda kv: -kv[1]):
            print(f"{v:9.2f} s  {k}")
        print(f"{len(known)} items, {sum(known.values()):.1f} s in all ({target})")
        return 0
    if not args.results:
        print("harness durations update: name at least one results directory or JUnit XML file")
        return 2
    from harness.files.atomic import check_writable

    try:  # before reading the results: the file's folder must take the new record
        check_writable(target.parent if str(target.parent) else Path("."), "durations file's folder")
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    new: dict[str, float] = {}
    for p in args.results:
        try:
            new.update(read(p))
        except (OSError, ValueError, ET.ParseError) as e:
            print(f"{p}: cannot read results: {e}")
            return 2
    known.update(new)
    try:
        durations.save(target, known)
    except OSError as e:
        print(f"error: cannot write {target}: {e.strerror or e}", file=sys.stderr)
        return 2
    print(f"recorded {len(new)} item durations in {target} ({len(known)} in all)")
    return 0
