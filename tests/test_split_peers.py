"""Which peers a worker of a block split by images connects to (hetconv.split): only those its
session's master prepared. Real worker processes on loopback, and a listening socket that
records every connection made to it: a split naming it is refused, and nothing connects."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from hetconv.master.client import WorkerAuthError, WorkerClient, WorkerError
from hetconv.master.launch import LocalWorkers
from hetconv.replica import ReplicaBlock
from hetconv.split import SplitPlan
from hetconv.stages import StageSpec

TOKEN = "peers-token-Qw7_z"
RELU = StageSpec.from_entries([{"type": "relu"}])


class Recorder:
    """A listening socket on loopback that accepts and counts every connection."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.accepted = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sock.close()


@pytest.fixture(scope="module")
def workers():
    with LocalWorkers(2, token=TOKEN) as started:
        yield started.addresses


@pytest.fixture
def recorder():
    got = Recorder()
    yield got
    got.close()


def _block() -> ReplicaBlock:
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 2, 6, 6)).astype(np.float32)
    w = rng.standard_normal((3, 2, 3, 3)).astype(np.float32)
    return ReplicaBlock("conv1", x, w, np.zeros(3, np.float32), (1, 1, 1, 1), RELU)


def _plan(*addresses: str) -> SplitPlan:
    return SplitPlan.of(list(addresses), [2] * len(addresses))


def test_a_split_naming_a_peer_the_session_did_not_prepare_is_refused_and_nothing_connects(
    workers, recorder
):
    """The session's first split fixes its peers; a later one naming another address without
    preparing it is refused by name, nothing connects to that address, and the prepared
    peers still split; another session prepares its own."""
    block = _block()
    client = WorkerClient(workers[0], token=TOKEN)
    try:
        client.replica_forward(71, 1, block, 30.0, _plan(workers[0], workers[1]))
        client._prepared = {71: frozenset([*workers, recorder.address])}  # as if prepared
        with pytest.raises(WorkerError, match=rf"split peer {recorder.address} is not one of"):
            client.replica_forward(71, 2, block, 30.0, _plan(workers[0], recorder.address))
        client.replica_forward(71, 3, block, 30.0, _plan(workers[1], workers[0]))
        time.sleep(1.0)  # time for a put to have connected, were one sent
        assert recorder.accepted == 0
    finally:
        client.close()


def test_a_split_without_the_token_is_refused_and_nothing_connects(workers, recorder):
    """A worker with a token refuses a split from a call without it before any handler runs:
    nothing connects to the peer it names."""
    block = _block()
    for token in (None, "wrong-token-Aa1_b"):
        client = WorkerClient(workers[0], token=token)
        try:
            with pytest.raises(WorkerAuthError):
                client.replica_forward(72, 1, block, 30.0, _plan(workers[0], recorder.address))
        finally:
            client.close()
    time.sleep(1.0)
    assert recorder.accepted == 0


def test_the_master_prepares_the_peers_anew_when_its_split_gains_a_worker(workers, recorder):
    """A split naming a worker the session's peers lack carries prepare from the master's
    client (a worker that joined): the worker takes it, and puts its part there."""
    block = _block()
    client = WorkerClient(workers[0], token=TOKEN)
    try:
        client.replica_forward(73, 1, block, 30.0, _plan(workers[0], workers[1]))
        client.replica_forward(73, 2, block, 30.0, _plan(workers[0], recorder.address))
        deadline = time.monotonic() + 10
        while not recorder.accepted and time.monotonic() < deadline:
            time.sleep(0.1)
        assert recorder.accepted >= 1
    finally:
        client.close()
