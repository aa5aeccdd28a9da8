"""A small GitHub REST server on 127.0.0.1 for the comparator's tests.

It speaks the JSON shapes github3.py reads for the endpoints the comparator uses (repository,
issues list/create/get/edit, comments, labels), keeps state in memory, checks the token, paginates
with ``Link`` headers like GitHub, and can be told to answer the next requests with errors
(``fail_next``) to exercise retries and rate limits. Served under ``/api/v3`` (GitHub Enterprise
layout) and at the root (api.github.com layout).
"""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

OWNER, REPO = "acme", "models"
TOKEN = "ghp_" + "x" * 36


def _user(base: str, login: str = "harness-bot") -> dict:
    u = f"{base}/users/{login}"
    return {"login": login, "id": 1, "node_id": "U1", "avatar_url": "", "gravatar_id": "", "url": u,
            "html_url": f"https://github.test/{login}", "followers_url": u + "/followers",
            "following_url": u + "/following{/other_user}", "gists_url": u + "/gists{/gist_id}",
            "starred_url": u + "/starred{/owner}{/repo}", "subscriptions_url": u + "/subscriptions",
            "organizations_url": u + "/orgs", "repos_url": u + "/repos",
            "events_url": u + "/events{/privacy}", "received_events_url": u + "/received_events",
            "type": "User", "site_admin": False}


class GitHubState:
    def __init__(self):
        self.issues: dict[int, dict] = {}
        self.comments: dict[int, list[dict]] = {}
        self.requests: list[tuple[str, str]] = []
        self.failures: list[tuple[int, dict]] = []  # answered before any real handling
        self.lock = threading.Lock()

    def fail_next(self, status: int, headers: dict | None = None, times: int = 1) -> None:
        self.failures.extend([(status, headers or {})] * times)

    def open_issues(self) -> list[dict]:
        return [i for i in self.issues.values() if i["state"] == "open"]

    def mutating(self) -> list[tuple[str, str]]:
        return [r for r in self.requests if r[0] != "GET"]


def _issue_json(base: str, n: int, issue: dict, full: bool) -> dict:
    api = f"{base}/repos/{OWNER}/{REPO}/issues/{n}"
    out = {"url": api, "repository_url": f"{base}/repos/{OWNER}/{REPO}",
           "labels_url": api + "/labels{/name}", "comments_url": api + "/comments",
           "events_url": api + "/events", "html_url": f"https://github.test/{OWNER}/{REPO}/issues/{n}",
           "id": 1000 + n, "node_id": f"I{n}", "number": n, "title": issue["title"],
           "user": _user(base), "labels": [
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
        with st.lock:
            st.requests.append((method, path))
            if st.failures:
                status, headers = st.failures.pop(0)
                return self._send(status, {"message": "injected failure"}, headers)
        if self.headers.get("Authorization") != f"token {TOKEN}":
            return self._send(401, {"message": "Bad credentials"})
        prefix = f"/repos/{OWNER}/{REPO}"
        if path == prefix and method == "GET":
            return self._send(200, _repo_json(base))
        m = re.fullmatch(prefix + r"/issues(?:/(\d+))?(/comments)?", path)
        if path == prefix + "/labels" and method == "GET":
            names = sorted({lbl for i in st.issues.values() for lbl in i["labels"]})
            return self._send(200, [{"name": n, "color": "ededed", "url": f"{base}{prefix}/labels/{n}"}
                                    for n in names])
        if not m:
            return self._send(404, {"message": "Not Found"})
        number, comments = (int(m.group(1)) if m.group(1) else None), bool(m.group(2))
        with st.lock:
            if number is None and method == "GET":
                return self._list(base, parse_qs(url.query))
            if number is None and method == "POST":
                n = max(st.issues, default=0) + 1
                st.issues[n] = {"title": body["title"], "body": body.get("body") or "",
                                "labels": list(body.get("labels") or []), "state": "open", "comments": []}
                return self._send(201, _issue_json(base, n, st.issues[n], True))
            issue = st.issues.get(number)
            if issue is None:
                return self._send(404, {"message": "Not Found"})
            if comments and method == "POST":
                c = {"id": len(issue["comments"]) + 1, "body": body["body"]}
                issue["comments"].append(c)
                api = f"{base}{prefix}/issues/comments/{c['id']}"
                return self._send(201, {"url": api, "html_url": api, "issue_url": f"{base}{prefix}/issues/{number}",
                                        "id": c["id"], "body": c["body"], "body_html": "", "body_text": c["body"],
                                        "user": _user(base), "author_association": "OWNER",
                                        "created_at": "2026-01-01T00:00:00Z", "updated_at": "2026-01-01T00:00:00Z"})
            if comments and method == "GET":
                return self._send(200, [{"id": c["id"], "body": c["body"]} for c in issue["comments"]])
            if method == "PATCH":
                for k in ("title", "body", "state", "labels"):
                    if k in body and body[k] is not None:
                        issue[k] = body[k]
                return self._send(200, _issue_json(base, number, issue, True))
            if method == "GET":
                return self._send(200, _issue_json(base, number, issue, True))
        return self._send(405, {"message": "Method Not Allowed"})

    def _list(self, base: str, q: dict) -> None:
        st = self.state
        state = q.get("state", ["open"])[0]
        labels = [x for x in q.get("labels", [""])[0].split(",") if x]
        per_page, page = int(q.get("per_page", ["30"])[0]), int(q.get("page", ["1"])[0])
        found = [n for n, i in sorted(st.issues.items())
                 if (state == "all" or i["state"] == state) and all(lbl in i["labels"] for lbl in labels)]
        chunk = found[(page - 1) * per_page: page * per_page]
        headers = {}
        if page * per_page < len(found):
            nxt = f"{base}/repos/{OWNER}/{REPO}/issues?state={state}&labels={','.join(labels)}" \
                  f"&per_page={per_page}&page={page + 1}"
            headers["Link"] = f'<{nxt}>; rel="next"'
        self._send(200, [_issue_json(base, n, st.issues[n], False) for n in chunk], headers)

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
