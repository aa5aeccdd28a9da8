"""KV-cache faults of the kind a Day-0 serving port makes, injected into transformers' own caches.

Every fault leaves the prefill exact (the prefill attends to its fresh keys and values) and breaks
only what a decode step reads back from the cache - the class of bug the ``decode`` check exists for:

* :func:`key_shift` - each earlier position's key handed to attention one position off (a paged
  cache's block table or a ring-buffer index off by one);
* :func:`value_dtype` - the value cache written in another dtype (rounded through bf16 in a float32
  run, through float8 e4m3 in a bfloat16 run: bf16 values are exact in fp16);
* :func:`sliding_short` - the sliding window one position short (a window treated as exclusive);
* :func:`stale_position` (a transform) - decode steps get a position id one behind (the counter
  read before the prefill's last token was counted).

The first three patch ``Cache.update`` / the sliding layers' constructor for the duration of a
``with``; they apply to the dynamic, static and quantized caches alike.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode
from transformers import cache_utils


def _new_index(keys: torch.Tensor, key_states: torch.Tensor) -> int | None:
    """Where the step's new key [B, h, 1, d] sits in the keys the cache hands attention [B, h, L, d]
    (last for a dynamic cache, the write position for a static one); None during the prefill."""
    if key_states.shape[-2] != 1 or keys.shape[-2] < 2:
        return None
    hit = (keys == key_states).flatten(0, 1).all(-1).all(0).nonzero()
    return int(hit[-1]) if len(hit) else None


@contextlib.contextmanager
def _patched_update(change):
    """``Cache.update`` whose returned (keys, values) go through ``change(keys, values, i)`` at decode
    steps, ``i`` the new position's index."""
    orig = cache_utils.Cache.update

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        keys, values = orig(self, key_states, value_states, layer_idx, *args, **kwargs)
        i = _new_index(keys, key_states)
        return (keys, values) if i is None else change(keys, values, i)

    cache_utils.Cache.update = update
    try:
        yield
    finally:
        cache_utils.Cache.update = orig


def key_shift():
    """Keys of positions 1..i-1 replaced by their predecessor's (position 0's key twice)."""
    def change(keys, values, i):
        k = keys.clone()
        k[..., 1:i, :] = keys[..., 0 : i - 1, :]
        return k, values

    return _patched_update(change)


def value_dtype(run_dtype: str):
    """Cached values (all but the new position's) rounded through the wrong storage dtype."""
    wrong = torch.bfloat16 if run_dtype == "float32" else torch.float8_e4m3fn

    def change(keys, values, i):
        v = values.clone()
        v[..., :i, :] = values[..., :i, :].to(wrong).to(values.dtype)
        return keys, v

    return _patched_update(change)


@contextlib.contextmanager
def sliding_short():
    """Every sliding-window cache layer built with a window one position short."""
    patched = []
    for cls in (cache_utils.DynamicSlidingWindowLayer, cache_utils.StaticSlidingWindowLayer):
        orig = cls.__init__

        def init(self, *args, _orig=orig, sliding_window=None, **kwargs):
            _orig(self, *args, sliding_window=sliding_window - 1, **kwargs)

        cls.__init__ = init
        patched.append((cls, orig))
    try:
        yield
    finally:
        for cls, orig in patched:
            cls.__init__ = orig


def stale_position(model: torch.nn.Module) -> torch.nn.Module:
    """Decode steps (one new token) run at the position before their own."""
    def pre(_mod, args, kwargs):
        ids, pos = kwargs.get("input_ids"), kwargs.get("position_ids")
        if ids is not None and pos is not None and ids.shape[1] == 1:
            kwargs = {**kwargs, "position_ids": pos - 1}
        return args, kwargs

    model.register_forward_pre_hook(pre, with_kwargs=True)
    return model


# fault -> (check options for a run dtype, which layers it is born in: "attention" (every layer with
# a KV cache) or "sliding")
FAULTS = {
    "key_shift": (lambda dt: {"context": key_shift}, "attention"),
    "value_dtype": (lambda dt: {"context": lambda: value_dtype(dt)}, "attention"),
    "sliding_short": (lambda dt: {"context": sliding_short}, "sliding"),
    "stale_position": (lambda dt: {"transform": stale_position}, "attention"),
}


def first_layer(entry: dict, born: str) -> str | None:
    """The decode section's first layer where a fault born in ``born`` layers can show."""
    kinds = ("sliding_attention",) if born == "sliding" else ("full_attention", "sliding_attention",
                                                               "chunked_attention")
    return next((n for n, t in zip(entry["layers"], entry["layer_types"], strict=True) if t in kinds), None)


class DecodeStepFlip(TorchFunctionMode):
    """What a near-tie does to a correct backend: in every decode step (a router call over B tokens,
    ``[B, E]`` scores), token 0's k-th chosen expert is replaced by the (k+1)-th best - the choice a
    rounding-level change of two nearly equal scores flips. Not a cache fault: the decode check forces
    the routers to the golden's choices and counts the flip, instead of failing the token for it."""

    def __init__(self, tokens: int):
        super().__init__()
        self.tokens, self.flipped = tokens, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in (torch.topk, torch.Tensor.topk):
            x, k = args[0], args[1] if len(args) > 1 else kwargs.get("k")
            if x.dim() == 2 and x.shape[0] == self.tokens and x.is_floating_point() and k < x.shape[1]:
                nxt = torch.topk(x, k + 1, dim=-1)
                idx, vals = out[1].clone(), out[0].clone()
                idx[0, -1], vals[0, -1] = nxt[1][0, -1], nxt[0][0, -1]
                self.flipped += 1
                out = torch.return_types.topk((vals, idx))
        return out
