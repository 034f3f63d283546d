"""What `deltad` prints for scripts and for typos: ``status --json`` has every integer a JSON
number and the release state a nested object; an unknown flag after a subcommand is that
subcommand's usage error. A real sidecar on port 0 over a real spool and Redis; `deltad` run
in-process."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
from serverkit import Client, SpoolWriter, redis_server, server_config, wait_for

from deltad.commands import main as cli
from deltad.serve.edge.app import SidecarServer
from deltad.store import EmbeddedRedis
from deltad.v1 import delta_pb2 as pb

__all__ = ["redis_server"]

pytestmark = pytest.mark.timeout(60)


def _int_types() -> set[int]:
    from google.protobuf.descriptor import FieldDescriptor as F

    return {
        F.TYPE_INT32, F.TYPE_INT64, F.TYPE_UINT32, F.TYPE_UINT64, F.TYPE_SINT32,
        F.TYPE_SINT64, F.TYPE_FIXED32, F.TYPE_FIXED64, F.TYPE_SFIXED32, F.TYPE_SFIXED64,
    }  # fmt: skip


def _integer_fields(d: Any, obj: dict[str, Any], where: str = "") -> int:
    """Assert every integer field of message ``d`` in ``obj`` (and in its nested messages and
    repeated fields) is a JSON number; returns how many integer values were checked."""
    ints, n = _int_types(), 0
    for f in d.fields:
        assert f.name in obj, f"{where}{f.name} missing"
        v = obj[f.name]
        values = v if isinstance(v, list) else [v]
        if f.message_type is not None:
            for i, x in enumerate(values):
                n += _integer_fields(f.message_type, x, f"{where}{f.name}[{i}].")
        elif f.type in ints:
            for x in values:
                assert type(x) is int, f"{where}{f.name} = {x!r} is not a JSON number"
                n += 1
    return n


def _status_json(target: str, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    code = cli.main(["status", "--target", target, "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    got: dict[str, Any] = json.loads(out.out)
    return got


def test_status_json_has_integers_as_numbers_and_the_release_state_as_an_object(
    tmp_path: Path, redis_server: EmbeddedRedis, capsys: pytest.CaptureFixture[str]
) -> None:
    spool = SpoolWriter(tmp_path / "spool", col_split=2)
    for _ in range(3):
        spool.delta()
    srv = SidecarServer(server_config(tmp_path / "spool", redis_server.url)).start()
    target = f"127.0.0.1:{srv.port}"
    c = Client(target)
    try:

        def synced() -> bool:
            d = c.pull("k")
            c.commit(d)
            return d.to_seq == 3

        wait_for(synced, 30, "consumer k at seq 3")

        st = _status_json(target, capsys)
        # the proto's field names, as before (not camelCase)
        assert {"head_seq", "world_size", "rollout_state", "consumers", "tables"} <= set(st)
        assert st["head_seq"] == 3 and st["base_seq"] == 0 and st["rank"] == 0
        assert type(st["generation"]) is int and st["generation"] == 1
        assert isinstance(st["rollout_state"], dict) and not st["rollout_state"]["held"]
        t0 = next(t for t in st["tables"] if t["table"] == "t0")
        assert t0["num_rows"] == 1000 and t0["dim"] == 8
        assert [(s["col_start"], s["col_end"]) for s in t0["local_slices"]] == [(0, 4), (4, 8)]
        assert all(type(s["count"]) is int for s in t0["local_slices"])
        (k,) = [x for x in st["consumers"] if x["consumer"] == "k"]
        assert k["cursor"]["seq"] == 3 and type(k["cursor"]["generation"]) is int
        assert type(k["owed_rows"]) is int and type(k["lag_segments"]) is int
        consumers = st.pop("consumers")
        assert _integer_fields(pb.StatusResponse.DESCRIPTOR, st) > 10
        for x in consumers:
            _integer_fields(pb.ConsumerInfo.DESCRIPTOR, x)

        assert cli.main(["rollout", "hold", "--target", target]) == 0
        assert "held" in capsys.readouterr().out
        st = _status_json(target, capsys)
        assert isinstance(st["rollout_state"], dict) and st["rollout_state"]["held"] is True
        assert type(st["rollout_version"]) is int and st["rollout_version"] >= 1
        st.pop("consumers")
        st["rollout_state"] = ""  # (a JSON string in the proto: checked above)
        _integer_fields(pb.StatusResponse.DESCRIPTOR, st)

        code = cli.main(["rollout", "status", "--target", target, "--json"])
        out = capsys.readouterr()
        assert code == 0, out.err
        r = json.loads(out.out)
        assert r["state"]["held"] is True and type(r["generation"]) is int
    finally:
        c.close()
        srv.stop(0)


def test_message_json_numbers_repeated_64_bit_fields_and_an_empty_release_state_is_null() -> None:
    from deltad.commands.status import message_json

    m = pb.StatusResponse(head_seq=5, log_bytes=2**40, head_step=-1)
    m.steps.extend([2**40, 3])
    m.tables.add(table="t", num_rows=2**33).local_slices.add(count=7, col_end=4)
    out = message_json(m)
    assert out["steps"] == [2**40, 3] and out["dense_steps"] == []
    assert (out["head_seq"], out["log_bytes"], out["head_step"]) == (5, 2**40, -1)
    assert out["tables"][0]["num_rows"] == 2**33
    assert out["tables"][0]["local_slices"][0]["count"] == 7
    assert out["rollout_state"] is None
    assert json.loads(json.dumps(out)) == out
    _integer_fields(pb.StatusResponse.DESCRIPTOR, {**out, "rollout_state": ""})


def _subcommands() -> list[str]:
    (sub,) = [a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return list(sub.choices)


#: what each subcommand needs before an unknown flag is the first error
_REQUIRED = {"rollout": ["status"], "consume": ["--consumer", "c"]}


@pytest.mark.parametrize("command", _subcommands())
@pytest.mark.parametrize("bogus", [["--bogus"], ["--bogus=1"], ["--bogus", "x"]])
def test_an_unknown_flag_after_a_subcommand_is_that_subcommands_usage_error(
    command: str, bogus: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main([command, *_REQUIRED.get(command, []), *bogus])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"deltad {command}: error: unrecognized arguments: {' '.join(bogus)} "
        f"(see deltad {command} --help)"
    ]


def test_an_unknown_subcommand_or_top_level_flag_stays_deltads_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for argv, text in (
        (["bogus"], "invalid choice: 'bogus'"),
        (["--bogus", "status"], "unrecognized arguments: --bogus"),
    ):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert line.startswith("deltad: error: ") and text in line, line
        assert line.endswith("(see deltad --help)"), line
