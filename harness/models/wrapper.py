"""A multimodal wrapper end to end: the pruned wrapper (language decoder + tiny vision tower +
projector) and a seeded synthetic image laid out as the model's own processor lays it out.

What the smoke check's ``wrapper`` variant builds (docs/adding-a-model.md):

* **config**: the published config.json with the suite's ``[prune]`` applied to the text part (as the
  suite's own decoder build does), the vision part pruned by ``harness.models.prune.plan_wrapper_vision``
  from the *effective* vision config (what transformers reads, defaults included: Llama-4-Scout's
  corpus config has no ``vision_config``; Kimi-K2.5's remote-code ``vt_*`` keys are not read by
  transformers' ``Kimi_K25VisionConfig``), then ``[checks.smoke] wrapper_overrides``;
* **image**: one seeded RGB image per sequence, made by the wrapper's *own* image processor: the class
  transformers' image-processor registry names for its model type (a type with no entry of its own
  takes its family's, qwen3_vl_moe -> qwen3_vl), the PIL backend (torchvision is not a dependency),
  its knobs (patch / merge / temporal patch / pooling sizes, a fixed tower's image size) read from the
  pruned vision config, its token or patch budget the smallest it accepts. No model type is listed.
  Where transformers ships only a torchvision processor, ``pixel_values`` are built from the config in
  its layout and value range where harness reproduces it (``CONFIG_BUILT``: Llama 4, Kimi-K2.5, LFM2-VL),
  otherwise in the first shape built from the vision config (patch, channels, temporal patch, merge
  sizes) that the tiny wrapper's own ``get_image_features`` takes (``_from_shapes``: Muse-Glimmer's
  patches [N, T*C*p*p] with image_grid_thw), and where none fits the item is NotApplicable in one line
  naming the processor.
* **image tokens**: how many positions one image fills is counted by the model itself: a float32 CPU
  copy of the tiny wrapper runs to its ``get_placeholder_mask``, whose image features [tokens, hidden]
  are the count it will check (or the rows of ``get_image_features`` where a model has no such check).
  The sequence is ``[text token, image tokens..., text tokens...]`` with labels -100 on the image
  positions and the modality ids (``mm_token_type_ids`` / ``token_type_ids``: 1 on the image) where
  the model's forward takes them.

Nothing is downloaded: a processor that needs Hub files is never used.
"""

from __future__ import annotations

import copy
import functools
import re
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
    tc = suite_mc.config.get_text_config() if hasattr(suite_mc.config, "get_text_config") else suite_mc.config
    up, why = plan_wrapper_vision(full, tc.hidden_size, tc)
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


def _lfm2_vl(cfg, n: int, seed: int):
    vc = cfg.vision_config
    p = vc.patch_size
    f = getattr(cfg, "downsample_factor", 2)
    side = p * f * 2  # a 2x2 grid of tokens after the f x f pixel unshuffle: one tile, no split
    # Lfm2VlImageProcessor (torchvision only), an image below its split threshold: resized to a multiple
    # of patch x factor (this side already is), rescale 1/255, normalize mean/std 0.5 -> [-1, 1], then
    # its convert_image_to_patches: [C, H, W] -> [H/p x W/p patches, p * p * C] with each patch's pixels
    # row-major and channels last; padded (do_pad) to its max_num_patches with a 0/1 pixel_attention_mask.
    # Here the pad is 4 patches past the image (the processor pads to max_image_tokens x factor^2), so the
    # tower's masked positions are exercised without a 1024-patch sequence; spatial_shapes [rows, cols].
    g = side // p
    pad = 4
    imgs = torch.stack([_image(seed + i, side).float() / 255 * 2 - 1 for i in range(n)])  # [n, 3, side, side]
    patches = imgs.reshape(n, 3, g, p, g, p).permute(0, 2, 4, 3, 5, 1).reshape(n, g * g, p * p * 3)
    px = torch.nn.functional.pad(patches, (0, 0, 0, pad))  # [n, g*g + pad, p*p*3]
    mask = torch.ones(n, g * g + pad, dtype=torch.int32)
    mask[:, g * g:] = 0
    shapes = torch.tensor([[g, g]] * n)
    return {"pixel_values": px, "pixel_attention_mask": mask, "spatial_shapes": shapes}, None, \
        "built from the config (Lfm2VlImageProcessor needs torchvision)", {}


def _vision_int(vc, *parts: str, default: int = 1) -> int:
    """The first positive integer attribute of ``vc`` whose name contains one of ``parts``."""
    for k, v in sorted(vars(vc).items()):
        if isinstance(v, int) and not isinstance(v, bool) and v > 0 and any(x in k for x in parts):
            return v
    return default


def _shape_candidates(cfg, n: int, seed: int, params: set[str]) -> list[tuple[str, dict]]:
    """Inputs of the shapes a vision tower may take, from its config: patches [N, C*T*p*p] (Qwen-VL's
    Conv3d / Muse-Glimmer's Linear patch embedding) or [N, C, p, p] with a [t, h, w] grid per image where
    get_image_features takes a grid, else whole images [n, C, side, side]. Pixels: seeded, in [-1, 1]
    (rescale 1/255, mean/std 0.5), repeated over the temporal patch as a still image is."""
    vc = cfg.vision_config
    p = getattr(vc, "patch_size", None) or 14
    c = _vision_int(vc, "num_channels", "in_channels", default=3)
    t = _vision_int(vc, "temporal")
    merge = _vision_int(vc, "spatial_merge_size", "merge_size", "downsample_factor", "merge_kernel")
    grid_key = next((k for k in sorted(params) if "grid" in k), None)
    if grid_key is None:
        fixed = getattr(vc, "image_size", None)
        side = fixed if isinstance(fixed, int) and fixed > 0 else p * merge * 2
        px = torch.stack([_image(seed + i, side).float() / 255 * 2 - 1 for i in range(n)])
        return [(f"images [{n}, {c}, {side}, {side}]", {"pixel_values": px[:, :c]})]
    g = 2 * merge  # a 2x2 grid of merged tokens per image
    imgs = [_image(seed + i, p * g).float()[:c] / 255 * 2 - 1 for i in range(n)]
    patches = torch.cat([im.reshape(c, g, p, g, p).permute(1, 3, 0, 2, 4).reshape(g * g, c, p, p) for im in imgs])
    flat = patches.unsqueeze(2).expand(-1, -1, t, -1, -1).reshape(n * g * g, c * t * p * p)
    grid = {grid_key: torch.tensor([[1, g, g]] * n)}
    return [(f"patches [{n * g * g}, {c * t * p * p}] (C*T*p*p) + {grid_key}", {"pixel_values": flat, **grid}),
            (f"patches [{n * g * g}, {c}, {p}, {p}] + {grid_key}", {"pixel_values": patches, **grid})]


def _from_shapes(cfg, n: int, seed: int, *, processor: str, architecture: str | None = None):
    """A torchvision-only processor with no CONFIG_BUILT layout: the image inputs built from the vision
    config in the first shape (``_shape_candidates``) the tiny wrapper's own get_image_features takes
    (a float32 CPU copy runs it); the model's own check then counts the image tokens. The values are
    seeded pixels in the processor's usual range, not its patch order: they are noise either way, and
    the item checks that the image reaches the logits, not what it shows. None fits: one line."""
    import inspect

    from harness.models.config import architecture_class

    arch = architecture or (getattr(cfg, "architectures", None) or [""])[0]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = architecture_class(arch)(copy.deepcopy(cfg)).float().eval()
    params = set(inspect.signature(model.get_image_features).parameters)
    tried = []
    for what, inputs in _shape_candidates(cfg, n, seed, params):
        try:
            _image_feature_rows(model, inputs)
        except Exception as e:  # noqa: BLE001 - not the shape this tower takes: the next candidate
            tried.append(f"{what}: {type(e).__name__}")
            continue
        return inputs, None, f"built from the config ({processor} needs torchvision): {what}", {}
    raise WrapperNotApplicable(
        f"its image processor {processor} needs torchvision, which is not installed, and no input shape "
        f"built from the vision config fits {arch}.get_image_features({', '.join(sorted(params - {'kwargs'}))}) "
        f"(tried {'; '.join(tried)}): pip install torchvision matching the installed torch")


# Processors transformers ships only for torchvision (not a dependency here): the layout and value
# range they produce, built from the config. Keyed by the processor's class name, the thing whose
# output they reproduce; any other processor runs itself (_from_processor).
CONFIG_BUILT: dict[str, Callable] = {"Llama4ImageProcessor": _llama4, "Kimi_K25ImageProcessor": _kimi_k25,
                                      "Lfm2VlImageProcessor": _lfm2_vl}

# The processor's knobs read from the (pruned) vision config: processor kwarg -> config attributes.
FROM_VISION = {"patch_size": ("patch_size",), "temporal_patch_size": ("temporal_patch_size",),
               "merge_size": ("spatial_merge_size", "merge_size"), "pooling_kernel_size": ("pooling_kernel_size",),
               "downsample_factor": ("downsample_factor",)}
# A processor's own budget of tokens / patches / tiles per image: the smallest it accepts keeps the
# vision tower's sequence short (Gemma 4: 70 soft tokens, 630 patches, instead of 280 and 2520).
BUDGET = re.compile(r"^max_\w*(tokens|patches|tiles)$")


def _torchvision() -> bool:
    import importlib.util

    return importlib.util.find_spec("torchvision") is not None


def processor_names(model_type: str) -> tuple[dict, str]:
    """({backend: image processor class name}, the model type they are registered under). A model type
    with no entry of its own takes the longest registered prefix (qwen3_vl_moe: qwen3_vl's processor;
    its checkpoints name that class in preprocessor_config.json)."""
    from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING_NAMES as names

    mt = model_type
    while mt and mt not in names:
        mt = mt.rpartition("_")[0]
    return (dict(names[mt]), mt) if mt else ({}, "")


def image_layout(model_type: str) -> tuple[Callable | None, str]:
    """(how to make this wrapper's image inputs, what that is) or (None, why it cannot be made here)."""
    from transformers.models.auto.image_processing_auto import get_image_processor_class_from_name

    names, under = processor_names(model_type)
    if not names:
        return None, f"transformers registers no image processor for model_type {model_type!r}"
    via = "" if under == model_type else f" (registered for {under})"
    for backend in ("pil", "torchvision"):
        name = names.get(backend)
        if not name or backend == "torchvision" and not _torchvision():
            continue
        cls = get_image_processor_class_from_name(name)
        if cls is not None:
            return functools.partial(_from_processor, processor=cls), f"processor {name}{via}"
    name = names.get("torchvision")
    if name in CONFIG_BUILT:
        return CONFIG_BUILT[name], f"built from the config ({name} needs torchvision)"
    if name:  # the tower's own get_image_features picks the shape (_from_shapes), or says none fits
        return functools.partial(_from_shapes, processor=name), f"built from the config ({name} needs torchvision)"
    return None, f"its image processors {names}{via} are none harness can run"


def _from_processor(cfg, n: int, seed: int, *, processor):
    """The wrapper's own image processor, its knobs read from the pruned vision config, on seeded
    images of side patch x merge x 2 (a 2x2 grid of merged tokens) or the tower's fixed image_size."""
    cls = processor
    vc = cfg.vision_config
    valid = set(getattr(getattr(cls, "valid_kwargs", None), "__annotations__", {}))
    kw = {}
    for key, attrs in FROM_VISION.items():
        v = next((getattr(vc, a) for a in attrs if isinstance(getattr(vc, a, None), int)), None)
        if key in valid and v:
            kw[key] = v
    patch = getattr(vc, "patch_size", None) or 14
    merge = next((getattr(vc, a) for a in ("spatial_merge_size", "merge_size", "downsample_factor",
                                           "pooling_kernel_size") if isinstance(getattr(vc, a, None), int)), 1)
    fixed = getattr(vc, "image_size", None)
    side = fixed if isinstance(fixed, int) and fixed > 0 else patch * merge * 2
    default = cls()
    for key in ("size", "crop_size"):  # a fixed-size tower: the processor resizes to it
        d = getattr(default, key, None)
        if isinstance(fixed, int) and isinstance(d, dict) and key in valid:
            if {"height", "width"} <= set(d):
                kw[key] = {"height": fixed, "width": fixed}
            elif set(d) == {"shortest_edge"}:
                kw[key] = {"shortest_edge": fixed}
    images = [_image(seed + i, side).permute(1, 2, 0).numpy() for i in range(n)]

    def run(extra):
        return cls(**{**kw, **extra})(images, return_tensors="pt")

    out = run({})
    for key in sorted(k for k in valid if BUDGET.match(k) and isinstance(getattr(default, k, None), int)):
        v = getattr(default, key)
        while v > 1:  # halve while the processor still accepts it
            try:
                trial = run({key: v // 2})
            except (ValueError, AssertionError):
                break
            v, out, kw[key] = v // 2, trial, v // 2
    return dict(out), None, type(default).__name__, {}


class _Counted(Exception):
    pass


def tokens_per_image(cfg, architecture: str, image_inputs: dict, n: int) -> int:
    """How many positions of the text one image fills, as the model itself checks it: a float32 CPU
    copy of the (tiny) wrapper runs up to its get_placeholder_mask, which receives the image features
    [total tokens, hidden]; where a model has none, the rows of get_image_features per image."""
    from harness.models.config import architecture_class

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = architecture_class(architecture)(copy.deepcopy(cfg)).float().eval()
    inputs = {k: (v.float() if v.is_floating_point() else v) for k, v in image_inputs.items()}
    total = _placeholder_tokens(model, cfg, inputs, n)
    if total is None:
        total = _image_feature_rows(model, inputs)
    if total % n:
        raise WrapperNotApplicable(f"{total} image tokens for {n} images: not the same number per image")
    return total // n


def _placeholder_tokens(model, cfg, inputs: dict, n: int) -> int | None:
    """The image features' rows its get_placeholder_mask receives in a forward of ``n`` prompts with
    one image token each; None where the model has none or the forward fails before it."""
    import inspect

    owner = next((m for m in model.modules() if "get_placeholder_mask" in type(m).__dict__), None)
    if owner is None:
        return None
    hidden = model.get_input_embeddings().embedding_dim
    seen: list[int] = []
    orig = owner.get_placeholder_mask
    sig = inspect.signature(orig)

    def spy(*a, **kw):
        f = sig.bind_partial(*a, **kw).arguments.get("image_features")
        if f is not None:
            seen.append(f.numel() // hidden)
            raise _Counted
        return orig(*a, **kw)

    owner.get_placeholder_mask = spy
    image_id = getattr(cfg, "image_token_id", None)
    image_id = getattr(cfg, "image_token_index", None) if image_id is None else image_id
    ids = torch.full((n, 4), 0, dtype=torch.long)
    ids[:, 1] = image_id
    fwd = set(inspect.signature(model.forward).parameters)
    try:
        with torch.no_grad():
            model(input_ids=ids, **{k: v for k, v in inputs.items() if k in fwd})
    except _Counted:
        pass
    except Exception:  # the forward fails before the check (Llama 4 in 5.24): count below
        pass
    finally:
        del owner.get_placeholder_mask
    return seen[0] if seen else None


def _image_feature_rows(model, inputs: dict) -> int:
    """The rows of get_image_features over all images."""
    import inspect

    params = set(inspect.signature(model.get_image_features).parameters)
    with torch.no_grad():
        out = model.get_image_features(**{k: v for k, v in inputs.items() if k in params})
    f = getattr(out, "pooler_output", None)
    f = f if f is not None else getattr(out, "last_hidden_state", out)
    total = sum(x.numel() for x in f) if isinstance(f, (list, tuple)) else f.numel()
    return total // f[0].shape[-1] if isinstance(f, (list, tuple)) else total // f.shape[-1]


def _special_ids(cfg) -> set[int]:
    out = set()
    for k, v in cfg.to_dict().items():
        if (k.endswith(("token_id", "token_index")) and isinstance(v, int) and not isinstance(v, bool)):
            out.add(v)
    return out


def image_batch(cfg, batch: int, text_len: int, seed: int, image_seed: int | None = None,
                architecture: str | None = None) -> ImageBatch:
    """``batch`` sequences of ``[text, image tokens..., text x (text_len - 1)]`` with one image each
    (images from ``image_seed``, default ``seed``: a second image for the same text)."""
    from harness.models.build import seeded_tokens

    layout, how = image_layout(getattr(cfg, "model_type", ""))
    if layout is None:
        raise WrapperNotApplicable(how)
    image_id = getattr(cfg, "image_token_id", None)
    if image_id is None:
        image_id = getattr(cfg, "image_token_index", None)
    if image_id is None:
        raise WrapperNotApplicable(f"{type(cfg).__name__} has no image_token_id")
    arch = architecture or (getattr(cfg, "architectures", None) or [""])[0]
    if isinstance(layout, functools.partial) and layout.func is _from_shapes:
        layout = functools.partial(layout, architecture=arch)
    with torch.random.fork_rng(devices=[]):
        extra, per, made, types = layout(cfg, batch, seed if image_seed is None else image_seed)
    if isinstance(made, str) and made.startswith("built from the config") and len(made) > len(how):
        how = made  # the shape the tower took
    import inspect

    from harness.models.config import architecture_class

    fwd = set(inspect.signature(architecture_class(arch).forward).parameters)
    extra = {k: v for k, v in extra.items() if k in fwd and isinstance(v, torch.Tensor)}
    if per is None:
        key = (id(cfg), tuple((k, tuple(v.shape)) for k, v in extra.items()))
        if key not in _COUNTS:
            _COUNTS[key] = tokens_per_image(cfg, arch, extra, batch)
        per = _COUNTS[key]
        how = f"{how}: {per} image tokens per image, counted by the model's own check"
    for k in ("mm_token_type_ids", "token_type_ids"):  # the processor's modality ids (text 0, image 1)
        if k in fwd and k not in types:
            types[k] = 1
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


_COUNTS: dict = {}  # (config, image input shapes) -> image tokens per image


def supported(raw: dict) -> str | None:
    """None when the wrapper variant can run on this config, else one line saying why not."""
    if not is_wrapper(raw):
        return "not a multimodal wrapper (no text_config)"
    try:
        arch = wrapper_architecture(raw)
    except ModelBuildError as e:
        return str(e)
    from harness.models.config import architecture_class

    mt = getattr(getattr(architecture_class(arch), "config_class", None), "model_type", "")
    layout, why = image_layout(mt)
    if layout is None:
        return f"{arch}: {why}"
    return None
