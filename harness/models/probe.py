"""A built model put through forward, backward, optimizer steps and greedy generation, and where it goes
wrong: the smoke check's steps as library calls (harness/checks/smoke.py).

* forward: the first module whose output is not finite (hooks fire children before parents);
* backward: trainable parameters without a gradient (``no_grad_ok`` globs excepted) or with a
  non-finite one, the global and per-part gradient norms, a wrapper part the loss does not reach;
* train: AdamW steps on one batch, with an epsilon the parameter dtype can hold;
* generate: greedy tokens with and without the KV cache, a mismatch judged against the near-tie margin;
* the multimodal wrapper variant (harness/models/wrapper.py): its seeded inputs and model, the first
  vision/projector module whose output ignores a changed image, and what an error inside
  transformers' own wrapper forward means.

A judged step returns a ``Failure`` (or None) that the check raises as its CheckFailure.
"""

from __future__ import annotations

import fnmatch
import os
import time
from dataclasses import dataclass, field

import torch

from harness.models.build import cast_model, torch_dtype

PARTS = ("text", "vision", "projector")


@dataclass
class Failure:
    message: str
    fields: dict  # CheckFailure's metric, expected, observed, tolerance, details
    detail: dict[str, str] = field(default_factory=dict)  # JUnit details recorded before it is raised


class NotRunnable(Exception):
    """The wrapper variant cannot run here (the installed transformers, a suite that is no wrapper):
    one line saying why."""


def tensors(obj):
    """Every tensor inside a module output (tensors, tuples, dicts/ModelOutputs)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors(v)
    elif isinstance(obj, (tuple, list)):
        for v in obj:
            yield from tensors(v)


def trainable(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


# -- forward --------------------------------------------------------------------------------------
def first_nonfinite_module(model: torch.nn.Module, **inputs) -> str | None:
    """Rerun forward with hooks on every module. Hooks fire when a module *finishes*, children
    before parents, so the first hook that sees inf/nan belongs to the module where it was born."""
    names = {m: n or "<model>" for n, m in model.named_modules()}
    found: list[str] = []

    def hook(mod, _args, out):
        if not found and any(t.is_floating_point() and not torch.isfinite(t).all() for t in tensors(out)):
            found.append(names[mod])

    handles = [m.register_forward_hook(hook) for m in model.modules()]
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        for h in handles:
            h.remove()
    return found[0] if found else None


def logits_failure(model: torch.nn.Module, inputs: dict, logits: torch.Tensor, want: tuple) -> Failure | None:
    """Logits [B, S, vocab] of the wrong shape, or with a non-finite entry (naming the first module
    whose output is not finite, the ``first_nonfinite_module`` detail)."""
    if tuple(logits.shape) != want:
        return Failure("logits have the wrong shape",
                       dict(metric="logits.shape", expected=want, observed=tuple(logits.shape)))
    bad = (~torch.isfinite(logits)).sum().item()
    if not bad:
        return None
    where = first_nonfinite_module(model, **inputs)
    return Failure(f"forward gives {bad} non-finite logits; first non-finite module output: {where}",
                   dict(metric="nonfinite_logits", expected=0, observed=bad), {"first_nonfinite_module": where or "?"})


# -- backward -------------------------------------------------------------------------------------
@dataclass
class Gradients:
    with_grad: list[tuple[str, torch.nn.Parameter]]
    excused: list[str]  # no gradient, by design (a no_grad_ok glob)
    failure: Failure | None  # a parameter without a gradient, or with a non-finite one


def gradients(params: list[tuple[str, torch.nn.Parameter]], allowed: list[str], knob: str) -> Gradients:
    """Every trainable parameter after a backward: a gradient, finite, unless ``allowed`` (globs of
    the ``knob`` option) excuses its absence."""
    excused = [n for n, p in params if p.grad is None and any(fnmatch.fnmatchcase(n, g) for g in allowed)]
    with_grad = [(n, p) for n, p in params if p.grad is not None]
    missing = [n for n, p in params if p.grad is None and n not in excused]
    if missing:
        return Gradients(with_grad, excused, Failure(
            f"{len(missing)} trainable parameters got no gradient, first: {missing[:5]}",
            dict(metric="params_without_grad", expected=0, observed=len(missing),
                 details=f"if this is by design, list them in [checks.smoke] {knob}")))
    nonfinite = [n for n, p in with_grad if not torch.isfinite(p.grad).all()]
    if nonfinite:
        return Gradients(with_grad, excused, Failure(
            f"non-finite gradients in {len(nonfinite)} parameters, first: {nonfinite[:5]}",
            dict(metric="params_nonfinite_grad", expected=0, observed=len(nonfinite))))
    return Gradients(with_grad, excused, None)


def grad_norm(with_grad: list[tuple[str, torch.nn.Parameter]]) -> float:
    """Global L2 norm of the gradients."""
    return torch.linalg.vector_norm(torch.stack([p.grad.float().norm() for _, p in with_grad])).item()


def part_grad_norms(with_grad: list[tuple[str, torch.nn.Parameter]], parts: dict[str, str]) -> dict[str, float]:
    """L2 norm of the gradients in each wrapper part (vision, projector, text; 0.0 for a part without one)."""
    out = {}
    for part in ("vision", "projector", "text"):
        norms = [p.grad.float().norm() for n, p in with_grad if parts[n] == part]
        out[part] = torch.linalg.vector_norm(torch.stack(norms)).item() if norms else 0.0
    return out


def dead_parts(norms: dict[str, float], roots: dict[str, list[str]]) -> Failure | None:
    """A wrapper part that the loss gives zero gradient: the image path does not reach the loss."""
    dead = [f"{part} ({', '.join(roots.get(part, [])[:2]) or 'no module'})" for part, g in norms.items() if g == 0]
    if not dead:
        return None
    return Failure(f"the loss gives zero gradient to the wrapper's {', '.join(dead)}: the image path does not "
                   "reach the loss", dict(metric="grad_norm_" + dead[0].split()[0], expected="> 0", observed=0.0))


# -- train ----------------------------------------------------------------------------------------
def train_steps(model: torch.nn.Module, inputs: dict, labels: torch.Tensor, params: list[torch.nn.Parameter],
                lr: float, steps: int, synchronize) -> tuple[float | None, float]:
    """``steps`` AdamW steps on one batch, the first with the gradient the parameters already hold:
    (mean seconds of a later step, None for one step; the loss after them)."""
    # eps must survive the parameter dtype: AdamW's default 1e-8 is 0 in float16, and then
    # a zero second moment gives 0/0 = nan on the first step.
    eps = max(1e-8, 2 * torch.finfo(params[0].dtype).tiny)
    opt = torch.optim.AdamW(params, lr=lr, eps=eps)
    opt.step()  # step 1 uses the gradient we already have
    t = time.perf_counter()
    for _ in range(steps - 1):
        opt.zero_grad(set_to_none=True)
        model(**inputs, labels=labels).loss.backward()
        opt.step()
    synchronize()
    step_s = (time.perf_counter() - t) / (steps - 1) if steps > 1 else None
    with torch.no_grad():
        return step_s, model(**inputs, labels=labels).loss.item()


def loss_failure(loss0: float, loss1: float, steps: int) -> Failure | None:
    import math

    if not math.isfinite(loss1):
        return Failure(f"{steps} optimizer steps made the loss non-finite",
                       dict(metric="loss_final", expected="finite", observed=loss1))
    if not loss1 < loss0:
        return Failure(f"{steps} optimizer steps on a fixed batch did not lower the loss",
                       dict(metric="loss_final", expected=f"< {loss0:.6g} (loss_initial)", observed=f"{loss1:.6g}"))
    return None


# -- generate -------------------------------------------------------------------------------------
def greedy(model, ids: torch.Tensor, n: int, use_cache: bool) -> tuple[torch.Tensor, tuple]:
    """``n`` greedy new tokens [B, n] and each step's scores."""
    out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, use_cache=use_cache,
                         output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    return out.sequences[:, ids.shape[1]:], out.scores


def greedy_pair(model, ids: torch.Tensor, n: int):
    """(cached tokens, their scores, uncached tokens, their scores): ``n`` greedy tokens with the KV
    cache and with recomputation, no end-of-sequence stop."""
    model.eval()
    model.generation_config.eos_token_id = None  # generate exactly n tokens
    with torch.no_grad():
        cached, cached_scores = greedy(model, ids, n, True)
        plain, scores = greedy(model, ids, n, False)
    return cached, cached_scores, plain, scores


def tie_failure(cached: torch.Tensor, plain: torch.Tensor, scores, margin: float) -> tuple[Failure | None, str]:
    """The first token that differs is acceptable only where the uncached logits were near-tied (top-2
    gap within ``margin``): (the failure, or None and the note saying it was a near tie)."""
    b, t = (cached != plain).nonzero()[0].tolist()
    step = scores[t][b].float()
    gap = (step[plain[b, t]] - step[cached[b, t]]).item()
    if gap > margin:
        return Failure(f"greedy generation with KV cache differs from generation without it "
                       f"(sequence {b}, new token {t}: {cached[b, t].item()} vs {plain[b, t].item()})",
                       dict(metric="generation_tie_gap", expected=f"<= {margin} (near tie)", observed=f"{gap:.6g}",
                            tolerance=margin)), ""
    return None, f"cached/uncached generation differ at a near tie (gap {gap:.3g} <= {margin})"


def shared_steps(cached: torch.Tensor, plain: torch.Tensor, n: int) -> int:
    """Decoded steps whose logits condition on the same tokens with and without the cache: up to and
    including the first token mismatch (which still shares its prefix), of ``n``."""
    diff = (cached != plain).any(0).nonzero()
    return int(diff[0]) + 1 if len(diff) else n


# Cached and uncached decoding are two roundings of one computation, each off float64 by the dtype's own error
# e at that step: they differ by up to ~2e, and the cached path's kernels may round worse than the uncached
# ones (a decode kernel's split over the cache): 3e. A cache fault (a stale page, a wrong position) moves
# logits by 1e-2 and more, far past it.
OWN_ERROR_FACTOR = 3.0


def cache_budgets(budget: float, own: list[float | None]) -> list[float]:
    """Each step's budget: the dtype's tolerance, or ``OWN_ERROR_FACTOR`` x its own error there if more."""
    return [max(budget, OWN_ERROR_FACTOR * o) if o is not None else budget for o in own]


def cache_logits_failure(errs: list[float], budget: float, dtype: str,
                         own: list[float | None] | None = None) -> Failure | None:
    """The first decoded step whose logits with the cache differ from recomputation beyond its budget: the
    dtype's tolerance ``budget``, or where ``own`` (the dtype's own error against float64 per step,
    ``harness.checks.smoke._own_errors``) was measured, ``OWN_ERROR_FACTOR`` times it if that is more."""
    own = own or [None] * len(errs)
    budgets = cache_budgets(budget, own)
    bad = next((t for t, e in enumerate(errs) if not e <= budgets[t]), None)
    if bad is None:
        return None
    why = (f"the {dtype} tolerance {budget:.3g}" if budgets[bad] == budget else
           f"{OWN_ERROR_FACTOR:g} x this {dtype} run's own error against float64 at that step, {own[bad]:.3g}, "
           f"above the {dtype} tolerance {budget:.3g}")
    return Failure(f"decode logits with the KV cache differ from recomputation without it at new token {bad} "
                   f"(rel_rmse {errs[bad]:.3g} > {why})",
                   dict(metric="generation_cache_logits_rel_rmse", expected=f"<= {budgets[bad]:.3g}",
                        observed=f"{max(errs):.4g}", tolerance=budgets[bad]))


# -- the multimodal wrapper variant ---------------------------------------------------------------
def wrapper_batch(ls, cfg):
    """(the pruned wrapper's ModelConfig, its seeded ImageBatch) for suite ``ls`` and the smoke
    options ``cfg``; NotRunnable where this transformers cannot build it."""
    from harness.models.build import model_config
    from harness.models.config import ModelBuildError
    from harness.models.wrapper import image_batch, supported, wrapper_config

    why = supported(ls.raw_config)
    if why:
        raise NotRunnable(why)
    try:
        mc, _ = wrapper_config(ls, model_config(ls), cfg.wrapper_overrides)
        batch = image_batch(mc.config, cfg.batch_size, cfg.seq_len, cfg.seed + 1, architecture=mc.architecture)
    except ModelBuildError as e:
        raise NotRunnable(f"the installed transformers cannot build it: {e}") from None
    return mc, batch


def wrapper_model(mc, seed: int, dtype: str, device, transform=None) -> torch.nn.Module:
    """The wrapper with seeded weights, cast as a deployed model is; ``transform`` (tests inject a
    fault with it) applied last."""
    from harness.models.config import architecture_class

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = architecture_class(mc.architecture)(mc.config)
    model = cast_model(model, torch_dtype(dtype), device)
    if transform is not None:
        model = transform(model) or model
    return model


def on_device(inputs: dict, dtype: str, device) -> dict:
    """Model inputs on ``device``, the floating ones (pixels) in the run's dtype."""
    dt = torch_dtype(dtype)
    return {k: (v.to(device, dt) if v.is_floating_point() else v.to(device)) for k, v in inputs.items()}


def other_image_inputs(mc, cfg, inputs: dict, dtype: str, device) -> dict:
    """``inputs`` with a second seeded image (same text), in the run's dtype and device."""
    from harness.models.wrapper import image_batch

    other = image_batch(mc.config, cfg.batch_size, cfg.seq_len, cfg.seed + 1, image_seed=cfg.seed + 1000,
                        architecture=mc.architecture)
    return {**inputs, **on_device({k: v for k, v in other.inputs.items() if k != "input_ids"}, dtype, device)}


def part_roots(model: torch.nn.Module) -> dict[str, list[str]]:
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


def call_error(e: Exception, model: torch.nn.Module, inputs: dict, roots: dict[str, list[str]],
               batch) -> Failure | str | None:
    """What the wrapper's forward raising ``e`` means: the model's own image-token check failing is a
    Failure naming the parts; transformers' own wrapper forward failing on its own objects, with the
    image or without one, is a wrapper this transformers cannot run (the reason, a str); anything else
    (e.g. a vision module that returns None) is None: a model fault to raise as it is."""
    if isinstance(e, ValueError) and "do not match" in str(e):
        proj = ", ".join(roots.get("projector", [])[:2]) or "?"
        said = " ".join(str(e).split())
        return Failure(f"image features do not match the image tokens: the input holds {batch.image_tokens} image "
                       f"tokens per sequence ({batch.how}), the vision tower + projector ({proj}) produced a "
                       f"different number of features: {said}",
                       dict(metric="image_tokens", expected=batch.image_tokens, observed=said))
    if not isinstance(e, AttributeError):
        return None
    where = _transformers_frame(e, model)
    if where and _fails_text_only(model, inputs["input_ids"]):
        import transformers

        return (f"transformers {transformers.__version__} cannot run {type(model).__name__}.forward: "
                f"AttributeError: {e} ({where})")
    return None


def image_path(model: torch.nn.Module, inputs: dict, other: dict, image_tokens: int,
               roots: dict[str, list[str]]) -> tuple[float, Failure | None]:
    """Does the image reach the logits? (max |logits(image A) - logits(image B)| at the text positions
    after the image, for ``inputs`` and ``other`` that differ in the image alone; where it is 0, the
    failure naming the first vision/projector module, in the order they finish, whose input changed
    but output did not: the ``image_path_break`` detail).
    """
    from harness.anatomy.moe import module_part

    after = slice(1 + image_tokens, None)  # text positions after the image
    seen: dict[str, list] = {}
    hook = _io_recorder(model, seen)
    watch = _watched(model, roots)
    logits = [_hooked_logits(model, x, after, watch, hook) for x in (inputs, other)]
    change = (logits[0] - logits[1]).abs().max().item()
    if change > 0:
        return change, None
    culprit = _ignores_its_input(seen)
    part = module_part(culprit) if culprit else None
    where = (f"the {part} module {culprit} ignores its input (same output for both images)" if culprit else
             "every vision/projector module's output follows the image, so the merge of image features into "
             "the token embeddings loses it")
    return change, Failure(f"the image does not reach the logits: two different images give identical logits after "
                           f"the image; {where}", dict(metric="image_logit_change", expected="> 0", observed=change),
                           {"image_path_break": culprit or "merge"})


def _watched(model: torch.nn.Module, roots: dict[str, list[str]]) -> list[torch.nn.Module]:
    """The vision/projector modules whose input and output are recorded: those with parameters of
    their own, and each part's root."""
    from harness.anatomy.moe import module_part

    # Modules with parameters only: a rotary or position module's output legitimately ignores the
    # pixels it is handed (positions only); its parent then answers for a broken child.
    return [m for n, m in model.named_modules() if n and module_part(n) != "text"
            and any(True for _ in m.parameters(recurse=False))
            or n and module_part(n) != "text" and any(r == n for rs in roots.values() for r in rs)]


def _io_recorder(model: torch.nn.Module, seen: dict[str, list]):
    """A forward hook appending a module's floating (inputs, outputs) to ``seen`` under its name."""
    names = {m: n for n, m in model.named_modules()}

    def hook(mod, args, kwargs, out):
        seen.setdefault(names[mod], []).append((
            [t.detach().clone() for t in tensors((args, kwargs)) if t.is_floating_point()],
            [t.detach().clone() for t in tensors(out) if t.is_floating_point()]))
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
