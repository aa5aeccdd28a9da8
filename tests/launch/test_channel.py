"""The coordinator's store (harness.launch.channel): what another node publishes lands in the run
folder and nowhere else, data before the marks that say it is complete."""

from __future__ import annotations

import json
from datetime import timedelta

from torch.distributed import TCPStore

from harness.launch.channel import Coordinator, Publisher


def test_a_published_name_that_leaves_the_run_folder_is_refused(tmp_path):
    coord = Coordinator(tmp_path / "run", world=1, host="127.0.0.1")
    client = TCPStore("127.0.0.1", coord.port, is_master=False, timeout=timedelta(seconds=10))
    for name, data in (("../../escape.json", b"x"), ("tp2/rank0.json", b"{}"), ("/etc/passwd2", b"y")):
        client.set(f"f/{name}", data)
        client.append("idx/0", name + "\n")
    assert coord.sync() == 1
    assert (tmp_path / "run" / "tp2" / "rank0.json").read_bytes() == b"{}"
    assert not (tmp_path / "escape.json").exists() and not (tmp_path.parent / "escape.json").exists()
    assert len(coord.refused_names) == 2 and all("launch store" in m for m in coord.refused_names), coord.refused_names


def test_a_ranks_files_are_published_and_mirrored(tmp_path):
    coord = Coordinator(tmp_path / "coordinator", world=2, host="127.0.0.1")
    coord.stage("spec.json", b'{"layouts": []}')
    node = tmp_path / "node1"
    node.mkdir()
    pub = Publisher(f"127.0.0.1:{coord.port}", str(node), rank=1, node=1)
    assert pub.fetch_stage() == ["spec.json"] and (node / "spec.json").read_bytes() == b'{"layouts": []}'
    (node / "tp2").mkdir()
    (node / "tp2" / "rank1.safetensors").write_bytes(b"data")
    (node / "tp2" / "rank1.json").write_text("{}")
    (node / "tp2" / "rank0.json").write_text("{}")  # another rank's: not this publisher's
    (node / "status-1").write_text("0\ttp2\tforward\t\t")
    assert pub.publish() == 3
    coord.sync()
    got = sorted(p.relative_to(tmp_path / "coordinator").as_posix() for p in (tmp_path / "coordinator").rglob("*")
                 if p.is_file())
    assert got == ["status-1", "tp2/rank1.json", "tp2/rank1.safetensors"], got
    assert coord.nodes[1][0] == 1 and coord.version_mismatch() == ""


def test_a_file_larger_than_the_store_takes_arrives_whole(tmp_path):
    """TCPStore's server drops a value over 8 MiB with the connection (a 2-node tp2 launch of a suite at the
    published head_dim died so: its ranks' results are larger). Files go in chunks above CHUNK_BYTES, and
    again when they change; a file whose bytes start like a chunk header is not mistaken for one."""
    import os

    from harness.launch.channel import CHUNK_BYTES, CHUNKED

    coord = Coordinator(tmp_path / "coordinator", world=2, host="127.0.0.1")
    coord.stage("big-spec.json", b"s" * (CHUNK_BYTES + 5))
    node = tmp_path / "node1"
    (node / "tp2").mkdir(parents=True)
    pub = Publisher(f"127.0.0.1:{coord.port}", str(node), rank=1, node=1)
    assert pub.fetch_stage() == ["big-spec.json"] and (node / "big-spec.json").stat().st_size == CHUNK_BYTES + 5
    big = os.urandom(9 << 20) + os.urandom(1234)  # over the server's 8 MiB in one value
    (node / "tp2" / "rank1.safetensors").write_bytes(big)
    (node / "tp2" / "rank1.json").write_bytes(CHUNKED + b"not a header")
    assert pub.publish() == 2
    coord.sync()
    mirrored = tmp_path / "coordinator" / "tp2"
    assert (mirrored / "rank1.safetensors").read_bytes() == big
    assert (mirrored / "rank1.json").read_bytes() == CHUNKED + b"not a header"
    # rewritten (another size, so publish sees the change): the new content, not the first sending's chunks
    again = os.urandom(3 * CHUNK_BYTES + 7)
    (node / "tp2" / "rank1.safetensors").write_bytes(again)
    assert pub.publish() == 1
    coord.sync()
    assert (mirrored / "rank1.safetensors").read_bytes() == again


def test_a_file_that_cannot_be_brought_back_is_named_and_costs_no_other(tmp_path):
    """A header whose chunks never came (a rank killed between them, or a buggy sender) and a malformed
    header: each named by ``problems`` at once (a ``get`` of a missing key waited out the store's whole
    timeout), and the rank's other files still mirrored."""
    import time

    from harness.launch.channel import CHUNKED

    coord = Coordinator(tmp_path / "run", world=1, host="127.0.0.1", timeout_s=30)
    client = TCPStore("127.0.0.1", coord.port, is_master=False, timeout=timedelta(seconds=10))
    sent = {"tp2/rank0.safetensors": CHUNKED + json.dumps({"gen": 1, "n": 3, "size": 99}).encode(),
            "tp2/rank0.log": CHUNKED + b"{not json", "status-0": b"0\ttp2\tforward\t\t"}
    for name, data in sent.items():
        client.set(f"f/{name}", data)
        client.append("idx/0", name + "\n")
    t0 = time.monotonic()
    assert coord.sync() == 1 and time.monotonic() - t0 < 5
    assert (tmp_path / "run" / "status-0").read_bytes() == sent["status-0"]
    assert not (tmp_path / "run" / "tp2").exists()
    problems = coord.problems()
    assert len(problems) == 2, problems
    assert any(p.startswith("rank 0's tp2/rank0.safetensors: ") and "3 chunks that are not all there" in p
               for p in problems), problems
    assert any(p.startswith("rank 0's tp2/rank0.log: ") and "malformed chunk header" in p for p in problems), problems


def test_a_rank_that_cannot_publish_says_so_once_in_its_nodes_log(tmp_path, capfd):
    coord = Coordinator(tmp_path / "coordinator", world=2, host="127.0.0.1")
    node = tmp_path / "node1"
    node.mkdir()
    pub = Publisher(f"127.0.0.1:{coord.port}", str(node), rank=1, node=1, timeout_s=2)
    coord.close()  # the coordinator's store is gone (as when its process died)
    (node / "status-1").write_text("0\ttp2\tforward\t\t")
    pub.stop()
    (node / "status-1").write_text("1\ttp2\tbackward\t\t")
    pub.stop()
    err = capfd.readouterr().err
    assert err.count("harness rank wrapper: rank 1 could not publish its files to the launch store: ") == 1, err
