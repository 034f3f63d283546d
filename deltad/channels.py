"""Options of deltad's long-lived gRPC connections: the channels its clients hold to a sidecar
(the consumer library's, one per rank and those discovery opens; a relay's to its upstream)
and what a sidecar accepts of them.

**Reconnecting.** gRPC waits between its own attempts to reconnect a channel whose server went
away, growing the wait x1.6 up to two minutes by default; a call in that wait fails at once,
whatever deltad's retries do. After a sidecar was down a minute, a predictor went on failing
for up to two more minutes after it came back (measured: 30 s after a 90 s outage). The
channel's reconnect backoff follows the client's own retry backoff (``backoff_initial_s`` up
to ``backoff_max_s``): a predictor or relay is back within about ``backoff_max_s``.

**A sidecar gone without a word** (its node died, a partition, a proxy that keeps the TCP
connection up: no FIN, no RST) left its clients' calls timing out on the dead connection until
a ping on it went unanswered: gRPC's clients send no keepalive pings by default and wait 60 s
for the answer to any other (a flow-control ping that happened to be in flight). Measured:
60.2 s when such a ping was in flight, not within 300 s when none was. A client pings once
nothing arrived on a connection for ``knobs.KEEPALIVE_S`` (10 s) and drops it when no answer
comes within ``knobs.PING_TIMEOUT_S`` (10 s) or its RPC deadline, the shorter: left within
about 20 s. A sidecar accepts those pings (gRPC's server default strikes a client that pings
more often than every 5 minutes without data, and sends it away), and pings its clients in
turn (``knobs.SERVER_KEEPALIVE_S``, 30 s): a predictor gone without a word no longer holds its
connection for gRPC's server default of two hours.
"""

from __future__ import annotations

from typing import Any

import grpc.experimental

from deltad import knobs, wire

#: Largest message a client sends (commits, requests: small).
MAX_SEND_MESSAGE_BYTES = 16 * 1024 * 1024
#: A sidecar accepts a client's pings this often (knobs.KEEPALIVE_S is at least twice this).
MIN_PING_INTERVAL_MS = 500


def _ms(seconds: float) -> int:
    return max(1, min(2**31 - 1, round(seconds * 1000)))


#: What every GetDelta channel carries, whatever its liveness options.
STREAM_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.max_receive_message_length", wire.CONSUMER_MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_SEND_MESSAGE_BYTES),
    # The thread reading a GetDelta stream drives it itself, instead of a channel thread
    # receiving every message and handing it over. Measured (1 GB fp32 window, decoded in a
    # pull thread, steady state): 1.4-1.5 -> 1.65-2.1 GB/s, client CPU 0.7 -> 0.5-0.6 s.
    (grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1),
)


def liveness_options(
    *, backoff_initial_s: float, backoff_max_s: float, deadline_s: float
) -> list[tuple[str, Any]]:
    """What gRPC otherwise defaults: reconnecting after ``backoff_initial_s`` and at most
    every ``backoff_max_s`` while the server is away, keepalive pings, and dropping a
    connection whose server answers no ping within ``knobs.PING_TIMEOUT_S`` or
    ``deadline_s`` (the client's RPC deadline), the shorter."""
    initial_ms = _ms(backoff_initial_s)
    ping_timeout_ms = _ms(min(knobs.PING_TIMEOUT_S, deadline_s))
    options: list[tuple[str, Any]] = [
        ("grpc.initial_reconnect_backoff_ms", initial_ms),
        ("grpc.max_reconnect_backoff_ms", max(initial_ms, _ms(backoff_max_s))),
        # every ping on the connection (keepalive, flow-control) is answered within this
        ("grpc.http2.ping_timeout_ms", ping_timeout_ms),
    ]
    if knobs.KEEPALIVE_S > 0:
        options += [
            ("grpc.keepalive_time_ms", _ms(knobs.KEEPALIVE_S)),
            ("grpc.keepalive_timeout_ms", ping_timeout_ms),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
        ]
    return options


def stream_channel_options(
    *, backoff_initial_s: float, backoff_max_s: float, deadline_s: float
) -> list[tuple[str, Any]]:
    """Options for a channel that carries GetDelta streams: :data:`STREAM_OPTIONS` and
    :func:`liveness_options`."""
    return [
        *STREAM_OPTIONS,
        *liveness_options(
            backoff_initial_s=backoff_initial_s, backoff_max_s=backoff_max_s, deadline_s=deadline_s
        ),
    ]


def server_ping_options() -> list[tuple[str, Any]]:
    """A sidecar's server options: its clients' keepalive pings are let in (every
    :data:`MIN_PING_INTERVAL_MS` or slower, with or without calls in flight; the argument is
    gRPC's GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS), and it pings a client
    connection idle for ``knobs.SERVER_KEEPALIVE_S``, closing it after
    ``knobs.PING_TIMEOUT_S`` without an answer."""
    options: list[tuple[str, Any]] = [
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
    ]
    if knobs.SERVER_KEEPALIVE_S > 0:
        options += [
            ("grpc.keepalive_time_ms", _ms(knobs.SERVER_KEEPALIVE_S)),
            ("grpc.keepalive_timeout_ms", _ms(knobs.PING_TIMEOUT_S)),
            # (the keepalive ping's answer is waited for this long: without it, 60 s)
            ("grpc.http2.ping_timeout_ms", _ms(knobs.PING_TIMEOUT_S)),
            ("grpc.http2.max_pings_without_data", 0),
        ]
    return options
