"""Operator coverage of a backend: each op of an inventory is

* ``native``: the backend has a kernel for it (its dispatch key's kernel table, or its declared list);
* ``composite``: no backend kernel, but a ``CompositeImplicitAutograd`` /
  ``CompositeExplicitAutograd`` kernel decomposes it into other ops (backend-agnostic);
* ``cpu-fallback``: the backend runs it on the host (a boxed fallback registered for its dispatch
  key, or an op list entry tagged ``fallback``);
* ``missing``: none of the above; the model cannot run there. ``known gap`` when the suite lists it
  under ``known_gaps.<backend>`` (tracked, not silent);
* ``unknown``: the backend is not installed and declares no op list.

Where the answer comes from:

1. the **dispatcher** when the backend is installed and has a ``dispatch_key`` (``torch._C.
   _dispatch_has_kernel_for_dispatch_key``);
2. otherwise its **declared op list**: ``op_list`` of its ``[[backends]]`` table in harness.toml,
   else ``harness/oplists/<backend>.txt``. One op per line, ``#`` comments; accepted spellings:
   ``aten.mm.default``, ``aten::mm`` (every overload), ``aten::add.Tensor``, ``add.Tensor`` and
   native_functions.yaml's ``- func: add.Tensor(Tensor self, ...) -> Tensor``; an optional second
   word ``native`` (default), ``fallback`` or ``composite`` says how the backend provides it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from harness.inspect.trace import Inventory

NATIVE, COMPOSITE, FALLBACK, MISSING, UNKNOWN = "native", "composite", "cpu-fallback", "missing", "unknown"
STATUS_ORDER = (MISSING, UNKNOWN, FALLBACK, COMPOSITE, NATIVE)
OPLIST_DIR = Path(__file__).resolve().parent.parent / "oplists"
_TAGS = {"native": NATIVE, "fallback": FALLBACK, "cpu-fallback": FALLBACK, "composite": COMPOSITE}


def dispatcher_name(op: str) -> str:
    """``aten.add.Tensor`` -> ``aten::add.Tensor``; ``aten.mm.default`` -> ``aten::mm``."""
    ns, _, rest = op.partition(".")
    name, _, overload = rest.rpartition(".") if rest.count(".") else (rest, "", "default")
    return f"{ns}::{name}" + ("" if overload in ("default", "") else f".{overload}")


def canonical(entry: str) -> str:
    """An op list entry in any accepted spelling -> ``aten.name.overload`` (or ``aten.name.*``)."""
    e = entry.strip()
    if e.startswith("- func:") or e.startswith("func:"):
        e = e.split(":", 1)[1].strip()
    e = e.split("(", 1)[0].strip()
    ns = "aten"
    if "::" in e:
        ns, e = e.split("::", 1)
        if "." not in e:
            return f"{ns}.{e}.*"
        name, overload = e.split(".", 1)
        return f"{ns}.{name}.{overload or 'default'}"
    parts = e.split(".")
    if len(parts) == 3:
        return e
    if len(parts) == 2:
        return f"{ns}.{parts[0]}.{parts[1]}"
    return f"{ns}.{parts[0]}.default"


def parse_op_list(path: str | Path) -> dict[str, str]:
    out: dict[str, str] = {}
    for raw in Path(path).read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line or line.startswith(("dispatch:", "variants:", "structured", "autogen:", "tags:")):
            continue
        if line.startswith("- func:") or line.startswith("func:"):
            out[canonical(line)] = NATIVE
            continue
        words = line.split()
        tag = _TAGS.get(words[1].lower(), NATIVE) if len(words) > 1 else NATIVE
        out[canonical(words[0])] = tag
    return out


def op_list_path(backend_name: str) -> Path | None:
    """``op_list`` of the backend's harness.toml table, else the bundled ``oplists/<name>.txt``."""
    from harness.settings import load_settings, settings_path

    for cb in load_settings().backends:
        if cb.name == backend_name and getattr(cb, "op_list", None):
            p = Path(cb.op_list)
            if not p.is_absolute():
                sp = settings_path()
                p = (sp.parent if sp else Path.cwd()) / p
            return p
    p = OPLIST_DIR / f"{backend_name}.txt"
    return p if p.is_file() else None


def _has(name: str, key: str) -> bool:
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(name, key)
    except RuntimeError:  # op not registered in this process (e.g. a custom op library not imported)
        return False


def composite_kind(op: str) -> str | None:
    name = dispatcher_name(op)
    if _has(name, "CompositeImplicitAutograd"):
        return "CompositeImplicitAutograd"
    if _has(name, "CompositeExplicitAutograd"):
        return "CompositeExplicitAutograd"
    # Structured ops (mm, add, ...) also carry a CompositeExplicitAutogradNonFunctional kernel that
    # only wraps their out= overload, which every backend still has to provide: those have a CPU
    # kernel of their own. Without one (new_empty_strided, ...) it is a real decomposition.
    if _has(name, "CompositeExplicitAutogradNonFunctional") and not _has(name, "CPU"):
        return "CompositeExplicitAutogradNonFunctional"
    return None


def _backend_fallback(key: str) -> bool:
    try:
        return torch._C._dispatch_has_backend_fallback(getattr(torch._C.DispatchKey, key))
    except (AttributeError, RuntimeError):
        return False


@dataclass
class OpCoverage:
    op: str
    status: str
    how: str  # which kernel / list entry decided
    modules: list[str]
    count: int
    known_gap: bool = False


@dataclass
class Coverage:
    backend: str
    source: str  # "dispatcher (CPU)", "op list harness/oplists/x.txt", "none"
    ops: dict[str, OpCoverage] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def by_status(self, status: str) -> list[OpCoverage]:
        return sorted((o for o in self.ops.values() if o.status == status), key=lambda o: o.op)

    def missing(self, include_known: bool = True) -> list[OpCoverage]:
        return [o for o in self.by_status(MISSING) if include_known or not o.known_gap]

    def counts(self) -> dict[str, int]:
        return {s: len(self.by_status(s)) for s in STATUS_ORDER if self.by_status(s)}

    def to_dict(self) -> dict:
        return {"backend": self.backend, "source": self.source, "counts": self.counts(), "notes": self.notes,
                "ops": {k: {"status": v.status, "how": v.how, "known_gap": v.known_gap, "count": v.count,
                            "modules": v.modules} for k, v in sorted(self.ops.items())}}


def classify_op(op: str, *, dispatch_key: str | None = None, op_list: dict[str, str] | None = None) -> tuple[str, str]:
    if dispatch_key is not None:
        name = dispatcher_name(op)
        if _has(name, dispatch_key):
            return NATIVE, f"{dispatch_key} kernel"
        comp = composite_kind(op)
        if comp:
            return COMPOSITE, comp
        if _backend_fallback(dispatch_key):
            return FALLBACK, f"{dispatch_key} boxed fallback"
        return MISSING, f"no {dispatch_key} kernel, not composite"
    if op_list is not None:
        ns, name, _ = op.split(".", 2) if op.count(".") >= 2 else (op, "", "")
        tag = op_list.get(op) or op_list.get(f"{ns}.{name}.*")
        if tag:
            return tag, "declared in op list"
        comp = composite_kind(op)
        if comp:
            return COMPOSITE, comp
        return MISSING, "not in the declared op list, not composite"
    comp = composite_kind(op)
    if comp:
        return COMPOSITE, comp
    return UNKNOWN, "backend not installed and no op list declared"


def backend_source(backend_name: str) -> tuple[str | None, dict[str, str] | None, str]:
    """(dispatch key, op list, description of the source) for a backend name."""
    from harness.backends import registry

    reg = registry()
    be = reg.get(backend_name) if backend_name in reg else None
    if be is not None and be.dispatch_key and be.available():
        return be.dispatch_key, None, f"dispatcher ({be.dispatch_key} kernel table)"
    path = op_list_path(backend_name)
    if path is not None:
        return None, parse_op_list(path), f"declared op list {path}"
    why = "not registered" if be is None else (be.availability()[1] if not be.available() else "no dispatch_key")
    return None, None, f"none ({why}; declare an op list: see docs/inspect.md)"


def coverage(inv: Inventory, backend_name: str, known_gaps: list[str] | None = None) -> Coverage:
    key, oplist, source = backend_source(backend_name)
    cov = Coverage(backend_name, source)
    gaps = {canonical(g) for g in known_gaps or []}
    for op, rec in sorted(inv.ops.items()):
        status, how = classify_op(op, dispatch_key=key, op_list=oplist)
        known = status == MISSING and (op in gaps or re.sub(r"\.[^.]+$", ".*", op) in gaps)
        cov.ops[op] = OpCoverage(op, status, how, sorted(rec.modules), rec.count, known)
    stale = sorted(g for g in gaps if g not in cov.ops and not g.endswith(".*"))
    if stale:
        cov.notes.append(f"known_gaps.{backend_name} lists ops the model does not use: {', '.join(stale)}")
    fixed = sorted(o.op for o in cov.ops.values() if o.op in gaps and o.status != MISSING)
    if fixed:
        cov.notes.append(f"known gaps now covered (remove from the suite): {', '.join(fixed)}")
    return cov


def dump_dispatcher_op_list(dispatch_key: str, namespace: str = "aten") -> str:
    """Every overload with a kernel for ``dispatch_key``: the op list of an installed backend, to ship
    for machines where it is not installed."""
    names = sorted(n for n in torch._C._dispatch_get_all_op_names()
                   if n.startswith(f"{namespace}::") and _has(n, dispatch_key))
    lines = [f"# ops with a {dispatch_key} kernel in torch {torch.__version__} "
             "(generated by `harness inspect --dump-op-list`)"]
    for n in names:
        ns, rest = n.split("::", 1)
        name, _, overload = rest.partition(".")
        lines.append(f"{ns}.{name}.{overload or 'default'}")
    return "\n".join(lines) + "\n"
