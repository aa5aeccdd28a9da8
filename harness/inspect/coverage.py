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
2. otherwise its **declared op list**: the ``op_lists`` its registration declares (a vendor's
   ``harness.backends`` entry point ships its own files; the built-ins declare
   ``harness/oplists/<backend>-<version>.txt``), or ``op_list`` of its ``[[backends]]`` table in
   harness.toml. One op per line, ``#`` comments; accepted spellings:
   ``aten.mm.default``, ``aten::mm`` (every overload), ``aten::add.Tensor``, ``add.Tensor`` and
   native_functions.yaml's ``- func: add.Tensor(Tensor self, ...) -> Tensor``; an optional second
   word ``native`` (default), ``fallback`` or ``composite`` says how the backend provides it.
   Header comments ``# key: value`` carry provenance (``backend``, ``version``, ``source``, ...) and
   ``# unlisted: fallback`` for plugins whose boxed CPU fallback runs every unlisted op on the host.
   Several versions of a backend's list may ship (``<backend>-<version>.txt``): the one matching the
   installed plugin's version is used, else the newest, with a warning when the versions differ.

Known gaps (:func:`known_gap`): a suite's ``known_gaps.<backend>`` entries are ``"aten::histc"`` (any
version) or ``{ op = "aten::histc", versions = "<2.6" }`` (``packaging`` specifiers against the
backend's version: the installed plugin's, else the op list's), so that an op a newer plugin provides
stops being excused and one that disappears again is a regression.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from harness.inspect.trace import Inventory
from harness.oplists.format import (  # the format lives with the lists
    COMPOSITE,
    FALLBACK,
    MISSING,
    NATIVE,
    STATUS_ORDER,
    UNKNOWN,
    OpList,
    canonical,
    dispatcher_name,
    header_value,
    parse_op_list,
)


def _version_key(v: str | None):
    from packaging.version import InvalidVersion, Version

    try:
        return (1, Version(v or ""), "")
    except InvalidVersion:
        return (0, None, v or "")


def declared_op_lists(backend_name: str | None = None) -> dict[str, list[Path]]:
    """backend -> the op lists its registration declares (``Backend.op_lists``: the built-ins' files in
    harness/oplists/, a vendor package's own, a harness.toml ``op_list``), oldest version first."""
    from harness.backends import registry

    out = {be: list(ps) for be, ps in registry().op_lists(backend_name).items()}
    for ps in out.values():
        ps.sort(key=lambda p: (_version_key(header_value(p, "version")), p.name))
    return out


def _base_version(v: str | None) -> str | None:
    """``2.13.0+cpu`` -> ``2.13.0``; ``1.25.0+torch2.4.1.cxx11.abi`` -> ``1.25.0``: what lists are named by."""
    return v.split("+", 1)[0] if v else v


def installed_version(backend_name: str) -> str | None:
    """Version of the installed plugin a backend's kernels come from, without importing it: torch's
    own for cpu and for cuda / rocm / xpu / mps when this torch is built with them, the vendor
    distribution's for the others; None when nothing installed provides the backend."""
    from importlib import metadata

    from harness.oplists.generate import BACKENDS

    built = {"cuda": bool(torch.version.cuda) and not torch.version.hip, "rocm": bool(torch.version.hip),
             "xpu": bool(getattr(torch.version, "xpu", None)), "mps": torch.backends.mps.is_built()}
    if not built.get(backend_name, True):  # this torch is not a build with that backend's kernels
        return None
    d = BACKENDS.get(backend_name)
    module = d.module if d else None
    if module is None:
        from harness.backends import registry

        reg = registry()
        module = reg.get(backend_name).module if backend_name in reg else None
    if module is None:  # nothing installed that the kernels come from: the list's version decides
        return None
    if module == "torch":
        return torch.__version__
    for dist in (module, module.replace("_", "-")):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def op_list_path(backend_name: str, version: str | None = None) -> Path | None:
    """The backend's declared op list whose version equals ``version`` (the installed plugin's), else
    its newest."""
    paths = declared_op_lists(backend_name).get(backend_name, [])
    if not paths:
        return None
    want = _base_version(version)
    for p in paths:
        if want and _base_version(header_value(p, "version")) == want:
            return p
    return paths[-1]


def version_warnings(backend_name: str, op_list: OpList, installed: str | None) -> list[str]:
    out = []
    listed = op_list.version
    if installed and listed and _base_version(installed) != _base_version(listed):
        out.append(f"warning: {backend_name}: the installed plugin is version {installed} but the op list "
                   f"{op_list.path.name if op_list.path else ''} is for version {listed}; regenerate it from your "
                   f"release's registration file (`harness oplist update --backend {backend_name} --from ...`, "
                   "docs/inspect.md)")
    built = str(op_list.meta.get("torch") or "")
    here = _base_version(torch.__version__) or ""
    if built and built.split(".")[:2] != here.split(".")[:2]:
        out.append(f"warning: {backend_name}: the op list is for a plugin built against torch {built}, this is "
                   f"torch {here}: ops it does not list are classified by this torch's composite kernels")
    return out


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


def structured_out(op: str) -> str | None:
    """``aten.mm.default`` -> ``aten.mm.out``: the out= overload a structured kernel's functional or
    inplace overload computes through (the installed torch's native_functions.yaml), else None."""
    from harness.oplists.generate import torch_structured_delegates

    ns, _, rest = op.partition(".")
    if ns != "aten":
        return None
    name, _, overload = rest.rpartition(".")
    delegate = torch_structured_delegates().get(name if overload == "default" else f"{name}.{overload}")
    return canonical(f"aten::{delegate}") if delegate else None


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
    version: str | None = None  # the backend version gaps were matched against (installed, else the list's)
    list_version: str | None = None  # the op list's, when a list decided
    warnings: list[str] = field(default_factory=list)  # e.g. installed plugin version != list version

    def by_status(self, status: str) -> list[OpCoverage]:
        return sorted((o for o in self.ops.values() if o.status == status), key=lambda o: o.op)

    def missing(self, include_known: bool = True) -> list[OpCoverage]:
        return [o for o in self.by_status(MISSING) if include_known or not o.known_gap]

    def counts(self) -> dict[str, int]:
        return {s: len(self.by_status(s)) for s in STATUS_ORDER if self.by_status(s)}

    def to_dict(self) -> dict:
        return {"backend": self.backend, "source": self.source, "version": self.version,
                "list_version": self.list_version, "warnings": self.warnings, "counts": self.counts(),
                "notes": self.notes,
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
        # A structured op's functional / inplace overload without a kernel of its own runs torch's
        # CompositeExplicitAutogradNonFunctional kernel, which calls the out= overload: the dispatcher
        # prefers it to a boxed fallback, so the out= kernel decides (as op lists tag it: generate.complete_structured)
        out = structured_out(op)
        if out is not None and _has(dispatcher_name(out), dispatch_key):
            return COMPOSITE, f"CompositeExplicitAutogradNonFunctional over its {dispatch_key} out= kernel {out}"
        if _backend_fallback(dispatch_key):
            via = f", reached through its out= overload {out}" if out is not None else ""
            return FALLBACK, f"{dispatch_key} boxed fallback{via}"
        return MISSING, f"no {dispatch_key} kernel, not composite"
    if op_list is not None:
        ns, name, _ = op.split(".", 2) if op.count(".") >= 2 else (op, "", "")
        tag = op_list.get(op) or op_list.get(f"{ns}.{name}.*")
        if tag:
            return tag, "declared in op list"
        comp = composite_kind(op)
        if comp:
            return COMPOSITE, comp
        if getattr(op_list, "unlisted", MISSING) == FALLBACK:
            return FALLBACK, "not in the declared op list; the backend's boxed CPU fallback runs it on the host"
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
    path = op_list_path(backend_name, installed_version(backend_name))
    if path is not None and not path.is_file():
        return None, None, f"none (declared op list {path} does not exist; by {be.source if be else 'builtin'})"
    if path is not None:
        ol = parse_op_list(path)
        return None, ol, ol.describe()
    why = "not registered" if be is None else (be.availability()[1] if not be.available() else "no dispatch_key")
    return None, None, f"none ({why}; declare an op list: see docs/inspect.md)"


def shipped_op_list(backend_name: str) -> OpList | None:
    """The backend's declared op list for its installed version (else its newest), when it declares
    one: what a machine without the backend classifies with, compared by the ``ops`` check with the
    dispatcher's answer where the backend is installed."""
    path = op_list_path(backend_name, installed_version(backend_name))
    return parse_op_list(path) if path is not None and path.is_file() else None


def _gap_op(entry) -> str:
    return canonical(entry if isinstance(entry, str) else str(entry.get("op", "")))


def _gap_applies(entry, version: str | None) -> bool:
    """Does the entry apply at ``version``? Unversioned entries always do, as does any entry when the
    version is unknown (nothing to compare with: excused, still tracked)."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    spec = "" if isinstance(entry, str) else str(entry.get("versions", "") or "")
    if not spec or version is None:
        return True
    try:
        return Version(_base_version(version)) in SpecifierSet(spec)
    except InvalidVersion:
        return False


def _gap_matches(entry, op: str, version: str | None) -> bool:
    g = _gap_op(entry)
    if g != op and not (g.endswith(".*") and g == re.sub(r"\.[^.]+$", ".*", op)):
        return False
    return _gap_applies(entry, version)


def _gaps_of(suite_or_gaps, backend: str) -> list:
    if suite_or_gaps is None:
        return []
    if isinstance(suite_or_gaps, list):
        return suite_or_gaps
    s = getattr(suite_or_gaps, "suite", suite_or_gaps)  # LoadedSuite -> Suite
    gaps = s.known_gaps if hasattr(s, "known_gaps") else suite_or_gaps
    return list(gaps.get(backend, []))


def known_gap(suite, backend: str, op: str, version: str | None = None) -> bool:
    """Is ``op`` (``aten.x.overload``) a known gap of ``backend`` at ``version`` for ``suite`` (a
    LoadedSuite, a Suite, its ``known_gaps`` dict, or that backend's entry list)? An entry without
    ``versions`` applies to every version (and when the version is unknown)."""
    return any(_gap_matches(e, op, version) for e in _gaps_of(suite, backend))


def backend_version(backend_name: str, op_list: OpList | None) -> str | None:
    """The version known gaps are matched against: the installed plugin's, else the op list's."""
    return installed_version(backend_name) or (op_list.version if op_list is not None else None)


# Ops the trace records because it follows the CPU's kernel choice (trace.emulate_device): on another
# backend ``scaled_dot_product_attention`` picks that backend's own fused kernel, or its math
# decomposition (CompositeImplicitAutograd) when it has none, so they are never missing there.
_SDPA_FUSED = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
               "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_fused_attention_overrideable")
DEVICE_SELECTED = {"aten._scaled_dot_product_flash_attention_for_cpu.default": "",
                   "aten._scaled_dot_product_flash_attention_for_cpu_backward.default": "_backward"}


def _device_selected(op: str, key: str | None, op_list: OpList | None) -> tuple[str, str] | None:
    suffix = DEVICE_SELECTED.get(op)
    if suffix is None:
        return None
    fused = [f"aten.{n}{suffix}.default" for n in _SDPA_FUSED]
    have = [f for f in fused if classify_op(f, dispatch_key=key, op_list=op_list)[0] == NATIVE]
    if have:
        return NATIVE, ("CPU's SDPA kernel in the trace; this backend's scaled_dot_product_attention takes its own "
                        "fused kernel: " + ", ".join(h.split(".")[1] for h in have))
    return COMPOSITE, ("CPU's SDPA kernel in the trace; this backend lists no fused SDPA kernel, so "
                       "scaled_dot_product_attention runs its math decomposition")


def coverage(inv: Inventory, backend_name: str, known_gaps=None) -> Coverage:
    """``known_gaps``: the backend's entries (strings or ``{op, versions}`` tables), or a suite."""
    key, oplist, source = backend_source(backend_name)
    cov = Coverage(backend_name, source)
    entries = _gaps_of(known_gaps, backend_name)
    inst = installed_version(backend_name)
    cov.version = backend_version(backend_name, oplist)
    if oplist is not None:
        cov.list_version = oplist.version
        cov.warnings += version_warnings(backend_name, oplist, inst)
    for op, rec in sorted(inv.ops.items()):
        status, how = classify_op(op, dispatch_key=key, op_list=oplist)
        if status != NATIVE and key != "CPU":
            status, how = _device_selected(op, key, oplist) or (status, how)
        known = status == MISSING and known_gap(entries, backend_name, op, cov.version)
        cov.ops[op] = OpCoverage(op, status, how, sorted(rec.modules), rec.count, known)
    gaps = {_gap_op(e) for e in entries if _gap_applies(e, cov.version)}
    if oplist is not None:
        cov.notes.insert(0, "op list: " + "; ".join(
            [f"{oplist.meta.get('backend', backend_name)} {oplist.version or '(no version)'}"]
            + [str(x) for x in oplist.meta.get("source", [])[:3]]))
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
