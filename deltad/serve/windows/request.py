"""A GetDelta request checked against the rank's log: the log's snapshot and the WindowSpec the
request asks for (its tables known, its packed dtype servable, its chunk size bounded)."""

from __future__ import annotations

import grpc

from deltad import wire
from deltad.config import ServerConfig, clip
from deltad.serve.edge.grpcutil import abort as _abort
from deltad.serve.index.log import LogSnapshot, SegmentLog
from deltad.serve.windows.spec import WindowSpec
from deltad.v1 import delta_pb2 as pb

#: The smallest chunk a request may ask for.
MIN_CHUNK_BYTES = 64 * 1024


def log_snapshot(
    config: ServerConfig, seglog: SegmentLog, context: grpc.ServicerContext
) -> LogSnapshot:
    """The log as it stands now; UNAVAILABLE while it has no base segment yet."""
    snap = seglog.snapshot()
    if snap is None:
        _abort(
            context,
            grpc.StatusCode.UNAVAILABLE,
            f"no base segment for model {config.model!r} rank {config.rank} "
            f"in {config.spool_dir} yet",
        )
    return snap


def request_spec(
    config: ServerConfig, req: pb.GetDeltaRequest, snap: LogSnapshot, context: grpc.ServicerContext
) -> WindowSpec:
    """The request's form, tables and limits as a WindowSpec (the window's seqs still
    to be decided); NOT_FOUND for unknown tables, INVALID_ARGUMENT for tables a packed
    dtype cannot serve here (column-wise shards)."""
    form, dtype = wire.form_from_pb(req.form), wire.dtype_from_pb(req.dtype)
    known = {t.name for t in snap.manifest.tables}
    unknown = sorted(set(req.tables) - known)
    if unknown:
        _abort(
            context,
            grpc.StatusCode.NOT_FOUND,
            f"{len(unknown)} unknown table(s) {clip(unknown, 256)}; model "
            f"{config.model!r} has {clip(sorted(known), 512)}",
        )
    tables = tuple(sorted(set(req.tables)))
    align = 0
    if dtype.packed:  # shards that cannot be packed (column-wise) travel as fp32
        align = wire.check_row_alignment(req.row_alignment)  # checked at the edge
    # a chunk and its framing fit in the server's send limit and in every consumer's
    # receive limit (a larger --max-message-bytes must not make pulls fail)
    limit = min(config.max_message_bytes, wire.CONSUMER_MAX_MESSAGE_BYTES)
    cap = max(MIN_CHUNK_BYTES, limit - 64 * 1024)
    chunk = min(max(req.chunk_bytes or config.chunk_bytes, MIN_CHUNK_BYTES), cap)
    return WindowSpec(
        config.rank, snap.generation, False, -1, -1, form, dtype, tables, int(req.k),
        float(req.fraction), int(req.max_rows), chunk, align, req.with_dense,
    )  # fmt: skip
