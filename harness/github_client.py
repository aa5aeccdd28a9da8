"""The only module in harness that talks to the network: a small wrapper around github3.py.

* token from ``GITHUB_TOKEN`` (never printed, never logged), repository from ``GITHUB_REPOSITORY``
  or an option, API root from ``GITHUB_API_URL`` (set by GitHub Actions, also on GitHub Enterprise
  Server) or a GitHub Enterprise base URL (``https://ghe.example.com``; github3 adds ``/api/v3``);
* every HTTP request goes through :class:`_RetryingSession`, which retries 5xx answers with
  exponential back-off and rate-limit answers (429, or 403 with ``Retry-After`` /
  ``X-RateLimit-Remaining: 0``) after the time the server asks for, and counts every request
  against a per-run budget, so a bug or an outage can never turn into hundreds of calls.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import github3
from github3.session import GitHubSession

from harness.compare.issues import IssueRef


class CallBudgetExceeded(RuntimeError):
    pass


class GitHubConfigError(RuntimeError):
    pass


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
            wait = self._wait_for(response, attempt)
            if wait is None or attempt >= self.retries or wait > self.max_wait:
                return response
            self.waits.append(wait)
            self.sleep(wait)
            attempt += 1

    def _wait_for(self, response, attempt: int) -> float | None:
        """Seconds to wait before retrying, or None when the answer is final."""
        status, headers = response.status_code, response.headers
        rate_limited = status == 429 or (status == 403 and (
            headers.get("Retry-After") or headers.get("X-RateLimit-Remaining") == "0"))
        if rate_limited:
            if headers.get("Retry-After"):
                try:
                    return max(0.0, float(headers["Retry-After"]))
                except ValueError:
                    pass
            if headers.get("X-RateLimit-Reset"):
                try:
                    return max(0.0, float(headers["X-RateLimit-Reset"]) - time.time()) + 1.0
                except ValueError:
                    pass
            return 60.0 * (attempt + 1)  # GitHub's advice for secondary limits without headers
        if status >= 500:
            return min(2.0 ** attempt, 30.0)
        return None


class GitHubClient:
    """Issues of one repository, through github3.py."""

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
        if enterprise_url:
            self.gh = github3.GitHubEnterprise(enterprise_url, token=token, session=self.session)
        else:
            self.gh = github3.GitHub(token=token, session=self.session)
            if api_url:
                self.session.base_url = api_url.rstrip("/")
        self._repo = None
        self._issues: dict[int, object] = {}  # github3 issue objects seen this run, by number

    @classmethod
    def from_env(cls, repository: str | None = None, **kw) -> GitHubClient:
        repo = repository or os.environ.get("GITHUB_REPOSITORY", "")
        if not repo:
            raise GitHubConfigError("no repository: pass --repo OWNER/NAME or set GITHUB_REPOSITORY")
        kw.setdefault("api_url", os.environ.get("GITHUB_API_URL"))
        return cls(repo, os.environ.get("GITHUB_TOKEN", ""), **kw)

    @property
    def calls(self) -> int:
        return self.session.calls

    def list_issues(self, label: str, state: str = "open") -> list[IssueRef]:
        out = []
        for issue in self.gh.issues_on(self.owner, self.name, labels=label, state=state):
            self._issues[issue.number] = issue
            out.append(_ref(issue))
        return out

    def create(self, title: str, body: str, labels: list[str]) -> int:
        if self._repo is None:  # one lookup per run, and only when something is created
            self._repo = self.gh.repository(self.owner, self.name)
        issue = self._repo.create_issue(title, body=body, labels=labels)
        self._issues[issue.number] = issue
        return issue.number

    def _issue(self, number: int):
        if number not in self._issues:
            self._issues[number] = self.gh.issue(self.owner, self.name, number)
        return self._issues[number]

    def get(self, number: int) -> IssueRef:
        return _ref(self._issue(number))

    def edit(self, number: int, body: str | None = None, state: str | None = None) -> None:
        # Only the fields given are sent: a PATCH with title/labels would undo what people edited.
        if not self._issue(number).edit(body=body, state=state):
            raise RuntimeError(f"editing issue #{number} failed")

    def comment(self, number: int, body: str) -> None:
        self._issue(number).create_comment(body)


def _ref(issue) -> IssueRef:
    labels = [lbl.name for lbl in (issue.original_labels or [])]
    return IssueRef(issue.number, issue.title, issue.body or "", issue.state, labels)
