"""The operator-list format (``<backend>-<version>.txt``, docs/inspect.md): one aten overload per line
with an optional tag (native / composite / fallback), ``# key: value`` header lines; the statuses an
op can have on a backend. Read by ``harness.inspect.coverage``, written by ``generate``."""

from __future__ import annotations

import re
from pathlib import Path

NATIVE, COMPOSITE, FALLBACK, MISSING, UNKNOWN = "native", "composite", "cpu-fallback", "missing", "unknown"
STATUS_ORDER = (MISSING, UNKNOWN, FALLBACK, COMPOSITE, NATIVE)
OPLIST_DIR = Path(__file__).resolve().parent
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


class OpList(dict):
    """op (``aten.name.overload`` or ``aten.name.*``) -> status, plus the file's header: ``meta``
    (``backend``, ``version``, ``source`` lines, ...), ``unlisted`` (MISSING or FALLBACK) and ``path``."""

    def __init__(self, *args, meta: dict | None = None, path: Path | None = None, **kw):
        super().__init__(*args, **kw)
        self.meta: dict[str, str | list[str]] = meta or {}
        self.path = path

    @property
    def unlisted(self) -> str:
        return FALLBACK if str(self.meta.get("unlisted", "")).lower() in ("fallback", "cpu-fallback") else MISSING

    @property
    def version(self) -> str | None:
        v = self.meta.get("version")
        return str(v) if v else None

    def describe(self) -> str:
        v = f"{self.meta.get('backend', '?')} {self.version}" if self.version else "unversioned"
        p = self.path
        try:  # repository-relative where it can be: the same text on every machine
            p = p.resolve().relative_to(Path.cwd().resolve()) if p is not None else p
        except ValueError:
            pass
        return f"declared op list {p} ({v})"


_HEADER = re.compile(r"^#\s*([a-z_]+):\s*(.*)$")
_MULTI = ("source", "note", "excluded")


def parse_op_list(path: str | Path) -> OpList:
    out = OpList(path=Path(path))
    for raw in Path(path).read_text().splitlines():
        m = _HEADER.match(raw.strip())
        if m:
            k, v = m.group(1), m.group(2).strip()
            if k in _MULTI:
                out.meta.setdefault(k, []).append(v)
            else:
                out.meta.setdefault(k, v)
            continue
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


def header_value(path: Path, key: str) -> str | None:
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.startswith("#"):
                return None
            m = _HEADER.match(line.strip())
            if m and m.group(1) == key:
                return m.group(2).strip()
    return None
