"""Small gRPC helpers shared by the sidecar's handlers."""

from __future__ import annotations

from typing import NoReturn

import grpc


def abort(context: grpc.ServicerContext, code: grpc.StatusCode, msg: str) -> NoReturn:
    """End the RPC with ``code`` and ``msg`` (``context.abort`` raises; this says so to mypy)."""
    context.abort(code, msg)
    raise AssertionError("unreachable")  # context.abort raises
