"""The page header: every field round-trips, and any flipped header byte is detected."""

from __future__ import annotations

import pytest

from gr_plugin.cache.tiers import PageKey
from gr_plugin.cache.tiers.page_format import (
    FIXED_BYTES,
    HeaderError,
    checksum,
    decode_header,
    encode_header,
    header_bytes,
    verify,
)

KEY = PageKey("model-v1/ünïcode", -42, 7, (1 << 127) + 12345)
PAYLOAD = bytes(range(256)) * 4


def test_header_round_trip():
    header = encode_header(KEY, 2, len(PAYLOAD), checksum(PAYLOAD))
    assert len(header) == header_bytes(KEY) == FIXED_BYTES + len(KEY.namespace.encode())
    key, dtype, length, payload_sum, size = decode_header(header + b"\0" * 100)
    assert (key, dtype, length, payload_sum, size) == (KEY, 2, len(PAYLOAD), checksum(PAYLOAD), len(header))
    assert verify(header, KEY, 2, PAYLOAD, len(PAYLOAD)) is None


def test_every_flipped_header_byte_is_detected():
    header = encode_header(KEY, 2, len(PAYLOAD), checksum(PAYLOAD))
    for i in range(len(header)):
        bad = bytearray(header)
        bad[i] ^= 0x10
        assert verify(bytes(bad), KEY, 2, PAYLOAD, len(PAYLOAD)) is not None, f"flip at byte {i} not detected"


def test_payload_and_key_mismatches_are_named():
    header = encode_header(KEY, 2, len(PAYLOAD), checksum(PAYLOAD))
    assert "checksum" in verify(header, KEY, 2, PAYLOAD[:-1] + b"\1", len(PAYLOAD))
    other = PageKey(KEY.namespace, KEY.user_id + 1, KEY.page_index, KEY.page_hash)
    assert "stored key" in verify(header, other, 2, PAYLOAD, len(PAYLOAD))
    assert "length" in verify(header, KEY, 2, PAYLOAD, len(PAYLOAD) + 1)
    assert "dtype" in verify(header, KEY, 1, PAYLOAD, len(PAYLOAD))
    with pytest.raises(HeaderError, match="truncated"):
        decode_header(header[:10])
    with pytest.raises(HeaderError, match="magic"):
        decode_header(b"\0" * len(header))


@pytest.mark.parametrize("fields, bad", [
    (("", 1, 0, 0), "namespace"),
    (("x" * 513, 1, 0, 0), "namespace"),
    (("ns", True, 0, 0), "user_id"),
    (("ns", 2**63, 0, 0), "user_id"),
    (("ns", 1, -1, 0), "page_index"),
    (("ns", 1, 0, 2**128), "page_hash"),
    (("ns", 1, 0, -5), "page_hash"),
])
def test_page_key_rejects_bad_fields(fields, bad):
    with pytest.raises(ValueError, match=bad):
        PageKey(*fields)
