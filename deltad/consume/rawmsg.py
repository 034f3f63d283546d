"""Hand parsing of raw GetDeltaResponse bytes: its framing, and a RowChunk's fields as views."""

from __future__ import annotations

from google.protobuf.message import DecodeError

from deltad.errors import StreamDecodeError
from deltad.v1 import delta_pb2 as pb

#: GetDeltaResponse's oneof fields as wire tags (field number << 3 | length-delimited)
HEADER_TAG = 0x0A
CHUNK_TAG = 0x12
TRAILER_TAG = 0x1A
DENSE_TAG = 0x22

#: a RowChunk's fields: (slice, offset, count, then ids, scale_bias, values, raw_ids, evicted,
#: admitted as views of the received bytes)
RowChunkFields = tuple[
    int, int, int, memoryview, memoryview, memoryview, memoryview, memoryview, memoryview
]


def read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    """The varint at ``pos``: (value, position after it)."""
    result = 0
    shift = 0
    while True:
        if pos >= len(buf):
            raise StreamDecodeError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise StreamDecodeError("varint too long")


def skip_field(buf: memoryview, pos: int, wire_type: int) -> int:
    """The position after a field of ``wire_type`` whose value starts at ``pos``."""
    if wire_type == 0:
        return read_varint(buf, pos)[1]
    if wire_type == 1:
        return pos + 8
    if wire_type == 2:
        n, pos = read_varint(buf, pos)
        return pos + n
    if wire_type == 5:
        return pos + 4
    raise StreamDecodeError(f"unsupported wire type {wire_type}")


def split_response(buf: memoryview) -> tuple[int, memoryview] | None:
    """A serialized GetDeltaResponse's one field: (tag, its bytes as a view); None when
    more fields follow the first (a newer server's additions: :func:`parse_response`)."""
    if len(buf) < 2:
        raise StreamDecodeError("empty GetDeltaResponse")
    tag, pos = read_varint(buf, 0)
    n, pos = read_varint(buf, pos)
    body = buf[pos : pos + n]
    if len(body) != n:
        raise StreamDecodeError("bad GetDeltaResponse framing")
    if pos + n != len(buf):
        return None
    return tag, body


def parse_response(buf: memoryview) -> pb.GetDeltaResponse:
    """The whole message, parsed by protobuf (the slow path)."""
    try:
        return pb.GetDeltaResponse.FromString(bytes(buf))
    except DecodeError as e:
        raise StreamDecodeError(f"bad GetDeltaResponse: {e}") from e


def parse_row_chunk(buf: memoryview) -> RowChunkFields:
    """A serialized RowChunk's fields; its byte fields are views of ``buf`` (no copy)."""
    fields = [0, 0, 0]
    # ids, scale_bias, values, raw_ids, evicted, admitted (RowChunk fields 4..9)
    blobs = [memoryview(b"")] * 6
    pos = 0
    while pos < len(buf):
        key, pos = read_varint(buf, pos)
        num, wt = key >> 3, key & 7
        if 1 <= num <= 3 and wt == 0:
            fields[num - 1], pos = read_varint(buf, pos)
        elif 4 <= num <= 9 and wt == 2:
            n, pos = read_varint(buf, pos)
            blobs[num - 4] = buf[pos : pos + n]
            pos += n
        else:
            pos = skip_field(buf, pos, wt)
    if pos != len(buf):
        raise StreamDecodeError("truncated RowChunk")
    ids, scale_bias, values, raw_ids, evicted, admitted = blobs
    return fields[0], fields[1], fields[2], ids, scale_bias, values, raw_ids, evicted, admitted
