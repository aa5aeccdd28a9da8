"""Pruned-model smoke check: does the model load, run forward and backward, and learn?

Per suite x backend x dtype, on the pruned model with seeded weights and seeded tokens [B, S],
as named steps (``SmokeCheck.steps``), each over calls of harness/models/probe.py (what a step runs
and where the model goes wrong) whose figures the step records and whose failure it raises:

``build``        the pruned model on the device (setup: a failure here is "could not run");
``forward``      logits [B, S, vocab] and finite (else: name the first module whose output is not);
``backward``     a finite gradient on every trainable parameter (``no_grad_ok`` globs excepted);
``train``        ``steps`` AdamW steps on the same batch lower the loss;
``determinism``  a second build + forward gives bit-identical logits (enforced on CPU, recorded elsewhere);
``generate``     greedy generation with the KV cache equals generation without it, except at near ties,
                 and each step's logits agree under the dtype's precision tolerance (rel_rmse).

Variant ``wrapper`` (``[checks.smoke] wrapper = true``, which ``harness init`` writes for multimodal
wrapper configs): the same steps on the wrapper end to end (harness/models/wrapper.py): the suite's
text pruning, a tiny vision tower and projector, and one seeded synthetic image per sequence laid out
as the model's processor lays it out. ``build`` says NotApplicable in one line when the installed
transformers cannot run the wrapper; ``forward`` also checks that the image reaches the logits (a
second image must change them; else it names the first vision/projector module whose output ignores
its changed input) and that the image features match the image tokens; ``backward`` requires a
non-zero gradient in every part (vision, projector, text); ``generate`` is left to the default item.
"""

from __future__ import annotations

import json
import time

import torch
from pydantic import Field

from harness import metrics
from harness.checks import Check, CheckConfig, CheckContext, CheckFailure, CheckRegistry
from harness.checks.outcomes import NotApplicable
from harness.models import probe
from harness.models.build import build_model, seeded_tokens

metrics.declare("loss_initial", "nats", "none", "cross-entropy of the seeded batch before training")
metrics.declare("loss_final", "nats", "lower", "loss on the same batch after the optimizer steps")
metrics.declare("loss_drop", "nats", "higher", "loss_initial - loss_final")
metrics.declare("forward_time_s", "s", "lower", "first forward of the smoke batch")
metrics.declare("backward_time_s", "s", "lower", "first backward of the smoke batch")
metrics.declare("train_step_time_s", "s", "lower", "mean wall time of one optimizer step")
metrics.declare("grad_norm", "", "none", "global L2 norm of the first backward's gradients")
metrics.declare("parameters", "", "none", "parameters of the pruned model")
metrics.declare("logits_bitwise_equal", "bool", "higher", "1 if two identical runs gave identical logits")
metrics.declare("generation_match", "bool", "higher", "1 if cached and uncached greedy tokens agree")
metrics.declare("generation_cache_logits_rel_rmse", "", "lower", "largest rel_rmse of a step's logits with the KV "
                "cache against recomputation without it (steps up to the first token mismatch)")
metrics.declare("image_tokens", "", "none", "image tokens per sequence in the wrapper variant's synthetic input")
metrics.declare("image_logit_change", "", "higher", "max |logits(image A) - logits(image B)| at text positions "
                "after the image (wrapper variant): 0 means the image does not reach the output")
for _part in ("text", "vision", "projector"):
    metrics.declare(f"parameters_{_part}", "", "none", f"parameters of the pruned wrapper's {_part} part "
                    "(harness.anatomy.moe.module_part, as `harness inspect` splits them)")
    metrics.declare(f"grad_norm_{_part}", "", "none", f"L2 norm of the first backward's gradients in the {_part} part")

WRAPPER = "wrapper"  # the variant name: item smoke[<backend>-<dtype>-wrapper]


class SmokeConfig(CheckConfig):
    """Pruned-model smoke check: forward, backward, a few optimizer steps, determinism, KV cache."""

    batch_size: int = Field(2, ge=1, description="Sequences per batch.")
    seq_len: int = Field(16, ge=2, description="Tokens per sequence.")
    steps: int = Field(3, ge=1, description="Optimizer steps on a fixed batch; the loss must fall.")
    lr: float = Field(1e-2, gt=0, description="AdamW learning rate for the steps.")
    generate_tokens: int = Field(4, ge=0, description="Greedy tokens generated with and without KV cache.")
    seed: int = Field(0, description="Seed for weights and inputs.")
    tie_margin: dict[str, float] = Field(
        default_factory=lambda: {"float64": 1e-9, "float32": 1e-4, "bfloat16": 0.1, "float16": 0.02},
        description="A cached/uncached generation mismatch is accepted only where the uncached "
        "logits' top-2 gap is below this (a near tie), per dtype.")
    no_grad_ok: list[str] = Field(
        default_factory=list, description="fnmatch globs of parameter names that get no gradient from the "
        "LM loss by design (e.g. '*.indexer.*', trained apart); every other parameter still must.")
    wrapper: bool = Field(
        False, description="Also run a multimodal wrapper end to end (variant 'wrapper'): the suite's text "
        "pruning, a tiny vision tower and projector, a seeded synthetic image through the model's image layout, "
        "forward + backward (every part gets a gradient), training steps and determinism. `harness init` sets "
        "it for configs with a text_config.")
    wrapper_overrides: dict[str, int | float | bool | str | list[int] | list[float] | None] = Field(
        default_factory=dict, description="Config keys (dotted, relative to the wrapper's config.json, e.g. "
        "'vision_config.image_size') set for the wrapper variant after harness's own vision pruning.")
    wrapper_no_grad_ok: list[str] = Field(
        default_factory=list, description="no_grad_ok for the wrapper variant (its parameter names are the "
        "wrapper's, e.g. 'model.visual.*'); the default item's no_grad_ok does not apply to it.")


def _raise(ctx: CheckContext, found: probe.Failure | None) -> None:
    """A library step's failure as the item's: its details recorded, then raised."""
    if found is None:
        return
    for k, v in found.detail.items():
        ctx.detail(k, v)
    raise CheckFailure(found.message, **found.fields)


class SmokeCheck(Check):
    cpu_threads = 1  # the pruned test models: one intra-op thread (harness.models.build.cpu_threads)
    name = "smoke"
    order = 10
    config_model = SmokeConfig
    headline = ("loss_initial", "loss_final")  # shown in `harness run`'s table
    steps = ("build", "forward", "backward", "train", "determinism", "generate")
    setup_steps = ("build",)

    def variants(self, suite, backend) -> list[str | None]:
        return [None, WRAPPER] if self.config(suite).wrapper else [None]

    def build(self, ctx: CheckContext, st) -> None:
        cfg = st.cfg = ctx.config
        st.wrapper = ctx.variant == WRAPPER
        if st.wrapper:
            return self._build_wrapper(ctx, st)
        st.model, st.mc = build_model(ctx.suite, ctx.dtype, ctx.device, seed=cfg.seed)
        ctx.notes.extend(st.mc.notes)
        st.vocab = st.mc.config.vocab_size
        st.ids = seeded_tokens(st.vocab, cfg.batch_size, cfg.seq_len, cfg.seed + 1).to(ctx.device)  # [B, S]
        st.inputs, st.labels = {"input_ids": st.ids}, st.ids
        st.trainable = probe.trainable(st.model)
        ctx.metric("parameters", sum(p.numel() for _, p in st.trainable))

    def _build_wrapper(self, ctx: CheckContext, st) -> None:
        from harness.anatomy.moe import module_part

        try:
            st.mc, st.batch = probe.wrapper_batch(ctx.suite, st.cfg)
        except probe.NotRunnable as e:
            raise NotApplicable(f"wrapper end to end: {e}") from None
        ctx.notes.extend(st.mc.notes)
        ctx.notes.append(f"synthetic image: {st.batch.image_tokens} image tokens per sequence, {st.batch.how}")
        ctx.detail("image_input", st.batch.how)
        st.model = probe.wrapper_model(st.mc, st.cfg.seed, ctx.dtype, ctx.device, getattr(st, "transform", None))
        st.vocab = st.mc.config.get_text_config().vocab_size
        st.inputs = probe.on_device(st.batch.inputs, ctx.dtype, ctx.device)
        st.labels = st.batch.labels.to(ctx.device)
        st.ids = st.inputs["input_ids"]
        st.trainable = probe.trainable(st.model)
        st.parts = {n: module_part(n) for n, _ in st.trainable}
        ctx.metric("parameters", sum(p.numel() for _, p in st.trainable))
        for part in probe.PARTS:
            ctx.metric(f"parameters_{part}", sum(p.numel() for n, p in st.trainable if st.parts[n] == part))
        ctx.metric("image_tokens", st.batch.image_tokens)
        st.roots = probe.part_roots(st.model)
        missing = [p for p in ("vision", "projector") if p not in set(st.parts.values())]
        if missing:
            raise NotApplicable(f"wrapper end to end: {type(st.model).__name__} has no {' or '.join(missing)} "
                                "parameters by module path (harness.anatomy.moe.module_part)")

    def forward(self, ctx: CheckContext, st) -> None:
        st.model.train()
        t = time.perf_counter()
        try:
            st.out = st.model(**st.inputs, labels=st.labels)
        except (ValueError, AttributeError) as e:
            # the wrapper's own image-token check, or a transformers wrapper that cannot run: an
            # outcome naming the part, not a traceback
            why = probe.call_error(e, st.model, st.inputs, st.roots, st.batch) if st.wrapper else None
            if isinstance(why, probe.Failure):
                raise CheckFailure(why.message, **why.fields) from None
            if why:
                raise NotApplicable(f"wrapper end to end: {why}") from None
            raise
        ctx.backend.synchronize()
        ctx.metric("forward_time_s", time.perf_counter() - t)
        st.logits0 = st.out.logits.detach().float().cpu()  # [B, S, vocab]
        _raise(ctx, probe.logits_failure(st.model, st.inputs, st.logits0, (st.cfg.batch_size, st.ids.shape[1], st.vocab)))
        st.loss0 = ctx.metric("loss_initial", st.out.loss.item())
        if st.wrapper:  # a second image must change the logits after the image
            alt = probe.other_image_inputs(st.mc, st.cfg, st.inputs, ctx.dtype, ctx.device)
            change, found = probe.image_path(st.model, st.inputs, alt, st.batch.image_tokens, st.roots)
            ctx.metric("image_logit_change", change)
            _raise(ctx, found)

    def backward(self, ctx: CheckContext, st) -> None:
        t = time.perf_counter()
        st.out.loss.backward()
        ctx.backend.synchronize()
        ctx.metric("backward_time_s", time.perf_counter() - t)
        knob = "wrapper_no_grad_ok" if st.wrapper else "no_grad_ok"
        grads = probe.gradients(st.trainable, getattr(st.cfg, knob), knob)
        if grads.excused:
            ctx.notes.append(f"{len(grads.excused)} parameters get no gradient by design (no_grad_ok), "
                             f"e.g. {grads.excused[0]}")
        _raise(ctx, grads.failure)
        st.with_grad = grads.with_grad
        ctx.metric("grad_norm", probe.grad_norm(st.with_grad))
        if st.wrapper:  # every part (vision, projector, text) gets a gradient
            norms = {part: ctx.metric(f"grad_norm_{part}", g)
                     for part, g in probe.part_grad_norms(st.with_grad, st.parts).items()}
            _raise(ctx, probe.dead_parts(norms, st.roots))

    def train(self, ctx: CheckContext, st) -> None:
        """A few optimizer steps on the same batch must lower the loss."""
        cfg = st.cfg
        step_s, loss1 = probe.train_steps(st.model, st.inputs, st.labels, [p for _, p in st.with_grad], cfg.lr,
                                          cfg.steps, ctx.backend.synchronize)
        if step_s is not None:
            ctx.metric("train_step_time_s", step_s)
        ctx.metric("loss_final", loss1)
        ctx.metric("loss_drop", st.loss0 - loss1)
        _raise(ctx, probe.loss_failure(st.loss0, loss1, cfg.steps))
        st.model = st.out = None  # free the trained model before the second build

    def determinism(self, ctx: CheckContext, st) -> None:
        """Same seed, same build, same input -> same bits."""
        if st.wrapper:
            st.model2 = probe.wrapper_model(st.mc, st.cfg.seed, ctx.dtype, ctx.device, getattr(st, "transform", None))
        else:
            st.model2, _ = build_model(ctx.suite, ctx.dtype, ctx.device, seed=st.cfg.seed, mc=st.mc)
        st.model2.train()
        with torch.no_grad():
            logits2 = st.model2(**st.inputs).logits.float().cpu()
        same = torch.equal(st.logits0, logits2)
        ctx.metric("logits_bitwise_equal", float(same))
        if not same and ctx.backend.device_type == "cpu":
            diff = (st.logits0 - logits2).abs().max().item()
            raise CheckFailure("two identical runs gave different logits on CPU", metric="logits_max_abs_diff",
                               expected=0.0, observed=diff)

    def generate(self, ctx: CheckContext, st) -> None:
        """Greedy generation with the KV cache equals recomputation, except at near ties."""
        cfg, model = st.cfg, st.model2
        if st.wrapper:  # the decoder's KV cache is the default item's; image prefill caching is not checked here
            return
        if not cfg.generate_tokens or not hasattr(model, "generate"):
            return
        cached, cached_scores, plain, scores = probe.greedy_pair(model, st.ids, cfg.generate_tokens)
        if torch.equal(cached, plain):
            ctx.metric("generation_match", 1.0)
        else:  # a token that differs is acceptable only where the uncached logits were near-tied
            margin = cfg.tie_margin.get(ctx.dtype, 0.0)
            ctx.tolerance("generation_tie_gap", margin)
            ctx.metric("generation_match", 0.0)
            found, note = probe.tie_failure(cached, plain, scores, margin)
            _raise(ctx, found)
            ctx.notes.append(note)
        self._cache_logits(ctx, st, cached, plain, cached_scores, scores)

    def _cache_logits(self, ctx: CheckContext, st, cached, plain, cached_scores, scores) -> None:
        """Each step's logits [B, vocab] with the cache against recomputation, under the dtype's
        precision tolerance: a wrong cache shows in every decoded step's logits even where the
        greedy tokens happen to agree. Steps after the first token mismatch condition on other
        tokens and are not compared (the mismatch step itself still shares its prefix). Where a step is
        over the tolerance, the dtype's own error at that step is measured against float64 and sets
        its budget if larger: at a published head size the dtype's own rounding can pass the fixed
        tolerance (Gemma-4's 512-wide global attention, float32: 2-6e-5 against float64, 1e-5 allowed)."""
        from harness.precision.compare import tensor_metrics
        from harness.precision.tolerance import resolve

        errs = [tensor_metrics(cached_scores[t].float(), scores[t].float())["rel_rmse"]
                for t in range(probe.shared_steps(cached, plain, len(scores)))]
        if not errs:
            return
        budget = resolve(ctx.suite.suite.checks.precision, ctx.backend.name, ctx.backend.device_name(), ctx.dtype)[0][
            "rel_rmse"]
        own = None
        if max(errs) > budget:
            ref, _ = build_model(ctx.suite, "float64", "cpu", seed=st.cfg.seed, mc=st.mc)
            own = _own_errors(ref, st.ids, plain, scores, len(errs))
            ctx.detail("generation_own_error_rel_rmse", json.dumps([o and float(f"{o:.3g}") for o in own]))
        budgets = probe.cache_budgets(budget, own or [None] * len(errs))
        worst = max(range(len(errs)), key=lambda t: errs[t] / budgets[t])
        ctx.metric("generation_cache_logits_rel_rmse", max(errs))
        ctx.tolerance("generation_cache_logits_rel_rmse", budgets[worst])
        _raise(ctx, probe.cache_logits_failure(errs, budget, ctx.dtype, own))


def _own_errors(ref_model, ids: torch.Tensor, plain: torch.Tensor, scores, n: int) -> list[float | None]:
    """Per decoded step t < ``n``: rel_rmse of the dtype run's uncached logits ``scores[t]`` [B, vocab] against
    ``ref_model``'s (float64, the same seeded weights, on the CPU), generated the same way from ``ids`` [B, S];
    None from the first step whose conditioning differs (float64 chose another token before it)."""
    from harness.precision.compare import tensor_metrics

    ref_model.eval()
    ref_model.generation_config.eos_token_id = None
    with torch.no_grad():
        ref, ref_scores = probe.greedy(ref_model, ids.cpu(), n, False)
    same = probe.shared_steps(ref, plain.cpu(), n)  # the first token mismatch still shares its prefix
    return [tensor_metrics(scores[t].double().cpu(), ref_scores[t].double())["rel_rmse"] if t < same else None
            for t in range(n)]


def register(registry: CheckRegistry) -> None:
    registry.add(SmokeCheck())
