"""Tolerance resolution: built-in defaults per dtype < the suite's ``tolerances.<dtype>`` < its
``overrides`` ordered by specificity (a device-generation match beats a backend match beats a
dtype-only match). Field by field: an unset field falls back to the next less specific entry.

The defaults were chosen from measured clean-vs-golden errors of the bundled suites (CPU,
against float64 goldens) with a wide margin; see docs/precision.md for the figures.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

FIELDS = ("rel_rmse", "min_cosine", "max_abs_err", "min_within_1e3", "logprob_atol", "tie_margin")

DEFAULTS: dict[str, dict] = {
    "float64": {"rel_rmse": 1e-6, "min_cosine": 1 - 1e-9, "max_abs_err": None, "min_within_1e3": None,
                "logprob_atol": 1e-5, "tie_margin": 1e-5},
    # measured worst module 5.5e-7 rel_rmse, 1.5e-13 cosine gap, 2.2e-7 logprob: margin ~20x
    "float32": {"rel_rmse": 1e-5, "min_cosine": 1 - 1e-9, "max_abs_err": None, "min_within_1e3": None,
                "logprob_atol": 1e-4, "tie_margin": 1e-4},
    "float16": {"rel_rmse": 1e-2, "min_cosine": 0.9995, "max_abs_err": None, "min_within_1e3": None,
                "logprob_atol": 0.02, "tie_margin": 0.02},
    # measured worst module 1.1e-2 rel_rmse, 6e-5 cosine gap, 2.4e-3 logprob: margin 4x / 16x / 20x.
    # logprob_atol: with realistic numerics (peaky attention, see numerics.py) greedy logprobs of
    # agreeing tokens differ by up to 0.061 (deepseek-v3, routing flips upstream); the golden's
    # measured budget (k x max + 0.01) applies below this ceiling.
    "bfloat16": {"rel_rmse": 4e-2, "min_cosine": 0.999, "max_abs_err": None, "min_within_1e3": None,
                 "logprob_atol": 0.15, "tie_margin": 0.1},
}


def _specificity(o) -> int:
    return (4 if o.device else 0) + (2 if o.backend else 0) + (1 if o.dtype else 0)


def _matches(o, backend: str, device: str, dtype: str) -> bool:
    return ((o.dtype is None or o.dtype == dtype) and (o.backend is None or o.backend == backend)
            and (o.device is None or fnmatchcase(device, o.device)))


def resolve(pc, backend: str, device: str, dtype: str) -> tuple[dict, dict]:
    """(tolerance dict, source of each field) for a run."""
    tol = dict(DEFAULTS.get(dtype, DEFAULTS["float32"]))
    src = dict.fromkeys(FIELDS, f"default[{dtype}]")
    layers = []
    if pc is not None and dtype in pc.tolerances:
        layers.append((f"suite[{dtype}]", pc.tolerances[dtype]))
    if pc is not None:
        matching = [o for o in pc.overrides if _matches(o, backend, device, dtype)]
        for o in sorted(matching, key=_specificity):  # stable: later entries of equal rank win
            sel = ",".join(f"{k}={getattr(o, k)}" for k in ("dtype", "backend", "device") if getattr(o, k))
            layers.append((f"override[{sel or '*'}]", o))
    for name, layer in layers:
        for f in FIELDS:
            v = getattr(layer, f)
            if v is not None:
                tol[f], src[f] = v, name
    return tol, src
