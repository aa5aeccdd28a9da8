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
from dataclasses import dataclass

from harness import toml as tomllib  # tomllib, or tomli on Python 3.10
from harness.compare.classify import Finding


@dataclass(frozen=True)
class Mute:
    until: dt.date
    suite: str = "*"
    backend: str = "*"
    kind: str = "*"
    test: str = "*"
    reason: str = ""

    def matches(self, f: Finding) -> bool:
        return (fnmatch.fnmatchcase(f.suite, self.suite) and fnmatch.fnmatchcase(f.backend, self.backend)
                and fnmatch.fnmatchcase(f.kind, self.kind) and fnmatch.fnmatchcase(f.key, self.test))


def load(path: str | None, today: dt.date | None = None) -> tuple[list[Mute], list[str]]:
    """Active mutes and messages (expired entries, format problems). A missing file is no mutes."""
    if not path or not os.path.exists(path):
        return [], []
    today = today or dt.date.today()
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as e:
        return [], [f"{path}: cannot read the mute file ({e}); nothing is muted"]
    active, notes = [], []
    for i, entry in enumerate(data.get("mute", []), 1):
        until = entry.get("until")
        if isinstance(until, dt.datetime):
            until = until.date()
        if not isinstance(until, dt.date):
            notes.append(f"{path}: mute #{i} has no valid 'until' date (YYYY-MM-DD); ignored")
            continue
        fields = {k: str(entry[k]) for k in ("suite", "backend", "kind", "test", "reason") if k in entry}
        mute = Mute(until=until, **fields)
        if until < today:
            notes.append(f"{path}: mute #{i} ({mute.reason or mute.test}) expired on {until}; "
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
