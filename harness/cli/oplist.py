"""``harness oplist``: the operator lists `harness inspect` and the ops check use for backends that are
not installed here (docs/inspect.md).

  harness oplist update --backend cuda --from torch
  harness oplist update --backend npu --from npu_native_functions.yaml --from op_plugin_functions.yaml \\
      --version 2.13.0 --select v2.13 --source "Ascend/pytorch torch_npu/csrc/aten/npu_native_functions.yaml @ ..."
  harness oplist show [--backend npu]

``update`` regenerates ``harness/oplists/<backend>-<version>.txt`` from the vendor's own registration
file(s), so a vendor refreshes the list for their release; ``--from torch`` reads the installed
torch's packaged native_functions.yaml.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("oplist", help="generate and list the backends' operator lists (provenance included)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = p.add_subparsers(dest="verb", metavar="VERB")
    u = verbs.add_parser("update", help="regenerate a backend's op list from a vendor registration file")
    u.add_argument("--backend", required=True, help="backend name (cuda, rocm, xpu, npu, musa, mlu, or yours)")
    u.add_argument("--from", dest="sources", action="append", required=True, metavar="PATH_OR_YAML",
                   help="a registration file (native_functions.yaml, npu_native_functions.yaml, "
                   "op_plugin_functions.yaml, musa_functions.yaml, mlu_functions.yaml, a C++ fallback_list, an op "
                   "list), 'torch' for the installed torch's packaged native_functions.yaml, or 'dispatcher' for "
                   "what the installed backend really registers (its module imported, its dispatch key's kernel "
                   "table read; a boxed fallback makes unlisted ops fallback); repeatable")
    u.add_argument("--version", help="the plugin version the list is for (default: torch's for --from torch)")
    u.add_argument("--source", dest="provenance", action="append", default=[], metavar="TEXT",
                   help="provenance of each --from, in order: repository, path, tag or commit, date")
    u.add_argument("--torch-version", help="the torch release the plugin is built against (default: a "
                   "'+torchX' suffix of --version, else --version itself)")
    u.add_argument("--dispatch-key", help="dispatch key whose registrations count (default: the backend's)")
    u.add_argument("--select", help="op-plugin version to select (default v<major>.<minor> of --version)")
    u.add_argument("--unlisted", choices=("missing", "fallback"),
                   help="what happens to ops not listed (default: the backend's: fallback for npu and mlu, "
                   "whose plugins register a boxed CPU fallback)")
    u.add_argument("--output", "-o", help="where to write (default harness/oplists/<backend>-<version>.txt; "
                   "'-' for stdout)")
    u.set_defaults(func=run_update)
    s = verbs.add_parser("show", help="the backends' declared op lists (shipped with harness or a vendor "
                         "package, or in harness.toml): backend, version, counts, sources")
    s.add_argument("--backend", help="only this backend")
    s.set_defaults(func=run_show)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def _fail(msg: str) -> int:
    print(f"harness oplist: {msg}", file=sys.stderr)
    return 2


def _command(args, version: str) -> str:
    """The command that regenerates the list (file names only: local paths mean nothing elsewhere)."""
    import shlex

    parts = ["--backend", args.backend]
    for src in args.sources:
        parts += ["--from", src if src == "torch" else Path(src).name]
    parts += ["--version", version]
    for flag in ("torch_version", "dispatch_key", "select", "unlisted"):
        if getattr(args, flag):
            parts += ["--" + flag.replace("_", "-"), getattr(args, flag)]
    return "harness oplist update " + " ".join(shlex.quote(p) for p in parts)


def run_update(args) -> int:
    from harness.oplists.generate import BACKENDS, default_output, render

    d = BACKENDS.get(args.backend)
    key = args.dispatch_key or (d.dispatch_key if d else None)
    if key is None:  # a vendor's backend: the dispatch key its registration declares
        from harness.backends import registry

        reg = registry()
        key = reg.get(args.backend).dispatch_key if args.backend in reg else None
    if key is None:
        return _fail(f"backend {args.backend!r} has no default dispatch key; pass --dispatch-key")
    version = _version(args)
    if version is None:
        return _fail("--version is required (the plugin version the list is for)")
    if args.provenance and len(args.provenance) != len(args.sources):
        return _fail(f"{len(args.sources)} --from but {len(args.provenance)} --source; give one each, in order")
    extracted = _extract_all(args, key, version)
    if isinstance(extracted, int):
        return extracted
    unlisted = args.unlisted or (d.unlisted if d else None)
    if unlisted is None:
        from harness.oplists.generate import has_backend_fallback

        unlisted = "fallback" if "dispatcher" in args.sources and has_backend_fallback(key) else "missing"
    m = re.search(r"\+torch([0-9][0-9.]*[0-9])", version)
    torch_version = args.torch_version or (m.group(1) if m else version.split("+", 1)[0])
    if not args.torch_version and "dispatcher" in args.sources:  # read from this very torch
        import torch

        torch_version = torch.__version__.split("+", 1)[0]
    text = render(args.backend, version, extracted, dispatch_key=key, unlisted=unlisted, torch_version=torch_version,
                  exclude=d.exclude if d else None, exclude_why=d.exclude_why if d else "",
                  notes=d.notes if d else (), command=_command(args, version))
    if args.output == "-":
        sys.stdout.write(text)
        return 0
    out = Path(args.output) if args.output else default_output(args.backend, version)
    out.parent.mkdir(parents=True, exist_ok=True)
    from harness.files import atomic

    atomic.write_text(out, text)
    counts = next(line for line in text.splitlines() if line.startswith("# counts:"))[2:]
    print(f"wrote {out}: {args.backend} {version}, {counts}")
    return 0


def _version(args) -> str | None:
    """The plugin version the list is for: --version, else the installed torch's for --from torch."""
    import torch

    if args.version is not None:
        return args.version
    if "dispatcher" in args.sources:  # the installed plugin's own version
        from harness.inspect.coverage import installed_version

        return installed_version(args.backend)
    if "torch" not in args.sources:
        return None
    return torch.__version__.split("+", 1)[0]


def _from_dispatcher(backend: str, key: str, version: str) -> tuple[str, object] | int:
    """(provenance, registrations) read from the dispatcher with the backend's module imported, or
    the exit status when the backend is not installed here."""
    import torch

    from harness.backends import registry
    from harness.oplists.generate import from_dispatcher

    reg = registry()
    if backend not in reg:
        return _fail(f"--from dispatcher: backend {backend!r} is not registered here (harness backends)")
    be = reg.get(backend)
    ok, why = be.availability()
    if not ok:
        return _fail(f"--from dispatcher: backend {backend} is not available here: {why}")
    what = f"{be.module} {version}" if be.module else f"torch {torch.__version__}"
    return (f"the dispatcher's {key} kernel table with {what} loaded (torch {torch.__version__}), "
            f"read by harness oplist update --from dispatcher", from_dispatcher(key))


def _extract_all(args, key: str, version: str) -> list[tuple[str, object]] | int:
    """(provenance, extracted registrations) of each --from, in order; or the exit status of the
    first source that cannot be read (its message printed)."""
    import torch

    from harness.oplists.generate import OpListSourceError, extract, packaged_native_functions

    select = args.select or "v" + ".".join(version.split("+", 1)[0].split(".")[:2])
    extracted = []
    for i, src in enumerate(args.sources):
        if src == "dispatcher":
            got = _from_dispatcher(args.backend, key, version)
            if isinstance(got, int):
                return got
            extracted.append((args.provenance[i] if args.provenance else got[0], got[1]))
            continue
        if src == "torch":
            path = packaged_native_functions()
            prov = (f"pytorch/pytorch aten/src/ATen/native/native_functions.yaml @ v{version} "
                    f"(git {torch.version.git_version}), as packaged in the installed torch {torch.__version__} "
                    f"(torchgen/packaged/ATen/native/native_functions.yaml)")
        else:
            path = Path(src)
            prov = str(path)
        if args.provenance:
            prov = args.provenance[i]
        if not path.is_file():
            return _fail(f"{src}: no such file")
        try:
            extracted.append((prov, extract(path, args.backend, dispatch_key=key, select=select)))
        except OpListSourceError as e:
            return _fail(f"{src}: {e}")
        except (OSError, UnicodeError) as e:
            return _fail(f"{src}: cannot read: {e}")
    return extracted


def run_show(args) -> int:
    from harness.backends import registry
    from harness.inspect.coverage import declared_op_lists, parse_op_list

    lists = declared_op_lists(args.backend)
    if not lists:
        return _fail(f"no op list declared for {args.backend!r}" if args.backend else "no op lists declared")
    reg = registry()
    for be in sorted(lists):
        declared_by = reg.get(be).source if be in reg else "builtin"
        for p in lists[be]:
            try:
                ol = parse_op_list(p)
            except (OSError, UnicodeError) as e:
                print(f"{be}: {p}: cannot read: {e} (declared by {declared_by})")
                continue
            print(f"{be} {ol.version or '(no version)'}: {p.name}, {len(ol)} ops, unlisted ops "
                  f"{ol.unlisted}; {ol.meta.get('counts', '')} (declared by {declared_by})")
            for src in ol.meta.get("source", []):
                print(f"  source: {src}")
    return 0
