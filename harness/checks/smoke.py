"""Pruned-model smoke check: does the model load, run forward and backward, and learn?

Per suite x backend x dtype, on the pruned model with seeded weights and seeded tokens [B, S],
as named steps (``SmokeCheck.steps``):

``build``        the pruned model on the device (setup: a failure here is "could not run");
``forward``      logits [B, S, vocab] and finite (else: name the first module whose output is not);
``backward``     a finite gradient on every trainable parameter (``no_grad_ok`` globs excepted);
``train``        ``steps`` AdamW steps on the same batch lower the loss;
``determinism``  a second build + forward gives bit-identical logits (enforced on CPU, recorded elsewhere);
``generate``     greedy generation with the KV cache equals generation without it, except at near ties.
"""

from __future__ import annotations

import fnmatch
import math
import time

import torch
from pydantic import Field

from harness import metrics
from harness.checks import Check, CheckConfig, CheckContext, CheckFailure, CheckRegistry
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


def _tensors(obj):
    """Every tensor inside a module output (tensors, tuples, dicts/ModelOutputs)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (tuple, list)):
        for v in obj:
            yield from _tensors(v)


def first_nonfinite_module(model: torch.nn.Module, **inputs) -> str | None:
    """Rerun forward with hooks on every module. Hooks fire when a module *finishes*, children
    before parents, so the first hook that sees inf/nan belongs to the module where it was born."""
    names = {m: n or "<model>" for n, m in model.named_modules()}
    found: list[str] = []

    def hook(mod, _args, out):
        if not found and any(t.is_floating_point() and not torch.isfinite(t).all() for t in _tensors(out)):
            found.append(names[mod])

    handles = [m.register_forward_hook(hook) for m in model.modules()]
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        for h in handles:
            h.remove()
    return found[0] if found else None


def _greedy(model, ids, n, use_cache):
    out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, use_cache=use_cache,
                         output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    return out.sequences[:, ids.shape[1]:], out.scores


class SmokeCheck(Check):
    name = "smoke"
    config_model = SmokeConfig
    headline = ("loss_initial", "loss_final")  # shown in `harness run`'s table
    steps = ("build", "forward", "backward", "train", "determinism", "generate")
    setup_steps = ("build",)

    def build(self, ctx: CheckContext, st) -> None:
        cfg = st.cfg = ctx.config
        st.model, st.mc = build_model(ctx.suite, ctx.dtype, ctx.device, seed=cfg.seed)
        ctx.notes.extend(st.mc.notes)
        st.vocab = st.mc.config.vocab_size
        st.ids = seeded_tokens(st.vocab, cfg.batch_size, cfg.seq_len, cfg.seed + 1).to(ctx.device)  # [B, S]
        st.trainable = [(n, p) for n, p in st.model.named_parameters() if p.requires_grad]
        ctx.metric("parameters", sum(p.numel() for _, p in st.trainable))

    def forward(self, ctx: CheckContext, st) -> None:
        cfg, model, ids = st.cfg, st.model, st.ids
        model.train()
        t = time.perf_counter()
        st.out = out = model(input_ids=ids, labels=ids)
        ctx.backend.synchronize()
        ctx.metric("forward_time_s", time.perf_counter() - t)
        want = (cfg.batch_size, cfg.seq_len, st.vocab)
        if tuple(out.logits.shape) != want:
            raise CheckFailure("logits have the wrong shape", metric="logits.shape",
                               expected=want, observed=tuple(out.logits.shape))
        st.logits0 = out.logits.detach().float().cpu()  # [B, S, vocab]
        bad = (~torch.isfinite(st.logits0)).sum().item()
        if bad:
            where = first_nonfinite_module(model, input_ids=ids)
            ctx.detail("first_nonfinite_module", where or "?")
            raise CheckFailure(f"forward gives {bad} non-finite logits; first non-finite module output: {where}",
                               metric="nonfinite_logits", expected=0, observed=bad)
        st.loss0 = ctx.metric("loss_initial", out.loss.item())

    def backward(self, ctx: CheckContext, st) -> None:
        t = time.perf_counter()
        st.out.loss.backward()
        ctx.backend.synchronize()
        ctx.metric("backward_time_s", time.perf_counter() - t)
        allowed = st.cfg.no_grad_ok
        excused = [n for n, p in st.trainable if p.grad is None and any(fnmatch.fnmatchcase(n, g) for g in allowed)]
        if excused:
            ctx.notes.append(f"{len(excused)} parameters get no gradient by design (no_grad_ok), e.g. {excused[0]}")
        missing = [n for n, p in st.trainable if p.grad is None and n not in excused]
        if missing:
            raise CheckFailure(f"{len(missing)} trainable parameters got no gradient, first: {missing[:5]}",
                               metric="params_without_grad", expected=0, observed=len(missing),
                               details="if this is by design, list them in [checks.smoke] no_grad_ok")
        with_grad = [(n, p) for n, p in st.trainable if p.grad is not None]
        nonfinite = [n for n, p in with_grad if not torch.isfinite(p.grad).all()]
        if nonfinite:
            raise CheckFailure(f"non-finite gradients in {len(nonfinite)} parameters, first: {nonfinite[:5]}",
                               metric="params_nonfinite_grad", expected=0, observed=len(nonfinite))
        ctx.metric("grad_norm", torch.linalg.vector_norm(
            torch.stack([p.grad.float().norm() for _, p in with_grad])).item())
        st.with_grad = with_grad

    def train(self, ctx: CheckContext, st) -> None:
        """A few optimizer steps on the same batch must lower the loss."""
        cfg, model, ids = st.cfg, st.model, st.ids
        params = [p for _, p in st.with_grad]
        # eps must survive the parameter dtype: AdamW's default 1e-8 is 0 in float16, and then
        # a zero second moment gives 0/0 = nan on the first step.
        eps = max(1e-8, 2 * torch.finfo(params[0].dtype).tiny)
        opt = torch.optim.AdamW(params, lr=cfg.lr, eps=eps)
        opt.step()  # step 1 uses the gradient we already have
        t = time.perf_counter()
        for _ in range(cfg.steps - 1):
            opt.zero_grad(set_to_none=True)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
        ctx.backend.synchronize()
        if cfg.steps > 1:
            ctx.metric("train_step_time_s", (time.perf_counter() - t) / (cfg.steps - 1))
        with torch.no_grad():
            loss1 = ctx.metric("loss_final", model(input_ids=ids, labels=ids).loss.item())
        ctx.metric("loss_drop", st.loss0 - loss1)
        if not math.isfinite(loss1):
            raise CheckFailure(f"{cfg.steps} optimizer steps made the loss non-finite", metric="loss_final",
                               expected="finite", observed=loss1)
        if not loss1 < st.loss0:
            raise CheckFailure(f"{cfg.steps} optimizer steps on a fixed batch did not lower the loss",
                               metric="loss_final", expected=f"< {st.loss0:.6g} (loss_initial)", observed=f"{loss1:.6g}")
        del opt
        st.model = st.out = None  # free the trained model before the second build

    def determinism(self, ctx: CheckContext, st) -> None:
        """Same seed, same build, same input -> same bits."""
        st.model2, _ = build_model(ctx.suite, ctx.dtype, ctx.device, seed=st.cfg.seed, mc=st.mc)
        st.model2.train()
        with torch.no_grad():
            logits2 = st.model2(input_ids=st.ids).logits.float().cpu()
        same = torch.equal(st.logits0, logits2)
        ctx.metric("logits_bitwise_equal", float(same))
        if not same and ctx.backend.device_type == "cpu":
            diff = (st.logits0 - logits2).abs().max().item()
            raise CheckFailure("two identical runs gave different logits on CPU", metric="logits_max_abs_diff",
                               expected=0.0, observed=diff)

    def generate(self, ctx: CheckContext, st) -> None:
        """Greedy generation with the KV cache equals recomputation, except at near ties."""
        cfg, model, ids = st.cfg, st.model2, st.ids
        if not cfg.generate_tokens or not hasattr(model, "generate"):
            return
        model.eval()
        model.generation_config.eos_token_id = None  # generate exactly n tokens
        with torch.no_grad():
            cached, _ = _greedy(model, ids, cfg.generate_tokens, True)
            plain, scores = _greedy(model, ids, cfg.generate_tokens, False)
        if torch.equal(cached, plain):
            ctx.metric("generation_match", 1.0)
            return
        # First mismatch: acceptable only if the uncached logits were near-tied there.
        b, t = (cached != plain).nonzero()[0].tolist()
        step = scores[t][b].float()
        gap = (step[plain[b, t]] - step[cached[b, t]]).item()
        margin = cfg.tie_margin.get(ctx.dtype, 0.0)
        ctx.tolerance("generation_tie_gap", margin)
        ctx.metric("generation_match", 0.0)
        if gap > margin:
            raise CheckFailure(
                f"greedy generation with KV cache differs from generation without it "
                f"(sequence {b}, new token {t}: {cached[b, t].item()} vs {plain[b, t].item()})",
                metric="generation_tie_gap", expected=f"<= {margin} (near tie)", observed=f"{gap:.6g}",
                tolerance=margin)
        ctx.notes.append(f"cached/uncached generation differ at a near tie (gap {gap:.3g} <= {margin})")


def register(registry: CheckRegistry) -> None:
    registry.add(SmokeCheck())
