"""A small GitHub REST server on 127.0.0.1 for the comparator's tests.

It speaks the JSON shapes github3.py reads for the endpoints the comparator uses (repository,
issues list/create/get/edit, comments list/create/edit, labels), keeps state in memory, checks the
token, and behaves like GitHub where the comparator's correctness depends on it:

* bodies (issue and comment) over 65,536 characters are refused with 422, as GitHub does;
* a deleted issue answers 410 Gone (``state.delete(n)``), an unknown number 404;
* listings paginate with ``Link`` headers (``per_page`` default 30, at most 100);
* ``latency``: seconds before every answer, like a network round trip (overlapping runs);
* faults (``fail_next``): an error answered *instead of* handling the request, or *after* it was
  applied (``after_apply=True``: the write took effect, the client sees a 5xx, as when GitHub
  times out behind its load balancer), optionally only for one method / path; a secondary rate
  limit is ``fail_next(403, {"Retry-After": "1"}, message=SECONDARY)`` (not processed); an error
  message can echo the credentials it was sent (``echo_auth=True``), as some proxies do;
* who the token is: ``GET /user`` answers ``state.login`` for a user's token; with ``state.app``
  set the token is a GitHub App installation token (``ghs_``, the Actions ``GITHUB_TOKEN``), which
  ``GET /user`` refuses with 403 "Resource not accessible by integration" while GraphQL's
  ``viewer`` answers the app's bot login (``<slug>[bot]``);
* every issue and comment has an author (``user.login``, and for an app's
  ``performed_via_github_app``): what the token posts is its own, ``state.add_issue`` /
  ``state.add_comment`` make a person's; an issue put into ``state.issues`` by hand without a
  ``user`` reads as the token's own. As on GitHub, a token with write access may edit a comment or
  an issue someone else wrote: refusing is the client's job.

Every applied change of an issue's state or body is counted in ``issue["changes"]`` (what the
state machine test checks comments against). Served under ``/api/v3`` (GitHub Enterprise
layout) and at the root (api.github.com layout).
"""

from __future__ import annotations

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

OWNER, REPO = "acme", "models"
TOKEN = "ghp_" + "x" * 36
MAX_BODY = 65_536  # characters, GitHub's limit for issue and comment bodies
SECONDARY = "You have exceeded a secondary rate limit. Please wait a few minutes before you try again."


def _user(base: str, login: str = "harness-bot", kind: str = "User") -> dict:
    u = f"{base}/users/{login}"
    return {"login": login, "id": 1, "node_id": "U1", "avatar_url": "", "gravatar_id": "", "url": u,
            "html_url": f"https://github.test/{login}", "followers_url": u + "/followers",
            "following_url": u + "/following{/other_user}", "gists_url": u + "/gists{/gist_id}",
            "starred_url": u + "/starred{/owner}{/repo}", "subscriptions_url": u + "/subscriptions",
            "organizations_url": u + "/orgs", "repos_url": u + "/repos",
            "events_url": u + "/events{/privacy}", "received_events_url": u + "/received_events",
            "type": kind, "site_admin": False}


def _app(slug: str | None) -> dict | None:
    """``performed_via_github_app`` of what an app's installation token made (None for a user's)."""
    if slug is None:
        return None
    return {"id": 99, "slug": slug, "node_id": "A99", "name": slug, "owner": None, "description": "",
            "external_url": "", "html_url": f"https://github.test/apps/{slug}", "permissions": {}, "events": []}


def _author(base: str, made: dict) -> dict:
    """The ``user`` and ``performed_via_github_app`` fields of an issue or comment."""
    app = made.get("app")
    return {"user": _user(base, made["user"], "Bot" if app else "User"), "performed_via_github_app": _app(app)}


class Fault:
    def __init__(self, status: int, headers: dict | None = None, after_apply: bool = False,
                 method: str | None = None, path: str | None = None, message: str = "injected failure",
                 echo_auth: bool = False):
        self.status, self.headers, self.after_apply = status, headers or {}, after_apply
        self.method, self.path, self.message, self.echo_auth = method, path, message, echo_auth

    def matches(self, method: str, path: str) -> bool:
        return (self.method is None or self.method == method) and (
            self.path is None or re.fullmatch(self.path, path) is not None)


class GitHubState:
    def __init__(self):
        self.issues: dict[int, dict] = {}
        self.deleted: set[int] = set()
        self.requests: list[tuple[str, str]] = []
        self.failures: list[Fault] = []
        self.latency = 0.0  # seconds before each answer: a real network round trip, so runs overlap
        self.lock = threading.Lock()
        self.login = "harness-bot"  # who TOKEN belongs to (a user's token) ...
        self.app: str | None = None  # ... or, when set, the slug of the app whose installation token it is

    def me(self) -> dict:
        """The author of what TOKEN posts: ``{"user": login, "app": slug or None}``."""
        return {"user": f"{self.app}[bot]" if self.app else self.login, "app": self.app}

    def add_issue(self, title: str, body: str = "", labels=(), user: str = "octocat", app: str | None = None,
                  state: str = "open") -> int:
        """An issue (or pull request) someone else opened; its number."""
        with self.lock:
            n = max([*self.issues, *self.deleted], default=0) + 1
            self.issues[n] = {"title": title, "body": body, "labels": list(labels), "state": state,
                              "comments": [], "changes": [], "user": user, "app": app}
            return n

    def add_comment(self, number: int, body: str, user: str = "octocat", app: str | None = None) -> int:
        """A comment someone else wrote on issue or pull request ``number``; its id."""
        with self.lock:
            c = {"id": self._next_comment_id(), "body": body, "user": user, "app": app}
            self.issues[number]["comments"].append(c)
            return c["id"]

    def _claim_unauthored(self) -> None:
        """Issues and comments a test put into ``issues`` by hand, without an author, are the token's."""
        for i in self.issues.values():
            for made in (i, *i["comments"]):
                if "user" not in made:
                    made.update(self.me())

    def _next_comment_id(self) -> int:
        return 1 + sum(len(i["comments"]) for i in self.issues.values())

    def fail_next(self, status: int, headers: dict | None = None, times: int = 1, **kw) -> None:
        self.failures.extend(Fault(status, headers, **kw) for _ in range(times))

    def delete(self, number: int) -> None:
        """Delete an issue as a repository admin can: it answers 410 Gone from now on."""
        with self.lock:
            del self.issues[number]
            self.deleted.add(number)

    def open_issues(self) -> list[dict]:
        return [i for i in self.issues.values() if i["state"] == "open"]

    def mutating(self) -> list[tuple[str, str]]:
        return [r for r in self.requests if r[0] != "GET"]

    def _fault(self, method: str, path: str) -> Fault | None:
        for i, f in enumerate(self.failures):
            if f.matches(method, path):
                return self.failures.pop(i)
        return None


def _comment_json(base: str, number: int, c: dict) -> dict:
    api = f"{base}/repos/{OWNER}/{REPO}/issues/comments/{c['id']}"
    return {"url": api, "html_url": api, "issue_url": f"{base}/repos/{OWNER}/{REPO}/issues/{number}",
            "id": c["id"], "node_id": f"C{c['id']}", "body": c["body"], "body_html": "",
            "body_text": c["body"], **_author(base, c), "author_association": "OWNER",
            "created_at": "2026-01-01T00:00:00Z", "updated_at": "2026-01-01T00:00:00Z"}


def _issue_json(base: str, n: int, issue: dict, full: bool) -> dict:
    api = f"{base}/repos/{OWNER}/{REPO}/issues/{n}"
    out = {"url": api, "repository_url": f"{base}/repos/{OWNER}/{REPO}",
           "labels_url": api + "/labels{/name}", "comments_url": api + "/comments",
           "events_url": api + "/events", "html_url": f"https://github.test/{OWNER}/{REPO}/issues/{n}",
           "id": 1000 + n, "node_id": f"I{n}", "number": n, "title": issue["title"],
           **_author(base, issue), "labels": [
               {"id": i, "node_id": f"L{i}", "url": f"{base}/repos/{OWNER}/{REPO}/labels/{name}",
                "name": name, "color": "ededed", "default": False, "description": None}
               for i, name in enumerate(issue["labels"])],
           "state": issue["state"], "locked": False, "assignee": None, "assignees": [],
           "milestone": None, "comments": len(issue.get("comments", [])),
           "created_at": "2026-01-01T00:00:00Z", "updated_at": "2026-01-02T00:00:00Z",
           "closed_at": "2026-01-03T00:00:00Z" if issue["state"] == "closed" else None,
           "author_association": "OWNER", "body": issue["body"]}
    if full:
        out.update({"body_html": "", "body_text": issue["body"], "closed_by": None})
    return out


def _repo_json(base: str) -> dict:
    r = f"{base}/repos/{OWNER}/{REPO}"
    urls = {k: f"{r}/{k.removesuffix('_url')}" for k in (
        "archive_url", "assignees_url", "blobs_url", "branches_url", "collaborators_url",
        "comments_url", "commits_url", "compare_url", "contents_url", "contributors_url",
        "deployments_url", "downloads_url", "events_url", "forks_url", "git_commits_url",
        "git_refs_url", "git_tags_url", "hooks_url", "issue_comment_url", "issue_events_url",
        "issues_url", "keys_url", "labels_url", "languages_url", "merges_url", "milestones_url",
        "notifications_url", "pulls_url", "releases_url", "stargazers_url", "statuses_url",
        "subscribers_url", "subscription_url", "tags_url", "teams_url", "trees_url")}
    return {**urls, "id": 7, "node_id": "R7", "name": REPO, "full_name": f"{OWNER}/{REPO}",
            "owner": _user(base, OWNER), "private": False, "html_url": f"https://github.test/{OWNER}/{REPO}",
            "description": "", "fork": False, "url": r, "archived": False,
            "clone_url": "", "created_at": "2026-01-01T00:00:00Z", "default_branch": "main",
            "forks_count": 0, "git_url": "", "has_downloads": True, "has_issues": True,
            "has_pages": False, "has_projects": False, "has_wiki": False, "homepage": None,
            "language": "Python", "mirror_url": None, "network_count": 0, "open_issues_count": 0,
            "pushed_at": "2026-01-01T00:00:00Z", "size": 1, "ssh_url": "", "stargazers_count": 0,
            "subscribers_count": 0, "svn_url": "", "updated_at": "2026-01-01T00:00:00Z",
            "watchers_count": 0, "permissions": {"admin": False, "push": True, "pull": True}}


class _Handler(BaseHTTPRequestHandler):
    state: GitHubState
    server_version = "GitHubTest/1.0"

    def log_message(self, *args):  # keep test output clean
        pass

    def _send(self, status: int, payload=None, headers: dict | None = None) -> None:
        data = b"" if payload is None else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, str(v))
        self.end_headers()
        self.wfile.write(data)

    def _handle(self, method: str) -> None:
        st = self.state
        url = urlparse(self.path)
        path = url.path.removeprefix("/api/v3")
        base = f"http://{self.headers['Host']}" + ("/api/v3" if url.path.startswith("/api/v3") else "")
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length) or b"null") if length else None
        if st.latency:
            time.sleep(st.latency)
        with st.lock:
            st.requests.append((method, path))
            fault = st._fault(method, path)
            st._claim_unauthored()
        if fault is not None and not fault.after_apply:
            return self._fail(fault)
        if self.headers.get("Authorization") != f"token {TOKEN}":
            return self._send(401, {"message": "Bad credentials"})
        status, payload, headers = self._identity(method, url.path, base) or self._route(method, path, base, url, body)
        if fault is not None:  # applied, and yet the client hears of a failure
            return self._fail(fault)
        return self._send(status, payload, headers)

    def _fail(self, fault: Fault) -> None:
        message = fault.message
        if fault.echo_auth:
            message += f" (request had Authorization: {self.headers.get('Authorization')})"
        self._send(fault.status, {"message": message}, fault.headers)

    def _identity(self, method: str, path: str, base: str):
        """``GET /user`` and GraphQL's ``{ viewer { login } }`` (``/graphql``; ``/api/graphql`` on
        GitHub Enterprise Server); None for every other request."""
        st = self.state
        if method == "GET" and path in ("/user", "/api/v3/user"):
            if st.app:  # GitHub: installation tokens cannot read the authenticated user
                return 403, {"message": "Resource not accessible by integration",
                             "documentation_url": "https://docs.github.com/rest/users/users#get-the-authenticated-user"}, None
            return 200, _user(base, st.login), None
        if method == "POST" and path in ("/graphql", "/api/graphql"):
            return 200, {"data": {"viewer": {"login": st.me()["user"]}}}, None
        return None

    def _route(self, method: str, path: str, base: str, url, body):
        st = self.state
        prefix = f"/repos/{OWNER}/{REPO}"
        if path == prefix and method == "GET":
            return 200, _repo_json(base), None
        if path == prefix + "/labels" and method == "GET":
            names = sorted({lbl for i in st.issues.values() for lbl in i["labels"]})
            return 200, [{"name": n, "color": "ededed", "url": f"{base}{prefix}/labels/{n}"} for n in names], None
        c = re.fullmatch(prefix + r"/issues/comments/(\d+)", path)
        if c and method == "PATCH":  # "Update an issue comment" (pull requests' comments are issue comments)
            return self._edit_comment(base, int(c.group(1)), body)
        m = re.fullmatch(prefix + r"/issues(?:/(\d+))?(/comments)?", path)
        if not m:
            return 404, {"message": "Not Found"}, None
        number, comments = (int(m.group(1)) if m.group(1) else None), bool(m.group(2))
        with st.lock:
            return self._issues(method, path, base, parse_qs(url.query), number, comments, body)

    def _edit_comment(self, base: str, comment_id: int, body):
        st = self.state
        with st.lock:
            for n, i in st.issues.items():
                for com in i["comments"]:
                    if com["id"] == comment_id:
                        if len((body or {}).get("body") or "") > MAX_BODY:
                            return 422, {"message": "Validation Failed"}, None
                        com["body"] = body["body"]
                        com["edits"] = com.get("edits", 0) + 1
                        return 200, _comment_json(base, n, com), None
        return 404, {"message": "Not Found"}, None

    def _issues(self, method: str, path: str, base: str, q: dict, number: int | None, comments: bool, body):
        """``/issues``, ``/issues/N`` and ``/issues/N/comments``; the caller holds the state's lock."""
        st = self.state
        if number is None and method == "GET":
            return self._list_issues(base, path, q)
        if method in ("POST", "PATCH") and len((body or {}).get("body") or "") > MAX_BODY:
            return 422, {"message": "Validation Failed", "errors": [
                {"resource": "Issue", "code": "custom", "field": "body",
                 "message": f"body is too long (maximum is {MAX_BODY} characters)"}]}, None
        if number is None and method == "POST":
            n = max([*st.issues, *st.deleted], default=0) + 1
            st.issues[n] = {"title": body["title"], "body": body.get("body") or "",
                            "labels": list(body.get("labels") or []), "state": "open", "comments": [],
                            "changes": [], **st.me()}
            return 201, _issue_json(base, n, st.issues[n], True), None
        if number in st.deleted:
            return 410, {"message": "This issue was deleted"}, None
        issue = st.issues.get(number)
        if issue is None:
            return 404, {"message": "Not Found"}, None
        if comments and method in ("POST", "GET"):  # a PATCH to .../comments falls through to editing the issue
            return self._issue_comments(method, path, base, q, number, issue, body)
        if method == "PATCH":
            return self._edit_issue(base, number, issue, body)
        if method == "GET":
            return 200, _issue_json(base, number, issue, True), None
        return 405, {"message": "Method Not Allowed"}, None

    def _list_issues(self, base: str, path: str, q: dict):
        st = self.state
        state = q.get("state", ["open"])[0]
        labels = [x for x in q.get("labels", [""])[0].split(",") if x]
        found = [n for n, i in sorted(st.issues.items())
                 if (state == "all" or i["state"] == state) and all(lbl in i["labels"] for lbl in labels)]
        return self._page(base, path, q, found, lambda n: _issue_json(base, n, st.issues[n], False))

    def _issue_comments(self, method: str, path: str, base: str, q: dict, number: int, issue: dict, body):
        if method == "POST":
            c = {"id": self.state._next_comment_id(), "body": body["body"], **self.state.me()}
            issue["comments"].append(c)
            return 201, _comment_json(base, number, c), None
        cs = {c["id"]: c for c in issue["comments"]}
        return self._page(base, path, q, list(cs), lambda i: _comment_json(base, number, cs[i]))

    def _edit_issue(self, base: str, number: int, issue: dict, body):
        """Every field given and not null replaces the issue's; a change of state or body is recorded
        in ``changes`` (what the tests count)."""
        before = (issue["state"], issue["body"])
        for k in ("title", "body", "state", "labels"):
            if k in body and body[k] is not None:
                issue[k] = body[k]
        if (issue["state"], issue["body"]) != before:
            issue.setdefault("changes", []).append((before[0], issue["state"]))
        return 200, _issue_json(base, number, issue, True), None

    def _page(self, base: str, path: str, q: dict, keys: list, render):
        per_page = min(int(q.get("per_page", ["30"])[0]), 100)
        page = int(q.get("page", ["1"])[0])
        chunk = keys[(page - 1) * per_page: page * per_page]
        headers = {}
        if page * per_page < len(keys):
            rest = {k: v[0] for k, v in q.items() if k not in ("page", "per_page")}
            query = "&".join(f"{k}={v}" for k, v in rest.items())
            headers["Link"] = (f'<{base}{path}?{query}{"&" if query else ""}per_page={per_page}'
                               f'&page={page + 1}>; rel="next"')
        return 200, [render(k) for k in chunk], headers

    def do_GET(self):
        self._handle("GET")

    def do_POST(self):
        self._handle("POST")

    def do_PATCH(self):
        self._handle("PATCH")


class GitHubServer:
    """``with GitHubServer() as gh: gh.url, gh.state``"""

    def __init__(self):
        self.state = GitHubState()
        handler = type("Handler", (_Handler,), {"state": self.state})
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02},
                                       daemon=True)

    def __enter__(self) -> GitHubServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
