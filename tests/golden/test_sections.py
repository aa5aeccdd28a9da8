"""A check owns what it declares (issue #44): its golden section is declared in its own module and
registered with the check, `harness golden generate` makes the sections the registered checks
declare, and a vendor's check brings its own section, config table and metric through its entry
point alone - nothing in harness is edited."""

from __future__ import annotations

import shutil

import pytest
from vendor_plugin import harness

from harness.checks import Check, CheckRegistry
from harness.golden import store
from harness.golden.sections import RESERVED, GoldenSection
from tests_support import REPO_SUITES, TINY_PRUNE

# A vendor package: one check with its own [checks.vendornorms] table, metric and golden section
# (the reference's logits row norms, scaled by a knob of the table), read back by the check's steps.
PACKAGE = '''
from types import SimpleNamespace

import torch
from pydantic import Field

from harness import metrics
from harness.anatomy.capture import forward_logits
from harness.checks import Check, CheckConfig, CheckFailure
from harness.golden.sections import GoldenSection, load_golden_for
from harness.precision.runner import build_target

metrics.declare("vendor_norm_rel_err", "", "lower", "largest relative error of a logits row norm against the "
                "golden's vendor_norms section")


class NormsConfig(CheckConfig):
    """Logits row norms against the vendor's own golden section."""

    scale: float = Field(1.0, gt=0, description="Scales the stored norms (a knob that shapes the section).")
    rel_tol: float = Field(1e-3, gt=0, description="Largest relative error of a row norm.")


def spec(ls):
    cfg = ls.suite.checks.vendornorms
    return {"scale": cfg.scale} if cfg.enabled else None


def build(ref):
    norms = ref.outputs["logits"].double().norm(dim=-1) * spec(ref.ls)["scale"]
    return {"rows": int(norms.numel())}, {"norms": norms}


SECTION = GoldenSection("vendor_norms", spec, build)


class NormsCheck(Check):
    name = "vendornorms"
    config_model = NormsConfig
    golden_sections = (SECTION,)
    headline = ("vendor_norm_rel_err",)
    steps = ("golden", "measure")
    setup_steps = ("golden",)

    def new_state(self, ctx):
        return SimpleNamespace(golden_root=None)

    def golden(self, ctx, st):
        st.g = load_golden_for(ctx, st.golden_root)
        st.section = SECTION.read(st.g, ctx.suite)

    def measure(self, ctx, st):
        model, _ = build_target(ctx.suite, ctx.backend, ctx.dtype, None, st.g)
        with torch.no_grad():
            logits = forward_logits(model, st.g.inputs.to(ctx.device))
        norms = logits.double().norm(dim=-1).cpu() * ctx.config.scale
        want = st.section.tensors["norms"].double()
        err = ctx.metric("vendor_norm_rel_err", float(((norms - want).abs() / want).max()))
        if err > ctx.config.rel_tol:
            raise CheckFailure(f"logits row norms off by {err:.3g}", metric="vendor_norm_rel_err",
                               expected=f"<= {ctx.config.rel_tol}", observed=err)


def register(registry):
    registry.add(NormsCheck())
'''

SUITE = ('backends = ["cpu"]\ndtypes = ["float32"]\n[model]\nconfig = "configs/Llama-3.1-8B.json"\n' + TINY_PRUNE
         + "\n[checks.training]\nenabled = false\n[checks.decode]\nenabled = false\n")


def vendor_site(root):
    site = root / "site"
    (site / "harness_norms").mkdir(parents=True)
    (site / "harness_norms" / "__init__.py").write_text(PACKAGE)
    info = site / "harness_norms-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: harness-norms\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[harness.checks]\nvendornorms = harness_norms:register\n")
    return site


@pytest.mark.slow
def test_a_vendor_check_brings_its_golden_section_config_and_metric(tmp_path):
    shutil.copytree(REPO_SUITES / "configs", tmp_path / "suites" / "configs")
    suite = tmp_path / "suites" / "tiny.toml"
    suite.write_text(SUITE + "[checks.vendornorms]\nscale = 2.0\n")
    site = vendor_site(tmp_path)
    g = harness("golden", "generate", "tiny", cwd=tmp_path, site=site)
    assert g.returncode == 0, g.stdout + g.stderr
    golden = store.load_golden_dir(tmp_path / "golden" / "tiny")
    # the registered checks' sections the suite wants: precision's and the vendor's (training and decode off)
    assert set(golden.manifest["sections"]) == {"signed_error", "vendor_norms"}
    entry = golden.manifest["sections"]["vendor_norms"]
    assert entry["spec"] == {"scale": 2.0} and entry["rows"] == golden.inputs.numel()
    assert golden.section_tensors["vendor_norms"]["norms"].shape == golden.inputs.shape

    r = harness("run", "tiny", "--check", "vendornorms", "--no-isolate", cwd=tmp_path, site=site)
    assert "1 passed, 0 failed, 0 errors" in r.stdout, r.stdout + r.stderr
    assert "vendor_norm_rel_err=" in r.stdout  # its headline metric, in the table

    # the suite's knob changed: the section was made with other knobs - the golden's problem, one line
    suite.write_text(SUITE + "[checks.vendornorms]\nscale = 3.0\n")
    r = harness("run", "tiny", "--check", "vendornorms", "--no-isolate", cwd=tmp_path, site=site)
    assert "0 passed, 0 failed, 1 errors" in r.stdout, r.stdout + r.stderr
    assert "golden unusable" in r.stdout and "vendor_norms section was made with {'scale': 2.0}" in r.stdout

    # without the vendor package (and its table) no such section is made; nothing in harness names it
    suite.write_text(SUITE)
    g = harness("golden", "generate", "tiny", "--update", cwd=tmp_path)
    assert g.returncode == 0, g.stdout + g.stderr
    assert set(store.load_golden_dir(tmp_path / "golden" / "tiny").manifest["sections"]) == {"signed_error"}


def test_the_built_in_sections_are_declared_by_the_checks_that_read_them():
    from harness.checks import registry
    from harness.precision.generate import registered_sections

    owners = {s.name: c.name for c in registry() for s in c.golden_sections}
    assert owners == {"signed_error": "precision", "training": "training", "decode": "decode"}
    assert list(registered_sections()) == [n for n in owners]  # generate asks the registry, in the checks' order


def _check(name, *sections):
    return type(f"{name.title()}Check", (Check,), {"name": name, "golden_sections": sections})()


def test_a_section_has_one_owner_and_a_name_of_its_own():
    sec = GoldenSection("mine", lambda ls: {}, lambda ref: ({}, {}))
    reg = CheckRegistry()
    reg.add(_check("one", sec))
    with pytest.raises(ValueError, match="golden section 'mine' is already declared by check 'one'"):
        reg.add(_check("two", GoldenSection("mine", sec.spec, sec.build)))
    reg.add(_check("one", sec), replace=True)  # replacing the owner is no conflict
    with pytest.raises(ValueError, match="golden_sections must hold harness.golden.sections.GoldenSection"):
        reg.add(_check("three", "mine"))
    assert RESERVED == store.FILES  # the forward golden's own files are no section's name
    for bad in ("modules", "a-b", "../x", ""):
        with pytest.raises(ValueError, match="golden section name"):
            GoldenSection(bad, sec.spec, sec.build)


@pytest.mark.parametrize("check", ["precision", "decode", "training", "quantization", "compile"])
def test_a_missing_golden_could_not_run_in_every_check_that_reads_it(tmp_path, check):
    """load_golden_for raises the store's error; the check contract reports it as "could not run",
    never as the target's failure, with the reason as a detail."""
    from harness.backends import get
    from harness.checks import CheckContext, CouldNotRun, registry
    from harness.suite.loader import load_suite

    ls = load_suite(REPO_SUITES / "llama-3.1-8b.toml")
    ctx = CheckContext(ls, get("cpu"), "bfloat16", check=check)
    with pytest.raises(CouldNotRun, match=r"^golden unusable: .*no golden for this suite") as e:
        registry().get(check).run(ctx, golden_root=tmp_path)  # an empty golden folder
    assert e.value.step == "golden"
    assert ("harness.detail.golden_error", str(e.value).removeprefix("golden unusable: ")) in ctx.properties
