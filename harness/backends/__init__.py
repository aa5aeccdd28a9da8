"""Backend registry: built-ins and vendors' backends through the ``harness.backends`` entry-point
group, plus custom backends declared in ``harness.toml``."""

from __future__ import annotations

from importlib.metadata import entry_points

from harness.backends.base import Backend, Registry
from harness.settings import load_settings

_REGISTRY: Registry | None = None
_REGISTRY_KEY: object = None


def _build() -> Registry:
    reg = Registry()
    eps = entry_points(group="harness.backends")
    if not any(ep.value.startswith("harness.backends.builtin") for ep in eps):
        # running from a source tree that was never pip-installed: built-ins still exist
        from harness.backends import builtin

        builtin.register(reg)
    for ep in sorted(eps, key=lambda e: e.name != "builtin"):
        ep.load()(reg)
    for cb in load_settings().backends:
        reg.add(Backend(cb.name, cb.device_type, cb.collective, cb.module, cb.dispatch_key,
                        cb.description, source="harness.toml"), replace=True)
    return reg


def registry() -> Registry:
    """The process-wide registry, rebuilt when the settings file changes (tests switch it)."""
    global _REGISTRY, _REGISTRY_KEY
    key = id(load_settings())
    if _REGISTRY is None or key != _REGISTRY_KEY:
        _REGISTRY, _REGISTRY_KEY = _build(), key
    return _REGISTRY


def get(name: str) -> Backend:
    return registry().get(name)


__all__ = ["Backend", "Registry", "registry", "get"]
