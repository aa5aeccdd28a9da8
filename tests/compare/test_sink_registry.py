"""Issue sinks: one registry (harness.sinks entry points); github/file/stdout are harness's own."""

from __future__ import annotations

import io

import pytest

from harness.compare.pipeline import Options, make_sink
from harness.compare.sinks import FileSink, SinkConfigError, SinkRegistry, StdoutSink, registry


def test_builtin_sinks_come_from_harness_own_entry_point():
    from importlib.metadata import entry_points

    assert [ep.value for ep in entry_points(group="harness.sinks") if ep.dist.name == "harness"] == \
        ["harness.compare.sinks:register"]
    assert registry().names()[:3] == ["github", "file", "stdout"]


def test_make_sink_by_name(tmp_path):
    assert isinstance(make_sink(Options(results=[], sink="stdout"), io.StringIO()), StdoutSink)
    assert isinstance(make_sink(Options(results=[], sink="file", out_dir=str(tmp_path / "i")), io.StringIO()), FileSink)
    with pytest.raises(SinkConfigError, match=r"unknown issue sink 'jira' \(registered: github, file, stdout"):
        make_sink(Options(results=[], sink="jira"), io.StringIO())


def test_the_registry_refuses_a_bare_factory():
    with pytest.raises(ValueError, match="SinkType"):
        SinkRegistry().add(lambda opts, out: None)  # type: ignore[arg-type]
