"""Names read from files, turned into paths: the one gate every such join goes through.

A suite's ``model.name`` or a parallel layout's ``name``, a perf sidecar's ``suite``, a shard named
by ``model.safetensors.index.json``, a file named by a weights manifest, a sidecar path named by a
JUnit property: each is data someone else wrote, and each becomes part of a path harness reads or
writes. Joined as it is, ``../../x`` or ``/etc/x`` or a symlink lets a file choose where results are
written, or which file outside a checkpoint is loaded without the manifest covering it. So every
writer and reader joins such a value through :func:`join` (or checks it with :func:`name` first):

* a **name** is one plain path component: letters, digits, ``_``, then also ``.``, ``+``, ``-``;
  never empty, never ``..``, no separator, no leading dot (a hidden file is where atomic writes
  keep their temporaries), no NUL;
* a **relative path** (``plain=False``: a shard in a sub-folder) is names joined by ``/``;
* either way the joined path, **after resolving symlinks**, must stay under the root.

Anything else raises :class:`PathRefused`, one line naming the file the value came from and the
field: ``results/x.xml: harness.detail.perf_samples: '../../etc' is not a plain name ...``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from harness.messages import display

# The one definition of a plain name (it was golden/store.py's NAME_RX: goldens use it too).
NAME_RX = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]*")
MAX_NAME = 200  # under every file system's 255-byte component limit, with room for suffixes


class PathRefused(ValueError):
    """A data-derived name or path that would leave its root. ``str()`` is one line:
    ``<file>: <field>: <what is wrong>``."""


def _where(source, field: str) -> str:
    if source is None:
        return f"(unknown file): {field}"
    src = str(source)
    return f"{display(src) if os.path.isabs(src) else src}: {field}"


def problem(value) -> str | None:
    """Why ``value`` is not a plain name, or None when it is one."""
    if not isinstance(value, str):
        return f"must be a string, got {type(value).__name__} {value!r}"[:160]
    if "\x00" in value:
        return f"{value[:60]!r} contains a NUL byte"
    if not value:
        return "is empty"
    if len(value) > MAX_NAME:
        return f"{value[:40]!r}... is longer than {MAX_NAME} characters"
    if not NAME_RX.fullmatch(value) or ".." in value:
        return (f"{value[:80]!r} is not a plain name (letters, digits, '_', then '.', '+', '-'; "
                "no path separators, no '..', no leading dot)")
    return None


def name(value, *, source, field: str) -> str:
    """``value`` when it is a plain name (module docstring); else :class:`PathRefused`."""
    why = problem(value)
    if why:
        raise PathRefused(f"{_where(source, field)}: {why}")
    return value


def join(root: str | Path, value, *, source, field: str, plain: bool = True,
         within: str | Path | None = None) -> Path:
    """``root / value``, refused unless ``value`` is a plain name (``plain=False``: a relative path
    of plain names) and the result, symlinks resolved, stays under ``within`` (default ``root``;
    a caller whose files are symlinks by design, the Hugging Face cache, names the wider folder)."""
    root = Path(root)
    if plain:
        name(value, source=source, field=field)
        parts = [value]
    else:
        if not isinstance(value, str):
            raise PathRefused(f"{_where(source, field)}: must be a string, got {type(value).__name__} {value!r}"[:200])
        if "\x00" in value:
            raise PathRefused(f"{_where(source, field)}: {value[:60]!r} contains a NUL byte")
        if value.startswith("/") or "\\" in value or re.match(r"^[A-Za-z]:", value):
            raise PathRefused(f"{_where(source, field)}: {value[:80]!r} is an absolute path; "
                              f"only paths relative to {root} are accepted")
        parts = [p for p in value.split("/") if p not in ("", ".")]
        if not parts:
            raise PathRefused(f"{_where(source, field)}: {value!r} names no file")
        for p in parts:
            why = problem(p)
            if why:
                raise PathRefused(f"{_where(source, field)}: {value[:80]!r}: component {why}")
    out = root.joinpath(*parts)
    bound = Path(within) if within is not None else root
    if not out.resolve().is_relative_to(bound.resolve()):  # a symlink inside the root that points out of it
        raise PathRefused(f"{_where(source, field)}: {value[:80]!r} resolves to {out.resolve()}, outside {bound} "
                          "(a symlink leaving the folder)")
    return out
