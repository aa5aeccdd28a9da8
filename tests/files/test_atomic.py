"""harness.files.atomic: the one atomic write every writer in harness/ goes through."""

from __future__ import annotations

import errno
import json
import os
import re
import stat
import subprocess
import threading
from pathlib import Path

import pytest

from harness.files import atomic

REPO = Path(__file__).resolve().parents[2]


def test_text_bytes_and_json_variants_write_whole_files(tmp_path):
    atomic.write_text(tmp_path / "a.txt", "héllo\n")
    atomic.write_bytes(tmp_path / "b.bin", b"\x00\x01" * 70000)
    atomic.write_json(tmp_path / "c.json", {"b": 1, "a": [1, 2]}, sort_keys=True)
    assert (tmp_path / "a.txt").read_text(encoding="utf-8") == "héllo\n"
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\x01" * 70000
    assert json.loads((tmp_path / "c.json").read_text()) == {"a": [1, 2], "b": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.bin", "c.json"]


def test_an_unserialisable_value_touches_nothing(tmp_path):
    (tmp_path / "c.json").write_text('{"old": 1}')
    with pytest.raises(TypeError):
        atomic.write_json(tmp_path / "c.json", {"x": object()})
    assert json.loads((tmp_path / "c.json").read_text()) == {"old": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["c.json"]


@pytest.mark.parametrize("umask,want", [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_mode_honours_the_umask_not_0600(tmp_path, umask, want):
    old = os.umask(umask)
    try:
        atomic.write_text(tmp_path / "f", "x")
        d = atomic.make_dirs(tmp_path / "d" / "e")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "f").stat().st_mode) == want
    assert stat.S_IMODE(d.stat().st_mode) == 0o777 & ~umask


def test_an_existing_file_keeps_its_mode(tmp_path):
    f = tmp_path / "f"
    f.write_text("old")
    f.chmod(0o640)
    atomic.write_text(f, "new")
    assert f.read_text() == "new" and stat.S_IMODE(f.stat().st_mode) == 0o640


def test_file_and_folder_are_fsyncd_before_and_after_the_rename(tmp_path, monkeypatch):
    synced, real = [], os.fsync

    def record(fd):
        st = os.fstat(fd)
        synced.append(("dir" if stat.S_ISDIR(st.st_mode) else "file", os.path.exists(tmp_path / "f")))
        real(fd)

    monkeypatch.setattr(os, "fsync", record)
    atomic.write_text(tmp_path / "f", "x")
    # the file before the rename (target not there yet), the folder after it
    assert synced == [("file", False), ("dir", True)]


def test_a_full_disk_leaves_the_old_file_whole_and_no_temporary(tmp_path, monkeypatch):
    target = tmp_path / "summary.json"
    target.write_text('{"complete": true}')

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError) as e:
        atomic.write_text(target, '{"new": ' + "1" * 100000 + "}")
    assert e.value.errno == errno.ENOSPC
    monkeypatch.undo()
    assert json.loads(target.read_text()) == {"complete": True}
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_temporary_names_are_unique_per_process_thread_and_call(tmp_path):
    """Eight threads write one target at once: every write succeeds and the result is one of them,
    whole (a fixed ".tmp" name made two writers truncate and rename each other's file)."""
    target = tmp_path / "t.json"
    errors, payloads = [], [json.dumps({"w": i, "pad": "x" * 200_000}) for i in range(8)]

    def writer(i):
        try:
            for _ in range(10):
                atomic.write_text(target, payloads[i])
        except Exception as e:  # pragma: no cover - what the test is looking for
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert target.read_text() in payloads
    assert [p.name for p in tmp_path.iterdir()] == ["t.json"]
    names = {atomic.tmp_name(target).name for _ in range(100)}
    assert len(names) == 100 and all(f".t.json.tmp-{os.getpid()}-" in n for n in names)


def test_leftovers_are_named_cleaned_and_ignored_by_git(tmp_path):
    dead = 2**22 + 12345  # above the default pid_max: never a live process
    left = [f".summary.json.tmp-{dead}-1-ab12cd34", f".kimi-k2.tmp-{dead}-7-00ff00ff", ".kimi-k2.tmp-k3j_x9",
            f".kimi-k2.old-{dead}"]
    for name in left:
        (tmp_path / name).write_text("partial")
    live = tmp_path / f".x.json.tmp-{os.getppid()}-1-ab"  # a live writer's file is left alone
    live.write_text("in flight")
    (tmp_path / "summary.json").write_text("{}")
    removed = atomic.clean_leftovers(tmp_path)
    assert sorted(p.name for p in removed) == sorted(left)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, "summary.json"])
    assert not atomic.is_leftover("summary.json") and not atomic.is_leftover("v-20260101T000000Z-ab")
    # git ignores them wherever they are (golden folders are committed)
    paths = [f"golden/kimi-k2/.v-20260101T000000Z-ab12cd34.tmp-{dead}-1-ab12cd34",
             f"golden/.kimi-k2.tmp-{dead}-7-00ff00ff", f"golden/.kimi-k2.old-{dead}", f"suites/.x.toml.tmp-{dead}-1-ab",
             "golden/.kimi-k2.tmp-k3j_x9"]
    r = subprocess.run(["git", "check-ignore", "--no-index", *paths], cwd=REPO, capture_output=True, text=True)
    assert sorted(r.stdout.split()) == sorted(paths), r.stdout + r.stderr


def test_check_writable_is_one_line(tmp_path):
    f = tmp_path / "file"
    f.write_text("a file where a folder should be")
    with pytest.raises(OSError) as e:
        atomic.check_writable(f / "sub", "golden directory")
    assert str(e.value).startswith(f"golden directory {f / 'sub'} is not writable: ") and "\n" not in str(e.value)


# Writers that bypass the helper, as they were found by the grep. A new one must use
# harness.files.atomic (or be listed here with why it is not a file write that must survive a crash).
_BYPASS = re.compile(r"os\.replace\(|\.rename\(|\.replace\(p\)|\.write_text\(|\.write_bytes\(|\.tmp\"|"
                     r"(?<![.\w])open\([^)]*[\"']w[b]?[\"']|json\.dump\(|mkdtemp\(")
_ALLOWED = {
    "harness/files/atomic.py": "the helper itself",
    "harness/golden/store.py": "os.rename of a whole version folder / first golden (atomic renames of folders)",
    "harness/parallel/launcher.py": "torchrun.log: a log stream, read while it grows",
    "harness/cli/ci_local.py": "shard logs: streams",
    "harness/proc.py": "/proc/self/clear_refs: a kernel interface, not a file",
    "harness/serve/engines/vllm_runner.py": "runs in the engine's venv, where harness is not installed: "
                                            "its own temporary file and os.replace",
    "harness/serve/engines/vllm_server.py": "runs in the engine's venv beside vllm_runner.py: its own temporary "
                                            "file and os.replace for the port and status files; the server's "
                                            "request file is written before the server that reads it starts",
    "harness/files/scratch.py": "mkdtemp of a process's scratch folder, removed at its exit or by the next "
                                "process's sweep of orphans",
    "harness/checks/parallel.py": "mkdtemp of scratch folders for launches, deleted after",
    "harness/launch/nodes.py": "mkdtemp of a rehearsal's node folders, removed with its node set",
    "harness/launch/agents.py": "mkdtemp of a node agent's launch folders, removed when it ends",
    "harness/compare/history.py": "os.replace of a damaged history file aside (a rename of the whole file)",
}


def test_every_writer_in_harness_goes_through_the_helper():
    offenders = []
    for p in sorted((REPO / "harness").rglob("*.py")):
        rel = p.relative_to(REPO).as_posix()
        if rel in _ALLOWED:
            continue
        for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
            code = line.split("#", 1)[0]
            if _BYPASS.search(code) and "atomic." not in code:
                offenders.append(f"{rel}:{n}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_a_symlink_stays_a_symlink_and_its_target_gets_the_content(tmp_path):
    """Issue #49: a quarantine file kept elsewhere and linked into the checkout was replaced by a
    regular file, so the shared copy never saw the change."""
    real = tmp_path / "shared" / "q.json"
    real.parent.mkdir()
    real.write_text("{}")
    link = tmp_path / "q.json"
    link.symlink_to(real)
    atomic.write_json(link, {"a": 1})
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert json.loads(real.read_text()) == {"a": 1}


def test_concurrent_read_modify_writes_under_the_lock_keep_every_change(tmp_path):
    """Eight processes each add one entry through `harness quarantine add`: all eight are kept (without
    the lock, each wrote its own read of the file over the others': one entry survived)."""
    import subprocess
    import sys

    q = tmp_path / "quarantine.json"
    exe = str(Path(sys.executable).with_name("harness"))
    procs = [subprocess.Popen([exe, "quarantine", "add", f"suites/s{i}.toml::smoke[cpu-float32]", "--file", str(q),
                               "--reason", "test"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
             for i in range(8)]
    errs = [p.communicate(timeout=120)[1] for p in procs]
    assert all(p.returncode == 0 for p in procs), errs
    items = json.loads(q.read_text())["items"]
    from harness.compare.quarantine import key_of

    assert sorted(items) == sorted(key_of(f"suites/s{i}.toml::smoke[cpu-float32]") for i in range(8))
