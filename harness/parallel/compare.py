"""Equivalence of one layout with the single-process reference, and localization on a mismatch.

Error of a tensor: ``max|x - ref| / max|ref|`` (scale-relative max error, computed in float64),
so one number per tensor is comparable across tensors of any magnitude; the loss uses
``|x - ref| / |ref|``. Every rank's own copy is compared (a gradient that differs on one data
rank is a missed reduction there, not noise), each against the matching piece of the reference:

* a rank that sees a slice of the batch (dp, fsdp, ep) is compared with that slice
  (``data_index``), in call order for pipeline microbatches;
* a tensor-parallel rank's sharded output with its shard (``tp`` index, the dimension where the
  shapes differ by the tp degree).

On a mismatch, the first module (in the reference's order of finished outputs: children finish
before parents, so the first is where the error is born) whose output exceeds the activation
tolerance on some rank, with the ranks, and the parameter whose gradient is furthest off.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from harness.parallel.layouts import Layout
from harness.parallel.reference import lm_loss

QUANTITIES = ("logits", "loss", "grads", "weights", "logits_after", "activations", "router")


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    if x.shape != ref.shape:
        return float("inf")
    scale = ref.abs().max().item() if ref.numel() else 0.0
    diff = (x - ref).abs().max().item() if ref.numel() else 0.0
    if diff != diff:  # nan
        return float("inf")
    return diff / scale if scale > 0 else diff


def ref_piece(ref: torch.Tensor, shape: tuple[int, ...], lay: Layout, rank: int,
              tokens: tuple[int, int] | None = None) -> torch.Tensor | None:
    """The part of the reference tensor ``ref`` that ``rank``'s tensor of ``shape`` holds.
    ``tokens`` = (B, S) of the batch: under cp, tensors of flattened token rows [B S, ...] (routers,
    fused experts' input) are chunked per sequence."""
    r = ref
    if tuple(r.shape) == tuple(shape):
        return r
    d = lay.data_degree
    if lay.cp > 1 and tokens and r.dim() and len(shape) == r.dim() and r.shape[0] == tokens[0] * tokens[1] \
            and shape[0] * d * lay.cp == r.shape[0]:
        # Flattened (batch-major) token rows: [B, S, ...] -> data slice, this rank's cp chunk -> rows.
        rest = r.shape[1:]
        r = r.reshape(*tokens, *rest).chunk(d)[lay.data_index(rank)] if d > 1 else r.reshape(*tokens, *rest)
        r = r.chunk(lay.cp, 1)[lay.coords(rank)["cp"]].reshape(-1, *rest)
        if tuple(r.shape) == tuple(shape):
            return r
    if d > 1 and r.dim() and len(shape) == r.dim() and shape[0] * d == r.shape[0]:
        r = r.chunk(d)[lay.data_index(rank)]
        if tuple(r.shape) == tuple(shape):
            return r
    if lay.cp > 1 and r.dim() >= 2 and len(shape) == r.dim():
        # This rank's chunk of the sequences: dimension 1 of [b, S, ...], or the one of length S
        # elsewhere (MLA's latent K/V [b, 1, S, .]). Chunked before tp, so that tp cannot take it.
        seq = [k for k in range(1, r.dim()) if shape[k] * lay.cp == r.shape[k]
               and (k == 1 or (tokens is not None and r.shape[k] == tokens[1]))]
        if seq:
            r = r.chunk(lay.cp, seq[0])[lay.coords(rank)["cp"]]
            if tuple(r.shape) == tuple(shape):
                return r
    if lay.tp > 1 and len(shape) == r.dim():
        diff = [k for k in range(r.dim()) if shape[k] != r.shape[k]]
        if len(diff) == 1 and shape[diff[0]] * lay.tp == r.shape[diff[0]]:
            return r.chunk(lay.tp, diff[0])[lay.coords(rank)["tp"]]
    return None


@dataclass
class RankData:
    rank: int
    meta: dict
    tensors: dict[str, torch.Tensor]


def load_ranks(layout_dir: Path, world: int) -> list[RankData]:
    from safetensors.torch import load_file

    out = []
    for r in range(world):
        meta = json.loads((layout_dir / f"rank{r}.json").read_text())
        out.append(RankData(r, meta, load_file(str(layout_dir / f"rank{r}.safetensors"))))
    return out


@dataclass
class Verdict:
    errors: dict[str, float] = field(default_factory=dict)  # quantity -> worst error over ranks
    failed: list[str] = field(default_factory=list)  # quantities over tolerance, with detail
    first_module: str | None = None
    first_module_ranks: list[int] = field(default_factory=list)
    first_module_error: float = 0.0
    worst_grad: tuple[str, float, list[int]] | None = None  # (param, error, ranks over tolerance)
    worst_weight: tuple[str, float, list[int]] | None = None
    recompute_grad_error: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failed


def _worst_param(ranks: list[RankData], ref: dict, prefix: str, tol: float):
    """(param, worst error, ranks over tol, error per rank) over every parameter in ``prefix``."""
    worst, where, per = ("", 0.0), [], {}
    missing = []
    for rd in ranks:
        for key, t in rd.tensors.items():
            if not key.startswith(prefix):
                continue
            if key not in ref:
                missing.append(key)
                continue
            e = rel_err(t, ref[key])
            per.setdefault(key, {})[rd.rank] = e
    for key, by_rank in per.items():
        e = max(by_rank.values())
        if e > worst[1] or not worst[0]:
            worst = (key[len(prefix):], e)
    if worst[0]:
        where = sorted(r for r, e in per[prefix + worst[0]].items() if e > tol)
    expected = {k for k in ref if k.startswith(prefix)}
    absent = sorted(expected - set(per))
    return worst[0], worst[1], where, absent, missing


def compare_layout(ref: dict[str, torch.Tensor], order: list[str], ids: torch.Tensor, lay: Layout,
                   ranks: list[RankData], tol: dict[str, float]) -> Verdict:
    """Every quantity of every rank against its piece of the reference, then the first diverging
    module. ``ids`` [B, S]: the whole batch (the loss's targets)."""
    v = Verdict()
    _compare_logits(v, ref, lay, ranks, tol)
    _compare_loss(v, ref, ids, lay, ranks, tol)
    _compare_params(v, ref, ranks, tol)
    _compare_router_logits(v, ref, lay, ranks, tol["router"])
    _compare_recompute(v, ranks, tol["grads"])
    localize(v, ref, order, lay, ranks, tol["activations"], tokens=tuple(ids.shape))
    if v.first_module and not v.failed:
        # Outputs of inner modules over tolerance while every result agrees: noted, not failed
        # (the activations tolerance is for localization).
        v.notes.append(f"module {v.first_module} differs by {v.first_module_error:.3g} on rank(s) "
                       f"{v.first_module_ranks} although every result agrees")
        v.first_module, v.first_module_ranks = None, []
    return v


def _judge(v: Verdict, q: str, errs: dict[int, float], tol: float, what: str) -> None:
    """Worst error of ``q`` over ranks; the ranks over ``tol`` fail it."""
    if not errs:
        return
    v.errors[q] = max(errs.values())
    bad = sorted(r for r, e in errs.items() if e > tol)
    if bad:
        v.failed.append(f"{q} {what} on rank(s) {bad} (error {v.errors[q]:.3g} > {tol:.3g})")


def _compare_logits(v: Verdict, ref: dict, lay: Layout, ranks: list[RankData], tol: dict[str, float]) -> None:
    """Logits and logits after the step: every rank that has them, against its slice."""
    for q in ("logits", "logits_after"):
        errs = {}
        for rd in ranks:
            if q in rd.tensors:
                piece = ref_piece(ref[q], tuple(rd.tensors[q].shape), lay, rd.rank)
                errs[rd.rank] = rel_err(rd.tensors[q], piece) if piece is not None else float("inf")
        _judge(v, q, errs, tol[q], "differ")


def _compare_loss(v: Verdict, ref: dict, ids: torch.Tensor, lay: Layout, ranks: list[RankData],
                  tol: dict[str, float]) -> None:
    """Each rank's loss against the loss of the reference's logits on its slice [b, S, V]."""
    errs = {}
    for rd in ranks:
        if "loss" in rd.tensors:
            logits_piece = ref_piece(ref["logits"], (rd.tensors["logits"].shape[0], *ref["logits"].shape[1:]), lay,
                                     rd.rank)
            ids_piece = ref_piece(ids, (logits_piece.shape[0], ids.shape[1]), lay, rd.rank)
            want = lm_loss(logits_piece, ids_piece).reshape(1)
            errs[rd.rank] = abs(rd.tensors["loss"].double().item() - want.double().item()) / max(abs(want.item()),
                                                                                                 1e-30)
    _judge(v, "loss", errs, tol["loss"], "differs")


def _compare_params(v: Verdict, ref: dict, ranks: list[RankData], tol: dict[str, float]) -> None:
    """Every gradient and every weight after the step, at full shape; the worst of each is named."""
    for q, prefix in (("grads", "grad/"), ("weights", "weight/")):
        name, err, where, absent, _extra = _worst_param(ranks, ref, prefix, tol[q])
        v.errors[q] = err
        if q == "grads":
            v.worst_grad = (name, err, where)
        else:
            v.worst_weight = (name, err, where)
        if absent:
            v.failed.append(f"{len(absent)} parameters have no {q[:-1]} on any rank, e.g. {absent[0][len(prefix):]}")
        if err > tol[q]:
            v.failed.append(f"{q} differ: worst {name} (error {err:.3g} > {tol[q]:.3g}) on rank(s) {where}")


def _compare_router_logits(v: Verdict, ref: dict, lay: Layout, ranks: list[RankData], tol: float) -> None:
    """Router logits (both forwards), the noise that routing flips are judged against."""
    errs: dict[int, float] = {}
    for rd in ranks:
        for key, t in rd.tensors.items():
            if key.startswith("rlogits/") and key in ref:
                piece = ref_piece(ref[key], tuple(t.shape), lay, rd.rank)
                e = rel_err(t, piece) if piece is not None else float("inf")
                errs[rd.rank] = max(errs.get(rd.rank, 0.0), e)
    if not errs:
        return
    v.errors["router"] = max(errs.values())
    bad = sorted(r for r, e in errs.items() if e > tol)
    if bad:
        # Not a failure by itself (module outputs are localized under the activations tolerance);
        # but the near-tie limit derived from tol["router"] is then narrower than this run's noise.
        v.notes.append(f"router logits differ by more than the routing noise tolerance on rank(s) {bad} "
                       f"(error {v.errors['router']:.3g} > {tol:.3g}): near-tie flips may be judged wide")


def _compare_recompute(v: Verdict, ranks: list[RankData], tol: float) -> None:
    """Recomputation: the same layout without it must give the same gradients."""
    noac = [(rd, k) for rd in ranks for k in rd.tensors if k.startswith("noac_grad/")]
    if noac:
        e = max(rel_err(rd.tensors["ac_" + k[len("noac_"):]], rd.tensors[k]) for rd, k in noac)
        v.recompute_grad_error = e
        if e > tol:
            v.failed.append(f"gradients with recomputation differ from those without (error {e:.3g})")


def localize(v: Verdict, ref: dict, order: list[str], lay: Layout, ranks: list[RankData], tol: float,
             tokens: tuple[int, int] | None = None) -> None:
    """First module (reference order) whose output diverges on some rank; the worst module error
    over all of them goes to ``v.errors['activations']`` (the clean spread it is derived from)."""
    v.errors["activations"] = 0.0
    for name in order:
        key = f"act/{name}"
        if key not in ref or ".experts." in name:
            # Inside a fused experts module rows are (token, expert) assignments grouped by expert,
            # not tokens: a data rank's rows are no slice of the reference's. The experts module's
            # own output (per token) is compared.
            continue
        bad, worst = [], 0.0
        for rd in ranks:
            t = rd.tensors.get(key)
            if t is None:
                continue
            piece = ref_piece(ref[key], tuple(t.shape), lay, rd.rank, tokens)
            if piece is None:
                continue
            e = rel_err(t, piece)
            v.errors["activations"] = max(v.errors["activations"], e)
            if e > tol:
                bad.append(rd.rank)
                worst = max(worst, e)
        if bad and v.first_module is None:
            v.first_module, v.first_module_ranks, v.first_module_error = name, bad, worst


def describe(v: Verdict, lay: Layout) -> str:
    """The root cause first - the first diverging module and its ranks; with every forward output
    right, the gradient (else the weight) furthest off and its ranks - then the symptoms: the
    results over tolerance, router flips at a wide margin."""
    grad = (f"Gradient furthest off: {v.worst_grad[0]}" + (f" on rank(s) {v.worst_grad[2]}" if v.worst_grad[2] else "")
            + f" (error {v.worst_grad[1]:.3g})") if v.worst_grad and v.worst_grad[0] else ""
    # Weights off with gradients right: the optimizer step or its parameter broadcast.
    weight = (f"Weight furthest off: {v.worst_weight[0]} on rank(s) {v.worst_weight[2]} (error {v.worst_weight[1]:.3g})"
              if v.worst_weight and v.worst_weight[2] else "")
    if v.first_module:
        how = ("routing at a wide margin" if v.first_module_error != v.first_module_error
               else f"error {v.first_module_error:.3g}")
        lead = [f"First diverging module: {v.first_module} on rank(s) {v.first_module_ranks} ({how})"]
    else:
        lead = ["Every module's forward output agrees", grad if v.worst_grad and v.worst_grad[2] else weight]
    tail = [x for x in (grad, weight) if x and x not in lead]
    return (f"layout {lay.label}: " + ". ".join(x for x in lead if x) + ". Differs from the single-process reference: "
            + "; ".join(v.failed) + "".join(f". {x}" for x in tail))
