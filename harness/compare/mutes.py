"""The mute file: a TOML file in the repository that silences known problems until a date.

.. code-block:: toml

    [[mute]]
    suite = "kimi-k2"            # each field is optional; a missing field matches everything
    backend = "npu"
    kind = "performance"         # failure | error | precision | performance | vanished | flaky
    test = "*moe_dispatch*"      # fnmatch pattern on the test id
    until = 2026-12-31           # required: mutes expire, so nothing stays hidden forever
    reason = "vendor driver 24.1 regression, tracked upstream"

An expired entry is ignored and reported, so the file gets cleaned up. Muting a whole issue is
also possible with the ``harness:muted`` label on the issue (see :mod:`harness.compare.issues`).
"""

from __future__ import annotations

import datetime as dt
import fnmatch
import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictStr, ValidationError, field_validator

from harness import toml as tomllib  # tomllib, or tomli on Python 3.10
from harness.compare.classify import Finding

# The issue kinds a finding files under (harness.compare.classify), or every kind.
Kind = Literal["*", "failure", "error", "precision", "performance", "vanished", "flaky", "infrastructure",
               "upstream", "improvement", "info"]


class Mute(BaseModel):
    """One ``[[mute]]`` entry. Unknown keys and wrong types are refused, naming the entry and the
    field: a misspelt ``suit = "kimi-k2"`` would otherwise load as ``suite = "*"`` and mute every
    finding of every suite until its date, without a word."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    until: dt.date = Field(description="Required: the mute ends after this day (YYYY-MM-DD).")
    suite: StrictStr = Field("*", description="fnmatch pattern on the suite name.")
    backend: StrictStr = Field("*", description="fnmatch pattern on the backend name.")
    kind: Kind = Field("*", description="The issue kind it silences.")
    test: StrictStr = Field("*", description="fnmatch pattern on the test id.")
    reason: StrictStr = Field("", description="Why: shown where the mute is reported.")

    @field_validator("until", mode="before")
    @classmethod
    def _date(cls, v):
        return v.date() if isinstance(v, dt.datetime) else v  # TOML's offset-less date-time: its day

    def matches(self, f: Finding) -> bool:
        return (fnmatch.fnmatchcase(f.suite, self.suite) and fnmatch.fnmatchcase(f.backend, self.backend)
                and fnmatch.fnmatchcase(f.kind, self.kind) and fnmatch.fnmatchcase(f.key, self.test))


class _File(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mute: list[dict] = Field(default_factory=list)


def _errors(path: str, where: str, e: ValidationError) -> list[str]:
    out = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"]) or "(entry)"
        out.append(f"{path}: {where}: {loc}: {err['msg']}")
    return out


def load(path: str | None, today: dt.date | None = None) -> tuple[list[Mute], list[str]]:
    """Active mutes and messages (expired entries, format problems: an entry that does not validate
    is ignored with one message per field, so what it would have muted is reported, never hidden).
    A missing file is no mutes."""
    if not path or not os.path.exists(path):
        return [], []
    today = today or dt.date.today()
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as e:
        return [], [f"{path}: cannot read the mute file ({e}); nothing is muted"]
    try:
        entries = _File.model_validate(data).mute
    except ValidationError as e:
        return [], _errors(path, "the file", e) + [f"{path}: nothing is muted"]
    active, notes = [], []
    for i, entry in enumerate(entries, 1):
        try:
            mute = Mute.model_validate(entry)
        except ValidationError as e:
            notes += [f"{m}; mute #{i} ignored" for m in _errors(path, f"mute #{i}", e)]
            continue
        if mute.until < today:
            notes.append(f"{path}: mute #{i} ({mute.reason or mute.test}) expired on {mute.until}; "
                         "it no longer applies, remove it")
            continue
        active.append(mute)
    return active, notes


def apply(findings: list[Finding], mutes: list[Mute]) -> tuple[list[Finding], list[Finding]]:
    """Split into (kept, muted)."""
    if not mutes:
        return findings, []
    kept, muted = [], []
    for f in findings:
        (muted if any(m.matches(f) for m in mutes) else kept).append(f)
    return kept, muted
