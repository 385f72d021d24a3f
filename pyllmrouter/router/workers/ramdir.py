"""The kept-state store's RAM directory: claimed, locked for its router's life, removed.

    claim() ──▶ .pyllmrouter-kv-new-XXXX, its .owner locked (flock) ──rename──▶ pyllmrouter-kv-XXXX
    remove() ──▶ at the store's close(), or by a finalizer at the interpreter's exit where
                 close() never ran; in the process that claimed it only (a fork's child: nothing)
    reclaim() ──▶ at a store's start: every directory whose lock is free (its router crashed
                  or was killed) removed, never a live one's
"""

from __future__ import annotations

import fcntl
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path

__all__ = ["claim", "ours", "ram_base", "reclaim", "remove"]

_PREFIX = "pyllmrouter-kv-"  # a RAM directory in use, its .owner locked
_NEW = ".pyllmrouter-kv-new-"  # one being made (renamed to _PREFIX once locked)
_OWNER = ".owner"
_FILE_MODE = 0o600  # its owner file: the router user's alone


def ram_base() -> Path | None:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else None


def claim(base: Path | None) -> tuple[Path, int]:
    """A new RAM directory and the fd that holds its lock: made under a temporary name,
    its ``.owner`` locked, then renamed, so a directory under the final name is never
    seen unlocked while its router lives."""
    tmp = Path(tempfile.mkdtemp(prefix=_NEW, dir=base))
    fd = os.open(tmp / _OWNER, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, _FILE_MODE)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, f"{os.getpid()}\n".encode())
    final = tmp.with_name(_PREFIX + tmp.name.removeprefix(_NEW))
    os.rename(tmp, final)
    return final, fd


def remove(ram_dir: Path, owner: int | None, pid: int) -> None:
    """The RAM directory removed and its lock let go, by the process that made them only
    (a fork's child has neither to remove)."""
    if os.getpid() == pid:
        shutil.rmtree(ram_dir, ignore_errors=True)
        if owner is not None:
            os.close(owner)


def ours(path: Path, kind: int) -> bool:
    """``path`` itself (not a link to it) is of ``kind`` (stat.S_IFDIR, S_IFREG) and ours."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_IFMT(st.st_mode) == kind and st.st_uid == os.getuid()


def reclaim(base: Path | None = None, grace: float = 60.0) -> list[Path]:
    """Remove the RAM directories of routers that no longer run (``base``: /dev/shm, or the
    temporary directory where it is missing): those whose ``.owner`` lock is free, and
    half-made ones older than ``grace`` seconds.  A live router's lock is held: its
    directory is left alone.  Only our own directories are looked at, and an ``.owner``
    that is not a plain file of ours (a FIFO, a link, another user's) is never opened for
    long or trusted: another local user cannot make a starting router wait or remove
    what it should not.  The directories removed."""
    base = Path(base) if base is not None else (ram_base() or Path(tempfile.gettempdir()))
    gone = []
    for d in [*base.glob(_PREFIX + "*"), *base.glob(_NEW + "*")]:
        if not ours(d, stat.S_IFDIR):
            continue
        if d.name.startswith(_NEW):  # one being made: its owner locks, then renames it
            try:
                if time.time() - os.lstat(d).st_mtime < grace:
                    continue
            except OSError:
                continue
        try:  # O_NONBLOCK: a FIFO would block an open; O_NOFOLLOW: not a link's target
            fd = os.open(d / _OWNER, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:  # none: a router's from before owner files, or a half-made one
            shutil.rmtree(d, ignore_errors=True)
            gone.append(d)
            continue
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                continue  # not an owner file of ours: left alone
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its router is running
            shutil.rmtree(d, ignore_errors=True)
            gone.append(d)
        finally:
            os.close(fd)
    return gone
