"""The split block's reach check at start (hetconv.split, ``--replicate split``): every worker
is asked whether it reaches the others at the addresses the master uses; one that a peer
cannot reach is left out of the exchange, named, and computes the block whole (as with
``first``), and training still equals local training, also with a worker killed mid-step.

The worker the others cannot reach is real: the master reaches it through a small TCP
forwarder on loopback that forwards only this process's connections (the master's) and closes
any other process's (the peers') at once, as a firewall between the workers would.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

import exactness
import grpc
import pytest
from exactness import FAST, same_as_local, train_strong_lrn

from hetconv.conv import LocalConv
from hetconv.master.client import WorkerClient, WorkerError
from hetconv.master.cluster import Cluster, ClusterConfig
from hetconv.master.launch import LocalWorkers
from hetconv.split import left_out

pytestmark = pytest.mark.skipif(
    not Path("/proc/net/tcp").exists(), reason="the forwarder tells processes apart by /proc"
)

SHARES = {"conv1": (0, 1, 1, 6), "conv2": (4, 4, 4, 4)}
SPLIT = dict(**FAST, shares=SHARES, stages="fused", replicate="split")


def _ours(peer: tuple[str, int]) -> bool:
    """Whether the TCP connection from ``peer`` (a loopback address and port) is one of this
    process's sockets (IPv4, or IPv6 with the address mapped)."""
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            mine.add(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue
    ip = socket.inet_aton(peer[0])[::-1].hex().upper()  # as /proc/net/tcp* writes it
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, _, port = fields[1].partition(":")
            if address.endswith(ip) and int(port, 16) == peer[1]:
                if f"socket:[{fields[9]}]" in mine:
                    return True
    return False


class OursOnly:
    """A TCP forwarder on 127.0.0.1 to ``target`` for this process's connections only."""

    def __init__(self, target: str):
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.server = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.server.getsockname()[1]}"
        self.refused = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, peer = self.server.accept()
            except OSError:
                return
            if not _ours(peer):
                self.refused += 1
                conn.close()
                continue
            try:
                out = socket.create_connection(self.target)
            except OSError:  # the worker is gone (killed)
                conn.close()
                continue
            for a, b in ((conn, out), (out, conn)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.server.close()


@pytest.fixture(scope="module")
def workers():
    with LocalWorkers(3) as started:
        yield started


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    return train_strong_lrn(tmp_path_factory.mktemp("local"), "local", LocalConv())


def test_left_out_takes_the_fewest_workers():
    assert left_out(["a", "b", "c"], {}) == {}
    # a and b cannot reach c: c goes, named with both
    out = left_out(["a", "b", "c"], {"a": {"c": "refused"}, "b": {"c": "no answer in 2 s"}})
    assert out == {"c": "a cannot reach it (refused); b cannot reach it (no answer in 2 s)"}
    # one direction fails: the one that could not be reached goes
    assert left_out(["a", "b"], {"a": {"b": "x"}}) == {"b": "a cannot reach it (x)"}
    # c reaches nobody: c goes, not the others
    out = left_out(["a", "b", "c"], {"c": {"a": "x", "b": "y"}})
    assert out == {"c": "cannot reach a (x); cannot reach b (y)"}
    # a worker that did not answer the check goes first; its pairs count no more
    assert left_out(["a", "b", "c"], {"a": {"c": "x"}}, {"c": "gone"}) == {"c": "gone"}


def test_the_reach_check_is_bounded_and_refuses_bad_addresses(workers):
    """A peer that never accepts (a listening socket nobody accepts on) costs the check its
    timeout, not more; a live peer is reached; an address that is not HOST:PORT is refused,
    named."""
    hole = socket.create_server(("127.0.0.1", 0), backlog=1)  # never accepted
    black = f"127.0.0.1:{hole.getsockname()[1]}"
    client = WorkerClient(workers.addresses[0])
    try:
        start = time.monotonic()
        got = client.reach_peers([workers.addresses[1], black, "127.0.0.1:1"], timeout=1.0)
        took = time.monotonic() - start
        assert took < 4.0, took
        assert set(got) == {black, "127.0.0.1:1"}, got
        assert got[black] == "no answer in 1 s"
        assert "unavailable" in got["127.0.0.1:1"]
        with pytest.raises(WorkerError, match="'nowhere' is not HOST:PORT"):
            client.reach_peers(["nowhere"])
        with pytest.raises(WorkerError, match="peer timeout 60"):
            client.reach_peers([workers.addresses[1]], timeout=60.0)
    finally:
        client.close()
        hole.close()


def _left_out_run(addresses, tmp_path, cluster_type=Cluster, **kwargs):
    trace = tmp_path / "trace.jsonl"
    with cluster_type(addresses, **kwargs) as cluster:
        got = train_strong_lrn(tmp_path, "reach", cluster, trace=str(trace))
        line = cluster.describe_replica()
        record = cluster.plan_record()
        lost = [(e["worker"], e["step"]) for e in cluster.events if e["event"] == "worker_lost"]
    steps = {r["step"]: r for r in map(json.loads, trace.read_text().splitlines()) if "step" in r}
    return got, line, record, lost, steps


def test_a_worker_the_others_cannot_reach_is_left_out_and_training_stays_exact(
    local, workers, tmp_path
):
    forwarder = OursOnly(workers.addresses[2])
    addresses = [*workers.addresses[:2], forwarder.address]
    try:
        got, line, record, lost, steps = _left_out_run(
            addresses, tmp_path, config=ClusterConfig(**SPLIT, kernels="resident")
        )
    finally:
        forwarder.close()
    same_as_local(got, local)
    assert forwarder.refused >= 2  # both peers tried it
    who = forwarder.address
    assert f"split: {who} left out of the exchange: {addresses[0]} cannot reach it (" in line
    assert set(record["replica_left_out"]) == {who}, record["replica_left_out"]
    assert not lost
    for step in steps.values():  # the two others split the batch; the third computes it whole
        split = step["replica_split"]["conv1"]
        assert len(split["images"]) == 2 and sum(split["images"]) == 8, split


def test_with_one_worker_left_the_block_is_not_split(local, workers, tmp_path):
    """Two workers, one the other cannot reach: the block is computed whole on both, as with
    first, and the line says why."""
    forwarder = OursOnly(workers.addresses[1])
    addresses = [workers.addresses[0], forwarder.address]
    shares = {"conv1": (0, 4, 4), "conv2": (6, 5, 5)}
    config = ClusterConfig(**{**SPLIT, "shares": shares}, kernels="resident")
    try:
        got, line, record, lost, steps = _left_out_run(addresses, tmp_path, config=config)
    finally:
        forwarder.close()
    same_as_local(got, local)
    assert "computed on every node" in line, line
    assert "not split: fewer than two workers reach each other" in line, line
    assert set(record["replica_left_out"]) == {forwarder.address}
    assert not lost and all(not s.get("replica_split") for s in steps.values())


class Killing(exactness.Killing):
    BASE = {**SPLIT, "deadline_floor": 5.0}


@pytest.mark.parametrize("victim", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_a_mixed_split_stays_exact_with_a_worker_killed_mid_step(local, tmp_path, victim):
    """Two split peers and a whole-block worker (left out): killing a split peer in backward
    (the master fetches the rows for its images from the other peer, not from the whole-block
    worker), or the whole-block worker (its slice's gradient goes back through the master's
    whole block), training equals local training."""
    with LocalWorkers(3) as started:
        forwarder = OursOnly(started.addresses[2])
        addresses = [*started.addresses[:2], forwarder.address]
        try:
            got, line, record, lost, steps = _left_out_run(
                addresses, tmp_path, Killing, victim=started.processes[victim], at=4,
                when="backward", kernels="resident",
            )  # fmt: skip
        finally:
            forwarder.close()
    same_as_local(got, local)
    assert set(record["replica_left_out"]) == {forwarder.address}
    assert lost == [(addresses[victim], 4)], lost
    if victim == 0:  # from step 5 one split peer is left: no split
        assert "replica_split" not in steps[5] or not steps[5]["replica_split"], steps[5]
    else:
        assert len(steps[5]["replica_split"]["conv1"]["images"]) == 2


def test_a_bad_peer_address_in_describe_is_refused(workers):
    """The wire check itself: a Describe naming peers answers only for those it checked."""
    channel = grpc.insecure_channel(workers.addresses[0])
    try:
        from hetconv.calls import DESCRIBE
        from hetconv.proto import worker_pb2 as pb

        stub = DESCRIBE.method.stub(channel)
        plain = stub(pb.DescribeRequest(), timeout=10)
        assert list(plain.unreachable) == []
        with pytest.raises(grpc.RpcError) as caught:
            stub(pb.DescribeRequest(peers=["a:b:c:x"]), timeout=10)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not HOST:PORT" in caught.value.details()
    finally:
        channel.close()
