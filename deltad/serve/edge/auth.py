"""Scoped credentials: who may act for which consumers (tokens file and mTLS identities).

A tokens file has one credential per line, ``TOKEN CONSUMERS ROLES``::

    # token            consumers            roles
    s3cret-alice       alice,alice-*        consume
    ops-7f1c           *                    consume,admin
    mtls:predictor-3   predictor-3          consume

* ``CONSUMERS``: comma-separated fnmatch globs over consumer names (``*`` = all);
* ``ROLES``: comma-separated subset of ``consume``, ``admin`` and ``relay`` (see :class:`Role`;
  ``relay``: a relay's mirror may be served past the model's release caps);
* a token field ``mtls:<CN>`` binds the client certificate whose subject CN is ``<CN>``;
* ``#`` starts a comment (a field beginning with ``#`` and the rest of the line).

A file with no usable line, an old one-field line, an unknown role or a repeated token is
refused (:class:`ConfigError`): a typo must never turn authorization off. The decisions are
pure functions of a :class:`Grant`; :mod:`deltad.serve.edge.gate` applies them to each call.
"""

from __future__ import annotations

import fnmatch
import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from deltad.errors import ConfigError
from deltad.types import Role

MTLS_PREFIX = "mtls:"
#: What a consumer glob may contain: name characters and fnmatch's ``* ? [ ] !``.
_GLOB = re.compile(r"[A-Za-z0-9_.\-*?\[\]!]{1,256}")
_TOKEN = re.compile(r"[\x21-\x7e]{1,4096}")  # printable ASCII, no space (an HTTP header value)


@dataclass(frozen=True)
class Grant:
    """What one credential may do: its consumer-name globs and its roles."""

    consumers: tuple[str, ...]
    roles: frozenset[Role]
    #: Where it came from (``file:line``), for log lines; never the secret.
    origin: str = ""

    def covers(self, consumer: str) -> bool:
        """Whether this credential may act for ``consumer``."""
        return any(fnmatch.fnmatchcase(consumer, g) for g in self.consumers)

    @property
    def admin(self) -> bool:
        return Role.ADMIN in self.roles


#: What a sidecar without credentials grants every caller.
OPEN = Grant(("*",), frozenset(Role), "no credentials configured")


def _digest(token: str) -> bytes:
    # tokens are looked up by their hash: the lookup's timing depends on the hash only
    return hashlib.sha256(token.encode()).digest()


@dataclass(frozen=True)
class Credentials:
    """Every credential a sidecar accepts: bearer tokens (by hash) and mTLS identities."""

    tokens: dict[bytes, Grant]
    identities: dict[str, Grant]

    def for_token(self, token: str) -> Grant | None:
        return self.tokens.get(_digest(token))

    def for_identity(self, common_name: str) -> Grant | None:
        return self.identities.get(common_name)

    def __len__(self) -> int:
        return len(self.tokens) + len(self.identities)

    @classmethod
    def full_access(cls, tokens: tuple[str, ...]) -> Credentials:
        """Tokens that may do everything (``ServerConfig.tokens``, for library use)."""
        grant = Grant(("*",), frozenset(Role), "ServerConfig.tokens")
        return cls({_digest(t): grant for t in tokens}, {})


def _fields(line: str) -> list[str]:
    out = []
    for f in line.split():
        if f.startswith("#"):
            break
        out.append(f)
    return out


def parse_tokens(text: str, source: str = "tokens file") -> Credentials:
    """Parse a tokens file's text (see the module docstring); ConfigError on any bad line."""
    tokens: dict[bytes, Grant] = {}
    identities: dict[str, Grant] = {}
    seen: dict[str, int] = {}
    for n, line in enumerate(text.splitlines(), 1):
        fields = _fields(line)
        if not fields:
            continue
        where = f"{source}:{n}"
        if len(fields) != 3:
            hint = (
                " (an old one-token-per-line file: give each token its consumers and roles)"
                if len(fields) == 1
                else ""
            )
            raise ConfigError(
                f"{where}: expected 'TOKEN CONSUMERS ROLES', got {len(fields)} field(s){hint}"
            )
        secret, consumers, roles = fields
        globs = tuple(consumers.split(","))
        bad = [g for g in globs if not _GLOB.fullmatch(g)]
        if bad:
            raise ConfigError(f"{where}: invalid consumer pattern(s) {bad[:3]!r}")
        try:
            role_set = frozenset(Role(r) for r in roles.split(","))
        except ValueError:
            raise ConfigError(
                f"{where}: roles must be a comma-separated subset of "
                f"{','.join(r.value for r in Role)}, got {roles[:64]!r}"
            ) from None
        if secret in seen:
            raise ConfigError(f"{where}: credential repeats the one on line {seen[secret]}")
        seen[secret] = n
        grant = Grant(globs, role_set, where)
        if secret.startswith(MTLS_PREFIX):
            cn = secret[len(MTLS_PREFIX) :]
            if not cn:
                raise ConfigError(f"{where}: 'mtls:' needs the client certificate's subject CN")
            identities[cn] = grant
        elif not _TOKEN.fullmatch(secret):
            raise ConfigError(f"{where}: a token is 1-4096 printable ASCII characters")
        else:
            tokens[_digest(secret)] = grant
    if not tokens and not identities:
        raise ConfigError(f"{source}: no usable line (refusing to start without authorization)")
    return Credentials(tokens, identities)


def load_tokens_file(path: Path) -> Credentials:
    """Read and parse a tokens file; ConfigError if unreadable or invalid."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read tokens file {path}: {e}") from e
    return parse_tokens(text, str(path))


# --- decisions --------------------------------------------------------------------------------

#: Methods that act for the consumer named in the request (role consume or admin).
CONSUMER_METHODS = frozenset({"GetDelta", "Commit", "Register", "Heartbeat"})
#: Methods only the admin role may call.
ADMIN_METHODS = frozenset({"Forget", "Rollout"})


def may_call(grant: Grant, method: str, consumer: str | None) -> str | None:
    """None if ``grant`` may call ``method`` (acting for ``consumer``), else why not."""
    if not grant.roles:
        return "credential has no role"
    if method in ADMIN_METHODS:
        return None if grant.admin else f"credential ({grant.origin}) has no admin role"
    if method in CONSUMER_METHODS:
        if consumer is None or not grant.covers(consumer):
            return f"credential ({grant.origin}) may not act for consumer {consumer!r}"
        return None
    return None  # Status, ListConsumers (filtered unless admin), reflection


def may_mirror(grant: Grant) -> str | None:
    """None if ``grant`` may pull as a relay's mirror (GetDeltaRequest.mirror: past the
    model's release caps), else why not: that needs the relay or admin role."""
    if Role.RELAY in grant.roles or grant.admin:
        return None
    return (
        f"credential ({grant.origin}) may not pull as a relay mirror (past the release caps): "
        f"that needs the relay or admin role"
    )


def may_ask_cap_of(grant: Grant, consumer: str) -> str | None:
    """None if ``grant`` may ask Status for ``consumer``'s cap (StatusRequest.consumer: a
    consumer it may see), else why not."""
    if visible(grant, consumer):
        return None
    return f"credential ({grant.origin}) may not ask for the cap of consumer {consumer!r}"


def sees_release(grant: Grant) -> bool:
    """Whether Status shows ``grant`` the whole release state (pins and canary groups name
    other consumers): admin and relay (a relay applies it to its own consumers) only."""
    return grant.admin or Role.RELAY in grant.roles


def visible(grant: Grant, consumer: str) -> bool:
    """Whether ListConsumers shows ``consumer`` to ``grant`` (admin: every consumer)."""
    return grant.admin or grant.covers(consumer)
