"""Suites: typed schema (schema.py) and loading with file- and field-named errors (loader.py)."""

from harness.suite.loader import LoadedSuite, SuiteError, discover, load_suite

__all__ = ["LoadedSuite", "SuiteError", "discover", "load_suite"]
