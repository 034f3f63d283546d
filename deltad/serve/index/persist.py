"""A log entry written back as a spool file, from its verified private copy: the archive's
objects (deltad.serve.archive.uploader), and the files of a served log that vanished from the
spool under a running sidecar (:meth:`deltad.serve.index.log.SegmentLog.refresh`).

The bytes are the entry's verified rows and header fields, laid out as the trainer lays them
out, so a file written here reads back (and verifies) as the one that was there."""

from __future__ import annotations

from pathlib import Path

from deltad.segment.dense import DENSE_END_MAGIC, DENSE_MAGIC, DenseState, tensor_bytes
from deltad.segment.format import write_segment
from deltad.segment.framing import PREFIX, TRAILER, align, checksum
from deltad.segment.spool import write_atomic
from deltad.serve.index.files import DenseEntry, LogEntry

__all__ = ["encode_dense_state", "write_dense_entry", "write_entry"]


def write_entry(entry: LogEntry, path: Path, *, fsync: bool = False) -> None:
    """Write the segment file of ``entry`` (its verified rows and header fields) at ``path``,
    atomically."""
    h = entry.segment.header
    write_segment(
        path,
        model=h.model,
        generation=h.generation,
        rank=h.rank,
        world_size=h.world_size,
        seq=h.seq,
        first_seq=h.first_seq,
        step=h.step,
        kind=h.kind,
        shards=entry.segment.shards,
        fsync=fsync,
        created_unix=h.created_unix,
        first_created_unix=h.first_created_unix,
    )


def encode_dense_state(state: DenseState) -> bytes:
    """The bytes of a dense state file holding ``state`` with its own header (its step,
    seq and time), laid out as :func:`deltad.segment.dense.encode_dense` lays them out."""
    raw = state.header.to_json()
    start = align(PREFIX.size + len(raw))
    end = max((align(m.offset + m.nbytes) for m in state.header.tensors), default=0)
    out = bytearray(start + end + TRAILER.size)
    PREFIX.pack_into(out, 0, DENSE_MAGIC, len(raw), 0)
    out[PREFIX.size : PREFIX.size + len(raw)] = raw
    for m in state.header.tensors:
        if m.nbytes:
            out[start + m.offset : start + m.offset + m.nbytes] = tensor_bytes(
                state.tensors[m.name]
            )
    TRAILER.pack_into(out, start + end, checksum(memoryview(out)[: start + end]), DENSE_END_MAGIC)
    return bytes(out)


def write_dense_entry(entry: DenseEntry, path: Path, *, fsync: bool = False) -> None:
    """Write the dense state file of ``entry`` at ``path``, atomically."""
    write_atomic(path, encode_dense_state(entry.state), fsync=fsync)
