"""GGUF files on a hub, known from their headers alone: llama-server's -hf, without the download.

    plan(hf_repo, hf_file, ...)  ──▶ the repository's files (GET api/models/{repo}/refs, tree)
                                 ──▶ the files llama-server would take: the quant's model (every
                                     part of a split one), its projector, a draft's model
    head(file)                   ──▶ the file's header and tensor table, read with HTTP Range
                                     requests as far as they go (a hub that ignores Range: its
                                     body read only as far as that, then closed); cached by
                                     the file's oid (or ETag) under cache_dir()/hub/heads
    stand_ins(files, heads, dir) ──▶ one local file per hub file, of its full size: its head
                                     written at offset 0, the rest a sparse hole

A stand-in is probed as any file is (engine/probe.py): llama.cpp plans a ``no_alloc`` load
from the header and tensor table alone and never reads the weights, so its figures are
those of the downloaded file, to the byte.  The choice of files is llama.cpp's
(common/download.cpp: common_download_split_repo_tag, find_best_model, get_split_files,
find_best_mmproj), followed here so that the router process, which never loads llama.cpp,
can make it too; the endpoint and token are llama.cpp's variables (MODEL_ENDPOINT, then
HF_ENDPOINT; HF_TOKEN).  Nothing is written to llama.cpp's cache.

Only the HTTP requests and the cache touch the outside; the rest are pure functions.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from pyllmrouter import gguf_header

__all__ = ["HubError", "HubFile", "HubPlan", "HubHead", "endpoint", "split_repo_tag", "split_info", "best_model",
           "split_parts", "best_mmproj", "quants", "list_files", "plan", "head", "stand_ins", "FIRST_READ"]

DEFAULT_ENDPOINT = "https://huggingface.co/"
FIRST_READ = 1 << 16  # bytes of a file's first Range request; a longer header doubles the read
TIMEOUT = 60.0  # seconds a hub may take to answer one request (a short-lived checking process lowers it)


class HubError(ValueError):
    """A hub reference that cannot be read: the message names the repository or file and why."""


@dataclass(frozen=True)
class HubFile:
    repo: str
    path: str  # in the repository
    size: int
    oid: str  # the LFS oid (its content's sha256) or the git oid: the head cache's key
    url: str

    @property
    def name(self) -> str:
        return f"{self.repo}/{self.path}"


@dataclass(frozen=True)
class HubPlan:
    """The files llama-server would take for a -hf reference (nothing: none of that kind)."""

    model: tuple[HubFile, ...]  # the primary first, then the other parts of a split model
    mmproj: HubFile | None = None
    draft: tuple[HubFile, ...] = ()

    @property
    def files(self) -> tuple[HubFile, ...]:
        return (*self.model, *((self.mmproj,) if self.mmproj else ()), *self.draft)


@dataclass(frozen=True)
class HubHead:
    """A file's first bytes, through the end of its tensor table."""

    data: bytes
    size: int  # the whole file's
    read: int = 0  # bytes transferred to get it (0: from the cache)
    cached: bool = False


# -- llama.cpp's names (common/download.cpp) ------------------------------------------

def endpoint(env: Mapping[str, str] = os.environ) -> str:
    """The hub llama.cpp downloads from: MODEL_ENDPOINT, else HF_ENDPOINT, else huggingface.co."""
    e = env.get("MODEL_ENDPOINT") or env.get("HF_ENDPOINT") or DEFAULT_ENDPOINT
    return e if e.endswith("/") else e + "/"


def split_repo_tag(ref: str) -> tuple[str, str]:
    """("org/repo", "quant") of "org/repo[:quant]" (common_download_split_repo_tag)."""
    parts = ref.split(":")
    repo, tag = parts[0], (parts[-1] if len(parts) > 1 else "")
    if len(repo.split("/")) != 2 or not all(repo.split("/")):
        raise HubError(f"{ref!r}: not a hub repository (expected <user>/<model>[:quant])")
    return repo, tag


_SPLIT = re.compile(r"^(.+)-([0-9]{5})-of-([0-9]{5})$", re.IGNORECASE)
_TAG = re.compile(r"[-.]([A-Z0-9_]+)$", re.IGNORECASE)


def split_info(path: str) -> tuple[str, str, int, int] | None:
    """(prefix, TAG, index, count) of a GGUF file's name; None: not a .gguf."""
    if not path.endswith(".gguf"):
        return None
    prefix, index, count = path[:-5], 1, 1
    m = _SPLIT.match(prefix)
    if m:
        prefix, index, count = m[1], int(m[2]), int(m[3])
    t = _TAG.search(prefix)
    return prefix, (t[1].upper() if t else ""), index, count


def _bits(tag: str) -> int:
    digits = re.search(r"[0-9]+", tag)
    return int(digits[0]) if digits else 0


def is_model(path: str) -> bool:
    """A model's GGUF, not a projector, imatrix or draft head (gguf_filename_is_model)."""
    name = path.rsplit("/", 1)[-1]
    return path.endswith(".gguf") and not any(k in name for k in ("mmproj", "imatrix", "mtp-", "eagle3-",
                                                                  "dflash-", "dspark-"))


def _first_part(path: str) -> bool:
    info = split_info(path)
    return info is not None and (info[3] <= 1 or info[2] == 1)


def best_model(files: Sequence[HubFile], tag: str) -> HubFile | None:
    """The file llama-server takes for ``tag`` (find_best_model): the first model file whose
    path has "TAG." or "TAG-" in it (no tag: Q4_K_M, then Q8_0, then the first model)."""
    for t in ([tag] if tag else ["Q4_K_M", "Q8_0"]):
        pattern = re.compile(re.escape(t) + "[.-]", re.IGNORECASE)
        for f in files:
            if is_model(f.path) and pattern.search(f.path) and _first_part(f.path):
                return f
    if not tag:
        return next((f for f in files if is_model(f.path) and _first_part(f.path)), None)
    return None


def split_parts(files: Sequence[HubFile], primary: HubFile) -> tuple[HubFile, ...]:
    """Every part of ``primary``'s split model, the primary first (get_split_files)."""
    prefix, _, _, count = split_info(primary.path) or (primary.path, "", 1, 1)
    if count <= 1:
        return (primary,)
    parts = [f for f in files if (i := split_info(f.path)) and i[0] == prefix and i[3] == count]
    return (primary, *sorted((f for f in parts if f != primary), key=lambda f: f.path))


def best_mmproj(files: Sequence[HubFile], model: str) -> HubFile | None:
    """The projector llama-server takes beside ``model`` (find_best_sibling with "mmproj"):
    the deepest shared directory, then the quantization closest to the model's."""
    model_dirs = model.split("/")[:-1]
    model_bits = _bits((split_info(model) or ("", "", 0, 0))[1])
    best, best_key = None, None
    for f in files:
        if not f.path.endswith(".gguf") or "mmproj" not in f.path:
            continue
        dirs = f.path.split("/")[:-1]
        if dirs != model_dirs[:len(dirs)]:
            continue
        key = (len(dirs), -abs(_bits((split_info(f.path) or ("", "", 0, 0))[1]) - model_bits))
        if best_key is None or key > best_key:
            best, best_key = f, key
    return best


def quants(files: Sequence[HubFile]) -> list[tuple[str, HubFile]]:
    """Every quant of the repository, as (TAG, its primary file), in the listing's order
    (as llama.cpp lists a repository's models: the first part of each tagged model file)."""
    out: dict[str, HubFile] = {}
    for f in files:
        info = split_info(f.path)
        if info and info[1] and info[2] == 1 and is_model(f.path):
            out.setdefault(info[1], f)
    return list(out.items())


# -- the hub (HTTP) ----------------------------------------------------------------

def _request(url: str, token: str | None, headers: Mapping[str, str] | None = None):
    req = urllib.request.Request(url, headers={"User-Agent": "pyllmrouter", **(headers or {})})
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        return urllib.request.urlopen(req, timeout=TIMEOUT)  # noqa: S310 - the hub's URL
    except urllib.error.HTTPError as e:
        raise _http_error(url, e, token) from None
    except (urllib.error.URLError, OSError) as e:
        raise HubError(f"{url}: the hub cannot be reached ({getattr(e, 'reason', e)})") from None


def _http_error(url: str, e: urllib.error.HTTPError, token: str | None) -> HubError:
    try:
        said = json.loads(e.read() or b"{}").get("error", "")
    except (ValueError, AttributeError):
        said = ""
    said = f": {said}" if said else ""
    if e.code in (401, 403):
        how = "the token given was refused" if token else "no token given (HF_TOKEN, or -hft TOKEN)"
        return HubError(f"{url}: access refused (HTTP {e.code}{said}; {how})")
    if e.code == 404:
        return HubError(f"{url}: not found (HTTP 404{said})")
    return HubError(f"{url}: HTTP {e.code}{said}")


def _json(url: str, token: str | None):
    with _request(url, token, {"Accept": "application/json"}) as r:
        try:
            return json.loads(r.read())
        except ValueError:
            raise HubError(f"{url}: the hub's answer is not JSON") from None


def list_files(repo: str, token: str | None, base: str) -> list[HubFile]:
    """The repository's files at its main branch (as llama.cpp's get_repo_files asks)."""
    try:
        refs = _json(f"{base}api/models/{repo}/refs", token)
    except HubError as e:
        if "HTTP 404" in str(e):
            raise HubError(f"{repo}: no such repository on {base} ({e})") from None
        raise
    branches = [b for b in refs.get("branches", []) if isinstance(b, dict) and b.get("targetCommit")]
    branch = next((b for b in branches if b.get("name") == "main"), branches[0] if branches else None)
    if branch is None:
        raise HubError(f"{repo}: the hub lists no branch for it")
    commit = branch["targetCommit"]
    tree = _json(f"{base}api/models/{repo}/tree/{commit}?recursive=true", token)
    out = []
    for item in tree if isinstance(tree, list) else []:
        if not isinstance(item, dict) or item.get("type") != "file" or not isinstance(item.get("path"), str):
            continue
        lfs = item.get("lfs") if isinstance(item.get("lfs"), dict) else {}
        out.append(HubFile(repo, item["path"], int(lfs.get("size", item.get("size", -1))),
                           str(lfs.get("oid") or item.get("oid") or ""), f"{base}{repo}/resolve/{commit}/{item['path']}"))
    return out


def _choose(files: list[HubFile], repo: str, tag: str, hf_file: str) -> HubFile:
    ggufs = ", ".join(f.path for f in files if f.path.endswith(".gguf")) or "none"
    if hf_file:
        found = next((f for f in files if f.path == hf_file), None)
        if found is None:
            raise HubError(f"{repo}: no file {hf_file!r} in the repository (its GGUF files: {ggufs})")
        return found
    found = best_model(files, tag)
    if found is None:
        what = f"no GGUF file of quant {tag!r}" if tag else "no GGUF model file"
        raise HubError(f"{repo}: {what} in the repository (its GGUF files: {ggufs})")
    return found


def plan(hf_repo: str, hf_file: str = "", *, token: str | None = None, base: str | None = None,
         mmproj: bool = True, draft_repo: str = "", draft_file: str = "",
         listing: Mapping[str, list[HubFile]] | None = None) -> HubPlan:
    """The files llama-server takes for ``-hf hf_repo [-hff hf_file]`` (``mmproj``: its
    projector too, where the repository has one; ``draft_repo``: ``-hfd`` [``-md`` file]).
    ``listing``: repositories' files already listed (repo -> files)."""
    base = base or endpoint()
    listed = dict(listing or {})

    def files_of(repo: str) -> list[HubFile]:
        if repo not in listed:
            listed[repo] = list_files(repo, token, base)
        return listed[repo]

    repo, tag = split_repo_tag(hf_repo)
    files = files_of(repo)
    primary = _choose(files, repo, tag, hf_file)
    draft: tuple[HubFile, ...] = ()
    if draft_repo:
        drepo, dtag = split_repo_tag(draft_repo)
        dfiles = files_of(drepo)
        draft = split_parts(dfiles, _choose(dfiles, drepo, dtag, draft_file))
    return HubPlan(split_parts(files, primary), best_mmproj(files, primary.path) if mmproj else None, draft)


def _read_more(url: str, token: str | None, have: int, want: int, stream):
    """(bytes have..want-1 of the file, the open response when the hub ignored Range)."""
    if stream is not None:
        return stream.read(want - have), stream
    r = _request(url, token, {"Range": f"bytes={have}-{want - 1}"})
    if r.status == 206:
        with r:
            return r.read(), None
    if have:  # a hub that honoured one Range and not the next
        r.close()
        raise HubError(f"{url}: the hub answered a Range request with HTTP {r.status}")
    return r.read(want), r  # the whole body is coming: read it only as far as needed


def fetch_head(file: HubFile, token: str | None, first: int = FIRST_READ) -> HubHead:
    """The file's header and tensor table, read from its start as far as they go (a read
    twice as long each time the header goes on)."""
    if file.size <= 0:
        raise HubError(f"{file.name}: the hub gives no size for it")
    buf, stream, want = b"", None, min(first, file.size)
    try:
        while True:
            asked = want - len(buf)
            chunk, stream = _read_more(file.url, token, len(buf), want, stream)
            buf += chunk
            try:
                table_end, _ = gguf_header.extent(buf, file.size, file.name)
                return HubHead(buf[:table_end], file.size, len(buf))
            except gguf_header.HeaderCutShort as e:
                if len(chunk) < asked or len(buf) >= file.size:  # the file ends inside its header
                    raise HubError(f"{file.name}: a truncated GGUF file ({e})") from None
            want = min(len(buf) * 2, file.size)
    except HubError:
        raise
    except ValueError as e:  # not GGUF, a header llama.cpp would refuse
        raise HubError(str(e)) from None
    finally:
        if stream is not None:
            stream.close()


def _cache_key(file: HubFile) -> str:
    return file.oid or hashlib.sha256(file.url.encode()).hexdigest()


def head(file: HubFile, token: str | None, cache: Path | None) -> HubHead:
    """``fetch_head`` through a cache of heads keyed by the file's oid (its content's hash
    on the hub: a new upload is a new key); ``cache`` None: no cache."""
    if cache is not None and file.oid:
        path = cache / f"{_cache_key(file)}.head"
        try:
            data = path.read_bytes()
            size = int(json.loads(path.with_suffix(".json").read_text())["size"])
            return HubHead(data, size, 0, cached=True)
        except (OSError, ValueError, KeyError):
            pass  # not cached (or half written): read it
    got = fetch_head(file, token)
    if cache is not None and file.oid:
        cache.mkdir(parents=True, exist_ok=True)
        tmp = cache / f".{_cache_key(file)}.{os.getpid()}"
        tmp.write_bytes(got.data)
        os.replace(tmp, cache / f"{_cache_key(file)}.head")
        (cache / f"{_cache_key(file)}.json").write_text(json.dumps({"size": got.size, "url": file.url,
                                                                    "name": file.name}))
    return got


def stand_ins(files: Iterable[HubFile], heads: Mapping[HubFile, HubHead], directory: Path) -> dict[HubFile, Path]:
    """One sparse file per hub file under ``directory`` (its repository's folder, its own
    name, so the parts of a split model find each other): its head at offset 0, then a
    hole to its full size."""
    out = {}
    for f in files:
        path = directory / f.repo.replace("/", "--") / f.path
        path.parent.mkdir(parents=True, exist_ok=True)
        h = heads[f]
        with open(path, "wb") as out_file:
            out_file.write(h.data)
            out_file.truncate(h.size)
        out[f] = path
    return out


@dataclass(frozen=True)
class Reading:
    """What reading a plan's heads cost."""

    heads: dict[HubFile, HubHead] = field(default_factory=dict)

    @property
    def bytes_read(self) -> int:
        return sum(h.read for h in self.heads.values())

    @property
    def size(self) -> int:
        return sum(h.size for h in self.heads.values())


def read_heads(files: Iterable[HubFile], token: str | None, cache: Path | None) -> Reading:
    return Reading({f: head(f, token, cache) for f in files})
