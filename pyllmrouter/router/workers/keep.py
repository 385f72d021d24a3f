"""Prompt states kept across eviction: files of llama-server's slot save, per model identity.

    unload (evict, unload, ttl) ──▶ worker saves each busy slot (llama-server's slot save task)
                                    into dir_for(identity) ──▶ Unloaded(kept files)
        add(identity, files) ──▶ counted in RAM; over the RAM budget the least recently
                                 used files move to the disk directory; over its cap
                                 (or without one) they are deleted
    load ──▶ prepare(identity): its files back in the RAM directory ──▶ LoadModel(restore)
             worker restores each into its slot (llama-server's slot restore task)
        consumed(identity, ...) ──▶ the files are deleted: the state lives in the KV now;
                                    a file llama.cpp refused is counted as discarded

A file is checked before it is offered (its size and CRC-32 as saved, kept in a
sidecar ``.meta``): llama.cpp asserts on a truncated state, so a damaged file is
discarded with a warning, never loaded.  A state is tied to its identity: a hash of
the model's name, the identity of every file its load reads (shards, projector, draft,
adapters...), the whole spec (every llama-server argument: context, slots, cache types,
rope settings, overrides...) and llama.cpp's LLAMA_ARG_* environment, so it is only
ever offered to the very configuration that wrote it.  The RAM directory is
a tmpfs (/dev/shm) where there is one: its bytes are host memory, which admission
counts as held.  Only the router writes there (its own slot save and restore calls,
never a client's: see engine/slots.py).  The directory is this router's while it runs:
its ``.owner`` file is locked (flock) for the router's life, so the lock goes with the
process however it ends, and a router that starts removes every directory whose lock
is free (a router that crashed or was killed), never a live one's; close() removes it,
or a finalizer at the interpreter's exit where close() never ran (ramdir.py).

Another local user has no way in.  The disk directory (``--kv-keep-dir``) must be the
router user's own and writable by nobody else, or the router refuses to start (naming
it, its owner and its mode); one it makes is 0700.  Only our own plain files in our own
subdirectories are indexed (a link, a FIFO or another user's file is left alone), files
are opened without following links, and every file the store writes is written under a
temporary name and renamed (a link planted at the final name is replaced, never
followed).  The RAM the states take never passes ``--kv-keep-ram``: an unload reserves
what is left of it before its worker writes (``reserve``: counted as held at once), and
the worker saves a slot only where its state's size, known before it is written, fits;
a load restores the states from where they lie (RAM or disk), moving nothing back.  The store does file I/O under its own lock only, never under
the scheduler's; what the scheduler reads under its lock (``held_ram``) is a
number the store publishes after each change, read without the store's lock,
so the scheduler never waits on the store's file work.
"""

from __future__ import annotations

import errno
import hashlib
import itertools
import json
import logging
import os
import shutil
import stat
import threading
import time
import weakref
import zlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import BinaryIO, Callable, Mapping

from pyllmrouter.memory import files_of, llama_args
from pyllmrouter.router import home
from pyllmrouter.router.workers.ramdir import claim, ours, ram_base, reclaim, remove
from pyllmrouter.router.policy.replicas import SEPARATOR
from pyllmrouter.spec import ModelSpec

__all__ = ["KeepStore", "Kept", "identity", "reclaim"]

_LOG = logging.getLogger(__name__)
# kept states are conversations' tokens: readable by the user who runs the router only
_DIR_MODE, _FILE_MODE = 0o700, 0o600


def _trusted(path: Path, what: str) -> None:
    """``path`` made where it is missing (0700), or ValueError where it is not a directory
    of ours that nobody else may write."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.mkdir(path, _DIR_MODE)
        except FileExistsError:
            pass
        st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"{what} {path} is not a directory (a link or a file is not used for kept states)")
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        try:
            import pwd  # noqa: PLC0415 - its owner's name, for the message
            owner = pwd.getpwuid(st.st_uid).pw_name
        except (ImportError, KeyError):
            owner = str(st.st_uid)
        raise ValueError(f"{what} {path} belongs to {owner} with mode {stat.S_IMODE(st.st_mode):04o}: kept states "
                         f"are conversations' tokens, and their directory must be the router user's own and "
                         f"writable by nobody else (chmod 0700, or another directory)")


def _safe_subdir(parent: Path, name: str) -> Path | None:
    """``parent/name``, a directory of ours nobody else may write (made 0700 where missing);
    None where something else holds the name."""
    d = parent / name
    try:
        os.mkdir(d, _DIR_MODE)
    except FileExistsError:
        pass
    except OSError:
        return None
    try:
        st = os.lstat(d)
    except OSError:
        return None
    ok = stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o022
    return d if ok else None


def _write_new(path: Path, data: bytes) -> None:
    """``data`` as ``path`` (``_replace_with``)."""
    _replace_with(path, lambda f: f.write(data))


def _replace_with(path: Path, fill: Callable[[BinaryIO], object]) -> None:
    """``path`` as ``fill`` writes it: written under a temporary name (never a link's target)
    and renamed over it (a link at ``path`` is replaced, not followed); nothing left of a
    write that fails."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, _FILE_MODE)
    try:
        with os.fdopen(fd, "wb") as f:
            fill(f)
        os.rename(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _move_file(src: Path, dst: Path) -> None:
    """``src`` (a plain file, not followed if a link) to ``dst``: renamed where both are on
    one file system, else copied under a temporary name and renamed; ``src`` removed."""
    try:
        os.rename(src, dst)  # never follows a link at dst: it replaces the entry
        return
    except OSError as e:
        if e.errno != errno.EXDEV:
            raise
    with os.fdopen(os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb") as r:
        _replace_with(dst, lambda w: shutil.copyfileobj(r, w, 1 << 22))
    os.unlink(src)


def identity(name: str, spec: ModelSpec, env: Mapping[str, str] | None = None) -> str | None:
    """The configuration a kept state belongs to: the model's name, every file a load of
    it reads (each shard, and the projector, draft, adapters... its arguments name: path,
    size, mtime, inode), the whole spec (every llama-server argument) and the arguments
    llama.cpp takes from the environment (``env``: the workers', this process's by
    default; LLAMA_ARG_*).  None if the model's file cannot be read: nothing is kept for
    it.  Two models over one file never share a directory, and a state written by one
    configuration is never offered to another, after a restart too."""
    env = os.environ if env is None else env
    files = files_of(spec, env)
    if files[0][1] is None:
        return None
    ident = {"name": name, "files": files, "spec": spec.to_dict(), "env": llama_args(env)}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:24]


@dataclass(frozen=True)
class Kept:
    identity: str
    name: str  # file name (one slot's state), the same in either place
    tokens: int
    size: int
    place: str  # "ram" | "disk"
    used: float  # when it was saved (monotonic)
    crc: int = 0  # CRC-32 of the file as saved


def _page_of(directory: Path) -> int:
    """The unit ``directory``'s file system allocates files in (a tmpfs: the memory page)."""
    try:
        return max(1, os.statvfs(directory).f_frsize)
    except OSError:
        return 4096


def _pages(size: int, page: int) -> int:
    return -(-size // page) * page


def _crc(path: Path) -> int:
    """The CRC-32 of a plain file of ours (OSError for a link, or another user's file)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            raise OSError(f"{path} is not a plain file of ours")
        crc = 0
        while block := f.read(1 << 22):
            crc = zlib.crc32(block, crc)
    return crc


class KeepStore:
    def __init__(self, ram_budget: int, disk_dir: str | os.PathLike | None = None, disk_budget: int = 0,
                 ram_dir: str | os.PathLike | None = None, page: int | None = None, sidecar: int = 256):
        """ValueError where ``disk_dir`` (or ``ram_dir``) is not a directory of ours that
        nobody else may write.  ``page``: what the RAM directory's file system allocates a
        file in (None: as it says); ``sidecar``: the most a state's .meta takes."""
        self.ram_budget = max(0, ram_budget)
        self.disk_budget = max(0, disk_budget) if disk_dir else 0
        self._lock = threading.Lock()
        self._files: dict[tuple[str, str], Kept] = {}  # (identity, name) -> where and how big
        self._models: dict[str, str] = {}  # identity -> the model's name
        self._reserved: dict[int, int] = {}  # unloads under way: RAM held for the states they write
        self._res_lock = threading.Lock()  # guards _reserved alone: taken under the scheduler's lock, never waits on files
        self._reservations = itertools.count(1)
        self._ram_bytes = 0  # the RAM files' and reservations' bytes, published by _settle
        self._ram_files = 0  # the RAM files' bytes alone, published by _settle
        self.version = 0  # bumped when states are written into RAM (the scheduler's Book.mark)
        self._snapshot: dict = {"models": {}, "counters": {}}  # what report() returns, published by _settle
        self.counters = {"saved": 0, "restores": 0, "restored_tokens": 0, "hits": 0, "discarded": 0, "dropped": 0}
        self._owner: int | None = None  # the fd holding our RAM directory's lock
        self._closed = False
        self.disk_dir = Path(disk_dir) if disk_dir else None
        if self.disk_dir is not None:
            _trusted(self.disk_dir, "the kept-state directory (--kv-keep-dir)")
        if ram_dir is not None:
            _trusted(Path(ram_dir), "the kept-state RAM directory")
        else:
            base = ram_base()
            for d in reclaim(base):
                _LOG.info("removed %s: the kept states of a router that no longer runs", d)
            ram_dir, self._owner = claim(base)
        self.ram_dir = Path(ram_dir)
        self.page = page or _page_of(self.ram_dir)  # what the RAM directory's file system charges a file in
        self.sidecar = sidecar
        # the RAM directory goes at close(), or at the interpreter's exit where close() never ran
        self._gone = weakref.finalize(self, remove, self.ram_dir, self._owner, os.getpid())
        home.hold(self)
        if self.disk_dir is not None:
            self._index_disk()
        with self._lock:
            self._settle()

    def _index_disk(self) -> None:
        """States a previous run left on disk, with their sidecars (by identity: safe to
        offer again; checked when offered).  Only our own plain files in our own
        subdirectories: anything else is left alone, never indexed or removed."""
        for sub in sorted(self.disk_dir.iterdir()):
            if _safe_subdir(self.disk_dir, sub.name) != sub:
                continue
            for f in sorted(sub.glob("*.bin")):
                if not ours(f, stat.S_IFREG):
                    continue
                try:
                    fd = os.open(f.with_suffix(".meta"), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                    with os.fdopen(fd) as m:
                        if os.fstat(m.fileno()).st_uid != os.getuid():
                            continue
                        meta = json.loads(m.read())
                    st = os.lstat(f)
                except (OSError, ValueError):
                    f.unlink(missing_ok=True)  # ours, without its sidecar: it cannot be checked
                    continue
                self._files[(sub.name, f.name)] = Kept(sub.name, f.name, meta["tokens"], meta["size"], "disk",
                                                       time.monotonic() - (time.time() - st.st_mtime), meta["crc"])

    def _path(self, k: Kept) -> Path:
        return (self.ram_dir if k.place == "ram" else self.disk_dir) / k.identity / k.name

    def dir_for(self, ident: str, model: str | None = None) -> Path:
        """Where the engine of this identity (of model ``model``) saves its slots (after
        close(): a directory that is not made, so nothing is saved)."""
        d = self.ram_dir / ident
        if not self._closed:
            _safe_subdir(self.ram_dir, ident)
        if model is not None:
            with self._lock:
                self._models[ident] = model
        return d

    def charged(self, size: int) -> int:
        """The RAM a state file of ``size`` bytes takes in the RAM directory, its sidecar
        included: each rounded up to whole pages, as a tmpfs charges them."""
        return _pages(size, self.page) + _pages(self.sidecar, self.page)

    def writable(self, reserved: int, files: int) -> int:
        """The bytes an unload's engine may write in ``files`` state files within ``reserved``
        bytes of RAM (what their pages and sidecars take beyond their sizes set aside)."""
        return max(0, reserved - files * (self.charged(0) + self.page - 1))

    def held_ram(self) -> int:
        """Bytes in RAM, the reservations of unloads under way included, as of the last
        change (no lock: the scheduler reads it under its own)."""
        return self._ram_bytes

    def kept_ram(self) -> int:
        """Bytes of the states written in RAM (what ``spill`` can give back; a reservation
        is an unload's until it ends), as of the last change (no lock)."""
        return self._ram_files

    def _settle(self, token: int | None = None) -> None:
        """Publish the RAM bytes and the report (store lock held, at the end of every change):
        readers take them without the store's lock, so they never wait on its file work.
        ``token``: a reservation whose states are among the files now, given back in the same
        step (never a moment where neither counts)."""
        with self._res_lock:
            if token is not None:
                self._reserved.pop(token, None)
            self._ram_files = sum(self.charged(k.size) for k in self._files.values() if k.place == "ram")
            self._ram_bytes = self._ram_files + sum(self._reserved.values())
        models: dict[str, dict[str, int]] = {}
        for k in self._files.values():
            s = models.setdefault(self._models.get(k.identity, k.identity), {"ram": 0, "disk": 0, "files": 0})
            s[k.place] += k.size
            s["files"] += 1
        self._snapshot = {"enabled": True, "ram_budget": self.ram_budget, "disk_budget": self.disk_budget,
                          "models": models, "counters": dict(self.counters)}

    def _publish_ram(self) -> None:
        with self._res_lock:
            self._ram_bytes = self._ram_files + sum(self._reserved.values())

    def reserve(self, room: int | None = None) -> tuple[int, int]:
        """(token, bytes): the RAM left within the budget, and within ``room`` (what host memory
        the scheduler has for it now), held for an unload's states from now on (counted in
        ``held_ram``) until ``add`` or ``release`` gives the token back.  It takes no lock of
        the store's file work: the scheduler calls it under its own lock."""
        with self._res_lock:
            free = max(0, self.ram_budget - self._ram_bytes) if not self._closed else 0
            if room is not None:
                free = min(free, max(0, room))
            token = next(self._reservations)
            self._reserved[token] = free
            self._ram_bytes += free
            return token, free

    def ram_left(self) -> int:
        """What the RAM budget has left for new states (no lock: a published figure)."""
        return max(0, self.ram_budget - self._ram_bytes) if not self._closed else 0

    def disk_left(self) -> int:
        """What the disk directory's cap has left (0: no directory)."""
        with self._lock:
            used = sum(k.size for k in self._files.values() if k.place == "disk")
            return max(0, self.disk_budget - used) if self.disk_dir is not None and not self._closed else 0

    def disk_dir_for(self, ident: str, model: str | None = None) -> Path:
        """Where an unload saves the states of this identity straight to disk (RAM is short)."""
        d = _safe_subdir(self.disk_dir, ident) or self.disk_dir / ident
        if model is not None:
            with self._lock:
                self._models[ident] = model
        return d

    def release(self, token: int | None, ident: str | None = None, place: str = "ram") -> None:
        """An unload's reservation given back (its states were not saved); what its engine
        wrote in ``ident``'s directory (in ``place``) and nobody indexed (a worker that died,
        or timed out, mid-save leaves a part of a file) goes with it."""
        with self._res_lock:
            self._reserved.pop(token, None)
        self._publish_ram()
        base = self.ram_dir if place == "ram" else self.disk_dir
        with self._lock:
            if ident is not None and base is not None and not self._closed:
                for path in (base / ident).glob("*"):
                    if (ident, path.name) not in self._files and (ident, path.with_suffix(".bin").name) \
                            not in self._files and ours(path, stat.S_IFREG):
                        path.unlink(missing_ok=True)
            self._settle()

    def add(self, ident: str, files: list[tuple[str, int, int]], token: int | None = None, place: str = "ram") -> None:
        """Slot files the engine of ``ident`` saved in dir_for(ident) (``place`` "disk":
        disk_dir_for(ident)): (name, tokens, bytes); ``token``: the reservation they were
        written within, given back."""
        now = time.monotonic()
        checked = []
        base = self.ram_dir if place == "ram" else self.disk_dir
        for name, tokens, size in files:  # read back before the lock: the files are the engine's new ones
            path = base / ident / name
            try:
                os.chmod(path, _FILE_MODE, follow_symlinks=False)  # a conversation's tokens: the user's alone
                crc = _crc(path)
                _write_new(path.with_suffix(".meta"), json.dumps({"tokens": tokens, "size": size, "crc": crc}).encode())
            except (OSError, NotImplementedError) as e:
                _LOG.warning("kept state %s of %s cannot be read back: %s", name, ident, e)
                continue
            checked.append(Kept(ident, name, tokens, size, place, now, crc))
        with self._lock:
            if self._closed:
                self._settle(token)
                return
            for k in checked:
                old = self._files.pop((ident, k.name), None)
                if old is not None and old.place != k.place:  # the new one took its name where it lay
                    self._unlink(old)
                self._files[(ident, k.name)] = k
                self.counters["saved"] += 1
            self.version += 1
            self._enforce()
            self._settle(token)

    def prepare(self, ident: str) -> list[str]:
        """The files of ``ident`` for the engine to restore, as paths where they lie (RAM or
        disk: none is moved, so a load never passes the RAM budget, and one that fails leaves
        them where they were), each checked first."""
        with self._lock:
            paths = []
            for _, k in sorted(self._files.items(), key=lambda kv: kv[0][1]):
                if k.identity != ident:
                    continue
                path = self._path(k)
                try:
                    intact = os.lstat(path).st_size == k.size and _crc(path) == k.crc
                except OSError:
                    intact = False
                if not intact:  # llama.cpp would assert on it: never offered
                    _LOG.warning("kept state %s of %s is damaged (size or checksum): discarded", k.name, ident)
                    self._drop(k, "discarded")
                    continue
                paths.append(str(path))
            self._settle()
            return paths

    def consumed(self, ident: str, paths: list[str], restored: dict[str, int], refused: dict[str, str]) -> None:
        """After a load: ``restored`` (file name -> tokens) live in the KV now, ``refused``
        (file name -> llama.cpp's reason) were not usable; either way the files go."""
        with self._lock:
            for path in paths:
                name = os.path.basename(path)
                k = self._files.get((ident, name))
                if k is None:
                    continue
                if name in restored:
                    self.counters["restores"] += 1
                    self.counters["restored_tokens"] += restored[name]
                    self._drop(k, None)
                else:
                    _LOG.warning("kept state %s of %s discarded: %s", name, ident, refused.get(name, "not restored"))
                    self._drop(k, "discarded")
            self._settle()

    def hit(self, n: int) -> None:
        """``n`` restored states served a request from their cache (counted by the worker
        from llama-server's timings, reported when their model leaves)."""
        with self._lock:
            self.counters["hits"] += n
            self._settle()

    def forget(self, model: str) -> None:
        """Every state of ``model`` and of its instances (``model#k``) goes (it left the
        router's list: no one can use them)."""
        def its(name: str | None) -> bool:
            return name is not None and (name == model or name.startswith(model + SEPARATOR))
        with self._lock:
            for k in [k for k in self._files.values() if its(self._models.get(k.identity))]:
                self._drop(k, "dropped")
            self._settle()

    def status(self) -> dict[str, dict[str, int]]:
        """Per identity: bytes kept in RAM and on disk, and files."""
        out: dict[str, dict[str, int]] = {}
        with self._lock:
            for k in self._files.values():
                s = out.setdefault(k.identity, {"ram": 0, "disk": 0, "files": 0})
                s[k.place] += k.size
                s["files"] += 1
        return out

    def spill(self) -> None:
        """Make room in host memory: every state in RAM goes to the disk directory (or is
        dropped), least recently saved first."""
        with self._lock:
            self._enforce(ram_budget=0)
            self._settle()

    def report(self) -> dict:
        """Per model, bytes in RAM and on disk and files; the budgets and counters: the
        snapshot published after the last change (never waits on the store's file work)."""
        return self._snapshot

    def close(self) -> None:
        """The RAM directory goes (its states are lost), and its lock; the disk directory stays.
        In a fork's child: nothing goes (the directory is the parent's)."""
        with self._lock:
            self._closed = True
            self._gone()  # once: a later fork's child has no lock to let go
            self._owner = None
            self._files = {key: k for key, k in self._files.items() if k.place == "disk"}
            self._settle()

    def let_go(self) -> None:
        """In a fork's child: its copy of the lock's descriptor closed (the parent still holds
        the lock; router/home.py)."""
        if self._owner is not None:
            os.close(self._owner)
            self._owner = None

    # -- lock held ---------------------------------------------------------------

    def _enforce(self, ram_budget: int | None = None) -> None:
        """RAM within its budget (least recently saved first to disk, or dropped); disk
        within its cap (least recently saved first dropped)."""
        budget = self.ram_budget if ram_budget is None else ram_budget
        ram = sorted((k for k in self._files.values() if k.place == "ram"), key=lambda k: k.used)
        total = sum(self.charged(k.size) for k in ram)
        for k in ram:
            if total <= budget:
                break
            total -= self.charged(k.size)
            if self.disk_dir is not None and k.size <= self.disk_budget:
                try:
                    self._move(k, self.disk_dir)
                    self._files[(k.identity, k.name)] = replace(k, place="disk")
                    continue
                except OSError as e:
                    _LOG.warning("kept state %s cannot go to disk: %s", k.name, e)
            self._drop(k, "dropped")
        disk = sorted((k for k in self._files.values() if k.place == "disk"), key=lambda k: k.used)
        total = sum(k.size for k in disk)
        for k in disk:
            if total <= self.disk_budget:
                break
            total -= k.size
            self._drop(k, "dropped")

    def _drop(self, k: Kept, counter: str | None) -> None:
        self._files.pop((k.identity, k.name), None)
        self._unlink(k)
        if counter:
            self.counters[counter] += 1

    def _move(self, k: Kept, base: Path) -> None:
        """The file and its sidecar into ``base``'s directory of their identity (ours, made
        0700 where missing; OSError where something else holds its name)."""
        directory = _safe_subdir(base, k.identity)
        if directory is None:
            raise OSError(f"{base / k.identity} is not a directory of ours")
        path = self._path(k)
        _move_file(path, directory / k.name)
        meta = path.with_suffix(".meta")
        if os.path.lexists(meta):
            _move_file(meta, directory / (Path(k.name).stem + ".meta"))

    def _unlink(self, k: Kept) -> None:
        for p in (self._path(k), self._path(k).with_suffix(".meta")):
            try:
                p.unlink()
            except OSError:
                pass
