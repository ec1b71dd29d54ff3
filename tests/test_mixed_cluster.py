"""A mixed cluster: the master, a cpu worker and an opencl worker train like one process.

Real worker processes on loopback, one per backend. The opencl worker runs wherever an OpenCL
device exists (PoCL's CPU device in CI); without one the test is skipped with the reason.
Tolerance: losses within rtol 1e-5 and weights within atol 1e-5 (test_cluster.py uses 1e-6:
the opencl device sums in a different order than BLAS does).
"""

from __future__ import annotations

import io

import numpy as np
import pytest

from hetconv.backends import BackendUnavailable, backend_class
from hetconv.conv import LocalConv
from hetconv.master.cluster import Cluster, ClusterConfig
from hetconv.master.launch import LocalWorkers
from hetconv.master.training import TrainConfig, train

try:
    backend_class("opencl")
    OPENCL_MISSING = ""
except BackendUnavailable as e:
    OPENCL_MISSING = str(e)

pytestmark = pytest.mark.skipif(bool(OPENCL_MISSING), reason=OPENCL_MISSING)

RUN = dict(steps=4, batch=8, train_size=64, eval_size=16, progress=False)


def _train(tmp_path, name, executor):
    weights = tmp_path / f"{name}.npz"
    result = train(TrainConfig(save=str(weights), **RUN), executor, log=io.StringIO())
    return result.losses, dict(np.load(weights))


def test_master_cpu_worker_and_opencl_worker_train_like_local(tmp_path):
    local_losses, local_weights = _train(tmp_path, "local", LocalConv())
    with LocalWorkers(1, backend="cpu") as cpu, LocalWorkers(1, backend="opencl") as opencl:
        addresses = cpu.addresses + opencl.addresses
        # Every node computes part of every layer (the probe alone might give PoCL nothing).
        config = ClusterConfig(shares={"conv1": (3, 3, 2), "conv2": (6, 5, 5)})
        with Cluster(addresses, config=config) as cluster:
            losses, weights = _train(tmp_path, "mixed", cluster)
            kinds = [node.description for node in cluster.nodes]
    assert "opencl" in kinds[2], kinds
    np.testing.assert_allclose(losses, local_losses, rtol=1e-5)
    for name in weights:
        np.testing.assert_allclose(weights[name], local_weights[name], rtol=0, atol=1e-5)
