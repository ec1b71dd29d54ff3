"""A replicated first block: every node computes conv1 and its stage from the images.

Real worker processes on loopback: a cluster that replicates the first block (with fused and
with resident kernels for conv2) trains as local training does step by step, also when a worker
is SIGKILLed mid-step; the second layer's input never crosses the link (the trace's bytes say
so, and match the cost model's count); a worker refuses bad ReplicaForward requests and a stage
call naming a block it has not computed, naming what was wrong.
"""

from __future__ import annotations

import json

import exactness
import numpy as np
import pytest
from exactness import FAST, RUN, STRONG_LRN, same_as_local, train_strong_lrn

from hetconv.balance import link_aware_shares
from hetconv.cli.simulate import main as simulate_main
from hetconv.costmodel import SimCluster, SimNode, replica_bytes, replicate_gain, simulate_step
from hetconv.formats import FLOAT32, PALETTE8
from hetconv.master.client import CallStats, WorkerClient, WorkerError
from hetconv.master.cluster import Cluster, ClusterConfig
from hetconv.master.launch import LocalWorkers
from hetconv.model import Model, reference_spec
from hetconv.replica import ReplicaBlock
from hetconv.simulations.calibrate import calibrate, replicas
from hetconv.simulations.trace import read_steps, step_bytes
from hetconv.stages import StageSpec
from hetconv.workload import (
    ConvLayer,
    conv_layers,
    network_layers,
    resident_call_bytes,
    resident_sync_bytes,
    stage_call_bytes,
)

SHARES = {"conv1": (0, 1, 7), "conv2": (5, 9, 2)}
REPLICA = dict(**FAST, shares=SHARES, stages="fused", replicate="first")


def _records(trace):
    return [json.loads(line) for line in trace.read_text().splitlines()]


@pytest.mark.parametrize("kernels", ["sent", "resident"])
def test_replicated_first_block_trains_as_local(local, workers, tmp_path, kernels):
    trace = tmp_path / "trace.jsonl"
    config = ClusterConfig(**REPLICA, kernels=kernels)
    with Cluster(workers.addresses, config=config) as cluster:
        got = train_strong_lrn(tmp_path, "replica", cluster, trace=str(trace))
    same_as_local(got, local)
    # every worker's ReplicaForward was started with the block's own forward, and taken
    assert cluster.replicas.input_of("conv2").started == {}
    records = _records(trace)
    assert records[0]["replicated"] == {"conv1": "conv2"}
    steps = [r for r in records if "step" in r]
    assert all(r["stage_modes"] == {"conv1": "replicated", "conv2": "fused"} for r in steps)
    # the images are normalised 8-bit pixels: they went as palette8 (exact: same_as_local)
    assert all(r["replica_images"] == {"conv1": "palette8"} for r in steps)
    # The master's part went back through the block inside conv2's backward, while the
    # workers computed: conv1's backward record holds that convolution (compute) beyond what
    # ran after the phase (wall: only the workers' parts added).
    for record in steps:
        back = record["nodes"]["master"]["conv1"]["backward"]
        assert back["compute_seconds"] > back["wall_seconds"] >= 0, back
    # conv1 ran on the master alone (no worker call of it); conv2's workers computed, and
    # each call moved what the cost model counts: the images out, never conv2's input
    layers = {layer.name: layer for layer in conv_layers(STRONG_LRN, RUN["batch"])}
    conv1, conv2 = layers["conv1"], layers["conv2"]
    count = stage_call_bytes if kernels == "sent" else resident_call_bytes
    for record in steps:
        offset = SHARES["conv2"][0]
        for node, share in zip(workers.addresses, SHARES["conv2"][1:], strict=True):
            assert "conv1" not in record["nodes"][node]
            for phase in ("forward", "backward"):
                got = record["nodes"][node]["conv2"][phase]
                want = count(
                    conv2, conv2.stage, phase, share, offset, record["step"], **({"replica": conv1})
                )
                assert (got["bytes_sent"], got["bytes_received"]) == (want.sent, want.received)
            offset += share
    plain = stage_call_bytes(conv2, conv2.stage, "forward", 9, 5)
    with_replica = stage_call_bytes(conv2, conv2.stage, "forward", 9, 5, replica=conv1)
    x = FLOAT32.nbytes((RUN["batch"], conv2.shape.c, conv2.shape.h, conv2.shape.w))
    # the run's images are normalised 8-bit pixels: they travel as palette8, 3 x 1024 bytes of
    # palettes and one byte per value, a quarter of float32's and more
    images = 3 * 1024 + RUN["batch"] * 3 * 32 * 32
    assert images == PALETTE8.nbytes((RUN["batch"], 3, 32, 32))
    kernels_bytes = 4 * (8 * 3 * 25 + 8)
    assert with_replica.tensors_sent == plain.tensors_sent - x + images + kernels_bytes
    floats = ConvLayer(conv1.name, conv1.shape, False, conv1.stage, images_fit=False)
    as_floats = stage_call_bytes(conv2, conv2.stage, "forward", 9, 5, replica=floats)
    assert as_floats.tensors_sent == with_replica.tensors_sent - images + FLOAT32.nbytes(
        (RUN["batch"], 3, 32, 32)
    )


class Killing(exactness.Killing):
    BASE = REPLICA


@pytest.mark.parametrize(
    "kernels, when",
    [
        pytest.param("sent", "backward", marks=pytest.mark.slow),
        ("resident", "backward"),
        # a kill in forward: also tests/test_split_all.py's [resident-forward-*] in the fast run
        pytest.param("resident", "forward", marks=pytest.mark.slow),
    ],
)
def test_a_worker_killed_mid_step_stays_exact(local, tmp_path, kernels, when):
    with LocalWorkers(2) as started:
        victim = started.processes[1]
        with Killing(
            started.addresses, victim, 4, when, kernels=kernels, resident_sync_every=3
        ) as cluster:
            got = train_strong_lrn(tmp_path, "killed", cluster)
            lost = [e for e in cluster.events if e["event"] == "worker_lost"]
    same_as_local(got, local)
    assert [(e["worker"], e["step"]) for e in lost] == [(started.addresses[1], 4)]


def test_the_model_says_which_convolution_a_block_feeds():
    model = Model(reference_spec(8, 16))
    specs = model.conv_specs()
    assert [s.feeds for s in specs] == ["conv2", None]
    dropout = reference_spec(8, 16)
    dropout.insert(4, {"type": "dropout", "p": 0.5})
    assert [s.feeds for s in Model(dropout).conv_specs()] == [None, None]


def test_replication_is_off_where_the_network_does_not_allow_it(workers):
    config = ClusterConfig(**{**REPLICA, "stages": "unfused"})
    with Cluster(workers.addresses, config=config) as cluster:
        cluster.prepare(Model(reference_spec(8, 16)).conv_specs(), 8)
        assert cluster.replicas.feeds == {}
        assert "conv2 does not run as a fused stage" in cluster.describe_replica()


def test_the_cost_model_counts_the_bytes_and_the_compute():
    layers = {layer.name: layer for layer in conv_layers(reference_spec(150, 800), 16)}
    up, down = replica_bytes(layers["conv1"], layers["conv2"])
    x = 4 * 16 * 150 * 16 * 16
    palette8 = 3 * 1024 + 16 * 3 * 32 * 32  # the images, as 8-bit pixels travel
    assert up == x - palette8 - 4 * (150 * 3 * 25 + 150)
    assert down == x - 4 * (150 * 3 * 25 + 150)
    conv1 = layers["conv1"]
    floats = ConvLayer(conv1.name, conv1.shape, False, conv1.stage, images_fit=False)
    assert replica_bytes(floats, layers["conv2"]) == (up + palette8 - 4 * 16 * 3 * 32 * 32, down)
    fast = replicate_gain(layers["conv1"], layers["conv2"], [0.01, 0.01], [12.5e6, 12.5e6])
    assert fast > 0  # 2 x 4.8 MB saved per worker on 100 Mbit/s against 10 ms of compute
    slow = replicate_gain(layers["conv1"], layers["conv2"], [0.01, 5.0], [1e9])
    assert slow < 0  # a worker 500 times slower at the block, on a fast link


def test_a_worker_that_holds_the_whole_block_computes_it_either_way():
    # One worker holds every kernel of conv1 and conv2 (the master computes none, as beside a
    # GPU worker): replicated, the worker computes the block it computed anyway, and conv2's
    # input and its gradient stop crossing, so the block pays however slow it is.
    from hetconv.modetable import ModeFlags, replica_gain

    layers = {layer.name: layer for layer in conv_layers(reference_spec(150, 800), 16)}
    conv1, conv2 = layers["conv1"], layers["conv2"]
    flags = ModeFlags(replicate="auto")
    seconds, links = [0.0, 0.5], [1e9]  # the master probes nothing; the worker's block 0.5 s
    blind = replica_gain(flags, conv1, conv2, (0, 800), seconds, links, False)
    held = replica_gain(flags, conv1, conv2, (0, 800), seconds, links, False, (0, 150))
    up, down = replica_bytes(conv1, conv2)
    assert blind < 0  # counted as 0.5 s of extra compute against 9.8 MB at 1 GB/s
    assert held == pytest.approx((up + down) / 1e9)
    # Split evenly with the master, the worker's half of the block is what it costs anyway.
    seconds = [0.5, 0.5]
    halves = replica_gain(flags, conv1, conv2, (400, 400), seconds, links, False, (75, 75))
    assert halves == pytest.approx((up + down) / 1e9 - 0.25)


def _block(x_shape=(2, 3, 8, 8), k=4):
    rng = np.random.default_rng(0)
    x = rng.standard_normal(x_shape).astype(np.float32)
    w = rng.standard_normal((k, x_shape[1], 3, 3)).astype(np.float32)
    b = rng.standard_normal(k).astype(np.float32)
    stage = StageSpec.from_entries([{"type": "relu"}, {"type": "maxpool", "kernel": 2}])
    return ReplicaBlock("conv1", x, w, b, (1, 1, 1, 1), stage)


def test_a_worker_refuses_bad_replica_requests(workers):
    client = WorkerClient(workers.addresses[0])
    try:
        block = _block()
        client.replica_forward(7, 0, block)  # a good one
        bad = ReplicaBlock("conv1", block.x, block.w, block.b[:2], block.sides, block.stage)
        with pytest.raises(WorkerError, match=r"b has shape \(2,\), expected \(4,\)"):
            client.replica_forward(7, 0, bad)
        nan = block.x.copy()
        nan[0, 0, 0, 0] = np.nan
        with pytest.raises(WorkerError, match="NaN or Inf"):
            client.replica_forward(
                7, 0, ReplicaBlock("conv1", nan, block.w, block.b, block.sides, block.stage)
            )
        # a stage call naming a block this session never computed is refused, not guessed
        rng = np.random.default_rng(1)
        w2 = rng.standard_normal((2, 4, 3, 3)).astype(np.float32)
        b2 = np.zeros(2, np.float32)
        x2 = np.zeros((2, 4, 4, 4), np.float32)
        stage = StageSpec.from_entries([{"type": "relu"}])
        other = ReplicaBlock("conv9", block.x, block.w, block.b, block.sides, block.stage)
        client.replica_forward = lambda *args, **kwargs: CallStats()  # a master that skipped it
        with pytest.raises(WorkerError, match="no output of at step 0.*send ReplicaForward"):
            client.stage_forward(
                8, 0, "conv2", x2, w2, b2, (1, 1, 1, 1), stage, slice(0, 2), replica=other
            )
    finally:
        client.close()


def test_a_stage_call_with_a_replica_matches_one_without(workers):
    """The worker's stage output from the block it computed equals the one from the block's
    output sent, and its rw, rb are the block's kernel gradients of that part."""
    from hetconv.backends import get_backend
    from hetconv.stages import stage_backward, stage_forward

    backend = get_backend("cpu")
    block = _block()
    y1, run1 = stage_forward(
        backend, block.x, block.w, block.b, block.sides, block.stage, slice(0, 4)
    )
    rng = np.random.default_rng(2)
    w2 = rng.standard_normal((3, 4, 3, 3)).astype(np.float32)
    b2 = rng.standard_normal(3).astype(np.float32)
    stage2 = StageSpec.from_entries([{"type": "relu"}])
    client = WorkerClient(workers.addresses[0])
    try:
        y, _, _ = client.stage_forward(
            11, 3, "conv2", y1, w2, b2, (1, 1, 1, 1), stage2, slice(0, 3), replica=block
        )
        want, run2 = stage_forward(backend, y1, w2, b2, (1, 1, 1, 1), stage2, slice(0, 3))
        np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)
        dy = rng.standard_normal(want.shape).astype(np.float32)
        rw, rb = np.empty_like(block.w), np.empty_like(block.b)
        dx, dw, db, _, _ = client.stage_backward(
            11, 3, "conv2", dy, 0, True, replica=("conv1", rw, rb)
        )
        assert dx is None  # the input gradient went on through the block
        dx2, dw2, db2 = stage_backward(backend, run2, dy, slice(0, 3), True)
        np.testing.assert_allclose(dw, dw2, rtol=1e-4, atol=1e-5)
        _, want_rw, want_rb = stage_backward(backend, run1, dx2, slice(0, 4), False)
        np.testing.assert_allclose(rw, want_rw, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(rb, want_rb, rtol=1e-4, atol=1e-4)
    finally:
        client.close()


def test_a_replicated_trace_calibrates_the_simulator(workers, tmp_path):
    trace = tmp_path / "trace.jsonl"
    config = ClusterConfig(**REPLICA, kernels="resident")
    with Cluster(workers.addresses, config=config) as cluster:
        train_strong_lrn(tmp_path, "traced", cluster, trace=str(trace))
    cal = calibrate(str(trace), str(tmp_path / "strong-lrn.json"))
    assert cal.stage_modes == {"conv1": "replicated", "conv2": "fused"}
    assert cal.shares["conv1"] == (8, 0, 0)  # the master computed the block alone
    # every worker's figure for the block is its conv2 calls' (which computed both)
    for per_layer in cal.layer_gflops[1:]:
        assert per_layer["conv1"] == per_layer["conv2"]
    layers = network_layers(str(tmp_path / "strong-lrn.json"), RUN["batch"])
    result = simulate_step(
        cal.traced_cluster(), layers, cal.shares, 0.0, cal.stage_modes, cal.kernel_modes
    )
    # the simulated calls move what the traced ones did (headers' varints aside), and the
    # syncs amortised over 20 steps (the traced steps without a sync have none)
    traced = [step_bytes(r) for r in read_steps(str(trace))[1:] if "resident" not in r]
    syncs = sum(resident_sync_bytes(layers[1], share) // 20 for share in SHARES["conv2"][1:])
    assert abs(result.bytes - syncs - min(traced)) < 32, (result.bytes, syncs, traced)
    assert cal.check()["step_s"] > 0


def test_link_shares_give_workers_more_when_less_travels():
    """On a slow shared medium, the link-aware split of conv2 gives the workers more kernels
    once their kernels stay (resident) and its input is computed there (replicated block)."""
    layers = {layer.name: layer for layer in conv_layers(reference_spec(150, 800), 16)}
    node = dict(gflops=20.0, bytes_per_s=12.5e6, rtt_s=1e-3)
    cluster = SimCluster(
        SimNode("master", **node),
        tuple(SimNode(f"w{i}", **node) for i in range(4)),
        "wifi",
        medium_bytes_per_s=12.5e6,
    )
    conv1, conv2 = layers["conv1"], layers["conv2"]
    fused = link_aware_shares(cluster, conv2, True)
    kept = link_aware_shares(cluster, conv2, True, resident=True)
    replicated = link_aware_shares(cluster, conv2, True, resident=True, replica=conv1)
    assert sum(fused[1:]) < sum(kept[1:]) < sum(replicated[1:])


def test_simulate_models_the_replicated_block(tmp_path, capsys):
    rows = {}
    for replicate in ("off", "first"):
        out = tmp_path / f"{replicate}.json"
        argv = ["gigabit-lan", "--preset", "paper-150-800", "--batch", "16", "--nodes", "5"]
        argv += ["--stages", "fused", "--kernels", "resident", "--policy", "compute"]
        assert simulate_main([*argv, "--replicate", replicate, "--json", str(out)]) == 0
        (rows[replicate],) = [r for r in json.loads(out.read_text()) if r["policy"] == "compute"]
    assert rows["first"]["replicate"] == "first"
    assert rows["first"]["shares"]["conv1"] == [150, 0, 0, 0, 0]
    assert rows["first"]["mbytes_per_step"] < rows["off"]["mbytes_per_step"] / 2
    capsys.readouterr()
    assert simulate_main(["gigabit-lan", "--stages", "unfused", "--replicate", "first"]) == 2
    assert "--replicate first feeds the second layer" in capsys.readouterr().err


def _five_equal_nodes():
    """paper-150-800's layers at batch 16 on a master and 4 workers alike, conv1 on the
    master, conv2's kernels a fifth each: (conv1, conv2, the cluster, the shares)."""
    layers = {layer.name: layer for layer in conv_layers(reference_spec(150, 800), 16)}
    conv1, conv2 = layers["conv1"], layers["conv2"]
    node = dict(gflops=20.0, bytes_per_s=125e6, rtt_s=1e-4)
    cluster = SimCluster(
        SimNode("master", **node), tuple(SimNode(f"w{i}", **node) for i in range(4))
    )
    shares = {"conv1": (150, 0, 0, 0, 0), "conv2": (160, 160, 160, 160, 160)}
    return conv1, conv2, cluster, shares


def test_the_masters_block_backward_runs_in_the_next_layers_phase():
    """The cost model: the master's backward of the replicated block falls in conv2's backward
    phase (beside the workers), not after it."""
    conv1, conv2, cluster, shares = _five_equal_nodes()
    step = simulate_step(
        cluster, [conv1, conv2], shares, 0.0, stages="fused", kernels="resident",
        replicate="first",
    )  # fmt: skip
    phases = {(p.layer, p.phase): p for p in step.phases}
    block_backward = cluster.master.conv_seconds(conv1, 150, conv1.passes("backward"))
    assert phases["conv1", "backward"].wall_s == 0.0
    assert phases["conv1", "forward"].wall_s > 0.0
    master_conv2 = cluster.master.conv_seconds(conv2, 160, conv2.passes("backward"))
    assert phases["conv2", "backward"].wall_s >= master_conv2 + block_backward - 1e-12
    alone = simulate_step(
        cluster, [conv1, conv2], shares, 0.0, stages="fused", kernels="resident",
        replicate="off",
    )  # fmt: skip
    assert {(p.layer, p.phase): p for p in alone.phases}["conv1", "backward"].wall_s > 0.0


def test_the_blocks_layers_after_its_convolution_run_inside_the_next_layers_phases():
    """The cost model: a replicated block's chain (``chains``, the master's other work that
    is not ``comp_s``) runs on the master in the block's forward and inside the next
    layer's backward, and on every worker's copy beside it: on equal nodes the step grows by
    the chain once (not once per node, nor between the calls), with its passes shared as the
    convolution's are. A fused stage's layers: each node runs its kernels' share of them."""
    conv1, conv2, cluster, shares = _five_equal_nodes()

    def step(chain_s):
        return simulate_step(
            cluster, [conv1, conv2], shares, 0.0, stages="fused", kernels="resident",
            replicate="first", chains={"conv1": chain_s},
        )  # fmt: skip

    without, with_chain = step(0.0), step(0.3)
    assert with_chain.step_s == pytest.approx(without.step_s + 0.3, abs=1e-6)
    before = {(p.layer, p.phase): p.wall_s for p in without.phases}
    after = {(p.layer, p.phase): p.wall_s for p in with_chain.phases}
    # conv1 has no input gradient: one pass each way, the chain halved between them
    assert after["conv1", "forward"] == pytest.approx(before["conv1", "forward"] + 0.15)
    assert after["conv2", "backward"] == pytest.approx(before["conv2", "backward"] + 0.15)
    assert after["conv2", "forward"] == pytest.approx(before["conv2", "forward"])
    assert with_chain.comp_s == 0.0
    # a fused stage's layers: every node its kernels' share of them (a fifth each here)
    fused = simulate_step(
        cluster, [conv1, conv2], shares, 0.0, stages="fused", kernels="resident",
        replicate="first", chains={"conv2": 0.5},
    )  # fmt: skip
    assert fused.step_s == pytest.approx(without.step_s + 0.1, abs=1e-6)


def test_a_nodes_block_is_scaled_by_the_next_layers_probe():
    """A node's whole block is the master's (its block probe x the measured factor) scaled by
    the node's speed on the next layer's long probe: a block probe twice as long on one of two
    equal nodes (what a short probe with a large output does from run to run) changes nothing;
    a node twice as slow on the next layer gets twice the block."""
    from types import SimpleNamespace

    from hetconv.master.replica import block_seconds

    master = SimpleNamespace(probe_seconds={"conv1": 0.8, "conv2": 33.0})
    noisy = SimpleNamespace(probe_seconds={"conv1": 1.6, "conv2": 33.0})
    slow = SimpleNamespace(probe_seconds={"conv1": 0.8, "conv2": 66.0})
    unprobed = SimpleNamespace(probe_seconds={"conv1": 1.6})
    assert block_seconds(master, master, "conv1", "conv2", 5.0) == pytest.approx(4.0)
    assert block_seconds(master, noisy, "conv1", "conv2", 5.0) == pytest.approx(4.0)
    assert block_seconds(master, slow, "conv1", "conv2", 5.0) == pytest.approx(8.0)
    assert block_seconds(master, unprobed, "conv1", "conv2", 5.0) == pytest.approx(8.0)


def test_a_trace_says_how_the_images_travelled_and_older_ones_sent_float32():
    layers = conv_layers(reference_spec(150, 800), 16)
    modes = {"conv1": "replicated", "conv2": "fused"}
    (old,) = replicas(layers, modes).values()  # before traces recorded it: float32
    (new,) = replicas(layers, modes, {"conv1": "palette8"}).values()
    assert old.name == new.name == "conv1"
    assert (old.images_fit, new.images_fit) == (False, True)
    assert old.images_bytes == 4 * 16 * 3 * 32 * 32
    assert new.images_bytes == 3 * 1024 + 16 * 3 * 32 * 32


def test_the_plan_counts_images_that_do_not_fit_palette8_as_float32():
    from dataclasses import replace

    from hetconv.master.probing import planned_layers

    specs = Model(reference_spec(150, 800)).conv_specs()
    floats = [replace(spec, images_fit=False) for spec in specs]
    for given, fit in ((specs, True), (floats, False)):
        assert [ly.images_fit for ly in planned_layers(given, 16)] == [fit, fit]
        block = ConvLayer.from_spec(given[0], 16)
        assert block.images_fit is fit
        assert block.images_bytes == (3 * 1024 + 16 * 3 * 32 * 32 if fit else 4 * 16 * 3 * 32 * 32)
