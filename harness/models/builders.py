"""Model builders: what turns a suite's (pruned) config into a ``torch.nn.Module``.

``model.adapter`` in a suite names one. Builders register like every other extension: an entry
point in the ``harness.models`` group whose target is ``register(registry)``, adding
:class:`Builder` objects by name (harness's own ``hf``, transformers' class for the architecture,
is one). A vendor's::

    # pyproject.toml
    [project.entry-points."harness.models"]
    mymodel = "vendor_models:register"

    # vendor_models/__init__.py
    from harness.models.builders import Builder

    def build(config, *, dtype, device):            # -> torch.nn.Module
        ...

    def register(registry):
        registry.add(Builder("mymodel", build, description="Vendor X's reference implementation"))

and a suite says ``adapter = "mymodel"``. An import string, ``adapter = "pkg.module:build"``, still
names a builder directly (the same ``build(config, dtype=..., device=...)``), without registering.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from harness.registry import NamedRegistry, of_group

if TYPE_CHECKING:
    import torch

    from harness.models.config import ModelConfig


class Builder:
    """A named model builder: ``fn(config, dtype=..., device=...) -> torch.nn.Module``."""

    def __init__(self, name: str, fn: Callable | None = None, *, description: str = "", source: str = "builtin"):
        self.name, self.fn, self.description, self.source = name, fn, description, source

    def build(self, mc: ModelConfig, *, dtype: torch.dtype, device: str) -> torch.nn.Module:
        return self.fn(mc.config, dtype=dtype, device=device)

    def __repr__(self) -> str:
        return f"Builder({self.name!r}, source={self.source!r})"


class HFBuilder(Builder):
    """transformers' class for the resolved architecture (harness.models.config), built from the config."""

    def build(self, mc: ModelConfig, *, dtype: torch.dtype, device: str) -> torch.nn.Module:
        from harness.models.config import architecture_class

        return architecture_class(mc.architecture)(mc.config)


class BuilderRegistry(NamedRegistry[Builder]):
    kind = "model builder"
    group = "harness.models"
    item_type = Builder

    def add(self, item: Builder, *, replace: bool = False) -> Builder:
        if isinstance(item, Builder) and (not item.name or ":" in item.name):
            raise ValueError(f"a model builder's name must be non-empty and without ':' (that is an import "
                             f"string), got {item.name!r}")
        return super().add(item, replace=replace)


def register(registry: BuilderRegistry) -> None:
    """harness's own builders (the ``harness.models`` entry point in its pyproject.toml)."""
    registry.add(HFBuilder("hf", description="transformers' class for config.json's architecture"))




def registry() -> BuilderRegistry:
    return of_group(BuilderRegistry.group)  # one per process (harness.registry)


def is_import_string(spec: str) -> bool:
    return ":" in spec


def from_import_string(spec: str) -> Builder:
    """``package.module:callable`` -> a builder calling it, with an error that says what went wrong."""
    from harness.models.config import AdapterError

    mod_name, _, attr = spec.partition(":")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise AdapterError(f"model.adapter {spec!r}: cannot import {mod_name!r}: {e}") from None
    fn = getattr(mod, attr, None)
    if not callable(fn):
        raise AdapterError(f"model.adapter {spec!r}: {mod_name} has no callable {attr!r}")
    return Builder(spec, fn, source=spec)


def resolve(spec: str) -> Builder:
    """``model.adapter`` -> its builder: a registered name, or an import string."""
    from harness.models.config import AdapterError

    if is_import_string(spec):
        return from_import_string(spec)
    try:
        return registry().get(spec)
    except KeyError as e:
        raise AdapterError(f"model.adapter: {str(e).strip(chr(34) + chr(39))}; or name one as "
                           f"'package.module:callable'") from None
