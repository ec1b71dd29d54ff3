"""The ring's chunks in segments, pipelined (:func:`hetconv.ring.all_reduce`'s
``segment_values``, the ImagesRing's ``segment_bytes``): the same sum, bit for bit, as whole
chunks, in threads (each part a view of its sender's vector, delivered late and out of order)
and with real worker processes; a segment holding NaN is refused; a failed put ends the ring
at once, not at the wait for the next part."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest
from exactness import train_strong_lrn

from hetconv.backends import get_backend
from hetconv.calls import RING_PART
from hetconv.conv import LocalConv
from hetconv.master.client import WorkerClient, WorkerError
from hetconv.master.cluster import ClusterConfig
from hetconv.master.launch import LocalWorkers
from hetconv.master.ring import RingImageSplit
from hetconv.master.spotcheck import SpotCheckConfig
from hetconv.ring import (
    RING,
    all_reduce,
    all_reduce_seconds,
    bucket_chunks,
    buckets,
    chunk_bounds,
    rounds,
    schedule,
    segments,
)
from hetconv.worker import service as service_module
from hetconv.worker.ring import RingCalls, RingFailed, part_request

STEPS = 3


def _ring(vectors, segment_values: int, bounds=None, seed: int = 0):
    """Every rank's :func:`all_reduce` of ``vectors`` in threads (``bounds``: a bucket's
    chunks, the vectors the bucket); each part delivered on a timer of its own after a random
    delay of up to 2 ms, so in any order, as the view of its sender's vector it was sent as.
    Also every rank's parts sent, as (round, segment) in order."""
    ranks = len(vectors)
    boxes: list[dict] = [{} for _ in range(ranks)]
    changed = threading.Condition()
    out, sent = [None] * ranks, [[] for _ in range(ranks)]

    def rank(r: int) -> None:
        delays = np.random.default_rng([seed, r])

        def deliver(key, part) -> None:
            with changed:
                boxes[(r + 1) % ranks][key] = part
                changed.notify_all()

        def send(round_, segment, part):
            assert part.base is not None  # a view, not a copy
            sent[r].append((round_, segment))
            threading.Timer(delays.random() * 2e-3, deliver, ((round_, segment), part)).start()

        def receive(round_, segment):
            with changed:
                assert changed.wait_for(lambda: (round_, segment) in boxes[r], timeout=5)
                return boxes[r].pop((round_, segment))

        out[r] = all_reduce(vectors[r].copy(), r, ranks, send, receive, bounds, segment_values)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out, sent


def test_segments_tile_the_chunk():
    assert segments(0, 10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert segments(3, 9, 0) == [(3, 9)]
    assert segments(3, 9, 100) == [(3, 9)]
    assert segments(5, 5, 4) == []


@pytest.mark.parametrize(
    "ranks, length, segment",
    [(1, 5, 2), (2, 7, 1), (3, 100, 7), (4, 1000, 64), (4, 3, 2), (5, 1001, 200)],
)
def test_segments_sum_bit_for_bit_as_whole_chunks(ranks, length, segment):
    rng = np.random.default_rng(length)
    scales = 10.0 ** rng.integers(-3, 4, (ranks, length))  # sums that round differently
    vectors = [(rng.standard_normal(length) * s).astype(np.float32) for s in scales]
    whole, whole_sent = _ring(vectors, 0)
    got, sent = _ring(vectors, segment, seed=length)
    for g in got:
        assert g.tobytes() == whole[0].tobytes()
    # every round's chunk went in segments of ``segment`` values
    bounds = chunk_bounds(length, ranks)
    for r in range(ranks):
        chunks = [bounds[schedule(r, ranks, k)[0]] for k in range(rounds(ranks))]
        assert sent[r] == [(k, s) for k, (a, b) in enumerate(chunks)
                           for s in range(len(segments(a, b, segment)))]  # fmt: skip
        assert whole_sent[r] == [(k, 0) for k, (a, b) in enumerate(chunks) if b > a]


def test_a_buckets_segments_sum_bit_for_bit_as_the_whole_ring():
    ranks, sizes = 3, [40, 7, 300, 5, 120]
    rng = np.random.default_rng(7)
    vectors = [rng.standard_normal(sum(sizes)).astype(np.float32) for _ in range(ranks)]
    whole, _ = _ring(vectors, 0)
    summed = [v.copy() for v in vectors]
    for a, b in buckets(sizes, ranks, 100):
        bounds = bucket_chunks((a, b), summed[0].size, ranks)
        got, _ = _ring([v[a:b] for v in summed], 9, bounds, seed=a)
        for v, g in zip(summed, got, strict=True):
            v[a:b] = g
    for v in summed:
        assert v.tobytes() == whole[0].tobytes()


@pytest.mark.parametrize("cpu", [1.0, 0.03], ids=["link-bound", "cpu-bound"])
def test_the_cost_model_counts_the_segments_pipelined(cpu):
    """Whole chunks: the rounds one after another, each its transfer, its parts' software and
    a latency; in segments: the link and the core at once, the slower setting the pace, one
    segment and a latency to fill the pipeline. At 3 % of a core the software is slower
    than the link (the segments gain more)."""
    from dataclasses import replace

    from hetconv.costmodel import SWITCHED, SimCluster, SimNode
    from hetconv.dataparallel import RING as DP_RING
    from hetconv.dataparallel import CollectiveCosts, exchange_seconds
    from hetconv.ring import PART_BYTES_PER_S, part_seconds

    link, rtt, nbytes = 87.5e6, 5e-3, 14e6  # the testbed's switched links, paper-150-800
    nodes = tuple(SimNode(f"w{i}", 50.0, bytes_per_s=link, rtt_s=rtt) for i in range(4))
    cluster = SimCluster(SimNode("m", 50.0, bytes_per_s=link), nodes, SWITCHED)
    workers = replace(cluster, master_compute=False)
    costs = CollectiveCosts().scaled(cpu)
    chunk, latency = nbytes / 4, costs.message_s + rtt / 2
    link = min(link, costs.tcp_bytes_per_s)  # TCP's own software, at the share of a core
    software = part_seconds(chunk, costs)
    assert software == pytest.approx(chunk / (PART_BYTES_PER_S * cpu))
    adds = 3 * chunk / costs.sum_bytes_per_s
    whole = all_reduce_seconds(workers, nbytes, costs, segment_bytes=0)
    assert whole == pytest.approx(exchange_seconds(workers, nbytes, DP_RING, costs) + 6 * software)
    assert whole == pytest.approx(6 * (chunk / link + software + latency) + adds)
    piped = all_reduce_seconds(workers, nbytes, costs, segment_bytes=2**20)  # 4 a chunk
    pace = max(chunk / link, software)
    assert (pace == software) == (cpu < 1)
    assert piped == pytest.approx(6 * pace + (chunk / link + software) / 4 + latency + adds)
    assert piped < whole
    assert all_reduce_seconds(workers, nbytes, costs, segment_bytes=chunk) == whole  # one


# -- a worker's ring --------------------------------------------------------------------------


@pytest.fixture
def served():
    """A worker service in this process, serving on loopback: (service, address)."""
    service = service_module.ConvWorkerService(get_backend("cpu"))
    server, address = service_module.start_server(service, "127.0.0.1:0")
    try:
        yield service, address
    finally:
        server.stop(0)
        service.close()


def _put(address: str, values: np.ndarray, round_: int, segment: int, step: int = 1) -> None:
    client = WorkerClient(address)
    try:
        request = part_request(7, step, 1, round_, segment=segment)
        client._call(RING_PART, "a ring part", request, [("p", values)], [], {}, 5.0, 0)
    finally:
        client.close()


def test_each_segment_is_filed_apart_and_a_nan_segment_refused(served):
    service, address = served
    ring = service.context.ring
    _put(address, np.arange(4, dtype=np.float32), 3, 2)
    _put(address, np.ones(4, np.float32), 3, 0)
    assert ring._receive(7, 1, (3, 2), 1.0).tolist() == [0, 1, 2, 3]
    assert ring._receive(7, 1, (3, 0), 1.0).tolist() == [1, 1, 1, 1]
    with pytest.raises(RingFailed, match=r"^round 3 \(segment 1\) did not come within 0\.1 s$"):
        ring._receive(7, 1, (3, 1), 0.1)
    with pytest.raises(WorkerError, match="the ring part holds NaN or Inf"):
        _put(address, np.array([0, np.nan, 1], np.float32), 3, 5)
    with pytest.raises(RingFailed, match="did not come"):
        ring._receive(7, 1, (3, 5), 0.1)


def test_two_workers_ring_in_segments_with_at_most_a_few_puts_in_flight(monkeypatch):
    """Two workers' rings in this process, in segments of 256 bytes: the sum is the whole
    chunks' bit for bit, and no rank has more than OUTSTANDING puts out at once."""
    from hetconv.worker import peers
    from hetconv.worker.ring import OUTSTANDING

    flying, most, lock = {}, {}, threading.Lock()
    put = peers.PeerLinks.put

    def counted(links, *args):
        with lock:
            flying[id(links)] = flying.get(id(links), 0) + 1
            most[id(links)] = max(most.get(id(links), 0), flying[id(links)])
        time.sleep(0.002)
        try:
            return put(links, *args)
        finally:
            with lock:
                flying[id(links)] -= 1

    monkeypatch.setattr(peers.PeerLinks, "put", counted)
    services = [service_module.ConvWorkerService(get_backend("cpu")) for _ in range(2)]
    servers = [service_module.start_server(s, "127.0.0.1:0") for s in services]
    rng = np.random.default_rng(3)
    vectors = [rng.standard_normal(10_000).astype(np.float32) for _ in services]
    out = [None, None]
    try:

        def rank(r: int) -> None:
            request = part_request(5, 1, r, 0)
            request.images.ring.peers.extend([address for _, address in servers])
            request.images.ring.wait_seconds = 10.0
            request.images.ring.segment_bytes = 256
            out[r] = services[r].context.ring.all_reduce(request, vectors[r].copy())

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    finally:
        for (server, _), service in zip(servers, services, strict=True):
            server.stop(0)
            service.close()
    whole, _ = _ring(vectors, 0)
    assert out[0].tobytes() == out[1].tobytes() == whole[0].tobytes()
    assert len(most) == 2 and 1 < max(most.values()) <= OUTSTANDING


def test_a_failed_put_ends_the_ring_at_once(served):
    """The next rank's address takes no calls: the ring fails with the put's failure within
    a moment, not when its wait for a part (30 s here) is out."""
    service, address = served
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"  # closed again: nothing listens there
    ring = service.context.ring
    ring.begin(9, 1)
    request = part_request(9, 1, 0, 0)
    request.images.ring.peers.extend([address, dead])
    request.images.ring.wait_seconds = 30.0
    request.images.ring.segment_bytes = 64
    start = time.monotonic()
    with pytest.raises(RingFailed, match=f"^the put to {dead} failed: UNAVAILABLE$"):
        ring.all_reduce(request, np.ones(1000, np.float32))
    assert time.monotonic() - start < 10


def test_an_abort_is_not_queued_behind_puts_into_a_peer_that_does_not_answer(served):
    """Rank 0's next rank takes connections but never answers: its puts hold every sender
    thread until their deadline (4 s); an abort still reaches the third rank at once, and
    rank 0's ring, waiting for a put's end, ends with it."""
    service, address = served
    other = service_module.ConvWorkerService(get_backend("cpu"))
    server, third = service_module.start_server(other, "127.0.0.1:0")
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    try:
        ring = service.context.ring
        request = part_request(11, 1, 0, 0)
        request.images.ring.peers.extend([address, f"127.0.0.1:{silent.getsockname()[1]}", third])
        request.images.ring.wait_seconds = 4.0
        request.images.ring.segment_bytes = 64
        failed = []

        def run():
            try:
                ring.all_reduce(request, np.ones(3000, np.float32))
            except RingFailed as e:
                failed.append(str(e))

        thread = threading.Thread(target=run)
        thread.start()
        time.sleep(0.5)  # its puts into the silent rank are out
        start = time.monotonic()
        ring.abort(request)
        while (11, 1) not in other.context.ring._aborted and time.monotonic() < start + 5:
            time.sleep(0.02)
        assert time.monotonic() - start < 1.5
        thread.join(10)
        assert failed == ["another rank said the ring failed"]
    finally:
        silent.close()
        server.stop(0)
        other.close()


# -- real worker processes ------------------------------------------------------------------


class Segmented(RingImageSplit):
    exchange = RING

    def __init__(self, addresses, segment_bytes: int, bucket_bytes: int):
        super().__init__(addresses, config=ClusterConfig(spot_checks=SpotCheckConfig(every=0),
                                                         deterministic=True))  # fmt: skip
        self.segment_bytes, self.bucket_bytes = segment_bytes, bucket_bytes
        self.steps: list[dict] = []

    def end_step(self):
        record = super().end_step()
        self.steps.append(record)
        return record


class CountingRing(RingCalls):
    """A worker's ring (in the test's process) that counts the segments it was given (put
    as RingPart calls or written to its sum port)."""

    def __init__(self, context):
        super().__init__(context)
        self.segments: set[int] = set()

    def file(self, session, step, round_, segment, part):
        super().file(session, step, round_, segment, part)
        with self._changed:
            self.segments.add(segment)


@pytest.mark.parametrize(
    "bucket_bytes",
    [pytest.param(0, marks=pytest.mark.slow), 4096],
    ids=["after-backward", "overlapped"],
)
def test_segmented_ring_trains_as_whole_chunks_and_local_training(tmp_path, bucket_bytes):
    """3 steps on a worker in this process (rank 0) and a worker process (rank 1): in
    segments of 1 KB the losses and weights are whole chunks' bit for bit, and local
    training's to round-off."""
    from exactness import same_as_local

    local = train_strong_lrn(tmp_path, "local", LocalConv(), steps=STEPS)
    service = service_module.ConvWorkerService(get_backend("cpu"))
    ring = CountingRing(service.context)
    service.context.ring = ring  # before its server takes the ring's calls
    server, address = service_module.start_server(service, "127.0.0.1:0")
    runs = {}
    try:
        with LocalWorkers(1) as started:
            for segment_bytes in (0, 1024):
                with Segmented([address, *started.addresses], segment_bytes, bucket_bytes) as c:
                    runs[segment_bytes] = train_strong_lrn(
                        tmp_path, f"ring-{segment_bytes}", c, steps=STEPS
                    )
                assert [r["exchange"] for r in c.steps] == [RING] * STEPS
    finally:
        server.stop(0)
        service.close()
    assert len(ring.segments) > 4  # the chunks went in segments
    (whole_losses, whole), (losses, weights) = runs[0], runs[1024]
    assert np.asarray(losses).tobytes() == np.asarray(whole_losses).tobytes()
    assert weights.keys() == whole.keys()
    for name in weights:
        assert weights[name].tobytes() == whole[name].tobytes(), name
    same_as_local(runs[1024], local)


def test_a_rank_dying_mid_ring_in_segments_loses_no_step(tmp_path):
    """Rank 1 (a worker in this process) dies in step 3 once its first segment is out, with
    parts of 1 KB: rank 0's waits or puts fail, that step goes through the master, the next
    ring over the survivor, and 5 steps equal local training's."""
    from exactness import FAST, same_as_local
    from test_image_ring import DyingRing, Recording

    local = train_strong_lrn(tmp_path, "local", LocalConv(), steps=5)
    dying = service_module.ConvWorkerService(get_backend("cpu"))
    dying.context.ring = ring = DyingRing(dying.context, "round")
    server, address = service_module.start_server(dying, "127.0.0.1:0")
    ring.server = server
    try:
        with LocalWorkers(1) as started:
            cluster = Recording([started.addresses[0], address], deterministic=True, **FAST)
            cluster.segment_bytes = 1024
            with cluster:
                got = train_strong_lrn(tmp_path, "dies", cluster, steps=5)
    finally:
        ring.ended.set()
        server.stop(0)
        dying.close()
    same_as_local(got, local)
    assert [r["exchange"] for r in cluster.steps] == [RING, RING, RING, "master", RING]
    assert cluster.steps[3]["nodes"][address]["covered_by"] == "master"
