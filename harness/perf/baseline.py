"""Where samples live: a sidecar file per item in the results dir, baselines under ``golden/perf/``.

Sidecar (written by every perf item)::

    results/perf/<suite>/<backend>-<dtype>-<variant>.json
    {"format": 1, "suite", "backend", "dtype", "variant", "fingerprint", "class",
     "calibration", "samples": {metric: [seconds...]}, "summary": {metric: {median, iqr, ...}},
     "roofline", "memory", "verdicts"}

Baseline (one file per suite and machine class, written by ``harness baseline update RESULTS``)::

    golden/perf/<suite>/<class key>.json
    {"format": 1, "suite", "class": {...}, "items": {"<backend>-<dtype>-<variant>": <sidecar>}}

A baseline is keyed by machine class (fingerprint.py), so a CPU runner and an H200 keep their own
and never meet. Updating merges: items of the run replace the same items, others stay.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from harness.files import atomic
from harness.perf import fingerprint as fpmod
from harness.perf import stats

FORMAT = 1


class BaselineError(Exception):
    """A baseline or sidecar that cannot be used; ``str()`` is one line naming the file."""


def results_root(results_dir: str | Path | None = None) -> Path:
    from harness.settings import results_root as root

    return root(results_dir)


def perf_golden_root(golden_root: str | Path | None = None) -> Path:
    from harness.settings import golden_root as root

    return root(golden_root) / "perf"


def item_key(backend: str, dtype: str, variant: str | None) -> str:
    return f"{backend}-{dtype}" + (f"-{variant}" if variant else "")


def _under(root: Path, *names, source, fields) -> Path:
    """``root / names...``, each a plain name (harness.files.paths), as BaselineError."""
    from harness.files import paths

    try:
        for n, f in zip(names, fields, strict=True):
            root = paths.join(root, n, source=source, field=f)
    except paths.PathRefused as e:
        raise BaselineError(str(e)) from None
    return root


def sidecar_path(suite: str, key: str, results_dir: str | Path | None = None) -> Path:
    return _under(results_root(results_dir) / "perf", suite, f"{key}.json", source="perf sidecar",
                  fields=("suite", "key"))


def write_sidecar(record: dict, results_dir: str | Path | None = None) -> Path:
    record = {"format": FORMAT, **record}
    p = sidecar_path(record["suite"], record["key"], results_dir)
    p.parent.mkdir(parents=True, exist_ok=True)
    atomic.write_json(p, record, sort_keys=True, default=_jsonable, newline=False)  # never half a file
    return p


def _jsonable(o):
    if hasattr(o, "to_dict"):
        return o.to_dict()
    return str(o)


def _read(p: Path) -> dict:
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise BaselineError(f"{p}: cannot read: {e.strerror}") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise BaselineError(f"{p}: not valid JSON ({e})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise BaselineError(f"{p}: not a harness perf file of format {FORMAT}")
    return data


def _from_junit(root: Path) -> list[Path]:
    """Sidecars named by the JUnit XML of a run (``harness.detail.perf_samples``): the check writes
    them to the configured results dir, which need not be the one ``harness run --results`` got."""
    import xml.etree.ElementTree as ET

    found = []
    for x in sorted(root.rglob("*.xml")):
        try:
            tree = ET.parse(x)
        except (ET.ParseError, OSError):
            continue  # not ours to judge: the comparator reports bad XML
        for prop in tree.iter("property"):
            if prop.get("name") == "harness.detail.perf_samples" and prop.get("value"):
                found.append((x, prop.get("value")))
    return found


def _junit_sidecar(root: Path, xml: Path, value: str) -> Path:
    """A sidecar path a JUnit property names: data, so it must lie in this results directory or
    the configured one (where the check writes them), symlinks resolved; else BaselineError."""
    from harness.files import paths

    where = f"{xml}: harness.detail.perf_samples"
    if "\x00" in value:
        raise BaselineError(f"{where}: {value[:60]!r} contains a NUL byte")
    p = Path(value)
    for base in (root, results_root()):
        try:
            rel = p.resolve().relative_to(base.resolve())
        except ValueError:
            continue
        try:
            return paths.join(base, rel.as_posix(), source=xml, field="harness.detail.perf_samples", plain=False)
        except paths.PathRefused as e:
            raise BaselineError(str(e)) from None
    raise BaselineError(f"{where}: {value[:120]!r} is outside the results directory {root} "
                        f"and the configured {results_root()}")


def read_sidecars(results_dir: str | Path, refused: list | None = None) -> list[tuple[Path, dict]]:
    """Every perf sidecar of a run: under ``results_dir`` (the dir itself, or its ``perf/``
    folder), and those its JUnit XML names. ``refused``: where a JUnit path that leaves the results
    goes, as (xml, why), instead of failing the whole read."""
    root = Path(results_dir)
    if not root.exists():
        raise BaselineError(f"{root}: no such results directory")
    # A sidecar is perf/<suite>/<key>.json *inside* the results directory (or the directory is perf/
    # itself). Judged on the path below ``root``: on the absolute path, a run in a project folder named
    # perf (perf/results/run.json) made every file of the run a "sidecar" and the update failed on run.json.
    inside = (root.resolve().name,)  # the results directory may be perf/ itself

    def sidecar(p: Path) -> bool:
        parts = inside + p.relative_to(root).parts  # (root's name, ..., perf, suite, key.json)
        return len(parts) >= 3 and parts[-3] == "perf"

    files = {p.resolve(): p for p in root.rglob("*.json") if sidecar(p)}
    for xml, value in _from_junit(root):
        try:
            p = _junit_sidecar(root, xml, value)
        except BaselineError as e:
            if refused is None:
                raise
            refused.append((xml, str(e)))
            continue
        if p.resolve() not in files:
            if not p.exists():
                raise BaselineError(f"{p}: perf samples named in {root}'s JUnit XML are missing")
            files[p.resolve()] = p
    out = []
    for p in sorted(files.values()):
        data = _read(p)
        if "samples" in data and "suite" in data and "key" in data:
            out.append((p, data))
    return out


def bad_samples(item: dict) -> str | None:
    """Why an item's samples cannot be a baseline (None: they can). Every sample is a time in seconds:
    a NaN, an infinity, a zero or a negative one made every later verdict read "unchanged" (a NaN
    median compares false both ways), so a perf issue could close on no evidence (issue #49)."""
    groups = [("", item.get("samples")), ("calibration ", (item.get("calibration") or {}).get("samples"))]
    for label, samples in groups:
        if samples is None and not label:
            return "no samples"
        for metric, values in (samples or {}).items():
            if not isinstance(values, list):
                return f"{label}samples of {metric} are not a list"
            bad = [v for v in values if isinstance(v, bool) or not isinstance(v, (int, float))
                   or not math.isfinite(v) or v <= 0]
            if bad:
                return f"{label}samples of {metric} hold {len(bad)} value(s) that are not times ({bad[0]!r})"
    return None


def baseline_path(suite: str, cls_key: str, golden_root: str | Path | None = None, source="perf baseline") -> Path:
    return _under(perf_golden_root(golden_root), suite, f"{cls_key}.json", source=source,
                  fields=("suite", "fingerprint (machine class)"))


def find_baseline(suite: str, key: str, fp: dict, golden_root: str | Path | None = None) -> tuple[dict | None, str]:
    """The baseline item for this suite x item on this machine class, or None and why not."""
    cls_key = fpmod.class_key(fp)
    p = baseline_path(suite, cls_key, golden_root)
    if p.exists():
        data = _read(p)
        item = data.get("items", {}).get(key)
        if item is None:
            return None, f"no baseline for {key} in {p}"
        if (why_bad := bad_samples(item)) is not None:  # a hand edit: never compared, said
            return None, f"{p}: baseline {key} not used: {why_bad}"
        ok, why = fpmod.compare(item.get("fingerprint", {}), fp)
        if not ok:  # a hand-edited or colliding file: never compare silently
            return None, f"{p}: {why}"
        return item, f"{p} ({why})"
    others = sorted(_under(perf_golden_root(golden_root), suite, source="perf baseline", fields=("suite",))
                    .glob("*.json"))
    for q in others:
        try:
            data = _read(q)
        except BaselineError:
            continue
        item = data.get("items", {}).get(key)
        if item is not None:
            _, why = fpmod.compare(item.get("fingerprint", {}), fp)
            return None, f"baseline {q.name} is from an {why}; not compared"
    return None, f"no baseline for {suite} on machine class {cls_key} (harness baseline update RESULTS)"


def runs(item: dict) -> int:
    """How many processes (runs) a baseline item's samples come from: 1 for an item taken from one
    run, and for older baselines, which did not say."""
    n = item.get("runs", 1)
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else 1


def splits(item: dict) -> dict[str, list[int]]:
    """Per metric, how many of the item's samples each pooled process (launch) gave, in order
    (``splits``, kept by :func:`_pool`); one process for an item that does not say or whose counts
    do not add up to its samples."""
    said = item.get("splits") if isinstance(item.get("splits"), dict) else {}
    out = {}
    for k, v in (item.get("samples") or {}).items():
        n = said.get(k)
        ok = isinstance(n, list) and all(isinstance(x, int) and x > 0 for x in n) and sum(n) == len(v)
        out[k] = list(n) if ok else [len(v)]
    return out


def launches(item: dict) -> list[dict[str, list[float]]]:
    """The item's pooled samples split back into the processes they came from: one dict of samples
    per launch, metrics that every launch has. One launch's samples share that launch's load level
    (the comm check's calibration rests on it: harness/perf/commjudge.py); an item whose metrics
    disagree on the split is one launch."""
    sp, samples = splits(item), item.get("samples") or {}
    counts = {len(v) for v in sp.values()}
    if len(counts) != 1:
        return [dict(samples)]
    out: list[dict[str, list[float]]] = [{} for _ in range(counts.pop())]
    for k, n in sp.items():
        at = 0
        for i, c in enumerate(n):
            out[i][k] = list(samples[k][at:at + c])
            at += c
    return out


def process_spread(item: dict, key: str) -> float | None:
    """Half the range of the baseline's processes' medians of ``key``, relative to their median: how far
    one process's level alone moves the metric (decide.py's ``process_spread`` hold). None with fewer than
    two processes (a one-process baseline has the thin-baseline margin instead)."""
    meds = [statistics.median(v[key]) for v in launches(item) if v.get(key)]
    if len(meds) < 2:
        return None
    mid = statistics.median(meds)
    return (max(meds) - min(meds)) / mid / 2 if mid > 0 else None


def _pool(old: dict, new: dict) -> dict:
    """``new``'s samples added to ``old``'s (same workload and calibration kernels): a baseline
    of several processes. One process's level can be 15% off another's on a loaded CPU
    (docs/perf.md); pooled, that spread is part of the baseline instead of its luck."""
    if old.get("shape") != new.get("shape"):
        raise BaselineError(f"{new['key']}: cannot pool a baseline of another workload "
                            f"({old.get('shape')} vs {new.get('shape')}); update without --append")
    out = dict(new)
    out["samples"] = {k: list(old.get("samples", {}).get(k, [])) + list(v) for k, v in new["samples"].items()}
    # where each process's samples start: a launch's samples share its load (launches())
    old_sp, new_sp = splits(old), splits(new)
    out["splits"] = {k: [n for n in old_sp.get(k, []) if old.get("samples", {}).get(k)] + new_sp[k]
                     for k in new["samples"]}
    ref = {}
    for phase in set(old.get("reference") or {}) | set(new.get("reference") or {}):
        a, b = (old.get("reference") or {}).get(phase, {}), (new.get("reference") or {}).get(phase, {})
        ref[phase] = {k: list(a.get(k, [])) + list(b.get(k, [])) for k in set(a) | set(b)}
    out["reference"] = ref
    cal = dict(new.get("calibration") or {})
    cal["samples"] = {k: list((old.get("calibration") or {}).get("samples", {}).get(k, [])) + list(v)
                      for k, v in (cal.get("samples") or {}).items()}
    out["calibration"] = cal
    out["summary"] = {k: stats.summarize(v).to_dict() for k, v in out["samples"].items()}
    out["runs"] = runs(old) + runs(new)
    out["source"] = f"{old.get('source')}; {new.get('source')}"
    return out


def update(results_dir: str | Path | list, golden_root: str | Path | None = None,
           suites: list[str] | None = None, append: bool = False) -> list[tuple[Path, list[str], list[str]]]:
    """Take reviewed runs' perf samples as the new baselines (``append``: pooled with the stored
    ones). Several results directories are pooled with each other: each is one process's samples of
    an item, and a baseline of one process is too thin to judge small changes (decide.py). Returns,
    per baseline file written, (path, items taken, items refused with why)."""
    dirs = list(results_dir) if isinstance(results_dir, list | tuple) else [results_dir]
    dirs = list({Path(d).resolve(): d for d in dirs}.values())  # one directory named twice: its samples once
    by_file: dict[Path, tuple[dict, list[str], list[str]]] = {}
    pooled: set[tuple[Path, str]] = set()  # items this update took already: later dirs pool with them
    for d in dirs:
        bad: list[tuple[Path, str]] = []
        sidecars = read_sidecars(d, bad)
        for xml, why in bad:
            by_file.setdefault(xml, ({}, [], []))[2].append(why)
        for src, rec in sidecars:
            if not suites or rec["suite"] in suites:
                _take(src, rec, by_file, pooled, golden_root, append)
    out = []
    for p, (base, took, refused) in by_file.items():
        if took:
            p.parent.mkdir(parents=True, exist_ok=True)
            atomic.write_json(p, {"format": FORMAT, **base}, sort_keys=True, newline=False)
        out.append((p, list(dict.fromkeys(took)), refused))
    return out


def _take(src: Path, rec: dict, by_file: dict, pooled: set, golden_root, append: bool) -> None:
    """One sidecar into its baseline file's record (``by_file``), or refused there with why."""
    fp = rec.get("fingerprint") or {}
    try:  # suite, key and machine class come from the sidecar: data, refused if not plain names
        from harness.files import paths

        paths.name(rec["key"], source=src, field="key")
        p = baseline_path(rec["suite"], fpmod.class_key(fp if isinstance(fp, dict) else {}), golden_root, source=src)
    except (BaselineError, ValueError) as e:
        by_file.setdefault(src, ({}, [], []))[2].append(str(e))  # this sidecar only; the others go on
        return
    if p not in by_file:
        base = _read(p) if p.exists() else {"format": FORMAT, "suite": rec["suite"],
                                             "class": fpmod.class_of(fp), "items": {}}
        by_file[p] = (base, [], [])
    base, took, refused = by_file[p]
    if not any(rec["samples"].get(m) for m in rec["samples"]):
        refused.append(f"{rec['key']}: no samples ({rec.get('why_no_samples') or 'not measured'})")
        return
    if (why := bad_samples(rec)) is not None:
        refused.append(f"{rec['key']}: {why}")
        return
    keep = {k: rec[k] for k in ("suite", "key", "backend", "dtype", "variant", "fingerprint", "class",
                                 "calibration", "reference", "samples", "summary", "roofline", "memory",
                                 "shape", "profile")
            if k in rec}
    keep["source"] = str(src)
    keep["runs"] = 1  # one item of one run: one process's samples
    old = base["items"].get(rec["key"])
    base["items"][rec["key"]] = _pool(old, keep) if old and (append or (p, rec["key"]) in pooled) else keep
    pooled.add((p, rec["key"]))
    took.append(rec["key"])
