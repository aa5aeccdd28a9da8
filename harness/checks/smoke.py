"""Pruned-model smoke check: does the model load, run forward and backward, and learn?

Per suite x backend x dtype, on the pruned model with seeded weights and seeded tokens [B, S],
as named steps (``SmokeCheck.steps``):

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

import fnmatch
import math
import time

import torch
from pydantic import Field

from harness import metrics
from harness.checks import Check, CheckConfig, CheckContext, CheckFailure, CheckRegistry
from harness.checks.outcomes import NotApplicable
from harness.models.build import build_model, cast_model, seeded_tokens, torch_dtype

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
        st.trainable = [(n, p) for n, p in st.model.named_parameters() if p.requires_grad]
        ctx.metric("parameters", sum(p.numel() for _, p in st.trainable))

    # -- the wrapper variant ------------------------------------------------------------------------
    def _wrapper_model(self, ctx: CheckContext, st) -> torch.nn.Module:
        from harness.models.config import architecture_class

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(st.cfg.seed)
            model = architecture_class(st.mc.architecture)(st.mc.config)
        model = cast_model(model, torch_dtype(ctx.dtype), ctx.device)
        if getattr(st, "transform", None) is not None:  # tests inject a fault into the built model
            model = st.transform(model) or model
        return model

    def _build_wrapper(self, ctx: CheckContext, st) -> None:
        from harness.anatomy.moe import module_part
        from harness.models.build import model_config
        from harness.models.config import ModelBuildError
        from harness.models.wrapper import image_batch, supported, wrapper_config

        cfg = st.cfg
        why = supported(ctx.suite.raw_config)
        if why:
            raise NotApplicable(f"wrapper end to end: {why}")
        try:
            st.mc, _ = wrapper_config(ctx.suite, model_config(ctx.suite), cfg.wrapper_overrides)
            st.batch = image_batch(st.mc.config, cfg.batch_size, cfg.seq_len, cfg.seed + 1,
                                   architecture=st.mc.architecture)
        except ModelBuildError as e:
            raise NotApplicable(f"wrapper end to end: the installed transformers cannot build it: {e}") from None
        ctx.notes.extend(st.mc.notes)
        ctx.notes.append(f"synthetic image: {st.batch.image_tokens} image tokens per sequence, {st.batch.how}")
        ctx.detail("image_input", st.batch.how)
        st.model = self._wrapper_model(ctx, st)
        st.vocab = st.mc.config.get_text_config().vocab_size
        dt = torch_dtype(ctx.dtype)
        st.inputs = {k: (v.to(ctx.device, dt) if v.is_floating_point() else v.to(ctx.device))
                     for k, v in st.batch.inputs.items()}
        st.labels = st.batch.labels.to(ctx.device)
        st.ids = st.inputs["input_ids"]
        st.trainable = [(n, p) for n, p in st.model.named_parameters() if p.requires_grad]
        st.parts = {n: module_part(n) for n, _ in st.trainable}
        ctx.metric("parameters", sum(p.numel() for _, p in st.trainable))
        for part in ("text", "vision", "projector"):
            ctx.metric(f"parameters_{part}", sum(p.numel() for n, p in st.trainable if st.parts[n] == part))
        ctx.metric("image_tokens", st.batch.image_tokens)
        st.roots = _part_roots(st.model)
        missing = [p for p in ("vision", "projector") if p not in set(st.parts.values())]
        if missing:
            raise NotApplicable(f"wrapper end to end: {type(st.model).__name__} has no {' or '.join(missing)} "
                                "parameters by module path (harness.anatomy.moe.module_part)")

    def forward(self, ctx: CheckContext, st) -> None:
        cfg, model, ids = st.cfg, st.model, st.ids
        model.train()
        t = time.perf_counter()
        st.out = out = self._call(ctx, st, model, labels=st.labels)
        ctx.backend.synchronize()
        ctx.metric("forward_time_s", time.perf_counter() - t)
        want = (cfg.batch_size, ids.shape[1], st.vocab)
        if tuple(out.logits.shape) != want:
            raise CheckFailure("logits have the wrong shape", metric="logits.shape",
                               expected=want, observed=tuple(out.logits.shape))
        st.logits0 = out.logits.detach().float().cpu()  # [B, S, vocab]
        bad = (~torch.isfinite(st.logits0)).sum().item()
        if bad:
            where = first_nonfinite_module(model, **st.inputs)
            ctx.detail("first_nonfinite_module", where or "?")
            raise CheckFailure(f"forward gives {bad} non-finite logits; first non-finite module output: {where}",
                               metric="nonfinite_logits", expected=0, observed=bad)
        st.loss0 = ctx.metric("loss_initial", out.loss.item())
        if st.wrapper:
            self._image_reaches_logits(ctx, st)

    def _call(self, ctx: CheckContext, st, model, **kw):
        """model(**inputs); for the wrapper, the model's own image-token check and a transformers
        wrapper that cannot run become outcomes naming the part, not a traceback."""
        try:
            return model(**st.inputs, **kw)
        except ValueError as e:
            if st.wrapper and "do not match" in str(e):
                proj = ", ".join(st.roots.get("projector", [])[:2]) or "?"
                raise CheckFailure(
                    f"image features do not match the image tokens: the input holds {st.batch.image_tokens} image "
                    f"tokens per sequence ({st.batch.how}), the vision tower + projector ({proj}) produced a "
                    f"different number of features: {' '.join(str(e).split())}",
                    metric="image_tokens", expected=st.batch.image_tokens, observed=" ".join(str(e).split())) from None
            raise
        except AttributeError as e:
            # transformers' own wrapper forward failing on its own objects, with the image or without
            # one, is a wrapper this transformers cannot run (NotApplicable); anything else (e.g. a vision
            # module that returns None) fails as a model fault.
            where = _transformers_frame(e, model) if st.wrapper else None
            if where and _fails_text_only(model, st.inputs["input_ids"]):
                import transformers

                raise NotApplicable(f"wrapper end to end: transformers {transformers.__version__} cannot run "
                                    f"{type(model).__name__}.forward: AttributeError: {e} ({where})") from None
            raise

    def _image_reaches_logits(self, ctx: CheckContext, st) -> None:
        """A second seeded image must change the logits after the image; if not, name the first
        vision/projector module (in the order they finish) whose input changed but output did not."""
        from harness.anatomy.moe import module_part

        alt = _other_image_inputs(ctx, st)
        after = slice(1 + st.batch.image_tokens, None)  # text positions after the image
        seen: dict[str, list] = {}
        hook = _io_recorder(st.model, seen)
        watch = _watched(st)
        logits = [_hooked_logits(st.model, inputs, after, watch, hook) for inputs in (st.inputs, alt)]
        change = ctx.metric("image_logit_change", (logits[0] - logits[1]).abs().max().item())
        if change > 0:
            return
        culprit = _ignores_its_input(seen)
        part = module_part(culprit) if culprit else None
        where = (f"the {part} module {culprit} ignores its input (same output for both images)" if culprit else
                 "every vision/projector module's output follows the image, so the merge of image features into "
                 "the token embeddings loses it")
        ctx.detail("image_path_break", culprit or "merge")
        raise CheckFailure(f"the image does not reach the logits: two different images give identical logits after "
                           f"the image; {where}", metric="image_logit_change", expected="> 0", observed=change)

    def backward(self, ctx: CheckContext, st) -> None:
        t = time.perf_counter()
        st.out.loss.backward()
        ctx.backend.synchronize()
        ctx.metric("backward_time_s", time.perf_counter() - t)
        allowed = st.cfg.wrapper_no_grad_ok if st.wrapper else st.cfg.no_grad_ok
        excused = [n for n, p in st.trainable if p.grad is None and any(fnmatch.fnmatchcase(n, g) for g in allowed)]
        if excused:
            ctx.notes.append(f"{len(excused)} parameters get no gradient by design (no_grad_ok), e.g. {excused[0]}")
        missing = [n for n, p in st.trainable if p.grad is None and n not in excused]
        if missing:
            raise CheckFailure(f"{len(missing)} trainable parameters got no gradient, first: {missing[:5]}",
                               metric="params_without_grad", expected=0, observed=len(missing),
                               details="if this is by design, list them in [checks.smoke] "
                               + ("wrapper_no_grad_ok" if st.wrapper else "no_grad_ok"))
        with_grad = [(n, p) for n, p in st.trainable if p.grad is not None]
        nonfinite = [n for n, p in with_grad if not torch.isfinite(p.grad).all()]
        if nonfinite:
            raise CheckFailure(f"non-finite gradients in {len(nonfinite)} parameters, first: {nonfinite[:5]}",
                               metric="params_nonfinite_grad", expected=0, observed=len(nonfinite))
        ctx.metric("grad_norm", torch.linalg.vector_norm(
            torch.stack([p.grad.float().norm() for _, p in with_grad])).item())
        st.with_grad = with_grad
        if st.wrapper:
            dead = []
            for part in ("vision", "projector", "text"):
                norms = [p.grad.float().norm() for n, p in with_grad if st.parts[n] == part]
                g = ctx.metric(f"grad_norm_{part}", torch.linalg.vector_norm(torch.stack(norms)).item() if norms else 0.0)
                if g == 0:
                    dead.append(f"{part} ({', '.join(st.roots.get(part, [])[:2]) or 'no module'})")
            if dead:
                raise CheckFailure(f"the loss gives zero gradient to the wrapper's {', '.join(dead)}: the image path "
                                   "does not reach the loss", metric="grad_norm_" + dead[0].split()[0],
                                   expected="> 0", observed=0.0)

    def train(self, ctx: CheckContext, st) -> None:
        """A few optimizer steps on the same batch must lower the loss."""
        cfg, model = st.cfg, st.model
        params = [p for _, p in st.with_grad]
        # eps must survive the parameter dtype: AdamW's default 1e-8 is 0 in float16, and then
        # a zero second moment gives 0/0 = nan on the first step.
        eps = max(1e-8, 2 * torch.finfo(params[0].dtype).tiny)
        opt = torch.optim.AdamW(params, lr=cfg.lr, eps=eps)
        opt.step()  # step 1 uses the gradient we already have
        t = time.perf_counter()
        for _ in range(cfg.steps - 1):
            opt.zero_grad(set_to_none=True)
            model(**st.inputs, labels=st.labels).loss.backward()
            opt.step()
        ctx.backend.synchronize()
        if cfg.steps > 1:
            ctx.metric("train_step_time_s", (time.perf_counter() - t) / (cfg.steps - 1))
        with torch.no_grad():
            loss1 = ctx.metric("loss_final", model(**st.inputs, labels=st.labels).loss.item())
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
        if st.wrapper:
            st.model2 = self._wrapper_model(ctx, st)
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
        cfg, model, ids = st.cfg, st.model2, st.ids
        if st.wrapper:  # the decoder's KV cache is the default item's; image prefill caching is not checked here
            return
        if not cfg.generate_tokens or not hasattr(model, "generate"):
            return
        model.eval()
        model.generation_config.eos_token_id = None  # generate exactly n tokens
        with torch.no_grad():
            cached, cached_scores = _greedy(model, ids, cfg.generate_tokens, True)
            plain, scores = _greedy(model, ids, cfg.generate_tokens, False)
        if torch.equal(cached, plain):
            ctx.metric("generation_match", 1.0)
        else:
            self._token_mismatch(ctx, cached, plain, scores)
        self._cache_logits(ctx, cached, plain, cached_scores, scores)

    def _token_mismatch(self, ctx: CheckContext, cached, plain, scores) -> None:
        """A token that differs is acceptable only where the uncached logits were near-tied."""
        cfg = ctx.config
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

    def _cache_logits(self, ctx: CheckContext, cached, plain, cached_scores, scores) -> None:
        """Each step's logits [B, vocab] with the cache against recomputation, under the dtype's
        precision tolerance: a wrong cache shows in every decoded step's logits even where the
        greedy tokens happen to agree. Steps after the first token mismatch condition on other
        tokens and are not compared (the mismatch step itself still shares its prefix)."""
        from harness.precision.compare import tensor_metrics
        from harness.precision.tolerance import resolve

        diff = (cached != plain).any(0).nonzero()
        last = int(diff[0]) if len(diff) else len(scores) - 1
        errs = [tensor_metrics(cached_scores[t].float(), scores[t].float())["rel_rmse"] for t in range(last + 1)]
        if not errs:
            return
        tol = resolve(ctx.suite.suite.checks.precision, ctx.backend.name, ctx.backend.device_name(), ctx.dtype)[0]
        budget = tol["rel_rmse"]
        worst = ctx.metric("generation_cache_logits_rel_rmse", max(errs))
        ctx.tolerance("generation_cache_logits_rel_rmse", budget)
        bad = next((t for t, e in enumerate(errs) if not e <= budget), None)
        if bad is not None:
            raise CheckFailure(
                f"decode logits with the KV cache differ from recomputation without it at new token {bad} "
                f"(rel_rmse {errs[bad]:.3g} > the {ctx.dtype} tolerance {budget:.3g})",
                metric="generation_cache_logits_rel_rmse", expected=f"<= {budget:.3g}", observed=f"{worst:.4g}",
                tolerance=budget)


def _other_image_inputs(ctx: CheckContext, st) -> dict:
    """The wrapper's inputs with a second seeded image (same text), in the run's dtype and device."""
    from harness.models.wrapper import image_batch

    cfg = st.cfg
    other = image_batch(st.mc.config, cfg.batch_size, cfg.seq_len, cfg.seed + 1, image_seed=cfg.seed + 1000,
                        architecture=st.mc.architecture)
    dt = torch_dtype(ctx.dtype)
    return {**st.inputs, **{k: v.to(ctx.device, dt) if v.is_floating_point() else v.to(ctx.device)
                            for k, v in other.inputs.items() if k != "input_ids"}}


def _watched(st) -> list[torch.nn.Module]:
    """The vision/projector modules whose input and output are recorded: those with parameters of
    their own, and each part's root."""
    from harness.anatomy.moe import module_part

    # Modules with parameters only: a rotary or position module's output legitimately ignores the
    # pixels it is handed (positions only); its parent then answers for a broken child.
    return [m for n, m in st.model.named_modules() if n and module_part(n) != "text"
            and any(True for _ in m.parameters(recurse=False))
            or n and module_part(n) != "text" and any(r == n for rs in st.roots.values() for r in rs)]


def _io_recorder(model: torch.nn.Module, seen: dict[str, list]):
    """A forward hook appending a module's floating (inputs, outputs) to ``seen`` under its name."""
    names = {m: n for n, m in model.named_modules()}

    def hook(mod, args, kwargs, out):
        seen.setdefault(names[mod], []).append((
            [t.detach().clone() for t in _tensors((args, kwargs)) if t.is_floating_point()],
            [t.detach().clone() for t in _tensors(out) if t.is_floating_point()]))
    return hook


def _hooked_logits(model: torch.nn.Module, inputs: dict, after: slice, watch: list[torch.nn.Module],
                   hook) -> torch.Tensor:
    """The float logits at the positions ``after`` for ``inputs``, with ``hook`` on every watched module."""
    handles = [m.register_forward_hook(hook, with_kwargs=True) for m in watch]
    try:
        with torch.no_grad():
            return model(**inputs).logits[:, after].float()
    finally:
        for h in handles:
            h.remove()


def _ignores_its_input(seen: dict[str, list]) -> str | None:
    """The first module (insertion order = the order modules first finished) whose input differed
    between the two images and whose output did not; the second image's first call is halfway
    through its calls."""
    for name, calls in seen.items():
        if len(calls) < 2:
            continue
        (ia, oa), (ib, ob) = calls[0], calls[len(calls) // 2]
        if not _same(ia, ib) and _same(oa, ob):
            return name
    return None


def _same(xs: list[torch.Tensor], ys: list[torch.Tensor]) -> bool:
    return len(xs) == len(ys) and all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(xs, ys, strict=True))


def _part_roots(model: torch.nn.Module) -> dict[str, list[str]]:
    """The shallowest modules of each wrapper part (vision / projector / text) by module path, as
    ``harness inspect`` splits parameters (``model.visual``, ``model.visual.merger``, ...)."""
    from harness.anatomy.moe import module_part

    roots: dict[str, list[str]] = {}
    for name, mod in model.named_modules():
        if not name or not any(True for _ in mod.parameters()):
            continue
        part = module_part(name)
        parent = name.rsplit(".", 1)[0] if "." in name else ""
        if parent and module_part(parent) == part:
            continue
        roots.setdefault(part, []).append(name)
    return roots


def _fails_text_only(model: torch.nn.Module, ids: torch.Tensor) -> bool:
    """Does the wrapper's forward raise AttributeError on text alone (no image path involved)?"""
    try:
        with torch.no_grad():
            model(input_ids=ids[:, :2])
    except AttributeError:
        return True
    except Exception:  # noqa: BLE001 - any other outcome: the image path is what broke
        return False
    return False


def _transformers_frame(e: BaseException, model: torch.nn.Module) -> str | None:
    """'modeling_x.py:123 in forward' when ``e`` was raised in transformers' own code, in ``model``'s
    own (top-level) forward, else None."""
    import os

    import transformers

    tb = e.__traceback__
    last = None
    while tb is not None:
        last = tb
        tb = tb.tb_next
    if last is None:
        return None
    f = last.tb_frame.f_code.co_filename
    if not f.startswith(os.path.dirname(transformers.__file__)) or last.tb_frame.f_locals.get("self") is not model:
        return None
    return f"{os.path.basename(f)}:{last.tb_lineno} in {last.tb_frame.f_code.co_name}"


def register(registry: CheckRegistry) -> None:
    registry.add(SmokeCheck())
