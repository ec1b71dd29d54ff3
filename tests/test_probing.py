"""Probing before training: every node probes a layer at the same time (as they compute it in
training), or one at a time; with real worker processes on loopback."""

from __future__ import annotations

import io
import re
import threading

import pytest

from hetconv.backends import get_backend
from hetconv.master.client import WorkerClient, WorkerUnavailable
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
