"""The bundled suites' compile items at commit scope (issue #52): code generation moved to nightly on
every suite but one, so the README's first command takes minutes; the commit scope still runs inductor's
code generation - the only place a wrong lowering shows - on at least one suite for every backend and
dtype, and the compiler's front end (graph breaks, recompiles, decompositions) on every suite."""

from __future__ import annotations

from harness.backends import get, registry
from harness.checks import registry as checks
from harness.suite.loader import discover, load_suite
from tests_support import REPO_SUITES


def test_every_backend_and_dtype_keeps_code_generation_on_commit_and_every_suite_its_front_end():
    check = checks().get("compile")
    full, frontend, dtypes = set(), set(), set()
    for path in discover(REPO_SUITES):
        ls = load_suite(path)
        assert ls.suite.backends == ["*"], path  # every backend: the loop below needs no filter
        dtypes |= set(ls.suite.dtypes)
        for backend in registry().names():
            for v in check.variants(ls, get(backend)):
                if check.scope(ls, v) != "commit":
                    continue
                for dtype in ls.suite.dtypes:
                    if v is None:
                        full.add((backend, dtype, path.stem))
                    elif v == "frontend":
                        frontend.add(path.stem)
    for backend in registry().names():
        for dtype in dtypes:
            assert any(b == backend and d == dtype for b, d, _ in full), (backend, dtype, sorted(full))
    # every suite compiles on commit, in full or through the front end
    assert {s for _, _, s in full} | frontend == {p.stem for p in discover(REPO_SUITES)}
    assert frontend, "the bundled suites' code generation is nightly but for one suite (issue #52)"
