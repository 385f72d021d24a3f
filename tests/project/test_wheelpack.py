"""scripts/wheelpack.py: a wheel folded (each file once) and unfolded into the same wheel."""

from __future__ import annotations

import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "wheelpack.py"


def test_a_wheel_folded_and_unfolded_is_the_same_wheel(tmp_path):
    wheel = tmp_path / "demo-1.0-py3-none-any.whl"
    lib = bytes(range(256)) * 4096
    members = {"demo/__init__.py": b"x = 1\n", "demo/lib/libx.so": lib, "demo/lib/libx.so.0": lib,
               "lib/libx.so.0.1": lib, "demo-1.0.dist-info/RECORD": b"record\n"}
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    folded = tmp_path / "demo.whl.tar.xz"
    subprocess.run([sys.executable, str(SCRIPT), "pack", str(wheel), str(folded)], check=True)
    with tarfile.open(folded) as tar:
        files = [m for m in tar.getmembers() if m.isfile() and m.name != ".wheelpack.json"]
        links = [m for m in tar.getmembers() if m.issym()]
    assert len(files) == 3 and len(links) == 2  # the library stored once
    out = subprocess.run([sys.executable, str(SCRIPT), "unpack", str(folded), str(tmp_path / "out")],
                         check=True, capture_output=True, text=True).stdout.strip()
    assert Path(out).name == wheel.name
    with zipfile.ZipFile(out) as zf:
        assert [i.filename for i in zf.infolist()] == list(members)
        assert all(zf.read(n) == data for n, data in members.items())
