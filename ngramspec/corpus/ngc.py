"""A small versioned binary format for named numpy arrays plus JSON metadata.

Layout (all integers little-endian):

    magic      8 bytes  b"NGSPEC\\x00\\x01"
    version    u32      FORMAT_VERSION
    kind_len   u32      then `kind` as UTF-8 ("trie", "sam", ...), zero-padded to 8 bytes
    body_len   u64      bytes of the body that follows
    crc32      u32      zlib.crc32 of the body
    reserved   u32      zero; keeps the body 8-byte aligned
    body:
      meta_len u64, meta JSON (UTF-8)
      count    u32      number of arrays
      per array: name_len u32, name, dtype_len u32, dtype str (numpy `.str`, e.g. "<i4"),
                 ndim u32, shape u64 * ndim, nbytes u64, pad to 8 bytes, raw C-order data

Arrays are returned as read-only `np.frombuffer` views of one bytes object: loading costs one file
read and one crc pass, no per-element Python work.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"NGSPEC\x00\x01"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<8sI")
_ALIGN = 8


class CorruptFileError(ValueError):
    """A persisted file is truncated, corrupt, of the wrong kind or from a newer format."""

    def __init__(self, path: str | os.PathLike[str], problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = str(path)
        self.problem = problem


def _pad(n: int) -> int:
    return (-n) % _ALIGN


def _encode_body(meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> list[bytes]:
    meta_bytes = json.dumps(meta, sort_keys=True).encode("utf-8")
    parts = [struct.pack("<Q", len(meta_bytes)), meta_bytes, struct.pack("<I", len(arrays))]
    offset = sum(len(p) for p in parts)
    for name, array in arrays.items():
        array = np.asarray(array, order="C")
        if array.dtype.hasobject:
            raise TypeError(f"array {name!r} has dtype object, which cannot be persisted")
        name_b, dtype_b = name.encode("utf-8"), array.dtype.str.encode("ascii")
        head = (struct.pack("<I", len(name_b)) + name_b + struct.pack("<I", len(dtype_b)) + dtype_b
                + struct.pack(f"<I{array.ndim}Q", array.ndim, *array.shape)
                + struct.pack("<Q", array.nbytes))
        head += b"\x00" * _pad(offset + len(head))
        parts += [head, array.tobytes()]
        offset += len(head) + array.nbytes
    return parts


def save(path: str | os.PathLike[str], kind: str, meta: dict[str, Any],
         arrays: dict[str, np.ndarray]) -> int:
    """Write atomically (temp file in the same folder + os.replace); returns the file size."""
    body = _encode_body(meta, arrays)
    crc, body_len = 0, 0
    for part in body:
        crc = zlib.crc32(part, crc)
        body_len += len(part)
    kind_b = kind.encode("utf-8")
    header = _HEADER.pack(MAGIC, FORMAT_VERSION) + struct.pack("<I", len(kind_b)) + kind_b
    header += b"\x00" * _pad(len(header)) + struct.pack("<QII", body_len, crc, 0)
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent or ".")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(header)
            for part in body:
                f.write(part)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return len(header) + body_len


class _Reader:
    """Bounds-checked cursor over a bytes buffer; every overrun is a CorruptFileError."""

    def __init__(self, data: bytes, path: str | os.PathLike[str], start: int = 0) -> None:
        self.data, self.path, self.pos = data, path, start

    def take(self, n: int, what: str) -> memoryview:
        if n < 0 or self.pos + n > len(self.data):
            raise CorruptFileError(self.path, f"truncated while reading {what}")
        view = memoryview(self.data)[self.pos:self.pos + n]
        self.pos += n
        return view

    def unpack(self, fmt: str, what: str) -> tuple[Any, ...]:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))

    def text(self, n: int, what: str) -> str:
        try:
            return bytes(self.take(n, what)).decode("utf-8")
        except UnicodeDecodeError as e:
            raise CorruptFileError(self.path, f"{what} is not UTF-8") from e


def read_kind(path: str | os.PathLike[str]) -> str:
    """The kind stored in a file's header (validates magic and version only)."""
    with open(path, "rb") as f:
        head = f.read(_HEADER.size + 4 + 256)
    r = _Reader(head, path)
    _check_header(r)
    (kind_len,) = r.unpack("<I", "kind length")
    return r.text(kind_len, "kind")


def _check_header(r: _Reader) -> None:
    head = bytes(r.data[:len(MAGIC)])
    if head != MAGIC[:len(head)] or not head:
        raise CorruptFileError(r.path, f"not an ngramspec file (starts with {head!r})")
    _, version = r.unpack("<8sI", "header")
    if version > FORMAT_VERSION:
        raise CorruptFileError(
            r.path, f"format version {version} is newer than supported {FORMAT_VERSION}")
    if version < 1:
        raise CorruptFileError(r.path, f"invalid format version {version}")


def load(path: str | os.PathLike[str], kind: str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Read a file written by `save`; returns (meta, arrays). Arrays are read-only views."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise CorruptFileError(path, f"cannot read: {e.strerror or e}") from e
    r = _Reader(data, path)
    _check_header(r)
    (kind_len,) = r.unpack("<I", "kind length")
    found = r.text(kind_len, "kind")
    if found != kind:
        raise CorruptFileError(path, f"holds a {found!r}, expected a {kind!r}")
    padding = r.take(_pad(r.pos), "kind padding")
    body_len, crc, reserved = r.unpack("<QII", "body length")
    if any(padding) or reserved:
        raise CorruptFileError(path, "header padding is not zero (file is corrupt)")
    if r.pos + body_len != len(data):
        raise CorruptFileError(
            path, f"truncated or padded: body should be {body_len} bytes, "
            f"file has {len(data) - r.pos}")
    if zlib.crc32(memoryview(data)[r.pos:]) != crc:
        raise CorruptFileError(path, "checksum mismatch (file is corrupt)")
    return _decode_body(r)


def _dtype(r: _Reader, text: str, name: str) -> np.dtype:
    try:
        dtype = np.dtype(text)
    except TypeError as e:
        raise CorruptFileError(r.path, f"array {name!r} has an unknown dtype {text!r}") from e
    if dtype.hasobject or dtype.itemsize == 0:
        raise CorruptFileError(r.path, f"array {name!r} has an unsupported dtype {text!r}")
    return dtype


def _decode_body(r: _Reader) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    (meta_len,) = r.unpack("<Q", "metadata length")
    try:
        meta = json.loads(r.text(meta_len, "metadata"))
    except json.JSONDecodeError as e:
        raise CorruptFileError(r.path, f"metadata is not JSON: {e}") from e
    (count,) = r.unpack("<I", "array count")
    arrays: dict[str, np.ndarray] = {}
    for _ in range(count):
        (name_len,) = r.unpack("<I", "array name length")
        name = r.text(name_len, "array name")
        (dtype_len,) = r.unpack("<I", f"dtype of {name!r}")
        dtype = _dtype(r, r.text(dtype_len, f"dtype of {name!r}"), name)
        (ndim,) = r.unpack("<I", f"rank of {name!r}")
        shape = r.unpack(f"<{ndim}Q", f"shape of {name!r}")
        (nbytes,) = r.unpack("<Q", f"size of {name!r}")
        if nbytes != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
            raise CorruptFileError(r.path, f"array {name!r}: size does not match shape")
        r.take(_pad(r.pos), f"padding of {name!r}")
        raw = r.take(nbytes, f"data of {name!r}")
        arrays[name] = np.frombuffer(raw, dtype=dtype).reshape(shape)
    if r.pos != len(r.data):
        raise CorruptFileError(r.path, "trailing bytes after the last array")
    return meta, arrays
