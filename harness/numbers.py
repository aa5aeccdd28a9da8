"""Numbers on the command line, checked where they enter (issue #49): an argparse ``type`` with a
range and finiteness, so a bad value is argparse's one line naming the option (exit 2) before
anything runs, never a traceback after the work (``--pr-comment ²``), an overflow (``quarantine
--days 3000000``) or a silent no-op (``server start --idle nan``).

``count(1, 1000)`` is a whole number in [1, 1000]; ``amount(0, 1, low_open=True)`` a finite real in
(0, 1]. Whole numbers are plain ASCII digits: ``int()`` also takes "²", "1_000" and " 7 "."""

from __future__ import annotations

import argparse
import math
import re

_WHOLE = re.compile(r"[+-]?[0-9]+")
DAY_S = 86400.0


def _range(lo, hi, low_open: bool) -> str:
    left = f"> {lo:g}" if low_open else f">= {lo:g}"
    return left if hi is None else f"{left} and <= {hi:g}"


def count(lo: int = 0, hi: int | None = None):
    """A whole number in [lo, hi] (hi None: no upper bound)."""

    def parse(text: str) -> int:
        if not _WHOLE.fullmatch(text):
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}")
        v = int(text)
        if v < lo or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"must be {_range(lo, hi, False)}, got {v}")
        return v

    parse.__name__ = "count"
    return parse


def amount(lo: float = 0.0, hi: float | None = None, low_open: bool = False):
    """A finite real number in [lo, hi] ((lo, hi] with ``low_open``)."""

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(v):
            raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
        if v < lo or (low_open and v == lo) or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"must be {_range(lo, hi, low_open)}, got {text}")
        return v

    parse.__name__ = "amount"
    return parse


def pull_request(text: str) -> str:
    """``--pr-comment``: 'auto' or a pull request number (a whole number >= 1)."""
    if text == "auto":
        return text
    count(1)(text)
    return text
