"""Finding each rank's sidecar in Redis, where the sidecars register their endpoints."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import grpc

from deltad.clientauth import ClientAuth
from deltad.config import ConsumerConfig
from deltad.errors import ConsumerError, SidecarUnavailableError
from deltad.keys import RedisKeys
from deltad.v1 import delta_pb2 as pb
from deltad.v1 import delta_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


class Discovery:
    """The sidecars of one model as they registered in Redis (``RedisKeys.ranks``)."""

    def __init__(
        self, config: ConsumerConfig, auth: ClientAuth, channel_options: Sequence[tuple[str, Any]]
    ) -> None:
        self.config = config
        self.auth = auth
        self.channel_options = channel_options
        self._redis: Any = None
        self._redis_lock = threading.Lock()

    def close(self) -> None:
        if self._redis is not None:
            self._redis.close()

    def registry(self) -> dict[int, str]:
        """rank -> endpoint, as the sidecars registered themselves in Redis."""
        from deltad.store import connect

        assert self.config.redis_url is not None
        try:
            with self._redis_lock:
                if self._redis is None:
                    self._redis = connect(
                        self.config.redis_url, attempts=self.config.max_retries + 1
                    )
                client = self._redis
            raw = client.hgetall(RedisKeys(self.config.model).ranks())
        except Exception as e:  # redis errors and OffsetStoreError alike
            raise ConsumerError(f"sidecar discovery in redis failed: {e}") from e
        out: dict[int, str] = {}
        for k, v in raw.items():
            try:
                out[int(k)] = str(json.loads(v)["endpoint"])
            except (ValueError, KeyError, TypeError):
                log.warning("ignoring bad ranks entry %r", k)
        return out

    def all(self) -> list[str]:
        """Every rank's endpoint; waits (bounded) until all ranks 0..world-1 registered."""
        deadline = time.monotonic() + self.config.discovery_timeout_s
        delay = self.config.backoff_initial_s
        found: dict[int, str] = {}
        while True:
            found = self.registry()
            world = self._world_size(found)
            if world and all(r in found for r in range(world)):
                return [found[r] for r in range(world)]
            if time.monotonic() >= deadline:
                raise SidecarUnavailableError(
                    f"model {self.config.model}: ranks {sorted(found)} registered in redis, "
                    f"not all of 0..{max(world, 1) - 1} after {self.config.discovery_timeout_s}s"
                )
            time.sleep(delay)
            delay = min(delay * 2, self.config.backoff_max_s)

    def _world_size(self, found: dict[int, str]) -> int:
        """World size as a registered sidecar's Status reports it (0 if none answers)."""
        for rank in sorted(found):
            channel = self.auth.channel(found[rank], self.channel_options)
            try:
                s = pb_grpc.DeltaServiceStub(channel).Status(
                    pb.StatusRequest(), timeout=min(2.0, self.config.rpc_deadline_s),
                    metadata=self.auth.metadata(),
                )  # fmt: skip
                return int(s.world_size)
            except grpc.RpcError:
                continue
            finally:
                channel.close()
        return 0
