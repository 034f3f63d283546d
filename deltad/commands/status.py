"""`deltad status --target host:port [--json]`: a sidecar's head, tables and consumers.

``--json`` prints StatusResponse with the proto's field names (:func:`message_json`: every
integer a JSON number, ``rollout_state`` a nested object or null), plus ``consumers``: the
ListConsumersResponse entries.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

from deltad.clientauth import ClientAuth
from deltad.config import Range, check_client_auth
from deltad.errors import ConfigError, SidecarUnavailableError
from deltad.v1 import delta_pb2 as pb
from deltad.v1 import delta_pb2_grpc

log = logging.getLogger(__name__)


#: Every numeric flag's range (by argparse dest), checked by `deltad` before run().
RANGES: dict[str, Range] = {"timeout": Range(0, 3600, lo_open=True)}
#: endpoint flags (dests), checked as HOST:PORT (deltad.commands.main.check_flags)
ENDPOINTS = ("target",)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_connection_arguments(p)
    p.add_argument(
        "--forget",
        metavar="CONSUMER",
        default=None,
        help="forget this consumer on every rank (admin role): cursor, pull, lease, owed rows",
    )


def add_connection_arguments(p: argparse.ArgumentParser) -> None:
    """--target, --json, --timeout and the credentials of a command that talks to one sidecar."""
    p.add_argument(
        "--target",
        default=os.environ.get("DELTAD_TARGET", "127.0.0.1:50051"),
        help="host:port of the sidecar or relay [DELTAD_TARGET]",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    # no --token: a secret on the command line shows in ps and shell history
    p.add_argument(
        "--token-file",
        type=Path,
        default=os.environ.get("DELTAD_TOKEN_FILE"),
        help="file holding the bearer token [DELTAD_TOKEN_FILE]; or set DELTAD_TOKEN",
    )
    p.add_argument("--tls-ca", default=os.environ.get("DELTAD_TLS_CA"), help="CA (PEM): use TLS")
    p.add_argument(
        "--tls-cert",
        type=Path,
        default=os.environ.get("DELTAD_TLS_CLIENT_CERT"),
        help="client certificate (PEM) for a sidecar that requires mTLS [DELTAD_TLS_CLIENT_CERT]",
    )
    p.add_argument(
        "--tls-key",
        type=Path,
        default=os.environ.get("DELTAD_TLS_CLIENT_KEY"),
        help="its private key (PEM) [DELTAD_TLS_CLIENT_KEY]",
    )
    p.add_argument("--timeout", type=float, default=10.0, help="seconds per RPC")


def connection_auth(args: argparse.Namespace) -> ClientAuth:
    """The credentials of :func:`add_connection_arguments`' flags: the token from
    ``--token-file`` or else ``DELTAD_TOKEN`` (never on the command line), checked
    (ConfigError names the flag at fault)."""
    token = None if args.token_file else (os.environ.get("DELTAD_TOKEN") or None)
    check_client_auth("--", token, args.token_file, args.tls_ca, args.tls_cert, args.tls_key)
    return ClientAuth(
        token=token,
        token_file=args.token_file,
        tls_ca=Path(args.tls_ca) if args.tls_ca else None,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
    )


def fetch(
    target: str,
    *,
    token: str | None = None,
    tls_ca: Path | None = None,
    timeout: float = 10.0,
    auth: ClientAuth | None = None,
) -> tuple[pb.StatusResponse, pb.ListConsumersResponse]:
    """Status and ListConsumers of the sidecar at ``target`` (credentials: ``auth``, or
    ``token`` and ``tls_ca``)."""
    auth = auth or ClientAuth(token=token, tls_ca=tls_ca)
    channel = auth.channel(target)
    md = auth.metadata()
    try:
        stub = delta_pb2_grpc.DeltaServiceStub(channel)
        status = stub.Status(pb.StatusRequest(), timeout=timeout, metadata=md)
        consumers = stub.ListConsumers(pb.ListConsumersRequest(), timeout=timeout, metadata=md)
        return status, consumers
    except grpc.RpcError as e:
        raise SidecarUnavailableError(rpc_failure(target, e, timeout)) from e
    finally:
        channel.close()


def rpc_failure(target: str, e: grpc.RpcError, timeout: float) -> str:
    """One line for a failed call to the sidecar at ``target``, naming what did not answer:
    the sidecar itself (its deadline passed), or what it says (an offset store that did not
    answer it is an UNAVAILABLE naming that store)."""
    if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
        return f"the sidecar at {target} did not answer in {timeout:g} s (DEADLINE_EXCEEDED)"
    return f"{target}: {e.code().name}: {e.details()}"


def check_sidecars(
    endpoints: tuple[str, ...],
    model: str,
    *,
    token: str | None = None,
    tls_ca: Path | None = None,
    deadline_s: float = 120.0,
    rpc_timeout_s: float = 5.0,
    auth: ClientAuth | None = None,
) -> list[pb.StatusResponse | None]:
    """Before consuming from a static list of sidecars (one per rank, in rank order): each
    answering one must serve ``model`` at that rank, and the model's world size must be the
    number of endpoints (ConfigError otherwise: partial tables are never a success). Probes
    until ``deadline_s`` while one does not answer (logging, once per endpoint, what it
    waits for), then SidecarUnavailableError naming those (a typo in one address must not
    look like success). Returns each endpoint's Status. Credentials: ``auth``, or ``token``
    and ``tls_ca``."""
    auth = auth or ClientAuth(token=token, tls_ca=tls_ca)
    end = time.monotonic() + deadline_s
    told: set[str] = set()
    while True:
        got: list[pb.StatusResponse | None] = []
        errors = []
        for target in endpoints:
            channel = auth.channel(target)
            try:
                stub = delta_pb2_grpc.DeltaServiceStub(channel)
                got.append(
                    stub.Status(pb.StatusRequest(), timeout=rpc_timeout_s, metadata=auth.metadata())
                )
            except grpc.RpcError as e:
                if e.code() in (
                    grpc.StatusCode.UNAUTHENTICATED,
                    grpc.StatusCode.PERMISSION_DENIED,
                ):
                    raise ConfigError(f"{target}: {e.code().name}: {e.details()}") from None
                got.append(None)
                errors.append(f"rank {len(got) - 1} at {target}: {e.code().name}")
                if target not in told:
                    told.add(target)
                    log.warning(
                        "waiting up to %.0fs for the sidecar of rank %d at %s: %s",
                        max(0.0, end - time.monotonic()), len(got) - 1, target, e.code().name,
                    )  # fmt: skip
            finally:
                channel.close()
        for rank, (target, st) in enumerate(zip(endpoints, got, strict=True)):
            if st is None:
                continue
            if st.model != model:
                raise ConfigError(f"{target} serves model {st.model!r}, not --model {model!r}")
            if st.rank != rank:
                raise ConfigError(
                    f"{target} serves rank {st.rank}; give the --sidecar endpoints in rank order"
                )
            if st.world_size and st.world_size != len(endpoints):
                raise ConfigError(
                    f"model {model!r} has {st.world_size} ranks; give one --sidecar per rank "
                    f"(got {len(endpoints)}): fewer would serve partial tables"
                )
        if all(st is not None for st in got):
            return got
        if time.monotonic() >= end:
            what = "no sidecar" if all(st is None for st in got) else "not every sidecar"
            raise SidecarUnavailableError(
                f"{what} answered within {deadline_s:.0f}s: {'; '.join(errors)[:300]}"
            )
        time.sleep(min(1.0, max(0.0, end - time.monotonic())))


#: The integer types the protobuf JSON mapping prints as strings (64-bit ones).
_INT64_TYPES = frozenset(
    {
        FieldDescriptor.TYPE_INT64,
        FieldDescriptor.TYPE_UINT64,
        FieldDescriptor.TYPE_SINT64,
        FieldDescriptor.TYPE_FIXED64,
        FieldDescriptor.TYPE_SFIXED64,
    }
)


def _numbers(d: Any, out: dict[str, Any]) -> dict[str, Any]:
    """``out`` (MessageToDict of a message of descriptor ``d``, proto field names) with its
    64-bit integers, in nested messages, repeated fields and map values too, as JSON numbers
    (in place)."""
    for f in d.fields:
        if f.name not in out:
            continue
        v = out[f.name]
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            vf = f.message_type.fields_by_name["value"]
            if vf.message_type is not None:
                out[f.name] = {k: _numbers(vf.message_type, x) for k, x in v.items()}
            elif vf.type in _INT64_TYPES:
                out[f.name] = {k: int(x) for k, x in v.items()}
        elif f.message_type is not None:
            if f.message_type.full_name.startswith("google.protobuf."):
                continue  # well-known types keep their own JSON form
            if isinstance(v, list):
                out[f.name] = [_numbers(f.message_type, x) for x in v]
            else:
                out[f.name] = _numbers(f.message_type, v)
        elif f.type in _INT64_TYPES:
            out[f.name] = [int(x) for x in v] if isinstance(v, list) else int(v)
    return out


def message_json(msg: Message) -> dict[str, Any]:
    """``msg`` as a JSON-ready dict for scripts: the protobuf JSON mapping with the proto's
    field names and every field present, but every integer a JSON number (the mapping prints
    64-bit ones as strings), and a ``rollout_state`` (the release state as a JSON string) a
    nested object, or None when empty."""
    out: dict[str, Any] = MessageToDict(
        msg, always_print_fields_with_no_presence=True, preserving_proto_field_name=True
    )
    _numbers(msg.DESCRIPTOR, out)
    if isinstance(out.get("rollout_state"), str):
        out["rollout_state"] = json.loads(out["rollout_state"]) if out["rollout_state"] else None
    return out


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def render(status: pb.StatusResponse, consumers: pb.ListConsumersResponse) -> str:
    s = status
    if s.head_seq < 0 and s.quarantined:  # its files failed their checks: said in its log
        fresh = (
            "the relay mirrors its upstream's tables again"
            if s.upstream
            else "a fresh base is asked of the trainer's publisher"
        )
        head = (
            f"head: no segment served: {s.quarantined} file(s) of this rank quarantined "
            f"(the sidecar's log says why; they are in <spool>/<model>/quarantine/), and {fresh}"
        )
    elif s.head_seq < 0:  # a head that does not exist has no age (a mistyped --spool?)
        head = (
            "head: no segment yet (nothing published to this spool for this model and rank; "
            "check --spool and --model)  quarantined 0"
        )
    else:
        head = (
            f"head seq {s.head_seq} step {s.head_step} (age {s.head_age_seconds:.1f}s)  "
            f"base seq {s.base_seq}  segments {s.segments}  log {_mb(s.log_bytes)}  "
            f"quarantined {s.quarantined}"
        )
    lines = [
        f"model {s.model}  rank {s.rank}/{s.world_size}  generation {s.generation}",
        head,
        f"health: NOT_SERVING: {s.health_reason}" if s.health_reason else "health: SERVING",
        "tables:",
    ]
    if s.upstream:
        lost = f" (LOST: {s.upstream_lost})" if s.upstream_lost else ""
        lines.insert(1, f"relay of {s.upstream}{lost}")
    if s.archive:
        lines.insert(lines.index("tables:"), archive_line(s))
    for t in s.tables:
        local = ", ".join(f"cols {c.col_start}:{c.col_end} rows {c.count}" for c in t.local_slices)
        lines.append(
            f"  {t.table:<20} {t.num_rows}x{t.dim} {t.dtype} {t.kind} {t.sharding_type}  "
            f"[{local or 'none on this rank'}]"
        )
    lines += rollout_lines(s)
    lines += evaluator_lines(s)
    lines.append("consumers:")
    lines.append(
        f"  {'name':<24} {'live':<5} {'seq':>8} {'lag seg':>8} {'lag s':>8} {'owed':>8} {'cap':>8}"
    )
    unknown = bool(s.rollout_state) and bool(json.loads(s.rollout_state).get("unknown"))
    for c in consumers.consumers:
        cap = "head" if c.cap_step == -1 or not s.rollout_state else str(c.cap_step)
        if c.cap_step == -2:  # (held at another generation's state: served nothing of this)
            cap = "nothing"
        if unknown:  # (a relay that has not heard its upstream's state serves nobody)
            cap = "-"
        lag = "-" if c.lag_segments < 0 else str(c.lag_segments)  # (-: consumes other ranks)
        lines.append(
            f"  {c.consumer:<24} {'yes' if c.live else 'no':<5} {c.cursor.seq:>8} "
            f"{lag:>8} {c.lag_seconds:>8.1f} {c.owed_rows:>8} {cap:>8}"
        )
    # (what a server says comes partly from Redis, which others may write: no control
    # character reaches the terminal, so no line can be forged or overwritten)
    return "\n".join(printable(line) for line in lines)


def evaluator_lines(s: pb.StatusResponse, now: float | None = None) -> list[str]:
    """The canary evaluators (docs/evaluate.md): who is alive and the newest verdicts; none
    alive but verdicts recorded: the fleet stays at the last release."""
    if not s.evaluator_state:
        return []
    try:
        d = json.loads(s.evaluator_state)
        alive = [str(x) for x in d.get("alive", [])]
        verdicts = list(d.get("verdicts", []))
    except (ValueError, AttributeError, TypeError):
        return ["evaluator: (unreadable state)"]
    now = time.time() if now is None else now
    head = (
        f"evaluator: {', '.join(alive)} alive"
        if alive
        else "evaluator: NONE alive: the fleet stays at the last release (nothing is released "
        "unscored)"
    )
    out = [head]
    for v in verdicts:
        age = now - float(v.get("decided_unix") or now)
        out.append(
            f"  step {v.get('step')} (generation {v.get('generation')}) vs release step "
            f"{v.get('release_step')}: {v.get('verdict')} by {v.get('by') or '?'}, "
            f"{max(0.0, age):.1f}s ago"
        )
    return out


def archive_line(s: pb.StatusResponse) -> str:
    """The archive (docs/archive.md): its store and how far it is behind the served log."""
    if s.archive_lag_segments == 0:
        behind = "caught up"
    else:
        behind = (
            f"{s.archive_lag_segments} segment(s) behind, the oldest {s.archive_lag_seconds:.1f}s "
            f"old"
        )
    return f"archive: {s.archive}: {behind}"


def printable(text: str) -> str:
    """``text`` with every character a terminal would act on (control characters, escape
    sequences' introducers) written as its escape, e.g. ``\\x1b``."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in text)


def rollout_lines(s: pb.StatusResponse) -> list[str]:
    """The release state and this server's validation gate, as ``deltad status`` shows them."""
    if not s.rollout_state:
        return []
    from deltad.serve.rollout import ReleaseState, describe

    d = json.loads(s.rollout_state)
    if d.get("unknown"):
        why = d.get("why", "not known")
        return ["rollout:", f"  release state: {why} (nothing is served)"]
    redacted = bool(d.get("redacted", False))
    state = ReleaseState.from_json(s.rollout_state)
    served = s.generation if s.head_seq >= 0 else None
    lines = ["rollout:"] + [
        f"  {line}" for line in describe(state, redacted=redacted, generation=served)
    ]
    if d.get("refused"):
        lines.append(
            f"  release state: the value in Redis is REFUSED (the state above, the last valid "
            f"one read, stays in force; the next control replaces it): {d['refused']}"
        )
    same = state.gate_bad_step == s.gate_bad_step and state.gate_generation == s.generation
    if s.gate_reason and not same:
        # (only published steps are named: the newest this rank holds before the failure)
        before = [t for t in s.steps if t < s.gate_bad_step]
        newest = f"; newest published before it: step {max(before)}" if before else ""
        lines.append(
            f"  gate here: step {s.gate_bad_step} failed: {s.gate_reason} (nothing at or past "
            f"it is served{newest})"
        )
    return lines


def forget(
    target: str,
    consumer: str,
    *,
    token: str | None = None,
    tls_ca: Path | None = None,
    timeout: float = 10.0,
    auth: ClientAuth | None = None,
) -> bool:
    """Ask the sidecar at ``target`` to forget ``consumer`` (admin); False if it was unknown."""
    auth = auth or ClientAuth(token=token, tls_ca=tls_ca)
    md = auth.metadata()
    with auth.channel(target) as channel:
        stub = delta_pb2_grpc.DeltaServiceStub(channel)
        try:
            resp = stub.Forget(pb.ForgetRequest(consumer=consumer), timeout=timeout, metadata=md)
        except grpc.RpcError as e:
            if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise SidecarUnavailableError(rpc_failure(target, e, timeout)) from e
            raise ConfigError(f"forget {consumer!r}: {e.code().name}: {e.details()}") from e
    return bool(resp.forgotten)


def _lease_left(target: str, consumer: str, auth: ClientAuth, timeout: float) -> float:
    """Seconds left on ``consumer``'s lease at ``target`` (0: not live, or not known)."""
    try:
        with auth.channel(target) as channel:
            listed = delta_pb2_grpc.DeltaServiceStub(channel).ListConsumers(
                pb.ListConsumersRequest(), timeout=timeout, metadata=auth.metadata()
            )
    except grpc.RpcError:
        return 0.0  # (the Forget itself then says what is wrong)
    return next(
        (c.lease_expires_in_seconds for c in listed.consumers if c.consumer == consumer and c.live),
        0.0,
    )


def run(args: argparse.Namespace) -> int:
    auth = connection_auth(args)
    if args.forget is not None:
        live = _lease_left(args.target, args.forget, auth, args.timeout)
        gone = forget(args.target, args.forget, auth=auth, timeout=args.timeout)
        note = ""
        if gone and live:  # (forgotten all the same: an admin's request)
            note = (
                f" (it was live, {live:.0f} s left on its lease: its next pull registers it "
                "again and is served the full tables)"
            )
        print(f"consumer {args.forget}: {'forgotten' if gone else 'not known'}{note}")
        return 0
    status, consumers = fetch(args.target, auth=auth, timeout=args.timeout)
    if args.json:
        out = message_json(status)
        out["consumers"] = message_json(consumers).get("consumers", [])
        print(json.dumps(out, indent=2, sort_keys=True))
    else:
        print(render(status, consumers))
    return 0
