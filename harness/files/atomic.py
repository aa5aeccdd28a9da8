"""The one atomic write: a file either keeps its old content or has the whole new one, never a
truncated mix, whatever happens (full disk, kill -9, power loss after the call returned).

How: the data goes to a temporary file in the *same folder* (a rename is atomic only within one
file system), named ``.<name>.tmp-<pid>-<thread>-<random>`` so that two processes or two threads
writing the same target never share a temporary file; the file is fsync'd, renamed over the target
with ``os.replace`` and the folder is fsync'd, so the rename itself survives a crash. On any error
the temporary file is removed and the error propagates (the target is untouched).

Modes honour the umask like a plain ``open(..., "w")`` (``mkstemp`` would give 0600, which made a
shared CI checkout unreadable to the next job's user); an existing target keeps its own mode.

``is_leftover`` names what an interrupted write can leave behind, so cleaners and ``.gitignore``
agree on one pattern.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import secrets
import threading
from pathlib import Path

TMP_MARK = ".tmp-"
# ".<name>.tmp-<pid>-<thread>-<hex>": what this module (and the golden store) leaves after a kill.
# Older writers' "mkdtemp" names (".<name>.tmp-k3j_x9") match too, so they are cleaned alike.
_LEFTOVER = re.compile(r"^\..+\.(tmp|old)-[A-Za-z0-9_-]+$")


def _umask() -> int:
    # os.umask can only be read by setting it; the lock keeps two threads from seeing each other's 0.
    with _UMASK_LOCK:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


_UMASK_LOCK = threading.Lock()


def tmp_name(path: Path) -> Path:
    """A temporary sibling of ``path``, unique per process, thread and call."""
    return path.with_name(f".{path.name}{TMP_MARK}{os.getpid()}-{threading.get_ident()}-{secrets.token_hex(4)}")


def is_leftover(name: str) -> bool:
    """A temporary or superseded file/folder an interrupted write left behind."""
    return bool(_LEFTOVER.match(name))


def fsync_dir(folder: Path) -> None:
    """Make a rename in ``folder`` durable. Some file systems cannot fsync a folder (EINVAL):
    the rename is still atomic there, just not yet durable, which is all they offer."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def _mode_for(path: Path) -> int:
    try:
        return os.stat(path).st_mode & 0o7777
    except FileNotFoundError:
        return 0o666 & ~_umask()


def write_bytes(path: str | os.PathLike, data: bytes, *, mode: int | None = None) -> Path:
    """Write ``data`` to ``path`` atomically (see the module docstring). ``mode``: the file's
    permission bits (default: the existing file's, else 0666 minus the umask). A symlink stays a
    symlink: the file it points to is the one replaced (a quarantine file kept in another folder
    and linked into the checkout was replaced by a regular file, issue #49)."""
    path = Path(path)
    if path.is_symlink():
        path = Path(os.path.realpath(path))
    tmp = tmp_name(path)
    want = _mode_for(path) if mode is None else mode
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        try:
            view = memoryview(data)
            while view:
                n = os.write(fd, view)
                view = view[n:]
            os.fchmod(fd, want)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, OSError) and not e.filename:
            e.filename = str(path)  # os.write/fsync errors name no file: say which one failed
        raise
    fsync_dir(path.parent)
    return path


def write_text(path: str | os.PathLike, text: str, *, encoding: str = "utf-8", mode: int | None = None) -> Path:
    return write_bytes(path, text.encode(encoding), mode=mode)


def write_json(path: str | os.PathLike, obj, *, indent: int | None = 1, sort_keys: bool = False,
               default=None, newline: bool = True, mode: int | None = None) -> Path:
    """``obj`` as JSON; serialised before anything touches the disk, so an unserialisable value
    never leaves even a temporary file."""
    text = json.dumps(obj, indent=indent, sort_keys=sort_keys, default=default)
    return write_text(path, text + ("\n" if newline else ""), mode=mode)


def make_dirs(path: str | os.PathLike) -> Path:
    """``mkdir -p`` with the umask's mode (0777 minus umask; ``tempfile.mkdtemp`` gives 0700)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    return path


def clean_leftovers(folder: str | os.PathLike, *, keep_pids: bool = True) -> list[Path]:
    """Remove what interrupted writes left in ``folder`` (temporary files and folders). With
    ``keep_pids`` the leftovers of processes still alive are kept (they may be writing now)."""
    import shutil

    folder = Path(folder)
    removed = []
    try:
        entries = list(folder.iterdir())
    except OSError:
        return removed
    for p in entries:
        if not is_leftover(p.name):
            continue
        pid = _pid_of(p.name)
        if keep_pids and pid is not None and pid != os.getpid() and _alive(pid):
            continue
        try:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
            removed.append(p)
        except OSError:
            pass
    return removed


def _pid_of(name: str) -> int | None:
    m = re.search(r"\.(?:tmp|old)-([0-9]+)(?:-|$)", name)  # a mkdtemp suffix ("k3j_x9") has no pid
    return int(m.group(1)) if m else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def check_writable(folder: str | os.PathLike, what: str = "folder") -> None:
    """Create ``folder`` if needed and prove a file can be written and removed there, before any
    work whose result would go there. Raises ``NotWritable`` with a one-line message."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = tmp_name(folder / ".harness-write-probe")
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, b"x" * 4096)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise NotWritable(f"{what} {folder} is not writable: {e.strerror or e}") from None


class NotWritable(OSError):
    """An output folder that cannot take this command's files (``str()``: one line). An OSError,
    so that every handler of disk errors also handles this early, clearer form of one."""


@contextlib.contextmanager
def locked(path: str | os.PathLike):
    """Hold an exclusive lock for a read-modify-write of ``path`` (load, change, write back): two
    processes doing it at once would each write their own change over the other's (eight concurrent
    ``harness quarantine add`` kept one entry, issue #49). The lock is ``flock`` on a sibling
    ``.<name>.lock`` (the file itself is replaced by every write, so it cannot hold the lock); it is
    released when the block ends or the process dies. Where ``flock`` is missing, no lock."""
    target = Path(path)
    if target.is_symlink():
        target = Path(os.path.realpath(target))
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield
        return
    lock = target.with_name(f".{target.name}.lock")
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o666 & ~_umask())
    except OSError:  # a folder we cannot write: nothing will be written there either, the write says why
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the flock
