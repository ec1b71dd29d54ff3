"""A whole model on a GPU's device (:meth:`hetconv.model.Model.place`) and a cuda worker's step
of the split by images there: every preset's passes and loss on the cuda backend's device
arrays equal the host path, the step's tensors cross host and device a small, fixed number of
times, and a cuda worker process trains like local training, with the ring too.

As in test_device_stages.py, each test runs on the real GPU when there is one (results to
float32 round-off) and everywhere on the strict fake CuPy of fake_cupy.py. On the fake the
device computes with numpy behind the wall, so a placed model equals the host model whose
convolutions are :mod:`hetconv.backends.xpconv`'s with numpy (:class:`HostXpConv`) bit for
bit; against the cpu backend, to float32 round-off.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import test_device_stages
from exactness import FAST, STRONG_LRN, same_as_local, train_strong_lrn

from hetconv.backends import conv_shape, xpconv
from hetconv.backends.arrays import on_host
from hetconv.conv import ConvExecutor, LocalConv
from hetconv.devicelocal import DeviceLocalConv
from hetconv.imagesplit import images_gradients
from hetconv.layers import Dropout
from hetconv.master.client import WorkerClient
from hetconv.master.imagesplit import images_step
from hetconv.master.launch import LocalWorkers
from hetconv.model import PRESETS, Model
from hetconv.optim import SGDConfig, sgd_update
from hetconv.worker.service import ConvWorkerService, start_server

Device = test_device_stages.Device
#: The fixtures: the cuda backend on a GPU or the fake, and a cuda worker process on the fake.
device, fake_cuda_worker = test_device_stages.device, test_device_stages.fake_cuda_worker

#: Strides (a 3x3 at 2 and a 1x1 at 2), a concat of two branches and dropout before the head.
BRANCHES = [
    {"type": "conv", "name": "stem", "out": 6, "kernel": 3, "padding": 1, "stride": 2},
    {"type": "relu", "name": "act"},
    {"type": "conv", "name": "left", "out": 4, "kernel": 3, "padding": 1, "inputs": ["act"]},
    {"type": "conv", "name": "right", "out": 3, "kernel": 1, "stride": 2, "bias": False,
     "inputs": ["act"]},
    {"type": "maxpool", "name": "down", "kernel": 2, "inputs": ["left"]},
    {"type": "concat", "name": "cat", "inputs": ["down", "right"]},
    {"type": "avgpool", "name": "pool", "kernel": 2},
    {"type": "dropout", "name": "drop", "p": 0.4},
    {"type": "fc", "name": "fc", "out": 10},
]  # fmt: skip
#: name -> (spec, images in the step): every preset kind, at small batches.
SPECS = {
    "tiny": (PRESETS["tiny"], 4),
    "paper-50-500": (PRESETS["paper-50-500"], 2),
    "resnet20": (PRESETS["resnet20"], 2),
    "branches": (BRANCHES, 4),
}
#: The specs a worker takes without a ring (no batch norm).
NO_BATCHNORM = [name for name in SPECS if name != "resnet20"]


class HostXpConv(ConvExecutor):
    """The convolutions on the host by :mod:`hetconv.backends.xpconv` with numpy: what the
    cuda backend computes on device arrays, the same operations."""

    def forward(self, layer, x, w, b, padding):
        return xpconv.forward(np, x, w, b, conv_shape(x.shape, w.shape, padding))

    def backward(self, layer, x, w, dy, padding, need_input_grad):
        shape = conv_shape(x.shape, w.shape, padding)
        dw, db = xpconv.grad_kernels(np, x, dy, shape)
        return (xpconv.grad_input(np, dy, w, shape) if need_input_grad else None), dw, db


def _batch(rng, spec, count):
    x = rng.standard_normal((count, 3, 32, 32), dtype=np.float32)
    return x, rng.integers(0, 10, count)


def _dropouts(model) -> int:
    return sum(isinstance(layer, Dropout) for layer in model.layers)


def _host_step(spec, executor, x, labels, first, batch, step=3, state=None):
    """A step of the split by images on the host (the model seeded 5, or holding ``state``)."""
    model = Model(spec, seed=5, executor=executor)
    if state is not None:
        model.load_state(state)
    return images_gradients(model, x, labels, first, batch, step)


def _exact(device: Device, rtol: float) -> float:
    """The tolerance against the host's xpconv path: none on the fake (numpy behind it)."""
    return 0.0 if device.fake is not None else rtol


# ---------------------------------------------------------------- the model on the device


@pytest.mark.parametrize("name", SPECS)
def test_every_presets_step_on_the_device_equals_the_host_path(device, rng, name):
    """The passes and the loss of images 1 .. 1 + n of a batch of n + 2 (dropout's rows) on a
    placed model: the images and labels go up, dropout's masks go up, nothing comes down; the
    gradients, losses and hits equal the host path's."""
    spec, count = SPECS[name]
    x, labels = _batch(rng, spec, count)
    backend = device.backend
    model = Model(spec, seed=5, executor=LocalConv(backend))
    with backend.scope():
        model.place(backend.to_device)
        assert not any(on_host(a) for a in model.state().values())
        x_dev, labels_dev = backend.to_device(x), backend.to_device(labels)
        before = device.crossings()
        got = images_gradients(model, x_dev, labels_dev, 1, count + 2, step=3)
        if before is not None:  # every layer ran there: only the masks crossed
            assert device.crossings() == (before[0] + _dropouts(model), before[1])
    grads, losses, hits = (
        {k: device.down(v) for k, v in got[0].items()},
        device.down(got[1]),
        device.down(got[2]),
    )
    exact = _host_step(spec, HostXpConv(), x, labels, 1, count + 2)
    cpu = _host_step(spec, LocalConv(), x, labels, 1, count + 2)
    assert grads.keys() == exact[0].keys()
    np.testing.assert_array_equal(hits, exact[2])
    device.close(losses, exact[1], _exact(device, 2e-5))
    for key in grads:
        device.close(grads[key], exact[0][key], _exact(device, 1e-4))
        device.close(grads[key], cpu[0][key], 1e-4)  # against the cpu backend: round-off
    device.close(losses, cpu[1], 1e-5)


def test_the_update_and_the_statistics_stay_on_the_device_and_come_back(device, rng):
    """Batch norm's running statistics move on the device, the SGD update runs where the
    weights are, and ``place(to_host)`` brings every array back: the host model's values."""
    spec, count = SPECS["resnet20"]
    x, labels = _batch(rng, spec, count)
    backend = device.backend
    host = Model(spec, seed=5, executor=HostXpConv())
    model = Model(spec, seed=5, executor=LocalConv(backend))
    config = SGDConfig(lr=0.1)
    with backend.scope():
        model.place(backend.to_device)
        grads = images_gradients(
            model, backend.to_device(x), backend.to_device(labels), 0, count, 0, copy=False
        )[0]
        for name, p in model.parameters().items():
            sgd_update(p, grads[name], None, config)
        model.place(backend.to_host)
    want = images_gradients(host, x, labels, 0, count, 0)[0]
    for name, p in host.parameters().items():
        sgd_update(p, want[name], None, config)
    assert all(on_host(a) for a in model.state().values())
    for key, value in host.state().items():
        device.close(model.state()[key], value, _exact(device, 1e-4))
    assert int(model.buffers()["bn1.num_batches_tracked"]) == 1


def test_synchronised_batch_norm_sums_through_the_host_on_a_device(device, rng):
    """The split by images' batch norm on a device: each mid-pass sum goes down and its
    answer up (a host ``reduce``, as the ring's), and the step equals the host path's."""
    spec, count = SPECS["resnet20"]
    x, labels = _batch(rng, spec, count)
    backend = device.backend
    calls = []

    def reduce(v):  # one node's sums: the batch is its own, counted twice
        assert on_host(v) and v.dtype == np.float64
        calls.append(v.size)
        return v * 2

    host = Model(spec, seed=5, executor=HostXpConv())
    want = images_gradients(host, x, labels, 0, 2 * count, 1, reduce)
    model = Model(spec, seed=5, executor=LocalConv(backend))

    def through_the_host(v):
        return backend.to_device(reduce(backend.to_host(v)))

    with backend.scope():
        model.place(backend.to_device)
        got = images_gradients(
            model, backend.to_device(x), backend.to_device(labels), 0, 2 * count, 1,
            through_the_host,
        )  # fmt: skip
    layers = sum(entry["type"] == "batchnorm" for entry in spec)
    assert len(calls) == 2 * 2 * layers  # two sums a layer a pass, twice (host, device)
    for key, value in want[0].items():
        device.close(device.down(got[0][key]), value, _exact(device, 1e-4))
    device.close(device.down(got[1]), want[1], _exact(device, 2e-5))


# ---------------------------------------------------------------- a cuda worker's ImagesStep


@pytest.fixture
def cuda_service(device):
    """An in-process worker service on the device's cuda backend, and a client of it."""
    service = ConvWorkerService(device.backend)
    server, address = start_server(service, "127.0.0.1:0")
    client = WorkerClient(address, 30.0)
    yield client
    client.close()
    server.stop(0)
    service.close()


@pytest.mark.parametrize("name", NO_BATCHNORM)
def test_a_cuda_workers_images_step_runs_on_its_device(device, cuda_service, rng, name):
    """Two ImagesSteps of a session on a cuda worker: the model is placed once and kept; each
    step its parameters go up in one copy, the images and labels in one each (and dropout's
    masks), and the answer (every gradient, the losses and hits) comes down in one."""
    spec, count = SPECS[name]
    spec_json = json.dumps(spec)
    master = Model(spec, seed=5)
    for step in range(2):
        x, labels = _batch(rng, spec, count)
        before = device.crossings()
        grads, losses, hits, _ = images_step(
            cuda_service, 7, step, master, spec_json, x, labels, 1, count + 1, 30.0
        )
        exact = _host_step(spec, HostXpConv(), x, labels, 1, count + 1, step, master.state())
        if before is not None and step == 1:  # the model kept there since step 0
            ups = 3 + _dropouts(master)
            assert device.crossings() == (before[0] + ups, before[1] + 1)
        np.testing.assert_array_equal(hits, exact[2])
        device.close(losses, exact[1], _exact(device, 2e-5))
        for key, value in exact[0].items():
            device.close(grads[key], value, _exact(device, 1e-4))
        for key, p in master.parameters().items():  # the next step's weights differ
            p -= np.float32(0.5) * grads[key]


def test_a_cuda_workers_passes_are_bounded_by_its_device_not_its_host_requests(device, rng):
    """The passes of an ImagesStep on a cuda worker live on its device: beyond the host's
    limit per request they are served, and still within the host's memory budget (not
    charged to it); beyond the device's memory for one call (``memory_limit``) refused, naming
    it (the split by images at paper-500-1500 batch 64 holds about 2.8 GiB)."""
    from hetconv.master.client import WorkerError
    from hetconv.worker.config import WorkerConfig

    spec, count = SPECS["tiny"]
    spec_json, master = json.dumps(spec), Model(spec, seed=5)
    x, labels = _batch(rng, spec, count)
    limits = WorkerConfig(max_request_bytes=1 << 20, memory_bytes=2 << 20)
    for memory_limit, served in ((None, True), (1 << 20, False)):
        device.backend.memory_limit = memory_limit
        service = ConvWorkerService(device.backend, limits)
        server, address = start_server(service, "127.0.0.1:0")
        client = WorkerClient(address, 30.0)
        try:
            if served:
                grads, losses, _, _ = images_step(client, 1, 0, master, spec_json, x, labels,
                                                  0, count, 30.0)  # fmt: skip
                exact = _host_step(spec, HostXpConv(), x, labels, 0, count, 0)
                device.close(losses, exact[1], _exact(device, 2e-5))
            else:
                with pytest.raises(WorkerError, match="one call may use of this worker's device"):
                    images_step(client, 1, 0, master, spec_json, x, labels, 0, count, 30.0)
        finally:
            client.close()
            server.stop(0)
            service.close()
            device.backend.memory_limit = None


# ---------------------------------------------------------------- a cuda worker process

#: A network with batch norm, a stride-2 convolution and a residual add (resnet-like), small.
RESIDUAL_BN = [
    {"type": "conv", "name": "c1", "out": 4, "kernel": 3, "padding": 1, "bias": False},
    {"type": "batchnorm", "name": "b1"},
    {"type": "relu", "name": "r1"},
    {"type": "conv", "name": "c2", "out": 4, "kernel": 3, "padding": 1, "bias": False},
    {"type": "batchnorm", "name": "b2"},
    {"type": "add", "name": "sum", "inputs": ["b2", "r1"]},
    {"type": "relu", "name": "r2"},
    {"type": "conv", "name": "c3", "out": 6, "kernel": 3, "padding": 1, "stride": 2},
    {"type": "relu", "name": "r3"},
    {"type": "gap", "name": "gap"},
    {"type": "fc", "name": "fc", "out": 10},
]
#: The strong-LRN network with dropout before its head.
DROPOUT_HEAD = [*STRONG_LRN[:-1], {"type": "dropout", "p": 0.3}, STRONG_LRN[-1]]
#: A few steps: enough to show the kept weights train.
SHORT = dict(steps=3, eval_size=0)


def test_a_cuda_worker_process_trains_split_by_images_like_local_training(
    fake_cuda_worker, tmp_path
):
    """The split by images (no ring) with the master computing its range beside the cuda
    worker: a few steps of the strong-LRN network with dropout, as local training."""
    from test_image_split import Recording

    local = _train_spec(tmp_path, "local", LocalConv(), DROPOUT_HEAD)
    cluster = Recording([fake_cuda_worker], deterministic=True, **FAST)
    got = _train_spec(tmp_path, "images", cluster, DROPOUT_HEAD)
    same_as_local(got, local)
    assert all(r["images"][fake_cuda_worker] > 0 for r in cluster.steps), cluster.steps


@pytest.mark.parametrize("buckets", [0, 4096], ids=["after-backward", "overlapped"])
def test_a_cuda_worker_process_in_a_ring_with_batch_norm_trains_like_local_training(
    fake_cuda_worker, tmp_path, buckets
):
    """``--exchange ring --spot-check-every 0`` on a residual network with batch norm: the
    cuda worker and a cpu worker sum their statistics mid-pass and their gradients over the
    ring (after backward, or bucket by bucket during it), each updating its own weights: a
    few steps as local training, the running statistics too (the weight file holds them)."""
    from test_image_ring import Recording

    local = _train_spec(tmp_path, "local", LocalConv(), RESIDUAL_BN)
    with LocalWorkers(1) as cpu:
        cluster = Recording([fake_cuda_worker, *cpu.addresses], deterministic=True, **FAST)
        cluster.bucket_bytes = buckets
        got = _train_spec(tmp_path, "ring", cluster, RESIDUAL_BN)
    same_as_local(got, local)
    assert all(r["exchange"] == "ring" and "master" not in r["images"] for r in cluster.steps)
    assert all(r["nodes"][n]["digest"] == r["digest"] for r in cluster.steps for n in r["nodes"])


def test_a_cuda_worker_process_alone_in_a_ring_with_batch_norm_trains_like_local_training(
    fake_cuda_worker, tmp_path
):
    """A ring of one (one GPU beside a master that computes no images): its batch norm sums
    are its own, taken on the device without crossing to the host; a few steps as local
    training."""
    from test_image_ring import Recording

    local = _train_spec(tmp_path, "local", LocalConv(), RESIDUAL_BN)
    cluster = Recording([fake_cuda_worker], deterministic=True, **FAST)
    got = _train_spec(tmp_path, "ring", cluster, RESIDUAL_BN)
    same_as_local(got, local)
    assert all(r["exchange"] == "ring" and "master" not in r["images"] for r in cluster.steps)


def test_a_ring_of_ones_batch_norm_sums_stay_on_the_device():
    """:class:`~hetconv.worker.imagesplit._BatchNormSums` of a ring of one: the values'
    split64/join64 sum where they are, the ring not called, the work meanwhile done; with
    sketches kept (a spot check's step) through the ring as before."""
    from fake_cupy import FakeCupy

    from hetconv.proto import worker_pb2 as pb
    from hetconv.ring import join64, split64
    from hetconv.worker.imagesplit import _BatchNormSums

    class NoRing:
        def sum64(self, *args):
            raise AssertionError("a ring of one called its ring")

    cp, crossed = FakeCupy(), []

    class Backend:
        def to_host(self, value):
            crossed.append(value)
            return cp.asnumpy(value)

    class Context:
        ring, backend = NoRing(), Backend()

    request = pb.ConvRequest()
    request.images.ring.peers.append("127.0.0.1:1")
    seconds = {"batchnorm": 0.0}
    sums = _BatchNormSums(Context(), request, seconds)
    done = []
    sums.meanwhile = lambda: done.append(True)
    values = cp.asarray(np.random.default_rng(0).standard_normal(12) * 1e3)
    got = sums(values)
    assert type(got) is type(values) and done == [True] and not crossed
    np.testing.assert_array_equal(cp.asnumpy(got), join64([split64(cp.asnumpy(values))]))
    request.images.ring.sketch = True
    with pytest.raises(AssertionError, match="called its ring"):
        _BatchNormSums(Context(), request, seconds)(values)


def _config(**config):
    from hetconv.master.cluster import ClusterConfig

    return ClusterConfig(**FAST, **config)


def _train_spec(tmp_path, name, executor, spec):
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(spec))
    with executor:
        return train_strong_lrn(tmp_path, name, executor, preset=str(path), **SHORT)


# ---------------------------------------------------------------- --local --engine cuda


class CountedDeviceConv(DeviceLocalConv):
    """:class:`~hetconv.devicelocal.DeviceLocalConv` keeping each step's crossings (the fake's)."""

    def __init__(self, device: Device):
        super().__init__(device.backend)
        self.device, self.steps = device, []

    def train_batch(self, model, x, labels, step):
        before = self.device.crossings()
        out = super().train_batch(model, x, labels, step)
        if before is not None:
            after = self.device.crossings()
            self.steps.append((after[0] - before[0], after[1] - before[1]))
        return out


@pytest.mark.parametrize("spec", [DROPOUT_HEAD, RESIDUAL_BN], ids=["dropout", "batchnorm"])
def test_local_training_on_the_cuda_engine_trains_like_local_training(device, tmp_path, spec):
    """``--local --engine cuda``: each step's whole model on the device, as local training
    on the cpu (the running statistics too). A step's parameters and buffers go up in one
    copy, the images and labels in one each (and the masks), everything back in one; the
    first step places the model first."""
    local = _train_spec(tmp_path, "local", LocalConv(), spec)
    executor = CountedDeviceConv(device)
    got = _train_spec(tmp_path, "cuda", executor, spec)
    same_as_local(got, local)
    if device.fake is not None:
        masks = sum(entry["type"] == "dropout" for entry in spec)
        assert executor.steps[1:] == [(3 + masks, 1)] * (SHORT["steps"] - 1)


def test_train_local_engine_cuda_runs_and_is_refused_without_local(device, tmp_path, capsys):
    from hetconv.cli import main

    trace = tmp_path / "trace.jsonl"
    argv = ["train", "--local", "--engine", "cuda", "--steps", "2", "--batch", "4",
            "--train-size", "8", "--eval-size", "4", "--no-run-dir", "--no-progress",
            "--trace", str(trace)]  # fmt: skip
    assert main(argv) == 0
    steps = [r for r in map(json.loads, trace.read_text().splitlines()) if "step" in r]
    assert len(steps) == 2 and all(np.isfinite(r["loss"]) for r in steps)
    capsys.readouterr()
    assert main(["train", "--engine", "cuda", "--steps", "1", "--no-run-dir"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--engine cuda trains the whole model" in err[0], err
