"""gguf_header.check: a file that is not a whole GGUF is refused with the reason, without
llama.cpp; what llama.cpp's load would judge better (tensor types newer than the gguf
package) is left to it."""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest

from pyllmrouter.gguf_header import check
from pyllmrouter.tools import tinymodels


def _write(path, tensors=(("w", np.zeros((4, 32), dtype=np.float32)),), kv=()):
    w = gguf.GGUFWriter(path, "llama")
    for key, value in kv:
        w.add_uint32(key, value)
    for name, data in tensors:
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_whole_model_and_a_sparse_one_pass(tmp_path):
    check(str(tinymodels.write_llama(tmp_path / "m.gguf")))
    check(str(tinymodels.write_shape(tmp_path / "s.gguf")))  # a 7B's size over a hole
    check(str(_write(tmp_path / "none.gguf", tensors=())))  # a vocabulary-only file has no tensors


@pytest.mark.parametrize("content, reason", [
    (b"", "is not a GGUF file: it starts with b''.*empty"),
    (b"PK\x03\x04 a zip", "is not a GGUF file: it starts with b'PK"),
    (b"GGUF\x01\x00\x00\x00" + bytes(16), "version 1"),
    (b"GGUF\x03\x00\x00\x00", "its header is cut short"),
])
def test_what_is_not_a_gguf_is_refused_naming_why(tmp_path, content, reason):
    p = tmp_path / "bad.gguf"
    p.write_bytes(content)
    with pytest.raises(ValueError, match=reason):
        check(str(p))


def test_a_file_cut_short_is_refused_with_its_sizes(tmp_path):
    p = _write(tmp_path / "m.gguf")
    os.truncate(p, os.path.getsize(p) - 10)
    with pytest.raises(ValueError, match=r"is cut short: its tensors end at byte \d+, the file has \d+"):
        check(str(p))


def _raw(kvs=(), tensors=(), data=b""):
    """GGUF v3 written by hand: (key, uint32 value) pairs, (name, dims, type, offset) tensors."""
    u32, u64 = (lambda v: v.to_bytes(4, "little")), (lambda v: v.to_bytes(8, "little"))
    out = b"GGUF" + u32(3) + u64(len(tensors)) + u64(len(kvs))
    for key, value in kvs:
        out += u64(len(key)) + key.encode() + u32(4) + u32(value)
    for name, dims, kind, offset in tensors:
        out += u64(len(name)) + name.encode() + u32(len(dims)) + b"".join(u64(d) for d in dims) + u32(kind) + u64(offset)
    return out + bytes(-len(out) % 32) + data


def test_a_key_twice_is_refused(tmp_path):
    p = tmp_path / "dup.gguf"
    p.write_bytes(_raw(kvs=[("k", 1), ("k", 2)]))
    with pytest.raises(ValueError, match="the key 'k' is there twice"):
        check(str(p))


def test_a_tensor_type_the_gguf_package_does_not_know_is_left_to_the_load(tmp_path):
    p = tmp_path / "new.gguf"
    p.write_bytes(_raw(tensors=[("w", (32,), 200, 0)], data=bytes(64)))  # a type no gguf package has
    check(str(p))
    p.write_bytes(_raw(tensors=[("w", (32,), 0, 0)], data=bytes(64)))  # F32: 128 bytes, 64 there
    with pytest.raises(ValueError, match="cut short"):
        check(str(p))


def test_an_unreadable_path_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="cannot be read"):
        check(str(tmp_path / "missing.gguf"))
