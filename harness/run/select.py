"""Selection by change: from a pull request's diff, the items it can affect (``harness select``).

Each changed path (``git diff --name-only --no-renames BASE...HEAD``: what the pull request changed
since it left its base) selects, by the first rule that applies:

===========================================  =================================================
path                                         selects
===========================================  =================================================
``select.ignore`` (docs, ``*.md``), the      nothing: no item depends on it
durations and quarantine files
``<suites_dir>/NAME.toml``                   that suite (every check); a deleted one, nothing
a suite's ``model.config`` (or a file in     the suites that name it
its folder: tokenizer, hf_quant_config)
``<golden_dir>/SUITE/...``                   that suite
``harness/checks/NAME.py`` (harness's own    every suite, check NAME only
repository)
``select.kernels`` paths (harness.toml)      the suites whose op inventory (the pruned model's
                                             real CPU trace, the ops check's) has one of the
                                             mapped ops
anything else                                everything: an unmapped change is not proof of no
                                             effect
===========================================  =================================================

The answer names, per suite, why it was selected ("kernel path csrc/mm/gemm.cu -> aten.mm.default").
A vendor's kernel repository maps its source folders to the aten operators they implement::

    [[select.kernels]]
    paths = ["csrc/attention/**"]
    ops = ["aten::_scaled_dot_product_*", "aten::bmm"]
"""

from __future__ import annotations

import fnmatch
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from harness.settings import Settings


class SelectError(Exception):
    """The diff cannot be computed (not a repository, unknown ref): one line."""


@dataclass
class Selection:
    everything: list[str] = field(default_factory=list)  # why every item is selected ([] if not)
    suites: dict[str, list[str]] = field(default_factory=dict)  # suite -> why (all its checks)
    checks: dict[str, list[str]] = field(default_factory=dict)  # check -> why (every suite, that check)
    ignored: list[str] = field(default_factory=list)  # changed paths that select nothing
    changed: list[str] = field(default_factory=list)
    files: dict[str, str] = field(default_factory=dict)  # suite name -> its file (repository path)

    @property
    def empty(self) -> bool:
        return not (self.everything or self.suites or self.checks)

    def run_arguments(self) -> list[str] | None:
        """`harness run` arguments that cover the selection (None: nothing to run; []: every item).
        Suites and a check-only change together are not one run's exact union: every item then (a
        superset, never less)."""
        if self.empty:
            return None
        if self.everything or (self.checks and self.suites):
            return []
        if self.checks:
            return [a for c in sorted(self.checks) for a in ("--check", c)]
        return sorted(self.suites)

    def add_sample(self, names: list[str], k: int, seed: str) -> list[str]:
        """``k`` suites the change did not select, taken in turn (a window over the sorted names that
        moves with ``seed``: the pull request, the run), so every suite gets run by pull requests now
        and then and an unmapped dependency cannot hide for good. Returns the names added."""
        import hashlib

        if self.everything or k <= 0:
            return []
        rest = sorted(n for n in names if n not in self.suites)
        if not rest:
            return []
        # a pull request number walks the names in turn (consecutive pull requests: consecutive suites);
        # any other seed (a commit) lands anywhere
        n = int(seed) if seed.isdigit() else int(hashlib.sha256(seed.encode()).hexdigest(), 16)
        start = n % len(rest)
        picked = [rest[(start + i) % len(rest)] for i in range(min(k, len(rest)))]
        for n in picked:
            self.suites[n] = [f"rotating sample (seed {seed}): not selected by the change"]
        return picked

    def markdown(self) -> str:
        """The job summary's section: what is run and why (never an empty selection without a word)."""
        lines = ["### Selection by change", "", f"{len(self.changed)} changed path(s)."]
        if self.everything:
            lines += ["", "**Every item**: " + "; ".join(self.everything[:10])]
        elif self.empty:
            lines += ["", "**Nothing to run**: no changed path can affect an item ("
                      + ", ".join(self.ignored[:10]) + ")."]
        else:
            lines += ["", "| selected | why |", "|---|---|"]
            lines += [f"| suite {s} | {'; '.join(w)} |" for s, w in sorted(self.suites.items())]
            lines += [f"| check {c} (every suite) | {'; '.join(w)} |" for c, w in sorted(self.checks.items())]
        return "\n".join(lines) + "\n"

    def to_json(self) -> dict:
        return {"format": 1, "everything": self.everything, "suites": self.suites, "checks": self.checks,
                "ignored": self.ignored, "changed": self.changed, "run_arguments": self.run_arguments(),
                "files": {n: f for n, f in self.files.items() if n in self.suites}}


def git(*args: str, cwd: str | Path | None = None) -> str:
    """``git ARGS`` output; SelectError with git's last line when it fails."""
    try:
        r = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SelectError(f"git {' '.join(args)}: {e}") from None
    if r.returncode:
        raise SelectError(f"git {' '.join(args)}: {(r.stderr.strip().splitlines() or ['failed'])[-1]}")
    return r.stdout.strip()


def changed_paths(base: str, head: str = "HEAD", cwd: str | Path | None = None) -> list[str]:
    """Paths changed between the merge base of ``base`` and ``head``, and ``head`` (a pull request's
    own changes), relative to the repository root; renames as a deletion and an addition."""
    try:
        git("rev-parse", "--git-dir", cwd=cwd)
    except SelectError:  # said as what it is, not as a missing ref (issue #49)
        raise SelectError(f"{Path(cwd or '.').resolve()} is not in a git repository: harness select compares two "
                          "commits of the repository it runs in") from None
    for ref in (base, head):
        try:
            git("rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}", cwd=cwd)
        except SelectError:
            raise SelectError(f"{ref!r} is not a commit of this repository (fetch it first: "
                              f"git fetch origin {ref})") from None
    return [p for p in git("diff", "--name-only", "--no-renames", f"{base}...{head}", cwd=cwd).splitlines() if p]


def _matches(path: str, patterns: list[str]) -> bool:
    p = PurePosixPath(path)
    return any(fnmatch.fnmatchcase(path, pat) or p.match(pat) for pat in patterns)


def _op_matches(op: str, pattern: str) -> bool:
    """``aten.mm.default`` against ``aten::mm`` (every overload), ``aten.mm.default`` or a glob."""
    pat = pattern.replace("::", ".")
    base = op.rsplit(".", 1)[0] if op.count(".") >= 2 else op
    return fnmatch.fnmatchcase(op, pat) or fnmatch.fnmatchcase(base, pat)


def select(changed: list[str], settings: Settings, root: Path, suites: list, op_names) -> Selection:
    """``suites``: the loaded suites (LoadedSuite); ``op_names(ls) -> set of op names`` (the ops
    check's inventory). Paths are relative to ``root`` (the repository root)."""
    root = root.resolve()
    out = Selection(changed=list(changed))
    layout = _layout(settings, root, suites, op_names)
    out.files = {n: f for f, n in layout.by_file.items()}
    for path in changed:
        # The rules of the module docstring's table, in its order: the first that applies decides.
        if not any(rule(path, PurePosixPath(path), layout, out) for rule in _RULES):
            out.everything.append(f"{path} is not mapped to suites, checks or ops (harness.toml [select])")
    return out


@dataclass
class _Layout:
    """Where each kind of changed path leads: the settings' paths and the loaded suites, indexed."""
    settings: Settings
    suites: list
    op_names: Callable  # ls -> the op names of its inventory (the ops check's)
    suites_dir: str
    golden_dir: str
    quiet: list[str]  # harness's own bookkeeping files: changing them changes no item
    by_config: dict[str, list[str]]  # model config (or its folder, ending in /) -> suite names
    by_file: dict[str, str]  # suite file -> suite name
    names: set[str]
    check_names: set[str]
    inventories: dict[str, set[str]] = field(default_factory=dict)  # filled on first use: each costs a trace

    def inventory(self, ls) -> set[str]:
        if ls.name not in self.inventories:
            self.inventories[ls.name] = set(self.op_names(ls))
        return self.inventories[ls.name]


def _layout(settings: Settings, root: Path, suites: list, op_names) -> _Layout:
    """The settings' paths as repository paths, and the suites indexed by their file and model config."""
    by_config: dict[str, list[str]] = {}
    for ls in suites:
        cfg = _rel(root, ls.config_path)
        by_config.setdefault(cfg, []).append(ls.name)
        if PurePosixPath(cfg).name == "config.json":  # a model folder (HF layout): its tokenizer, sidecars
            by_config.setdefault(str(PurePosixPath(cfg).parent) + "/", []).append(ls.name)
    by_file = {_rel(root, ls.path): ls.name for ls in suites}
    from harness.checks import registry as checks

    return _Layout(settings, suites, op_names,
                   suites_dir=_rel(root, Path(settings.suites_dir)),
                   golden_dir=_rel(root, Path(settings.golden_dir)),
                   quiet=[_rel(root, Path(settings.durations_file)), _rel(root, Path(settings.quarantine_file))],
                   by_config=by_config, by_file=by_file, names={ls.name for ls in suites},
                   check_names=set(checks().names()))


def _add(out: Selection, suite: str, why: str) -> None:
    out.suites.setdefault(suite, []).append(why)


def _ignored_path(path: str, pp: PurePosixPath, lay: _Layout, out: Selection) -> bool:
    if _matches(path, lay.settings.select.ignore) or path in lay.quiet:
        out.ignored.append(path)
        return True
    return False


def _suite_file(path: str, pp: PurePosixPath, lay: _Layout, out: Selection) -> bool:
    if path in lay.by_file:
        _add(out, lay.by_file[path], f"suite file {path} changed")
        return True
    if lay.suites_dir and str(pp.parent) == lay.suites_dir and pp.suffix == ".toml":
        out.ignored.append(path)  # a suite file that no longer exists (deleted or renamed away)
        return True
    return False


def _model_config(path: str, pp: PurePosixPath, lay: _Layout, out: Selection) -> bool:
    if not (path in lay.by_config or str(pp.parent) + "/" in lay.by_config):
        return False
    for s in lay.by_config.get(path) or lay.by_config[str(pp.parent) + "/"]:
        _add(out, s, f"its model config {'' if path in lay.by_config else 'folder '}{path} changed")
    return True


def _golden(path: str, pp: PurePosixPath, lay: _Layout, out: Selection) -> bool:
    golden_dir = lay.golden_dir
    if not (golden_dir and pp.is_relative_to(golden_dir) and len(pp.relative_to(golden_dir).parts) > 1):
        return False
    suite = pp.relative_to(golden_dir).parts[0]
    if suite in lay.names:
        _add(out, suite, f"its golden {path} changed")
    else:
        out.ignored.append(path)  # the golden of a suite that does not exist here
    return True


def _check_code(path: str, pp: PurePosixPath, lay: _Layout, out: Selection) -> bool:
    if pp.parts[:2] == ("harness", "checks") and pp.stem in lay.check_names and len(pp.parts) == 3:
        out.checks.setdefault(pp.stem, []).append(f"check code {path} changed")
        return True
    return False


def _kernel_path(path: str, pp: PurePosixPath, lay: _Layout, out: Selection) -> bool:
    maps = [m for m in lay.settings.select.kernels if _matches(path, m.paths)]
    if not maps:
        return False
    pats = [o for m in maps for o in m.ops]
    for ls in lay.suites:
        hit = sorted(op for op in lay.inventory(ls) if any(_op_matches(op, p) for p in pats))
        if hit:
            _add(out, ls.name, f"kernel path {path} -> {', '.join(hit[:4])}" + (" ..." if len(hit) > 4 else ""))
    return True


_RULES = (_ignored_path, _suite_file, _model_config, _golden, _check_code, _kernel_path)


def _rel(root: Path, p: Path) -> str:
    """``p`` (a settings path: relative to the working directory, as every harness command reads it)
    as a repository path (posix, relative to ``root``), or '' when it is outside it."""
    try:
        return PurePosixPath(p.resolve().relative_to(root)).as_posix()
    except ValueError:
        return ""


def read_selection(path: str | Path) -> dict | None:
    """A selection ``harness select --json`` wrote, or None when the file does not exist (then every
    item runs: main's runs have none). A file that is not one raises SelectError."""
    import json

    p = Path(path)
    if not p.exists():
        return None
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise SelectError(f"{path}: not a selection file: {e}") from None
    if not isinstance(data, dict) or data.get("format") != 1 or "run_arguments" not in data:
        raise SelectError(f"{path}: not a selection file of format 1 (harness select --json writes one)")
    return _checked(path, data)


def _checked(path, data: dict) -> dict:
    """Every field ``harness run --selection`` reads, of the shape ``to_json`` writes (issue #49: a list
    where a dict was, or numbers where names were, gave tracebacks); SelectError naming the field."""
    from pydantic import BaseModel, ConfigDict, ValidationError

    class Selection(BaseModel):
        model_config = ConfigDict(extra="allow", strict=True)
        run_arguments: list[str] | None
        everything: list[str] = []
        ignored: list[str] = []
        changed: list[str] = []
        suites: dict[str, list[str]] = {}
        checks: dict[str, list[str]] = {}
        files: dict[str, str] = {}

    try:
        Selection.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(map(str, err["loc"])) or "(top)"
        raise SelectError(f"{path}: not a selection file of format 1: {where}: {err['msg']} (harness select "
                          "--json writes one)") from None
    return data
