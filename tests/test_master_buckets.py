"""The master's own gradient put into rank 0 bucket by bucket as its backward gives it
(:mod:`hetconv.master.ringparts`), not whole after its range."""

from __future__ import annotations

import threading

import numpy as np
from exactness import STRONG_LRN, same_as_local, train_strong_lrn
from test_image_ring import Recording

from hetconv.conv import LocalConv
from hetconv.dataparallel import parameter_bytes
from hetconv.master import ringparts
from hetconv.ring import MASTER_ROUND, RING, buckets
from hetconv.worker.ring import RingCalls


class Calls:
    """A client stand-in for :class:`~hetconv.master.ringparts.MasterBuckets`' puts: each
    put's bucket and values, in order, and whether the last parameter was given when it
    went."""

    def __init__(self, bucket_of_interest_ready: threading.Event):
        self.puts: list[tuple[int, np.ndarray, bool]] = []
        self.done = bucket_of_interest_ready

    def put(self, client, session, step, vector, timeout, segment=0):
        self.puts.append((segment, np.array(vector), self.done.is_set()))


def test_each_bucket_goes_once_its_parameters_are_given(monkeypatch, rng):
    shapes = [(8, 3, 3, 3), (8,), (16, 8, 3, 3), (16,), (10, 64), (10,)]
    given = threading.Event()
    calls = Calls(given)
    monkeypatch.setattr(ringparts, "put_master_part", calls.put)
    sender = ringparts.MasterBuckets(None, 1, 2, shapes, 2, 4 * 300, lambda n: 1.0)
    grads = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    for i in range(len(shapes) - 1, 0, -1):  # backward's order: the last layer's first
        sender.ready(i, grads[i])
    expected = buckets([int(np.prod(s)) for s in shapes], 2, 300)
    assert len(expected) > 1
    # every bucket but the one holding the first parameter can go before the end
    for _ in range(200):
        if len(calls.puts) == len(expected) - 1:
            break
        threading.Event().wait(0.01)
    assert len(calls.puts) == len(expected) - 1
    given.set()
    sender.finish(grads)
    assert [k for k, _, _ in calls.puts] == list(range(len(expected)))
    assert [late for _, _, late in calls.puts] == [False] * (len(expected) - 1) + [True]
    vector = np.concatenate([g.reshape(-1) for g in grads])
    for k, values, _ in calls.puts:
        start, stop = expected[k]
        assert np.array_equal(values, vector[start:stop])


class MasterParts(RingCalls):
    """Rank 0's ring, in this process: the master's parts it was given, by bucket."""

    def __init__(self, context):
        super().__init__(context)
        self.master_buckets: set[int] = set()

    def file(self, session, step, round_, segment, part):
        super().file(session, step, round_, segment, part)
        if round_ == MASTER_ROUND:
            with self._changed:
                self.master_buckets.add(segment)


def test_the_master_part_by_buckets_trains_as_local_training(tmp_path, workers):
    """Rank 0 a worker in this process, the ring by small buckets, the master computing a
    range: its part comes in several buckets, and 3 steps equal local training's."""
    from hetconv.backends import get_backend
    from hetconv.worker import service as service_module

    local = train_strong_lrn(tmp_path, "local", LocalConv(), steps=3)
    service = service_module.ConvWorkerService(get_backend("cpu"))
    service.context.ring = ring = MasterParts(service.context)
    server, address = service_module.start_server(service, "127.0.0.1:0")
    try:
        cluster = Recording([address, workers.addresses[0]], deterministic=True)
        cluster.bucket_bytes = 4096
        with cluster:
            got = train_strong_lrn(tmp_path, "ring", cluster, steps=3)
    finally:
        server.stop(0)
        service.close()
    same_as_local(got, local)
    assert all(r["exchange"] == RING for r in cluster.steps)
    assert all(r["master_part_bytes"] == parameter_bytes(STRONG_LRN) for r in cluster.steps)
    assert len(ring.master_buckets) > 1
