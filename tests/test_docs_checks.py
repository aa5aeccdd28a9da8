"""The docs name the checks harness registers, all of them: docs/adding-a-check.md's table of
built-in checks is the canonical list, kept equal to the ``harness.checks`` entry points of
harness's own distribution (pyproject.toml as written and as installed); README and
docs/architecture.md, which list them again, name every one too, and no count of them comes back
wrong ("the seven built-ins" when there were eleven)."""

from __future__ import annotations

import re
from importlib.metadata import entry_points
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
NUMBERS = {w: i for i, w in enumerate("zero one two three four five six seven eight nine ten eleven twelve "
                                      "thirteen fourteen fifteen sixteen seventeen eighteen nineteen twenty".split())}


def _registered() -> list[str]:
    table = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["harness.checks"]
    installed = sorted(ep.name for ep in entry_points(group="harness.checks")
                       if ep.dist is not None and ep.dist.name == "harness")
    assert installed == sorted(table), "the installed metadata is stale: reinstall (pip install -e .)"
    return sorted(table)


def _canonical() -> list[str]:
    """The check names of the table under '## The built-in checks' in docs/adding-a-check.md."""
    text = (ROOT / "docs" / "adding-a-check.md").read_text()
    assert "\n## The built-in checks\n" in text, "docs/adding-a-check.md lost its list of built-in checks"
    section = text.split("\n## The built-in checks\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `(\w+)` \| `harness/checks/(\w+)\.py` \|", section, re.M)


def test_the_canonical_list_is_the_entry_points():
    rows = _canonical()
    names = [name for name, _module in rows]
    assert len(names) == len(set(names)), names
    assert sorted(names) == _registered()
    for name, module in rows:  # each row names the module that registers it
        table = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["harness.checks"]
        assert table[name] == f"harness.checks.{module}:register", (name, module)


def test_the_other_lists_name_every_check():
    names = _registered()
    readme = [line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("| `harness/checks/`")]
    arch = [line for line in (ROOT / "docs" / "architecture.md").read_text().splitlines()
            if re.match(r"\s+(checks\s+)?smoke\s+precision\s", line)]
    assert len(readme) == 1 and len(arch) == 2, (readme, arch)  # the lists this test knows about
    for line in readme:
        assert sorted(re.findall(r"`(\w+)`", line.split("|")[2])) == names, line
    for line in arch:
        listed = line.split("(")[0].split()
        assert sorted(w for w in listed if w != "checks") == names, line


def test_no_doc_miscounts_the_built_in_checks():
    n = len(_registered())
    wrong = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text()
        for m in re.finditer(r"\b(\w+)\s+built-in(?:s| checks)\b", text):
            word = m.group(1).lower()
            count = NUMBERS.get(word, int(word) if word.isdigit() else None)
            if count is not None and count != n:
                wrong.append(f"{path.name}: {m.group(0)!r} (there are {n})")
    assert not wrong, wrong
