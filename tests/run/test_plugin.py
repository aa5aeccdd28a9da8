"""The pytest plugin end to end: suite files -> items -> outcomes -> JUnit properties."""

from __future__ import annotations

import shutil
import textwrap
import xml.etree.ElementTree as ET

import pytest

from tests_support import REPO_SUITES, TINY_PRUNE

TINY = '[model]\nconfig = "configs/Llama-3.1-8B.json"\n' + TINY_PRUNE


@pytest.fixture(scope="module")
def warm_imports(tmp_path_factory):
    """pytester's in-process runs drop every module they imported afterwards, which leaves
    transformers' lazy modules half-initialised for the next run. Importing what a smoke run
    needs here, once, keeps those modules in the outer process."""
    from harness.checks import run_one
    from harness.suite.loader import load_suite

    d = tmp_path_factory.mktemp("warm") / "suites"
    shutil.copytree(REPO_SUITES / "configs", d / "configs")
    (d / "w.toml").write_text(TINY)
    run_one(load_suite(d / "w.toml"), "smoke", "cpu", "float32")


@pytest.fixture
def project(pytester, warm_imports):
    """pytester's directory laid out like the repository: suites/ with the real configs. Only the
    smoke check is generated (other checks have their own tests)."""
    shutil.copytree(REPO_SUITES / "configs", pytester.path / "suites" / "configs")
    pytester.makeini("[pytest]\naddopts = --harness-check=smoke -p no:cacheprovider\n")
    return pytester


def write(pytester, name, body):
    p = pytester.path / "suites" / f"{name}.toml"
    p.write_text(textwrap.dedent(body))
    return p


def junit_cases(path):
    root = ET.parse(path).getroot()
    out = {}
    for tc in root.iter("testcase"):
        props = {p.get("name"): p.get("value") for p in tc.iter("property")}
        out[tc.get("name")] = (tc, props)
    return out


def test_items_ids_and_junit_properties(project):
    write(project, "tiny", TINY)
    r = project.runpytest("suites", "--harness-backend=cpu", "--junitxml=j.xml", "-v")
    r.assert_outcomes(passed=2)
    r.stdout.fnmatch_lines(["*suites/tiny.toml::smoke?cpu-float32? PASSED*",
                            "*suites/tiny.toml::smoke?cpu-bfloat16? PASSED*"])
    cases = junit_cases(project.path / "j.xml")
    tc, props = cases["smoke[cpu-float32]"]
    assert tc.get("classname") == "suites.tiny.toml"
    assert props["harness.suite"] == "tiny" and props["harness.check"] == "smoke"
    assert props["harness.backend"] == "cpu" and props["harness.dtype"] == "float32"
    assert float(props["metric.loss_final"]) < float(props["metric.loss_initial"])
    assert float(props["metric.wall_time_s"]) > 0 and float(props["metric.peak_memory_bytes"]) > 0


def test_uninstalled_backend_items_skip_with_reason(project):
    write(project, "npu", 'backends = ["npu", "cpu"]\ndtypes = ["float32"]\n' + TINY)
    r = project.runpytest("suites", "-rs", "--junitxml=j.xml")
    r.assert_outcomes(passed=1, skipped=1)
    r.stdout.fnmatch_lines(["*SKIPPED*backend npu: module 'torch_npu' not importable*"])


def test_unknown_backend_in_a_suite_is_an_error_naming_the_known_ones(project):
    # A typo in `backends` used to make the suite silently run nothing, exit 0.
    write(project, "x", 'backends = ["tpu9"]\ndtypes = ["float32"]\n' + TINY)
    write(project, "good", 'backends = ["cpu"]\ndtypes = ["float32"]\n' + TINY)
    r = project.runpytest("suites", "--junitxml=j.xml")
    r.assert_outcomes(passed=1, errors=1)
    r.stdout.fnmatch_lines(["*suites/x.toml: backends: unknown backend 'tpu9' (registered: cpu, cuda*"])


@pytest.mark.parametrize("option, message", [
    ("--harness-check=smok", "--harness-check: unknown check 'smok' (known: *smoke*"),
    ("--harness-backend=cpux", "--harness-backend: unknown backend 'cpux' (known: cpu,*"),
    ("--harness-dtype=fp32", "--harness-dtype: unknown dtype 'fp32' (known: float64, float32, bfloat16, float16)"),
])
def test_unknown_option_values_are_usage_errors(project, option, message):
    write(project, "tiny", TINY)
    r = project.runpytest("suites", option)
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    r.stderr.fnmatch_lines(["*" + message])


def test_custom_backend_declared_in_configuration_runs(project, monkeypatch):
    (project.path / "harness_vendordev.py").write_text("IMPORTED = True\n")
    monkeypatch.syspath_prepend(str(project.path))
    (project.path / "harness.toml").write_text(textwrap.dedent("""
        [[backends]]
        name = "vendordev"
        module = "harness_vendordev"
        device_type = "cpu"
        collective = "gloo"
        dispatch_key = "CPU"
    """))
    monkeypatch.setenv("HARNESS_CONFIG", str(project.path / "harness.toml"))
    write(project, "v", 'backends = ["vendordev"]\ndtypes = ["float32"]\n' + TINY)
    r = project.runpytest("suites", "--junitxml=j.xml", "-v")
    r.assert_outcomes(passed=1)
    _, props = junit_cases(project.path / "j.xml")["smoke[vendordev-float32]"]
    assert props["harness.backend"] == "vendordev"


def test_malformed_suite_is_reported_and_the_rest_still_runs(project):
    write(project, "good", 'dtypes = ["float32"]\nbackends = ["cpu"]\n' + TINY)
    write(project, "broken", TINY.replace("num_hidden_layers = 2", "num_hidden_layers = 0"))
    r = project.runpytest("suites", "--junitxml=j.xml")
    r.assert_outcomes(passed=1, errors=1)
    r.stdout.fnmatch_lines(["*suites/broken.toml: prune.num_hidden_layers: must be >= 1, got 0*"])
    assert "Traceback" not in r.stdout.str()
    assert (project.path / "j.xml").exists()


def test_filters_and_dtype_override(project):
    write(project, "tiny", TINY)
    r = project.runpytest("suites", "--harness-dtype=float16", "--harness-backend=cpu",
                          "--collect-only", "-q")
    assert r.ret == 0
    r.stdout.fnmatch_lines(["suites/tiny.toml::smoke[[]cpu-float16[]]", "1 test collected*"])


def test_check_failure_report_shows_metric_expected_observed(project):
    write(project, "flat", 'dtypes = ["float32"]\nbackends = ["cpu"]\n' + TINY + "[checks.smoke]\nlr = 1e-30\n")
    r = project.runpytest("suites")
    r.assert_outcomes(failed=1)
    r.stdout.fnmatch_lines(["*smoke check failed for flat on cpu in float32: 3 optimizer steps*",
                            "*metric:*loss_final*", "*expected:*< *(loss_initial)*", "*observed:*"])


def test_non_suite_toml_files_are_ignored(project):
    (project.path / "other.toml").write_text("[tool]\nx = 1\n")
    r = project.runpytest(".", "--collect-only", "-q")
    assert "other.toml" not in r.stdout.str()


def test_variants_in_a_check_table_select_items_and_an_unknown_one_is_an_error(project):
    from harness.checks import Check, registry

    class Layouts(Check):  # a check with variants, like a parallel matrix
        name = "layouts"
        steps = ("noop",)

        def variants(self, suite, backend):
            return ["tp2", "pp2", "dp2"]

        def noop(self, ctx, st):
            ctx.metric("wall_time_s", 0.0)

    registry().add(Layouts())
    try:
        write(project, "some", 'backends = ["cpu"]\ndtypes = ["float32"]\n' + TINY + '[checks.layouts]\nvariants = ["pp2"]\n')
        write(project, "typo", 'backends = ["cpu"]\ndtypes = ["float32"]\n' + TINY + '[checks.layouts]\nvariants = ["tp3"]\n')
        # in-process: the check is registered in this process only, an isolated worker would not know it
        r = project.runpytest("suites", "--harness-check=layouts", "--harness-isolate=off", "-v")
        r.assert_outcomes(passed=2, errors=1)  # some: smoke + layouts[pp2] only; typo: one erroring item
        r.stdout.fnmatch_lines(["*some.toml::layouts[[]cpu-float32-pp2[]] PASSED*",
                                "*suites/typo.toml: checks.layouts.variants: unknown variant 'tp3' (known: tp2, pp2, dp2)*"])
    finally:
        registry()._items.pop("layouts")
