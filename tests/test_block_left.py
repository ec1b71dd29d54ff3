"""A replicated first block left to the workers: where the master holds no kernel of the layer
the block feeds (resident), it computes neither its copy of the block nor its backward, and
computes the output only where something reads it.

Real worker processes on loopback; each run equals local training step by step and in its
final weights: the block never computed on the master, a worker SIGKILLed mid-step (the master
covers its piece, replaying the slice from a log that kept the block's inputs), and spot checks
that replay the log at syncs.
"""

from __future__ import annotations

import json

import exactness
import numpy as np
import pytest
from exactness import FAST, same_as_local, train_strong_lrn
from test_spot_checks import lying_worker

from hetconv.backends import CpuBackend
from hetconv.master.cluster import Cluster, ClusterConfig
from hetconv.master.launch import LocalWorkers
from hetconv.master.replica import BlockOutput, arrived
from hetconv.master.spotcheck import SpotCheckConfig
from hetconv.replica import ReplicaBlock
from hetconv.stages import StageSpec, stage_forward

SHARES = {"conv1": (0, 4, 4), "conv2": (0, 9, 7)}  # the master: none of conv2
# no spot checks but where a test asks: a drawn forward reads the output (computed then)
LEFT = dict(
    **FAST, shares=SHARES, stages="fused", kernels="resident", replicate="first",
    resident_sync_every=3, spot_checks=SpotCheckConfig(every=0),
)  # fmt: skip


def _steps(trace):
    return [r for r in map(json.loads, trace.read_text().splitlines()) if "step" in r]


def test_the_block_left_to_the_workers_trains_as_local(local, workers, tmp_path):
    trace = tmp_path / "trace.jsonl"
    with Cluster(workers.addresses, config=ClusterConfig(**LEFT)) as cluster:
        got = train_strong_lrn(tmp_path, "left", cluster, trace=str(trace))
    same_as_local(got, local)
    steps = _steps(trace)
    assert steps and all(r["blocks_left"] == {"conv1": False} for r in steps), steps[0]
    assert all(r["stage_modes"]["conv1"] == "replicated" for r in steps)
    for r in steps:  # the master computed nothing of the block
        assert r["nodes"]["master"]["conv1"]["forward"]["compute_seconds"] == 0.0


def test_a_master_with_kernels_of_the_next_layer_computes_the_block(workers, tmp_path):
    trace = tmp_path / "trace.jsonl"
    shares = {"conv1": (0, 4, 4), "conv2": (2, 7, 7)}
    with Cluster(workers.addresses, config=ClusterConfig(**{**LEFT, "shares": shares})) as c:
        train_strong_lrn(tmp_path, "kept", c, trace=str(trace), steps=3)
    assert all("blocks_left" not in r for r in _steps(trace))


class Killing(exactness.Killing):
    BASE = LEFT


@pytest.mark.parametrize("when", ["backward", pytest.param("forward", marks=pytest.mark.slow)])
def test_a_worker_killed_mid_step_is_covered_from_the_blocks_inputs(local, tmp_path, when):
    trace = tmp_path / "trace.jsonl"
    with LocalWorkers(2) as started:
        victim = started.processes[1]
        with Killing(started.addresses, victim, 4, when) as cluster:
            got = train_strong_lrn(tmp_path, "killed", cluster, trace=str(trace))
            lost = [e for e in cluster.events if e["event"] == "worker_lost"]
    same_as_local(got, local)
    assert [(e["worker"], e["step"]) for e in lost] == [(started.addresses[1], 4)]
    steps = {r["step"]: r for r in _steps(trace)}
    # the step of the kill computed the block here (the lost piece read it); before, never
    assert steps[4]["blocks_left"] == {"conv1": True}
    assert all(steps[s]["blocks_left"] == {"conv1": False} for s in range(4))


def test_spot_checks_replay_the_log_of_a_block_left_to_the_workers(tmp_path):
    # a worker scaling each of its updates by 1.01 is caught at the first sync's replay, which
    # recomputes the block's output from the inputs the log kept
    trace = tmp_path / "trace.jsonl"
    config = ClusterConfig(**{**LEFT, "spot_checks": SpotCheckConfig(every=1)})
    with LocalWorkers(1) as honest, lying_worker("update") as liar:
        with Cluster(honest.addresses + [liar], config=config) as cluster:
            train_strong_lrn(tmp_path, "checked", cluster, trace=str(trace), steps=6)
            lost = [e for e in cluster.events if e["event"] == "worker_lost"]
    assert [(e["worker"], e["step"]) for e in lost] == [(liar, LEFT["resident_sync_every"])]
    assert "replay conv2: spot check failed: " in lost[0]["reason"], lost[0]["reason"]
    steps = _steps(trace)
    # step 0's forward is compared (every slice just placed), so it computed the output;
    # step 1's is not (compared at the sync, by replay), so it did not
    assert [r["blocks_left"] for r in steps[:2]] == [{"conv1": True}, {"conv1": False}]


def test_a_block_output_is_computed_once_when_read():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 8, 8), dtype=np.float32)
    w = rng.standard_normal((4, 3, 3, 3), dtype=np.float32)
    b = np.zeros(4, np.float32)
    entries = [{"type": "relu"}, {"type": "lrn", "size": 3}, {"type": "maxpool", "size": 2}]
    stage = StageSpec.from_entries(entries)
    backend = CpuBackend()
    block = ReplicaBlock("conv1", x, w, b, (1, 1, 1, 1), stage)
    late = BlockOutput(backend, block, (2, 4, 4, 4))
    assert not late.computed and late.shape == (2, 4, 4, 4) and late.nbytes == 2 * 4 * 16 * 4
    want, _ = stage_forward(backend, x, w, b, (1, 1, 1, 1), stage, slice(0, 4))
    np.testing.assert_array_equal(np.asarray(late), want)
    assert late.computed and arrived(late) is arrived(late) and late.run is not None
    np.testing.assert_array_equal(late[1], want[1])
    late.release()  # the step's backward done: a replay computing it later keeps no StageRun
    assert late.run is None and late.computed
    later = BlockOutput(backend, block, (2, 4, 4, 4))
    later.release()
    np.testing.assert_array_equal(later.array(), want)
    assert later.run is None


def test_the_cost_model_leaves_the_block_to_the_workers():
    """Simulated: the master holding none of conv2 (resident) spends nothing on the block; with
    kernels sent it still computes its copy (as the cluster does)."""
    from hetconv.costmodel import SimCluster, SimNode, simulate_step
    from hetconv.model import reference_spec
    from hetconv.workload import conv_layers

    conv1, conv2 = conv_layers(reference_spec(150, 800), 16)
    node = dict(gflops=20.0, bytes_per_s=125e6, rtt_s=1e-4)
    cluster = SimCluster(SimNode("master", **node), (SimNode("w0", **node),), master_compute=False)
    shares = {"conv1": (150, 0), "conv2": (0, 800)}

    def block_seconds(kernels):
        step = simulate_step(
            cluster, [conv1, conv2], shares, 0.0, stages="fused", kernels=kernels,
            replicate="first",
        )  # fmt: skip
        phases = {(p.layer, p.phase): p.wall_s for p in step.phases}
        return phases["conv1", "forward"], phases["conv1", "backward"], step.step_s

    left, kept = block_seconds("resident"), block_seconds("sent")
    assert left[:2] == (0.0, 0.0)
    assert kept[0] > 0.0 and kept[1] > 0.0
