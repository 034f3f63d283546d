"""Tunables: performance settings users never need to set, kept apart from the user settings
in :mod:`deltad.config` (the pattern of torchsnapshot's ``knobs.py``).

Each knob is a module-level default. The environment overrides it when deltad is imported:
``DELTAD_KNOB_<NAME>`` (for example ``DELTAD_KNOB_WRITER_NICE=0``); a value that does not parse
or is out of range raises :class:`~deltad.errors.ConfigError` naming the variable. Code reads
the knobs at use time (``knobs.WRITER_NICE``), so a benchmark or a test may also change one for
a block with :func:`override`.

The knobs (default in brackets):

* ``WRITER_NICE`` [10]: niceness added to the publisher's writer thread (Linux: per thread;
  0 = leave it), so its checksum/write/fsync yields the cores to the training loop (0..19).
* ``REUSE_COPY_BUFFERS`` [1]: copy touched rows into reused (pooled) host buffers instead of
  new ones, which page-fault on first write.
* ``COPY_POOL_MAX_BYTES`` [64 GiB]: most bytes the publisher's copy-buffer pool keeps.
* ``COPY_POOL_GRANULE`` [4096]: its buffers are rounded up to this many bytes,
* ``COPY_POOL_HEADROOM`` [0.125]: and made this fraction larger than the rows copied.
* ``FOLD_IN_BACKGROUND`` [1]: CPU weights: the tracker folds each lookup's ids into its bitmaps
  on a background thread, not in the output dist's hook (device weights: always in the hook).
* ``FOLD_BATCH_IDS`` [65536]: with that fold thread, lookups are handed to it in batches of
  this many ids (and at every drain): the hook only appends to a list, and the thread is
  woken once per batch (>= 0; 0 = every lookup at once).
* ``MAX_PENDING_FOLDS`` [16]: batches of lookups (or drains) waiting for that fold thread
  before the training loop's hook blocks (>= 1).
* ``MERGE_MAX_BYTES_PER_ROUND`` [1 GiB]: the sidecar's retention: most input bytes one
  background round may merge (bounded work per round, >= 1).
* ``STATUS_WAITERS`` [64]: long-polling Status calls a sidecar holds at once (each holds an RPC
  worker thread; past it a Status answers at once and says it did not wait; >= 0).
* ``STATUS_MAX_WAIT_S`` [30]: longest a long-polling Status call is held (> 0).
* ``SIDE_STREAMS`` [8]: streams outside deltad's own service (health ``Watch``, reflection) a
  sidecar holds at once: each holds an RPC worker thread for as long as its client keeps it
  open, so past this many a new one is refused with RESOURCE_EXHAUSTED, and the threads that
  serve GetDelta, Status and the health checks stay free (>= 0; 0 = none served).
* ``IDLE_HEAP_TRIM_S`` [30]: the sidecar hands the free heap malloc keeps (freed windows and
  merges: :mod:`deltad.perf` tunes malloc to keep it for the next pull) back to the kernel once
  no GetDelta stream has run for this many seconds (0 = never; >= 0),
* ``IDLE_HEAP_TRIM_MIN_BYTES`` [16 MiB]: when at least this much is free (>= 0).
* ``IDLE_PAGE_OUT_LIBRARIES`` [1]: in the same idle spell, once, the sidecar also gives back the
  resident pages of its loaded libraries' code (:func:`deltad.perf.page_out_libraries`: clean
  file pages, mostly libtorch's start-up; the next pull reads back the few it uses). 0 = keep.
* ``KEEPALIVE_S`` [10]: a client (consumer, relay) pings its sidecar once nothing arrived on a
  connection for this long, pulls in flight or not (0 = no keepalive pings; else >= 1:
  sidecars accept a client's pings every half second or slower),
* ``PING_TIMEOUT_S`` [10]: and drops a connection whose sidecar answers no ping within this (or
  its RPC deadline, the shorter), then connects again: a sidecar gone without a word (a dead
  node, a partition, a proxy that keeps the TCP connection up) is left within about the two
  together, 20 s; gRPC's defaults send no keepalive pings and wait 60 s for any other (> 0).
* ``SERVER_KEEPALIVE_S`` [30]: a sidecar pings a client connection on which nothing arrived for
  this long and closes it after ``PING_TIMEOUT_S`` without an answer: a predictor that vanished
  without a word (its node died) no longer holds its connection, and the bytes queued on it,
  for gRPC's default two hours (0 = two hours; else >= 1).
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from deltad.errors import ConfigError

PREFIX = "DELTAD_KNOB_"

_T = TypeVar("_T")


def _parse_bool(raw: str) -> bool:
    low = raw.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {raw!r:.20}")


#: Each knob's range check, for the environment and :func:`override`.
_CHECKS: dict[str, Callable[[Any], bool]] = {}


def _knob(name: str, default: _T, parse: Callable[[str], _T], ok: Callable[[_T], bool]) -> _T:
    """``default``, or the environment's ``DELTAD_KNOB_<name>`` if set (checked by ``ok``;
    a float must be finite too: nan and inf are out of every range)."""

    def finite_and_ok(v: _T) -> bool:
        return (not isinstance(v, float) or math.isfinite(v)) and ok(v)

    _CHECKS[name] = finite_and_ok
    raw = os.environ.get(PREFIX + name)
    if raw is None:
        return default
    try:
        value = parse(raw)
    except ValueError:
        raise ConfigError(f"{PREFIX}{name}={raw!r:.20}: not a valid value") from None
    if not finite_and_ok(value):
        raise ConfigError(f"{PREFIX}{name}={raw!r:.20}: out of range")
    return value


WRITER_NICE: int = _knob("WRITER_NICE", 10, int, lambda v: 0 <= v <= 19)
REUSE_COPY_BUFFERS: bool = _knob("REUSE_COPY_BUFFERS", True, _parse_bool, lambda v: True)
COPY_POOL_MAX_BYTES: int = _knob("COPY_POOL_MAX_BYTES", 64 << 30, int, lambda v: v >= 0)
COPY_POOL_GRANULE: int = _knob("COPY_POOL_GRANULE", 4096, int, lambda v: v >= 1)
COPY_POOL_HEADROOM: float = _knob("COPY_POOL_HEADROOM", 0.125, float, lambda v: v >= 0)
FOLD_IN_BACKGROUND: bool = _knob("FOLD_IN_BACKGROUND", True, _parse_bool, lambda v: True)
FOLD_BATCH_IDS: int = _knob("FOLD_BATCH_IDS", 65536, int, lambda v: v >= 0)
MAX_PENDING_FOLDS: int = _knob("MAX_PENDING_FOLDS", 16, int, lambda v: v >= 1)
MERGE_MAX_BYTES_PER_ROUND: int = _knob("MERGE_MAX_BYTES_PER_ROUND", 1 << 30, int, lambda v: v >= 1)
STATUS_WAITERS: int = _knob("STATUS_WAITERS", 64, int, lambda v: v >= 0)
STATUS_MAX_WAIT_S: float = _knob("STATUS_MAX_WAIT_S", 30.0, float, lambda v: v > 0)
SIDE_STREAMS: int = _knob("SIDE_STREAMS", 8, int, lambda v: v >= 0)
IDLE_HEAP_TRIM_S: float = _knob("IDLE_HEAP_TRIM_S", 30.0, float, lambda v: v >= 0)
IDLE_HEAP_TRIM_MIN_BYTES: int = _knob("IDLE_HEAP_TRIM_MIN_BYTES", 16 << 20, int, lambda v: v >= 0)
IDLE_PAGE_OUT_LIBRARIES: bool = _knob("IDLE_PAGE_OUT_LIBRARIES", True, _parse_bool, lambda v: True)
PING_TIMEOUT_S: float = _knob("PING_TIMEOUT_S", 10.0, float, lambda v: v > 0)
KEEPALIVE_S: float = _knob("KEEPALIVE_S", 10.0, float, lambda v: v == 0 or v >= 1)
SERVER_KEEPALIVE_S: float = _knob("SERVER_KEEPALIVE_S", 30.0, float, lambda v: v == 0 or v >= 1)

#: The knobs' names.
NAMES = tuple(_CHECKS)


@contextmanager
def override(**values: Any) -> Iterator[None]:
    """Set knobs (by name, e.g. ``override(WRITER_NICE=7)``) for the block, then restore them.

    Process-wide: every thread sees the new values while the block runs.
    """
    module = sys.modules[__name__]
    unknown = sorted(set(values) - set(NAMES))
    if unknown:
        raise ConfigError(f"unknown knobs {unknown}; known: {list(NAMES)}")
    for name, value in values.items():
        if not _CHECKS[name](value):
            raise ConfigError(f"knob {name}={value!r:.20}: out of range")
    old = {name: getattr(module, name) for name in values}
    for name, value in values.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in old.items():
            setattr(module, name, value)
