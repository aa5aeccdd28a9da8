"""Per-rank status files: what each rank was doing, for the report when it hangs or dies.

One fixed-size file per rank (``status-<rank>``), rewritten in place (``pwrite``) whenever the
rank changes layout, step or collective, or enters another module: ``index\\tlayout\\tstep\\t
collective\\tmodule``. The launcher reads them after killing a hung launch, and the rank wrapper
(``harness.parallel.rank``) adds the worker's exit status in ``exit-<rank>.json``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

STATUS_BYTES = 1024


@dataclass
class RankStatus:
    rank: int
    index: int = -1
    layout: str = ""
    step: str = ""
    collective: str = ""
    module: str = ""

    def line(self) -> str:
        return "\t".join([str(self.index), self.layout, self.step, self.collective, self.module])

    @classmethod
    def parse(cls, rank: int, raw: str) -> RankStatus:
        parts = (raw.strip("\x00 \n").split("\t") + [""] * 5)[:5]
        try:
            idx = int(parts[0])
        except ValueError:
            idx = -1
        return cls(rank, idx, parts[1], parts[2], parts[3], parts[4])

    def describe(self) -> str:
        s = f"rank {self.rank}: layout {self.layout or '?'}, step {self.step or '?'}"
        if self.collective:
            s += f", inside collective {self.collective}"
        if self.module:
            s += f", last module entered {self.module}"
        return s


class StatusWriter:
    def __init__(self, path: str, rank: int):
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        self.st = RankStatus(rank)
        self._write()

    def _write(self) -> None:
        rec = self.st.line().encode()[:STATUS_BYTES]
        os.pwrite(self.fd, rec + b" " * (STATUS_BYTES - len(rec)), 0)

    def layout(self, index: int, name: str) -> None:
        self.st.index, self.st.layout, self.st.step, self.st.collective, self.st.module = index, name, "build", "", ""
        self._write()

    def step(self, name: str) -> None:
        self.st.step, self.st.collective = name, ""
        self._write()

    def collective(self, name: str) -> None:
        if name != self.st.collective:
            self.st.collective = name
            self._write()

    def module(self, name: str) -> None:
        if name != self.st.module:
            self.st.module = name
            self._write()


def read_status(path: str, rank: int) -> RankStatus:
    try:
        with open(path, "rb") as f:
            return RankStatus.parse(rank, f.read(STATUS_BYTES).decode("utf-8", "replace"))
    except OSError:
        return RankStatus(rank)
