"""The ring of the split by images overlapped with backward (:func:`hetconv.ring.buckets`,
:class:`hetconv.worker.ring.BucketRing`), the digests' samples, and the master out of the
batch: bucket by bucket the sum is the whole vector's ring's, bit for bit; with real workers,
training is the same bit for bit with and without the overlap, and equal to local training."""

from __future__ import annotations

import queue
import threading
import time

import numpy as np
import pytest
from exactness import train_strong_lrn

from hetconv.costmodel import SWITCHED, SimCluster, SimNode
from hetconv.master.cluster import ClusterConfig
from hetconv.master.ring import RingImageSplit
from hetconv.master.spotcheck import SpotCheckConfig
from hetconv.ring import (
    DIGEST_BLOCK,
    RING,
    all_reduce,
    bucket_chunks,
    buckets,
    digest,
    ring_exchange_seconds,
    rounds,
)
from hetconv.worker.ring import RingCalls


def _ring(vectors: list[np.ndarray], sizes: list[int] | None = None, bucket: int = 0):
    """Every rank's sum of ``vectors`` in threads: the whole vector's ring, or (``bucket``
    values a bucket) bucket by bucket over ``sizes``, as a worker overlapping backward."""
    ranks = len(vectors)
    boxes = [queue.Queue() for _ in range(ranks)]
    out = [None] * ranks

    def rank(r: int) -> None:
        def io(offset):
            def send(round_, segment, chunk):
                boxes[(r + 1) % ranks].put(((offset + round_, segment), chunk))

            def receive(round_, segment):
                got_part, chunk = boxes[r].get(timeout=5)
                assert got_part == (offset + round_, segment)
                return chunk

            return send, receive

        v = vectors[r].copy()
        if not bucket:
            out[r] = all_reduce(v, r, ranks, *io(0))
            return
        for k, (a, b) in enumerate(buckets(sizes, ranks, bucket)):
            all_reduce(v[a:b], r, ranks, *io(k * rounds(ranks)),
                       bucket_chunks((a, b), v.size, ranks))  # fmt: skip
        out[r] = v

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


@pytest.mark.parametrize("ranks, bucket", [(2, 50), (3, 7), (4, 1), (4, 10_000), (5, 120)])
def test_buckets_sum_bit_for_bit_as_the_whole_ring(ranks, bucket):
    rng = np.random.default_rng(ranks)
    sizes = [int(s) for s in rng.integers(1, 90, size=12)]
    length = sum(sizes)
    vectors = [(rng.standard_normal(length) * 10 ** rng.uniform(-3, 3, length)).astype(np.float32)
               for _ in range(ranks)]  # fmt: skip
    whole = _ring(vectors)
    got = _ring(vectors, sizes, bucket)
    for g in got:
        assert g.tobytes() == whole[0].tobytes()
    chosen = buckets(sizes, ranks, bucket)  # backward's order: the last parameters first
    assert chosen[0][1] == length and chosen[-1][0] == 0
    assert all(a == d for (a, _), (_, d) in zip(chosen, chosen[1:], strict=False))
    assert len(chosen) * rounds(ranks) <= 256


def test_buckets_keep_to_the_rounds_a_sum_has():
    many = buckets([1] * 1000, 2, 1)  # a bucket per parameter would need 2000 rounds
    assert len(many) * rounds(2) <= 256 and many[0][1] == 1000 and many[-1][0] == 0


def test_a_sampled_digest_sees_a_changed_block_it_covers_and_no_other():
    values = np.zeros(10 * DIGEST_BLOCK, np.float32)
    seed, share = 7, 0.3
    from hetconv.ring import digest_blocks

    taken = set(digest_blocks(np.random.default_rng(seed), values.size, share).tolist())
    assert 0 < len(taken) < 10
    base = digest([values], seed, share)
    for block in range(10):
        changed = values.copy()
        changed[block * DIGEST_BLOCK + 5] = 1.0
        assert (digest([changed], seed, share) != base) == (block in taken)
        assert digest([changed]) != digest([values])  # the whole digest sees every value
    small = np.zeros(DIGEST_BLOCK, np.float32)
    nudged = small.copy()
    nudged[-1] = 1.0
    assert digest([nudged], seed, share) != digest([small], seed, share)  # small: whole


def test_the_overlap_hides_the_ring_behind_backward_in_the_cost_model():
    link = 90e6  # ~720 Mbit/s
    workers = tuple(SimNode(f"w{i}", 50.0, bytes_per_s=link, rtt_s=2e-4) for i in range(4))
    cluster = SimCluster(SimNode("m", 50.0, bytes_per_s=link), workers, SWITCHED,
                         master_compute=False)  # fmt: skip
    after = ring_exchange_seconds(cluster, 14e6)
    during = ring_exchange_seconds(cluster, 14e6, backward_s=0.4)
    assert during < after
    long = ring_exchange_seconds(cluster, 14e6, backward_s=100.0)  # all but the last bucket hid
    assert during >= long - 1e-12 and long > 14e6 / link  # the sum back to the master stays
    master = SimCluster(cluster.master, workers, SWITCHED, master_compute=True)
    assert ring_exchange_seconds(master, 14e6, backward_s=0.4) > after  # its part: no overlap


# -- real workers ---------------------------------------------------------------------------


class Traced(RingImageSplit):
    """A ring split keeping each step's record, its buckets and digests set per instance."""

    exchange = RING

    def __init__(self, addresses, bucket_bytes: int, digest_share: float = 1.0, **config):
        config.setdefault("spot_checks", SpotCheckConfig(every=0))
        super().__init__(addresses, config=ClusterConfig(**config))
        self.bucket_bytes, self.digest_share = bucket_bytes, digest_share
        self.steps = []

    def end_step(self):
        record = super().end_step()
        self.steps.append(record)
        return record


def test_overlapped_training_is_the_plain_ring_bit_for_bit_and_local(tmp_path, local, workers):
    """20 steps with small buckets (several a step, summed during backward) and with the
    whole gradient summed after backward: the same losses, weights and per-step digests bit
    for bit, and both equal to local training."""
    runs = {}
    for name, bucket in (("plain", 0), ("overlapped", 2048)):
        cluster = Traced(workers.addresses, bucket, deterministic=True)
        with cluster:
            runs[name] = (train_strong_lrn(tmp_path, name, cluster), cluster.steps)
    (plain, plain_steps), (overlapped, overlapped_steps) = runs["plain"], runs["overlapped"]
    assert plain[0] == overlapped[0]  # the losses, as floats
    for key, value in plain[1].items():
        assert value.tobytes() == overlapped[1][key].tobytes(), key
    assert [r["digest"] for r in plain_steps] == [r["digest"] for r in overlapped_steps]
    assert all(r["exchange"] == RING for r in overlapped_steps)
    from exactness import same_as_local

    same_as_local(overlapped, local)


class Counting(RingCalls):
    """A worker's ring that keeps, per step, how many buckets began before backward ended."""

    def __init__(self, context):
        super().__init__(context)
        self.early: dict[int, tuple[int, int]] = {}

    def buckets(self, request, shapes, master_part):
        got = super().buckets(request, shapes, master_part)
        finish, ready = got.finish, got.ready

        def slow_first_layer(index, gradient):  # backward's last gradient: a slower backward
            if index == 0:
                time.sleep(0.05)
            ready(index, gradient)

        def counted(gradients):
            summed = finish(gradients)
            self.early[int(request.step)] = (got.early, len(got._buckets))
            return summed

        got.finish, got.ready = counted, slow_first_layer
        return got


def test_buckets_go_while_backward_runs(tmp_path, local, workers):
    """The master out of the batch (nothing for rank 0 to wait for): buckets' rings begin
    before the worker's backward has ended; training stays local training's, and the sampled
    digests agree with the master's copy."""
    from hetconv.backends import get_backend
    from hetconv.worker import service as service_module

    service = service_module.ConvWorkerService(get_backend("cpu"))
    service.context.ring = counting = Counting(service.context)
    server, address = service_module.start_server(service, "127.0.0.1:0")
    try:
        cluster = Traced([workers.addresses[0], address], 2048, digest_share=1 / 8,
                         deterministic=True, master_compute=False)  # fmt: skip
        with cluster:
            got = train_strong_lrn(tmp_path, "counted", cluster, steps=3)
    finally:
        server.stop(0)
        service.close()
    np.testing.assert_allclose(got[0], local[0][:3], rtol=1e-5)
    assert counting.early and all(b > 1 for _, b in counting.early.values())
    assert all(early >= 1 for early, _ in counting.early.values())  # before backward ended
    # the sampled digests still agree with the master's copy: never placed again
    assert all(not r["nodes"][address]["placed"] for r in cluster.steps[1:])


def test_the_master_computes_only_where_its_range_pays_for_its_part():
    from hetconv.ring import MASTER_RANGE_MARGIN, master_range_pays

    def during(images):  # the ring during backward: 0.1 s of it past backward's end
        return 0.1

    # equal nodes, 0.04 s an image: the master's part crossing its link in 0.01 s pays
    # where the ring after backward costs little
    pays, with_s, without_s = master_range_pays(20, [0.04] * 5, 0.01, 0.05, during)
    assert pays and with_s == pytest.approx(0.01 + 4 * 0.04 + 0.05)
    # predicted faster, but not by MASTER_RANGE_MARGIN: the workers alone
    close = (5 * 0.04 + 0.1) * (1 - MASTER_RANGE_MARGIN / 2) - (0.01 + 4 * 0.04)
    assert not master_range_pays(20, [0.04] * 5, 0.01, close, during)[0]
    assert without_s == pytest.approx(5 * 0.04 + 0.1)
    # its part takes 0.2 s and the ring after backward 0.3 s: the workers alone are faster
    pays, with_s, without_s = master_range_pays(20, [0.04] * 5, 0.2, 0.3, during)
    assert not pays and without_s == pytest.approx(5 * 0.04 + 0.1) and without_s < with_s


def test_the_master_range_put_bucket_by_bucket_leaves_the_ring_during_backward():
    """Where the master puts its part into rank 0 bucket by bucket as its backward goes
    (``overlapped``), the ring runs during the workers' backward with its range as without
    it: the step with it is priced by ``during`` of the workers' images, not by the whole
    ring after backward."""
    from hetconv.ring import master_range_pays

    asked = []

    def during(images):  # 0.01 s of ring past the passes an image of the busiest worker
        asked.append(list(images))
        return 0.01 * max(images)

    # the whole ring after backward (0.3 s) would cost the master's range its gain
    whole = master_range_pays(20, [0.04] * 5, 0.01, 0.3, during)
    assert not whole[0] and whole[1] == pytest.approx(0.01 + 4 * 0.04 + 0.3)
    assert asked == [[5, 5, 5, 5]]  # the workers alone: 5 images each
    asked.clear()
    pays, with_s, without_s = master_range_pays(20, [0.04] * 5, 0.01, 0.3, during,
                                                overlapped=True)  # fmt: skip
    assert asked[0] == [4, 4, 4, 4] and asked[1] == [5, 5, 5, 5]  # with its 4, then without
    # its part (0.01 s) crosses rank 0's link beside the ring: hidden as the ring is (all but
    # 0.04 s of 0.3)
    assert pays and with_s == pytest.approx(0.01 + 4 * 0.04 + 0.04 + 0.01 * 0.04 / 0.3)
    assert without_s == pytest.approx(whole[2]) == pytest.approx(5 * 0.04 + 0.05)
    # a ring backward hides nothing of: the part adds its whole time
    exposed = master_range_pays(20, [0.04] * 5, 0.01, 0.3, lambda images: 0.3, overlapped=True)
    assert exposed[1] == pytest.approx(0.01 + 4 * 0.04 + 0.3 + 0.01)


def test_the_master_weighs_the_spot_checks_it_would_run_after_its_own_range():
    """A checked step's recomputation of a worker's range follows the master's own range,
    so where one step in 2 is checked its range pays less: paid without checks, not with
    them (the mean over steps; the step's own draw never decides)."""
    from types import SimpleNamespace

    from hetconv.master.ringcheck import check_pricing
    from hetconv.ring import master_range_pays

    def during(images):
        return 0.05

    def checks(every, master_s):  # one range drawn on a checked step, 4 workers
        checker = SimpleNamespace(config=SpotCheckConfig(every=every, ranges=1))
        return check_pricing(checker, master_s, 4)

    pays, with_s, without_s = master_range_pays(20, [0.04] * 5, 0.01, 0.03, during)
    assert pays and with_s == pytest.approx(0.01 + 4 * 0.04 + 0.03)
    checked = master_range_pays(20, [0.04] * 5, 0.01, 0.03, during, checks(2, 0.04))
    # with its range: 4 images checked (0.16 s) past the ring's 0.03 s, one step in 2
    assert checked[1] == pytest.approx(with_s + (4 * 0.04 - 0.03) / 2)
    # without: 5 images (0.2 s) beside the workers' 0.25 s step: hidden
    assert checked[2] == pytest.approx(without_s) and not checked[0]
    # a master twice as slow: its check of 5 images (0.4 s) outlasts the workers' step
    slow = master_range_pays(20, [0.08, 0.04, 0.04, 0.04, 0.04], 0.01, 0.03, during,
                             checks(2, 0.08))  # fmt: skip
    assert slow[2] == pytest.approx(without_s + 0.5 * (5 * 0.08 - without_s))


def test_the_master_out_of_the_batch_trains_as_local_training(tmp_path, local, workers):
    """20 steps, the master computing no images (its range 0: nothing put into rank 0), the
    ring overlapped with backward: equal to local training, every copy the master's."""
    from exactness import same_as_local

    cluster = Traced(workers.addresses, 2048, digest_share=1 / 8, deterministic=True,
                     master_compute=False)  # fmt: skip
    with cluster:
        got = train_strong_lrn(tmp_path, "no-master", cluster)
    same_as_local(got, local)
    assert all(r["master_part_bytes"] == 0 and "master" not in r["nodes"] for r in cluster.steps)
    assert all(r["nodes"][n]["digest"] == r["digest"] for r in cluster.steps
               for n in workers.addresses)  # fmt: skip


def test_the_master_weighs_its_range_each_step_from_the_measured_figures(tmp_path, local, workers):
    """Not deterministic: once the nodes are measured, each step records whether the
    master's range pays (both predicted steps) and cuts the ranges so; training stays local
    training's."""
    cluster = Traced(workers.addresses, 2048, digest_share=1 / 8)
    with cluster:
        got = train_strong_lrn(tmp_path, "weighed", cluster, steps=5)
    np.testing.assert_allclose(got[0], local[0][:5], rtol=1e-5)
    weighed = [r for r in cluster.steps if "master_range_pays" in r]
    assert weighed, "never weighed"
    for r in weighed:
        assert r["predicted_with_master_s"] > 0 and r["predicted_without_master_s"] > 0
        if not r["master_range_pays"]:  # its range 0: it computed nothing, put nothing in
            assert "master" not in r["nodes"] and r["master_part_bytes"] == 0


def test_a_convolution_tells_its_kernel_gradient_before_computing_its_input_gradient():
    """Under a bucket ring's hooks (:func:`hetconv.imagesplit.backward_hooks`) each
    convolution's gradients are told before its input gradient is computed (its bucket's ring
    runs meanwhile), strided or not, and the pass's gradients are bit for bit backward's
    without the hooks."""
    from hetconv.backends.cpu import CpuBackend
    from hetconv.conv import LocalConv
    from hetconv.imagesplit import backward_hooks, images_gradients
    from hetconv.model import Model

    class Counted(CpuBackend):
        inputs = 0

        def conv_grad_input(self, *args, **kwargs):
            Counted.inputs += 1
            return super().conv_grad_input(*args, **kwargs)

    spec = [
        {"type": "conv", "name": "c1", "out": 6, "kernel": 3, "padding": 1},
        {"type": "relu"},
        {"type": "conv", "name": "c2", "out": 8, "kernel": 3, "padding": 1, "stride": 2},
        {"type": "relu"},
        {"type": "conv", "name": "c3", "out": 5, "kernel": 3, "padding": 1},
        {"type": "fc", "name": "fc", "out": 4},
    ]
    rng = np.random.default_rng(4)
    x = rng.standard_normal((3, 3, 8, 8)).astype(np.float32)
    labels = rng.integers(0, 4, 3)

    class Told:
        def __init__(self):
            self.told: dict[int, tuple[np.ndarray, int]] = {}

        def ready(self, index, gradient):
            self.told[index] = (np.array(gradient), Counted.inputs)

    got = []
    for hooks in (None, Told()):
        model = Model(spec, input_shape=(3, 8, 8), seed=2, executor=LocalConv(Counted()))
        model.train()
        Counted.inputs = 0
        with backward_hooks(model, hooks):
            got.append(images_gradients(model, x, labels, 0, 3, 0)[0])
    plain, hooked = got
    for name in plain:
        assert np.array_equal(plain[name], hooked[name]), name
    names = list(hooked)
    told = {names[i]: (g, inputs) for i, (g, inputs) in hooks.told.items()}
    assert set(told) == set(names)
    for name, (g, _) in told.items():
        assert np.array_equal(g, hooked[name]), name
    # input gradients computed when each kernel was told: those of the convolutions after it
    assert [told[f"{c}.weight"][1] for c in ("c3", "c2", "c1")] == [0, 1, 2]
