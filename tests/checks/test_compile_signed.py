"""Issue #51 item 1, the compile check's loss and gradients: a compiled-only backward error of 1 % in
bfloat16 stays far inside the gradients' magnitude budget (grad_k x the training check's, measured on
eager draws), but it scales every row of the gradients it reaches the same way. The compiled backward's
gradients are judged against eager's (same backend and dtype: the clean run) by a sign test over rows
too, and the module is named first.

The fault runs in the compiled path only: an autograd Function that dynamo traces into the compiled
graph (``torch.compiler.is_compiling()``) and whose backward scales the gradient it passes on; eager
never applies it. ``aot_eager`` compiles it (dynamo and AOTAutograd's joint graph, no C++ build), so
the two items take ~15 s cold."""

from __future__ import annotations

import torch
from checks.test_compile import compile_suite, metric, run

NAME = "llama-3.1-8b"


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the backward passes ``factor`` x the gradient (a backward kernel 1 % high), only
    a gradient of dtype ``only`` where one is given."""

    @staticmethod
    def forward(ctx, x, factor, only=None):
        ctx.factor, ctx.only = factor, only
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return (grad * ctx.factor if ctx.only in (None, grad.dtype) else grad), None, None


def _backward_scale(path: str, factor: float, compiled: bool = True, only=None):
    """``path``'s output through _ScaleGrad in one path only: the compiled one (while dynamo traces it:
    the compiled backward scales the gradient flowing into the module by ``factor``, the forward and eager
    exact), or eager's (``compiled`` False; ``only``: a gradient of that dtype alone)."""
    def transform(model):
        mod = model.get_submodule(path)

        def forward(*args, _orig=mod.forward, **kw):
            out = _orig(*args, **kw)
            return _ScaleGrad.apply(out, factor, only) if torch.compiler.is_compiling() == compiled else out

        mod.forward = forward
        return model
    return transform


def _compiled_only_backward_scale(path: str, factor: float = 1.01):
    return _backward_scale(path, factor)


def test_a_one_signed_compiled_backward_error_inside_the_budget_fails_naming_the_module():
    """The MLP of layer 1 gets a gradient 1 % high in the compiled backward only: its parameters'
    gradients use ~0.3 of their magnitude budget (and the forward is exact), so by size alone the item
    passed. Every row of those gradients is scaled up: the sign test names the MLP, at the parameter met
    first walking backward (down_proj). Clean, the same item passes: its one-signed rounding stays under
    the effect floor."""
    ls = compile_suite(NAME, backend="aot_eager", prompt_lens=[], decode_step=False)
    ctx, _, f = run(ls, dtype="bfloat16", transform=_compiled_only_backward_scale("model.layers.1.mlp"))
    assert f is not None, "a one-signed compiled backward error passed"
    line = str(f).splitlines()[0]
    assert line.startswith("model.layers.1.mlp: compiled backward against eager: gradient of "
                           "model.layers.1.mlp.down_proj.weight: one-signed scale error: 128 of 128 rows scaled "
                           "the same way, mean +0.9"), line
    assert "inside the magnitude budget" in line, line
    assert 0 < metric(ctx, "compile_grad_worst_budget_use") < 0.5  # the size alone passes it
    assert metric(ctx, "compile_logits_budget_use") < 1 and metric(ctx, "compile_signed_min_p") > 1e-3  # forward right
    assert metric(ctx, "compile_grad_signed_min_p") < 1e-30
    assert abs(metric(ctx, "compile_grad_signed_max_effect") - 0.01) < 1e-3
    assert f.metric == "compile_grad_signed_min_p" and "model.layers.1.mlp.gate_proj.weight" in f.details

    ctx, _, f = run(ls, dtype="bfloat16")
    assert f is None, str(f)
    # measured clean (this item, deterministic on CPU): at the published head_dim (128) the compiled
    # backward's own bf16 rounding is one-signed against eager's on some gradient (smallest p 2e-38; at the
    # pruned 16 it was 2.6e-4), so the p-value alone cannot separate it: the effect floor does. The clean
    # run's largest significant effect is 0.00114, 0.58 of the bf16 gradient floor (2^-9); the fault's 0.01
    # is 5x the floor
    from harness.precision.signed import GRAD_FLOORS

    assert metric(ctx, "compile_grad_signed_max_effect") < 0.75 * GRAD_FLOORS["bfloat16"]
    assert metric(ctx, "compile_loss_signed_p") > 1e-3  # the loss's test is made and recorded


def _eager_only_bf16_scale(path: str, factor: float = 0.99):
    """Eager's bfloat16 backward into ``path`` scaled by ``factor``: a shared factor eager rounds one way in
    bfloat16, which the compiled graph (and the same weights in float32) do not."""
    return _backward_scale(path, factor, compiled=False, only=torch.bfloat16)


def test_a_compiled_gradient_closer_to_float32_than_eagers_passes_and_says_why():
    """Eager's bfloat16 backward into layer 1's MLP 1 % low, compiled exact (Llama-4-Scout's clean items,
    bfloat16, measured: eager's attention gradients -0.9 to -1.2 % against float32, compiled -0.6 to -0.8 %):
    compiled against eager is one-signed at +1 %, the planted fault's size, but it is the closer to the same
    weights' float32 backward. The item passes and says so; the fault above, compiled 1 % high with eager
    exact, still fails (it moves away from the float32 backward). The norm's weight (a vector of 119 rows
    that vary) reads eager against float32 at p=5.9e-5: until 2026-12-07 the limit was ALPHA / the gradients
    asked about (2e-5 for 5) and this item failed on it ("model.layers.1.post_attention_layernorm: ... 99 of
    119 rows ... +1.10%"); the plant was 2 % to pass (gradients.toward_truth)."""
    ls = compile_suite(NAME, backend="aot_eager", prompt_lens=[], decode_step=False)
    ctx, _, f = run(ls, dtype="bfloat16", transform=_eager_only_bf16_scale("model.layers.1.mlp"))
    assert f is None, str(f)
    assert metric(ctx, "compile_grad_signed_min_p") < 1e-30 and metric(ctx, "compile_grad_signed_max_effect") > 0.0095
    said = dict(ctx.properties)["harness.detail.compile_grad_toward_float32"]
    assert said.startswith("4 parameter gradient(s) one-signed against eager, each closer than eager's to the "
                           "same weights' float32 backward (first model.layers.1."), said
    assert any("not a compiler fault" in n for n in ctx.notes)


def test_a_compiled_only_fault_in_a_patched_moe_module_is_compiled_with_the_routers_forced():
    """qwen3-30b-a3b, bfloat16: the gradients step forces the routers to the golden's choices and keeps
    them (alone) out of the compiled graph. Until 2026-12-07 it kept *every* module with an instance
    forward out too: a forward patched on an instance (a vendor's kernel swap; here the planted fault)
    ran eagerly there, so its compiled backward was never compared, and this item passed (Llama-4-Scout:
    the same fault in the shared expert, traced 0 times by the compiled step). Now the fault is in the
    graph and named, and the step says which of its graph breaks are the routers'."""
    ls = compile_suite("qwen3-30b-a3b", backend="aot_eager", prompt_lens=[], decode_step=False)
    ctx, _, f = run(ls, dtype="bfloat16", transform=_compiled_only_backward_scale("model.layers.1.mlp.experts"))
    assert f is not None, "a compiled-only backward fault in a patched MoE module passed"
    line = str(f).splitlines()[0]
    assert line.startswith("model.layers.1.mlp.experts: compiled backward against eager: gradient of "
                           "model.layers.1.mlp.experts."), line
    said = dict(ctx.properties)["harness.detail.compile_grad_graph_breaks"]
    # every break the routers' (qwen3-30b-a3b's pruned model: one router per layer, both MoE)
    assert " at the 2 forced router(s) (kept out of the graph by design" in said and "elsewhere" not in said, said
    assert not any("outside the forced routers" in n for n in ctx.notes), ctx.notes


def test_a_model_without_a_float32_path_keeps_its_finding_and_says_why_it_was_not_explained():
    """The float32 backward is harness's own diagnostic: a model that runs in its dtype only (a vendor's
    kernel without float32, here layer 0's MLP refusing float32 input) keeps the one-signed finding it
    had, with a note saying why it was not explained - not an error from the diagnostic."""
    ls = compile_suite(NAME, backend="aot_eager", prompt_lens=[], decode_step=False)
    eager_low = _eager_only_bf16_scale("model.layers.1.mlp")

    def bf16_only(model):
        mod = eager_low(model).get_submodule("model.layers.0.mlp")

        def forward(x, _orig=mod.forward):
            if x.dtype == torch.float32:
                raise RuntimeError("vendor_mlp: float32 is not supported")
            return _orig(x)

        mod.forward = forward
        return model

    ctx, _, f = run(ls, dtype="bfloat16", transform=bf16_only)
    assert f is not None and str(f).startswith("model.layers.1."), f
    assert "one-signed scale error" in str(f).splitlines()[0], f
    assert any(n.startswith("compile: the same weights' float32 backward (to tell eager's own rounding from the "
                            "compiler's) could not run: RuntimeError: vendor_mlp: float32 is not supported")
               for n in ctx.notes), ctx.notes
