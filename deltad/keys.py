"""Redis key names, all in one place, prefixed by model.

Keys use a ``{model}`` hash tag so every key of one model lands in one Redis Cluster slot
(multi-key Lua scripts stay legal).

==============================  =====================================================
key                             value
==============================  =====================================================
``cursor:<consumer>:<rank>``    hash: generation, seq, step, updated_unix, owed_token
``pull:<consumer>:<rank>``      hash: the last issued, not yet committed pull
``lease:<consumer>``            string with a TTL (PX): alive while it exists
``consumers``                   set of consumer names ever registered
``lease_ttl``                   hash: consumer -> lease TTL in ms (kept when a lease expires)
``seen``                        hash: consumer -> unix time last heard of (register, heartbeat,
                                pull); a consumer silent past ``--forget-after`` is forgotten
``ranks``                       hash: rank -> JSON {endpoint, generation, updated_unix}
``rollout``                     string: the model's release state as JSON
                                (deltad.serve.rollout.ReleaseState; deltad.serve.state.release)
==============================  =====================================================
"""

from __future__ import annotations

from deltad.config import check_name

PREFIX = "deltad"


class RedisKeys:
    """Key names of one model."""

    def __init__(self, model: str, prefix: str = PREFIX) -> None:
        self.model = check_name("model", model)
        self.base = f"{prefix}:{{{model}}}"

    def cursor(self, consumer: str, rank: int) -> str:
        return f"{self.base}:cursor:{consumer}:{rank}"

    def pull(self, consumer: str, rank: int) -> str:
        return f"{self.base}:pull:{consumer}:{rank}"

    def lease(self, consumer: str) -> str:
        return f"{self.base}:lease:{consumer}"

    def lease_ttl(self) -> str:
        return f"{self.base}:lease_ttl"

    def seen(self) -> str:
        return f"{self.base}:seen"

    def consumers(self) -> str:
        return f"{self.base}:consumers"

    def ranks(self) -> str:
        return f"{self.base}:ranks"

    def rollout(self) -> str:
        return f"{self.base}:rollout"

    def evaluators(self) -> str:
        """The prefix of the canary evaluators' records (deltad.evaluate.record)."""
        return f"{self.base}:eval"
