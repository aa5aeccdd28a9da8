"""`harness durations update RESULTS...`: record item durations from a results run.

The recorded durations (settings ``durations_file``, default ``durations.json``) set the wall-clock
backstop of isolated items (30x the record, at least 900 s) and balance shards. A value that is not a
duration (NaN, Infinity, negative, over a day) is left out with a line naming the item. RESULTS are results
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
        items = data.get("items", []) if isinstance(data, dict) else None
        if not isinstance(items, list):
            raise ValueError("not a harness summary.json (no items list)")
        for r in items:
            if (isinstance(r, dict) and r.get("outcome") in ("passed", "failed", "error")
                    and "::" in str(r.get("nodeid", ""))):
                _put(out, str(r["nodeid"]), r.get("duration", 0.0))
        return out
    for tc in ET.parse(path).getroot().iter("testcase"):
        if tc.find("skipped") is not None:
            continue
        _put(out, _nodeid(tc), _number(tc.get("time", "0")))
    return out


def _number(text: str):
    try:
        return float(text)
    except ValueError:
        return None


def _put(out: dict, nodeid: str, seconds) -> None:
    from harness.run.durations import MAX_RECORD_S, valid

    s = valid(seconds)
    if s is None:  # NaN, Infinity, 1e308, negative: not a duration (it would switch the time limit off)
        print(f"harness durations: {nodeid}: {seconds!r} is not a duration (0-{MAX_RECORD_S:g} s); left out")
        return
    out[nodeid] = s


def _nodeid(tc: ET.Element) -> str:
    """The item id back from pytest's JUnit mangling (suites/x.toml -> classname suites.x.toml). The
    file name is the suite's, which the item records (harness.suite), so a suite named with dots
    (llama-3.1-8b) keeps them; without that property, the last dot before .toml splits."""
    cls, name = tc.get("classname", ""), tc.get("name", "")
    stem = next((p.get("value") for p in tc.iter("property") if p.get("name") == "harness.suite"), None)
    if stem and (cls == f"{stem}.toml" or cls.endswith(f".{stem}.toml")):
        head = cls[: -len(f"{stem}.toml")].rstrip(".")
        file = stem
    else:
        head, _, file = cls.rpartition(".toml")[0].rpartition(".")
    return f"{head.replace('.', '/')}/{file}.toml::{name}" if head else f"{file}.toml::{name}"


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
