"""The frame every spool file shares: versions, magics, prefix, trailer, alignment, checksum.

A file is ``PREFIX`` (magic, header length, reserved), its JSON header, zero padding to
:data:`ALIGN`, a payload of 64-byte aligned arrays, then ``TRAILER`` (the checksum of every
byte before it, and the end magic). Segments (:mod:`deltad.segment.header`) and dense states
(:mod:`deltad.segment.dense`) share it.
"""

from __future__ import annotations

import struct
import zlib

import xxhash

#: The version writers write for ordinary tables (version 1 is still read).
FORMAT_VERSION = 2
#: The version written when a shard carries managed-collision identities (raw ids, evictions):
#: a reader of version 2 refuses such a segment rather than serving slots without identities.
IDENTITY_FORMAT_VERSION = 3
#: Versions readers read, with their leading and trailing magic.
MAGICS: dict[int, tuple[bytes, bytes]] = {
    1: (b"DLTSEG01", b"DLTEND01"),
    2: (b"DLTSEG02", b"DLTEND02"),
    3: (b"DLTSEG03", b"DLTEND03"),
}
#: The leading and trailing magic of :data:`FORMAT_VERSION`.
MAGIC, END_MAGIC = MAGICS[FORMAT_VERSION]
VERSION_OF_MAGIC = {m: v for v, (m, _) in MAGICS.items()}
#: Every header's padding and every payload array's offset is a multiple of this.
ALIGN = 64
#: The first 16 bytes: magic, header length H (uint32 LE), reserved (0).
PREFIX = struct.Struct("<8sII")
#: The last 16 bytes: checksum (v1: crc32 in the low 4 bytes), end magic.
TRAILER = struct.Struct("<Q8s")


def align(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`ALIGN`."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


class Checksum:
    """The running checksum of a segment version: XXH3-64 (v2) or zlib crc32 (v1)."""

    def __init__(self, version: int) -> None:
        self._xxh = xxhash.xxh3_64() if version >= 2 else None
        self._crc = 0

    def update(self, b: bytes | memoryview) -> None:
        if self._xxh is not None:
            self._xxh.update(b)
        else:
            self._crc = zlib.crc32(b, self._crc)

    def value(self) -> int:
        return self._xxh.intdigest() if self._xxh is not None else self._crc


def checksum(buf: bytes | memoryview, version: int = FORMAT_VERSION) -> int:
    """The checksum a segment of ``version`` stores for the bytes ``buf``."""
    c = Checksum(version)
    c.update(buf)
    return c.value()
