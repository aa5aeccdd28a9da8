"""Pruned-model smoke check: does the model load, run forward and backward, and learn?

Per suite x backend x dtype, on the pruned model with seeded weights and seeded tokens [B, S]:

1. forward: logits [B, S, vocab] and finite (else: name the first module whose output is not);
2. backward: a finite gradient on every trainable parameter;
3. ``steps`` AdamW steps on the same batch lower the loss;
4. determinism: a second build + forward gives bit-identical logits (enforced on CPU, recorded elsewhere);
5. greedy generation with the KV cache equals generation without it, except at near ties.
"""

from __future__ import annotations

import math
import time

import torch

from harness import metrics
from harness.backends.base import Backend
from harness.checks import CheckContext, CheckFailure, CheckRegistry
from harness.models.build import build_model, seeded_tokens
from harness.suite.loader import LoadedSuite

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


class SmokeCheck:
    name = "smoke"
    headline = ("loss_initial", "loss_final")  # shown in `harness run`'s table

    def enabled(self, suite: LoadedSuite) -> bool:
        return suite.suite.checks.smoke.enabled

    def variants(self, suite: LoadedSuite, backend: Backend) -> list[str | None]:
        return [None]

    def run(self, ctx: CheckContext) -> None:
        cfg = ctx.suite.suite.checks.smoke
        dev, be = ctx.device, ctx.backend
        model, mc = build_model(ctx.suite, ctx.dtype, dev, seed=cfg.seed)
        ctx.notes.extend(mc.notes)
        vocab = mc.config.vocab_size
        ids = seeded_tokens(vocab, cfg.batch_size, cfg.seq_len, cfg.seed + 1).to(dev)
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        ctx.metric("parameters", sum(p.numel() for _, p in trainable))

        # 1. forward ------------------------------------------------------------------------
        model.train()
        t = time.perf_counter()
        out = model(input_ids=ids, labels=ids)
        be.synchronize()
        ctx.metric("forward_time_s", time.perf_counter() - t)
        want = (cfg.batch_size, cfg.seq_len, vocab)
        if tuple(out.logits.shape) != want:
            raise CheckFailure("logits have the wrong shape", metric="logits.shape",
                               expected=want, observed=tuple(out.logits.shape))
        logits0 = out.logits.detach().float().cpu()
        bad = (~torch.isfinite(logits0)).sum().item()
        if bad:
            where = first_nonfinite_module(model, input_ids=ids)
            ctx.detail("first_nonfinite_module", where or "?")
            raise CheckFailure(f"forward gives {bad} non-finite logits; first non-finite module output: {where}",
                               metric="nonfinite_logits", expected=0, observed=bad)
        loss0 = ctx.metric("loss_initial", out.loss.item())

        # 2. backward -----------------------------------------------------------------------
        t = time.perf_counter()
        out.loss.backward()
        be.synchronize()
        ctx.metric("backward_time_s", time.perf_counter() - t)
        missing = [n for n, p in trainable if p.grad is None]
        if missing:
            raise CheckFailure(f"{len(missing)} trainable parameters got no gradient, first: {missing[:5]}",
                               metric="params_without_grad", expected=0, observed=len(missing))
        nonfinite = [n for n, p in trainable if not torch.isfinite(p.grad).all()]
        if nonfinite:
            raise CheckFailure(f"non-finite gradients in {len(nonfinite)} parameters, first: {nonfinite[:5]}",
                               metric="params_nonfinite_grad", expected=0, observed=len(nonfinite))
        ctx.metric("grad_norm", torch.linalg.vector_norm(
            torch.stack([p.grad.float().norm() for _, p in trainable])).item())

        # 3. a few optimizer steps on the same batch must lower the loss ------------------------
        # eps must survive the parameter dtype: AdamW's default 1e-8 is 0 in float16, and then
        # a zero second moment gives 0/0 = nan on the first step.
        eps = max(1e-8, 2 * torch.finfo(trainable[0][1].dtype).tiny)
        opt = torch.optim.AdamW([p for _, p in trainable], lr=cfg.lr, eps=eps)
        opt.step()  # step 1 uses the gradient we already have
        t = time.perf_counter()
        for _ in range(cfg.steps - 1):
            opt.zero_grad(set_to_none=True)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
        be.synchronize()
        if cfg.steps > 1:
            ctx.metric("train_step_time_s", (time.perf_counter() - t) / (cfg.steps - 1))
        with torch.no_grad():
            loss1 = ctx.metric("loss_final", model(input_ids=ids, labels=ids).loss.item())
        ctx.metric("loss_drop", loss0 - loss1)
        if not math.isfinite(loss1):
            raise CheckFailure(f"{cfg.steps} optimizer steps made the loss non-finite", metric="loss_final",
                               expected="finite", observed=loss1)
        if not loss1 < loss0:
            raise CheckFailure(f"{cfg.steps} optimizer steps on a fixed batch did not lower the loss",
                               metric="loss_final", expected=f"< {loss0:.6g} (loss_initial)", observed=f"{loss1:.6g}")
        del opt, model

        # 4. determinism: same seed, same build, same input -> same bits -----------------------
        model2, _ = build_model(ctx.suite, ctx.dtype, dev, seed=cfg.seed, mc=mc)
        model2.train()
        with torch.no_grad():
            logits2 = model2(input_ids=ids).logits.float().cpu()
        same = torch.equal(logits0, logits2)
        ctx.metric("logits_bitwise_equal", float(same))
        if not same and be.device_type == "cpu":
            diff = (logits0 - logits2).abs().max().item()
            raise CheckFailure("two identical runs gave different logits on CPU", metric="logits_max_abs_diff",
                               expected=0.0, observed=diff)

        # 5. KV-cache generation equals recomputation -----------------------------------------
        if cfg.generate_tokens and hasattr(model2, "generate"):
            self._generation(ctx, model2, ids, cfg)

    def _generation(self, ctx: CheckContext, model, ids, cfg) -> None:
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
