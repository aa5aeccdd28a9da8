"""A check is a short sequence of named steps over library functions (issue #44 item 3, torchtitan's
way: ``apply_tp -> apply_ac -> apply_fsdp``, each a call into the library). A Check subclass in
harness/checks/ of several hundred lines holds logic that belongs in the layer below it
(harness/perf/measure.py and judge.py took PerfCheck's, harness/compiler/bounds.py, counts.py and
backward.py CompileCheck's, harness/models/probe.py SmokeCheck's, harness/precision/backward_judge.py
TrainingCheck's): the test measures every one with ast and names the offenders."""

from __future__ import annotations

import ast
from pathlib import Path

CHECKS = Path(__file__).resolve().parents[1] / "harness" / "checks"
LIMIT = 200  # lines of a Check subclass (end_lineno - lineno + 1)
# A class over LIMIT when the rule came was held at its size of that day (so it could only shrink) until
# it was split as perf and compile were, then its entry dropped: SmokeCheck 285 and TrainingCheck 206 were
# split so. Empty: every check class is within LIMIT; a new entry is a debt, and the test below fails
# once it is no longer needed.
CEILING: dict[str, int] = {}


def check_classes(folder: Path) -> dict[str, tuple[str, int]]:
    """class name -> (file, lines) of every subclass of ``Check`` (directly or through another class
    of the folder) defined at the top level of ``folder/*.py``."""
    classes: dict[str, tuple[str, int, set[str]]] = {}
    for path in sorted(folder.glob("*.py")):
        for node in ast.parse(path.read_text(), filename=str(path)).body:
            if isinstance(node, ast.ClassDef):
                bases = {b.id if isinstance(b, ast.Name) else b.attr for b in node.bases
                         if isinstance(b, ast.Name | ast.Attribute)}
                classes[node.name] = (path.name, node.end_lineno - node.lineno + 1, bases)
    found, grew = {"Check"}, True
    while grew:  # subclasses of subclasses, in any order of the files
        new = {name for name, (_, _, bases) in classes.items() if bases & found} - found
        found |= new
        grew = bool(new)
    return {name: (f, n) for name, (f, n, _) in classes.items() if name in found and name != "Check"}


def oversized(folder: Path, limit: int = LIMIT, ceiling: dict[str, int] | None = None) -> list[str]:
    ceiling = CEILING if ceiling is None else ceiling
    return [f"{f}:{name} has {n} lines (at most {ceiling.get(name, limit)})"
            for name, (f, n) in sorted(check_classes(folder).items()) if n > ceiling.get(name, limit)]


def stale(sizes: dict[str, tuple[str, int]], ceiling: dict[str, int] | None = None, limit: int = LIMIT) -> list[str]:
    """Ceilings no longer needed: the class shrank to the limit, or is gone."""
    ceiling = CEILING if ceiling is None else ceiling
    return [name for name in ceiling if name not in sizes or sizes[name][1] <= limit]


def test_every_check_class_is_a_short_sequence_of_steps():
    assert oversized(CHECKS) == [], ("move the logic of these checks' steps into library functions below "
                                     "harness/checks (docs/architecture.md):\n" + "\n".join(oversized(CHECKS)))


def test_the_split_checks_are_within_the_limit_and_the_ceilings_are_current():
    sizes = check_classes(CHECKS)
    split = ("PerfCheck", "CompileCheck", "SmokeCheck", "TrainingCheck")
    assert set(split) <= set(sizes), sorted(sizes)  # the walk finds them
    assert all(sizes[name][1] <= 180 for name in split), {name: sizes[name] for name in split}
    # a ceiling no longer needed (the class shrank to the limit, or is gone) is dropped, not kept as slack
    assert stale(sizes) == [], f"drop these from CEILING: {stale(sizes)}"


def test_an_oversized_check_is_named(tmp_path):
    """A check (and a subclass of it, in another file) past the limit are reported by name; a class
    that is no check is not measured."""
    body = "".join(f"    def step{i}(self, ctx, st):\n        st.x = {i}\n\n" for i in range(80))
    (tmp_path / "a.py").write_text(f"from harness.checks import Check\n\n\nclass BigCheck(Check):\n{body}")
    (tmp_path / "b.py").write_text(f"from a import BigCheck\n\n\nclass Bigger(BigCheck):\n{body}\n\n"
                                   f"class NotACheck:\n{body}\n\nclass Small(base.Check):\n    name = 's'\n")
    sizes = check_classes(tmp_path)
    assert set(sizes) == {"BigCheck", "Bigger", "Small"} and sizes["Small"] == ("b.py", 2)
    assert oversized(tmp_path, 200, {}) == ["a.py:BigCheck has 240 lines (at most 200)",
                                            "b.py:Bigger has 240 lines (at most 200)"]
    assert oversized(tmp_path, 200, {"BigCheck": 240}) == ["b.py:Bigger has 240 lines (at most 200)"]
    # a ceiling is stale once its class is within the limit or gone; one still needed is not
    assert stale(sizes, {"BigCheck": 240, "Small": 10, "Gone": 300}, 200) == ["Small", "Gone"]
