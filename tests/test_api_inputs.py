"""Library inputs a user can get wrong: config fields, publisher steps, the public names.

Each wrong input is a ConfigError naming the field (never a raw TypeError / ValueError, never
silently accepted); the publisher refuses a bad step before it writes anything, and its
close() detaches the tracker it attached. The publisher part runs a real DMP (the toy model
of shardkit) in one gloo process of world size 1.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from shardkit import batch, spawn, toy_dmp

from deltad.config import (
    ConsumerConfig,
    PublisherConfig,
    PullOptions,
    RelayConfig,
    ServerConfig,
    TrackerConfig,
)
from deltad.errors import ConfigError
from deltad.types import Form, TrainLoop, WireDtype

NAN = float("nan")
INF = float("inf")


# -- PublisherConfig / TrackerConfig ----------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("every_seconds", NAN),  # never published, then close() crashed
        ("every_seconds", INF),  # the first publish crashed
        ("every_seconds", -1.0),
        ("every_seconds", "0.5"),  # was a raw TypeError
        ("every_seconds", 1e12),  # past the upper bound (a year)
        ("every_steps", 2.5),
        ("every_steps", True),  # a bool is not a step count
        ("every_steps", "10"),
        ("every_steps", 10**400),  # huge: no OverflowError from float()
        ("dense_every_steps", 1.5),
        ("dense_every_seconds", NAN),
        ("rebase_retry_s", INF),
        ("max_pending_writes", 0),
        ("max_pending_writes", 2.0),
    ],
)
def test_publisher_config_refuses_bad_numbers_naming_the_field(
    tmp_path: Path, field: str, value: Any
) -> None:
    kw: dict[str, Any] = {"every_steps": 1, field: value}
    with pytest.raises(ConfigError, match=rf"^{field} must be "):
        PublisherConfig(tmp_path / "spool", **kw)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"fsync": "no"}, r"^fsync must be True or False"),
        ({"copy_in_background": 1}, r"^copy_in_background must be True or False"),
        ({"publish_dense": None}, r"^publish_dense must be True or False"),
        ({"fqns_to_skip": "ebc"}, r"^fqns_to_skip must be a tuple or list of strings.*\('ebc',\)"),
        ({"fqns_to_skip": ("ebc", 3)}, r"^fqns_to_skip must hold strings only"),
        ({"train_loop": "pipelined"}, r"^train_loop 'pipelined' is not one of"),
        ({"generation": 1.5}, r"^generation must be an int or None"),
        ({"generation": True}, r"^generation must be an int or None"),
    ],
)
def test_publisher_config_refuses_wrong_types(
    tmp_path: Path, kw: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        PublisherConfig(tmp_path / "spool", every_steps=1, **kw)


def test_publisher_config_accepts_what_it_documents(tmp_path: Path) -> None:
    cfg = PublisherConfig(
        str(tmp_path / "spool"), every_steps=10, every_seconds=0.5, train_loop="pipeline-base",
        fqns_to_skip=["ec"], generation=7, dense_every_seconds=2,
    )  # fmt: skip
    assert cfg.spool_dir == tmp_path / "spool" and cfg.train_loop is TrainLoop.PIPELINE_BASE
    assert cfg.fqns_to_skip == ("ec",)
    assert PublisherConfig(tmp_path, every_seconds=1).every_steps == 0  # 1: an int is a number


def test_publisher_config_refuses_a_spool_whose_parent_does_not_exist(tmp_path: Path) -> None:
    typo = tmp_path / "nonexistent" / "a" / "spool"
    with pytest.raises(ConfigError, match=r"^spool_dir \(--spool\) .*neither it nor its parent"):
        PublisherConfig(typo, every_steps=1)
    assert not (tmp_path / "nonexistent").exists()
    with pytest.raises(ConfigError, match=r"^spool_dir must be a path"):
        PublisherConfig(3, every_steps=1)  # type: ignore[arg-type]
    # the spool itself may be missing (the publisher creates that one level)
    assert PublisherConfig(tmp_path / "new-spool", every_steps=1).spool_dir.parent == tmp_path


def test_tracker_config_checks_its_fields() -> None:
    with pytest.raises(ConfigError, match=r"^train_loop 'nope' is not one of"):
        TrackerConfig(train_loop="nope")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^fqns_to_skip must be a tuple or list"):
        TrackerConfig(fqns_to_skip="ebc")  # type: ignore[arg-type]
    cfg = TrackerConfig(fqns_to_skip=["ec"], train_loop="plain")  # type: ignore[arg-type]
    assert cfg.fqns_to_skip == ("ec",) and cfg.train_loop is TrainLoop.PLAIN


# -- PullOptions / ConsumerConfig -------------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"tables": "t_user"}, r"^tables must be a tuple or list of strings.*\('t_user',\)"),
        ({"tables": ("t_user", None)}, r"^tables must hold strings only"),
        ({"tables": 3}, r"^tables must be a tuple or list of strings"),
        ({"k": 10}, r"^k is for form=Form\.TOPK only"),
        ({"k": 10, "form": Form.ROWS}, r"^k is for form=Form\.TOPK only"),
        ({"fraction": 0.5, "form": Form.IDS}, r"^fraction is for form=Form\.TOPK only"),
        ({"wire_dtype": "int3"}, r"^wire_dtype 'int3' is not one of"),
        ({"form": "top-k"}, r"^form 'top-k' is not one of"),
        ({"form": Form.TOPK, "k": 2.5}, r"^k must be an integer"),
        ({"max_rows": 1.5}, r"^max_rows must be an integer"),
        ({"max_step": 10.5}, r"^max_step must be an integer"),
        ({"row_alignment": 16.0}, r"^row_alignment must be an integer"),
        ({"dense": "yes"}, r"^dense must be True or False"),
        ({"auto_commit": 1}, r"^auto_commit must be True or False"),
    ],
)
def test_pull_options_refuse_bad_inputs_naming_the_field(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        PullOptions(**kw)


def test_pull_options_convert_valid_strings_and_keep_defaults() -> None:
    opts = PullOptions(form="topk", k=10, wire_dtype="int8", tables=["t_user"])  # type: ignore[arg-type]
    assert opts.form is Form.TOPK and opts.wire_dtype is WireDtype.INT8
    assert opts.tables == ("t_user",)
    assert PullOptions(form=Form.TOPK, fraction=0.25).fraction == 0.25
    assert PullOptions(form=Form.IDS, k=0, fraction=0.0).form is Form.IDS  # defaults of 0


@pytest.mark.parametrize("field", ["resume", "align_steps"])
@pytest.mark.parametrize("value", ["no", 0, None])
def test_consumer_config_bools_must_be_bools(field: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=rf"^{field} must be True or False"):
        ConsumerConfig("c", sidecars=("127.0.0.1:1",), **{field: value})
    assert getattr(ConsumerConfig("c", sidecars=("127.0.0.1:1",), **{field: True}), field)


# -- the public names -------------------------------------------------------------------------


# -- ServerConfig / RelayConfig (library use; the CLI's argparse types check its flags) -------


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"chunk_bytes": 2.5 * 1024 * 1024}, r"^--chunk-bytes .*must be an integer"),
        ({"rank": True}, r"^--rank .*must be an integer"),
        ({"max_consumers": 10.0}, r"^--max-consumers .*must be an integer"),
        ({"metrics_port": 9090.0}, r"^--metrics-port .*must be an integer"),
        ({"window_cache_entries": "8"}, r"^--window-cache-entries .*must be an integer"),
        ({"restore_window_steps": 1.5}, r"^--restore-window-steps .*must be an integer"),
        ({"lease_ttl_s": NAN}, r"^--lease-ttl .*must be a finite number"),
        ({"tokens": "secret"}, r"^tokens must be a tuple or list of strings"),
    ],
)
def test_server_config_refuses_bad_inputs_naming_the_field(
    tmp_path: Path, kw: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        ServerConfig(spool_dir=tmp_path, **kw)


def test_server_config_keeps_integers_and_floats_it_documents(tmp_path: Path) -> None:
    cfg = ServerConfig(spool_dir=tmp_path, rank=1, chunk_bytes=1 << 20, lease_ttl_s=5, tokens=["t"])
    assert (cfg.rank, cfg.chunk_bytes, cfg.lease_ttl_s, cfg.tokens) == (1, 1 << 20, 5, ("t",))
    assert ServerConfig(spool_dir=tmp_path, metrics_port=None).metrics_port is None


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"fsync": "no"}, r"^fsync must be True or False"),
        ({"lease_ttl_s": INF}, r"^lease_ttl_s must be a finite number"),
    ],
)
def test_relay_config_refuses_bad_inputs_naming_the_field(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        RelayConfig(upstream="127.0.0.1:50051", **kw)


def test_every_error_class_is_exported_from_deltad_without_torch() -> None:
    code = (
        "import sys, inspect, deltad, deltad.errors as e\n"
        "names = [n for n, c in vars(e).items() if inspect.isclass(c)"
        " and issubclass(c, e.DeltadError)]\n"
        "assert len(names) > 10, names\n"
        "for n in names:\n"
        "    assert n in deltad.__all__, n\n"
        "    assert getattr(deltad, n) is getattr(e, n), n\n"
        "from deltad import OverloadedError, SpoolError, UnsupportedModelError\n"
        "assert 'torch' not in sys.modules\n"
        "print(len(names))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd="/"
    )
    assert out.returncode == 0, out.stderr


# -- SegmentPublisher on a real DMP -----------------------------------------------------------


def _publisher_worker(rank: int, world_size: int, spool: str) -> None:
    from deltad.errors import UnsupportedModelError
    from deltad.publish.publisher import SegmentPublisher
    from deltad.publish.tracker import DeltaTracker
    from deltad.segment.reader import read_segment
    from deltad.segment.spool import SpoolLayout

    dmp = toy_dmp(world_size)
    cfg = PublisherConfig(Path(spool), model="toy", every_steps=1, fsync=False)
    layout = SpoolLayout(Path(spool), "toy")

    # Steps: ints (not bools), never decreasing; refused before anything is written.
    pub = SegmentPublisher(dmp, cfg)
    with pytest.raises(ConfigError, match=r"^step must be an int"):
        pub.start(0.5)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^step must be in 0\.\."):
        pub.start(-1)
    gen = pub.start(0)
    dmp(batch(rank, 1))[0].backward()
    assert pub.maybe_publish(1) is not None

    def files() -> list[int]:
        return [seq for seq, _ in layout.segments(gen, rank)]

    pub.wait_copied()
    written = len(pub.stats.segments)
    for bad, message in (
        (101.5, r"^step must be an int .*101\.5"),  # was published, then quarantined
        ("101", r"^step must be an int .*'101'"),  # was a raw TypeError
        (True, r"^step must be an int .*True"),
        (0, r"^step 0 is below the last step given \(1\)"),  # was accepted silently
    ):
        with pytest.raises(ConfigError, match=message):
            pub.maybe_publish(bad)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match=message):
            pub.publish(bad)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match=message):
            pub.close(bad)  # type: ignore[arg-type]
    assert len(pub.stats.segments) == written
    assert pub.maybe_publish(1) is None  # the same step again: nothing due, not refused
    dmp(batch(rank, 2))[0].backward()
    assert pub.maybe_publish(2) is not None
    with pytest.raises(ConfigError, match=r"^step 1 is below the last step given \(2\)"):
        pub.close(1)  # was a final segment at an older step
    pub.close(2)  # the final segment may repeat the last step
    steps = [read_segment(path).header.step for _, path in layout.segments(gen, rank)]
    assert steps == [0, 1, 2, 2] and files() == [0, 1, 2, 3]

    # close() detached the tracker it attached: a new publisher on the model is accepted,
    # also after a close of a publisher never started; closing again does nothing.
    pub.close(2)
    unstarted = SegmentPublisher(dmp, cfg)
    unstarted.close(0)
    with pytest.raises(Exception, match="closed"):
        unstarted.start(0)  # its hooks are gone: it cannot start any more
    again = SegmentPublisher(dmp, cfg)
    for module in (dmp.module.ebc, dmp.module.ec):
        assert module.post_lookup_tracker_fn is not None
    gen2 = again.start(3)
    dmp(batch(rank, 3))[0].backward()
    again.close(3)
    for module in (dmp.module.ebc, dmp.module.ec):  # no hook left running on every forward
        assert module.post_lookup_tracker_fn is None and module.post_odist_tracker_fn is None
    assert gen2 > gen

    # A tracker passed in stays the caller's: close() leaves it attached.
    tracker = DeltaTracker(dmp)
    mine = SegmentPublisher(dmp, cfg, tracker=tracker)
    mine.close(0)
    with pytest.raises(UnsupportedModelError, match="already has a tracker"):
        DeltaTracker(dmp)
    tracker.detach()
    DeltaTracker(dmp).detach()


@pytest.mark.slow
def test_the_publisher_refuses_bad_steps_and_close_detaches(tmp_path: Path) -> None:
    spawn(_publisher_worker, 1, tmp_path, str(tmp_path / "spool"))
