"""The command line's own lines (not log records): plain text, or with ``--log-json`` one
JSON object per line in the log's shape (``ts``, ``level``, ``logger``, ``msg``), so that a
JSON log stream holds nothing else."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import TextIO

_json_lines = False


def use_json(on: bool) -> None:
    """Write every later line as JSON (``--log-json``)."""
    global _json_lines
    _json_lines = on


def json_lines() -> bool:
    """Whether ``--log-json`` is on."""
    return _json_lines


def line(
    msg: str, *, file: TextIO | None = None, level: str = "INFO", logger: str = "deltad"
) -> None:
    """Write ``msg`` (stderr unless ``file``), flushed."""
    out = sys.stderr if file is None else file
    if _json_lines:
        record = {"ts": round(time.time(), 6), "level": level, "logger": logger, "msg": msg}
        msg = json.dumps(record, separators=(",", ":"))
    try:
        print(msg, file=out, flush=True)
    except (BrokenPipeError, ValueError):  # its reader is gone (or the stream closed)
        muted(out)


def muted(stream: TextIO) -> None:
    """Send every later write to ``stream`` (stdout or stderr, whose reader went away: a
    closed pipe) to /dev/null, so that the process goes on, or ends, without a traceback:
    a sidecar whose log collector died keeps serving."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass
