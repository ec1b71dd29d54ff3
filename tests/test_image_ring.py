"""The whole network split by images with the ring exchange (``--split images --exchange
ring``, :mod:`hetconv.master.ring`): real worker processes, compared with training on one
machine."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import numpy as np
import pytest
from exactness import FAST, STRONG_LRN, same_as_local, train_strong_lrn

from hetconv.costmodel import SWITCHED, SimCluster, SimNode
from hetconv.dataparallel import parameter_bytes
from hetconv.master.cluster import ClusterConfig
from hetconv.master.launch import LocalWorkers
from hetconv.master.ring import RingImageSplit, image_split_class
from hetconv.master.spotcheck import SpotCheckConfig
from hetconv.onnx_import import load_network
from hetconv.ring import (
    MASTER,
    RING,
    all_gather,
    all_gather_doubling,
    all_reduce,
    all_to_all,
    choose,
    chunk_bounds,
    digest,
    digest_of_values,
    digest_values,
    doubling_rounds,
    flat,
    join64,
    master_link_bytes,
    split64,
    unflat,
)
from hetconv.worker.imagesplit import ImagesCalls
from hetconv.worker.ring import RingCalls, RingFailed


class Recording(RingImageSplit):
    """A ring split that keeps every step's trace fields, and runs ``actions`` (step -> a
    callable) once the step's ranges are cut, and ``in_flight`` ones while its calls are out
    (the master's own range)."""

    exchange = RING

    def __init__(self, addresses, actions=None, in_flight=None, **config):
        config.setdefault("spot_checks", SpotCheckConfig(every=0))  # none with the ring
        super().__init__(addresses, config=ClusterConfig(**config))
        self.actions, self.in_flight = dict(actions or {}), dict(in_flight or {})
        self.steps = []

    def _local(self, model, *args):
        if self.step in self.in_flight:
            self.in_flight.pop(self.step)()
        return super()._local(model, *args)

    def _ranges(self, batch):
        ranges = super()._ranges(batch)
        if self.step in self.actions:
            self.actions.pop(self.step)()
        return ranges

    def end_step(self):
        record = super().end_step()
        self.steps.append(record)
        return record


# -- the ring itself, in one process ----------------------------------------------------------


def _ring_in_threads(vectors: list[np.ndarray]) -> list[np.ndarray]:
    """:func:`all_reduce` of ``vectors``, one thread per rank, parts through queues."""
    import queue

    ranks = len(vectors)
    boxes = [queue.Queue() for _ in range(ranks)]
    out = [None] * ranks

    def rank(r: int) -> None:
        def send(round_, segment, chunk):
            boxes[(r + 1) % ranks].put(((round_, segment), chunk))

        def receive(round_, segment):
            got_part, chunk = boxes[r].get(timeout=5)
            assert got_part == (round_, segment)
            return chunk

        out[r] = all_reduce(vectors[r].copy(), r, ranks, send, receive)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


@pytest.mark.parametrize("ranks, length", [(1, 5), (2, 7), (3, 10), (4, 3)])
def test_all_reduce_gives_every_rank_the_same_sum_bit_for_bit(ranks, length):
    rng = np.random.default_rng(ranks)
    vectors = [rng.standard_normal(length).astype(np.float32) for _ in range(ranks)]
    got = _ring_in_threads(vectors)
    for g in got:
        assert g.tobytes() == got[0].tobytes()
    np.testing.assert_allclose(got[0], np.sum(vectors, axis=0), rtol=1e-6, atol=1e-6)
    assert [b - a for a, b in chunk_bounds(length, ranks)] == [
        len(c) for c in np.array_split(np.zeros(length), ranks)
    ]


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_all_gather_sums_float64_in_rank_order_on_every_rank(ranks):
    import queue

    rng = np.random.default_rng(ranks)
    values = [rng.standard_normal(5) * 1e3 for _ in range(ranks)]
    boxes = [queue.Queue() for _ in range(ranks)]
    out = [None] * ranks

    def rank(r: int) -> None:
        def send(round_, segment, piece):
            boxes[(r + 1) % ranks].put(piece)

        out[r] = join64(all_gather(split64(values[r]), r, ranks, send,
                                   lambda round_, segment: boxes[r].get(timeout=5)))  # fmt: skip

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for got in out:
        assert got.tobytes() == out[0].tobytes()
    np.testing.assert_allclose(out[0], np.sum(values, axis=0), rtol=1e-13)


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_all_to_all_puts_every_piece_at_once_and_sums_as_the_gather(ranks):
    """Batch norm's sums: every rank puts its piece into every other before it waits for any
    (one round, not ``ranks - 1`` in turn), and each holds the gather's pieces in rank order:
    the same float64 sum bit for bit."""
    import queue

    rng = np.random.default_rng(ranks)
    values = [rng.standard_normal(5) * 1e3 for _ in range(ranks)]
    boxes = [{s: queue.Queue() for s in range(ranks)} for _ in range(ranks)]
    events: list[tuple[int, str]] = []
    out = [None] * ranks

    def rank(r: int) -> None:
        def send(round_, segment, piece, to):
            assert round_ == r and to != r
            events.append((r, "put"))
            boxes[to][round_].put(piece)

        def receive(round_, segment):
            events.append((r, "wait"))
            return boxes[r][round_].get(timeout=5)

        out[r] = join64(all_to_all(split64(values[r]), r, ranks, send, receive))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in range(ranks):
        mine = [what for who, what in events if who == r]
        assert mine == ["put"] * (ranks - 1) + ["wait"] * (ranks - 1)
    in_order = join64([split64(v) for v in values])  # the gather's pieces, in rank order
    for got in out:
        assert got.tobytes() == in_order.tobytes()
    np.testing.assert_allclose(in_order, np.sum(values, axis=0), rtol=1e-13)


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 5, 8])
def test_the_doubling_gather_puts_log2_parts_and_sums_as_the_gather(ranks):
    """Batch norm's sums on four workers or more: ``ceil(log2(ranks))`` puts out and in per
    rank (the gather and the all-to-all put ``ranks - 1``), the pieces in rank order on every
    rank: the same float64 sum bit for bit."""
    import queue

    rng = np.random.default_rng(ranks)
    values = [rng.standard_normal(5) * 1e3 for _ in range(ranks)]
    boxes = [{k: queue.Queue() for k in range(4)} for _ in range(ranks)]
    puts, out = [0] * ranks, [None] * ranks

    def rank(r: int) -> None:
        def send(round_, segment, part, to):
            puts[r] += 1
            boxes[to][round_].put(part)

        out[r] = join64(all_gather_doubling(split64(values[r]), r, ranks, send,
                                            lambda k, s: boxes[r][k].get(timeout=5)))  # fmt: skip

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert puts == [doubling_rounds(ranks)] * ranks
    assert doubling_rounds(ranks) == {1: 0, 2: 1, 3: 2, 4: 2, 5: 3, 8: 3}[ranks]
    in_order = join64([split64(v) for v in values])
    for got in out:
        assert got.tobytes() == in_order.tobytes()


def test_flat_digest_round_trips():
    arrays = [np.arange(6, dtype=np.float32).reshape(2, 3), np.ones(4, np.float32)]
    back = unflat(flat(arrays), [a.shape for a in arrays])
    assert all((a == b).all() for a, b in zip(arrays, back, strict=True))
    d = digest(arrays)
    assert digest_of_values(digest_values(d)) == d
    arrays[1][2] = np.nextafter(np.float32(1), np.float32(2))
    assert digest(arrays) != d


def test_cost_model_counts_the_master_link_and_chooses():
    assert master_link_bytes(100, 3, MASTER) == 600
    assert master_link_bytes(100, 3, RING) == 200
    link = 125e6  # gigabit, switched
    nodes = tuple(SimNode(f"w{i}", 50.0, bytes_per_s=link, rtt_s=2e-4) for i in range(3))
    cluster = SimCluster(SimNode("m", 50.0, bytes_per_s=link), nodes, SWITCHED)
    chosen, seconds = choose(cluster, 14e6)  # paper-150-800's parameters, about
    assert chosen == RING and seconds[RING] < seconds[MASTER]
    one = SimCluster(SimNode("m", 50.0, bytes_per_s=link), nodes[:1], SWITCHED)
    seconds = choose(one, 14e6)[1]  # one worker: the same bytes each way
    assert seconds[RING] == pytest.approx(seconds[MASTER], rel=0.05)


# -- real worker processes -----------------------------------------------------------------


def test_equal_to_local_training_and_every_copy_bitwise_equal(tmp_path, local, workers):
    cluster = Recording(workers.addresses, deterministic=True)
    with cluster:
        got = train_strong_lrn(tmp_path, "ring", cluster)
    same_as_local(got, local)
    assert all(r["split"] == "images" and r["exchange"] == RING for r in cluster.steps)
    # placed once, at the first step; after each update every worker's weights are the
    # master's, bit for bit (the digests of their weights)
    for i, record in enumerate(cluster.steps):
        for name in workers.addresses:
            node = record["nodes"][name]
            assert node["placed"] == (i == 0)
            assert node["digest"] == record["digest"], (i, name)


def test_bytes_on_the_master_link_are_the_ring_exchange(tmp_path, workers):
    """After the first step (which places the weights), the master's link carries the
    parameters twice a step (its gradient into rank 0, the sum back), plus each worker's
    images, labels, losses and hits: what hetconv.ring.master_link_bytes counts."""
    trace = tmp_path / "trace.jsonl"
    cluster = Recording(workers.addresses, deterministic=True)
    with cluster:
        train_strong_lrn(tmp_path, "bytes", cluster, trace=str(trace), steps=3)
    params = parameter_bytes(STRONG_LRN)
    record = cluster.steps[-1]
    images = [record["nodes"][name]["images"] for name in workers.addresses]
    calls = sum(record["nodes"][n]["bytes_sent"] + record["nodes"][n]["bytes_received"]
                for n in workers.addresses)  # fmt: skip
    assert record["master_part_bytes"] == params  # the master's part put into rank 0
    moved = calls + params
    data = sum(3 * 1024 + i * 3 * 32 * 32 + 4 * i + 8 * i + 20 for i in images)
    counted = master_link_bytes(params, len(images), RING)
    assert counted + data < moved < counted + data + 8192  # headers
    assert moved < master_link_bytes(params, len(images), MASTER)
    plan = json.loads(trace.read_text().splitlines()[0])
    assert plan["exchange"] == RING and plan["master_link_bytes"] == counted


def test_worker_killed_mid_ring_loses_no_step(tmp_path, local):
    """A worker SIGKILLed while its call is out (after it computed, during the ring): that
    step goes through the master (exact), and the next ones ring over the survivor."""
    with LocalWorkers(2) as started:
        victim = started.processes[1]
        stop = {5: lambda: os.kill(victim.pid, signal.SIGSTOP)}
        kill = {5: lambda: (victim.kill(), victim.wait())}
        cluster = Recording(started.addresses, stop, kill, deterministic=True, **FAST)
        with cluster:
            got = train_strong_lrn(tmp_path, "killed", cluster)
    same_as_local(got, local)
    assert cluster.steps[5]["exchange"] == MASTER
    assert cluster.steps[5]["nodes"][started.addresses[1]].get("covered_by") == "master"
    assert all(r["exchange"] == RING for r in cluster.steps[6:])
    assert cluster.steps[6]["nodes"][started.addresses[0]]["placed"]  # re-placed after it
    assert all(r["workers_computed"] == 1 for r in cluster.steps[7:])


@pytest.mark.slow
def test_rejoining_worker_is_placed_again(tmp_path, local):
    """A worker that hung (lost at its call's deadline) rejoins at a step boundary and gets
    the weights and momentum again: training stays equal to local training, and its copy is
    the master's, bit for bit."""
    import time

    from hetconv.master.membership import READY

    with LocalWorkers(2) as started:
        pid, name = started.processes[1].pid, started.addresses[1]

        def resume():
            os.kill(pid, signal.SIGCONT)
            deadline = time.monotonic() + 30
            while cluster.nodes[2].state != READY and time.monotonic() < deadline:
                time.sleep(0.05)

        actions = {2: lambda: os.kill(pid, signal.SIGSTOP), 5: resume}
        cluster = Recording(started.addresses, actions, deterministic=True, **FAST)
        with cluster:
            got = train_strong_lrn(tmp_path, "rejoined", cluster)
    same_as_local(got, local)
    back = [i for i, r in enumerate(cluster.steps) if i > 2 and name in r["nodes"]]
    assert back, "the worker never rejoined"
    assert cluster.steps[back[0]]["nodes"][name]["placed"]
    assert cluster.steps[-1]["nodes"][name]["digest"] == cluster.steps[-1]["digest"]


def test_image_split_class_checks_the_exchange():
    assert image_split_class("ring").exchange == RING
    with pytest.raises(ValueError, match="--exchange 'x' is not one of auto, master, ring"):
        image_split_class("x")


class CorruptingImages(ImagesCalls):
    """ImagesStep whose worker nudges one weight after its update of step 3 (a fault the
    digest shows)."""

    def _sum_and_update(self, request, kept, names, grads, *rest):
        got = super()._sum_and_update(request, kept, names, grads, *rest)
        if request.step == 3:
            weight = kept.model.parameters()[names[0]]
            weight.flat[0] = np.nextafter(weight.flat[0], np.float32(np.inf))
        return got


def test_a_copy_that_differs_is_placed_again(tmp_path, local, workers, monkeypatch):
    from hetconv.backends import get_backend
    from hetconv.worker import service as service_module

    monkeypatch.setattr(service_module, "ImagesCalls", CorruptingImages)
    faulty = service_module.ConvWorkerService(get_backend("cpu"))
    server, address = service_module.start_server(faulty, "127.0.0.1:0")
    try:
        cluster = Recording([workers.addresses[0], address], deterministic=True)
        with cluster:
            got = train_strong_lrn(tmp_path, "differs", cluster)
    finally:
        server.stop(0)
        faulty.close()
    same_as_local(got, local)  # its copy never computed: placed again before step 4
    assert cluster.steps[3]["nodes"][address]["weights_differ"]
    assert cluster.steps[4]["nodes"][address]["placed"]
    assert not cluster.steps[5]["nodes"][address]["placed"]
    events = [(e["event"], e["step"]) for r in cluster.steps for e in r.get("events", [])]
    assert ("weights_differ", 3) in events
    assert all(r["exchange"] == RING for r in cluster.steps)


def test_train_with_the_ring_on_local_workers(tmp_path, capsys):
    from hetconv.cli import main

    trace = tmp_path / "trace.jsonl"
    argv = ["train", "--split", "images", "--exchange", "ring", "--steps", "2", "--batch", "8",
            "--train-size", "32", "--eval-size", "8", "--no-run-dir", "--no-progress",
            "--trace", str(trace), "--deterministic", "--local-workers", "2",
            "--spot-check-every", "0"]  # fmt: skip
    assert main(argv) == 0
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    plan, steps = records[0], [r for r in records if "step" in r]
    assert plan["exchange"] == RING and plan["exchange_why"] == "--exchange ring"
    assert [r["exchange"] for r in steps] == [RING, RING]
    assert "gradients summed by a ring among the workers (--exchange ring)" in (
        capsys.readouterr().err
    )


def test_train_refuses_an_exchange_without_the_split_by_images(capsys):
    from hetconv.cli import main

    argv = ["train", "--steps", "1", "--no-run-dir", "--split", "kernels", "--exchange", "ring"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--exchange says how a split by images sums its gradients: with --split kernels" in err


def test_the_simulator_and_the_plan_rank_the_ring():
    """simulate_image_split with the ring: the master's link carries the parameters twice
    plus the images; on four equal laptops on switched gigabit at batch 64 it beats the
    exchange through the master, and hetconv plan lists it with its command."""
    from hetconv.imagecost import simulate_image_split
    from hetconv.simulations.plan import IMAGE_SPLIT, IMAGE_SPLIT_RING, candidates

    link = 940e6 / 8
    nodes = tuple(SimNode(f"w{i}", 60.0, bytes_per_s=link, rtt_s=3e-3) for i in range(3))
    cluster = SimCluster(SimNode("m", 60.0, bytes_per_s=link), nodes, SWITCHED)
    ps = simulate_image_split(cluster, "paper-150-800", 64, 0.05)
    ring = simulate_image_split(cluster, "paper-150-800", 64, 0.05, exchange=RING)
    params = parameter_bytes(load_network("paper-150-800").spec)
    images = 48 * 3 * 32 * 32
    assert ring.master_bytes == master_link_bytes(params, 3, RING) + images
    assert ps.master_bytes == master_link_bytes(params, 3, MASTER) + images
    assert ring.step_s < ps.step_s and ring.compute_s == ps.compute_s
    ranked = candidates(cluster, "paper-150-800", 64, 0.05)
    labels = {c.label: c for c in ranked}
    assert labels[IMAGE_SPLIT_RING].step_s < labels[IMAGE_SPLIT].step_s
    assert labels[IMAGE_SPLIT_RING].how.endswith("--split images --exchange ring")


def test_a_ring_run_resumes_from_its_checkpoint(tmp_path, local, workers):
    """The checkpoint holds the master's copy and momentum (every worker's, bit for bit); the
    resumed run places them on the workers and goes on as local training does."""
    folder = str(tmp_path / "checkpoints")
    with Recording(workers.addresses, deterministic=True) as cluster:
        train_strong_lrn(tmp_path, "first", cluster, steps=3, checkpoint_dir=folder)
    with Recording(workers.addresses, deterministic=True) as cluster:
        losses, _ = train_strong_lrn(
            tmp_path, "resumed", cluster, steps=6, checkpoint_dir=folder, resume=True
        )
    assert len(cluster.steps) == 3  # steps 3, 4 and 5: the rest came from the checkpoint
    assert [r["nodes"][workers.addresses[0]]["placed"] for r in cluster.steps] == [
        True,
        False,
        False,
    ]
    np.testing.assert_allclose(losses, local[0][:6], rtol=1e-5)


class DyingRing(RingCalls):
    """A worker's ring that stops the worker's server, as if its process died, in step 3:
    once it has put its part of the first round (``at="round"``), or once its ring is done
    (``"after"``); its call then never answers."""

    def __init__(self, context, at: str):
        super().__init__(context)
        self.at, self.server, self.ended = at, None, threading.Event()

    def _die(self):
        self.server.stop(0)
        self.ended.wait(10)  # the call is gone with the server: nothing answers
        raise RingFailed("stopped")

    def _receive(self, session, step, round_, wait):
        if step == 3 and self.at == "round":
            self._die()
        return super()._receive(session, step, round_, wait)

    def _after(self, request):
        if request.step == 3 and self.at == "after":
            time.sleep(0.5)  # the answer to rank 0's last put on its way
            self._die()

    def all_reduce(self, request, vector, offset=0, bounds=None):
        summed = super().all_reduce(request, vector, offset, bounds)
        if bounds is None:  # the whole gradient's ring (not a bucket's)
            self._after(request)
        return summed

    def buckets(self, request, shapes, master_part):
        got = super().buckets(request, shapes, master_part)
        finish = got.finish

        def finish_then_die(gradients):
            summed = finish(gradients)
            self._after(request)
            return summed

        got.finish = finish_then_die
        return got


@pytest.mark.parametrize("buckets", [0, 4096], ids=["after-backward", "overlapped"])
@pytest.mark.parametrize(("at", "exchange"), [("round", MASTER), ("after", MASTER)])
def test_a_rank_dying_mid_ring_loses_no_step(tmp_path, local, workers, at, exchange, buckets):
    """Rank 1 dies at step 3: mid-ring (rank 0's next put fails), or after the ring (its
    chunk of the sum, which each rank answers, never comes): that step goes through the
    master. Either way the step is the same and the next ones ring over the survivor; so too
    with the ring overlapped with backward (small buckets: several a step)."""
    from hetconv.backends import get_backend
    from hetconv.worker import service as service_module

    dying = service_module.ConvWorkerService(get_backend("cpu"))
    dying.context.ring = ring = DyingRing(dying.context, at)
    server, address = service_module.start_server(dying, "127.0.0.1:0")
    ring.server = server
    try:
        cluster = Recording([workers.addresses[0], address], deterministic=True, **FAST)
        cluster.bucket_bytes = buckets
        with cluster:
            got = train_strong_lrn(tmp_path, f"dies-{at}", cluster)
    finally:
        ring.ended.set()
        server.stop(0)
        dying.close()
    same_as_local(got, local)
    assert cluster.steps[3]["exchange"] == exchange
    assert cluster.steps[3]["nodes"][address]["covered_by"] == "master"
    assert all(r["exchange"] == RING and address not in r["nodes"] for r in cluster.steps[4:])
    survivor = [r["nodes"][workers.addresses[0]] for r in cluster.steps[4:6]]
    assert [n["placed"] for n in survivor] == [exchange == MASTER, False]


def test_the_ring_runs_with_spot_checks_and_checks_each_step_by_sketches(tmp_path):
    """`--exchange ring` with the default spot checks: each worker answers sketches of its own
    gradient (hetconv.ringcheck), and the steps drawn record the ring's checks."""
    from hetconv.cli import main

    trace = tmp_path / "trace.jsonl"
    argv = ["train", "--split", "images", "--exchange", "ring", "--spot-check-every", "1",
            "--spot-check-sample", "2", "--steps", "2", "--batch", "8", "--train-size", "32",
            "--eval-size", "8",
            "--no-run-dir", "--no-progress", "--trace", str(trace),
            "--local-workers", "2"]  # fmt: skip
    assert main(argv) == 0
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    plan, steps = records[0], [r for r in records if "step" in r and "nodes" in r]
    assert plan["exchange"] == RING and plan["exchange_why"] == "--exchange ring"
    assert [r["exchange"] for r in steps] == [RING, RING]
    for record in steps:
        checked = record["spot_checks"]["workers"]
        assert len(checked) == 2 and all(c["worst"] < 1e-3 for c in checked.values())


@pytest.mark.slow
def test_paper_150_800_with_the_ring_equal_to_local_training_with_a_worker_killed(tmp_path):
    import io

    from exactness import RUN

    from hetconv.conv import LocalConv
    from hetconv.training import TrainConfig, train

    def trained(name, executor):
        weights = tmp_path / f"{name}.npz"
        run = {**RUN, "preset": "paper-150-800", "eval_size": 0, "save": str(weights)}
        with executor:
            losses = train(TrainConfig(**run), executor, log=io.StringIO()).losses
        return losses, dict(np.load(weights))

    local = trained("local", LocalConv())
    with LocalWorkers(2) as started:
        victim = started.processes[0]
        stop = {11: lambda: os.kill(victim.pid, signal.SIGSTOP)}
        kill = {11: lambda: (victim.kill(), victim.wait())}
        cluster = Recording(started.addresses, stop, kill, deterministic=True, **FAST)
        got = trained("ring", cluster)
    same_as_local(got, local)
    assert cluster.steps[11]["exchange"] == MASTER
    assert all(r["exchange"] == RING for r in cluster.steps[:11] + cluster.steps[12:])
