"""The gRPC edge: every DeltaService call is parsed, identified, authorized and admitted here,
once, before the servicer sees it.

* request bytes that do not parse (health checks' too) get INVALID_ARGUMENT (and at most one log line per
  ``deltad.serve.ratelog.LOG_EVERY_S``), never a traceback per request;
* the caller's :class:`~deltad.serve.edge.auth.Grant` comes from its one ``authorization: Bearer``
  header (two or more: UNAUTHENTICATED) or its mTLS client certificate's CN;
* out of scope: PERMISSION_DENIED before the servicer runs, so nothing changes;
* a request whose own fields are invalid (consumer name, form, dtype, k, fraction, row
  alignment, lease TTL: :func:`deltad.serve.windows.decide.check_request`) gets INVALID_ARGUMENT,
  checked here only;
* a consumer name the offset store does not know yet is admitted only below
  ``max_consumers`` (RESOURCE_EXHAUSTED otherwise, nothing stored; deltad.serve.edge.admission);
* ListConsumers shows a non-admin credential only its own consumers;
* a GetDelta as a relay's mirror (``mirror``: past the release caps) needs the relay or admin
  role; without it the pull is served capped, as the consumer it names.

Health checks are open; reflection needs a valid credential. Streams outside DeltaService
(health ``Watch``, reflection) hold a worker thread each for as long as their client keeps
them open: at most ``knobs.SIDE_STREAMS`` run at once (:class:`StreamCap`; past it
RESOURCE_EXHAUSTED), so nobody, with or without a credential, ties up the threads that serve
everything else.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from deltad import knobs
from deltad.errors import OffsetStoreError
from deltad.serve.edge import auth
from deltad.serve.edge.admission import Admission
from deltad.serve.edge.auth import Credentials, Grant
from deltad.serve.edge.grpcutil import abort as _abort
from deltad.serve.ratelog import RateLimitedLog
from deltad.serve.rollout import redacted_json
from deltad.serve.windows.decide import check_request

log = logging.getLogger(__name__)

SERVICE_PREFIX = "/deltad.v1.DeltaService/"
OPEN_PREFIX = "/grpc.health.v1.Health/"
#: Methods that may create a consumer (and so count against ``max_consumers``).
ADMITTING = frozenset({"GetDelta", "Register"})


class StreamCap:
    """At most ``limit`` streams at once (see the module docstring); :meth:`enter` refuses the
    one past it with RESOURCE_EXHAUSTED, and the slot is given back when the call ends."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.active = 0
        #: streams refused for want of a slot
        self.refused = 0
        self._lock = threading.Lock()

    def enter(self, context: grpc.ServicerContext, method: str) -> None:
        """Take a slot for the call of ``context`` until it ends, or abort."""
        with self._lock:
            if self.active >= self.limit:
                self.refused += 1
                full = True
            else:
                self.active += 1
                full = False
        if full:
            _abort(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{method}: {self.limit} health-watch and reflection streams are open on this "
                "sidecar already (knob SIDE_STREAMS); close one, or use Health/Check",
            )
        done = threading.Event()

        def leave() -> None:
            if not done.is_set():
                done.set()
                with self._lock:
                    self.active -= 1

        if not context.add_callback(leave):  # (the call ended already)
            leave()


class Gate(grpc.ServerInterceptor):
    """The edge interceptor (see the module docstring).

    ``credentials`` None: no authorization (every caller may do everything). ``admit(name)``
    answers whether a consumer may be served under the consumer limit (True for a known
    one); None: no limit. :meth:`set_credentials` swaps the credentials (SIGHUP reload).
    """

    def __init__(
        self,
        credentials: Credentials | None,
        admit: Callable[[str], bool] | None = None,
        *,
        max_consumers: int = 0,
        side_streams: int | None = None,
    ) -> None:
        self._credentials = credentials
        #: the consumer limit (None: no limit)
        self.admission = Admission(admit, max_consumers) if admit is not None else None
        self.max_consumers = max_consumers
        self.bad_requests = 0
        self.denied = 0
        self._bad_log = RateLimitedLog(logger=log)
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}
        self._deny_log = RateLimitedLog(logger=log)
        #: the streams outside DeltaService (health Watch, reflection)
        self.side_streams = StreamCap(knobs.SIDE_STREAMS if side_streams is None else side_streams)

    def set_credentials(self, credentials: Credentials | None) -> None:
        self._credentials = credentials

    def forget_admitted(self) -> None:
        """Drop the cache of admitted names (after consumers were forgotten), so a forgotten
        name is counted against the limit again."""
        if self.admission is not None:
            self.admission.forget()

    # --- decisions applied to a call ------------------------------------------------------

    def grant(self, context: grpc.ServicerContext) -> Grant:
        """The caller's grant, or abort UNAUTHENTICATED."""
        values = [v for k, v in context.invocation_metadata() or () if k == "authorization"]
        if len(values) > 1:
            self._denied("more than one authorization header")
            _abort(context, grpc.StatusCode.UNAUTHENTICATED, "more than one authorization header")
        creds = self._credentials
        if creds is None:
            return auth.OPEN
        if values:
            value = values[0]
            grant = None
            if isinstance(value, str) and value.startswith("Bearer "):
                grant = creds.for_token(value[7:])
            if grant is None:
                self._denied("invalid bearer token")
                _abort(context, grpc.StatusCode.UNAUTHENTICATED, "invalid bearer token")
            return grant
        for cn in context.auth_context().get("x509_common_name", ()):
            grant = creds.for_identity(cn.decode("utf-8", "replace"))
            if grant is not None:
                return grant
        self._denied("no credential")
        _abort(
            context,
            grpc.StatusCode.UNAUTHENTICATED,
            "missing or invalid bearer token (or client certificate not in the tokens file)",
        )

    def _denied(self, why: str) -> None:
        self.denied += 1
        self._deny_log.warning("refused a call: %s", why)

    def _parse(
        self, deserializer: Callable[[bytes], Any], raw: bytes, method: str, context: Any
    ) -> Any:
        try:
            return deserializer(raw)
        except Exception as e:  # DecodeError, or anything a hostile payload triggers
            self.bad_requests += 1
            self._bad_log.warning("malformed %s request (%d bytes): %s", method, len(raw), e)
            _abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"malformed {method} request: not a valid protobuf message",
            )

    def _check(self, grant: Grant, method: str, req: Any, context: Any) -> None:
        consumer = getattr(req, "consumer", None) if method in auth.CONSUMER_METHODS else None
        why = auth.may_call(grant, method, consumer)
        if why is None and method == "Status" and req.consumer:
            why = auth.may_ask_cap_of(grant, req.consumer)
        if why is None and method == "GetDelta" and getattr(req, "mirror", False):
            no_mirror = auth.may_mirror(grant)
            if no_mirror is not None:  # served as the consumer it names: capped
                req.mirror = False
                self._bad_log.warning("%s: served capped", no_mirror)
        if why is not None:
            self._denied(why)
            _abort(context, grpc.StatusCode.PERMISSION_DENIED, why)
        bad = check_request(method, req)  # the one check of the request's own fields
        if bad is not None:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, bad)
        if method in ADMITTING and self.admission is not None:
            try:
                ok = self.admission.admits(consumer or "")
            except OffsetStoreError as e:
                _abort(context, grpc.StatusCode.UNAVAILABLE, str(e))
            if not ok:
                _abort(
                    context,
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"the sidecar knows max_consumers={self.max_consumers} consumers or more; "
                    f"consumer {consumer!r} is new and not admitted: forget an idle one or "
                    "raise the limit",
                )

    # --- wrapping -------------------------------------------------------------------------

    def _wrap(self, h: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        deserialize = h.request_deserializer or (lambda b: b)
        if h.unary_unary is not None:
            fn = h.unary_unary

            def unary(raw: bytes, context: grpc.ServicerContext) -> Any:
                grant = self.grant(context)
                req = self._parse(deserialize, raw, method, context)
                self._check(grant, method, req, context)
                resp = fn(req, context)
                if method == "ListConsumers" and not grant.admin and resp is not None:
                    keep = [c for c in resp.consumers if auth.visible(grant, c.consumer)]
                    del resp.consumers[:]
                    resp.consumers.extend(keep)
                if method == "Status" and resp is not None and not auth.sees_release(grant):
                    resp.rollout_state = redacted_json(resp.rollout_state)
                return resp

            return grpc.unary_unary_rpc_method_handler(
                unary, response_serializer=h.response_serializer
            )
        if h.unary_stream is not None:
            gen = h.unary_stream

            def stream(raw: bytes, context: grpc.ServicerContext) -> Iterator[Any]:
                grant = self.grant(context)
                req = self._parse(deserialize, raw, method, context)
                self._check(grant, method, req, context)
                yield from gen(req, context)

            return grpc.unary_stream_rpc_method_handler(
                stream, response_serializer=h.response_serializer
            )
        return self._wrap_identified(h, method)

    def _wrap_open(self, h: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        """A health method (no credential needed): parsed here, so bytes that do not parse
        get INVALID_ARGUMENT and a rate-limited line, not INTERNAL and a traceback each."""
        deserialize = h.request_deserializer or (lambda b: b)
        if h.unary_unary is not None:
            fn = h.unary_unary

            def unary(raw: bytes, context: grpc.ServicerContext) -> Any:
                return fn(self._parse(deserialize, raw, method, context), context)

            return grpc.unary_unary_rpc_method_handler(
                unary, response_serializer=h.response_serializer
            )
        if h.unary_stream is not None:
            gen = h.unary_stream

            def stream(raw: bytes, context: grpc.ServicerContext) -> Iterator[Any]:
                req = self._parse(deserialize, raw, method, context)
                self.side_streams.enter(context, method)
                yield from gen(req, context)

            return grpc.unary_stream_rpc_method_handler(
                stream, response_serializer=h.response_serializer
            )
        return h

    def _wrap_identified(self, h: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        """Any other method (reflection's bidi stream): a valid credential, and a slot of
        :attr:`side_streams` for a stream."""
        kw = {
            "request_deserializer": h.request_deserializer,
            "response_serializer": h.response_serializer,
        }
        if h.stream_stream is not None:
            bidi = h.stream_stream

            def stream_stream(it: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
                self.grant(context)
                self.side_streams.enter(context, method)
                yield from bidi(it, context)

            return grpc.stream_stream_rpc_method_handler(stream_stream, **kw)
        if h.stream_unary is not None:
            su = h.stream_unary

            def stream_unary(it: Iterator[Any], context: grpc.ServicerContext) -> Any:
                self.grant(context)
                self.side_streams.enter(context, method)
                return su(it, context)

            return grpc.stream_unary_rpc_method_handler(stream_unary, **kw)
        if h.unary_stream is not None:
            us = h.unary_stream

            def unary_stream(req: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                self.grant(context)
                self.side_streams.enter(context, method)
                yield from us(req, context)

            return grpc.unary_stream_rpc_method_handler(unary_stream, **kw)
        uu = h.unary_unary

        def unary_unary(req: Any, context: grpc.ServicerContext) -> Any:
            self.grant(context)
            return uu(req, context)

        return grpc.unary_unary_rpc_method_handler(unary_unary, **kw)

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(details)
        method = details.method
        if handler is None:
            return handler
        cached = self._wrapped.get(method)
        if cached is not None and cached[0] is handler:  # the servicer's handlers are static
            return cached[1]
        if method.startswith(OPEN_PREFIX):
            wrapped = self._wrap_open(handler, method[len(OPEN_PREFIX) :])
        elif method.startswith(SERVICE_PREFIX):
            wrapped = self._wrap(handler, method[len(SERVICE_PREFIX) :])
        else:
            wrapped = self._wrap_identified(handler, method)
        if len(self._wrapped) < 64:
            self._wrapped[method] = (handler, wrapped)
        return wrapped
