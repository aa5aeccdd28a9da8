"""What each rank of a parallel launch was doing, for the report when it hangs or dies.

The record of the launch layer's per-rank status file (``harness.launch.status``: ``status-<rank>``,
fixed size, rewritten in place) with the parallel check's fields, rewritten whenever the rank changes
layout, step or collective, or enters another module: ``index, layout, step, collective, module``.
The launcher reads them after killing a hung launch; the launch layer's rank wrapper adds the
worker's exit status in ``exit-<rank>.json``.
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.launch.status import StatusRecord, read_record


@dataclass
class RankStatus:
    rank: int
    index: int = -1
    layout: str = ""
    step: str = ""
    collective: str = ""
    module: str = ""

    def fields(self) -> list[str]:
        return [str(self.index), self.layout, self.step, self.collective, self.module]

    @classmethod
    def from_fields(cls, rank: int, parts: list[str]) -> RankStatus:
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
        self.rec = StatusRecord(path)
        self.st = RankStatus(rank)
        self._write()

    def _write(self) -> None:
        self.rec.write(self.st.fields())

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
    parts = read_record(path, 5)
    return RankStatus(rank) if parts is None else RankStatus.from_fields(rank, parts)
