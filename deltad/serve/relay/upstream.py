"""The relay's calls to its upstream: channel and credentials, lease, Status, pulls and commits."""

from __future__ import annotations

import logging
import time

import grpc

from deltad.channels import stream_channel_options
from deltad.clientauth import ClientAuth
from deltad.config import RelayConfig
from deltad.consume import decode
from deltad.consume.window import RankDelta
from deltad.v1 import delta_pb2 as pb
from deltad.v1 import delta_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

#: A mirror pull whose stream brings no message for this long is cancelled (and retried); the
#: whole stream may run ``stream_deadline_s`` (a base over a slow link).
STALL_S = 30.0

#: Commit answers no retry changes: the upstream refuses this cursor for good.
_FINAL_COMMIT = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND)

#: Answers that mean the upstream refuses this relay's credentials or scope (no retry helps
#: until someone fixes them): readiness turns NOT_SERVING.
_REFUSED = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
#: Transport failures that are a TLS refusal (wrong CA, rejected client certificate), not
#: an upstream that is down.
_TLS_REFUSAL = ("ssl", "handshake", "certificate", "tls")


def refuses(e: grpc.RpcError) -> bool:
    """Whether ``e`` is the upstream refusing the relay (credentials, scope or TLS trust)."""
    if e.code() in _REFUSED:
        return True
    details = (e.details() or "").lower()
    return e.code() == grpc.StatusCode.UNAVAILABLE and any(w in details for w in _TLS_REFUSAL)


class Upstream:
    """A relay's session with its upstream sidecar as the consumer ``config.consumer``: the
    channel (a new one when the TLS files change), the lease, and the cursor committed
    upstream as far as the relay knows. gRPC errors propagate (the mirror retries them)."""

    def __init__(self, config: RelayConfig) -> None:
        self.config = config
        self._auth = ClientAuth.of(config)
        #: a mirror pull's wait for each message (and the channel's ping timeout)
        self._stall_s = min(STALL_S, config.rpc_deadline_s)
        self._options = stream_channel_options(
            backoff_initial_s=config.backoff_initial_s,
            backoff_max_s=config.backoff_max_s,
            deadline_s=self._stall_s,
        )
        self._channel = self._auth.channel(config.upstream, self._options)
        self._stub = pb_grpc.DeltaServiceStub(self._channel)
        self.registered = False
        #: the cursor of the last pull, until it is committed
        self.pending: pb.Cursor | None = None
        #: (generation, seq) committed upstream, as far as the relay knows
        self.committed: tuple[int, int] | None = None
        self._touched = 0.0
        #: how long the upstream held the last Status (0 when it did not wait)
        self.waited_s = 0.0
        #: mirror pulls across their attempts: a window whose stream broke goes on there
        self._stream = decode.ResumableStream(decode.WindowAssembler)
        #: mirror pulls that went on where a broken one stopped
        self.resumed = 0
        #: the last pull broke after bringing messages the next one goes on from
        self.progressed = False

    @property
    def _metadata(self) -> tuple[tuple[str, str], ...]:
        return self._auth.metadata()

    def close(self) -> None:
        """Close the channel: a call in flight is cancelled."""
        self._channel.close()

    def reconnect_if_changed(self) -> None:
        """Re-read credential files that changed (a new channel if the TLS files did)."""
        if self._auth.tls_changed():
            log.info("upstream %s: new TLS credentials, reconnecting", self.config.upstream)
            self._channel.close()
            self._channel = self._auth.channel(self.config.upstream, self._options)
            self._stub = pb_grpc.DeltaServiceStub(self._channel)

    def register(self) -> pb.Cursor:
        """Take the lease; the upstream's committed cursor of this relay (seq -1: none)."""
        resp = self._stub.Register(
            pb.RegisterRequest(
                consumer=self.config.consumer, lease_ttl_seconds=self.config.lease_ttl_s
            ),
            timeout=min(10.0, self.config.rpc_deadline_s),
            metadata=self._metadata,
        )
        c = resp.cursor
        self.committed = (c.generation, c.seq) if c.seq >= 0 else None
        self.registered = True
        self._touched = time.monotonic()
        return c

    def keep_lease(self) -> bool:
        """Renew the lease once a third of it passed since the last call; False if the
        upstream no longer knows it (expired: register again)."""
        if time.monotonic() - self._touched < self.config.lease_ttl_s / 3:
            return True
        try:
            self._stub.Heartbeat(
                pb.HeartbeatRequest(consumer=self.config.consumer),
                timeout=min(10.0, self.config.rpc_deadline_s),
                metadata=self._metadata,
            )
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.NOT_FOUND:
                raise
            return False
        self._touched = time.monotonic()
        return True

    def commit(self) -> None:
        """Commit :attr:`pending`; a commit the upstream refuses for good is logged and
        dropped (the next pull re-sends what is not committed, and the relay holds it)."""
        cursor = self.pending
        assert cursor is not None
        try:
            self._stub.Commit(
                pb.CommitRequest(consumer=self.config.consumer, cursor=cursor),
                timeout=min(10.0, self.config.rpc_deadline_s),
                metadata=self._metadata,
            )
        except grpc.RpcError as e:
            if e.code() not in _FINAL_COMMIT:
                raise
            # refused for good (superseded, older generation, forgotten): the next pull
            # re-sends whatever is not committed, and the relay already holds it
            log.warning("upstream refused the commit of seq %d: %s", cursor.seq, e.details())
            self.committed = max(self.committed or (-1, -1), (cursor.generation, cursor.seq))
        else:  # (the upstream's cursor now: back too, after a resync at a held step)
            self.committed = (cursor.generation, cursor.seq)
        self.pending = None

    def status(
        self, after: tuple[int, int] | None = None, rollout_version: int = 0
    ) -> pb.StatusResponse:
        """The upstream's Status; a long poll (answered when its head passes ``after``, a
        ``(generation, seq)``, or its release state passes ``rollout_version``) when
        ``after`` is given. Sets :attr:`waited_s`."""
        c = self.config
        wait = min(c.long_poll_s, c.lease_ttl_s / 3)
        req = pb.StatusRequest()
        if after is not None and wait > 0:
            req = pb.StatusRequest(
                after_generation=after[0], after_seq=after[1], wait_ms=int(wait * 1000),
                after_rollout_version=rollout_version,
            )  # fmt: skip
        start = time.monotonic()
        st = self._stub.Status(
            req, timeout=min(10.0, c.rpc_deadline_s) + req.wait_ms / 1000,
            metadata=self._metadata,
        )  # fmt: skip
        self.waited_s = time.monotonic() - start if st.waited else 0.0
        return st

    def pull(self, from_base: bool, max_step: int | None = None) -> RankDelta:
        """One mirror pull: rows form, fp32, with the dense state, no generation diff
        (``from_base``: the full tables), up to the head or to ``max_step``."""
        req = pb.GetDeltaRequest(
            consumer=self.config.consumer, form=pb.FORM_ROWS, dtype=pb.WIRE_DTYPE_FP32,
            from_base=from_base, no_generation_diff=True, mirror=True, with_dense=True,
        )  # fmt: skip
        if max_step is not None:
            req.max_step = max_step
        # a window whose stream broke goes on where it broke (GetDeltaRequest.resume): over a
        # link that drops more often than a base takes, starting over would never finish
        ask, asm = self._stream.next(req)
        if ask is not req:
            self.resumed += 1
            log.info("upstream %s: resuming a window after %d messages", self.config.upstream,
                     asm.messages)  # fmt: skip
        self.progressed = False
        try:
            d = decode.pull(
                self._channel, ask, metadata=self._metadata,
                timeout=max(self.config.rpc_deadline_s, self.config.stream_deadline_s),
                stall_s=self._stall_s, assembler=asm,
            )  # fmt: skip
        except grpc.RpcError:
            self.progressed = self._stream.progressed()
            raise
        except BaseException:
            self._stream.forget()  # (NotResumed, ...: the mirror loop's next pull starts over)
            raise
        self._stream.forget()  # (the window pulled is the caller's: not kept here)
        self._touched = time.monotonic()
        return d
