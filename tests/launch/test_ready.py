"""Readiness of a server started through the launch layer: a real HTTP server becomes ready (its port
accepts, its ready-line is logged) and serves; one that never listens, or exits, is a one-line
NotReady with its log's tail, and is killed."""

from __future__ import annotations

import sys
import urllib.request

import pytest

from harness.launch.group import ProcessGroup
from harness.launch.ready import NotReady, free_port, port_open, wait_ready
from tests.launch.helpers import still_alive


def test_a_real_http_server_becomes_ready_and_serves(tmp_path):
    (tmp_path / "www").mkdir()
    (tmp_path / "www" / "hello.txt").write_text("hello from the server")
    port = free_port()
    g = ProcessGroup.start([sys.executable, "-u", "-m", "http.server", str(port), "--bind", "127.0.0.1",
                            "--directory", str(tmp_path / "www")], tmp_path / "run", log_name="server.log")
    with g:
        took = g.wait_ready(timeout_s=20, port=port, line=r"Serving HTTP on .* port \d+")
        assert 0 <= took < 20
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/hello.txt", timeout=10) as r:
            assert r.status == 200 and r.read() == b"hello from the server"
    assert g.ended.how == "killed" and still_alive([g.pid]) == [] and not port_open(port)


def test_a_server_that_never_listens_times_out_with_its_log_tail(tmp_path):
    port = free_port()
    code = "import time; print('loading weights shard 1 of 9', flush=True); time.sleep(600)"
    g = ProcessGroup.start([sys.executable, "-c", code], tmp_path / "run", log_name="server.log")
    with pytest.raises(NotReady) as e:
        g.wait_ready(timeout_s=1.5, port=port, name="vllm server")
    msg = str(e.value)
    assert msg.startswith(f"vllm server not ready within 1.5 s (waited for port {port} accepting)"), msg
    assert msg.endswith("log: loading weights shard 1 of 9") and "\n" not in msg
    assert g.ended is not None and still_alive([g.pid]) == []  # not ready: killed, not left running


def test_a_server_that_exits_is_not_waited_for(tmp_path):
    code = "import sys; print('OSError: [Errno 98] Address already in use', flush=True); sys.exit(3)"
    g = ProcessGroup.start([sys.executable, "-c", code], tmp_path / "run", log_name="server.log")
    with pytest.raises(NotReady, match=r"exited with code 3 .*; log: OSError: \[Errno 98\] Address already in use"):
        g.wait_ready(timeout_s=60, line="Uvicorn running")
    assert g.ended.wall_s < 30  # it did not wait out the 60 s


def test_bad_arguments_are_one_line_errors(tmp_path):
    with pytest.raises(ValueError, match="needs a port, a ready-line or both"):
        wait_ready(timeout_s=1)
    with pytest.raises(ValueError, match="needs the log"):
        wait_ready(timeout_s=1, line="ready")
