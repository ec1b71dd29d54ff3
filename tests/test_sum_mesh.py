"""The sum mesh (:mod:`hetconv.worker.summesh`): batch norm's small sums among a ring's
workers as frames on kept TCP connections, not RingPart calls."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from hetconv.worker.summesh import SumLinks, SumListener


class Filed:
    """A listener's ``file``: every part it gave, and a wait for a count of them."""

    def __init__(self, refuse: bool = False):
        self.parts: list[tuple] = []
        self.refuse = refuse
        self.changed = threading.Condition()

    def __call__(self, session, step, round_, segment, values):
        if self.refuse:
            raise ValueError("refused")
        with self.changed:
            self.parts.append((session, step, round_, segment, values))
            self.changed.notify_all()

    def wait(self, count: int, seconds: float = 10.0) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: len(self.parts) >= count, seconds)


@pytest.fixture
def mesh():
    made = []

    def make(file, listen_token=None, send_token=None):
        listener = SumListener("127.0.0.1", file, listen_token)
        links = SumLinks(send_token)
        made.append((listener, links))
        return listener, links

    yield make
    for listener, links in made:
        links.close()
        listener.close()


def test_parts_come_whole_with_their_keys_in_order(mesh, rng):
    filed = Filed()
    listener, links = mesh(filed, "secret", "secret")
    sent = [rng.standard_normal(n).astype(np.float32) for n in (1, 64, 5000)]
    for i, values in enumerate(sent):
        links.send(f"127.0.0.1:{9}", listener.port, 7, 3 + i, 256 + i, i, values)
    links.send("127.0.0.1:9", listener.port, 7, 9, 1, 0, np.zeros(0, np.float32))
    assert filed.wait(4)
    for i, values in enumerate(sent):
        session, step, round_, segment, got = filed.parts[i]
        assert (session, step, round_, segment) == (7, 3 + i, 256 + i, i)
        assert got.dtype == np.float32 and np.array_equal(got, values)
    assert filed.parts[3][4].size == 0
    assert listener.frames == 4


def test_a_wrong_token_files_nothing_and_the_sender_fails(mesh):
    filed = Filed()
    listener, links = mesh(filed, "secret", "guess")
    with pytest.raises(OSError):
        for _ in range(200):  # the listener closes the connection: a later write fails
            links.send("127.0.0.1:9", listener.port, 1, 1, 0, 0, np.ones(4, np.float32))
            time.sleep(0.01)
    assert not filed.wait(1, seconds=0.3) and listener.frames == 0


def test_no_token_on_either_side_is_accepted(mesh):
    filed = Filed()
    listener, links = mesh(filed)
    links.send("localhost:1", listener.port, 1, 1, 0, 0, np.ones(3, np.float32))
    assert filed.wait(1)


def test_a_refused_part_closes_its_connection(mesh):
    listener, links = mesh(Filed(refuse=True))
    with pytest.raises(OSError):
        for _ in range(200):
            links.send("127.0.0.1:9", listener.port, 1, 1, 0, 0, np.ones(4, np.float32))
            time.sleep(0.01)
    # the next part opens a new connection
    assert listener.frames == 0


def test_a_closed_port_fails_the_send_at_once(mesh):
    listener, links = mesh(Filed())
    port = listener.port
    listener.close()
    with pytest.raises(OSError):
        links.send("127.0.0.1:9", port, 1, 1, 0, 0, np.ones(4, np.float32))


def test_a_tls_worker_opens_no_sum_port():
    from types import SimpleNamespace

    from hetconv.worker.ring import RingCalls

    calls = RingCalls(SimpleNamespace())
    calls.use("token", tls=True)
    assert calls.listen("127.0.0.1") == 0
    calls.use("token", tls=False)
    try:
        assert calls.listen("127.0.0.1") > 0
    finally:
        calls.close()


def test_a_ring_step_sums_batch_norm_over_the_mesh(tmp_path, workers):
    """Two worker processes answer their sum ports; a conv-bn network split by images trains
    as local training (tests/test_image_syncbn.py) with every batch norm sum a mesh frame."""
    import grpc
    from exactness import same_as_local
    from test_image_syncbn import CONV_BN, _ring, _train
    from test_worker_budget import worker_memory

    from hetconv.conv import LocalConv

    before = {}
    for address in workers.addresses:
        with grpc.insecure_channel(address) as channel:
            before[address] = worker_memory(channel)["sum_frames"]
    cluster = _ring(workers.addresses)
    got = _train(tmp_path, "ring", cluster, CONV_BN, steps=3)
    local = _train(tmp_path, "local", LocalConv(), CONV_BN, steps=3)
    same_as_local(got, local)
    # a step: 2 batch norm layers, 2 sums each, one frame in per sum on a ring of two; the
    # gradient's ring, 2 rounds of one frame in (one bucket: the gradient is small)
    for address in workers.addresses:
        with grpc.insecure_channel(address) as channel:
            assert worker_memory(channel)["sum_frames"] - before[address] == 3 * (2 * 2 + 2)


def test_a_peer_whose_sum_port_cannot_be_reached_gets_its_parts_as_ring_calls(
    tmp_path, workers, monkeypatch
):
    """The master gives the second worker's sum port as one nothing listens on (a firewall's
    effect): the first worker's parts to it go as RingPart calls after the first fails, and
    the run still trains as local training, every step by the ring."""
    import socket

    import grpc
    from exactness import same_as_local
    from test_image_syncbn import CONV_BN, _ring, _train
    from test_worker_budget import worker_memory

    from hetconv.conv import LocalConv
    from hetconv.master import probing

    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        dead = closed.getsockname()[1]  # free once closed: nothing listens there
    blocked = workers.addresses[1]
    connect = probing.connect

    def connect_blocked(node, *args, **kwargs):
        connect(node, *args, **kwargs)
        if node.name == blocked:
            node.sum_port = dead

    monkeypatch.setattr(probing, "connect", connect_blocked)
    with grpc.insecure_channel(blocked) as channel:
        before = worker_memory(channel)["sum_frames"]
    cluster = _ring(workers.addresses)
    got = _train(tmp_path, "ring", cluster, CONV_BN, steps=3)
    same_as_local(got, _train(tmp_path, "local", LocalConv(), CONV_BN, steps=3))
    assert all(r["exchange"] == "ring" for r in cluster.steps)
    with grpc.insecure_channel(blocked) as channel:  # nothing came on its real sum port
        assert worker_memory(channel)["sum_frames"] == before


def test_worker_sum_port_flag_opens_that_port_and_describe_answers_it():
    import socket
    import subprocess
    import sys

    import grpc

    from hetconv.calls import DESCRIBE, READY, SERVICE_NAME
    from hetconv.proto import worker_pb2 as pb

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    argv = [sys.executable, "-m", "hetconv", "worker", "--listen", "127.0.0.1:0", "--backend",
            "cpu", "--sum-port", str(port), "--no-startup-probe", "--no-advertise",
            "--exit-on-stdin-close"]  # fmt: skip
    worker = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        lines = []
        for line in worker.stdout:
            lines.append(line)
            if line.startswith(READY):
                break
        assert f"ring sums: TCP port {port} (--sum-port)\n" in lines, lines
        address = lines[-1].split()[-1]
        with grpc.insecure_channel(address) as channel:
            describe = channel.unary_unary(
                f"/{SERVICE_NAME}/{DESCRIBE.name}",
                request_serializer=pb.DescribeRequest.SerializeToString,
                response_deserializer=pb.DeviceDescription.FromString,
            )
            assert describe(pb.DescribeRequest(), timeout=10).sum_port == port
    finally:
        worker.stdin.close()
        worker.wait(timeout=30)


def test_a_silent_connection_is_closed_and_past_the_cap_none_is_kept(monkeypatch):
    import socket

    from hetconv.worker import summesh

    monkeypatch.setattr(summesh, "HELLO_S", 0.2)
    monkeypatch.setattr(summesh, "MAX_CONNECTIONS", 2)
    filed = Filed()
    listener = SumListener("127.0.0.1", filed)
    try:
        held = [socket.create_connection(("127.0.0.1", listener.port)) for _ in range(3)]
        held[2].settimeout(5)
        assert held[2].recv(1) == b""  # the third: closed at once
        held[0].settimeout(5)
        assert held[0].recv(1) == b""  # no hello within HELLO_S: closed
        links = SumLinks()  # a peer that says its hello is served again
        links.send("127.0.0.1:1", listener.port, 1, 1, 0, 0, np.ones(2, np.float32))
        assert filed.wait(1)
        links.close()
        for connection in held:
            connection.close()
    finally:
        listener.close()
