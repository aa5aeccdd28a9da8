"""The check contract (harness/checks/base.py, outcomes.py, the registry): a vendor's check plugs in
through the entry point with its own validated table, and run_one callers see harness outcomes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from harness.checks import (
    Check,
    CheckConfig,
    CheckContext,
    CheckFailure,
    CheckRegistry,
    CouldNotRun,
    KnownGap,
    NotApplicable,
    registry,
    run_one,
)
from harness.suite.loader import SuiteError, load_suite
from tests_support import REPO_SUITES, TINY_PRUNE

TINY = '[model]\nconfig = "configs/Llama-3.1-8B.json"\n' + TINY_PRUNE

# A vendor's check, as it would ship in its own package: its own table, two named steps, a metric.
VENDOR_CHECK = '''
from pydantic import Field

from harness import metrics
from harness.checks import Check, CheckConfig, CheckFailure, NotApplicable
from harness.models.build import build_model

metrics.declare("embedding_rms", "", "none", "RMS of the input embedding weights")


class EmbeddingConfig(CheckConfig):
    """Embedding sanity (a vendor's example check)."""

    max_rms: float = Field(1.0, gt=0, description="Largest acceptable RMS of the embedding weights.")


class EmbeddingCheck(Check):
    name = "embedding"
    config_model = EmbeddingConfig
    headline = ("embedding_rms",)
    steps = ("build", "measure")
    setup_steps = ("build",)

    def build(self, ctx, st):
        st.model, _ = build_model(ctx.suite, ctx.dtype, ctx.device, seed=0)

    def measure(self, ctx, st):
        if ctx.dtype == "bfloat16":
            raise NotApplicable("embedding check runs in float32 only")
        w = st.model.get_input_embeddings().weight.float()
        rms = ctx.metric("embedding_rms", w.pow(2).mean().sqrt().item())
        ctx.tolerance("embedding_rms", ctx.config.max_rms)
        if rms > ctx.config.max_rms:
            raise CheckFailure("embedding weights too large", metric="embedding_rms",
                               expected=f"<= {ctx.config.max_rms}", observed=rms)


def register(registry):
    registry.add(EmbeddingCheck())
'''


@pytest.fixture
def vendor_package(tmp_path: Path) -> Path:
    """A real installed-style distribution on a path: package + dist-info with entry_points.txt
    (what `pip install` of a vendor package leaves behind). Nothing in harness is edited."""
    site = tmp_path / "site"
    (site / "vendor_checks").mkdir(parents=True)
    (site / "vendor_checks" / "__init__.py").write_text(VENDOR_CHECK)
    info = site / "vendor_checks-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vendor-checks\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[harness.checks]\nembedding = vendor_checks:register\n")
    return site


def _harness(*args, cwd: Path, site: Path | None = None, env: dict | None = None):
    exe = Path(sys.executable).with_name("harness")
    e = os.environ | {"HF_HUB_OFFLINE": "1", "COLUMNS": "200"} | (env or {})
    if site is not None:
        e["PYTHONPATH"] = str(site) + os.pathsep + e.get("PYTHONPATH", "")
    return subprocess.run([str(exe), *args], cwd=cwd, env=e, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_a_vendor_check_registers_through_the_entry_point_with_its_own_table(tmp_path, vendor_package):
    shutil.copytree(REPO_SUITES / "configs", tmp_path / "suites" / "configs")
    (tmp_path / "suites" / "tiny.toml").write_text(
        'backends = ["cpu"]\n' + TINY + "\n[checks.embedding]\nmax_rms = 0.5\n")
    (tmp_path / "suites" / "bad.toml").write_text(
        'backends = ["cpu"]\n' + TINY + '\n[checks.embedding]\nmax_rms = "big"\n')
    # validated like a built-in: file, field path, what was expected
    v = _harness("validate", "--no-build", cwd=tmp_path, site=vendor_package)
    assert "ok    suites/tiny.toml" in v.stdout, v.stdout + v.stderr
    assert "suites/bad.toml: checks.embedding.max_rms: input should be a valid number" in v.stdout
    schema = _harness("validate", "--schema", cwd=tmp_path, site=vendor_package).stdout
    assert "`checks.embedding.max_rms`" in schema and "Largest acceptable RMS" in schema
    # collected, run and reported: one passed item, one NotApplicable -> skipped, in JUnit and the table
    (tmp_path / "suites" / "bad.toml").unlink()
    r = _harness("run", "tiny", "--check", "embedding", cwd=tmp_path, site=vendor_package)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 passed, 0 failed, 0 errors, 1 skipped" in r.stdout
    assert "embedding check runs in float32 only" in r.stdout
    row = next(line for line in r.stdout.splitlines() if "│" in line and "embedding" in line and "passed" in line)
    assert "embedding_rms=" in row  # the check's headline metric in the table
    root = ET.parse(tmp_path / "results" / "junit.xml").getroot()
    props = {p.get("name"): p.get("value") for tc in root.iter("testcase") if "float32" in tc.get("name")
             for p in tc.iter("property")}
    assert props["harness.check"] == "embedding" and float(props["tolerance.embedding_rms"]) == 0.5
    # without the package the same table is an unknown key naming the checks that exist
    v = _harness("validate", "--no-build", "tiny", cwd=tmp_path)
    assert "checks.embedding: unknown key (expected one of: " in v.stdout and "smoke" in v.stdout


def test_run_one_raises_harness_outcomes_never_pytest_exceptions(write_suite):
    ls = load_suite(write_suite("t", TINY))
    outcomes = {"fail": CheckFailure("no"), "gap": KnownGap("known"), "na": NotApplicable("n/a")}

    class Says(Check):
        name = "says"
        steps = ("say",)

        def say(self, ctx, st):
            raise outcomes[ctx.variant]

    reg = registry()
    reg.add(Says())
    try:
        for variant, exc in outcomes.items():
            with pytest.raises(type(exc)):
                run_one(ls, "says", "cpu", "float32", variant)
        with pytest.raises(NotApplicable, match="not importable"):  # absent backend: skip, not a crash
            run_one(ls, "smoke", "npu", "float32")
        with pytest.raises(CouldNotRun, match="unknown backend 'tpu9'"):
            run_one(ls, "smoke", "tpu9", "float32")
    finally:
        reg._items.pop("says")


def test_an_exception_in_a_setup_step_is_could_not_run_and_names_the_step(write_suite):
    ls = load_suite(write_suite("t", TINY))

    class Broken(Check):
        name = "broken"
        steps = ("build", "forward")
        setup_steps = ("build",)

        def build(self, ctx, st):
            raise ImportError("No module named 'vendor_adapter'")

        def forward(self, ctx, st):  # never reached
            raise AssertionError

    from harness.backends import get

    with pytest.raises(CouldNotRun) as e:
        Broken().run(CheckContext(ls, get("cpu"), "float32"))
    assert e.value.step == "build" and "ImportError: No module named 'vendor_adapter'" in str(e.value)


def test_registry_refuses_checks_that_cannot_have_a_table():
    reg = CheckRegistry()

    class NoName(Check):
        pass

    class BadConfig(Check):
        name = "bad"
        config_model = dict  # type: ignore[assignment]

    with pytest.raises(ValueError, match="Python identifier"):
        reg.add(NoName())
    with pytest.raises(ValueError, match="CheckConfig subclass"):
        reg.add(BadConfig())


def test_builtin_tables_come_from_the_checks(write_suite):
    ls = load_suite(write_suite("t", TINY + "\n[checks.quantization]\nscheme = 'int8'\n[checks.smoke]\n"
                                "no_grad_ok = ['*.indexer.*']\n"))
    assert ls.suite.checks.quantization.scheme == "int8"
    assert ls.suite.checks.smoke.no_grad_ok == ["*.indexer.*"]
    assert isinstance(ls.suite.checks.ops, CheckConfig) and ls.suite.checks.ops.enabled is False
    with pytest.raises(SuiteError, match=r"checks\.smoke\.steps: must be >= 1, got 0"):
        load_suite(write_suite("u", TINY + "\n[checks.smoke]\nsteps = 0\n"))


def test_smoke_no_grad_ok_excuses_only_the_listed_parameters(write_suite):
    """A parameter without gradient by design (a sparse-attention indexer) is allowed by glob;
    any other parameter without gradient still fails."""
    import harness.checks.smoke as smoke

    ls_ok = load_suite(write_suite("a", TINY + "\n[checks.smoke]\nno_grad_ok = ['*.layers.0.mlp.up_proj.*']\n"
                                   "generate_tokens = 0\n"))
    ls_bad = load_suite(write_suite("b", TINY + "\n[checks.smoke]\nno_grad_ok = ['*.indexer.*']\ngenerate_tokens = 0\n"))
    real = smoke.build_model

    def detached(*a, **kw):  # cut layer 0's up_proj out of the graph, as an indexer is
        model, mc = real(*a, **kw)
        lin = model.model.layers[0].mlp.up_proj
        lin.register_forward_hook(lambda m, i, o: o.detach())
        return model, mc

    smoke.build_model = detached
    try:
        ctx = run_one(ls_ok, "smoke", "cpu", "float32")
        assert any("no gradient by design" in n for n in ctx.notes)
        with pytest.raises(CheckFailure, match="got no gradient, first: \\['model.layers.0.mlp.up_proj.weight'\\]"):
            run_one(ls_bad, "smoke", "cpu", "float32")
    finally:
        smoke.build_model = real


def test_toml_falls_back_to_tomli_when_tomllib_is_missing():
    """Python 3.10 has no tomllib: harness.toml must import tomli there (simulated by hiding it)."""
    code = textwrap.dedent("""
        import sys
        sys.modules["tomllib"] = None  # import tomllib -> ModuleNotFoundError, as on 3.10
        import harness.toml as t
        print(t.IMPLEMENTATION, t.loads('a = 1')['a'])
        from harness.suite import loader  # the suite loader imports through it
        print("loader ok")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["tomli", "1", "loader", "ok"]


def test_no_module_imports_tomllib_directly():
    root = Path(__file__).resolve().parents[2] / "harness"
    offenders = [str(p.relative_to(root)) for p in root.rglob("*.py")
                 if p.name != "toml.py" and "import tomllib" in p.read_text()]
    assert offenders == [], f"import TOML through harness.toml: {offenders}"


def test_hypothesis_is_a_runtime_dependency():
    from importlib.metadata import requires

    reqs = [r.split(";")[0].replace(" ", "") for r in requires("harness") if "extra ==" not in r]
    assert any(r.startswith("hypothesis") for r in reqs), reqs
    json.dumps(reqs)
