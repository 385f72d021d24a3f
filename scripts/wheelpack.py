#!/usr/bin/env python3
"""A wheel folded small enough to carry, and unfolded back into the very same wheel.

    python scripts/wheelpack.py pack WHEEL OUT.tar.xz
    python scripts/wheelpack.py unpack IN.tar.xz DIR      # prints DIR/<the wheel's name>

A wheel holds no links, so llama-cpp-python's stores each shared library once per name
(libggml-cuda.so, .so.0, .so.0.25.3, twice over: 6 copies of 60 MB for one CUDA
architecture).  ``pack`` writes each distinct file once and the other names as links to
it, xz-compressed; ``unpack`` writes the wheel again, its members in their order with their
bytes (so its RECORD holds), stored uncompressed (pip installs it at once).  Stdlib only.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

MANIFEST = ".wheelpack.json"


def pack(wheel: Path, out: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        names = [i.filename for i in zf.infolist() if not i.is_dir()]
        first: dict[str, str] = {}  # content digest -> the first member that has it
        with tarfile.open(out, "w:xz", preset=6) as tar:
            manifest = json.dumps({"wheel": wheel.name, "members": names}).encode()
            info = tarfile.TarInfo(MANIFEST)
            info.size = len(manifest)
            tar.addfile(info, io.BytesIO(manifest))
            for name in names:
                data = zf.read(name)
                digest = hashlib.sha256(data).hexdigest()
                info = tarfile.TarInfo(name)
                if digest in first:
                    info.type = tarfile.SYMTYPE
                    info.linkname = os.path.relpath(first[digest], os.path.dirname(name) or ".")
                    tar.addfile(info)
                    continue
                first[digest] = name
                info.size = len(data)
                info.mode = 0o755 if name.endswith(".so") or ".so." in name else 0o644
                tar.addfile(info, io.BytesIO(data))


def unpack(packed: Path, directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as tmp, tarfile.open(packed) as tar:
        try:
            tar.extractall(tmp, filter="data")
        except TypeError:  # Python before 3.11.4 / 3.10.12: no extraction filters
            tar.extractall(tmp)
        manifest = json.loads((Path(tmp) / MANIFEST).read_text())
        wheel = directory / manifest["wheel"]
        part = wheel.with_name(wheel.name + ".part")
        with zipfile.ZipFile(part, "w", zipfile.ZIP_STORED) as zf:
            for name in manifest["members"]:
                path = Path(tmp) / name  # a link is read through: the same bytes
                info = zipfile.ZipInfo(name, (1980, 1, 1, 0, 0, 0))
                info.external_attr = (path.stat().st_mode & 0xFFFF) << 16
                zf.writestr(info, path.read_bytes())
        os.replace(part, wheel)
    return wheel


def main() -> int:
    if len(sys.argv) != 4 or sys.argv[1] not in ("pack", "unpack"):
        print(__doc__, file=sys.stderr)
        return 2
    if sys.argv[1] == "pack":
        pack(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        print(unpack(Path(sys.argv[2]), Path(sys.argv[3])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
