"""Probing before training: every node probes a layer at the same time (as they compute it in
training), or one at a time; with real worker processes on loopback. What the probe lines name
(layers as written) and what the network line says on loopback."""

from __future__ import annotations

import io
import re
import threading

import pytest

from hetconv.backends import get_backend
from hetconv.master import connecting, probing
from hetconv.master.client import WorkerClient, WorkerUnavailable
from hetconv.master.config import ClusterConfig
from hetconv.master.launch import LocalWorkers
from hetconv.master.membership import MASTER, Node
from hetconv.master.probing import planned_layers, probe_every
from hetconv.model import Model, load_spec


class _Meeting:
    """A worker's client whose probes first wait for every other worker's probe to be under
    way (a barrier): it passes only if the probes are in flight at the same time."""

    def __init__(self, client, barrier: threading.Barrier, calls: list, wait: float = 10.0):
        self._client, self._barrier, self._calls, self._wait = client, barrier, calls, wait

    def probe(self, *args, **kwargs):
        self._calls.append(threading.get_ident())
        self._barrier.wait(timeout=self._wait)  # BrokenBarrierError: not at the same time
        return self._client.probe(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._client, name)


@pytest.fixture(scope="module")
def two():
    with LocalWorkers(2) as started:
        clients = [WorkerClient(a, connect_timeout=30) for a in started.addresses]
        yield clients
        for client in clients:
            client.close()


def _layers():
    return planned_layers(Model(load_spec("tiny")).conv_specs(), batch=8)


def test_every_node_probes_a_layer_at_the_same_time(two):
    barrier, calls = threading.Barrier(2), []
    nodes = [Node(MASTER, None)] + [Node(c.address, _Meeting(c, barrier, calls)) for c in two]
    log = io.StringIO()
    probe_every(nodes, _layers(), get_backend("cpu"), repeats=1, log=log)
    lines = log.getvalue().splitlines()
    assert lines[0] == (
        "probing 3 nodes on 2 layers (forward + backward of each layer's real shape, best of 1), "
        "all nodes at once:"
    )
    assert len(lines) == 7 and [re.match(r"  \[(\d)/6\]", x)[1] for x in lines[1:]] == list(
        "123456"
    )
    assert len(calls) == 4 and threading.get_ident() not in calls  # in threads of their own
    for node in nodes:
        assert set(node.probe_seconds) == {"conv1", "conv2"}
        assert all(s > 0 for s in node.probe_seconds.values())


def test_one_at_a_time_never_overlaps(two):
    barrier, calls = threading.Barrier(2), []
    nodes = [Node(MASTER, None)] + [
        Node(c.address, _Meeting(c, barrier, calls, wait=2.0)) for c in two
    ]
    log = io.StringIO()
    # the barrier waits for a second probe that never comes while the first is under way
    with pytest.raises(threading.BrokenBarrierError):
        probe_every(nodes[:2] + [Node(two[1].address, two[1])], _layers()[:1],
                    get_backend("cpu"), repeats=1, log=log, together=False)  # fmt: skip
    assert log.getvalue().splitlines()[0].endswith("one at a time:")
    # without the barrier, the same nodes probe in turn, in node order
    plain = [Node(MASTER, None)] + [Node(c.address, c) for c in two]
    log = io.StringIO()
    probe_every(plain, _layers(), get_backend("cpu"), repeats=1, log=log, together=False)
    names = [
        line.split(" on ", 1)[1].rsplit(": ", 1)[0] for line in log.getvalue().splitlines()[1:]
    ]
    assert names == [MASTER, *(c.address for c in two)] * 2


def test_a_failed_probe_is_raised_after_the_others_end(two):
    class Gone:
        address = "127.0.0.1:1"

        def probe(self, *args, **kwargs):
            raise WorkerUnavailable(self.address, "connection refused")

    nodes = [Node(MASTER, None), Node(two[0].address, two[0]), Node("127.0.0.1:1", Gone())]
    with pytest.raises(WorkerUnavailable, match="127.0.0.1:1"):
        probe_every(nodes, _layers()[:1], get_backend("cpu"), repeats=1)
    assert "conv1" in nodes[0].probe_seconds and "conv1" in nodes[1].probe_seconds
    assert not nodes[2].probe_seconds


# -- what the probe lines and the network line say ----------------------------------------------


def test_a_strided_layer_is_named_as_written_not_as_its_stride_phases():
    spec = [
        {"type": "conv", "name": "conv1", "out": 32, "kernel": 3, "padding": 1},
        {"type": "relu"},
        {"type": "conv", "name": "conv3", "out": 64, "kernel": 3, "stride": 2, "padding": 1},
        {"type": "fc", "out": 10},
    ]
    layers = planned_layers(Model(spec, input_shape=(3, 8, 8)).conv_specs(), batch=32)
    assert layers[1].shape.c == 128 and layers[1].shape.kh == 2  # what executors compute
    log = io.StringIO()
    probe_every([Node(MASTER, None)], layers, get_backend("cpu"), repeats=1, log=log)
    lines = log.getvalue().splitlines()
    assert lines[1].startswith("  [1/2] conv1 (3->32 channels, 3x3, 8x8, batch 32) on master: ")
    assert lines[2].startswith(
        "  [2/2] conv3 (32->64 channels, 3x3, stride 2, 8x8, batch 32) on master: "
    ), lines[2]


@pytest.mark.parametrize(
    ("address", "here"),
    [("127.0.0.1:50052", True), ("localhost:50052", True), ("[::1]:50051", True),
     ("192.0.2.7:50051", False), ("no-such-host.invalid:50051", False)],
)  # fmt: skip
def test_workers_on_this_machine_are_told_apart(address, here):
    assert probing.on_this_machine(address) is here


def test_an_address_of_this_machines_own_is_this_machine():
    own = [ip for ip in probing._own_addresses() if "." in ip and not ip.startswith("127.")]
    if not own:
        pytest.skip("this machine has no non-loopback IPv4 address")
    assert probing.on_this_machine(f"{own[0]}:50051")


def test_the_network_on_loopback_says_loopback_and_times_no_medium(two, monkeypatch):
    nodes = [Node(c.address, c) for c in two]
    for node in nodes:
        probing.connect(node, connect_timeout=30, deadline=30.0)

    def no_duplex(*args, **kwargs):
        raise AssertionError("the duplex ratio was timed on loopback")

    monkeypatch.setattr(probing, "_echo_seconds", no_duplex)
    config = ClusterConfig()
    medium = connecting.measure_medium(nodes, config, emit=lambda *a, **k: None)
    assert medium.loopback and medium.network == "switched"
    assert medium.describe().startswith(
        "network: loopback (this machine): every worker runs on the master's machine, so no "
        "medium was measured (planned as switched); all workers at once "
    ), medium.describe()
    assert "Wi-Fi" not in medium.describe() and "duplex" not in medium.describe()
    assert medium.together_bytes_per_s > 0
    assert medium.record()["loopback"] is True and medium.record()["duplex_ratio"] is None
