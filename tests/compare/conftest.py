"""Fixtures for the comparator's tests: a local GitHub server and a clean CI environment."""

from __future__ import annotations

import pytest

from .github_server import TOKEN, GitHubServer


@pytest.fixture
def github(monkeypatch):
    """A local GitHub; GITHUB_TOKEN/GITHUB_REPOSITORY point at it for the test's duration."""
    with GitHubServer() as server:
        monkeypatch.setenv("GITHUB_TOKEN", TOKEN)
        monkeypatch.setenv("GITHUB_REPOSITORY", "acme/models")
        for k in ("GITHUB_API_URL", "GITHUB_RUN_ID", "GITHUB_STEP_SUMMARY", "GITHUB_SHA"):
            monkeypatch.delenv(k, raising=False)
        yield server


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    # CI variables of the machine running these tests must not leak into run URLs or summaries.
    for k in ("GITHUB_RUN_ID", "GITHUB_STEP_SUMMARY", "GITHUB_SHA", "GITHUB_RUN_ATTEMPT"):
        monkeypatch.delenv(k, raising=False)
