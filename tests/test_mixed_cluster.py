"""A mixed cluster: the master, a cpu worker and a device worker train like one process.

Real worker processes on loopback, one per backend. The device worker is opencl (wherever an
OpenCL device exists: PoCL's CPU device in CI) or cuda (on a machine with a CUDA GPU); a backend
that cannot run here is skipped with the reason. Tolerance: losses within rtol 1e-5 and weights
within atol 1e-5 (test_cluster.py uses 1e-6: a device sums in a different order than BLAS does).
"""

from __future__ import annotations

import io

import numpy as np
import pytest

from hetconv.backends import BackendUnavailable, backend_class
from hetconv.conv import LocalConv
from hetconv.master.cluster import Cluster, ClusterConfig
from hetconv.master.launch import LocalWorkers
from hetconv.training import TrainConfig, train


def _missing(name: str) -> str:
    """Why backend ``name`` cannot run here ('' when it can)."""
    try:
        cls = backend_class(name)
    except BackendUnavailable as e:
        return str(e)
    ok, why = cls.is_available()
    return "" if ok else f"backend {name} is not available here: {why}"


DEVICE_BACKENDS = [
    pytest.param(name, marks=pytest.mark.skipif(bool(_missing(name)), reason=_missing(name)))
    for name in ("opencl", "cuda")
]

RUN = dict(steps=4, batch=8, train_size=64, eval_size=16, progress=False)


def _train(tmp_path, name, executor):
    weights = tmp_path / f"{name}.npz"
    result = train(TrainConfig(save=str(weights), **RUN), executor, log=io.StringIO())
    return result.losses, dict(np.load(weights))


@pytest.mark.parametrize("device_backend", DEVICE_BACKENDS)
def test_master_cpu_worker_and_device_worker_train_like_local(tmp_path, device_backend):
    local_losses, local_weights = _train(tmp_path, "local", LocalConv())
    with (
        LocalWorkers(1, backend="cpu") as cpu,
        LocalWorkers(1, backend=device_backend) as device,
    ):
        addresses = cpu.addresses + device.addresses
        # Every node computes part of every layer (the probe alone might give PoCL nothing).
        config = ClusterConfig(shares={"conv1": (3, 3, 2), "conv2": (6, 5, 5)})
        with Cluster(addresses, config=config) as cluster:
            losses, weights = _train(tmp_path, "mixed", cluster)
            kinds = [node.description for node in cluster.nodes]
    assert device_backend in kinds[2], kinds
    np.testing.assert_allclose(losses, local_losses, rtol=1e-5)
    for name in weights:
        np.testing.assert_allclose(weights[name], local_weights[name], rtol=0, atol=1e-5)
