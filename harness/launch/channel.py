"""How a multi-node launch's files reach the coordinating node without a shared folder.

On one host the ranks write their files (``harness.launch.status``: status records, exit records,
logs; the caller's results) into the launch's run folder and the launcher reads them there. On a
cluster the nodes share no folder, so each node's ranks write into a node-local folder and the rank
wrapper (``harness.launch.rank``) *publishes* what its rank wrote to a key-value store served by the
coordinator; the coordinator *mirrors* the store back into its run folder, where the launcher reads
the files exactly as on one host. The store is torch's ``TCPStore`` (the same server torchrun's
rendezvous uses; one TCP connection per rank). Its server refuses a value over 8 MiB and drops the
connection ("Invalid payload size ... max: 8388608": a tensor-parallel rank's results at the published
head_dim are more, and the whole launch died with it), so a larger file goes as chunks (``put``/``get``).

Keys (all under the launch's store):

* ``stage/<name>`` and ``stage-index``: files the coordinator hands every node before the ranks
  start (the worker's spec); the wrapper writes them into its node-local folder;
* ``f/<relative path>``: the latest content of one file a rank wrote; ``idx/<rank>``: the paths that
  rank published (one per line, each once);
* ``node/<rank>``: ``<node index>\\t<hostname>\\t<package versions, JSON>``: which node a rank runs
  on, for the error messages (a node that died wrote no exit records: its ranks are named through
  this), and what it runs: a node whose torch, transformers, safetensors or harness differ from the
  others' is refused before any result is compared (``Coordinator.version_mismatch``).

Publishing order matters for results: a rank writes ``<layout>/rank<r>.safetensors`` and then
``rank<r>.json`` (the launcher's "done" mark), so the publisher notes which marks exist *before* it
reads the other files and sends those marks last: the coordinator never sees a mark before the data.

What fails on the way is said where it will be read. A file the coordinator cannot bring back (a name
that would leave the run folder, a chunked file whose chunks are not all there) costs no other file
and is named by ``Coordinator.problems``, which the launch's ``infrastructure()`` reports: the
results it lacks are then the launch's failure, not the model's. A rank that cannot publish (the
store refused a value, the coordinator is gone) says so once on its wrapper's stderr, the node
agent's log, which the launcher quotes when the rank's results never arrive.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
from datetime import timedelta
from pathlib import Path

from harness.files import atomic, paths
from harness.messages import first_line

LOG_TAIL_BYTES = 16384  # a rank's log is published as its tail: error messages quote the last lines
PACKAGES = ("torch", "transformers", "safetensors", "harness")  # what every node must run alike
# TCPStore's server (libuv backend) takes values up to 8 MiB; a file above CHUNK_BYTES is sent as chunks
CHUNK_BYTES = 4 << 20
# the value of a chunked file's key: this, then JSON {"gen", "n", "size"}; its chunks are ``<key>#<gen>/<i>``.
# A file whose own bytes start so (none of harness's do: NUL first) is chunked too, so a value is never ambiguous
CHUNKED = b"\0harness-chunked\0"


def put(store, key: str, data: bytes, gen: int = 0) -> None:
    """Set ``key`` to ``data``, in chunks when it is larger than the store takes (chunks first, then the
    header: a reader never sees a header before its chunks).
    ``gen`` tells one sending of a key from the last. An earlier sending's chunks stay: a reader that took
    its header may still be reading them (a file goes again only when it changed; the files this large,
    a layout's results, are written once)."""
    if len(data) <= CHUNK_BYTES and not data.startswith(CHUNKED):
        store.set(key, data)
        return
    n = -(-len(data) // CHUNK_BYTES)
    for i in range(n):
        store.set(f"{key}#{gen}/{i}", data[i * CHUNK_BYTES:(i + 1) * CHUNK_BYTES])
    store.set(key, CHUNKED + json.dumps({"gen": gen, "n": n, "size": len(data)}).encode())


def get(store, key: str, value: bytes | None = None) -> bytes:
    """``key``'s content, its chunks joined (``value``: the key's value where already read). A header
    whose chunks are not all there (they are sent first) is an OSError at once: ``get`` of a missing
    key would wait out the store's whole timeout."""
    value = store.get(key) if value is None else value
    if not value.startswith(CHUNKED):
        return value
    try:
        h = json.loads(value[len(CHUNKED):])
        keys = [f"{key}#{int(h['gen'])}/{i}" for i in range(int(h["n"]))]
    except (ValueError, KeyError, TypeError) as e:
        raise OSError(f"launch store: {key} has a malformed chunk header ({e})") from None
    if not store.check(keys):
        raise OSError(f"launch store: {key} announces {len(keys)} chunks that are not all there")
    data = b"".join(store.get(k) for k in keys)
    if len(data) != h["size"]:
        raise OSError(f"launch store: {key} came as {len(data)} bytes of {h['size']}")
    return data


def versions() -> dict[str, str]:
    """This process's Python and package versions (as installed: what ``import`` would load)."""
    from importlib import metadata

    out = {"python": ".".join(map(str, sys.version_info[:3]))}
    for p in PACKAGES:
        try:
            out[p] = metadata.version(p)
        except metadata.PackageNotFoundError:
            out[p] = "absent"
    return out


def _split(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"the launch store {endpoint!r}: expected host:port")
    return host, int(port)


def _owned(rank: int, rel: str) -> bool:
    """Whether ``rel`` (a path in the run folder) is one of ``rank``'s files."""
    name = os.path.basename(rel)
    return (name in (f"status-{rank}", f"exit-{rank}.json", f"rank{rank}.log")
            or name.startswith(f"rank{rank}.") and os.path.dirname(rel) != "")


class Coordinator:
    """The store of one launch, served by the coordinating process; ``sync`` mirrors it into ``run_dir``."""

    def __init__(self, run_dir: Path, world: int, host: str = "0.0.0.0", timeout_s: float = 60.0):
        from torch.distributed import TCPStore

        self.run_dir, self.world = Path(run_dir), world
        self.store = TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
        self._seen: dict[str, bytes] = {}
        self.nodes: dict[int, tuple[int, str]] = {}  # rank -> (node index, hostname)
        self.versions: dict[int, dict[str, str]] = {}  # rank -> versions
        self.reference = versions()  # what every rank must run
        self.refused_names: list[str] = []  # published names that would have left the run folder
        self.lost: dict[str, str] = {}  # published name -> why it could not be read from the store

    @property
    def port(self) -> int:
        return self.store.port

    def stage(self, name: str, data: bytes) -> None:
        put(self.store, f"stage/{name}", data)
        self.store.append("stage-index", name + "\n")
        # set and append do not wait for the server, and a node's wrapper reads over its own connection:
        # without this round trip a wrapper that asked early found no stage-index (CI, a 4 MiB stage under
        # load) and its rank ran without the spec. The reply comes after everything sent before it.
        self.store.check(["stage-index"])

    def _names(self, rank: int) -> list[str]:
        key = f"idx/{rank}"
        if not self.store.check([key]):
            return []
        return [n for n in self.store.get(key).decode().splitlines() if n]

    def sync(self) -> int:
        """Write every file published since the last call into the run folder; returns how many."""
        n = 0
        for r in range(self.world):
            if r not in self.nodes and self.store.check([f"node/{r}"]):
                idx, host, vers = (self.store.get(f"node/{r}").decode().split("\t") + ["", "{}"])[:3]
                self.nodes[r] = (int(idx), host)
                self.versions[r] = json.loads(vers or "{}")
            names = self._names(r)
            marks = [x for x in names if x.endswith(".json")]
            # data before marks, as published (see the module's docstring)
            for name in [x for x in names if not x.endswith(".json")] + marks:
                n += self._mirror(r, name)
        return n

    def _mirror(self, rank: int, name: str) -> int:
        """Write one published file into the run folder when it changed: 1, else 0. A file that cannot
        be read or placed is recorded (``problems``) and costs no other file."""
        try:
            value = self.store.get(f"f/{name}")  # a chunked file's header: new chunks, new header
            if self._seen.get(name) == value:
                return 0
            data = get(self.store, f"f/{name}", value)
            self._seen[name] = value  # after the read: a read that failed is tried again at the next sync
        except (OSError, RuntimeError) as e:  # torch's store errors are RuntimeErrors
            self.lost[name] = f"rank {rank}'s {name}: {first_line(e) or type(e).__name__}"
            return 0
        self.lost.pop(name, None)
        try:  # a name another node sent: a relative path of plain names under the run folder
            target = paths.join(self.run_dir, name, source="launch store", field=f"rank {rank}'s file", plain=False)
        except paths.PathRefused as e:
            self.refused_names.append(str(e))
            return 0
        target.parent.mkdir(parents=True, exist_ok=True)
        atomic.write_bytes(target, data)
        return 1

    def problems(self) -> list[str]:
        """What the ranks sent that did not reach the run folder, and why ([] when everything did)."""
        return [*self.refused_names, *self.lost.values()]

    def version_mismatch(self) -> str:
        """'' while every rank heard from runs the coordinator's versions (it runs on node 0 and
        compares what the ranks send); else which node differs in what."""
        ref = self.reference
        bad: dict[int, tuple[list[int], str]] = {}
        for r, v in sorted(self.versions.items()):
            diff = ", ".join(f"{k} {v.get(k, 'absent')} (the coordinator: {ref.get(k, 'absent')})"
                             for k in sorted(set(ref) | set(v)) if v.get(k) != ref.get(k))
            if diff:
                bad.setdefault(self.nodes[r][0], ([], diff))[0].append(r)
        return "; ".join(f"node {n} ({self.nodes[rs[0]][1]}, ranks {rs}) runs {d}" for n, (rs, d) in sorted(bad.items()))

    def ranks_of(self, node: int) -> list[int]:
        return sorted(r for r, (i, _h) in self.nodes.items() if i == node)

    def close(self) -> None:
        del self.store


class Publisher:
    """The rank wrapper's side: stage files in, then publish the rank's files as they change."""

    def __init__(self, endpoint: str, run_dir: str, rank: int, node: int, timeout_s: float = 60.0):
        from torch.distributed import TCPStore

        host, port = _split(endpoint)
        self.run_dir, self.rank = run_dir, rank
        self.store = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
        self.store.set(f"node/{rank}", f"{node}\t{socket.gethostname()}\t{json.dumps(versions())}")
        self._sent: dict[str, tuple[int, int]] = {}  # rel -> (mtime_ns, size) last sent
        self._gen = 0  # one per chunked sending: its chunks' keys
        self._named: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._said = False  # a failure to publish is said once (_say)

    def fetch_stage(self) -> list[str]:
        """Write the coordinator's staged files into the local run folder; their names."""
        if not self.store.check(["stage-index"]):
            return []
        names = [n for n in self.store.get("stage-index").decode().splitlines() if n]
        for name in names:
            target = paths.join(self.run_dir, name, source="launch store", field="staged file")
            atomic.write_bytes(target, get(self.store, f"stage/{name}"))
        return names

    def _files(self) -> list[str]:
        out = []
        for base, _dirs, files in os.walk(self.run_dir):
            for f in files:
                rel = os.path.relpath(os.path.join(base, f), self.run_dir)
                if _owned(self.rank, rel) and not f.startswith("."):
                    out.append(rel)
        return out

    def publish(self) -> int:
        """Send this rank's changed files; marks (``.json``) seen before the data was read go last."""
        files = self._files()
        marks = [f for f in files if f.endswith(".json")]
        n = 0
        for rel in [f for f in files if not f.endswith(".json")] + marks:
            path = os.path.join(self.run_dir, rel)
            try:
                st = os.stat(path)
                key = (st.st_mtime_ns, st.st_size)
                if self._sent.get(rel) == key:
                    continue
                with open(path, "rb") as f:
                    if rel.endswith(".log"):
                        f.seek(max(0, st.st_size - LOG_TAIL_BYTES))
                    data = f.read()
            except OSError:
                continue
            self._gen += 1
            put(self.store, f"f/{rel}", data, self._gen)
            if rel not in self._named:
                self._named.add(rel)
                self.store.append(f"idx/{self.rank}", rel + "\n")
            self._sent[rel] = key
            n += 1
        if n:  # TCPStore's set does not wait for the server: one round trip, and every value sent is there
            self.store.check([f"idx/{self.rank}"])
        return n

    def start(self, interval_s: float = 0.1) -> None:
        def loop():
            while not self._stop.wait(interval_s):
                try:
                    self.publish()
                except Exception as e:  # the coordinator went away (the launch is being torn down), or
                    self._say(e)        # the store refused what was sent: said where the node's log shows it
                    return

        self._thread = threading.Thread(target=loop, name="launch-publisher", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the loop and publish what is left (the exit record)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            self.publish()
        except Exception as e:
            self._say(e)

    def _say(self, e: Exception) -> None:
        """One line on the wrapper's stderr, which is the node agent's log: the coordinator heard nothing
        more from this rank, and its report ("ranks exited before reporting") quotes that log's tail."""
        if not self._said:
            self._said = True
            print(f"harness rank wrapper: rank {self.rank} could not publish its files to the launch store: "
                  f"{first_line(e) or type(e).__name__}", file=sys.stderr, flush=True)


def publisher_from_env(run_dir: str, rank: int) -> Publisher | None:
    from harness import settings

    endpoint = settings.env("HARNESS_LAUNCH_STORE")
    if not endpoint:
        return None
    node = settings.env("HARNESS_LAUNCH_NODE")
    return Publisher(endpoint, run_dir, rank, node if node is not None else int(os.environ.get("SLURM_NODEID") or 0))
