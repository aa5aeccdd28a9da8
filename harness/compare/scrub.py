"""Make untrusted text (test names, failure messages, logs) safe to post on GitHub.

* ``@mentions`` are neutralised with a zero-width joiner after the ``@``: a log line saying
  ``@alice`` must not notify alice every time a regression is filed or updated.
* Anything that looks like a credential is replaced by ``***``: the value of every environment
  variable whose name says token/secret/password/key, and well-known token shapes (GitHub, AWS,
  bearer headers), because logs of failing tests sometimes echo their environment.
* Names that came from a run (test ids, module names, suites) are shown with :func:`md_text` /
  :func:`md_code`: every character Markdown or HTML could read as markup becomes a numeric
  character reference, which GitHub renders as that very character and never as markup. So a test
  named ``a`<img src=x onerror=alert(1)>`` shows as itself, in a table cell, in ``<summary>`` or
  in bold, instead of closing a code span or injecting a tag.

Scrub first, cut second: text is scrubbed before anything shortens it, so a token that straddles
a cut can never leave its tail behind.
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


# What Markdown or HTML can read as markup inside a line (code spans, emphasis, links, tags,
# entities, table cells, escapes, strikethrough), plus the line breaks that would end a table row.
# Block markers (#, -, >, 1.) only act at the start of a line, where these names never are.
_MARKUP = re.compile(r"[`*_\[\]<>&|\\~\r\n]")


def md_text(text: str) -> str:
    """Untrusted text, scrubbed, safe anywhere in Markdown or HTML: markup becomes entities."""
    return _MARKUP.sub(lambda m: "&#32;" if m.group() in "\r\n" else f"&#{ord(m.group())};", scrub(str(text)))


def md_code(text: str) -> str:
    """Untrusted text shown as code (``<code>`` rather than backticks, which a name can close)."""
    return f"<code>{md_text(text)}</code>"


def code_fence(text: str) -> str:
    """A fence longer than any backtick run inside ``text``, so a log cannot close it early."""
    longest = max((len(m) for m in re.findall(r"`+", text)), default=0)
    return "`" * max(3, longest + 1)
