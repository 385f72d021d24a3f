"""A GGUF file's header read without llama.cpp: is it a GGUF file, whole?

    check(path)    ValueError naming the problem: not a GGUF file (its first bytes), a
                   version llama.cpp does not read, a header cut short or inconsistent, or
                   tensor data that ends past the end of the file (a truncated download)
    metadata(path) the same checks, and what the header says: its keys' values (numbers,
                   booleans and strings; an array is None) and the parameters (the
                   tensors' elements): what Ollama's /api/show and /api/tags describe
    extent(head, size, name)  the same checks on the first bytes of a file of ``size``
                   bytes (a remote one's, hubfiles.py): where its tensor table ends, or
                   HeaderCutShort while ``head`` holds less than the header

Reads the key/value section and the tensor table (values skipped by their lengths, nothing
decoded but what the sizes need), as llama.cpp's gguf reader walks them, and the extent of
the tensor data against the file's size: what a load would find first, without a load (the
router never loads llama.cpp in its own process).  Sparse files of a model's full size pass.
"""

from __future__ import annotations

import mmap
import os
import struct
from typing import Any

__all__ = ["check", "metadata", "extent", "HeaderCutShort"]

_MAGIC = b"GGUF"
_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF value type -> bytes
_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_MAX_COUNT = 1 << 40  # counts past this are a corrupt header, not a big model


class HeaderCutShort(ValueError):
    """The bytes read end inside the header (a file cut short, or a head read too short)."""


class _Header:
    def __init__(self, buf: mmap.mmap | bytes, size: int, path: str):
        self.buf, self.size, self.path, self.pos = buf, size, path, 0
        self.tensors = 0

    def fail(self, what: str, kind: type[ValueError] = ValueError) -> ValueError:
        return kind(f"{self.path} is not a valid GGUF file: {what} (at byte {self.pos} of {self.size})")

    def short(self) -> ValueError:
        return self.fail("its header is cut short", HeaderCutShort)

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > self.size:
            raise self.short()
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return bytes(out)

    def u32(self) -> int:
        return struct.unpack("<I", self.take(4))[0]

    def u64(self) -> int:
        value = struct.unpack("<Q", self.take(8))[0]
        if value > _MAX_COUNT:
            raise self.fail(f"a length of {value}")
        return value

    def string(self) -> bytes:
        return self.take(self.u64())

    def skip_string(self) -> None:
        n = struct.unpack_from("<Q", self.buf, self.pos)[0] if self.pos + 8 <= self.size else -1
        if n < 0 or self.pos + 8 + n > self.size:
            raise self.short()
        self.pos += 8 + n

    def skip_value(self, kind: int) -> None:
        if kind in _SCALARS:
            self.take(_SCALARS[kind])
        elif kind == _STRING:
            self.skip_string()
        elif kind == _ARRAY:
            inner, count = self.u32(), self.u64()
            if inner in _SCALARS:
                self.take(_SCALARS[inner] * count)
            elif inner == _STRING:
                for _ in range(count):
                    self.skip_string()
            else:
                raise self.fail(f"an array of value type {inner}")
        else:
            raise self.fail(f"value type {kind}")


def check(path: str) -> None:
    """ValueError unless ``path`` is a whole GGUF file (see the module's docstring).  A
    tensor of a type the installed gguf package does not know (llama.cpp's newer ones) is
    not judged by its size: llama.cpp's load is."""
    metadata(path, values=False)


def metadata(path: str, values: bool = True) -> tuple[dict[str, Any], int]:
    """``check``'s checks, then (the header's keys and values, the parameters): a number,
    boolean or string as it is, an array as None (``values=False``: no value read)."""
    try:
        return _walk(path, values)
    except OSError as e:
        raise ValueError(f"{path} cannot be read: {e.strerror or e}") from None


def extent(head: bytes, size: int, name: str) -> tuple[int, int]:
    """(where the tensor table ends, where the tensor data starts) in a GGUF file of ``size``
    bytes whose first bytes are ``head``: ``check``'s checks, naming ``name``.
    HeaderCutShort while ``head`` ends inside the header (read more, unless it is the
    whole file)."""
    if head[:4] != _MAGIC:
        raise ValueError(f"{name} is not a GGUF file: it starts with {bytes(head[:4])!r}, not b'GGUF'"
                         + (" (it is empty)" if size == 0 else ""))
    h = _Header(head, len(head), name)
    _, _, end, data = _read(h, values=False)
    _check_end(name, data + end, size, h)
    return h.pos, data


def _walk(path: str, values: bool) -> tuple[dict[str, Any], int]:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(4)
        if head != _MAGIC:
            raise ValueError(f"{path} is not a GGUF file: it starts with {head!r}, not b'GGUF'"
                             + (" (it is empty)" if size == 0 else ""))
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            h = _Header(buf, size, path)
            keys, parameters, end, data = _read(h, values)
    _check_end(path, data + end, size, h)
    return {k.decode(errors="replace"): v for k, v in keys.items()}, parameters


def _check_end(name: str, end: int, size: int, h: _Header) -> None:
    if h.tensors and end > size:
        raise ValueError(f"{name} is cut short: its tensors end at byte {end}, the file has {size} "
                         f"(a download that did not finish?)")


def _read(h: _Header, values: bool) -> tuple[dict[bytes, Any], int, int, int]:
    """(keys, parameters, end of the tensor data relative to its start, where the data
    starts), walking the header from its first byte."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType  # noqa: PLC0415

    h.take(4)
    version = h.u32()
    if version not in (2, 3):
        raise h.fail(f"version {version} (llama.cpp reads 2 and 3)")
    n_tensors, n_kv = h.u64(), h.u64()
    h.tensors = n_tensors
    alignment = 32
    keys: dict[bytes, Any] = {}
    for _ in range(n_kv):
        key, kind = h.string(), h.u32()
        if key in keys:
            raise h.fail(f"the key {key.decode(errors='replace')!r} is there twice")
        keys[key] = None
        if key == b"general.alignment" and kind == 4:
            alignment = keys[key] = struct.unpack("<I", h.take(4))[0]
            if alignment == 0 or alignment & (alignment - 1):
                raise h.fail(f"general.alignment {alignment}")
        elif values and kind in _FORMATS:
            keys[key] = struct.unpack(_FORMATS[kind], h.take(_SCALARS[kind]))[0]
        elif values and kind == _STRING:
            keys[key] = h.string().decode(errors="replace")
        else:
            h.skip_value(kind)
    end = parameters = 0
    for _ in range(n_tensors):
        name = h.string()
        n_dims = h.u32()
        if n_dims > 8:
            raise h.fail(f"tensor {name!r} has {n_dims} dimensions")
        elements = 1
        for _ in range(n_dims):
            elements *= h.u64()
        parameters += elements
        kind, offset = h.u32(), h.u64()
        if offset % alignment:
            raise h.fail(f"tensor {name!r} is at offset {offset}, not a multiple of {alignment}")
        try:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
        except (ValueError, KeyError):  # a type newer than the gguf package: its load judges it
            end = max(end, offset)
            continue
        if elements % block:
            raise h.fail(f"tensor {name!r} has {elements} elements, not whole blocks of {block}")
        end = max(end, offset + elements // block * type_size)
    return keys, parameters, end, -(-h.pos // alignment) * alignment
