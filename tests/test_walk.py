"""The walk of a training step through the cluster: the model enters the cluster module once per
convolution and phase, the cluster hands the call to the layer's way of running (master/runs.py),
and nothing the cluster hands work to calls back into it, whatever the modes."""

from __future__ import annotations

import io
import sys
import threading
from pathlib import Path

import pytest

from hetconv.master import cluster as cluster_module
from hetconv.master.cluster import Cluster, ClusterConfig
from hetconv.model import PRESETS
from hetconv.training import TrainConfig, train

CLUSTER_FILE = Path(cluster_module.__file__).resolve()
MASTER = CLUSTER_FILE.parent
TENSOR_CALLS = {"forward", "backward", "stage_forward", "stage_backward"}


class Walked(Cluster):
    """A cluster that records, between each step's begin and end, every entry into its own
    module from another: (the caller's file, the function entered)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.entries: list[list[tuple[Path, str]]] = []

    def _profile(self, frame, event, arg):
        if event != "call" or Path(frame.f_code.co_filename).resolve() != CLUSTER_FILE:
            return
        caller = frame.f_back
        where = Path(caller.f_code.co_filename).resolve() if caller is not None else None
        if where != CLUSTER_FILE:
            self.entries[-1].append((where, frame.f_code.co_name))

    def begin_step(self, step):
        super().begin_step(step)
        self.entries.append([])
        threading.setprofile(self._profile)
        sys.setprofile(self._profile)

    def end_step(self):
        sys.setprofile(None)
        threading.setprofile(None)
        return super().end_step()


@pytest.mark.parametrize(
    "modes",
    [
        dict(stages="unfused", kernels="sent"),  # the paper's
        dict(stages="fused", kernels="sent", overlap="on"),
        dict(stages="fused", kernels="resident", head="split", replicate="first"),
        dict(stages="fused", kernels="resident", replicate="split_all"),
    ],
    ids=["unfused", "fused-overlap", "resident-head-replicated", "split-all"],
)
def test_a_step_enters_the_cluster_once_per_layer_and_phase(workers, tmp_path, modes):
    config = TrainConfig(steps=2, batch=8, train_size=32, eval_size=0, progress=False)
    with Walked(workers.addresses, config=ClusterConfig(**modes)) as cluster:
        train(config, cluster, log=io.StringIO())
        convs = len([spec for spec in PRESETS["tiny"] if spec["type"] == "conv"])
        assert len(cluster.entries) == 2
        for entries in cluster.entries:
            # nothing the cluster handed work to (runs, dispatch, resident, replica, the
            # client, their threads) came back into it
            back = [(where, name) for where, name in entries if where and where.parent == MASTER]
            assert back == []
            tensor = [name for _, name in entries if name in TENSOR_CALLS]
            assert len(tensor) == 2 * convs, entries  # each conv: one forward, one backward
