"""The model's release state (deltad.serve.rollout.ReleaseState) in Redis: one JSON string per
model (``RedisKeys.rollout``), changed by an atomic read-modify-write (WATCH/MULTI), read by
every sidecar through a short cache (:class:`RolloutView`: at most ``ttl_s`` stale).

A stored value that is not a state the controls could have written (``{}``, a pin at step
2^63-1, a field of the wrong type or unknown: ReleaseState.from_json) is refused as a bad
segment is: never applied. Every sidecar keeps the last valid state it read (one that never
read one serves nothing), logs it (rate-limited), counts it (``deltad_release_state_refused``)
and says it in Status (``"refused"`` in the state's JSON, shown by ``deltad status``); the next
control sent to a sidecar that holds a valid state writes that state back, changed.

A relay follows its upstream instead (:class:`FollowedRollout`: the state the upstream's
Status answered), so every level of a relay tree serves its consumers with the model's caps.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Protocol

import redis

from deltad.errors import OffsetStoreError
from deltad.keys import RedisKeys
from deltad.segment.spool import read_small_file, write_atomic
from deltad.serve.ratelog import RateLimitedLog
from deltad.serve.rollout import ReleaseState
from deltad.serve.state.redis_calls import RedisCalls

log = logging.getLogger(__name__)

#: A read-modify-write that keeps losing its WATCH race gives up after this many tries.
UPDATE_ATTEMPTS = 50
#: How stale a sidecar's view of the state may be (seconds).
VIEW_TTL_S = 0.25


class RolloutSource(Protocol):
    """Where a server reads the release state it applies. ``known``: False while a relay has
    not heard its upstream's state (it serves nothing then); ``state_json``: the state for
    Status and ``rollout status`` (:data:`UNKNOWN_JSON` while not known)."""

    @property
    def known(self) -> bool: ...

    @property
    def unknown_reason(self) -> str: ...

    def state(self) -> ReleaseState: ...

    def state_json(self) -> str: ...


class InvalidReleaseState(OffsetStoreError):
    """The value stored is not a release state the controls could have written."""


class RolloutStore:
    """The release state of one model in Redis.

    ``last_valid``: the newest valid state read or written (None: none yet); ``refused``: why
    the stored value is refused ("" if it is not), and ``refused_values`` how many distinct
    bad values were read."""

    def __init__(
        self, client: redis.Redis, model: str, *, attempts: int = 5, calls: RedisCalls | None = None
    ) -> None:
        self.client = client
        self.key = RedisKeys(model).rollout()
        self.attempts = max(1, attempts)
        #: How calls reach Redis: the offset store's (its URL, deadlines, down flag) if given.
        self.calls = calls or RedisCalls(client, attempts=attempts)
        self.last_valid: ReleaseState | None = None
        self.refused = ""
        self.refused_values = 0
        #: set by :meth:`update` when it replaced a refused value (the answer says so)
        self.replaced = ""
        self._bad_raw: bytes | str | None = None
        self._lock = threading.Lock()

    def _read(self, raw: str | bytes | None) -> ReleaseState:
        """The state stored as ``raw``; InvalidReleaseState (recorded) if it is not one."""
        if raw is None:
            state = ReleaseState()
        else:
            try:
                state = _parsed(self.key, raw)
            except InvalidReleaseState as e:
                with self._lock:
                    if raw != self._bad_raw:
                        self._bad_raw = raw
                        self.refused_values += 1
                    self.refused = str(e)
                raise
        with self._lock:
            self.refused, self._bad_raw, self.last_valid = "", None, state
        return state

    def _retry(
        self, what: str, fn: Callable[[], ReleaseState], attempts: int | None = None
    ) -> ReleaseState:
        return self.calls.retry(f"release state {what}", fn, attempts=attempts or self.attempts)

    def get(self, *, attempts: int | None = None) -> ReleaseState:
        """The stored state (the default, everything released, if none is stored)."""

        def run() -> ReleaseState:
            return self._read(self.client.get(self.key))  # type: ignore[arg-type]

        return self._retry("get", run, attempts)

    def update(self, change: Callable[[ReleaseState], ReleaseState]) -> ReleaseState:
        """Apply ``change`` to the stored state atomically and return the new state (the
        stored one if ``change`` returned it unchanged: nothing is written). ``change`` may
        run several times (a concurrent writer won the race); its errors propagate."""

        def run() -> ReleaseState:
            for _ in range(UPDATE_ATTEMPTS):
                with self.client.pipeline() as pipe:
                    try:
                        pipe.watch(self.key)
                        raw = pipe.get(self.key)
                        self.replaced = ""
                        try:
                            old = self._read(raw)  # type: ignore[arg-type]
                        except InvalidReleaseState as e:
                            # a control repairs a refused value: from the last valid state
                            # this process read (the one it serves); none: refused
                            if self.last_valid is None:
                                raise InvalidReleaseState(
                                    f"{e}; this sidecar never read a valid one to start from: "
                                    f"fix the value, or delete {self.key} (everything released)"
                                ) from e
                            old, self.replaced = self.last_valid, str(e)
                        new = change(old)
                        if new == old and not self.replaced:
                            pipe.unwatch()
                            return old
                        new = replace(new, version=old.version + 1)
                        pipe.multi()
                        pipe.set(self.key, new.to_json())
                        pipe.execute()
                        with self._lock:
                            self.last_valid, self.refused, self._bad_raw = new, "", None
                        return new
                    except redis.WatchError:
                        continue
            raise OffsetStoreError(
                f"release state: {UPDATE_ATTEMPTS} concurrent writers won the race in a row"
            )

        return self._retry("update", run)


def _parsed(key: str, raw: str | bytes) -> ReleaseState:
    """The stored state; OffsetStoreError naming the key if it is malformed (a reader keeps
    its last state; an operator can delete the key: everything released)."""
    try:
        return ReleaseState.from_json(raw)
    except (ValueError, TypeError, KeyError, IndexError) as e:
        raise InvalidReleaseState(
            f"the release state in Redis ({key}) is malformed (refused, never applied): "
            f"{str(e)[:300]}"
        ) from e


class RolloutView:
    """A sidecar's cached view of the stored state: re-read at most every ``ttl_s``; while
    Redis does not answer, or holds a value that is not a valid state (refused: logged at
    most once a minute, counted in :attr:`store` ``.refused_values``), the last valid state
    read stays in force. Until one read succeeded the state is not ``known`` (a malformed
    stored state at start: nothing is served, rather than everything)."""

    def __init__(self, store: RolloutStore, ttl_s: float = VIEW_TTL_S) -> None:
        self.store = store
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._state = ReleaseState()
        self._read_at = -float("inf")
        self._failing = False
        self._read_once = False
        self._problem = "not read yet"
        self._refusals = RateLimitedLog(60.0, logger=log)

    @property
    def known(self) -> bool:
        self.state()
        return self._read_once

    @property
    def unknown_reason(self) -> str:
        return f"nothing is served until the release state is read: {self._problem}"[:512]

    @property
    def refused(self) -> str:
        """Why the stored value is refused ("" if it is not)."""
        self.state()
        return self.store.refused

    def state(self) -> ReleaseState:
        now = time.monotonic()
        if now - self._read_at < self.ttl_s:
            return self._state
        with self._lock:
            if time.monotonic() - self._read_at < self.ttl_s:
                return self._state
            try:
                self._state = self.store.get(attempts=1)  # fail fast: the last one stays
                self._read_once = True
                if self._failing:
                    log.info("release state readable again (version %d)", self._state.version)
                self._failing = False
            except InvalidReleaseState as e:
                self._problem = str(e)
                self._failing = True
                kept = (
                    f"the last valid one (version {self._state.version}) stays in force"
                    if self._read_once
                    else "nothing is served until a valid one is stored"
                )
                self._refusals.warning("%s; %s", e, kept)
            except OffsetStoreError as e:
                if not self._failing:
                    log.warning("release state unreadable, the last one read stays: %s", e)
                self._failing = True
                self._problem = str(e)
            self._read_at = time.monotonic()
            return self._state

    def refresh(self) -> ReleaseState:
        """The state read now, whatever the cache's age (a Status that reports a generation
        for the first time: its state must be as new as that generation, see StatusRpc)."""
        with self._lock:
            self._read_at = -float("inf")
        return self.state()

    def state_json(self) -> str:
        """The state for Status; while not known (never read: a malformed value in Redis),
        "unknown" with why, so relays keep the state they have rather than take the default
        "everything released" as the model's; while the stored value is refused, the state
        in force with ``"refused"``: why."""
        if not self.known:
            return unknown_json(f"unreadable in Redis: {self._problem}")
        state = self.state()
        refused = self.store.refused
        if not refused:
            return state.to_json()
        d = json.loads(state.to_json())
        d["refused"] = refused[:500]
        return json.dumps(d, separators=(",", ":"), sort_keys=True)

    def set(self, state: ReleaseState) -> None:
        """Take a state this process just wrote (no wait for the next read)."""
        with self._lock:
            if state.version >= self._state.version or self._failing:
                self._state, self._read_at = state, time.monotonic()
                self._read_once = True


class FollowedRollout:
    """A relay's state: the last one its upstream's Status answered, kept in ``path`` (the
    relay's spool), so a relay restarted while its upstream is unreachable applies the last
    state it knew, not "everything released" (a hold would be lost exactly when things go
    wrong). ``known`` is False until a state was heard or read back: the relay then serves
    its consumers nothing (:data:`UNKNOWN_JSON` in its Status, so relays below it wait too)."""

    def __init__(self, path: Path | None = None, *, fsync: bool = True) -> None:
        self._state = ReleaseState()
        self._told_redacted = False
        self.path = path
        self.fsync = fsync
        self.known = False
        #: why the model's stored state is refused, as the upstream said ("" if it is not)
        self.refused = ""
        if path is not None and path.exists():
            try:
                self._state = ReleaseState.from_json(read_small_file(path))
                self.known = True
                log.info("release state as last followed: version %d", self._state.version)
            except (OSError, ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
                log.warning("cannot read the release state last followed (%s): %s", path, e)

    def state(self) -> ReleaseState:
        return self._state

    #: (why nothing is served while not ``known``)
    unknown_reason = (
        "this relay has not heard its upstream's release state yet (is the upstream "
        "reachable?): nothing is served until it has"
    )

    def state_json(self) -> str:
        """The state for this relay's own Status: :data:`UNKNOWN_JSON` while not known; with
        the upstream's ``"refused"`` (the model's stored value is refused) passed on."""
        if not self.known:
            return UNKNOWN_JSON
        if not self.refused:
            return self._state.to_json()
        d = json.loads(self._state.to_json())
        d["refused"] = self.refused
        return json.dumps(d, separators=(",", ":"), sort_keys=True)

    def follow(self, raw: str) -> None:
        """Take the upstream's state (its JSON; "" from an upstream without rollout state:
        everything released); a malformed one is logged and ignored, and so is an upstream
        relay's "not known yet" (this relay keeps what it knows)."""
        try:
            d = json.loads(raw) if raw else {}
            if d.get("unknown"):
                return
            new = ReleaseState.from_json(raw) if raw else ReleaseState()
            redacted = bool(d.get("redacted", False))
            self.refused = str(d.get("refused", ""))[:500]
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
            log.warning("upstream sent a malformed release state (ignored): %s", e)
            return
        if redacted and not self._told_redacted:
            self._told_redacted = True
            log.warning(
                "the upstream hides the release state's pins and canary groups from this relay "
                "(its credential has no relay role): its consumers get the release step only"
            )
        if new == self._state and self.known:
            return
        log.info("release state from upstream: version %d", new.version)
        self._state, self.known = new, True
        if self.path is not None:
            try:
                write_atomic(self.path, new.to_json().encode(), fsync=self.fsync)
            except OSError as e:  # kept in memory; a restart then waits for the upstream
                log.warning("cannot keep the release state in %s: %s", self.path, e)


#: A relay's Status while it has not heard its upstream's release state (FollowedRollout).
UNKNOWN_JSON = '{"unknown":true,"why":"not heard from the upstream yet"}'


def unknown_json(why: str) -> str:
    """The Status form of a state not known, saying why (relays below keep what they have)."""
    return json.dumps({"unknown": True, "why": why[:300]}, separators=(",", ":"))
