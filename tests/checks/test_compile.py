"""The ``compile`` check (issue #27) on a real model with real torch.compile backends, no mocks.

One clean run of llama-3.1-8b (2 layers) in float32 through inductor (a C++ build on this CPU) is
shared by the assertions that need it. The faults run through cheaper dynamo backends where the
property under test is dynamo's (graph breaks, recompiles: aot_eager) or the decomposition table
inductor lowers with (``aot_eager_decomp_partition`` traces with inductor's own decompositions and
skips the C++ build), so that the whole file stays near a minute cold.

Inductor's caches go to a temporary folder (TORCHINDUCTOR_CACHE_DIR): nothing depends on a warm
cache from an earlier run."""

from __future__ import annotations

import contextlib
import dataclasses
import os

import pytest
import torch
from precision.helpers import run_check, suite

from harness.backends import Backend, get
from harness.checks import CheckContext, CheckFailure, NotApplicable, registry
from harness.checks.compile import CompileConfig, run_compile

NAME = "llama-3.1-8b"
# graph breaks and recompiles are dynamo's: its "eager" backend shows them without a compiler's cost
# (the compiled backward is off where the test is about the forward: it has its own test)
EAGER = {"backend": "eager", "sweep_backend": "eager", "gradients": False}


@pytest.fixture(scope="module", autouse=True)
def _inductor_cache(tmp_path_factory):
    old = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path_factory.mktemp("inductor-cache"))
    yield
    if old is None:
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
    else:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = old


def compile_suite(name: str = NAME, **knobs):
    """The bundled suite with other ``[checks.compile]`` values (no file written)."""
    ls = suite(name)
    if not knobs:
        return ls
    checks = ls.suite.checks.model_copy(update={"compile": ls.suite.checks.compile.model_copy(update=knobs)})
    return dataclasses.replace(ls, suite=ls.suite.model_copy(update={"checks": checks}))


def run(ls, dtype="float32", backend=None, variant=None, **options):
    ctx = CheckContext(ls, backend or get("cpu"), dtype, variant)
    try:
        st = run_compile(ctx, **options)
    except (CheckFailure, NotApplicable) as f:
        return ctx, None, f
    return ctx, st, None


def metric(ctx, name: str) -> float:
    return float(dict(ctx.properties)[f"metric.{name}"])


@pytest.fixture(scope="module")
def clean():
    return run(suite(NAME))


def test_registered_through_its_entry_point():
    check = registry().get("compile")
    assert check.config_model is CompileConfig and check.scope(suite(NAME), "speed") == "nightly"
    assert check.variants(suite(NAME), get("cpu")) == [None, "speed"]


def test_clean_suite_passes_with_inductor(clean):
    ctx, st, f = clean
    assert f is None, str(f)
    props = dict(ctx.properties)
    assert props["harness.detail.compile_backend"].startswith("inductor: inductor (C++ code generation")
    # within the eager comparison's budget, and compiled agrees with eager as tightly
    assert 0 < metric(ctx, "compile_logits_budget_use") < 1
    assert metric(ctx, "compile_vs_eager_rel_rmse") <= float(props["tolerance.compile_vs_eager_rel_rmse"])
    assert metric(ctx, "compile_loss_abs_err") <= float(props["tolerance.compile_loss_abs_err"])
    # the committed expectations are what the run measures
    cfg = suite(NAME).suite.checks.compile
    assert metric(ctx, "compile_graph_breaks") == cfg.expected_graph_breaks == 0
    assert metric(ctx, "compile_recompiles") == cfg.expected_recompiles
    assert metric(ctx, "compile_graphs") == 1 and metric(ctx, "compile_time_s") > 0
    assert "decode step (length 1)" in props["harness.detail.compile_recompile_reasons"]
    # the compiled backward's parameter gradients within the training check's budgets
    assert 0 < metric(ctx, "compile_grad_worst_budget_use") < 1 and metric(ctx, "compile_backward_time_s") > 0


def test_fewer_than_expected_passes_with_a_note():
    ctx, _, f = run(compile_suite(expected_graph_breaks={"float32": 3}, expected_recompiles=5, prompt_lens=[8],
                                    decode_step=False, **EAGER))
    assert f is None, str(f)
    assert any("lower [checks.compile] expected_graph_breaks for float32 to 0" in n for n in ctx.notes), ctx.notes
    assert any("expected_recompiles for float32 to" in n for n in ctx.notes), ctx.notes


def _item_in_layer(model):
    """A model change that breaks the graph: layer 1's MLP reads a value back to Python."""
    mlp = model.model.layers[1].mlp
    forward = mlp.forward

    def with_item(x):
        if x.abs().amax().item() > 1e9:  # the graph break: Tensor.item() in the compiled region
            x = x * 0
        return forward(x)

    mlp.forward = with_item
    return model


def test_added_graph_break_fails_naming_reason_and_line():
    ctx, _, f = run(compile_suite(prompt_lens=[], decode_step=False, **EAGER), transform=_item_in_layer)
    assert isinstance(f, CheckFailure), f
    line = str(f).splitlines()[0]
    assert line.startswith("8 graph break(s), 0 expected: Unsupported Tensor.item() call"), line
    assert f"{os.path.relpath(__file__)}:" in line and "in with_item" in line, line  # the user frame
    assert metric(ctx, "compile_graph_breaks") == 8


def _branch_on_length(model):
    """A model change that recompiles: layer 0's MLP branches on the sequence length in Python."""
    mlp = model.model.layers[0].mlp
    forward = mlp.forward

    def branching(x):
        return forward(x) * 1.0 if x.shape[1] > 10 else forward(x)

    mlp.forward = branching
    return model


def test_shape_that_recompiles_is_named():
    ctx, _, f = run(compile_suite(**EAGER), transform=_branch_on_length)
    assert isinstance(f, CheckFailure), f
    line = str(f).splitlines()[0]
    want = suite(NAME).suite.checks.compile.expected_recompiles
    assert line.startswith(f"{want + 1} recompile(s), {want} expected: the prompt length 12 recompiled"), line
    assert "size()[1] <= 10" in line, line  # dynamo's guard-failure reason
    assert metric(ctx, "compile_recompiles") == want + 1


@contextlib.contextmanager
def wrong_decomposition(op, fn):
    """A lowering fault in the compiled path only: inductor's decomposition of ``op`` replaced by
    ``fn`` (eager never reads the table). The compile caches are off, so no clean artifact is served."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config
    from torch._inductor import decomposition as d

    tables = [d.decompositions, d.fast_random_decomps()]
    saved = [t.get(op) for t in tables]
    for t in tables:
        t[op] = fn
    try:
        with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
            yield
    finally:
        for t, sv in zip(tables, saved, strict=True):
            if sv is None:
                t.pop(op, None)
            else:
                t[op] = sv


def wrong_silu_decomposition():
    """aten.silu's decomposition 0.1% high."""
    return wrong_decomposition(torch.ops.aten.silu.default, lambda x: x / (1 + x.neg().exp()) * (1 + 2.0**-10))


def test_lowering_fault_fails_compiled_localized_while_eager_passes(tmp_path):
    ctx, _, f = run(compile_suite(backend="aot_eager_decomp_partition", gradients=False), context=wrong_silu_decomposition)
    assert isinstance(f, CheckFailure), f
    line = str(f).splitlines()[0]
    assert line.startswith("model.layers.0.mlp.act_fn compiled alone diverges from eager"), line
    assert "compiled logits diverge from the golden" in line, line
    assert metric(ctx, "compile_logits_budget_use") > 1
    # the same fault leaves the eager path alone: the precision check passes with it
    _, pf = run_check(NAME, "float32", tmp_path, context=wrong_silu_decomposition)
    assert pf is None, str(pf)


def test_a_region_that_raises_compiled_alone_is_passed_over_and_the_finding_kept():
    """The bisection is a diagnostic of a finding already made (the compiled logits diverge): a region
    whose compile alone raises (its own graph inputs and guards, paths the whole-model compile did not
    take; here layer 0's ``compile``) is said in the bisection's detail and passed over. It ended the item
    on that error in step ``bisect`` before, the divergence unsaid. The silu fault is in every layer:
    layer 1 is where it is found now."""
    def layer0_raises(model):
        def compile_(**kw):
            raise RuntimeError("vendor layer: no graph of its own")

        model.get_submodule("model.layers.0").compile = compile_
        return model

    ctx, _, f = run(compile_suite(backend="aot_eager_decomp_partition", gradients=False), transform=layer0_raises,
                    context=wrong_silu_decomposition)
    assert isinstance(f, CheckFailure), f
    line = str(f).splitlines()[0]
    assert line.startswith("model.layers.1.mlp.act_fn compiled alone diverges from eager"), line
    said = dict(ctx.properties)["harness.detail.compile_bisection"]
    assert "  model.layers.0: raised compiled alone (RuntimeError: vendor layer: no graph of its own): passed over" in said


def wrong_silu_backward_decomposition():
    """The compiled backward only: aten.silu_backward's decomposition 5% high (forward and eager untouched)."""
    def silu_backward(grad, x):
        s = torch.sigmoid(x)
        return grad * s * (1 + x * (1 - s)) * 1.05

    return wrong_decomposition(torch.ops.aten.silu_backward.default, silu_backward)


def test_compiled_backward_fault_fails_naming_the_parameter_while_forward_and_eager_pass():
    ctx, _, f = run(compile_suite(backend="aot_eager_decomp_partition", prompt_lens=[], decode_step=False),
                    context=wrong_silu_backward_decomposition)
    assert isinstance(f, CheckFailure), f
    line = str(f).splitlines()[0]
    assert line.startswith("compiled backward diverges from the golden: gradient of model.layers.1.mlp."), line  # where met first
    assert "while eager's agrees" in line, line
    assert metric(ctx, "compile_logits_budget_use") < 1  # the compiled forward is right
    assert metric(ctx, "compile_grad_worst_budget_use") > 1 > metric(ctx, "compile_grad_vs_eager_worst_budget_use")


def test_frontend_item_runs_the_compilers_front_end_and_catches_its_faults():
    """A suite whose code generation is nightly (what `harness init` writes for a new config): its
    commit item compiles through inductor's front end only (dynamo, AOTAutograd, inductor's
    decompositions), forward and backward; a decomposition fault in the backward fails it, named."""
    ls = compile_suite(codegen_scope="nightly", prompt_lens=[], decode_step=False)
    check = registry().get("compile")
    assert check.variants(ls, get("cpu")) == ["frontend", None, "speed"]
    assert [check.scope(ls, v) for v in ("frontend", None, "speed")] == ["commit", "nightly", "nightly"]
    assert check.variants(suite(NAME), get("cpu")) == [None, "speed"]  # the bundled suites: code generation on commit
    ctx, _, f = run(ls, variant="frontend")
    assert f is None, str(f)
    assert dict(ctx.properties)["harness.detail.compile_backend"].startswith(
        "aot_eager_decomp_partition: front end of inductor: dynamo, AOTAutograd"), ctx.properties
    assert 0 < metric(ctx, "compile_logits_budget_use") < 1 and 0 < metric(ctx, "compile_grad_worst_budget_use") < 1
    ctx, _, f = run(ls, variant="frontend", context=wrong_silu_backward_decomposition)
    assert isinstance(f, CheckFailure), f
    assert str(f).startswith("compiled backward diverges from the golden: gradient of model.layers.1.mlp."), str(f)


def test_backend_without_compiler_is_not_applicable(tmp_path, monkeypatch):
    from harness.backends import registry as backends

    cfg = tmp_path / "harness.toml"  # compile_backend from a [[backends]] table
    cfg.write_text('[[backends]]\nname = "nocompile"\ndevice_type = "cpu"\ncompile_backend = "none"\n')
    monkeypatch.setenv("HARNESS_CONFIG", str(cfg))
    none = backends().get("nocompile")
    assert none.compile_backend == "none"
    _, _, f = run(suite(NAME), backend=none)
    assert isinstance(f, NotApplicable) and "declares no compiler" in str(f), f
    _, _, f = run(compile_suite(backend="no-such-compiler"))
    assert isinstance(f, NotApplicable) and "no torch.compile backend 'no-such-compiler'" in str(f), f
    vendor = Backend("vendor", "cpu", "gloo", compile_backend="no-such-graph-mode")  # the backend's own
    _, _, f = run(suite(NAME), backend=vendor)
    assert isinstance(f, NotApplicable) and "'no-such-graph-mode'" in str(f), f
    # the front-end item of either: no compiler, no front end either
    nightly = compile_suite(codegen_scope="nightly")
    _, _, f = run(nightly, backend=none, variant="frontend")
    assert isinstance(f, NotApplicable) and "declares no compiler" in str(f), f
    _, _, f = run(nightly, backend=vendor, variant="frontend")
    assert isinstance(f, NotApplicable) and "'no-such-graph-mode'" in str(f), f


def test_table_is_strict():
    with pytest.raises(ValueError, match="keys must be dtypes"):
        CompileConfig(expected_graph_breaks={"float33": 1})
    with pytest.raises(ValueError, match="valid integer"):
        CompileConfig(expected_recompiles="2")


def test_a_suite_without_committed_counts_records_them_and_passes_with_a_note():
    """A suite `harness init` just wrote has no [checks.compile] counts: the breaks and recompiles are
    measured and said, not judged against a 0 nobody chose (the Day-0 pipeline stays green)."""
    ls = compile_suite(expected_graph_breaks=None, expected_recompiles=None, prompt_lens=[], decode_step=False,
                       bisect=False, **EAGER)
    ctx, _, f = run(ls)
    assert f is None, str(f)
    notes = " ".join(ctx.notes)
    assert "0 graph break(s) measured, no expectation committed: add `expected_graph_breaks = 0`" in notes, notes
    assert "0 recompile(s) measured, no expectation committed: add `expected_recompiles = 0`" in notes, notes
    assert metric(ctx, "compile_graph_breaks") == 0


# --- MoE routing: a near-tie flip in the compiled graph is no compiler fault ----------------------
MOE = "qwen3-30b-a3b"


def flip_compiled_routing(model):
    """A routing difference in the compiled graph only: while dynamo traces a router, token 0 is sent
    to the next experts (what a compiled attention's different rounding does to a near-tie router in
    bfloat16, made certain). Eager runs, and routers forced to the golden's choices (run eagerly),
    are untouched."""
    from harness.anatomy.moe import is_router

    for name, mod in model.named_modules():
        if is_router(name):
            def forward(hidden, _orig=mod.forward, _n=mod.weight.shape[0]):
                logits, scores, idx = _orig(hidden)
                if torch.compiler.is_compiling():
                    idx = torch.cat([(idx[:1] + 1) % _n, idx[1:]])
                return logits, scores, idx

            mod.forward = forward
    return model


def test_moe_routing_flip_in_the_compiled_graph_is_judged_with_the_goldens_routing(monkeypatch):
    from harness.golden.store import Golden, load_golden

    ls = compile_suite(MOE, backend="aot_eager", gradients=False, prompt_lens=[], decode_step=False)
    forced = load_golden(ls).budgets("float32")["propagated"]["logits_forced"]["budget"]
    ctx, _, f = run(ls, transform=flip_compiled_routing)
    assert f is None, str(f)
    detail = dict(ctx.properties)["harness.detail.compile_routing"]
    # the model's own (flipped) routing diverged; forced to the golden's, compiled agrees
    assert "with the model's own routing: compiled logits diverge" in detail, detail
    assert metric(ctx, "compile_logits_budget_use") < 1
    assert any("MoE routing forced to the golden's" in n for n in ctx.notes)
    # the bounds applied, once each: the golden's budget measured with the routers forced
    tol = [float(v) for k, v in ctx.properties if k == "tolerance.compile_logits_rel_rmse"]
    assert tol == [pytest.approx(forced, rel=1e-3)], (tol, forced)
    assert float(dict(ctx.properties)["tolerance.compile_vs_eager_rel_rmse"]) == pytest.approx(forced, rel=1e-3)

    # a golden made before the forced measurement (no ``logits_forced``): compiled vs golden is held
    # to the forced eager model's distance + the compiled-vs-eager budget, and the note says why
    orig = Golden.budgets

    def without_forced(self, dtype):
        b = orig(self, dtype)
        return {**b, "propagated": {k: v for k, v in b["propagated"].items() if k != "logits_forced"}}

    monkeypatch.setattr(Golden, "budgets", without_forced)
    ctx, _, f = run(ls, transform=flip_compiled_routing)
    assert f is None, str(f)
    tol = [float(v) for k, v in ctx.properties if k == "tolerance.compile_logits_rel_rmse"]
    assert len(tol) == 1 and tol[0] > float(dict(ctx.properties)["tolerance.compile_vs_eager_rel_rmse"]), tol
    assert any("no logits budget measured with the routers forced" in n for n in ctx.notes), ctx.notes


def test_moe_compiled_fault_still_fails_with_the_goldens_routing():
    ls = compile_suite(MOE, backend="aot_eager_decomp_partition", gradients=False, prompt_lens=[],
                       decode_step=False, bisect=False)
    ctx, _, f = run(ls, transform=flip_compiled_routing, context=wrong_silu_decomposition)
    assert isinstance(f, CheckFailure), f
    assert "compile_routing" in str(dict(ctx.properties)), "judged again with the golden's routing"
    assert metric(ctx, "compile_logits_budget_use") > 1  # the forced run: the fault, not the flip


# --- the recompile sweep's shortcut backend failing is no verdict ---------------------------------
def _no_length_1(gm, example_inputs):
    """A dynamo backend without a kernel for a length-1 sequence (the ids [batch, 1] of a decode step)."""
    if any(isinstance(t, torch.Tensor) and t.dim() == 2 and not t.is_floating_point() and t.shape[1] == 1
           for t in example_inputs):
        raise RuntimeError("no kernel for a length-1 sequence")
    return gm.forward


@pytest.fixture(scope="module")
def no_length_1():
    import torch._dynamo

    name = "harness_test_no_length_1"
    if name not in torch._dynamo.list_backends(exclude_tags=()):
        torch._dynamo.register_backend(_no_length_1, name=name)
    return name


def test_sweep_backend_raising_at_a_shape_falls_back_and_says_so(no_length_1):
    ctx, _, f = run(compile_suite(backend="eager", sweep_backend=no_length_1, gradients=False, prompt_lens=[8]))
    assert f is None, str(f)
    props = dict(ctx.properties)
    assert props["harness.detail.compile_sweep_fallback"].startswith(
        f"{no_length_1} raised at the decode step (length 1): "), props["harness.detail.compile_sweep_fallback"]
    assert props["harness.detail.compile_sweep"].startswith("eager "), props["harness.detail.compile_sweep"]


def test_compiler_under_test_raising_at_a_shape_fails_naming_it(no_length_1):
    ctx, _, f = run(compile_suite(backend=no_length_1, sweep_backend="", gradients=False, prompt_lens=[8]))
    assert isinstance(f, CheckFailure), f
    assert str(f).startswith(f"the compiled model ({no_length_1}) raised at the decode step (length 1): "), str(f)


def test_moe_fault_under_the_unforced_cap_is_caught_by_the_forced_budget(monkeypatch):
    """mixtral-8x7b in bfloat16, its golden's draws routed otherwise than the bfloat16 model (near-tie flips):
    the unforced logits budget is then at the tolerance's cap (0.04; measured so on this suite at the
    pruned head_dim 16, whose draws flipped), while the same draws with the routers forced measure ~0.02
    (golden generate's ``logits_forced``). A compiled fault (silu 80 % high) that moves the logits by 0.03
    hides under the cap and is caught under the forced budget; the clean model passes it. At the published
    head_dim the suite's draws no longer flip (unforced 0.0207, forced 0.0193): the golden's unforced budget
    is set to the cap here, as a golden whose draws flipped has it. (At head_dim 16 silu 20 % high moved the
    logits 0.03; at 128 it moves them 0.014, 80 % high 0.030.)"""
    from harness.golden.store import Golden, load_golden

    orig = Golden.budgets

    def flipped(self, dtype):
        b = orig(self, dtype)
        if dtype != "bfloat16":
            return b
        prop = b["propagated"]
        return {**b, "propagated": {**prop, "logits": {**prop["logits"], "budget": 0.04}}}

    monkeypatch.setattr(Golden, "budgets", flipped)
    bud = load_golden(suite("mixtral-8x7b")).budgets("bfloat16")["propagated"]
    assert bud["logits"]["budget"] == 0.04 and bud["logits_forced"]["budget"] < 0.025, bud

    def silu_80_percent_high():
        return wrong_decomposition(torch.ops.aten.silu.default, lambda x: x / (1 + x.neg().exp()) * 1.8)

    ls = compile_suite("mixtral-8x7b", backend="aot_eager_decomp_partition", gradients=False, prompt_lens=[],
                       decode_step=False, bisect=False)
    ctx, _, f = run(ls, dtype="bfloat16")
    assert f is None, str(f)
    assert metric(ctx, "compile_logits_budget_use") < 1
    ctx, _, f = run(ls, dtype="bfloat16", context=silu_80_percent_high)
    assert isinstance(f, CheckFailure), f
    assert "compiled logits diverge" in str(f).splitlines()[0], str(f)
    observed = metric(ctx, "compile_logits_rel_rmse")
    assert bud["logits_forced"]["budget"] < observed < bud["logits"]["budget"], observed  # the cap would pass it
    assert float(dict(ctx.properties)["tolerance.compile_logits_rel_rmse"]) == pytest.approx(
        bud["logits_forced"]["budget"], rel=1e-3)


def _compiled_only_scale(path: str, factor: float = 1.01):
    """A compiled-only error: while dynamo traces ``path``'s forward its output is scaled by ``factor``
    (a fused normalization kernel 1 % high); eager is exact."""
    def transform(model):
        mod = model.get_submodule(path)

        def forward(x, _orig=mod.forward):
            out = _orig(x)
            return out * factor if torch.compiler.is_compiling() else out

        mod.forward = forward
        return model
    return transform


def test_a_one_signed_compiled_error_inside_the_magnitude_budget_fails_with_its_module_named():
    """Issue #51: a compiled normalization 1 % high in bfloat16 stays inside the logits budget (budget
    use 0.77), judged by size alone it passed on 5 of 6 suites. Every position's logits are scaled the
    same way: the sign test over positions fails it, and the bisection, judging by direction, names
    the module. Clean, the bundled suites' compile items sit at p >= 0.2 (tests/precision/test_signed.py)."""
    ls = compile_suite(NAME, backend="aot_eager", gradients=False, prompt_lens=[], decode_step=False)
    ctx, _, f = run(ls, dtype="bfloat16", transform=_compiled_only_scale("model.norm"))
    assert isinstance(f, CheckFailure), f
    line = str(f).splitlines()[0]
    assert line.startswith("model.norm compiled alone gives it"), line
    assert "one-signed scale error: 32 of 32 positions scaled the same way, mean +0.9" in line, line
    assert metric(ctx, "compile_logits_budget_use") < 1 and metric(ctx, "compile_signed_min_p") < 1e-8
    ctx, _, f = run(ls, dtype="bfloat16")
    assert f is None, str(f)
    assert metric(ctx, "compile_signed_min_p") > 1e-3
