"""The only module in harness that talks to the network: a small wrapper around github3.py.

* token from ``GITHUB_TOKEN`` (never printed, never logged), repository from ``GITHUB_REPOSITORY``
  or an option, API root from ``--api-url``, else ``GITHUB_API_URL`` (set by GitHub Actions, also on
  GitHub Enterprise Server), else a GitHub Enterprise base URL (``https://ghe.example.com``; github3
  adds ``/api/v3``), else api.github.com;
* every HTTP request goes through :class:`_RetryingSession`, which counts it against a per-run
  budget (a bug or an outage can never turn into hundreds of calls) and retries what is safe to
  retry: rate-limit answers of any method (GitHub did not process the request: 429, or 403 with
  ``Retry-After`` / ``X-RateLimit-Remaining: 0`` / a "secondary rate limit" message) after the time
  the server asks for, and 5xx answers of idempotent methods only. A POST (create an issue, post a
  comment) that got a 5xx may have been applied before the server failed, so it is never retried
  blindly: the caller gets :class:`~harness.compare.sinks.SinkError` with ``maybe_applied`` set and
  looks first (for an issue: its fingerprint among the open issues).
* github3 and requests errors are translated here, by type, into the sink errors of
  :mod:`harness.compare.sinks` (404 and 410 Gone: :class:`~harness.compare.sinks.IssueGone`), so
  nothing else in harness needs to know github3's exception classes. Messages are scrubbed: a
  server may echo what it was sent;
* **harness edits only what its own identity made.** The hidden markers in harness's issues and
  comments are text anyone can copy, so they prove nothing: a PR author's comment carrying the
  triage marker and "No failing item" must not become harness's comment (and, were the edit
  refused, stay the PR's only triage). Who the token is is resolved once per run (:meth:`identity`:
  ``GET /user`` for a person's or a machine account's token; for a GitHub App installation token,
  which GitHub refuses ``/user``, GraphQL's ``viewer``: ``<slug>[bot]``), and an issue or comment
  is harness's only when its ``user.login`` is that login (and, for an app, its
  ``performed_via_github_app`` that app, when GitHub names one). Issues of anyone else are left out
  of listings and, fetched by number, are :class:`NotOurs` (an :class:`IssueGone`: the planner files
  harness's own instead); comments of anyone else are never edited nor taken as harness's.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import github3
import requests
from github3.exceptions import GitHubError, GitHubException
from github3.session import GitHubSession
from urllib3.util.retry import Retry

from harness.compare.errors import BudgetExhausted, IssueGone, SinkConfigError, SinkError
from harness.compare.issues import IssueRef, said
from harness.compare.scrub import scrub

# Methods safe to repeat after a 5xx: urllib3's own list of idempotent methods (GET, PUT, DELETE,
# HEAD, OPTIONS, TRACE; POST and PATCH are left out there), plus PATCH, because every PATCH harness
# sends sets absolute values (a body, a state), so sending it twice leaves the same issue.
_IDEMPOTENT = frozenset(Retry.DEFAULT_ALLOWED_METHODS) | {"PATCH"}


class CallBudgetExceeded(BudgetExhausted):
    pass


class GitHubConfigError(SinkConfigError):
    pass


class NotOurs(IssueGone):
    """An issue harness's identity did not make (whatever marker, title or label it carries): to
    harness it is as good as absent, so it is neither edited nor closed, and harness files its own."""


@dataclass(frozen=True)
class Identity:
    """Who the token is: ``login`` as GitHub shows it on what the token posts (``octo-bot``,
    ``github-actions[bot]``) and, for a GitHub App's installation token, the app's ``slug``."""
    login: str
    app: str | None = None

    def made(self, item) -> bool:
        """Whether ``item`` (a github3 issue or comment) was made by this identity."""
        data = item.as_dict() if hasattr(item, "as_dict") else item
        login = str((data.get("user") or {}).get("login") or "")
        if login.lower() != self.login.lower():
            return False
        via = (data.get("performed_via_github_app") or {}).get("slug")
        return self.app is None or via is None or via == self.app


class _RetryingSession(GitHubSession):
    def __init__(self, max_calls: int, retries: int, max_wait: float, sleep: Callable[[float], None]):
        super().__init__(default_connect_timeout=10, default_read_timeout=30)
        self.max_calls, self.retries, self.max_wait, self.sleep = max_calls, retries, max_wait, sleep
        self.calls = 0
        self.waits: list[float] = []

    def request(self, method, url, *args, **kwargs):
        attempt = 0
        while True:
            if self.calls >= self.max_calls:
                raise CallBudgetExceeded(f"API call budget of {self.max_calls} per run used up")
            self.calls += 1
            response = super().request(method, url, *args, **kwargs)
            wait = self._wait_for(method.upper(), response, attempt)
            if wait is None or attempt >= self.retries or wait > self.max_wait:
                return response
            self.waits.append(wait)
            self.sleep(wait)
            attempt += 1

    def _wait_for(self, method: str, response, attempt: int) -> float | None:
        """Seconds to wait before retrying, or None when the answer is final."""
        status, headers = response.status_code, response.headers
        if status == 429 or (status == 403 and _rate_limited(response)):
            # GitHub did not process a rate-limited request: retrying is safe for every method.
            if headers.get("Retry-After"):
                try:
                    return max(0.0, float(headers["Retry-After"]))
                except ValueError:
                    pass
            if headers.get("X-RateLimit-Remaining") == "0" and headers.get("X-RateLimit-Reset"):
                try:
                    return max(0.0, float(headers["X-RateLimit-Reset"]) - time.time()) + 1.0
                except ValueError:
                    pass
            return 60.0 * (attempt + 1)  # GitHub's advice for secondary limits without headers
        if status >= 500 and method in _IDEMPOTENT:
            return min(2.0 ** attempt, 30.0)
        return None


def _rate_limited(response) -> bool:
    headers = response.headers
    if headers.get("Retry-After") or headers.get("X-RateLimit-Remaining") == "0":
        return True
    try:
        message = str(response.json().get("message", ""))
    except ValueError:
        return False
    return "rate limit" in message.lower()


def _translate(what: str, e: Exception, method: str) -> SinkError:
    """github3/requests error -> sink error (by type, message scrubbed)."""
    if isinstance(e, GitHubError):
        if e.code in (404, 410):  # 410 Gone: the issue was deleted (404: or never visible to us)
            return IssueGone(f"{what}: {e.code} {scrub(str(e.msg or ''))}")
        # 5xx on a POST: the server may have done it before failing
        return SinkError(f"{what}: {e.code} {scrub(str(e.msg or ''))}", status=e.code,
                         maybe_applied=e.code >= 500 and method not in _IDEMPOTENT)
    # no answer at all (connection reset, timeout): a POST may have arrived
    return SinkError(f"{what}: {type(e).__name__}: {scrub(str(e))}",
                     maybe_applied=method not in _IDEMPOTENT)


class GitHubClient:
    """Issues of one repository, through github3.py."""

    persistent = True  # its issue numbers are real: the history keeps them

    def __init__(self, repository: str, token: str, api_url: str | None = None,
                 enterprise_url: str | None = None, max_calls: int = 100, retries: int = 4,
                 max_wait: float = 300.0, sleep: Callable[[float], None] = time.sleep):
        if "/" not in repository:
            raise GitHubConfigError(f"repository must be OWNER/NAME, got {repository!r}")
        if not token:
            raise GitHubConfigError("GITHUB_TOKEN is not set: the github sink needs a token "
                                    "(use --sink file or --sink stdout without one)")
        self.owner, self.name = repository.split("/", 1)
        self.session = _RetryingSession(max_calls, retries, max_wait, sleep)
        if api_url:
            self.gh = github3.GitHub(token=token, session=self.session)
            self.session.base_url = api_url.rstrip("/")
        elif enterprise_url:
            self.gh = github3.GitHubEnterprise(enterprise_url, token=token, session=self.session)
        else:
            self.gh = github3.GitHub(token=token, session=self.session)
        self._repo = None
        self._issues: dict[int, object] = {}  # github3 issue objects seen this run, by number
        self._me: Identity | None = None  # who the token is, asked once per run

    @classmethod
    def from_env(cls, repository: str | None = None, **kw) -> GitHubClient:
        repo = repository or os.environ.get("GITHUB_REPOSITORY", "")
        if not repo:
            raise GitHubConfigError("no repository: pass --repo OWNER/NAME or set GITHUB_REPOSITORY")
        # An explicit None (no --api-url given) must not hide GITHUB_API_URL: on GitHub Enterprise
        # Server runners that variable is the only thing pointing away from api.github.com.
        if not kw.get("api_url") and not kw.get("enterprise_url"):
            kw["api_url"] = os.environ.get("GITHUB_API_URL") or None
        return cls(repo, os.environ.get("GITHUB_TOKEN", ""), **kw)

    @property
    def calls(self) -> int:
        return self.session.calls

    def _do(self, what: str, method: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (GitHubException, requests.RequestException) as e:
            raise _translate(what, e, method) from None

    # ---- who harness is --------------------------------------------------------------------
    def identity(self) -> Identity:
        """The token's identity, resolved on first use and kept for the run (one call; two for an
        app's installation token). A token whose identity cannot be told is a SinkError: without it
        nothing on GitHub can be told to be harness's."""
        if self._me is None:
            self._me = self._resolve_identity()
        return self._me

    def _resolve_identity(self) -> Identity:
        r = self._do("asking who GITHUB_TOKEN is", "GET", self.session.get, self.session.build_url("user"))
        if r.status_code == 200:
            return Identity(_login(r, lambda d: d.get("login")))
        if r.status_code not in (401, 403):  # 401 as well: some proxies answer so for app tokens
            raise SinkError(f"asking who GITHUB_TOKEN is: GET /user answered {r.status_code}", status=r.status_code)
        # an installation token (GitHub App, or Actions' own GITHUB_TOKEN): GitHub refuses it /user,
        # and GraphQL's viewer is the documented way to its bot account
        r = self._do("asking who GITHUB_TOKEN is", "POST", self.session.post, self._graphql_url(),
                     json={"query": "query { viewer { login } }"})
        login = _login(r, lambda d: ((d.get("data") or {}).get("viewer") or {}).get("login"))
        return Identity(login, login.removesuffix("[bot]") if login.endswith("[bot]") else None)

    def _graphql_url(self) -> str:
        """api.github.com/graphql; on GitHub Enterprise Server ``https://HOST/api/graphql`` (the REST
        root is ``/api/v3``)."""
        base = self.session.base_url.rstrip("/")
        return base.removesuffix("/v3") + "/graphql" if base.endswith("/api/v3") else base + "/graphql"

    def _ours(self, item) -> bool:
        return self.identity().made(item)

    # ---- issues -------------------------------------------------------------------------------
    def list_issues(self, label: str, state: str = "open") -> list[IssueRef]:
        """Harness's own issues with ``label``: one a person opened with the same label, title or
        fingerprint is not harness's to update or close."""
        out = []
        for issue in self._do("listing issues", "GET", lambda: list(
                self.gh.issues_on(self.owner, self.name, labels=label, state=state))):
            if not self._ours(issue):
                continue
            self._issues[issue.number] = issue
            out.append(_ref(issue))
        return out

    def create(self, title: str, body: str, labels: list[str]) -> int:
        if self._repo is None:  # one lookup per run, and only when something is created
            self._repo = self._do("looking up the repository", "GET", self.gh.repository,
                                  self.owner, self.name)
        issue = self._do("creating an issue", "POST", self._repo.create_issue, title, body=body,
                         labels=labels)
        self._issues[issue.number] = issue
        return issue.number

    def _issue(self, number: int):
        if number not in self._issues:
            self._issues[number] = self._do(f"fetching issue #{number}", "GET", self.gh.issue,
                                            self.owner, self.name, number)
        return self._issues[number]

    def _own_issue(self, number: int):
        issue = self._issue(number)
        if not self._ours(issue):
            author = (issue.as_dict().get("user") or {}).get("login")
            raise NotOurs(f"issue #{number} was opened by {scrub(str(author))}, not by "
                          f"{self.identity().login}: harness leaves it alone")
        return issue

    def get(self, number: int) -> IssueRef:
        return _ref(self._own_issue(number))

    def edit(self, number: int, body: str | None = None, state: str | None = None) -> None:
        # Only the fields given are sent: a PATCH with title/labels would undo what people edited.
        issue = self._own_issue(number)
        if not self._do(f"editing issue #{number}", "PATCH", issue.edit, body=body, state=state):
            raise SinkError(f"editing issue #{number} failed")

    def comment(self, number: int, body: str) -> None:
        self._do(f"commenting on issue #{number}", "POST", self._issue(number).create_comment, body)

    def _own_comments(self, number: int) -> list:
        """Harness's own comments on ``number``, oldest first (anyone can copy a marker)."""
        issue = self._issue(number)
        return [c for c in self._do(f"listing comments of #{number}", "GET", lambda: list(issue.comments()))
                if self._ours(c)]

    def upsert_comment(self, number: int, marker: str, body: str) -> str:
        """One comment of harness's on issue or pull request ``number``: harness's latest one holding
        ``marker`` is edited (only when what it says changed: lines ending in ``issues.RUN_LINE``,
        which name the run, are not compared), else one is created. A marked comment
        someone else wrote is ignored; an edit GitHub refuses (403, 404: locked, deleted, the token's
        rights changed) posts the triage as a new comment, since an old or foreign text must never
        stay the only one. Returns created / updated / unchanged (and why a refused edit was)."""
        mine = [c for c in self._own_comments(number) if marker in (c.body or "")]
        if mine and said(mine[-1].body) == said(body):
            return "unchanged"
        refused = ""
        if mine:
            try:
                if self._do(f"editing comment {mine[-1].id} of #{number}", "PATCH", mine[-1].edit, body):
                    return "updated"
                refused = f"editing comment {mine[-1].id} of #{number} failed"
            except SinkError as e:
                # refused (403) or gone (404/410: IssueGone); anything else (budget, outage) stops here
                if isinstance(e, BudgetExhausted) or not (isinstance(e, IssueGone) or e.status == 403):
                    raise
                refused = str(e)
        self._do(f"commenting on #{number}", "POST", self._issue(number).create_comment, body)
        return f"created (the edit was refused: {refused})" if refused else "created"

    def comments(self, number: int) -> list[str]:
        """Bodies of harness's own comments on the issue (to check whether a comment arrived before
        posting it: a copied marker in someone else's comment proves nothing)."""
        return [c.body or "" for c in self._own_comments(number)]


def _login(response, pick) -> str:
    """The login ``pick`` finds in a JSON answer, or a SinkError naming what came back instead."""
    try:
        login = pick(response.json())
    except (ValueError, AttributeError):
        login = None
    if not isinstance(login, str) or not login:
        raise SinkError(f"asking who GITHUB_TOKEN is: {response.request.method} {response.url.split('?')[0]} "
                        f"answered {response.status_code} without a login")
    return login


def _ref(issue) -> IssueRef:
    labels = [lbl.name for lbl in (issue.original_labels or [])]
    return IssueRef(issue.number, issue.title, issue.body or "", issue.state, labels)
