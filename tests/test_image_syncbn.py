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
    """``reduce`` for ``ranks`` threads: each call deposits a float64 vector and returns the
    sum of every rank's, in rank order (the same on every rank)."""

    def __init__(self, ranks: int):
        self.barrier = threading.Barrier(ranks, timeout=20)
        self.slots: list = [None] * ranks

    def for_rank(self, rank: int):
        def reduce(v: np.ndarray) -> np.ndarray:
            self.slots[rank] = v
            self.barrier.wait()
            total = np.array(self.slots[0], np.float64)
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
    # the plain layer sums per image plane (hetconv.batchnorm.plane_sums), the synced one in
    # float64 over the whole: a convolution's bias before a batch norm has a gradient of zero
    # but for round-off, which differs by about 1e-7
    for name in a[0]:
        np.testing.assert_allclose(b[0][name], a[0][name], rtol=1e-5, atol=1e-6)


class _Filling:
    """A one-node ``reduce`` with a ``meanwhile`` (as a worker's sums have), which it calls
    before giving each sum back, and the kernel gradients it saw set then."""

    def __init__(self, model):
        self.model, self.meanwhile, self.filled = model, None, []

    def __call__(self, v: np.ndarray) -> np.ndarray:
        before = {k for k, layer in self._convs() if "weight" in layer.grads}
        self.meanwhile()
        self.filled.append({k for k, layer in self._convs() if "weight" in layer.grads} - before)
        return v

    def _convs(self):
        from hetconv.layers import Conv2d

        return [(layer.name, layer) for layer in self.model.layers if isinstance(layer, Conv2d)]


class _Told:
    """A bucket ring's ``ready`` (:func:`hetconv.imagesplit.backward_hooks`): what it was told."""

    def __init__(self):
        self.told: dict[int, np.ndarray] = {}

    def ready(self, index: int, gradient: np.ndarray) -> None:
        self.told[index] = np.array(gradient)


@pytest.mark.parametrize("network", ["conv-bn", "resnet20"])
def test_kernel_gradients_left_for_later_are_the_same_bit_for_bit(network, rng):
    """With the sums, each convolution's kernel gradient is computed while a sum waits
    (:class:`hetconv.imagesplit._Later`): bit for bit what computing it at once gives, every
    convolution's but the first's (no sum after it) filled into a backward sum's wait, and
    the gradients told to a bucket ring once set."""
    from hetconv.imagesplit import backward_hooks
    from hetconv.onnx_import import load_network

    spec, shape = (CONV_BN, (3, 8, 8)) if network == "conv-bn" else (
        load_network("resnet20").spec, (3, 32, 32))  # fmt: skip
    x = rng.standard_normal((4, *shape)).astype(np.float32)
    labels = rng.integers(0, 10, 4)
    got = []
    for later in (False, True):
        model = Model(spec, input_shape=shape, seed=3)
        model.train()
        reduce, buckets = _Filling(model), _Told()
        told = buckets.told
        with backward_hooks(model, buckets):
            reduce.meanwhile = lambda: None
            grads = images_gradients(model, x, labels, 0, 4, 0, reduce, kernels_later=later)[0]
        assert len(told) == len(grads)  # every parameter told, once set
        for i, name in enumerate(grads):
            assert np.array_equal(told[i], grads[name]), name
        got.append((grads, reduce.filled))
    (want, _), (grads, filled) = got
    for name in want:
        assert np.array_equal(grads[name], want[name]), name
    convs = [name for name, _ in _Filling(Model(spec, input_shape=shape, seed=3))._convs()]
    assert set().union(*filled) == set(convs[1:])  # the first's: after the last sum


def test_a_batch_norm_layer_takes_two_sums_a_step_and_a_flat_channel_no_negative_variance(rng):
    """Forward's values and squares in one sum, backward's two in another: each sum is a round
    of puts among the workers, on a capped core the cost of a small sum."""
    shape = (3, 8, 8)
    x = rng.standard_normal((4, *shape)).astype(np.float32)
    x[:, 1] = 7.0  # a channel of one value: its variance is 0, not a negative round-off
    model = Model([{"type": "batchnorm"}, {"type": "fc", "out": 10}], input_shape=shape, seed=3)
    model.train()
    calls = []

    def reduce(v: np.ndarray) -> np.ndarray:
        calls.append(v.size)
        return v

    images_gradients(model, x, rng.integers(0, 10, 4), 0, 4, 0, reduce=reduce)
    assert calls == [2 * 3, 2 * 3]
    assert model.layers[0].batch_stats[1][1] == 0.0
    assert np.isfinite(model.layers[0].buffers["running_var"]).all()


# -- real worker processes: the ring sums the statistics mid-pass ----------------------------


def _train(tmp_path, name, executor, spec, **overrides):
    import io
    import json

    from exactness import RUN

    from hetconv.training import TrainConfig, train

    path = tmp_path / "spec.json"
    if isinstance(spec, list):
        path.write_text(json.dumps(spec))
        spec = str(path)
    weights = tmp_path / f"{name}.npz"
    config = TrainConfig(**{**RUN, "preset": spec, "save": str(weights), **overrides})
    with executor:
        losses = train(config, executor, log=io.StringIO()).losses
    return losses, dict(np.load(weights))


def _ring(addresses, **config):
    from test_image_ring import Recording

    return Recording(addresses, deterministic=True, **config)


def test_a_conv_bn_network_split_by_images_trains_as_local_training(tmp_path, workers):
    from exactness import same_as_local

    from hetconv.conv import LocalConv

    local = _train(tmp_path, "local", LocalConv(), CONV_BN)
    cluster = _ring(workers.addresses)
    got = _train(tmp_path, "ring", cluster, CONV_BN)
    same_as_local(got, local)  # the running statistics too: the weight file holds them
    assert all(r["exchange"] == "ring" and "master" not in r["images"] for r in cluster.steps)
    assert all(
        r["nodes"][name]["digest"] == r["digest"] for r in cluster.steps for name in r["nodes"]
    )


def test_resnet20_split_by_images_trains_as_local_training(tmp_path, workers):
    """One step of resnet20 (its running statistics in the weight file), within round-off of
    local training (6e-8 apart). One, not more: at batch 8 the second step's batch holds a
    ReLU input within round-off of zero, and summing by images flips it (measured: the
    weights 3e-5 apart after step 2, while the losses still agree to 1e-7); the 20-step
    equality is the conv-bn network's above, and resnet20's step by step from the run's own
    state in tests/test_image_kill.py."""
    from exactness import same_as_local

    from hetconv.conv import LocalConv

    run = dict(steps=1, eval_size=0)
    local = _train(tmp_path, "local", LocalConv(), "resnet20", **run)
    got = _train(tmp_path, "ring", _ring(workers.addresses), "resnet20", **run)
    same_as_local(got, local)


def test_a_worker_lost_mid_pass_the_master_computes_the_whole_batch(tmp_path):
    """A worker SIGKILLed while the other waits on its batch norm sums (the master computes
    no range of a network with batch norm, so it is killed from a thread once step 3's calls
    are out): the survivor's sums fail, and the master computes that step's whole batch
    (the same step); the next ones ring over the survivor."""
    import os
    import signal
    import time

    from exactness import FAST, same_as_local

    from hetconv.conv import LocalConv
    from hetconv.master.launch import LocalWorkers

    local = _train(tmp_path, "local", LocalConv(), CONV_BN, steps=8)
    with LocalWorkers(2) as started:
        victim = started.processes[1]
        cluster = _ring(started.addresses, **FAST)

        def kill_in_step_3() -> None:
            while cluster.step != 3:
                time.sleep(0.005)
            time.sleep(0.3)  # its call out, the survivor waiting on its sums
            victim.kill()
            victim.wait()

        cluster.actions[3] = lambda: os.kill(victim.pid, signal.SIGSTOP)
        threading.Thread(target=kill_in_step_3, daemon=True).start()
        got = _train(tmp_path, "killed", cluster, CONV_BN, steps=8)
    same_as_local(got, local)
    assert cluster.steps[3]["exchange"] == "master"
    assert cluster.steps[3]["nodes"][started.addresses[0]]["covered_by"] == "master"
    assert all(r["exchange"] == "ring" for r in cluster.steps[4:])


def test_train_refuses_batch_norm_without_the_ring_and_says_how(capsys):
    from hetconv.cli import main

    argv = ["train", "--split", "images", "--model", "resnet20", "--exchange", "master",
            "--steps", "1", "--no-run-dir"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "batch norm (layer 'bn1'" in err
    assert "or sum them among the workers: --exchange ring" in err


def test_train_resnet20_split_by_images_with_the_ring(tmp_path, capsys):
    import json

    from hetconv.cli import main

    trace = tmp_path / "trace.jsonl"
    argv = ["train", "--split", "images", "--model", "resnet20", "--spot-check-every", "0",
            "--steps", "1", "--batch", "4", "--train-size", "16", "--eval-size", "4",
            "--no-run-dir", "--no-progress", "--trace", str(trace), "--deterministic",
            "--local-workers", "2"]  # fmt: skip
    assert main(argv) == 0
    plan = json.loads(trace.read_text().splitlines()[0])
    assert plan["exchange"] == "ring"
    assert plan["exchange_why"] == (
        "batch norm: its statistics summed among the workers, the master computing no images"
    )
    err = capsys.readouterr().err
    assert "gradients summed by a ring among the workers (batch norm" in err
    # said once the model is known: the master computes no images, so the line has none
    split = next(line for line in err.splitlines() if line.startswith("split by images"))
    assert "master" not in split and split.endswith("2 of 4 per step)"), split


def test_the_simulator_and_the_plan_split_a_batch_norm_network_by_images_with_the_ring():
    from hetconv import imagecost
    from hetconv.costmodel import SWITCHED, SimCluster, SimNode
    from hetconv.imagecost import batchnorm_sums_seconds, simulate_image_split
    from hetconv.simulations.plan import IMAGE_SPLIT, IMAGE_SPLIT_RING, candidates

    link = 940e6 / 8
    nodes = tuple(SimNode(f"w{i}", 60.0, bytes_per_s=link, rtt_s=3e-3) for i in range(3))
    cluster = SimCluster(SimNode("m", 60.0, bytes_per_s=link), nodes, SWITCHED)
    with pytest.raises(ValueError, match="batch norm is split by images only with the ring"):
        simulate_image_split(cluster, "resnet20", 64, 0.05)
    got = simulate_image_split(cluster, "resnet20", 64, 0.05, exchange="ring")
    assert got.batches[0] == 0 and sum(got.batches) == 64  # the master computes no images
    sums = batchnorm_sums_seconds(nodes, 19)
    SUM_S, ROUND_S, PUT_S = imagecost.SUM_S, imagecost.ROUND_S, imagecost.PUT_S  # noqa: N806
    # two sums a layer; three workers: one round a sum, each worker's two puts out and in
    assert sums == pytest.approx(2 * 19 * (SUM_S + ROUND_S + 2 * PUT_S + 50e-6 + 1.5e-3))
    four = batchnorm_sums_seconds((*nodes, SimNode("w3", 60.0, bytes_per_s=link, rtt_s=3e-3)), 19)
    want = 2 * 19 * (SUM_S + 2 * (ROUND_S + PUT_S + 50e-6 + 1.5e-3))  # two rounds of one put
    assert four == pytest.approx(want)
    assert got.comm_s > sums
    labels = {c.label for c in candidates(cluster, "resnet20", 64, 0.05)}
    assert IMAGE_SPLIT_RING in labels and IMAGE_SPLIT not in labels
