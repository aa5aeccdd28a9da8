"""A float64 reference that says nothing is refused before it becomes a golden.

Everything downstream compares against the reference: if its logits are all 0.0, every low-precision
run of the same model also gives 0.0 and precision, decode, compile and quantization all pass at an
error of exactly 0 while testing nothing. That happened (issue #50): a 108-layer hybrid left unpruned
compounded its activations to ~1e32 and its reference logits came out exactly 0. So ``golden
generate`` looks at what it is about to store and refuses, in one line saying why, a reference with

* non-finite logits (naming the first module whose output went non-finite);
* activations that grow without bound: a module output whose RMS exceeds ``ACTIVATION_RMS_MAX``, or a
  decoder layer whose output RMS is ``LAYER_GROWTH_MAX`` times the previous layer's;
* logits that vanish: max |logit| under ``LOGIT_FLOOR``, or a row with one value over the vocabulary;
* a greedy top-k that carries no information: a step whose top-k log-probabilities are all equal.

The thresholds are orders of magnitude from what a working model gives. Measured on the bundled
suites' float64 goldens and on pruned Nemotron-3-Ultra: max module RMS 1.0 (the final norm), layer
over layer growth at most 2.7x, max |logit| 0.63-0.89, the narrowest logit row 0.82 wide, the
narrowest top-64 0.22 nats. A real checkpoint's massive activations (early layers ~1e3-1e4 in a few
channels) stay under both activation limits.
"""

from __future__ import annotations

import re

import torch

ACTIVATION_RMS_MAX = 1e6
LAYER_GROWTH_MAX = 1e4
LOGIT_FLOOR = 1e-6
FLAT = 1e-9  # a logit row or top-k this narrow (relative to its scale) holds one value
LAYER = re.compile(r"(?:.*\.)?layers\.(\d+)")


def _rms(t: torch.Tensor) -> float:
    return t.detach().double().pow(2).mean().sqrt().item()


def _floats(outputs: dict[str, torch.Tensor]):
    for name, t in outputs.items():
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel():
            yield name, t


def nonfinite(outputs: dict[str, torch.Tensor]) -> str | None:
    logits = outputs.get("logits")
    if logits is None or bool(torch.isfinite(logits).all()):
        return None
    first = next((n for n, t in _floats(outputs) if not bool(torch.isfinite(t).all())), "logits")
    bad = int((~torch.isfinite(logits)).sum())
    return f"{bad} of {logits.numel()} reference logits are not finite (first non-finite output: {first})"


def unbounded(outputs: dict[str, torch.Tensor]) -> str | None:
    rms = {n: _rms(t) for n, t in _floats(outputs) if n != "logits"}
    big = next((n for n, r in rms.items() if r > ACTIVATION_RMS_MAX), None)
    if big is not None:
        return f"activations grow without bound: {big} has RMS {rms[big]:.3g} (> {ACTIVATION_RMS_MAX:.0e})"
    chain = sorted((int(m.group(1)), n) for n in rms if (m := LAYER.fullmatch(n)))
    for (_, a), (_, b) in zip(chain, chain[1:], strict=False):
        if rms[a] > 0 and rms[b] / rms[a] > LAYER_GROWTH_MAX:
            return (f"activations grow without bound: {b} has {rms[b] / rms[a]:.3g}x the RMS of {a} "
                    f"({rms[a]:.3g} -> {rms[b]:.3g}; > {LAYER_GROWTH_MAX:.0e} in one layer)")
    return None


def vanishing(logits: torch.Tensor) -> str | None:
    x = logits.detach().double().flatten(0, -2)
    top = x.abs().max().item()
    if top < LOGIT_FLOOR:
        return f"the reference logits vanish: max |logit| {top:.3g} (< {LOGIT_FLOOR:.0e})"
    span = x.amax(-1) - x.amin(-1)
    flat = span <= FLAT * x.abs().amax(-1).clamp_min(1.0)
    if bool(flat.any()):
        row = int(flat.nonzero()[0, 0])
        return (f"the reference logits are constant over the vocabulary in {int(flat.sum())} of {len(span)} "
                f"positions (the first, position {row}, is all {x[row, 0].item():.6g})")
    return None


def uninformative_topk(generation: dict[str, torch.Tensor]) -> str | None:
    top = generation.get("top_logprobs")
    if top is None or top.numel() == 0 or top.shape[-1] < 2:
        return None
    t = top.detach().double().flatten(0, -2)
    flat = (t.amax(-1) - t.amin(-1)) <= FLAT * t.abs().amax(-1).clamp_min(1.0)
    if bool(flat.any()):
        return (f"the greedy top-{t.shape[-1]} carries no information: all its log-probabilities are equal "
                f"({t[int(flat.nonzero()[0, 0]), 0].item():.6g}) in {int(flat.sum())} of {len(t)} steps")
    return None


def why_degenerate(outputs: dict[str, torch.Tensor], generation: dict[str, torch.Tensor] | None = None) -> str | None:
    """The one-line reason this reference says nothing, or None. ``outputs``: captured module outputs
    with ``logits``; ``generation``: the greedy generation (``top_logprobs``)."""
    why = nonfinite(outputs) or unbounded(outputs)
    if why is None and "logits" in outputs:
        why = vanishing(outputs["logits"])
    if why is None and generation is not None:
        why = uninformative_topk(generation)
    return why
