"""Real-weight loaders: what fills a built model from a checkpoint when a suite names ``model.weights``.

``build_model`` asks this registry instead of importing a loader: harness's own (``safetensors``,
``harness.weights.load``) registers like a vendor's would, through an entry point in the
``harness.weights`` group whose target is ``register(registry)``. That keeps ``harness.models``
below ``harness.weights`` (docs/architecture.md): the weights package builds on model
instantiation, never the other way round.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from harness.registry import NamedRegistry, of_group


@dataclass
class WeightsLoader:
    """``empty(ls, mc, dtype)``: the pruned model with uninitialised parameters (no random init: the
    load writes every one); ``load(model, ls, mc, dtype)``: fill it, return notes for the run."""

    name: str
    empty: Callable
    load: Callable
    description: str = ""
    source: str = "builtin"


class LoaderRegistry(NamedRegistry[WeightsLoader]):
    kind = "weights loader"
    group = "harness.weights"


DEFAULT = "safetensors"


def registry() -> LoaderRegistry:
    return of_group(LoaderRegistry.group)  # one per process (harness.registry)
