"""Synchronised batch norm for the split by images (:func:`hetconv.imagesplit.sync_batchnorm`):
nodes that each run a range of the batch, their batch statistics summed over every node, train
as the whole batch does."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from hetconv.imagesplit import image_ranges, images_gradients
from hetconv.model import Model

#: conv, batch norm, ReLU, twice, then the head: small enough for a quick test.
CONV_BN = [
    {"type": "conv", "out": 4, "kernel": 3, "padding": 1},
    {"type": "batchnorm"},
    {"type": "relu"},
    {"type": "conv", "out": 6, "kernel": 3, "padding": 1},
    {"type": "batchnorm"},
    {"type": "relu"},
    {"type": "maxpool", "kernel": 2},
    {"type": "fc", "out": 10},
]


class ThreadSum:
    """``reduce`` for ``ranks`` threads: each call deposits a vector and returns the sum of
    every rank's, in rank order (the same on every rank)."""

    def __init__(self, ranks: int):
        self.barrier = threading.Barrier(ranks, timeout=20)
        self.slots: list = [None] * ranks

    def for_rank(self, rank: int):
        def reduce(v: np.ndarray) -> np.ndarray:
            self.slots[rank] = v
            self.barrier.wait()
            total = np.array(self.slots[0], np.float32)
            for other in self.slots[1:]:
                total += other
            self.barrier.wait()
            return total

        return reduce


def _split_step(spec, x, labels, counts, input_shape, seed=3, step=0):
    """Each range on its own copy of the model, in threads, statistics summed: (the ranges'
    gradients summed in order, the losses joined, the models)."""
    ranges = image_ranges(len(x), [1.0 / c for c in counts])
    models = [Model(spec, input_shape=input_shape, seed=seed) for _ in ranges]
    sums = ThreadSum(len(ranges))
    out = [None] * len(ranges)

    def run(rank):
        first, count = ranges[rank]
        model = models[rank]
        model.train()
        rows = slice(first, first + count)
        out[rank] = images_gradients(
            model, x[rows], labels[rows], first, len(x), step, sums.for_rank(rank)
        )

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(ranges))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    grads = {k: sum(o[0][k] for o in out[1:]) + out[0][0][k] for k in out[0][0]}
    return grads, np.concatenate([o[1] for o in out]), models


@pytest.mark.parametrize("counts", [(4, 4), (3, 2, 3), (5, 1, 1, 1)])
def test_ranges_with_summed_statistics_train_as_the_whole_batch(counts, rng):
    shape = (3, 8, 8)
    x = rng.standard_normal((8, *shape)).astype(np.float32)
    labels = rng.integers(0, 10, 8)
    whole = Model(CONV_BN, input_shape=shape, seed=3)
    whole.train()
    want, losses, _ = images_gradients(whole, x, labels, 0, 8, 0)
    got, got_losses, models = _split_step(CONV_BN, x, labels, counts, shape)
    np.testing.assert_allclose(got_losses, losses, rtol=1e-5, atol=1e-6)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-6, err_msg=name)
    for model in models:  # every node's running statistics: the whole batch's
        for name, value in whole.buffers().items():
            np.testing.assert_allclose(model.buffers()[name], value, rtol=1e-5, atol=1e-7)
        assert all(
            (b == models[0].buffers()[k]).all() for k, b in model.buffers().items()
        )  # bit for bit on every node


def test_without_reduce_a_range_normalises_by_its_own_images(rng):
    shape = (3, 8, 8)
    x = rng.standard_normal((4, *shape)).astype(np.float32)
    labels = rng.integers(0, 10, 4)
    plain, synced = (Model(CONV_BN, input_shape=shape, seed=3) for _ in range(2))
    for model in (plain, synced):
        model.train()
    a = images_gradients(plain, x, labels, 0, 4, 0)
    b = images_gradients(synced, x, labels, 0, 4, 0, reduce=lambda v: v)  # one node
    for name in a[0]:
        np.testing.assert_allclose(b[0][name], a[0][name], rtol=1e-5, atol=1e-7)
