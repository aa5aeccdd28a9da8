"""Generate a backend's op list from the registration file its vendor publishes.

``harness oplist update --backend NAME --from PATH_OR_YAML`` (harness/cli/oplist.py) reads one or
more vendor files and writes ``harness/oplists/<backend>-<version>.txt``: one aten overload per line
with how the backend provides it (``native``, ``composite``, ``fallback``), under a header that says
where the facts came from (repository, path, tag or commit, date) and what happens to ops that are
not listed (``unlisted: missing`` or ``unlisted: fallback`` for plugins that register a boxed CPU
fallback for their dispatch key). Only op *names* are copied from the vendor files.

Recognised inputs (detected from their structure, so a vendor can point at their own file):

* PyTorch's ``native_functions.yaml`` (the installed torch's packaged copy: ``--from torch``; Intel's
  ``yaml/native/native_functions.yaml`` in torch-xpu-ops): an op is ``native`` when its ``dispatch``
  names the backend's key, directly or through its ``structured_delegate``; ``composite`` when it is
  CompositeImplicitAutograd (no ``dispatch`` section), CompositeExplicitAutograd(NonFunctional), or
  an ``autogen`` out= variant;
* a gen_backend_stubs file (``backend: NPU`` with ``supported`` / ``autograd`` / ``custom`` /
  ``symint`` and the older ``tocpu`` section, whose ops torch_npu ran on the host): torch_npu's
  ``npu_native_functions.yaml``;
* Ascend op-plugin's ``op_plugin_functions.yaml`` (``all_version`` / ``official`` / ``custom`` ...):
  an op counts when its ``acl_op`` or ``op_api`` versions include the selected torch version;
* Cambricon's ``mlu_functions.yaml`` (``aten`` / ``vision`` / ``audio`` / ``custom`` sections);
* a plain list of ``- func:`` entries in which every entry is a registration (torch_musa's
  ``musa_functions.yaml``);
* a C++ source with a ``fallback_list = { "op", ... }`` block (torch-xpu-ops' XPUFallback.template,
  whose ops run on the CPU): those ops are tagged ``fallback``;
* an existing harness op list (``.txt``).
"""

from __future__ import annotations

import datetime as _dt
import functools
import re
from dataclasses import dataclass, field
from pathlib import Path

from harness.oplists.format import COMPOSITE, FALLBACK, NATIVE, OPLIST_DIR, canonical, parse_op_list

TAG_WORD = {NATIVE: "native", COMPOSITE: "composite", FALLBACK: "fallback"}
# Which source wins when two disagree: the host-fallback routing is explicit vendor intent; a kernel
# beats a decomposition.
_RANK = {COMPOSITE: 0, NATIVE: 1, FALLBACK: 2}
_COMPOSITE_KEYS = {"CompositeImplicitAutograd", "CompositeExplicitAutograd",
                   "CompositeExplicitAutogradNonFunctional"}


@dataclass(frozen=True)
class BackendDefaults:
    dispatch_key: str
    module: str  # the Python distribution whose version the list is for
    unlisted: str = "missing"
    exclude: str | None = None  # regex of op names registered under the key that cannot run in this flavour
    exclude_why: str = ""
    notes: tuple[str, ...] = ()


BACKENDS: dict[str, BackendDefaults] = {
    "cpu": BackendDefaults("CPU", "torch"),
    "cuda": BackendDefaults(
        "CUDA", "torch", exclude=r"^miopen",
        exclude_why="miopen_* ops are registered under the CUDA key but are ATen stubs that raise "
        "'ATen not compiled with MIOpen support' in NVIDIA builds"),
    "rocm": BackendDefaults(
        "CUDA", "torch", exclude=r"^_?cudnn",
        exclude_why="cudnn_* / _cudnn_* ops are registered under the CUDA key but are ATen stubs that raise "
        "'ATen not compiled with cuDNN support' in ROCm builds (ROCm uses the miopen_* ops)",
        notes=("ROCm builds of torch register their (hipified) kernels under the CUDA dispatch key, from the "
               "same native_functions.yaml: this list is the CUDA key's, less the cuDNN-only ops.",)),
    "xpu": BackendDefaults(
        "XPU", "torch",
        notes=("torch-xpu-ops registers a boxed fallback for XPU that raises for unimplemented ops unless "
               "PYTORCH_ENABLE_XPU_FALLBACK=1 (src/ATen/native/xpu/XPUFallback.template): unlisted aten ops are "
               "missing; its fallback_list ops are registered to run on the CPU.",)),
    "mps": BackendDefaults("MPS", "torch"),
    "npu": BackendDefaults(
        "PrivateUse1", "torch_npu", unlisted="fallback",
        notes=("torch_npu registers a boxed CPU fallback for PrivateUse1 (torch_npu/csrc/aten/"
               "VariableFallbackKernel.cpp, npu_cpu_fallback): unlisted aten ops run on the host.",)),
    "musa": BackendDefaults(
        "PrivateUse1", "torch_musa",
        notes=("torch_musa registers no CPU fallback for PrivateUse1 (only autograd and autocast "
               "fallthroughs): unlisted aten ops are missing.",)),
    "mlu": BackendDefaults(
        "PrivateUse1", "torch_mlu", unlisted="fallback",
        notes=("torch_mlu registers a boxed CPU fallback for PrivateUse1, enabled unless "
               "ENABLE_FALLBACK_TO_CPU=0 (torch_mlu/csrc/aten/MLUFallback.cpp): unlisted aten ops run on "
               "the host.",)),
}


class OpListSourceError(ValueError):
    """A --from file harness cannot read as any known registration format."""


@dataclass
class Extracted:
    ops: dict[str, str] = field(default_factory=dict)  # aten.name.overload -> tag
    kind: str = ""
    notes: list[str] = field(default_factory=list)

    def add(self, op: str, tag: str) -> None:
        old = self.ops.get(op)
        if old is None or _RANK[tag] > _RANK[old]:
            self.ops[op] = tag


def _name(entry) -> str:
    """``add.Tensor(Tensor self, ...) -> Tensor`` or a dict with ``func`` -> ``add.Tensor``."""
    func = entry.get("func") if isinstance(entry, dict) else entry
    return str(func).split("(", 1)[0].strip()


def _op(name: str, ns: str = "aten") -> str:
    return canonical(f"{ns}::{name}" if "." in name else f"{ns}::{name}.default")


def _keys(entry: dict) -> set[str]:
    d = entry.get("dispatch") or {}
    if isinstance(d, str):  # mlu: `dispatch: SparsePrivateUse1`
        keys = {k.strip() for k in d.split(",")}
    else:
        keys = {k.strip() for spec in d for k in str(spec).split(",")}
    if entry.get("ufunc_inner_loop"):  # torchgen's ufunc codegen emits CPU and CUDA kernels (add.out)
        keys |= {"CPU", "CUDA"}
    return keys


# --- PyTorch's native_functions.yaml ----------------------------------------------------------------
def from_native_functions(entries: list, key: str) -> Extracted:
    out = Extracted(kind=f"native_functions.yaml, dispatch key {key}")
    by_name = {_name(e): e for e in entries if isinstance(e, dict) and "func" in e}
    for name, e in by_name.items():
        keys = _keys(e)
        delegate = e.get("structured_delegate")
        if delegate and delegate in by_name:  # functional/inplace kernels generated per key of the out=
            keys |= _keys(by_name[delegate])
        if "dispatch" not in e and not delegate and not e.get("ufunc_inner_loop"):  # `dispatch: {}`: no kernel
            keys.add("CompositeImplicitAutograd")  # torchgen's default for an entry without dispatch
        if key in keys:
            out.add(_op(name), NATIVE)
        elif keys & _COMPOSITE_KEYS:
            out.add(_op(name), COMPOSITE)
        for gen in str(e.get("autogen") or "").split(","):  # generated out= variants: CompositeExplicit
            if gen.strip():
                out.add(_op(gen.strip()), COMPOSITE)
    return out


@functools.lru_cache(maxsize=4)
def _load_yaml(path: Path, mtime: float):
    import yaml

    try:
        return yaml.load(path.read_text(encoding="utf-8", errors="replace"),
                         Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except yaml.YAMLError as e:
        raise OpListSourceError(f"not valid YAML: {str(e).splitlines()[0]}") from None


def load_yaml(path: Path):
    """Parsed once per process per file version (torch's native_functions.yaml is 15k lines)."""
    return _load_yaml(path.resolve(), path.stat().st_mtime)


def torch_structured_delegates() -> dict[str, str]:
    """``scatter.src`` -> ``scatter.src_out``: functional / inplace overloads of the installed torch's
    structured kernels and the out= overload that computes them."""
    entries = load_yaml(packaged_native_functions())
    return {_name(e): e["structured_delegate"] for e in entries if isinstance(e, dict) and e.get("structured_delegate")}


def _dense(keys: set[str]) -> bool:
    return not keys or not all(k.startswith(("Sparse", "Quantized", "NestedTensor")) for k in keys)


def from_listed(entries: list, ns: str = "aten") -> Extracted:
    """Every ``- func:`` entry is a registration for the backend (torch_musa's musa_functions.yaml).
    An entry whose own ``dispatch`` only names sparse/quantized keys still gets the dense kernel when
    it is the functional/inplace member of a structured group whose out= is listed (``cat`` with
    ``cat.out``): the codegen derives it from the out= kernel."""
    out = Extracted(kind="list of registered functions")
    listed = [(_name(e), _keys(e) if isinstance(e, dict) else set()) for e in entries
              if isinstance(e, (dict, str)) and _name(e)]
    dense = {name for name, keys in listed if _dense(keys)}
    delegates = torch_structured_delegates() if len(dense) < len(listed) else {}
    for name, _ in listed:
        if name in dense or delegates.get(name) in dense:
            out.add(_op(name, ns), NATIVE)
    return out


def complete_structured(ops: dict[str, str], delegates: dict[str, str]) -> list[str]:
    """Functional / inplace overloads of structured kernels that a list leaves out while listing their
    out= overload: torch registers a CompositeExplicitAutogradNonFunctional kernel for them that
    calls the out= kernel, and the dispatcher prefers it to a backend's boxed fallback. Returns the
    ops added as ``composite``."""
    added = []
    for name, delegate in delegates.items():
        op, out = _op(name), _op(delegate)
        if op not in ops and ops.get(out) == NATIVE:
            ops[op] = COMPOSITE
            added.append(op)
    return sorted(added)


# --- torch_npu (gen_backend_stubs) ------------------------------------------------------------------
def from_backend_stubs(doc: dict, custom_ns: str = "npu") -> Extracted:
    out = Extracted(kind=f"gen_backend_stubs yaml (backend {doc.get('backend')})")
    for section, ns, tag in (("supported", "aten", NATIVE), ("autograd", "aten", NATIVE),
                             ("symint", "aten", NATIVE), ("custom", custom_ns, NATIVE),
                             ("custom_autograd", custom_ns, NATIVE), ("tocpu", "aten", FALLBACK)):
        for e in doc.get(section) or []:
            name = _name(e)
            if not name:
                continue
            if section == "symint" and _op(name, custom_ns) in out.ops:
                continue  # a modifier of a custom op listed above
            out.add(_op(name, ns), tag)
    return out


# --- Ascend op-plugin -------------------------------------------------------------------------------
def _versions_of(spec, all_versions: list[str]) -> set[str]:
    """op-plugin's ``acl_op`` / ``op_api``: ``all_version``, ``[v2.1, newest]`` (closed range),
    ``v1.11, v2.1`` (a set) or a single version."""
    if spec is None or spec is False:
        return set()
    if spec is True or spec == "all_version":
        return set(all_versions)
    if isinstance(spec, list) and len(spec) == 2:
        lo, hi = (all_versions[-1] if str(v) == "newest" else str(v) for v in spec)
        if lo in all_versions and hi in all_versions:
            return set(all_versions[all_versions.index(lo):all_versions.index(hi) + 1])
    items = spec if isinstance(spec, list) else str(spec).split(",")
    return {all_versions[-1] if str(v).strip() == "newest" else str(v).strip() for v in items}


def from_op_plugin(doc: dict, select: str) -> Extracted:
    all_versions = [str(v) for v in doc.get("all_version") or []]
    if select not in all_versions:
        raise OpListSourceError(f"op-plugin yaml has no version {select!r} (all_version: {', '.join(all_versions)})")
    out = Extracted(kind=f"op-plugin yaml, ops whose acl_op or op_api includes {select}")
    for section, ns in (("official", "aten"), ("autograd", "aten"), ("quant", "aten"), ("custom", "npu"),
                        ("symint", None)):
        for e in doc.get(section) or []:
            if not isinstance(e, dict) or "func" not in e:
                continue
            if select not in (_versions_of(e.get("acl_op"), all_versions)
                              | _versions_of(e.get("op_api"), all_versions)):
                continue
            name = _name(e)
            space = ns
            if space is None:  # symint lists both aten and custom ops; custom ones are npu_* by convention
                space = "npu" if name.startswith("npu_") or _op(name, "npu") in out.ops else "aten"
            out.add(_op(name, space), NATIVE)
    return out


# --- Cambricon mlu_functions.yaml -------------------------------------------------------------------
def from_mlu(doc: dict) -> Extracted:
    out = Extracted(kind="mlu_functions.yaml")
    for section, ns in (("aten", "aten"), ("vision", "torchvision"), ("audio", "torchaudio"),
                        ("custom", "torch_mlu")):
        for e in doc.get(section) or []:
            name = _name(e)
            keys = _keys(e) if isinstance(e, dict) else set()
            if keys and "PrivateUse1" not in {k.replace("Privateuse1", "PrivateUse1") for k in keys}:
                continue  # `dispatch: SparsePrivateUse1` only: not the dense kernel
            if name:
                out.add(_op(name, ns), NATIVE)
    return out


# --- C++ fallback lists -----------------------------------------------------------------------------
_FALLBACK_BLOCK = re.compile(r"fallback_list\s*=\s*\{(.*?)\}", re.S)


def from_fallback_source(text: str) -> Extracted:
    out = Extracted(kind="C++ fallback_list (ops run on the CPU)")
    blocks = _FALLBACK_BLOCK.findall(text)
    if not blocks:
        raise OpListSourceError("no `fallback_list = { ... }` block found")
    for block in blocks:
        body = "\n".join(line.split("//", 1)[0] for line in block.splitlines())
        for name in re.findall(r'"([A-Za-z0-9_.]+)"', body):
            out.add(_op(name), FALLBACK)
    return out


def from_dispatcher(key: str, namespace: str = "aten") -> Extracted:
    """What the running process's dispatcher really has for ``key``: every ``namespace`` overload
    with a kernel registered for it (native). Import the backend's module first: its registrations
    are what is read. Whether unlisted ops fall back is :func:`has_backend_fallback`."""
    import torch

    out = Extracted(kind=f"dispatcher: {key} kernels registered in this process")
    for n in torch._C._dispatch_get_all_op_names():
        if not n.startswith(f"{namespace}::"):
            continue
        try:
            has = torch._C._dispatch_has_kernel_for_dispatch_key(n, key)
        except RuntimeError:
            continue
        if has:
            out.add(canonical(n if "." in n.split("::", 1)[1] else n + ".default"), NATIVE)
    return out


def has_backend_fallback(key: str) -> bool:
    """Does ``key`` have a boxed backend fallback (``TORCH_LIBRARY_IMPL(_, key, m)``) in this process?"""
    import torch

    try:
        return bool(torch._C._dispatch_has_backend_fallback(getattr(torch._C.DispatchKey, key)))
    except (AttributeError, RuntimeError):
        return False


# --- dispatch on structure --------------------------------------------------------------------------
def packaged_native_functions() -> Path:
    """The installed torch's own native_functions.yaml (torchgen ships it)."""
    import torchgen

    return Path(torchgen.__file__).parent / "packaged" / "ATen" / "native" / "native_functions.yaml"


def extract(path: Path, backend: str, *, dispatch_key: str | None = None, select: str | None = None) -> Extracted:
    if path.suffix == ".txt":
        out = Extracted(kind="harness op list")
        for op, tag in parse_op_list(path).items():
            out.add(op, tag)
        return out
    if path.suffix not in (".yaml", ".yml"):
        return from_fallback_source(path.read_text(encoding="utf-8", errors="replace"))
    doc = load_yaml(path)
    defaults = BACKENDS.get(backend)
    key = dispatch_key or (defaults.dispatch_key if defaults else None)
    if isinstance(doc, dict) and "all_version" in doc:
        if not select:
            raise OpListSourceError("an op-plugin yaml needs --select vX.Y (the torch version, e.g. v2.13)")
        return from_op_plugin(doc, select)
    if isinstance(doc, dict) and ("supported" in doc or "backend" in doc):
        return from_backend_stubs(doc)
    if isinstance(doc, dict) and "aten" in doc:
        return from_mlu(doc)
    if isinstance(doc, list):
        has_key = key is not None and key != "PrivateUse1" and any(
            isinstance(e, dict) and key in _keys(e) for e in doc)
        return from_native_functions(doc, key) if has_key else from_listed(doc)
    raise OpListSourceError("not a registration format harness knows (native_functions.yaml, gen_backend_stubs, "
                            "op-plugin, mlu_functions.yaml, a list of `- func:` entries, or a C++ fallback_list)")


# --- writing ----------------------------------------------------------------------------------------
def render(backend: str, version: str, extracted: list[tuple[str, Extracted]], *, dispatch_key: str,
           unlisted: str, torch_version: str | None = None, exclude: str | None = None, exclude_why: str = "", notes: tuple[str, ...] = (),
           command: str = "", complete: bool = True) -> str:
    """The op list file: provenance header, then ``aten.name.overload tag`` lines, sorted."""
    merged = Extracted()
    for _, ex in extracted:
        for op, tag in ex.ops.items():
            merged.add(op, tag)
    excluded = sorted(op for op in merged.ops if exclude and re.search(exclude, op.split(".", 1)[1]))
    for op in excluded:
        del merged.ops[op]
    derived = complete_structured(merged.ops, torch_structured_delegates()) if complete else []
    counts = {w: sum(1 for t in merged.ops.values() if t == tag) for tag, w in TAG_WORD.items()}
    head = [f"# harness op list: backend {backend}, version {version}",
            f"# backend: {backend}", f"# version: {version}", f"# dispatch_key: {dispatch_key}",
            f"# unlisted: {unlisted}"] + ([f"# torch: {torch_version}"] if torch_version else []) + [

            f"# generated: {_dt.date.today().isoformat()}" + (f" by `{command}`" if command else "")]
    head += [f"# source: {src} [{ex.kind}]" for src, ex in extracted]
    head += [f"# note: {n}" for n in notes]
    if derived:
        head.append(f"# derived: {len(derived)} functional/inplace overload(s) of structured kernels whose out= "
                    "is listed, tagged composite (torch's CompositeExplicitAutogradNonFunctional kernel calls the "
                    "out= kernel; structured_delegate map of the installed torch)")
    if excluded:
        head.append(f"# excluded: {len(excluded)} op(s) because {exclude_why}: {', '.join(excluded)}")
    head.append("# counts: " + ", ".join(f"{w} {n}" for w, n in counts.items()))
    body = [f"{op} {TAG_WORD[tag]}" if tag != NATIVE else op for op, tag in sorted(merged.ops.items())]
    return "\n".join(head + body) + "\n"


def default_output(backend: str, version: str) -> Path:
    safe = re.sub(r"[^A-Za-z0-9._+-]", "_", version)
    return OPLIST_DIR / f"{backend}-{safe}.txt"
