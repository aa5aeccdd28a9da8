"""The sign tests of the compile check's gradients and loss against eager (issue #51 item 1) on
tensors: what a parameter gradient looks like (rows of absent tokens 0, a norm's vector), what the
LM loss reads of the logits, and the Bonferroni limit over a family."""

from __future__ import annotations

import math

import torch

from harness.compiler import gradients as grd
from harness.compiler import numerics as num
from harness.precision import signed


def _g(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_gradient_scale_is_one_signed_over_rows_zero_rows_left_out():
    """An embedding-like gradient (most rows 0: tokens absent) scaled 1 % fails as 'scale' over the rows
    that vary, the effect read on those rows only; noise of the same size without a direction does not."""
    ref = torch.zeros(512, 64, dtype=torch.float64)
    ref[:40] = torch.randn(40, 64, generator=_g(), dtype=torch.float64)
    noise = torch.randn(ref.shape, generator=_g(1), dtype=torch.float64) * 3e-3 * (ref != 0)
    tests = signed.tensor_tests(ref * 1.01 + noise, ref)
    assert {t.kind for t in tests} == {"scale", "offset"} and all(t.unit == "rows" for t in tests)
    bad = signed.failing(tests, "bfloat16", 2)
    assert bad.kind == "scale" and bad.same_sign == bad.rows == 40 and math.isclose(bad.effect, 0.01, rel_tol=0.05)
    assert "40 of 40 rows scaled the same way, mean +0.99%" in bad.words()
    assert signed.failing(signed.tensor_tests(ref + noise, ref), "bfloat16", 2) is None
    # Bonferroni over the family: the same test is judged against ALPHA / tests made
    assert signed.failing(tests, "bfloat16", int(1 / bad.p)) is None


def test_vector_gradient_elements_are_the_rows():
    """A norm's weight gradient [H]: each nonzero element a row, its scale's sign that of (g - r) x r,
    the effect the vector's least-squares slope."""
    ref = torch.randn(128, generator=_g(2), dtype=torch.float64)
    noise = torch.randn(128, generator=_g(3), dtype=torch.float64) * 1e-3
    bad = signed.failing(signed.tensor_tests(ref * 0.99 + noise, ref), "bfloat16", 2)
    assert bad.kind == "scale" and bad.rows == 128 and math.isclose(bad.effect, -0.01, rel_tol=0.05)
    assert signed.failing(signed.tensor_tests(ref + noise, ref), "bfloat16", 2) is None


def test_nothing_to_test_gives_no_tests():
    """An unrouted expert's gradient (all 0), a non-finite one (it fails on its size), a mismatch."""
    z = torch.zeros(8, 16)
    assert signed.tensor_tests(z, z) == []
    x = torch.randn(8, 16, generator=_g(4))
    assert signed.tensor_tests(x.clone().fill_(math.nan), x) == []
    assert signed.tensor_tests(x[:4], x) == []


def test_bonferroni_over_every_parameter_and_the_lead_in_backward_order():
    """One parameter one-signed among many: judged at ALPHA / all tests made, named with its module
    (the innermost of the golden's backward order holding it) first."""
    ref = {f"m.{i}.w": torch.randn(64, 32, generator=_g(i), dtype=torch.float64) for i in range(6)}
    got = {n: r + torch.randn(r.shape, generator=_g(10 + i), dtype=torch.float64) * 1e-3
           for i, (n, r) in enumerate(ref.items())}
    got["m.3.w"] = ref["m.3.w"] * 1.01
    ref_ = grd.BackwardReference({}, {}, ["m.5", "m.3", "m.0"], {}, {}, torch.zeros(1), {}, list(ref))
    tests = grd.signed_tests(ref_, got, ref)
    rows = [grd.GradRow(n, 0.01, 0.0, 0.05) for n in ref]
    bad = grd.one_signed(tests, rows, "bfloat16")
    assert [b.name for b in bad] == ["m.3.w"] and math.isclose(bad[0].use, 0.2)
    message, fields = grd.signed_failure(bad, tests, "bfloat16", ref_.order)
    assert message.startswith("m.3: compiled backward against eager: gradient of m.3.w: one-signed scale error: "
                              "64 of 64 rows"), message
    assert "inside the magnitude budget (0.2 of it)" in message
    assert fields["tolerance"] == signed.ALPHA / 12
    figs = grd.signed_figures(tests)
    assert figs["compile_grad_signed_min_p"] == bad[0].test.p and figs["compile_grad_signed_max_effect"] > 0.009


def test_loss_one_signed_where_the_logits_offset_is_diluted():
    """The label's logit 0.05 low at every position (a compiled log-softmax or loss kernel biased
    against the target): each row's offset is 0.05 / vocab, under bfloat16's floor, and its scale has
    no direction, so the logits' tests pass; every token's loss is higher: the loss's test fails."""
    ids = torch.randint(0, 512, (2, 16), generator=_g(5))
    eager = torch.randn(2, 16, 512, generator=_g(6), dtype=torch.float64)
    got = eager.clone()
    nxt = ids[:, 1:]
    got[:, :-1].scatter_(-1, nxt.unsqueeze(-1), got[:, :-1].gather(-1, nxt.unsqueeze(-1)) - 0.05)
    assert signed.one_signed(got, eager, "bfloat16")[0] is None
    t = num.loss_signed(ids, got, eager)
    assert t.kind == "loss" and t.same_sign == t.rows == 30 and t.effect > signed.COMPILE_FLOORS["bfloat16"]
    assert signed.failing([t], "bfloat16", 1) is t and "30 of 30 tokens moved the same way" in t.words()
    clean = num.loss_signed(ids, eager + torch.randn(eager.shape, generator=_g(7), dtype=torch.float64) * 1e-3, eager)
    assert signed.failing([clean], "bfloat16", 1) is None
    assert num.loss_signed(ids, got.clone().fill_(math.inf), eager) is None


def test_thousands_of_rows():
    """An MoE's fused experts' gradient [E, out, in] has thousands of rows: the sign test's p past 1023
    rows (where 2.0 ** n overflows a float: mixtral-8x7b's compile items raised OverflowError) is
    computed in logs and matches the exact sum."""
    ref = torch.randn(8, 256, 16, generator=_g(8), dtype=torch.float64)
    bad = signed.failing(signed.tensor_tests(ref * 1.01, ref), "bfloat16", 2)
    assert bad.rows == 2048 and bad.p < 1e-300
    exact = 2 * sum(math.comb(1500, i) for i in range(790, 1501)) / (1 << 1500)
    assert math.isclose(signed.sign_p(790, 1500), exact, rel_tol=1e-9)


def _one(compiled: torch.Tensor, eager: torch.Tensor, name: str = "w") -> list[grd.SignedRow]:
    tests = signed.tensor_tests(compiled, eager)
    return [grd.SignedRow(name, signed.failing(tests, "bfloat16", 2, signed.GRAD_FLOORS), None)]


def test_a_compiled_gradient_closer_than_eagers_to_the_float32_backward_is_eagers_rounding_not_a_fault():
    """Eager one-signed against the float32 backward by -1 % (a shared factor rounded in bfloat16), the
    compiled gradient at -0.6 %: compiled against eager is +0.4 %, over the floor, but it is the closer to
    the truth: explained. A compiled-only fault moves it away from the truth (+1 % with eager exact, or
    -0.4 % more where eager is -1 %), or past it by more than eager's error (+4 % over an eager at -1 %):
    still failing."""
    truth = torch.randn(128, 64, generator=_g(7), dtype=torch.float64)
    noise = torch.randn(truth.shape, generator=_g(8), dtype=torch.float64) * 2e-3
    eager = truth * 0.99 + noise
    compiled = truth * 0.994 + noise
    one = _one(compiled, eager)
    assert one[0].test is not None and one[0].test.effect > 2 ** -9
    failing, explained = grd.toward_truth(one, {"w": compiled}, {"w": eager}, {"w": truth})
    assert failing == [] and explained[0].eager.effect < -0.009
    text = grd.toward_truth_text(explained)
    assert "closer than eager's to the same weights' float32 backward" in text and "eager against float32 -1.00%" in text
    assert "compiled against float32 -0.60%" in text
    # eager exact, compiled 1 % high: away from the truth
    exact = truth + noise
    failing, explained = grd.toward_truth(_one(exact * 1.01, exact), {"w": exact * 1.01}, {"w": exact}, {"w": truth})
    assert explained == [] and len(failing) == 1
    # eager 1 % low, compiled 4 % over it: toward the truth, but far past it
    failing, explained = grd.toward_truth(_one(eager * 1.04, eager), {"w": eager * 1.04}, {"w": eager}, {"w": truth})
    assert explained == [] and len(failing) == 1
    # the same direction as eager's own error: away
    failing, explained = grd.toward_truth(_one(eager * 0.996, eager), {"w": eager * 0.996}, {"w": eager}, {"w": truth})
    assert explained == [] and len(failing) == 1


def test_the_gradients_step_tells_the_forced_routers_breaks_from_the_models():
    """Dynamo's own break reasons (a real compile): a function carrying the forced router's name is the
    check's break by design and only said; a function kept out of the graph otherwise, beyond the
    forward's own breaks, gets a note that its compiled backward was not compared."""
    from harness.compiler import dynamo as dyn
    from harness.precision.routing import FORCED_MARK

    def router(x):
        return x * 2

    def vendor_kernel(x):
        return x + 1

    router.__name__ = router.__qualname__ = f"{FORCED_MARK}[model.layers.0.mlp.gate]"
    router, vendor_kernel = torch.compiler.disable(router), torch.compiler.disable(vendor_kernel)

    def f(x):
        return vendor_kernel(router(x).sin()).cos()

    with dyn.fresh():
        before = dyn.break_reasons()
        torch.compile(f, backend="eager")(torch.randn(4))
        breaks = dyn.break_reasons() - before
    detail, note = grd.graph_breaks(breaks, forward_breaks=0)
    assert detail.startswith("2 graph break(s) in the compiled forward and backward: 1 at the 1 forced router(s) "
                             "(kept out of the graph by design: their backward is eager's), 1 elsewhere (1 x Skip "
                             "calling `torch.compiler.disable()`d function ("), detail
    assert "vendor_kernel" in detail and note.startswith("compile: the gradients step's compile broke the graph 1 "
                                                         "time(s) outside the forced routers, the forward's compile 0"), note
    assert grd.graph_breaks(breaks, forward_breaks=1)[1] is None  # the forward broke there too: the breaks step's
    assert grd.graph_breaks(type(breaks)(), forward_breaks=0) == (None, None)
