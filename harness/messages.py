"""How harness words things it did not write: the first line of an error or a log, and a path as
the user typed it (relative to where they stand, when it can be)."""

from __future__ import annotations

import os
from pathlib import Path


def first_line(obj: BaseException | str | None, limit: int | None = None) -> str:
    """The first non-blank line of an exception's message or of a text, stripped (cut to ``limit``)."""
    for line in str(obj if obj is not None else "").splitlines():
        if line.strip():
            return line.strip()[:limit] if limit else line.strip()
    return ""


def display(p: str | Path) -> str:
    """``p`` relative to the working directory (what a user typed), else as it is (another drive)."""
    try:
        return os.path.relpath(p)
    except ValueError:
        return str(p)
