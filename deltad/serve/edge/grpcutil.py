"""Small gRPC helpers shared by the sidecar's handlers."""

from __future__ import annotations

import logging
import re
from typing import NoReturn

import grpc

log = logging.getLogger(__name__)

#: Longest status message sent to a client: far below gRPC's 16 kB metadata limit, whatever
#: a request echoed into it.
MAX_DETAILS = 1000
#: An absolute file path in a message (two or more components): the spool, the tokens file.
_PATH = re.compile(r"(?<![\w.~-])/(?:[^\s'\"/,;:()\[\]]+/)+([^\s'\"/,;:()\[\]]*)")


def public_details(msg: str) -> str:
    """``msg`` as a client may see it: absolute paths cut to their last component (the
    server's log keeps them) and at most :data:`MAX_DETAILS` characters."""
    safe = _PATH.sub(lambda m: f".../{m.group(1)}", msg)
    if len(safe) > MAX_DETAILS:
        safe = f"{safe[: MAX_DETAILS - 40]}... ({len(safe)} chars, cut)"
    return safe


def abort(context: grpc.ServicerContext, code: grpc.StatusCode, msg: str) -> NoReturn:
    """End the RPC with ``code`` and ``msg`` (``context.abort`` raises; this says so to mypy);
    the client gets :func:`public_details` of it, the log the full text if that differs."""
    public = public_details(msg)
    if public != msg:
        log.info("%s (sent as: %s): %s", code.name, public[:200], msg[:4000])
    context.abort(code, public)
    raise AssertionError("unreachable")  # context.abort raises
