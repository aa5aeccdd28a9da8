"""Backend registry: built-ins and vendors' backends through the ``harness.backends`` entry-point
group (each with the op lists it declares), plus custom backends declared in ``harness.toml``.

* ``base``     the ``Backend`` (device type, collective, dispatch key, module, op lists) and its probes;
* ``builtin``  harness's own: cpu, cuda, rocm, xpu, mps and the PrivateUse1 npu, musa, mlu;
* ``faults``   known wrong kernels installed on a backend's dispatch key (``harness certify``)."""

from __future__ import annotations

from pathlib import Path

from harness.backends.base import Backend, Registry
from harness.settings import load_settings, settings_path

_REGISTRY: Registry | None = None
_REGISTRY_KEY: object = None


def _build() -> Registry:
    reg = Registry().load_entry_points()  # the built-ins are an entry point like any vendor's
    settings_file = settings_path()
    for cb in load_settings().backends:
        lists: tuple = ()
        if cb.op_list:
            p = Path(cb.op_list)
            lists = (p if p.is_absolute() else (settings_file.parent if settings_file else Path.cwd()) / p,)
        elif cb.name in reg:  # a redeclared built-in keeps the lists it shipped
            lists = reg.get(cb.name).op_lists
        reg.add(Backend(cb.name, cb.device_type, cb.collective, cb.module, cb.dispatch_key,
                        cb.description, source="harness.toml", op_lists=lists,
                        compile_backend=cb.compile_backend), replace=True)
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
