"""A multimodal wrapper end to end: the pruned wrapper (language decoder + tiny vision tower +
projector) and a seeded synthetic image laid out as the model's own processor lays it out.

What the smoke check's ``wrapper`` variant builds (docs/adding-a-model.md):

* **config**: the published config.json with the suite's ``[prune]`` applied to the text part (as the
  suite's own decoder build does), the vision part pruned by ``harness.models.prune.plan_wrapper_vision``
  from the *effective* vision config (what transformers reads, defaults included: Llama-4-Scout's
  corpus config has no ``vision_config``; Kimi-K2.5's remote-code ``vt_*`` keys are not read by
  transformers' ``Kimi_K25VisionConfig``), then ``[checks.smoke] wrapper_overrides``;
* **image**: one seeded RGB image per sequence. Where transformers has an image processor that runs
  offline without torchvision (Qwen-VL's and Gemma 4's PIL processors, built from the pruned config's
  patch / merge / pooling sizes, no Hub files) it makes ``pixel_values`` and the grid; otherwise
  (Llama 4, Kimi-K2.5: torchvision-only processors) ``pixel_values`` are built directly in the layout
  and value range their processor produces, from the config. The number of image tokens per image is
  the processor's formula (grid / merge², pixel-shuffle ratio, pooled soft tokens), and the sequence
  is ``[text token, image tokens..., text tokens...]`` with labels -100 on the image positions.

Nothing is downloaded: a processor that needs Hub files is never used.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from harness.models.config import (
    ModelBuildError,
    ModelConfig,
    _remap_token_ids,
    _set_path,
    apply_prune,
    build_config,
)

TEXT_PARTS = ("text_config", "language_config", "llm_config")


class WrapperNotApplicable(ModelBuildError):
    """The installed transformers cannot run this wrapper end to end: one line saying why."""


@dataclass
class ImageBatch:
    """Model inputs for one forward with an image per sequence."""

    inputs: dict  # input_ids [B, S], pixel_values, grids, ... (everything model(**inputs) takes)
    labels: torch.Tensor  # [B, S], -100 on image positions
    image_tokens: int  # per sequence
    how: str  # "processor Qwen2VLImageProcessorPil" or "built from the config (...)"
    notes: list[str] = field(default_factory=list)


def text_part(raw: dict) -> str | None:
    return next((k for k in TEXT_PARTS if isinstance(raw.get(k), dict)), None)


def is_wrapper(raw: dict) -> bool:
    """A multimodal wrapper config: a nested text config beside (or with defaults for) a vision part."""
    return text_part(raw) is not None


def wrapper_architecture(raw: dict) -> str:
    """The wrapper's own class through transformers' registries (never the suite's decoder override)."""
    from harness.models.config import resolve_architecture

    arch, _, _ = resolve_architecture(raw)
    return arch


def _effective(raw: dict, arch: str) -> object:
    """The unpruned wrapper config transformers builds (sub-config defaults filled in)."""
    return build_config(raw, None, architecture=arch).config


def wrapper_config(ls, suite_mc: ModelConfig, overrides: dict | None = None) -> tuple[ModelConfig, list[str]]:
    """The pruned wrapper for suite ``ls`` (whose own build is ``suite_mc``) and the reasons."""
    from harness.models.prune import plan_wrapper_vision

    raw = ls.raw_config
    part = text_part(raw)
    if part is None:
        raise WrapperNotApplicable("not a multimodal wrapper (no text_config)")
    arch = wrapper_architecture(raw)
    d = copy.deepcopy(raw)
    if suite_mc.part:  # the suite builds the decoder from text_config: its [prune] is the text part's
        apply_prune(d[part], ls.suite.prune)
    else:  # the suite builds the wrapper itself (dotted keys reach every part)
        apply_prune(d, ls.suite.prune)
    full = _effective(raw, arch)
    text_hidden = suite_mc.config.get_text_config().hidden_size if hasattr(suite_mc.config, "get_text_config") \
        else suite_mc.config.hidden_size
    up, why = plan_wrapper_vision(full, text_hidden)
    for k, v in {**up, **(overrides or {})}.items():
        _set_path(d, k, v)
    for k, v in full.to_dict().items():  # token ids transformers fills in (Llama 4's image_token_index)
        if k not in d and k.endswith(("token_id", "token_index")) and isinstance(v, int) and not isinstance(v, bool):
            d[k] = v
    _remap_token_ids(d, None)
    mc = build_config(d, None, architecture=arch)
    mc.notes[:0] = [f"wrapper {arch} end to end: text part pruned as the suite's [prune], vision part: "
                    + "; ".join(why)]
    return mc, why


# --- synthetic images ----------------------------------------------------------------------------

def _image(seed: int, size: int, width: int | None = None) -> torch.Tensor:
    """A seeded RGB image [3, size, width or size] in [0, 255] (uint8), identical on every backend."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (3, size, width or size), generator=g, dtype=torch.uint8)


def _qwen_vl(cfg, n: int, seed: int):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    vc = cfg.vision_config
    p, m, t = vc.patch_size, vc.spatial_merge_size, vc.temporal_patch_size
    side = p * m * 2  # a 2x2 grid of merged tokens: 4 image tokens per image
    proc = Qwen2VLImageProcessorPil(patch_size=p, merge_size=m, temporal_patch_size=t,
                                    size={"shortest_edge": side * side, "longest_edge": side * side})
    out = proc([_image(seed + i, side).permute(1, 2, 0).numpy() for i in range(n)], return_tensors="pt")
    grid = out["image_grid_thw"]  # [n, 3]
    per = int(grid[0].prod()) // (m * m)
    return {"pixel_values": out["pixel_values"], "image_grid_thw": grid}, per, type(proc).__name__, \
        {"mm_token_type_ids": 1}


def _gemma4(cfg, n: int, seed: int):
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    vc = cfg.vision_config
    # 70 is the smallest soft-token budget the processor accepts; it resizes the image to fill it.
    proc = Gemma4ImageProcessorPil(patch_size=vc.patch_size, pooling_kernel_size=vc.pooling_kernel_size,
                                   max_soft_tokens=70)
    out = proc([_image(seed + i, 48).permute(1, 2, 0).numpy() for i in range(n)], return_tensors="pt")
    per = int(out["num_soft_tokens_per_image"][0])
    return {"pixel_values": out["pixel_values"], "image_position_ids": out["image_position_ids"]}, per, \
        type(proc).__name__, {"mm_token_type_ids": 1}


def _llama4(cfg, n: int, seed: int):
    vc = cfg.vision_config
    side = vc.image_size
    # Llama4ImageProcessor (torchvision only): rescale 1/255, normalize mean 0.5 std 0.5 -> [-1, 1];
    # one tile per image; tokens per tile: (side / patch)^2 patches after pixel shuffle by the ratio.
    px = torch.stack([_image(seed + i, side).float() / 255 for i in range(n)]) * 2 - 1  # [n, 3, side, side]
    per = int((side // vc.patch_size) ** 2 * vc.pixel_shuffle_ratio ** 2)
    return {"pixel_values": px}, per, "built from the config (Llama4ImageProcessor needs torchvision)", {}


def _kimi_k25(cfg, n: int, seed: int):
    vc = cfg.vision_config
    p = vc.patch_size
    kh, kw = vc.merge_kernel_size
    gh, gw = 2 * kh, 2 * kw  # a 2x2 grid of merged tokens
    # Kimi_K25ImageProcessor (torchvision only): normalize mean/std 0.5 -> [-1, 1], then patchify to
    # [grid_h * grid_w, 3, p, p] per image (its `patchify`), images concatenated; grid [1, gh, gw].
    imgs = [_image(seed + i, p * gh, p * gw).float() / 255 * 2 - 1 for i in range(n)]
    patches = [im.reshape(3, gh, p, gw, p).permute(1, 3, 0, 2, 4).reshape(gh * gw, 3, p, p) for im in imgs]
    grid = torch.tensor([[1, gh, gw]] * n)
    return {"pixel_values": torch.cat(patches), "image_grid_thw": grid}, (gh * gw) // (kh * kw), \
        "built from the config (Kimi_K25ImageProcessor needs torchvision)", {}


# Wrapper config model_type -> how its processor lays out an image. Keyed by transformers' model
# types, because the layout is the processor's, which the model type names.
LAYOUTS: dict[str, Callable] = {
    "qwen2_vl": _qwen_vl, "qwen2_5_vl": _qwen_vl, "qwen3_vl": _qwen_vl, "qwen3_vl_moe": _qwen_vl,
    "qwen3_5": _qwen_vl, "qwen3_5_moe": _qwen_vl, "gemma4": _gemma4, "llama4": _llama4, "kimi_k25": _kimi_k25,
}


def _special_ids(cfg) -> set[int]:
    out = set()
    for k, v in cfg.to_dict().items():
        if (k.endswith(("token_id", "token_index")) and isinstance(v, int) and not isinstance(v, bool)):
            out.add(v)
    return out


def image_batch(cfg, batch: int, text_len: int, seed: int, image_seed: int | None = None) -> ImageBatch:
    """``batch`` sequences of ``[text, image tokens..., text x (text_len - 1)]`` with one image each
    (images from ``image_seed``, default ``seed``: a second image for the same text)."""
    from harness.models.build import seeded_tokens

    layout = LAYOUTS.get(getattr(cfg, "model_type", ""))
    if layout is None:
        raise WrapperNotApplicable(f"no image layout known for model_type {cfg.model_type!r} (harness/models/"
                                   "wrapper.py LAYOUTS)")
    image_id = getattr(cfg, "image_token_id", None)
    if image_id is None:
        image_id = getattr(cfg, "image_token_index", None)
    if image_id is None:
        raise WrapperNotApplicable(f"{type(cfg).__name__} has no image_token_id")
    with torch.random.fork_rng(devices=[]):
        extra, per, how, types = layout(cfg, batch, seed if image_seed is None else image_seed)
    vocab = cfg.get_text_config().vocab_size
    ids = seeded_tokens(vocab, batch, text_len, seed)  # [B, text_len]
    specials = _special_ids(cfg)
    free = next(i for i in range(vocab) if i not in specials)
    for s in specials:
        ids[ids == s] = free  # text positions never hold an image/video/boundary token
    img = torch.full((batch, per), image_id, dtype=ids.dtype)
    input_ids = torch.cat([ids[:, :1], img, ids[:, 1:]], dim=1)  # [B, text_len + per]
    labels = input_ids.clone()
    labels[:, 1:1 + per] = -100
    inputs = {"input_ids": input_ids, **extra}
    for k, v in types.items():  # the processor's modality ids (text 0, image 1) where the model wants them
        tt = torch.zeros_like(input_ids)
        tt[:, 1:1 + per] = v
        inputs[k] = tt
    return ImageBatch(inputs, labels, per, how)


def supported(raw: dict) -> str | None:
    """None when the wrapper variant can run on this config, else one line saying why not."""
    if not is_wrapper(raw):
        return "not a multimodal wrapper (no text_config)"
    try:
        arch = wrapper_architecture(raw)
    except ModelBuildError as e:
        return str(e)
    import transformers

    cls = getattr(transformers, arch)
    mt = getattr(getattr(cls, "config_class", None), "model_type", "")
    if mt not in LAYOUTS:
        return f"{arch}: no image layout for model_type {mt!r} in harness/models/wrapper.py"
    return None
