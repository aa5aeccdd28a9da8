"""Make untrusted text (test names, failure messages, logs) safe to post on GitHub.

* ``@mentions`` are neutralised with a zero-width joiner after the ``@``: a log line saying
  ``@alice`` must not notify alice every time a regression is filed or updated.
* Anything that looks like a credential is replaced by ``***``: the value of every environment
  variable whose name says token/secret/password/key, and well-known token shapes (GitHub, AWS,
  bearer headers), because logs of failing tests sometimes echo their environment.
"""

from __future__ import annotations

import os
import re

ZWJ = "\u200d"
_MENTION = re.compile(r"@(?=[A-Za-z0-9])")
_TOKEN_SHAPES = re.compile(
    r"(gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,}|AKIA[0-9A-Z]{16}|"
    r"xox[abpr]-[A-Za-z0-9-]{10,}|(?i:bearer|token)\s+[A-Za-z0-9._~+/=-]{16,})")
_SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|API_?KEY|PRIVATE_KEY|CREDENTIAL", re.I)


def _secret_values() -> list[str]:
    vals = {v for k, v in os.environ.items() if _SECRET_NAME.search(k) and len(v) >= 8}
    return sorted(vals, key=len, reverse=True)  # longest first, so substrings do not split one


def scrub(text: str) -> str:
    for v in _secret_values():
        text = text.replace(v, "***")
    text = _TOKEN_SHAPES.sub("***", text)
    return _MENTION.sub("@" + ZWJ, text)


def code_fence(text: str) -> str:
    """A fence longer than any backtick run inside ``text``, so a log cannot close it early."""
    longest = max((len(m) for m in re.findall(r"`+", text)), default=0)
    return "`" * max(3, longest + 1)
