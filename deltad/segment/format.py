"""The segment file format (version 2; version 1 is still read): what one rank publishes at
one step boundary.

A segment is a set of "latest value" rows per table shard, in one file::

    offset 0   magic  b"DLTSEG02"  (b"DLTSEG01")       8 bytes
           8   header length H (uint32 LE)             4 bytes
          12   reserved (0)                            4 bytes
          16   header: UTF-8 JSON, H bytes             (see SegmentHeader / ShardMeta)
               zero padding to a multiple of 64
           P   payload: per shard, ids then values, each 64-byte aligned; offsets in the
               header are relative to P. ids are int64 LE global row ids, unique, ascending;
               values are row-major [count, col_end - col_start] in the shard's dtype.
        end-16 checksum of every byte before the trailer: 8 bytes
               v2: XXH3-64 (uint64 LE); v1: crc32 (uint32 LE), then 4 reserved zero bytes
        end-8  magic  b"DLTEND02"  (b"DLTEND01")       8 bytes

Files are written to a hidden temp name in the destination directory, fsynced, renamed into
place and the directory fsynced, so a reader never sees half a segment. A segment that merges
the original segments ``first_seq..seq`` carries both numbers (a base has ``first_seq == 0``).
Writers write version 2 (XXH3 runs at ~30 GB/s here, zlib's crc32 at ~4); readers read both.
See docs/segment-format.md for the rules readers follow.

This module is the format's one import place; its parts live beside it:

* :mod:`deltad.segment.framing`: versions and magics, the prefix and trailer, alignment, the
  checksum (shared with dense state files);
* :mod:`deltad.segment.header`: :class:`SegmentHeader` and :class:`ShardMeta` (the JSON
  header), the value dtypes;
* :mod:`deltad.segment.rows`: :class:`ShardRows` and :class:`Segment` (a segment in memory),
  :func:`apply_segments`;
* :mod:`deltad.segment.writer`: :func:`write_segment`;
* :mod:`deltad.segment.reader`: :func:`read_header`, :func:`read_segment`;
* :mod:`deltad.segment.dense`: dense state files (the model's dense parameters and buffers);
* :mod:`deltad.segment.validate`: the spool as input, checked before anything serves it.
"""

from __future__ import annotations

from deltad.segment.dense import (
    DENSE_END_MAGIC,
    DENSE_FORMAT_VERSION,
    DENSE_MAGIC,
    DenseHeader,
    DenseState,
    DenseTensorMeta,
    decode_dense,
    dense_dtype,
    dense_file_size,
    encode_dense,
    read_dense,
    read_dense_header_at,
    tensor_bytes,
    write_dense,
)
from deltad.segment.framing import (
    ALIGN,
    END_MAGIC,
    FORMAT_VERSION,
    IDENTITY_FORMAT_VERSION,
    MAGIC,
    MAGICS,
    checksum,
)
from deltad.segment.header import (
    SegmentHeader,
    ShardMeta,
    dtype_name,
)
from deltad.segment.reader import (
    file_size,
    read_header,
    read_header_at,
    read_segment,
)
from deltad.segment.rows import (
    Segment,
    ShardRows,
    apply_segments,
)
from deltad.segment.writer import (
    write_segment,
)

__all__ = [
    "ALIGN",
    "DENSE_END_MAGIC",
    "DENSE_FORMAT_VERSION",
    "DENSE_MAGIC",
    "END_MAGIC",
    "FORMAT_VERSION",
    "IDENTITY_FORMAT_VERSION",
    "MAGIC",
    "MAGICS",
    "DenseHeader",
    "DenseState",
    "DenseTensorMeta",
    "Segment",
    "SegmentHeader",
    "ShardMeta",
    "ShardRows",
    "apply_segments",
    "checksum",
    "decode_dense",
    "dense_dtype",
    "dense_file_size",
    "dtype_name",
    "encode_dense",
    "file_size",
    "read_dense",
    "read_dense_header_at",
    "read_header",
    "read_header_at",
    "read_segment",
    "tensor_bytes",
    "write_dense",
    "write_segment",
]
