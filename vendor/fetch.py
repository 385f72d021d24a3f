#!/usr/bin/env python3
"""The pinned llama.cpp that pyllmrouter compiles against, fetched and checked.

``pin.json`` beside this file names one llama-cpp-python release, the sha256 of
its source distribution, and the sha256 of each llama.cpp header we compile
against that the wheel does not install.  Nothing of llama.cpp is committed:
the sdist is downloaded through pip into the cache directory and verified.

    fetch.py sdist                 print the path of the verified sdist
    fetch.py header --out DIR      extract the pinned headers into DIR (flat)
    fetch.py source [--out DIR] [--complete]
                                   extract the llama.cpp tree into DIR (default: the
                                   cache's llama.cpp-src) and print DIR; --complete: from
                                   the whole sdist (llama.cpp's own programs need it)
    fetch.py trimmed [--out FILE]  print the path of (writing it first, from the sdist,
                                   if need be) the trimmed sdist: without what a CUDA/CPU
                                   build of llama-cpp-python, this package's extension and
                                   llama.cpp's llama-server and rpc-server never read (docs,
                                   vocab files, other GPU backends, tests, the web page's
                                   sources, media...); 4 MB, not 76
    fetch.py locate                check the installed llama-cpp-python against
                                   the pin; print "VERSION;SITE_PACKAGES;LIB_DIR"

The trimmed sdist is written deterministically and checked by the digest of its
contents (``trimmed_contents_sha256``: every member's name, type and bytes, in
order; the tar and gzip encodings aside), so where the whole sdist cannot be
downloaded (a machine with no route to PyPI) a trimmed one copied into the
cache builds the wheel and the extension, verified all the same.

The cache is ``$PYLLMROUTER_CACHE`` or ``~/.cache/pyllmrouter``.  Stdlib only:
this runs inside CMake's configure step.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

PIN = json.loads((Path(__file__).with_name("pin.json")).read_text())


def cache_dir() -> Path:
    root = os.environ.get("PYLLMROUTER_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "pyllmrouter")
    return Path(root)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def sdist() -> Path:
    """The pinned sdist in the cache, downloaded through pip when missing or wrong."""
    target = cache_dir() / "sdist"
    path = target / PIN["sdist"]
    if path.exists() and sha256(path) == PIN["sdist_sha256"]:
        return path
    target.mkdir(parents=True, exist_ok=True)
    spec = f"{PIN['package']}=={PIN['version']}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           "--no-build-isolation", "-d", str(target), spec]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0 or not path.exists():
        sys.exit(f"pyllmrouter: could not download {spec} through pip:\n{proc.stdout[-2000:]}")
    got = sha256(path)
    if got != PIN["sdist_sha256"]:
        path.unlink()
        sys.exit(f"pyllmrouter: {path.name} has sha256 {got}, pin.json expects {PIN['sdist_sha256']}")
    return path


def _member(tar: tarfile.TarFile, relative: str) -> tarfile.TarInfo:
    root = PIN["sdist"].removesuffix(".tar.gz")
    return tar.getmember(f"{root}/{relative}")


def _trimmed_path() -> Path:
    return cache_dir() / "trimmed" / PIN["sdist"]


def contents_sha256(path: Path) -> str:
    """The digest of an archive's contents: each member's name, type and data, in order."""
    h = hashlib.sha256()
    with tarfile.open(path) as tar:
        for m in tar:
            h.update(f"{m.name}\0{m.type.decode()}\0{m.size if m.isfile() else 0}\0".encode())
            if m.isfile():
                h.update(tar.extractfile(m).read())
    return h.hexdigest()


def _trimmed_ok(path: Path) -> bool:
    try:
        return path.exists() and contents_sha256(path) == PIN["trimmed_contents_sha256"]
    except (tarfile.TarError, OSError, EOFError):
        return False


def archive(complete: bool = False) -> tuple[Path, str]:
    """A verified archive of the pinned source and its identity: the whole sdist when it is
    in the cache (or ``complete`` is asked: downloaded), else a verified trimmed one in the
    cache, else the whole sdist downloaded."""
    full = cache_dir() / "sdist" / PIN["sdist"]
    if not complete and not (full.exists() and sha256(full) == PIN["sdist_sha256"]):
        trimmed_path = _trimmed_path()
        if _trimmed_ok(trimmed_path):
            return trimmed_path, "trimmed " + PIN["trimmed_contents_sha256"]
    return sdist(), PIN["sdist_sha256"]


def headers(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive()[0]) as tar:
        for relative, digest in PIN["headers"].items():
            data = tar.extractfile(_member(tar, relative)).read()
            got = hashlib.sha256(data).hexdigest()
            if got != digest:
                sys.exit(f"pyllmrouter: {relative} in the sdist has sha256 {got}, pin.json expects {digest}")
            (out / Path(relative).name).write_bytes(data)


def source(out: Path, complete: bool = False) -> None:
    """Extract vendor/llama.cpp of the sdist into OUT (once; a stamp marks completion and
    says from which archive: a tree from the trimmed one serves only where ``complete`` is
    not asked)."""
    stamp = out / ".pyllmrouter-sdist-sha256"
    done = stamp.read_text() if stamp.exists() else ""
    if done == PIN["sdist_sha256"] or (done == "trimmed " + PIN["trimmed_contents_sha256"] and not complete):
        return
    path, identity = archive(complete)
    out.mkdir(parents=True, exist_ok=True)
    root = PIN["sdist"].removesuffix(".tar.gz") + "/vendor/llama.cpp/"
    with tarfile.open(path) as tar:
        members = []
        for m in tar.getmembers():
            if m.name.startswith(root) and (m.isfile() or m.isdir()):
                m.name = m.name[len(root):]
                members.append(m)
        try:
            tar.extractall(out, members=members, filter="data")
        except TypeError:  # Python before 3.11.4 / 3.10.12: no extraction filters
            tar.extractall(out, members=members)
    stamp.write_text(identity)


# Paths under vendor/llama.cpp that a llama-cpp-python build (CPU, CUDA, RPC), this package's
# extension (common, tools/server, tools/mtmd) and llama.cpp's own programs (llama-server,
# rpc-server: the peer the benchmarks measure against, built offline on a GPU machine) never
# read.
TRIM = (
    "docs/", "models/", "media/", ".github/", "gguf-py/", "benches/", "tests/", "examples/", "pocs/",
    "conversion/", "grammars/", "requirements/", "skills/", "app/", "ci/", "licenses/",
    "ggml/src/ggml-cann/", "ggml/src/ggml-et/", "ggml/src/ggml-hexagon/", "ggml/src/ggml-metal/",
    "ggml/src/ggml-musa/", "ggml/src/ggml-opencl/", "ggml/src/ggml-openvino/", "ggml/src/ggml-sycl/",
    "ggml/src/ggml-virtgpu/", "ggml/src/ggml-vulkan/", "ggml/src/ggml-webgpu/", "ggml/src/ggml-zdnn/",
    "ggml/src/ggml-zendnn/", "tools/server/tests/", "tools/server/bench/",
)
# Of scripts/, what the programs' CMake runs; of tools/ui/ (the web page's sources: llama-server
# is built without it, LLAMA_BUILD_UI off), what its CMake reads.
KEEP_SCRIPTS = ("scripts/ui-assets.cmake",)
KEEP_UI = ("tools/ui/CMakeLists.txt", "tools/ui/sources.cmake", "tools/ui/ui.cpp.in", "tools/ui/ui.h.in")
MEDIA = (".mp4", ".jpg", ".jpeg", ".png", ".wav", ".mp3", ".gif", ".webp")


def _keep(name: str) -> bool:
    root = PIN["sdist"].removesuffix(".tar.gz") + "/"
    llama = root + "vendor/llama.cpp/"
    if name + "/" == llama:
        return True
    if not name.startswith(llama):
        return not any(name.startswith(root + d) for d in ("docs/", "examples/", ".git/", "tests/"))
    rel = name[len(llama):]
    if rel.startswith("scripts/"):
        return rel == "scripts" or rel in KEEP_SCRIPTS
    if rel.startswith("tools/ui/"):
        return rel in KEEP_UI
    if rel.startswith("tools/") and rel.endswith(MEDIA):
        return False
    return not any(rel.startswith(t) for t in TRIM)


def trimmed(out: Path | None = None) -> Path:
    """The trimmed sdist at ``out`` (default: the cache's), written from the whole one unless
    a verified one is there already; its contents are checked against the pin."""
    out = out or _trimmed_path()
    if _trimmed_ok(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    # deterministic: members in the sdist's order with their own metadata, no gzip timestamp
    with tarfile.open(sdist()) as src, open(tmp, "wb") as raw, \
            gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz, \
            tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as dst:
        for m in src.getmembers():
            if _keep(m.name):
                dst.addfile(m, src.extractfile(m) if m.isfile() else None)
    got = contents_sha256(tmp)
    if got != PIN["trimmed_contents_sha256"]:
        tmp.unlink()
        sys.exit(f"pyllmrouter: the trimmed sdist's contents have sha256 {got}, pin.json expects "
                 f"{PIN['trimmed_contents_sha256']}")
    os.replace(tmp, out)
    return out


def locate() -> str:
    """Version, site-packages and library directory of the installed llama-cpp-python."""
    try:
        version = importlib.metadata.version(PIN["package"])
    except importlib.metadata.PackageNotFoundError:
        sys.exit(f"pyllmrouter: {PIN['package']} is not installed; install {PIN['package']}=={PIN['version']} "
                 "first (see README: scripts/setup.sh does it)")
    if version != PIN["version"]:
        sys.exit(f"pyllmrouter: built against {PIN['package']} {version}, but this source pins "
                 f"{PIN['version']} (vendor/pin.json); install {PIN['package']}=={PIN['version']}")
    spec = importlib.util.find_spec("llama_cpp")
    pkg = Path(spec.origin).parent
    return f"{version};{pkg.parent};{pkg / 'lib'}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["sdist", "header", "source", "trimmed", "locate"])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--complete", action="store_true", help="source: from the whole sdist")
    args = parser.parse_args()
    if args.what == "header" and args.out is None:
        parser.error("--out is required")
    if args.what == "sdist":
        print(sdist())
    elif args.what == "header":
        headers(args.out)
    elif args.what == "source":
        out = args.out or cache_dir() / "llama.cpp-src"
        source(out, args.complete)
        print(out)
    elif args.what == "trimmed":
        print(trimmed(args.out))
    else:
        print(locate())


if __name__ == "__main__":
    main()
