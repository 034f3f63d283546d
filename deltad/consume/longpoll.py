"""Waiting for a publish: a long-polling Status held on every rank until a head moves on."""

from __future__ import annotations

import threading
import time

import grpc

from deltad.consume.sidecars import Sidecars

#: The longest wait asked of a sidecar (seconds).
MAX_WAIT_S = 86400.0


def wait_for_new(sidecars: Sidecars, timeout_s: float, stop: threading.Event | None) -> bool:
    """Block until a rank publishes past what the consumer has seen of it, or ``timeout_s``;
    True if something is new (see :meth:`deltad.consume.client.DeltaConsumer.wait_for_new`)."""
    ranks = sidecars.ranks
    # a sidecar holds a long poll at most STATUS_MAX_WAIT_S (30 s) anyway; longer waits,
    # inf too, are cut to a day (StatusRequest.wait_ms is a uint32 of milliseconds)
    timeout_s = min(timeout_s, MAX_WAIT_S)
    if timeout_s <= 0 or any(r.needs_base and r.seen[1] >= 0 for r in ranks):
        return True  # a rank has segments this consumer has not pulled yet
    # (a rank with nothing published yet, seen (0, -1), is waited for like any other:
    # its sidecar answers once the trainer's first segment lands)
    answered = threading.Event()
    calls = []
    for r in ranks:
        try:
            call = sidecars.wait_past(r, timeout_s)
        except grpc.RpcError:
            return False
        call.add_done_callback(lambda _: answered.set())
        calls.append((r, call))
    try:
        end = time.monotonic() + timeout_s + 1.0  # each call has its own deadline too
        while not answered.wait(0.1 if stop is not None else timeout_s + 1.0):
            if (stop is not None and stop.is_set()) or time.monotonic() >= end:
                break
        moved = False
        for r, call in calls:
            if not call.done() or call.cancelled() or call.exception() is not None:
                continue
            st = call.result()
            if (st.generation, st.head_seq) > r.seen:
                moved = True
            if st.rollout_state and r.rollout_version not in (None, st.rollout_version):
                moved = True  # released (or held): the cap moved
        return moved
    finally:
        for _, call in calls:
            call.cancel()
