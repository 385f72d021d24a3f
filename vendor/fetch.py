#!/usr/bin/env python3
"""The pinned llama.cpp that pyllmrouter compiles against, fetched and checked.

``pin.json`` beside this file names one llama-cpp-python release, the sha256 of
its source distribution, and the sha256 of each llama.cpp header we compile
against that the wheel does not install.  Nothing of llama.cpp is committed:
the sdist is downloaded through pip into the cache directory and verified.

    fetch.py sdist                 print the path of the verified sdist
    fetch.py header --out DIR      extract the pinned headers into DIR (flat)
    fetch.py source [--out DIR]    extract the sdist's llama.cpp tree into DIR (default:
                                   the cache's llama.cpp-src) and print DIR
    fetch.py trimmed --out FILE    write the sdist without what a CUDA/CPU build of
                                   llama-cpp-python never reads (docs, vocab files,
                                   other GPU backends, tests, tools but mtmd...)
    fetch.py locate                check the installed llama-cpp-python against
                                   the pin; print "VERSION;SITE_PACKAGES;LIB_DIR"

The cache is ``$PYLLMROUTER_CACHE`` or ``~/.cache/pyllmrouter``.  Stdlib only:
this runs inside CMake's configure step.
"""

from __future__ import annotations

import argparse
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


def headers(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdist()) as tar:
        for relative, digest in PIN["headers"].items():
            data = tar.extractfile(_member(tar, relative)).read()
            got = hashlib.sha256(data).hexdigest()
            if got != digest:
                sys.exit(f"pyllmrouter: {relative} in the sdist has sha256 {got}, pin.json expects {digest}")
            (out / Path(relative).name).write_bytes(data)


def source(out: Path) -> None:
    """Extract vendor/llama.cpp of the sdist into OUT (once; a stamp marks completion)."""
    stamp = out / ".pyllmrouter-sdist-sha256"
    if stamp.exists() and stamp.read_text() == PIN["sdist_sha256"]:
        return
    out.mkdir(parents=True, exist_ok=True)
    root = PIN["sdist"].removesuffix(".tar.gz") + "/vendor/llama.cpp/"
    with tarfile.open(sdist()) as tar:
        members = []
        for m in tar.getmembers():
            if m.name.startswith(root) and (m.isfile() or m.isdir()):
                m.name = m.name[len(root):]
                members.append(m)
        try:
            tar.extractall(out, members=members, filter="data")
        except TypeError:  # Python before 3.11.4 / 3.10.12: no extraction filters
            tar.extractall(out, members=members)
    stamp.write_text(PIN["sdist_sha256"])


# Paths under vendor/llama.cpp that a llama-cpp-python build (CPU, CUDA, RPC) never reads.
TRIM = (
    "docs/", "models/", "media/", ".github/", "gguf-py/", "benches/", "tests/", "examples/", "pocs/",
    "scripts/", "conversion/", "grammars/", "requirements/", "skills/", "app/", "ci/", "licenses/",
    "ggml/src/ggml-cann/", "ggml/src/ggml-et/", "ggml/src/ggml-hexagon/", "ggml/src/ggml-metal/",
    "ggml/src/ggml-musa/", "ggml/src/ggml-opencl/", "ggml/src/ggml-openvino/", "ggml/src/ggml-sycl/",
    "ggml/src/ggml-virtgpu/", "ggml/src/ggml-vulkan/", "ggml/src/ggml-webgpu/", "ggml/src/ggml-zdnn/",
    "ggml/src/ggml-zendnn/",
)


def trimmed(out: Path) -> None:
    """The pinned sdist minus TRIM (and every tools/ folder but mtmd), as a .tar.gz."""
    root = PIN["sdist"].removesuffix(".tar.gz") + "/"
    llama = root + "vendor/llama.cpp/"

    def keep(name: str) -> bool:
        if not name.startswith(llama):
            return not any(name.startswith(root + d) for d in ("docs/", "examples/", ".git/", "tests/"))
        rel = name[len(llama):]
        if rel.startswith("tools/") and not (rel == "tools/" or rel.startswith("tools/mtmd")):
            return False
        if rel.startswith("tools/mtmd/") and rel.endswith((".mp4", ".jpg", ".png", ".wav", ".mp3")):
            return False
        return not any(rel.startswith(t) for t in TRIM)

    out.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdist()) as src, tarfile.open(out, "w:gz") as dst:
        for m in src.getmembers():
            if keep(m.name) or m.name + "/" == llama:
                dst.addfile(m, src.extractfile(m) if m.isfile() else None)


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
    args = parser.parse_args()
    if args.what in ("header", "trimmed") and args.out is None:
        parser.error("--out is required")
    if args.what == "sdist":
        print(sdist())
    elif args.what == "header":
        headers(args.out)
    elif args.what == "source":
        out = args.out or cache_dir() / "llama.cpp-src"
        source(out)
        print(out)
    elif args.what == "trimmed":
        trimmed(args.out)
    else:
        print(locate())


if __name__ == "__main__":
    main()
