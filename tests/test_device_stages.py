"""A worker's whole stage on its GPU: every layer and every stage kind on the cuda backend's
device arrays equals the numpy path, the call's tensors cross once, and a cuda worker process
trains like local training.

Each test runs on the real GPU when there is one (``gpu``: results to float32 round-off) and
everywhere on the strict fake CuPy of fake_cupy.py (``fake``: device arrays numpy refuses,
functions cupy has only, and every host<->device copy counted). On the fake the layers compute
with numpy behind the wall, so they equal the numpy path bit for bit; the convolutions are
:mod:`hetconv.backends.xpconv`'s, compared with the cpu backend's to float32 round-off.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import fake_cupy
import numpy as np
import pytest
from exactness import FAST, same_as_local, train_strong_lrn

from hetconv.backends import CpuBackend
from hetconv.backends.arrays import on_host
from hetconv.backends.cuda import CudaBackend
from hetconv.batchnorm import BatchNorm2d
from hetconv.calls import READY
from hetconv.head import columns_grad, partial_logits, stage_grad
from hetconv.layers import (
    GlobalAvgPool2d,
    ImageChunks,
    LocalResponseNorm,
    Pool2d,
    ReLU,
)
from hetconv.master.cluster import Cluster, ClusterConfig
from hetconv.master.launch import LocalWorkers, stop_processes
from hetconv.optim import SGDConfig, sgd_update
from hetconv.resident import edge_rows, edges
from hetconv.stages import (
    BatchNormSlice,
    StageOp,
    StageSpec,
    batch_statistics_rows,
    batchnorm_grad_rows,
    stage_backward,
    stage_forward,
)

CUDA_OK, CUDA_WHY = CudaBackend.is_available()
needs_gpu = pytest.mark.skipif(not CUDA_OK, reason=f"no usable CUDA GPU here: {CUDA_WHY}")


class Device:
    """A cuda backend and what the tests ask of it: the fake (with its counts) or a GPU."""

    def __init__(self, backend: CudaBackend, fake: fake_cupy.FakeCupy | None):
        self.backend, self.fake = backend, fake

    def up(self, a):
        return self.backend.to_device(a)

    def down(self, a):
        return self.backend.to_host(a)

    def crossings(self) -> tuple[int, int] | None:
        return self.fake.crossings() if self.fake is not None else None

    def close(self, got, want, rtol: float = 2e-5) -> None:
        """``got`` (numpy) equals ``want``: exactly on the fake, to float32 round-off on a
        GPU (relative to the largest value)."""
        if self.fake is not None and rtol == 0:
            np.testing.assert_array_equal(got, want)
            return
        scale = max(1.0, float(np.max(np.abs(want)))) if want.size else 1.0
        np.testing.assert_allclose(got, want, rtol=0, atol=rtol * scale)


@pytest.fixture(params=[pytest.param("gpu", marks=needs_gpu), "fake"])
def device(request, monkeypatch) -> Device:
    if request.param == "fake":
        fake = fake_cupy.install(monkeypatch)
        yield Device(CudaBackend(), fake)
        from hetconv.backends import cuda as cuda_module

        cuda_module._availability.cache_clear()
        return
    yield Device(CudaBackend(), None)


def _exact(device: Device) -> float:
    """The tolerance of a layer's device result: none on the fake (numpy behind it)."""
    return 0.0 if device.fake is not None else 2e-5


# ---------------------------------------------------------------- the fake is strict


def test_the_fake_refuses_host_arrays_numpy_only_names_and_implicit_copies(monkeypatch):
    fake = fake_cupy.install(monkeypatch)
    a = fake.asarray(np.ones((2, 3), np.float32))
    with pytest.raises(TypeError, match="does not support ufuncs"):
        np.maximum(a, 0)
    with pytest.raises(TypeError, match="Implicit conversion"):
        np.asarray(a)
    with pytest.raises(TypeError, match="upload it first"):
        a + np.ones((2, 3), np.float32)
    with pytest.raises(TypeError, match="upload it first"):
        fake.maximum(np.ones(3, np.float32), 0)
    with pytest.raises(AttributeError, match="cupy may lack it"):
        fake.errstate  # noqa: B018 - numpy has it, cupy does not
    assert fake.crossings() == (1, 0)
    assert isinstance(a * np.float32(2) + 1, fake_cupy.FakeArray)  # scalars are fine
    np.testing.assert_array_equal(a.get(), np.ones((2, 3)))
    assert fake.crossings() == (1, 1)


# ---------------------------------------------------------------- every layer kind

LAYERS = {
    "relu": lambda: ReLU("r"),
    "lrn": lambda: LocalResponseNorm("n", 5, 1.0, 0.75, 1.0),
    "lrn-beta-0.6": lambda: LocalResponseNorm("n", 3, 0.5, 0.6, 2.0),
    "maxpool": lambda: Pool2d("p", 2, 2, "max"),
    "maxpool-overlapping": lambda: Pool2d("p", 3, 2, "max"),
    "avgpool": lambda: Pool2d("p", 2, 2, "avg"),
    "avgpool-overlapping": lambda: Pool2d("p", 3, 1, "avg"),
    "gap": lambda: GlobalAvgPool2d("g"),
    "chain": lambda: ImageChunks(
        [ReLU("r"), LocalResponseNorm("n", 5, 1.0), Pool2d("p", 2, 2)], chunk_bytes=256
    ),
}


@pytest.mark.parametrize("kind", LAYERS)
def test_every_layer_on_the_device_equals_numpy(device, rng, kind):
    x = rng.standard_normal((3, 6, 7, 7), dtype=np.float32)
    x[:, :, :2, :2] = 0  # ties in max-pool windows: the first takes the gradient
    host, there = LAYERS[kind](), LAYERS[kind]()
    y = host.forward(x)
    dy = rng.standard_normal(y.shape, dtype=np.float32)
    dx = host.backward(dy)
    y_dev = there.forward(device.up(x))
    assert not on_host(y_dev), f"{kind} answered a host array for a device input"
    dx_dev = there.backward(device.up(dy))
    assert not on_host(dx_dev)
    device.close(device.down(y_dev), y, _exact(device))
    device.close(device.down(dx_dev), dx, _exact(device))


@pytest.mark.parametrize("training", [True, False])
def test_batchnorm_on_the_device_equals_numpy(device, rng, training):
    x = rng.standard_normal((4, 5, 3, 3), dtype=np.float32) * 3 + 1
    host, there = BatchNorm2d("bn", 5), BatchNorm2d("bn", 5)
    host.training = there.training = training
    gamma = rng.standard_normal(5, dtype=np.float32)
    host.params["weight"][...] = gamma
    there.params = {"weight": device.up(gamma), "bias": device.up(host.params["bias"])}
    there.buffers["running_mean"] = device.up(host.buffers["running_mean"] + 0.5)
    there.buffers["running_var"] = device.up(host.buffers["running_var"] * 2)
    host.buffers["running_mean"] += 0.5
    host.buffers["running_var"] *= 2
    y, y_dev = host.forward(x), there.forward(device.up(x))
    dy = rng.standard_normal(y.shape, dtype=np.float32)
    dx, dx_dev = host.backward(dy), there.backward(device.up(dy))
    for got, want in ((y_dev, y), (dx_dev, dx)):
        device.close(device.down(got), want, _exact(device))
    for name in ("weight", "bias"):
        device.close(device.down(there.grads[name]), host.grads[name], _exact(device))
    for name in ("running_mean", "running_var"):
        device.close(device.down(there.buffers[name]), host.buffers[name], _exact(device))


def test_split_head_and_resident_update_on_the_device_equal_numpy(device, rng):
    y = rng.standard_normal((4, 6, 2, 2), dtype=np.float32)
    f = rng.standard_normal((6, 4, 3), dtype=np.float32)
    dz = rng.standard_normal((4, 3), dtype=np.float32)
    y_d, f_d, dz_d = device.up(y), device.up(f), device.up(dz)
    device.close(device.down(partial_logits(y_d, f_d)), partial_logits(y, f))
    device.close(device.down(stage_grad(dz_d, f_d[1:5], (2, 2))), stage_grad(dz, f[1:5], (2, 2)))
    device.close(device.down(columns_grad(dz_d, y_d)), columns_grad(dz, y))
    # the resident update: momentum started and not, bitwise the host's on the fake
    config = SGDConfig(lr=0.1, momentum=0.9, weight_decay=1e-3)
    w, dw = rng.standard_normal((2, 5, 8), dtype=np.float32)
    w_d = device.up(w)
    buf, buf_d = sgd_update(w, dw, None, config), sgd_update(w_d, device.up(dw), None, config)
    sgd_update(w, dw, buf, config)
    sgd_update(w_d, device.up(dw), buf_d, config)
    device.close(device.down(w_d), w, _exact(device))
    device.close(device.down(buf_d), buf, _exact(device))
    for count, halo in ((6, 2), (4, 2), (3, 0)):
        a = rng.standard_normal((count, 2), dtype=np.float32)
        np.testing.assert_array_equal(
            device.down(edges(device.up(a), halo)), a[edge_rows(count, halo)]
        )


# ---------------------------------------------------------------- every stage kind

_RELU, _LRN = StageOp("relu"), StageOp("lrn", size=5, alpha=1.0, beta=0.75, k=1.0)
_MAX, _AVG = StageOp("maxpool", kernel=2, stride=2), StageOp("avgpool", kernel=2, stride=2)
_BN, _GAP = StageOp("batchnorm"), StageOp("gap")
STAGES = {
    "relu": (_RELU,),
    "lrn": (_LRN,),
    "maxpool": (_MAX,),
    "avgpool": (_AVG,),
    "gap": (_GAP,),
    "relu-lrn-maxpool": (_RELU, _LRN, _MAX),
    "batchnorm-relu-avgpool": (_BN, _RELU, _AVG),
    "batchnorm-eval-relu-gap": (_BN, _RELU, _GAP),
}


def _stage_problem(rng, ops, k=10):
    x = rng.standard_normal((3, 4, 8, 8), dtype=np.float32)
    w = rng.standard_normal((k, 4, 3, 3), dtype=np.float32) * 0.3
    b = rng.standard_normal(k, dtype=np.float32) * 0.1
    training = not any(op.kind == "batchnorm" for op in ops) or len(ops) != 3 or ops[2] != _GAP
    bn = [
        BatchNormSlice(
            rng.standard_normal(k, dtype=np.float32),
            rng.standard_normal(k, dtype=np.float32),
            training,
            *((None, None) if training else (rng.random(k, dtype=np.float32),) * 2),
        )
        for op in ops
        if op.kind == "batchnorm"
    ]
    return x, w, b, bn


@pytest.mark.parametrize("kind", STAGES)
def test_every_stage_on_the_device_equals_the_cpu_path_crossing_once(device, rng, kind):
    spec = StageSpec(STAGES[kind])
    x, w, b, bn = _stage_problem(rng, spec.ops)
    own = slice(2, 8)  # halo channels on both sides
    grad = spec.grad_range(own, w.shape[0])
    cpu = CpuBackend()
    y, run = stage_forward(cpu, x, w, b, 1, spec, own, bn)
    dy = rng.standard_normal((y.shape[0], grad.stop - grad.start, *y.shape[2:]), np.float32)
    want = stage_backward(cpu, run, dy, grad, True)

    before = device.crossings()
    y_dev, run_dev = stage_forward(device.backend, x, w, b, 1, spec, own, bn)
    stats = batch_statistics_rows(run_dev)
    if before is not None:  # x, w, b and each batch norm's weight and bias (and running
        # statistics in evaluation) in; y and the statistics out
        inputs = 3 + sum(2 if one.training else 4 for one in bn)
        outputs = 1 + (1 if any(one.training for one in bn) else 0)
        assert device.crossings() == (before[0] + inputs, before[1] + outputs)
    assert isinstance(y_dev, np.ndarray) and all(not on_host(a) for a in (run_dev.x, run_dev.w))
    device.close(y_dev, y)
    device.close(stats, batch_statistics_rows(run))

    before = device.crossings()
    got = stage_backward(device.backend, run_dev, dy, grad, True)
    if before is not None:  # dy in; dx, dw, db out
        assert device.crossings() == (before[0] + 1, before[1] + 3)
    for g, wnt in zip(got, want, strict=True):
        device.close(g, wnt, 1e-4)
    device.close(batchnorm_grad_rows(run_dev), batchnorm_grad_rows(run), 1e-4)


def test_a_replicated_block_feeds_the_next_stage_without_leaving_the_device(device, rng):
    """The replicated block's way on a worker: its output stays on the device as the next
    stage's input, and the next stage's input gradient goes back through it there."""
    block, spec = StageSpec((_RELU, _MAX)), StageSpec((_RELU, _LRN, _MAX))
    x = rng.standard_normal((2, 3, 12, 12), dtype=np.float32)
    w1, b1 = rng.standard_normal((5, 3, 3, 3), dtype=np.float32), np.zeros(5, np.float32)
    w2 = rng.standard_normal((8, 5, 3, 3), dtype=np.float32) * 0.2
    b2 = np.zeros(8, np.float32)

    def through(backend, on_device):
        y1, run1 = stage_forward(backend, x, w1, b1, 1, block, slice(0, 5), on_device=on_device)
        y2, run2 = stage_forward(backend, y1, w2, b2, 1, spec, slice(0, 8))
        dy = np.ones(y2.shape, np.float32)
        dx, dw2, _ = stage_backward(backend, run2, dy, slice(0, 8), True, on_device=on_device)
        _, dw1, _ = stage_backward(backend, run1, dx, slice(0, 5), False)
        return y2, backend.to_host(dw2), dw1

    want = through(CpuBackend(), False)
    before = device.crossings()
    got = through(device.backend, True)
    if before is not None:  # x, w1, b1, w2, b2, dy in; y2, dw1, db1 out: the block's
        # output and its input gradient never cross (dw2 comes down by itself)
        assert device.crossings() == (before[0] + 6, before[1] + 4)
    for g, wnt in zip(got, want, strict=True):
        device.close(g, wnt, 1e-4)


# ---------------------------------------------------------------- a cuda worker process


@pytest.fixture(scope="module")
def fake_cuda_worker():
    """One ``hetconv worker --backend cuda`` process whose CuPy is the strict fake."""
    command = [
        sys.executable, str(Path(fake_cupy.__file__)), "worker", "--listen", "127.0.0.1:0",
        "--backend", "cuda", "--no-startup-probe", "--exit-on-stdin-close",
    ]  # fmt: skip
    env = dict(os.environ, PYTHONUNBUFFERED="1", OPENBLAS_NUM_THREADS="1")
    process = subprocess.Popen(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        env=env, text=True,
    )  # fmt: skip
    found, lines = threading.Event(), []

    def drain():
        for line in process.stdout:
            lines.append(line.rstrip("\n"))
            if line.startswith(READY):
                found.set()

    drainer = threading.Thread(target=drain, daemon=True)
    drainer.start()
    try:
        assert found.wait(60), "the fake cuda worker did not start:\n" + "\n".join(lines)
        assert any("cuda backend" in line for line in lines), lines
        yield lines[-1][len(READY) :].strip()
    finally:
        stop_processes([process])
        drainer.join(10)
    # it computed on its (fake) device: tensors went up and came down
    counts = [line for line in lines if line.startswith("fake cupy:")]
    assert counts and not counts[0].startswith("fake cupy: 0 uploads"), lines[-5:]


# tiny: 8 then 16 kernels; the master computes a share beside the worker
SHARES = {"conv1": (3, 5), "conv2": (6, 10)}
MODES = {
    "resident-head-replicated": dict(stages="fused", kernels="resident", head="split",
                                     replicate="first"),
    "fused-sent-overlap": dict(stages="fused", kernels="sent", overlap="on"),
    "resident-overlap": dict(stages="fused", kernels="resident", overlap="on"),
}  # fmt: skip


@pytest.mark.parametrize("mode", MODES)
def test_a_cuda_worker_process_trains_like_local_training(fake_cuda_worker, local, tmp_path, mode):
    config = ClusterConfig(**FAST, shares=SHARES, **MODES[mode])
    with Cluster([fake_cuda_worker], config=config) as cluster:
        got = train_strong_lrn(tmp_path, mode, cluster)
    same_as_local(got, local)


# ---------------------------------------------------------------- benchmarks/gpu_vs_torch.py

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_vs_torch.py"


def _bench(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(BENCH), *argv], capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.skipif(CUDA_OK, reason="this machine has a GPU")
def test_gpu_vs_torch_without_a_gpu_says_why_in_one_line():
    done = _bench("--network", "tiny")
    assert done.returncode == 2 and not done.stdout
    assert len(done.stderr.strip().splitlines()) == 1
    assert "no GPU" in done.stderr and "--dry-run" in done.stderr


def test_gpu_vs_torch_checks_its_arguments_and_formats_its_rows():
    bad = _bench("--network", "nope")
    assert bad.returncode == 2 and "--network 'nope' is not a preset" in bad.stderr
    sys.path.insert(0, str(BENCH.parent))
    try:
        import gpu_vs_torch as bench
    finally:
        sys.path.remove(str(BENCH.parent))
    args = bench.build_parser().parse_args(["--batch", "64", "--flags", "--stages", "unfused"])
    assert bench.check_arguments(args) is None
    assert args.network == ["paper-500-1500", "resnet20"] and args.flags == ["--stages", "unfused"]
    rows = [
        bench.Row("resnet20", 64, bench.TORCH, "H100", 0.04, 25.0, 1.0),
        bench.Row("resnet20", 64, bench.WORKER, "H100", None, None, None, "failed"),
    ]
    table = bench.format_table(rows).splitlines()
    assert table[0].split() == ["network", "batch", "engine", "step_s", "steps/s", "x", "torch"]
    assert "0.0400" in table[1] and "25.00" in table[1] and table[2].split()[3:6] == ["-"] * 3


@pytest.mark.slow
def test_gpu_vs_torch_dry_run_measures_torch_and_local_on_the_cpu(tmp_path):
    out = tmp_path / "rows.json"
    done = _bench("--dry-run", "--json", str(out), timeout=300)
    assert done.returncode == 0, done.stderr
    rows = {row["engine"]: row for row in json.loads(out.read_text())}
    assert rows["torch"]["step_s"] > 0 and rows["hetconv-local"]["step_s"] > 0
    assert rows["hetconv-cuda-worker"]["step_s"] is None


def test_a_cuda_worker_beside_a_cpu_worker_splits_the_block_like_local_training(
    fake_cuda_worker, local, tmp_path
):
    """The replicated block split by images between the cuda worker and a cpu worker: its
    rows go to the peer from the host, the rest of each stage stays on the device."""
    shares = {"conv1": (0, 4, 4), "conv2": (4, 6, 6)}
    config = ClusterConfig(**FAST, shares=shares, stages="fused", replicate="split")
    with LocalWorkers(1) as cpu, Cluster([fake_cuda_worker, *cpu.addresses], config=config) as c:
        got = train_strong_lrn(tmp_path, "split", c)
        assert "split by images among the workers" in c.describe_replica()
    same_as_local(got, local)
