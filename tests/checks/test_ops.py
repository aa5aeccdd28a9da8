"""The ops check: items from the inventory, CPU conformance, missing ops fail with op and modules."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from harness.checks import CheckFailure, KnownGap, registry, run_one
from harness.suite.loader import load_suite
from tests_support import REPO, REPO_SUITES

CPU_LIST = REPO / "harness" / "oplists" / "cpu.txt"


@pytest.fixture(scope="module")
def ops_suite(tmp_path_factory):
    """qwen3-30b-a3b (MoE, GQA, explicit head_dim) with the ops check on, cache in tmp. Module-scoped:
    the real CPU trace is made once per process per suite path and dtype."""
    tmp = tmp_path_factory.mktemp("ops")
    body = (REPO_SUITES / "qwen3-30b-a3b.toml").read_text().replace(
        'config = "configs/', f'config = "{REPO_SUITES}/configs/')
    body = body.split("\n[checks.ops]")[0]  # the bundled suite may enable ops itself; set our own
    body += "\n[checks.ops]\nenabled = true\nexamples = 4\n\n[known_gaps]\ngapdev = [\"aten::silu\"]\n"
    (tmp / "suites").mkdir()
    p = tmp / "suites" / "q.toml"
    p.write_text(body)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HARNESS_CACHE_DIR", str(tmp / "cache"))
        yield load_suite(p)


def test_variants_come_from_the_inventory_and_are_cached(ops_suite):
    check = registry().get("ops")
    assert check.enabled(ops_suite) and not check.enabled(load_suite(REPO_SUITES / "qwen3-8b.toml"))
    ops = check.variants(ops_suite, None)
    assert {"aten.mm.default", "aten._grouped_mm.default", "aten.histc.default", "aten.silu.default"} <= set(ops)
    cached = list((ops_suite.path.parent.parent / "cache" / "ops").glob("q-*.json"))
    assert len(cached) == 2  # float32 and bfloat16


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("op", ["aten.mm.default", "aten._grouped_mm.default", "aten.histc.default",
                                "aten.rsqrt.default", "aten.topk.default", "aten.index_put_.default",
                                "aten._softmax.default", "aten.nll_loss_forward.default"])
def test_cpu_conformance(ops_suite, op, dtype):
    if op == "aten._softmax.default" and dtype == "bfloat16":
        pytest.skip("router softmax runs in float32 in both")
    ctx = run_one(ops_suite, "ops", "cpu", dtype, op)
    props = dict(ctx.properties)
    assert float(props["metric.op_max_rel_error"]) <= float(props["tolerance.op_max_rel_error"])
    assert float(props["metric.op_cases"]) >= 1
    assert "native" in props["harness.detail.coverage"] or "composite" in props["harness.detail.coverage"]


def test_grouped_mm_has_no_float64_cpu_reference_and_says_so(ops_suite):
    ctx = run_one(ops_suite, "ops", "cpu", "float32", "aten._grouped_mm.default")
    assert any("no float64 CPU reference" in n for n in ctx.notes)


def _testdev(tmp_path, monkeypatch, name="testdev"):
    lines = [x for x in CPU_LIST.read_text().splitlines() if x.strip() != "aten.silu.default"]
    (tmp_path / "dev.txt").write_text("\n".join(lines) + "\n")
    (tmp_path / "harness.toml").write_text(
        f'[[backends]]\nname = "{name}"\ndevice_type = "cpu"\nop_list = "dev.txt"\n')
    monkeypatch.setenv("HARNESS_CONFIG", str(tmp_path / "harness.toml"))


def test_missing_op_item_fails_with_op_and_modules(ops_suite, tmp_path, monkeypatch):
    _testdev(tmp_path, monkeypatch)
    with pytest.raises(CheckFailure) as e:
        run_one(ops_suite, "ops", "testdev", "float32", "aten.silu.default")
    msg = str(e.value)
    assert "aten.silu.default is missing on backend testdev" in msg
    assert "model.layers.*.mlp.experts.act_fn [SiLUActivation]" in msg
    # an op the list has still runs and passes there
    run_one(ops_suite, "ops", "testdev", "float32", "aten.mm.default")


def test_known_gap_is_an_expected_failure(ops_suite, tmp_path, monkeypatch):
    _testdev(tmp_path, monkeypatch, "gapdev")
    # run_one callers see harness's own outcome, never a pytest exception
    with pytest.raises(KnownGap, match="known gap"):
        run_one(ops_suite, "ops", "gapdev", "float32", "aten.silu.default")


def test_wrong_kernel_is_caught(ops_suite, monkeypatch):
    """A backend kernel that is slightly off fails against the float64 reference."""
    import harness.checks.ops as ops_mod

    real = ops_mod._execute

    def skewed(func, args, kwargs, device, float_dtype=None):
        out = real(func, args, kwargs, device, float_dtype)
        # the backend run gets the backend's torch.device; the references get the string "cpu"
        return out * 1.001 if isinstance(device, torch.device) else out

    monkeypatch.setattr(ops_mod, "_execute", skewed)
    with pytest.raises(CheckFailure, match="off the cpu float64 reference"):
        run_one(ops_suite, "ops", "cpu", "float32", "aten.mm.default")


@pytest.mark.slow  # a pytest subprocess: ~10-25 s on 2 cores
def test_items_in_pytest(ops_suite, tmp_path):
    """Collected as ops[<backend>-<dtype>-<op>] items; a missing op fails with its reason in the report."""
    _lines = [x for x in CPU_LIST.read_text().splitlines() if x.strip() != "aten.silu.default"]
    (tmp_path / "dev.txt").write_text("\n".join(_lines) + "\n")
    (tmp_path / "harness.toml").write_text(textwrap.dedent("""
        [[backends]]
        name = "testdev"
        device_type = "cpu"
        op_list = "dev.txt"
        """))
    env = dict(os.environ, HARNESS_CONFIG=str(tmp_path / "harness.toml"))
    r = subprocess.run([sys.executable, "-m", "pytest", str(ops_suite.path), "-q", "-p", "no:randomly",
                        "--harness-backend", "testdev", "--harness-dtype", "float32", "--harness-check", "ops",
                        "-k", "silu or mm.default"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    out = r.stdout + r.stderr
    assert "q.toml::ops[testdev-float32-aten.silu.default] - ops" in out, out[-3000:]
    assert "aten.silu.default is missing on backend testdev" in out and " passed" in out, out[-3000:]
    assert "model.layers.*.mlp.experts.act_fn [SiLUActivation]" in out


# --- realistic inputs (issue #11, item 5) ------------------------------------------------------------
SDPA = "aten._scaled_dot_product_flash_attention_for_cpu.default"


@pytest.fixture(scope="module")
def bare_suite(ops_suite):
    """The same suite with ``[checks.ops] realistic = false``: the bare trace and generic kinds only
    (what the check did before realistic inputs)."""
    p = ops_suite.path.with_name("bare.toml")
    p.write_text(ops_suite.path.read_text().replace("[checks.ops]\n", "[checks.ops]\nrealistic = false\n"))
    return load_suite(p)


def _sdpa_default_scale(q, k, v, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    """A fused CPU attention kernel whose low-precision path hard-wires the softmax scale to
    1/sqrt(head_dim) (the `scale` argument dropped): right whenever a model passes the default,
    wrong for any other attention temperature. Float32/float64 stay right."""
    low = q.dtype in (torch.bfloat16, torch.float16)
    sc = q.shape[-1] ** -0.5 if low or scale is None else scale
    out, _ = torch.ops.aten._scaled_dot_product_attention_math(q, k, v, attn_mask, dropout_p, is_causal, None,
                                                              scale=sc, enable_gqa=True)
    s = (q.float() @ k.float().repeat_interleave(q.shape[1] // k.shape[1], 1).transpose(-2, -1)) * sc
    if is_causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    if attn_mask is not None:
        s = s + attn_mask
    return out, torch.logsumexp(s, -1)  # the logsumexp output consistent with the kernel's own scale


@pytest.fixture
def backend_kernel_fault(monkeypatch):
    """Register the faulty kernel with torch.library for the CPU, around the *backend's* calls only:
    the check's references (float64 and the CPU's own run-dtype result) keep torch's kernels, as
    they would on a real accelerator whose vendor kernel is wrong."""
    import warnings

    import harness.checks.ops as ops_mod

    real = ops_mod._execute

    def backend_faulty(func, args, kwargs, device, float_dtype=None):
        if not isinstance(device, torch.device):  # the references get the string "cpu"
            return real(func, args, kwargs, device, float_dtype)
        lib = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "overriding a previously registered kernel": on purpose
            lib.impl("_scaled_dot_product_flash_attention_for_cpu", _sdpa_default_scale, "CPU")
        try:
            return real(func, args, kwargs, device, float_dtype)
        finally:
            lib._destroy()

    monkeypatch.setattr(ops_mod, "_execute", backend_faulty)


def test_realistic_inputs_catch_a_kernel_the_bare_inputs_miss(ops_suite, bare_suite, backend_kernel_fault):
    """The attention kernel that drops `scale` in bfloat16 passes the old inputs (bare init: the model
    passes the default scale, so every generic kind agrees) and fails with the realistic trace, whose
    attention temperature (calibrated here: this tmp suite has no golden) is in `scale`."""
    ctx = run_one(bare_suite, "ops", "cpu", "bfloat16", SDPA)
    props = dict(ctx.properties)
    assert "bare initialisation" in props["harness.detail.numerics"]
    assert "observed" not in props["harness.detail.input_kinds"]
    with pytest.raises(CheckFailure, match=f"{SDPA} on cpu is off the cpu float64 reference") as e:
        run_one(ops_suite, "ops", "cpu", "bfloat16", SDPA)
    assert float(e.value.observed) > 3 * float(props["metric.op_max_rel_error"])
    # float32 keeps the right kernel: passes either way
    run_one(ops_suite, "ops", "cpu", "float32", SDPA)


def test_stat_kinds_are_drawn_from_the_observed_scale():
    from harness.checks.ops import OUTLIER_EVERY, OUTLIER_RMS, _vary, observed_scale

    t = torch.randn(4, 64, generator=torch.Generator().manual_seed(0)) * 0.2
    t[0, 3] = 1.5  # the model's own peak
    rms, peak = observed_scale(t)
    obs = _vary(t, "observed", 7)
    assert obs.shape == t.shape and abs(observed_scale(obs)[0] / rms - 1) < 0.15
    out = _vary(t, "outliers", 7)
    hot = (out.abs() == out.abs().max()).all(0)  # [64]: the outlier channels, the same for every row
    assert int(hot.sum()) == 64 // OUTLIER_EVERY
    assert out.abs().max().item() == pytest.approx(max(peak, OUTLIER_RMS * rms), rel=1e-6)
    assert torch.equal(out, _vary(t, "outliers", 7))  # derandomized: every backend sees these values
    masked = torch.tensor([[0.0, float("-inf")], [0.5, -0.5]])  # a mask's -inf does not set the scale
    assert observed_scale(masked) == pytest.approx(((0.5**2 * 2 / 3) ** 0.5, 0.5))
    assert torch.equal(_vary(torch.zeros(3, 8), "outliers", 1), torch.zeros(3, 8))


def test_items_record_numerics_and_input_kinds(ops_suite):
    ctx = run_one(ops_suite, "ops", "cpu", "bfloat16", "aten.mm.default")
    props = dict(ctx.properties)
    assert props["harness.detail.numerics"].startswith("realistic: calibrated here (no golden")
    kinds = dict(x.rsplit(" ", 1) for x in props["harness.detail.input_kinds"].split(", "))
    assert {"model", "observed", "outliers"} <= set(kinds) and int(kinds["outliers"]) >= 1
    assert "rms" in props["harness.detail.input_scale"]


@pytest.mark.slow  # every ops item of one bundled suite in bfloat16, plus a few of the others: ~15-30 s on 2 cores
def test_clean_items_pass_with_realistic_inputs_on_the_bundled_suites(monkeypatch, tmp_path):
    """No false alarms from the new inputs: every ops item of the bundled qwen3-30b-a3b (the suite that
    enables the check; its committed golden's gains) passes in bfloat16 with the realistic trace and
    the statistics-drawn kinds, and so do the attention, matmul and activation items of the other
    bundled suites. (On the CPU backend a float error can only fail if the run-dtype kernel disagrees
    with itself; what this shows is that no new input makes an op raise or differ in structure.)"""
    from harness.checks import NotApplicable

    monkeypatch.setenv("HARNESS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HARNESS_GOLDEN_DIR", str(REPO / "golden"))
    ls = load_suite(REPO_SUITES / "qwen3-30b-a3b.toml")
    check = registry().get("ops")
    ops = check.variants(ls, None)
    assert len(ops) >= 50
    for op in ops:
        try:
            ctx = run_one(ls, "ops", "cpu", "bfloat16", op)
        except NotApplicable:
            continue
        assert dict(ctx.properties)["harness.detail.numerics"].startswith("realistic: gains of golden")
    for name in ("llama-3.1-8b", "mixtral-8x7b", "deepseek-v3"):
        other = load_suite(REPO_SUITES / f"{name}.toml")
        for op in ("aten.mm.default", "aten.silu.default", SDPA, "aten.bmm.default"):
            try:
                run_one(other, "ops", "cpu", "bfloat16", op)
            except NotApplicable:  # deepseek-v3's MLA takes the math path (bmm), not the fused kernel
                pass
