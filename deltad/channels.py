"""Options of the channels deltad's long-lived clients hold to a sidecar: the consumer
library's (one per rank, and those discovery opens) and a relay's to its upstream.

gRPC waits between its own attempts to reconnect a channel whose server went away, doubling
the wait (x1.6) up to two minutes by default; a call on a channel in that wait fails at once,
whatever deltad's retries do. After a sidecar was down a minute, a predictor would go on
failing for up to two more minutes after it came back (measured: 30 s after a 90 s outage).
The channel's reconnect backoff therefore follows the client's own retry backoff
(``backoff_initial_s`` up to ``backoff_max_s``): a predictor or relay is back within about
``backoff_max_s`` of its sidecar.
"""

from __future__ import annotations

from typing import Any

import grpc.experimental

from deltad import wire

#: Largest message a client sends (commits, requests: small).
MAX_SEND_MESSAGE_BYTES = 16 * 1024 * 1024


def stream_channel_options(
    *, backoff_initial_s: float, backoff_max_s: float
) -> list[tuple[str, Any]]:
    """Options for a channel that carries GetDelta streams, reconnecting after
    ``backoff_initial_s`` and at most every ``backoff_max_s`` while its server is away."""
    initial_ms = max(1, round(backoff_initial_s * 1000))
    return [
        ("grpc.max_receive_message_length", wire.CONSUMER_MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_SEND_MESSAGE_BYTES),
        # The thread reading a GetDelta stream drives it itself, instead of a channel thread
        # receiving every message and handing it over. Measured (1 GB fp32 window, decoded
        # in a pull thread, steady state): 1.4-1.5 -> 1.65-2.1 GB/s, client CPU 0.7 -> 0.5-0.6 s.
        (grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1),
        ("grpc.initial_reconnect_backoff_ms", initial_ms),
        ("grpc.max_reconnect_backoff_ms", max(initial_ms, round(backoff_max_s * 1000))),
    ]
