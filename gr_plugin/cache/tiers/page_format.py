"""The byte format of one stored page: a self-describing header and the payload checksum.

Owns the header codec shared by the SSD slots and the Redis values, and zero-copy byte views of
memory by address. It does not decide where headers go (the SSD store puts the header after the
payload so the payload stays aligned; the Redis store puts it first).

Header (little-endian, ``FIXED_BYTES`` = 68, then the namespace)::

    offset  type  field
    0       4s    magic b"GRKV"
    4       H     format version (1)
    6       B     dtype code (0 = raw bytes, not checked)
    7       B     flags (0)
    8       H     namespace length in bytes (1..512)
    10      H     reserved (0)
    12      q     user_id
    20      q     page_index
    28      Q     page_hash, low 64 bits
    36      Q     page_hash, high 64 bits
    44      Q     payload length in bytes
    52      Q     xxh3-64 of the payload
    60      Q     xxh3-64 of header bytes [0, 60) + the namespace
    68      ...   namespace, utf-8

A page is valid only if every field equals what the reader asked for and both checksums agree.
"""

from __future__ import annotations

import ctypes
import struct

import torch
import xxhash

from gr_plugin.cache.tiers.types import MAX_NAMESPACE_BYTES, PageKey

MAGIC = b"GRKV"
VERSION = 1
_FIXED = struct.Struct("<4sHBBHHqqQQQQQ")
_OWN = 60  # offset of the header's own checksum
FIXED_BYTES = _FIXED.size
#: the most bytes a header can take (longest namespace)
MAX_HEADER_BYTES = FIXED_BYTES + MAX_NAMESPACE_BYTES
_MASK64 = (1 << 64) - 1

#: NOTE: codes are part of the format: append, never renumber.
_DTYPE_CODES = {
    torch.float32: 1,
    torch.bfloat16: 2,
    torch.float16: 3,
    torch.float64: 4,
    torch.uint8: 5,
    torch.int8: 6,
    torch.float8_e4m3fn: 7,
    torch.float8_e5m2: 8,
}


class HeaderError(ValueError):
    """A stored header is not a valid header of this format (wrong magic, version, checksum, size)."""


def dtype_code(dtype: torch.dtype) -> int:
    """Code stored in the header for ``dtype`` (0: stored as raw bytes, not checked)."""
    return _DTYPE_CODES.get(dtype, 0)


def byte_view(address: int, num_bytes: int) -> ctypes.Array:
    """Zero-copy, writable byte view of ``num_bytes`` at ``address`` (the owner must stay alive)."""
    return (ctypes.c_char * num_bytes).from_address(address)


def checksum(buffer: object) -> int:
    """xxh3-64 of a bytes-like object."""
    return xxhash.xxh3_64_intdigest(buffer)


def encode_header(key: PageKey, dtype: int, payload_len: int, payload_checksum: int) -> bytes:
    """Header bytes for a page stored under ``key`` (length ``header_bytes(key)``)."""
    ns = key.namespace.encode("utf-8")
    fields = (MAGIC, VERSION, dtype, 0, len(ns), 0, key.user_id, key.page_index,
              key.page_hash & _MASK64, key.page_hash >> 64, payload_len, payload_checksum)
    head = _FIXED.pack(*fields, 0)
    return head[:_OWN] + struct.pack("<Q", checksum(head[:_OWN] + ns)) + ns


def header_bytes(key: PageKey) -> int:
    return FIXED_BYTES + len(key.namespace.encode("utf-8"))


def decode_header(buffer: bytes | memoryview) -> tuple[PageKey, int, int, int, int]:
    """``(key, dtype code, payload length, payload checksum, header length)`` of a stored header.

    Raises `HeaderError` when the bytes are not an intact header of this format.
    """
    if len(buffer) < FIXED_BYTES:
        raise HeaderError(f"header truncated: {len(buffer)} bytes < {FIXED_BYTES}")
    (magic, version, dtype, _flags, ns_len, _reserved, user_id, page_index, h_lo, h_hi, payload_len, payload_sum,
     own) = _FIXED.unpack_from(buffer, 0)
    if magic != MAGIC:
        raise HeaderError(f"bad magic {bytes(magic)!r}")
    if version != VERSION:
        raise HeaderError(f"unknown format version {version}")
    if ns_len == 0 or ns_len > MAX_NAMESPACE_BYTES or FIXED_BYTES + ns_len > len(buffer):
        raise HeaderError(f"bad namespace length {ns_len}")
    ns = bytes(buffer[FIXED_BYTES : FIXED_BYTES + ns_len])
    if checksum(bytes(buffer[:_OWN]) + ns) != own:
        raise HeaderError("header checksum mismatch")
    try:
        key = PageKey(ns.decode("utf-8"), user_id, page_index, h_lo | (h_hi << 64))
    except (UnicodeDecodeError, ValueError) as exc:
        raise HeaderError(f"bad key fields: {exc}") from exc
    return key, dtype, payload_len, payload_sum, FIXED_BYTES + ns_len


def verify(buffer: bytes | memoryview, key: PageKey, dtype: int, payload: object, payload_len: int) -> str | None:
    """Why the header in ``buffer`` does not describe ``payload`` stored under ``key``, or ``None``.

    ``payload`` is a bytes-like view of the page bytes that were read (``payload_len`` of them).
    """
    try:
        stored, stored_dtype, stored_len, stored_sum, _ = decode_header(buffer)
    except HeaderError as exc:
        return str(exc)
    if stored != key:
        return f"stored key {stored} is not the requested {key}"
    if stored_len != payload_len:
        return f"payload length {stored_len} != {payload_len}"
    if stored_dtype and dtype and stored_dtype != dtype:
        return f"dtype code {stored_dtype} != {dtype}"
    if checksum(payload) != stored_sum:
        return "payload checksum mismatch"
    return None
