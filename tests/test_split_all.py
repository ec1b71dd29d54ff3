"""The replicated block split by images with the master one of the peers (``--replicate
split_all``, hetconv.split): real worker processes on loopback, training compared with local
training step by step, also with a worker SIGKILLed mid-step."""

from __future__ import annotations

import json

import exactness
import pytest
from exactness import FAST, same_as_local, train_strong_lrn

from hetconv.conv import LocalConv
from hetconv.master.cluster import Cluster, ClusterConfig
from hetconv.master.launch import LocalWorkers

SHARES = {"conv1": (0, 1, 1, 6), "conv2": (4, 4, 4, 4)}
SPLIT_ALL = dict(**FAST, shares=SHARES, stages="fused", replicate="split_all")


@pytest.fixture(scope="module")
def workers():
    with LocalWorkers(3) as started:
        yield started


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    return train_strong_lrn(tmp_path_factory.mktemp("local"), "local", LocalConv())


@pytest.mark.parametrize("kernels", ["sent", "resident"])
def test_a_block_split_with_the_master_trains_as_local(local, workers, tmp_path, kernels):
    trace = tmp_path / "trace.jsonl"
    config = ClusterConfig(**SPLIT_ALL, kernels=kernels)
    with Cluster(workers.addresses, config=config) as cluster:
        got = train_strong_lrn(tmp_path, "split_all", cluster, trace=str(trace))
    same_as_local(got, local)
    assert "among the master and the workers" in cluster.describe_replica()
    steps = [r for r in map(json.loads, trace.read_text().splitlines()) if "step" in r]
    assert all(r["stage_modes"] == {"conv1": "replicated", "conv2": "fused"} for r in steps)
    for record in steps:
        split = record["replica_split"]["conv1"]
        assert len(split["images"]) == 4 and sum(split["images"]) == 8, split
        assert split["master"] == 0 and split["covered_bytes"] == 0
        assert split["exchanged_bytes"] > 0
    assert not [e for e in cluster.events if e["event"] == "worker_lost"]


class Killing(exactness.Killing):
    BASE = SPLIT_ALL


@pytest.mark.parametrize(
    "kernels, when", [("sent", "backward"), ("resident", "backward"), ("resident", "forward")]
)
def test_a_worker_killed_mid_step_stays_exact(local, tmp_path, kernels, when):
    trace = tmp_path / "trace.jsonl"
    with LocalWorkers(3) as started:
        victim = started.processes[1]
        with Killing(
            started.addresses, victim, 4, when, kernels=kernels, resident_sync_every=3
        ) as cluster:
            got = train_strong_lrn(tmp_path, "killed", cluster, trace=str(trace))
            lost = [e for e in cluster.events if e["event"] == "worker_lost"]
    same_as_local(got, local)
    assert [(e["worker"], e["step"]) for e in lost] == [(started.addresses[1], 4)]
    steps = {r["step"]: r for r in map(json.loads, trace.read_text().splitlines()) if "step" in r}
    # at step 4 the master put the lost worker's parts into the other two: lost in forward,
    # its images' block output, to each; then its slice's gradient rows of their images (not
    # the master's own). From step 5 the master and two workers split the batch.
    covered = steps[4]["replica_split"]["conv1"]
    images = covered["images"]
    victim_images = images[2]  # the master first, then the workers in node order
    per_image = 8 * 16 * 16 * 4  # the block's output on one image, float32
    put = (2 * victim_images if when == "forward" else 0) + sum(images[1:]) - victim_images
    assert covered["covered_bytes"] == put * per_image, covered
    after = steps[5]["replica_split"]["conv1"]
    assert len(after["images"]) == 3 and sum(after["images"]) == 8, after
    assert after["covered_bytes"] == 0
