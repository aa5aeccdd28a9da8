"""Where compiled numerics diverge: the smallest region whose compiled version alone is wrong.

A whole-model compile fuses across module boundaries, and module hooks would force graph breaks,
so the compiled model has no per-module outputs to compare. Bisection recovers a place instead:
one region at a time is compiled (``nn.Module.compile``: its own call compiled, the rest of the
model eager) and the model's logits are compared with the eager model's. The first region in
forward order whose compiled-alone logits exceed the budget is kept and its children are tried the
same way, down to ``depth`` levels (decoder layer -> MLP -> activation). A region whose children all
agree is the answer itself (the fault needs the region's fusion, e.g. across its submodules).

Top-level regions: the modules beside the decoder-layer list (embeddings, final norm, rotary), each
decoder layer, and the model's other children (the LM head), in forward order.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from harness.anatomy.layers import decoder_layers
from harness.compiler.dynamo import fresh
from harness.messages import first_line
from harness.precision.compare import tensor_metrics


@dataclass
class Region:
    name: str
    rel_rmse: float  # logits with only this region compiled, against the eager logits
    diverges: bool
    raised: str = ""  # compiled alone, the region raised (type: first line); not descended into


@dataclass
class Bisection:
    path: list[Region] = field(default_factory=list)  # the diverging region at each depth
    tried: list[Region] = field(default_factory=list)  # every region compiled, in order

    @property
    def region(self) -> str | None:
        return self.path[-1].name if self.path else None


def top_regions(model: torch.nn.Module) -> list[str]:
    prefix, layers = decoder_layers(model)
    parent_name = prefix.rsplit(".", 1)[0] if "." in prefix else ""
    parent = model.get_submodule(parent_name) if parent_name else model
    dot = f"{parent_name}." if parent_name else ""
    out = []
    for n, m in parent.named_children():
        if m is layers:
            out += [f"{prefix}.{i}" for i in range(len(layers))]
        else:
            out.append(dot + n)
    if parent is not model:
        top = parent_name.split(".")[0]
        out += [n for n, _ in model.named_children() if n != top]
    return out


@contextlib.contextmanager
def compiled_only(module: torch.nn.Module, compile_kw: dict) -> Iterator[None]:
    """``module``'s own call compiled for the block (``nn.Module.compile``), then eager again."""
    kw = {k: v for k, v in compile_kw.items() if v is not None}
    module.compile(**kw)
    try:
        yield
    finally:
        module._compiled_call_impl = None


def localize(model: torch.nn.Module, forward: Callable[[torch.nn.Module], torch.Tensor], reference: torch.Tensor,
             budget: float, compile_kw: dict, depth: int = 3,
             diverges: Callable[[torch.Tensor], bool] | None = None) -> Bisection:
    """Bisect ``model``'s compiled numerics: ``forward(model)`` gives logits, compared with
    ``reference`` (the eager logits) under ``budget`` (rel_rmse), or by ``diverges(logits)`` where the
    failure was the error's direction (a one-signed error inside the budget)."""
    out = Bisection()
    names = top_regions(model)
    for _ in range(depth):
        hit = None
        for name in names:
            try:
                with fresh(), compiled_only(model.get_submodule(name), compile_kw):
                    got = forward(model)
            except Exception as e:  # noqa: BLE001 - said in the bisection's detail, the finding kept
                # Compiled alone a region can take paths the whole-model compile did not (its own graph
                # inputs, other guards). The bisection is a diagnostic of a finding already made: a region
                # that raises is said and passed over, and the finding keeps its place.
                out.tried.append(Region(name, math.nan, False, f"{type(e).__name__}: {first_line(e, 200)}"))
                continue
            err = tensor_metrics(got, reference)["rel_rmse"]
            r = Region(name, err, diverges(got) if diverges is not None else not err <= budget)
            out.tried.append(r)
            if r.diverges:
                hit = r
                break
        if hit is None:
            break
        out.path.append(hit)
        names = [f"{hit.name}.{c}" for c, _ in model.get_submodule(hit.name).named_children()]
        if not names:
            break
    return out


def describe(b: Bisection) -> str:
    """Every region tried, in order, with its logits' distance from eager (the check's detail)."""
    return "bisection, one region compiled at a time, logits against eager:\n" + "\n".join(
        f"  {r.name}: " + (f"raised compiled alone ({r.raised}): passed over" if r.raised else
                           f"rel_rmse {r.rel_rmse:.3g}" + (" (diverges)" if r.diverges else "")) for r in b.tried)


def where(b: Bisection | None, eager_budget: float) -> str:
    """Where the compiled numerics diverge, as the failure names it."""
    if b is None:
        return "not bisected ([checks.compile] bisect = false)"
    if b.region and not b.path[-1].rel_rmse > eager_budget:  # judged by direction, inside the size budget
        return f"{b.region} compiled alone gives it (rel_rmse {b.path[-1].rel_rmse:.3g}, within {eager_budget:.3g})"
    if b.region:
        return f"{b.region} compiled alone diverges from eager (rel_rmse {b.path[-1].rel_rmse:.3g} > {eager_budget:.3g})"
    return "no single region compiled alone diverges (a fusion across region boundaries, or the whole graph)"
