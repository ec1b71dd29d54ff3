"""The replicated block split by images with the master one of the peers (``--replicate
split_all``, hetconv.split): real worker processes on loopback, training compared with local
training step by step, also with a worker SIGKILLed mid-step."""

from __future__ import annotations

import json

import exactness
import numpy as np
import pytest
from exactness import FAST, same_as_local, train_strong_lrn
from test_split import (
    BATCH,
    K1,
    PAD,
    RELU,
    _case,
    _forward_everywhere,
    _local,
    same_block_gradients,
)

from hetconv.cli.simulate import main as simulate_main
from hetconv.conv import LocalConv
from hetconv.costmodel import SimCluster, SimNode, simulate_step
from hetconv.master.client import WorkerClient, WorkerError
from hetconv.master.cluster import Cluster, ClusterConfig
from hetconv.master.launch import LocalWorkers
from hetconv.proto import worker_pb2 as pb
from hetconv.simulations.calibrate import calibrate
from hetconv.split import MASTER, SplitPlan
from hetconv.stages import stage_backward, stage_forward
from hetconv.workload import network_layers

SHARES = {"conv1": (0, 1, 1, 6), "conv2": (4, 4, 4, 4)}
SPLIT_ALL = dict(**FAST, shares=SHARES, stages="fused", replicate="split_all")


@pytest.fixture(scope="module")
def workers():
    with LocalWorkers(3) as started:
        yield started


def test_the_master_as_a_peer_exchanges_parts_with_the_workers(workers):
    """The master computes the block on its own images and puts that output into the
    workers, fetches theirs; backward it puts its rows of their images and fetches theirs of
    its images; every piece summed equals the whole block's gradient here."""
    block, w2, b2, rng = _case()
    clients = [WorkerClient(a) for a in workers.addresses]
    plan = SplitPlan.of([MASTER, *workers.addresses], [1, 2, 2, 2])
    assert plan.master == 0 and plan.workers == workers.addresses
    slices = [slice(0, 2), slice(2, 4), slice(4, 6)]  # conv2's kernels: one slice each
    backend, y1, run1, outs = _local(block, w2, b2, slices)
    own = plan.images(MASTER)
    try:
        pool = _forward_everywhere(clients, block, plan, 31, 2)
        for i, c in enumerate(clients):  # each worker's own images' output, once computed
            got, _ = c.fetch_part(31, 2, "conv1", i + 1, gradient=False)
            np.testing.assert_allclose(got, y1[plan.images(c.address)], rtol=1e-5, atol=1e-6)
        for c in clients:  # the master's own images' output, as node 0
            c.put_part(31, 2, "conv1", 0, np.ascontiguousarray(y1[own]), False, 60.0, plan.round)
        got = list(pool.map(
            lambda cs: cs[0].stage_forward(
                31, 2, "conv2", y1, w2[cs[1]], b2[cs[1]], PAD, RELU, slice(0, 2), replica=block
            ),
            zip(clients, slices, strict=False),
        ))  # fmt: skip
        for (y, _, _), (want, _) in zip(got, outs, strict=True):
            np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
        dys = [rng.standard_normal(want.shape).astype(np.float32) for want, _ in outs]
        dx_master = rng.standard_normal(y1.shape).astype(np.float32)  # its own slice's rows
        for c in clients:
            rows = np.ascontiguousarray(dx_master[plan.images(c.address)])
            c.put_part(31, 2, "conv1", 0, rows, True, 60.0, plan.round)
        parts = [(np.empty_like(block.w), np.empty_like(block.b)) for _ in clients]
        back = [pool.submit(
            c.stage_backward, 31, 2, "conv2", dy, 0, True, replica=("conv1", *p)
        ) for c, dy, p in zip(clients, dys, parts, strict=True)]  # fmt: skip
        # the rows of the master's images, from each worker, as its backward has them
        rows = [c.fetch_part(31, 2, "conv1", 0)[0] for c in clients]
        for b in back:
            b.result()
        g = dx_master[own] + sum(rows)
        _, run_own = stage_forward(backend, block.x[own], block.w, block.b, PAD, block.stage,
                                   slice(0, K1))  # fmt: skip
        _, mw, mb = stage_backward(backend, run_own, g, slice(0, K1), False)
        dx = dx_master + sum(
            stage_backward(backend, run, dy, slice(0, 2), True)[0]
            for (_, run), dy in zip(outs, dys, strict=True)
        )
        _, want_rw, want_rb = stage_backward(backend, run1, dx, slice(0, K1), False)
        same_block_gradients(parts, want_rw, want_rb, (mw, mb))
    finally:
        for c in clients:
            c.close()


def test_a_fetch_names_its_round_and_never_gets_an_older_ones_output(workers):
    """A step computed again is a new round of the split, with other images per worker: the
    master's fetch of a worker's own output names the round, so it waits for that round's
    ReplicaForward instead of taking the first pass's output."""
    block, *_ = _case()
    client = WorkerClient(workers.addresses[0])
    first = SplitPlan.of([MASTER, workers.addresses[0]], [3, BATCH - 3], 1)
    again = SplitPlan.of([MASTER, workers.addresses[0]], [4, BATCH - 4], 2)
    try:
        client.replica_forward(43, 5, block, 60.0, first)
        with pytest.raises(WorkerError, match="DEADLINE_EXCEEDED"):
            client.fetch_part(43, 5, "conv1", 1, 1.0, gradient=False, round_=2)
        client.replica_forward(43, 5, block, 60.0, again)
        got, _ = client.fetch_part(43, 5, "conv1", 1, 10.0, gradient=False, round_=2)
        assert got.shape[0] == BATCH - 4
        with pytest.raises(WorkerError, match="moved on to step 5 round 2"):
            client.fetch_part(43, 5, "conv1", 1, 1.0, gradient=False, round_=1)
    finally:
        client.close()


def test_a_split_naming_the_master_badly_is_refused(workers):
    block, *_ = _case()
    client = WorkerClient(workers.addresses[0])
    try:
        good = SplitPlan.of([MASTER, workers.addresses[0]], [3, BATCH - 3])
        request = good.request_for(workers.addresses[0])
        assert [p.master for p in request.peers] == [True, False]
        two = pb.SplitBlock(node=1, peers=[
            pb.SplitPeer(start=0, count=3, master=True),
            pb.SplitPeer(address=workers.addresses[0], start=3, count=2),
            pb.SplitPeer(start=5, count=2, master=True),
        ])  # fmt: skip
        with pytest.raises(WorkerError, match="names 2 masters"):
            client.replica_forward(41, 1, block, 60.0, _Plan(two))
        mine = pb.SplitBlock(node=0, peers=[
            pb.SplitPeer(address=workers.addresses[0], start=0, count=3, master=True),
            pb.SplitPeer(address="127.0.0.1:1", start=3, count=4),
        ])  # fmt: skip
        with pytest.raises(WorkerError, match="is the master's"):
            client.replica_forward(41, 2, block, 60.0, _Plan(mine))
        client.replica_forward(41, 3, block, 60.0, good)
        with pytest.raises(WorkerError, match="the split has 2 peers"):
            client.fetch_part(41, 3, "conv1", 5, gradient=False)
    finally:
        client.close()


class _Plan:
    """A plan whose request is given as is (one SplitPlan would refuse to make)."""

    def __init__(self, request: pb.SplitBlock):
        self.request = request
        self.images = lambda _: slice(
            request.peers[request.node].start,
            request.peers[request.node].start + request.peers[request.node].count,
        )

    def request_for(self, _):
        return self.request


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    return train_strong_lrn(tmp_path_factory.mktemp("local"), "local", LocalConv())


@pytest.mark.parametrize(
    "kernels, master_block",
    [
        pytest.param("sent", "share", marks=pytest.mark.slow),
        ("resident", "share"),
        ("resident", "none"),
    ],
)
def test_a_block_split_with_the_master_trains_as_local(
    local, workers, tmp_path, kernels, master_block
):
    trace = tmp_path / "trace.jsonl"
    config = ClusterConfig(**SPLIT_ALL, kernels=kernels, master_block=master_block)
    with Cluster(workers.addresses, config=config) as cluster:
        got = train_strong_lrn(tmp_path, "split_all", cluster, trace=str(trace))
    same_as_local(got, local)
    among = "the master (which computes none" if master_block == "none" else "among the master"
    assert among in cluster.describe_replica()
    steps = [r for r in map(json.loads, trace.read_text().splitlines()) if "step" in r]
    assert all(r["stage_modes"] == {"conv1": "replicated", "conv2": "fused"} for r in steps)
    for record in steps:
        split = record["replica_split"]["conv1"]
        assert len(split["images"]) == 4 and sum(split["images"]) == 8, split
        assert split["master"] == 0 and split["covered_bytes"] == 0
        assert (split["images"][0] == 0) == (master_block == "none")
        assert split["exchanged_bytes"] > 0
    assert not [e for e in cluster.events if e["event"] == "worker_lost"]
    # the simulator reads the trace: the master's images, first, and its exchange
    cal = calibrate(str(trace))
    assert cal.replica_split == {"conv1": split["images"]}
    assert cal.split_master == {"conv1": 0}
    assert cal.check()["step_s"] > 0


@pytest.mark.parametrize(
    "kind, kernels",
    [
        pytest.param("output", "resident", marks=pytest.mark.slow),
        ("parts", "resident"),
        pytest.param("rows", "sent", marks=pytest.mark.slow),
        ("rows", "resident"),
    ],
)
def test_a_peer_lying_in_its_block_output_is_the_one_dropped(
    local, workers, tmp_path, kind, kernels
):
    """With the master a peer: a worker whose block output is x1.5 everywhere (its peers, the
    master's fetch, its own stage calls: ``output``) is caught by the master computing one of
    its images again; one that lies only in what it puts into its peers (``parts``), by the
    receivers' samples; one whose input-gradient rows put into its peers are x1.5 (``rows``),
    by the receivers' samples of one image's rows against the master's recomputation (with
    resident kernels, from the liar's slice fetched after its update and taken back a step).
    Only the liar is dropped, the honest workers stay, and training
    equals local step by step: the step computed again without the liar, whose slice of the
    next layer the master computes while it is outside the split, takes that slice's rows of
    the workers' images along with the master's own."""
    from test_spot_checks import lying_worker

    from hetconv.master.spotcheck import SpotCheckConfig

    with lying_worker(kind) as liar:
        addresses = [*workers.addresses[:2], liar]
        checks = SpotCheckConfig(every=1)
        config = ClusterConfig(**SPLIT_ALL, kernels=kernels, spot_checks=checks)
        with Cluster(addresses, config=config) as cluster:
            got = train_strong_lrn(tmp_path, kind, cluster)
            events = list(cluster.events)
            states = {node.name: node.state for node in cluster.nodes}
    lost = [(e["worker"], e["reason"]) for e in events if e["event"] == "worker_lost"]
    assert [w for w, _ in lost] == [liar], lost
    assert ("fetched by the master" in lost[0][1]) == (kind == "output"), lost
    assert ("input-gradient rows it put into" in lost[0][1]) == (kind == "rows"), lost
    assert all(states[a] == "active" for a in workers.addresses[:2])
    same_as_local(got, local)


@pytest.mark.parametrize("kernels", ["sent", "resident"])
def test_16_bit_wire_checks_keep_honest_workers_with_the_master_a_peer(workers, tmp_path, kernels):
    """With a 16-bit wire the master's block output goes into the workers, and theirs comes
    to it, as float32 (as the workers' own go between them): every node's stage input is the
    same float32 block output, so the spot checks and the parts' and rows' checks keep honest
    workers (before, the master's 16-bit parts flipped max-pool choices on the workers, and
    its 16-bit fetches on the master: every honest worker was dropped at step 0)."""
    from hetconv.formats import BFLOAT16
    from hetconv.master.spotcheck import SpotCheckConfig

    checks = SpotCheckConfig(every=1, unpredictable=False)
    config = ClusterConfig(**SPLIT_ALL, kernels=kernels, wire_format=BFLOAT16, spot_checks=checks)
    with Cluster(workers.addresses, config=config) as cluster:
        train_strong_lrn(tmp_path, f"bf16-{kernels}", cluster, steps=3)
        lost = [(e["worker"], e["reason"]) for e in cluster.events if e["event"] == "worker_lost"]
    assert lost == []


class Killing(exactness.Killing):
    # the honest workers' calls wait while the master covers the victim (its slice replayed
    # and computed, its rows put; more with spot checks due): 1 s was short on a busy machine
    BASE = {**SPLIT_ALL, "deadline_floor": 5.0}


@pytest.mark.parametrize(
    "kernels, when, master_block",
    [  # (the fast run keeps a kill in backward and one in forward; the rest are slow)
        pytest.param("sent", "backward", "share", marks=pytest.mark.slow),
        ("resident", "backward", "share"),
        pytest.param("resident", "forward", "share", marks=pytest.mark.slow),
        pytest.param("resident", "backward", "none", marks=pytest.mark.slow),
        ("resident", "forward", "none"),
    ],
)
def test_a_worker_killed_mid_step_stays_exact(local, tmp_path, kernels, when, master_block):
    trace = tmp_path / "trace.jsonl"
    with LocalWorkers(3) as started:
        victim = started.processes[1]
        with Killing(
            started.addresses, victim, 4, when, kernels=kernels, resident_sync_every=3,
            master_block=master_block,
        ) as cluster:  # fmt: skip
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


def test_the_simulator_models_the_master_as_a_peer():
    """The master computes the block on its own images and exchanges parts on its port: its
    block phases shrink by its share of the images, forward waits for the slowest worker's
    output, and the trace's form (its index in split_images) gives the same step."""
    layers = network_layers("paper-150-800", 16)
    nodes = [SimNode(f"w{i}", 5.0, bytes_per_s=1e9) for i in range(4)]
    cluster = SimCluster(SimNode("master", 5.0, bytes_per_s=1e9), tuple(nodes))
    shares = {"conv1": (150, 0, 0, 0, 0), "conv2": (160, 160, 160, 160, 160)}
    args = (cluster, layers, shares, 0.1, {"conv2": "fused"}, "resident")
    split = simulate_step(*args, replicate="split")
    everyone = simulate_step(*args, replicate="split_all")
    traced = {"conv1": "replicated", "conv2": "fused"}
    given = simulate_step(
        *args[:4], traced, "resident", split_images={"conv1": [4, 3, 3, 3, 3]},
        split_master={"conv1": 0},
    )  # fmt: skip
    assert given == everyone  # equal nodes: 16 images as 4, 3, 3, 3, 3
    block = {r: [p for p in s.phases if p.layer == "conv1"] for r, s in
             (("split", split), ("all", everyone))}  # fmt: skip
    # the master's own block: 4 of 16 images plus its exchange, against all 16
    assert block["all"][0].conv_s < block["split"][0].conv_s
    with pytest.raises(ValueError, match="the split's first peer"):
        simulate_step(*args[:4], traced, "resident", split_images={"conv1": [3, 4, 3, 3, 3]},
                      split_master={"conv1": 1})  # fmt: skip


def test_simulate_models_the_master_as_a_peer(tmp_path):
    rows = {}
    for replicate in ("split", "split_all"):
        out = tmp_path / f"{replicate}.json"
        argv = ["gigabit-lan", "--preset", "paper-150-800", "--batch", "16", "--nodes", "5"]
        argv += ["--stages", "fused", "--kernels", "resident", "--policy", "compute"]
        assert simulate_main([*argv, "--replicate", replicate, "--json", str(out)]) == 0
        (rows[replicate],) = [r for r in json.loads(out.read_text()) if r["policy"] == "compute"]
    assert rows["split_all"]["replicate"] == "split_all"
    assert rows["split_all"]["step_s"] != rows["split"]["step_s"]
