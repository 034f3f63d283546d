"""The model's release state (deltad.serve.rollout.ReleaseState) in Redis: one JSON string per
model (``RedisKeys.rollout``), changed by an atomic read-modify-write (WATCH/MULTI), read by
every sidecar through a short cache (:class:`RolloutView`: at most ``ttl_s`` stale).

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


class RolloutStore:
    """The release state of one model in Redis."""

    def __init__(
        self, client: redis.Redis, model: str, *, attempts: int = 5, calls: RedisCalls | None = None
    ) -> None:
        self.client = client
        self.key = RedisKeys(model).rollout()
        self.attempts = max(1, attempts)
        #: How calls reach Redis: the offset store's (its URL, deadlines, down flag) if given.
        self.calls = calls or RedisCalls(client, attempts=attempts)

    def _retry(
        self, what: str, fn: Callable[[], ReleaseState], attempts: int | None = None
    ) -> ReleaseState:
        return self.calls.retry(f"release state {what}", fn, attempts=attempts or self.attempts)

    def get(self, *, attempts: int | None = None) -> ReleaseState:
        """The stored state (the default, everything released, if none is stored)."""

        def run() -> ReleaseState:
            raw = self.client.get(self.key)
            return ReleaseState() if raw is None else _parsed(self.key, raw)  # type: ignore[arg-type]

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
                        old = ReleaseState() if raw is None else _parsed(self.key, raw)  # type: ignore[arg-type]
                        new = change(old)
                        if new == old:
                            pipe.unwatch()
                            return old
                        new = replace(new, version=old.version + 1)
                        pipe.multi()
                        pipe.set(self.key, new.to_json())
                        pipe.execute()
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
        raise OffsetStoreError(f"the release state in Redis ({key}) is malformed: {e}") from e


class RolloutView:
    """A sidecar's cached view of the stored state: re-read at most every ``ttl_s``; while
    Redis does not answer, the last state read stays in force (logged once). Until one read
    succeeded the state is not ``known`` (a malformed stored state at start: nothing is
    served, rather than everything)."""

    def __init__(self, store: RolloutStore, ttl_s: float = VIEW_TTL_S) -> None:
        self.store = store
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._state = ReleaseState()
        self._read_at = -float("inf")
        self._failing = False
        self._read_once = False
        self._problem = "not read yet"

    @property
    def known(self) -> bool:
        self.state()
        return self._read_once

    @property
    def unknown_reason(self) -> str:
        return f"nothing is served until the release state is read: {self._problem}"[:512]

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
            except OffsetStoreError as e:
                if not self._failing:
                    log.warning("release state unreadable, the last one read stays: %s", e)
                self._failing = True
                self._problem = str(e)
            self._read_at = time.monotonic()
            return self._state

    def state_json(self) -> str:
        """The state for Status; while not known (never read: a malformed value in Redis),
        "unknown" with why, so relays keep the state they have rather than take the default
        "everything released" as the model's."""
        if not self.known:
            return unknown_json(f"unreadable in Redis: {self._problem}")
        return self.state().to_json()

    def set(self, state: ReleaseState) -> None:
        """Take a state this process just wrote (no wait for the next read)."""
        with self._lock:
            if state.version >= self._state.version:
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
        """The state for this relay's own Status: :data:`UNKNOWN_JSON` while not known."""
        return self._state.to_json() if self.known else UNKNOWN_JSON

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
