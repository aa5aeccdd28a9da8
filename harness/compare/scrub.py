"""Make untrusted text (test names, failure messages, logs) safe to post on GitHub.

* ``@mentions`` are neutralised with a zero-width joiner after the ``@``: a log line saying
  ``@alice`` must not notify alice every time a regression is filed or updated.
* Anything that looks like a credential is replaced by ``***`` (:func:`scrub_secrets`, which the
  results writer and the console use too): the value of every environment variable whose name says
  token/secret/password/key, the token shapes vendors use (GitHub, Hugging Face, GitLab, AWS, Slack,
  PyPI, npm, JWTs, Google ``AIza`` API keys), and any value labelled as one (``Bearer x``,
  ``Authorization: x``, ``token=x``, ``aws_secret_access_key=x``), because logs of failing tests
  sometimes echo their environment or a request. Two shapes go whole or in part: a PEM private-key
  block (``-----BEGIN ... PRIVATE KEY-----`` to its END line, or to the end of the text when a cut
  took the END line) becomes ``***``, and a URL's credentials (``https://user:pass@host``) become
  ``https://***@host``: the host stays, so the reader still sees where the request went.
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
# The shapes vendors give their tokens: GitHub (ghp_/gho_/ghu_/ghs_/ghr_, github_pat_), Hugging Face
# (hf_, and the older api_ org tokens), GitLab (glpat-), OpenAI-style (sk-), Slack (xox?-), AWS
# access keys (AKIA long-term, ASIA temporary), Google API keys (AIza + 35), PyPI upload tokens
# (pypi-), npm (npm_) and JWTs (three base64url parts, eyJ...).
# The distinctive prefixes match anywhere, glued to other text too (a log line "...xxxghp_..." leaks
# otherwise); the short, word-like ones (hf_, api_org_, sk-) only where no letter or digit precedes
# them, so "task-", "mask-" and "self_" names stay as they are.
_TOKEN_SHAPES = re.compile(
    r"(gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,}|glpat-[A-Za-z0-9_-]{20,}|"
    r"(?:AKIA|ASIA)[0-9A-Z]{16}|AIza[0-9A-Za-z_-]{35}|"
    r"xox[abeoprs]-[A-Za-z0-9-]{10,}|pypi-[A-Za-z0-9_-]{32,}|npm_[A-Za-z0-9]{30,}|"
    r"eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}|"
    r"(?<![A-Za-z0-9])(?:hf_[A-Za-z0-9]{20,}|api_org_[A-Za-z0-9]{20,}|sk-[A-Za-z0-9_-]{20,}))")
# A private key as PEM prints it (PKCS#1 "RSA", PKCS#8, "EC", "OPENSSH", "ENCRYPTED"...), with real
# or escaped ("\\n" in a repr) line breaks: the whole block, or everything from BEGIN on when the END
# line was cut away, since every line of it is key material.
_PEM = re.compile(r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----.*?(?:-----END [A-Z0-9 ]*PRIVATE KEY-----|\Z)", re.S)
# A URL's userinfo when it holds a password ("scheme://user:pass@host", also ":pass@" and a password
# with an unescaped "@": the userinfo runs to the authority's last "@"). "ssh://git@host" names an
# account, not a secret, and stays.
_URL_CREDENTIALS = re.compile(r"(\b[A-Za-z][A-Za-z0-9+.-]*://)(?=[^\s/?#@]*:)[^\s/?#]*@")
# "Bearer" names the scheme of a token, so whatever follows it is one unless it is a word of prose
# about it ("Bearer authentication"); 8 characters or more.
_BEARER = re.compile(r"(?i)(\bbearer\s+)(?!\*\*\*)(?!(?:auth\w*|tokens?|scheme)\b)[A-Za-z0-9._~+/=-]{8,}")
# A credential by where it stands, whatever its shape: the value after "token"/"Basic"
# (one with a digit, or a long one: "the token embedding" is prose),
# after an Authorization/X-Api-Key/... header, or after token=/password=/secret=/api_key= (query
# strings, key=value logs, JSON; a number is a count, not a secret: "num_tokens: 1024"). The label
# is kept, so the reader still sees what was removed.
_LABELLED = re.compile(
    r"(?i)(\b(?:basic|token)\s+)(?!\*\*\*)(?:(?=[A-Za-z._~+/=-]*[0-9])[A-Za-z0-9._~+/=-]{8,}"
    r"|[A-Za-z0-9._~+/=-]{20,})"
    r"|(\b(?:authorization|proxy-authorization|x-api-key|api-key|x-auth-token|private-token)\b\s*[:=]\s*"
    r"[\"']?(?:(?:bearer|basic|token)\s+)?)(?!(?:(?:bearer|basic|token)\s+)?\*\*\*)[^\s\"',;&]{4,}"
    r"|(\b[\w.-]*(?:token|secret|password|passwd|api_?key|access_?key|credential)s?[\"']?\s*[:=]\s*[\"']?)"
    r"(?!\*\*\*)(?=[^\s\"',;&)}\]]*[A-Za-z])[^\s\"',;&)}\]]{4,}")
_SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|API_?KEY|PRIVATE_KEY|CREDENTIAL", re.I)


def _secret_values() -> list[str]:
    vals = {v for k, v in os.environ.items() if _SECRET_NAME.search(k) and len(v) >= 8}
    return sorted(vals, key=len, reverse=True)  # longest first, so substrings do not split one


def scrub_secrets(text: str) -> str:
    """The one redaction every output goes through (issue bodies and comments, junit.xml, the
    journal and summaries, the console): secret environment values, token shapes and labelled
    credentials become ``***``. Idempotent; non-text passes through unchanged."""
    if not isinstance(text, str) or not text:
        return text
    for v in _secret_values():
        text = text.replace(v, "***")
    # blocks and URLs first: a key's base64 lines or a password could otherwise be half-matched below
    text = _PEM.sub("***", text)
    text = _URL_CREDENTIALS.sub(r"\1***@", text)
    text = _TOKEN_SHAPES.sub("***", text)
    text = _BEARER.sub(r"\1***", text)
    return _LABELLED.sub(lambda m: (m.group(1) or m.group(2) or m.group(3)) + "***", text)


def scrub(text: str) -> str:
    """Text for GitHub: credentials removed (:func:`scrub_secrets`) and @mentions neutralised."""
    return _MENTION.sub("@" + ZWJ, scrub_secrets(text))


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
