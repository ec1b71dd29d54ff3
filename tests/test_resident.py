"""Resident kernels: workers keep their kernel slices and SGD state between steps.

Real worker processes on loopback: a cluster with resident kernels (fused stages, a strong LRN
so a wrong halo would show) trains as local training does step by step, also when a worker
holding kernels is SIGKILLed mid-step (the master replays its slice's updates), when a worker
process is replaced between steps (its calls are refused, never computed with a slice it does
not hold), when the shares change mid-run (slices move), and across a checkpoint and resume;
checkpoints and ``--save`` gather the slices. A worker refuses a call naming a version it does
not hold, and bad PlaceKernels requests, naming what was wrong.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest
from exactness import FAST, RUN, STRONG_LRN, same_as_local, train_strong_lrn

from hetconv.balance import kernel_shares
from hetconv.calls import READY as READY_LINE
from hetconv.conv import LocalConv
from hetconv.costmodel import (
    MBIT,
    SWITCHED,
    SimCluster,
    SimNode,
    kernel_mode,
    layer_bytes,
    resident_layer_bytes,
    simulate_step,
)
from hetconv.formats import BFLOAT16, FLOAT32
from hetconv.master.client import WorkerClient, WorkerError
from hetconv.master.cluster import ACTIVE, READY, Cluster, ClusterConfig
from hetconv.master.launch import LocalWorkers
from hetconv.master.resident_jobs import as_received
from hetconv.optim import SGDConfig, sgd_update
from hetconv.resident import edge_rows, placement_version
from hetconv.simulations.calibrate import calibrate
from hetconv.stages import StageSpec
from hetconv.training import TrainConfig, train
from hetconv.training.checkpoint import POINTER_NAME, read_checkpoint
from hetconv.workload import conv_layers, network_layers, resident_call_bytes

# tiny: conv1 8 kernels, conv2 16; LRN size 5 (halo 4). Shares smaller than the halo, a node
# with none (the master on conv1), uneven.
SHARES = {"conv1": (0, 1, 7), "conv2": (5, 9, 2)}
RESIDENT = dict(**FAST, shares=SHARES, stages="fused", kernels="resident")


def test_sgd_on_slices_is_bitwise_the_whole_update():
    rng = np.random.default_rng(0)
    config = SGDConfig(lr=0.1, momentum=0.9, weight_decay=5e-4)
    whole = rng.standard_normal((7, 3)).astype(np.float32)
    parts = [whole[:2].copy(), whole[2:].copy()]
    buf = bufs = None
    for _ in range(3):
        g = rng.standard_normal((7, 3)).astype(np.float32)
        buf = sgd_update(whole, g, buf, config)
        bufs = [
            sgd_update(p, g[s], None if bufs is None else bufs[i], config)
            for i, (p, s) in enumerate(zip(parts, (slice(0, 2), slice(2, 7)), strict=True))
        ]
    np.testing.assert_array_equal(np.concatenate(parts), whole)
    np.testing.assert_array_equal(np.concatenate(bufs), buf)


def test_edge_rows():
    assert list(edge_rows(3, 4)) == [0, 1, 2]
    assert list(edge_rows(8, 4)) == list(range(8))
    assert list(edge_rows(10, 2)) == [0, 1, 8, 9]


def test_resident_cluster_trains_as_local(local, workers, tmp_path):
    trace = tmp_path / "trace.jsonl"
    with Cluster(workers.addresses, config=ClusterConfig(**RESIDENT)) as cluster:
        got = train_strong_lrn(tmp_path, "resident", cluster, trace=str(trace))
    same_as_local(got, local)
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    plan = records[0]
    assert plan["kernels"] == "resident"
    assert plan["kernel_modes"] == {"conv1": "resident", "conv2": "resident"}
    steps = [r for r in records if "step" in r]
    assert all(r["kernel_modes"] == {"conv1": "resident", "conv2": "resident"} for r in steps)
    # The workers computed (no silent fallback): conv2's worker 1 held 9 kernels every step.
    assert all(r["nodes"][workers.addresses[0]]["conv2"]["kernels"] == 9 for r in steps)
    # Placed once (step 0), synced at step 20 only: no other kernel bytes crossed.
    placed = [r["step"] for r in steps if "placed_bytes" in r.get("resident", {}).get("conv2", {})]
    assert placed == [0]
    # Each call moved what the cost model counts for a resident call.
    layers = {layer.name: layer for layer in conv_layers(STRONG_LRN, RUN["batch"])}
    for record in steps:
        for name, shares in SHARES.items():
            offset = shares[0]
            for node, share in zip(workers.addresses, shares[1:], strict=True):
                for phase in ("forward", "backward"):
                    got = record["nodes"][node][name][phase]
                    layer = layers[name]
                    want = resident_call_bytes(
                        layer, layer.stage, phase, share, offset, record["step"]
                    )
                    assert got["bytes_sent"] == want.sent, (name, phase)
                    assert got["bytes_received"] == want.received, (name, phase)
                offset += share


class Disturbed(Cluster):
    """Runs ``actions[(step, layer)]`` just before that layer's stage forward in training
    (layer None: before the step begins)."""

    def __init__(self, addresses, actions, **config):
        super().__init__(addresses, config=ClusterConfig(**{**RESIDENT, **config}))
        self.actions = actions

    def begin_step(self, step):
        action = self.actions.get((step, None))
        if action:
            action(self)
        super().begin_step(step)

    def stage_forward(self, layer, x, w, b, padding, stage, batchnorm=()):
        action = self.actions.get((self.step, layer))
        if action and x.shape[0] == RUN["batch"]:
            action(self)
        return super().stage_forward(layer, x, w, b, padding, stage, batchnorm)


def _steps(trace):
    return [json.loads(line) for line in trace.read_text().splitlines() if '"step"' in line]


def test_worker_killed_while_holding_kernels_stays_exact(local, tmp_path):
    trace = tmp_path / "trace.jsonl"
    with LocalWorkers(2) as started:
        victim = started.processes[1]

        def kill(cluster):
            victim.kill()  # SIGKILL: its slices and their momentum die with it
            victim.wait()

        # Synced at step 3; killed after conv1's forward at step 5: conv1's backward and
        # conv2's forward fail, and the master replays both slices' updates of steps 3 and 4.
        with Disturbed(started.addresses, {(5, "conv2"): kill}, resident_sync_every=3) as cluster:
            got = train_strong_lrn(tmp_path, "killed", cluster, trace=str(trace))
            lost = [e for e in cluster.events if e["event"] == "worker_lost"]
    same_as_local(got, local)
    assert [(e["worker"], e["step"]) for e in lost] == [(started.addresses[1], 5)]
    records = {r["step"]: r for r in _steps(trace)}
    # Synced at step 3 (fetched, not placed again), not before.
    assert [
        s for s in range(5) if "fetched_bytes" in records[s].get("resident", {}).get("conv2", {})
    ] == [3]
    assert "placed_bytes" not in records[3]["resident"]["conv2"]
    assert records[5]["resident"]["conv1"]["replayed_steps"] == 2
    assert records[5]["resident"]["conv2"]["replayed_steps"] == 2
    # From step 6 the survivor's slices moved (the shares changed): fetched, placed again.
    assert records[6]["resident"]["conv2"]["fetched_bytes"] > 0
    assert records[6]["resident"]["conv2"]["placed_bytes"] > 0


def test_worker_joining_moves_slices_without_loss(local, tmp_path):
    listing = tmp_path / "workers.txt"
    trace = tmp_path / "trace.jsonl"
    with LocalWorkers(2) as started:
        first, second = started.addresses
        listing.write_text(f"{first}\n")

        def add(cluster):
            listing.write_text(f"{first}\n{second}\n")
            os.utime(listing, (time.time() + 5, time.time() + 5))  # an mtime surely new
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                if any(n.name == second for n in cluster.nodes + cluster._pending):
                    if any(
                        n.name == second and n.state in (READY, ACTIVE)
                        for n in cluster.nodes + cluster._pending
                    ):
                        return
                time.sleep(0.05)
            raise AssertionError(f"{second} did not join")

        with Disturbed(
            [first], {(4, None): add}, shares=None, workers_file=str(listing), settle_steps=0
        ) as cluster:  # (no settling: the split the join made is the one checked)
            got = train_strong_lrn(tmp_path, "joined", cluster, trace=str(trace))
            shares = cluster.plans["conv2"].shares
    same_as_local(got, local)
    assert shares[2] > 0
    records = {r["step"]: r for r in _steps(trace)}
    assert records[4]["nodes"][second]["conv2"]["kernels"] == shares[2]
    assert records[4]["resident"]["conv2"]["placed_bytes"] > 0


def test_checkpoints_and_save_gather_the_slices(local, workers, tmp_path):
    """A checkpoint (weights and momentum) and --save written with resident kernels equal
    bitwise those of the same cluster sending its kernels, at the same step; a resumed
    resident run places the slices again and ends as local training does."""
    fused = dict(**FAST, shares=SHARES, stages="fused")
    runs = {}
    for kernels in ("sent", "resident"):
        folder = tmp_path / kernels
        with Cluster(workers.addresses, config=ClusterConfig(**fused, kernels=kernels)) as c:
            runs[kernels] = train_strong_lrn(
                tmp_path, kernels, c, checkpoint_dir=str(folder), checkpoint_every=7
            )
    same_as_local(runs["resident"], local)
    for name, value in runs["sent"][1].items():  # --save
        np.testing.assert_array_equal(runs["resident"][1][name], value, err_msg=name)
    for step in (7, 14, 20):
        sent = read_checkpoint(tmp_path / "sent" / f"ckpt-{step:08d}.npz")
        resident = read_checkpoint(tmp_path / "resident" / f"ckpt-{step:08d}.npz")
        for what in ("model", "momentum"):
            a, b = getattr(sent, what), getattr(resident, what)
            assert a.keys() == b.keys()
            for name in a:
                np.testing.assert_array_equal(b[name], a[name], err_msg=f"{step} {what} {name}")
    # Resumed from step 7 with resident kernels: placed again from the checkpoint.
    folder = tmp_path / "resumed"
    folder.mkdir()
    for path in (tmp_path / "resident").glob("ckpt-00000007.npz"):
        (folder / path.name).write_bytes(path.read_bytes())
    (folder / POINTER_NAME).write_text("ckpt-00000007.npz\n")
    with Cluster(workers.addresses, config=ClusterConfig(**RESIDENT)) as cluster:
        resumed = train_strong_lrn(
            tmp_path, "resumed", cluster, checkpoint_dir=str(folder), resume=True
        )
    same_as_local(resumed, local)


LRN_POOL = StageSpec.from_entries(
    [{"type": "relu"}, {"type": "lrn", "size": 5, "alpha": 1.0}, {"type": "maxpool"}]
)
PADDING = (2, 2, 2, 2)


def _slice(k=4, c=3):
    rng = np.random.default_rng(2)
    w = rng.standard_normal((k, c, 5, 5)).astype(np.float32)
    b = rng.standard_normal(k).astype(np.float32)
    return w, b, np.zeros_like(w), np.zeros_like(b)


def test_a_stale_version_is_refused_never_computed(workers):
    client = WorkerClient(workers.addresses[0])
    session, version = 77, placement_version(1)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 3, 8, 8)).astype(np.float32)
    halo = np.zeros((2, 3, 5, 5), np.float32), np.zeros(2, np.float32)
    try:
        client.place_kernels(session, "conv9", 2, version, *_slice(), False, SGDConfig())

        def forward(v, step=1):
            return client.resident_stage_forward(
                session, step, "conv9", x, *halo, 2, v, PADDING, LRN_POOL, 4
            )

        y, _ = forward(version)
        assert y.shape == (2, 4, 4, 4)
        dy = np.ones((2, 6, 4, 4), np.float32)
        _, ew, eb, _ = client.resident_stage_backward(session, 1, "conv9", dy, 0, version, True)
        assert ew.shape == (4, 3, 5, 5) and eb.shape == (4,)  # 4 kernels: all are edges
        # The worker now holds version + 1: the old version is refused, naming both.
        for call in (
            lambda: forward(version, step=2),
            lambda: client.fetch_kernels(session, "conv9", version),
            lambda: client.resident_stage_backward(session, 1, "conv9", dy, 0, version, True),
        ):
            with pytest.raises(
                WorkerError,
                match=r"names slice version 1\.0, this worker "
                r"holds version 1\.1",
            ) as caught:
                call()
            assert caught.value.code == grpc.StatusCode.FAILED_PRECONDITION
        (w, b, mw, mb, f, mf), _ = client.fetch_kernels(session, "conv9", version + 1)
        assert f.shape == mf.shape == (4, 0, 0)  # no split head
        np.testing.assert_array_equal(w[edge_rows(4, 4)], ew)
        assert np.any(mw != 0)  # the momentum started
        with pytest.raises(WorkerError, match="no resident slice for this session") as caught:
            client.fetch_kernels(session + 1, "conv9", version)
        assert caught.value.code == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        client.close()


class _Settings:
    """Optimizer settings as a master could send them (SGDConfig refuses bad ones itself)."""

    def __init__(self, lr=0.01, momentum=0.9, weight_decay=5e-4):
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay


@pytest.mark.parametrize(
    "arrays, version, settings, message",
    [
        (_slice(), 0, _Settings(), "resident.version is 0"),
        (_slice(), 1, _Settings(lr=0.0), "optimizer settings: learning rate must be positive"),
        (_slice(), 1, _Settings(momentum=1.0), "optimizer settings: momentum must be in"),
        (_slice()[:3] + (np.zeros(3, np.float32),), 1, _Settings(), r"mb \(3,\) must match"),
        (
            (np.full((4, 3, 5, 5), np.nan, np.float32), *_slice()[1:]),
            1,
            _Settings(),
            "w or b holds NaN or Inf",
        ),
    ],
)
def test_bad_place_kernels_requests_are_refused(workers, arrays, version, settings, message):
    client = WorkerClient(workers.addresses[0])
    try:
        with pytest.raises(WorkerError, match=message) as caught:
            client.place_kernels(5, "conv9", 0, version, *arrays, False, settings)
        assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
        client.place_kernels(5, "conv9", 0, 1, *_slice(), False, SGDConfig())  # still serving
    finally:
        client.close()


def test_the_replay_log_keeps_what_a_16_bit_wire_delivered():
    x = np.random.default_rng(4).standard_normal((2, 3, 4, 4)).astype(np.float32)
    kept = as_received(x, BFLOAT16)
    np.testing.assert_array_equal(kept, BFLOAT16.decode(b"".join(BFLOAT16.encode(x)), x.shape))
    assert not np.array_equal(kept, x)
    assert np.array_equal(as_received(x, FLOAT32), x) and as_received(x, FLOAT32) is not x


def test_cost_model_and_simulator_count_resident_kernels():
    layers = network_layers("paper-500-1500", 16)
    shares = {layer.name: kernel_shares(layer.kernels, [1.0] * 5) for layer in layers}
    for layer in layers:
        split = shares[layer.name]
        assert kernel_mode(layer, layer.stage, split) == "resident"
        assert kernel_mode(layer, None, split) == "sent"
        assert resident_layer_bytes(layer, split) < layer_bytes(layer, split, True)
    workers = tuple(SimNode(f"w{i}", 100.0, bytes_per_s=MBIT * 100) for i in range(4))
    cluster = SimCluster(SimNode("master", 100.0), workers, SWITCHED, medium_bytes_per_s=MBIT * 100)
    fused = simulate_step(cluster, layers, shares, 0.1, "fused")
    resident = simulate_step(cluster, layers, shares, 0.1, "fused", "resident")
    auto = simulate_step(cluster, layers, shares, 0.1, "fused", "auto")
    assert resident.bytes == auto.bytes < fused.bytes
    assert resident.comm_s < fused.comm_s  # fewer bytes on a 100 Mbit/s link
    want = sum(resident_layer_bytes(layer, shares[layer.name]) for layer in layers)
    assert resident.bytes == pytest.approx(want, rel=1e-6)
    # Unfused layers keep nothing: resident asks nothing of them.
    unfused = simulate_step(cluster, layers, shares, 0.1, "unfused")
    assert simulate_step(cluster, layers, shares, 0.1, "unfused", "resident").bytes == unfused.bytes
    with pytest.raises(ValueError, match="kernels 'kept'; expected resident, sent or auto"):
        simulate_step(cluster, layers, shares, 0.1, "fused", "kept")


def test_bad_kernel_modes_are_refused():
    with pytest.raises(ValueError, match="kernels 'local'; expected one of resident, sent, auto"):
        ClusterConfig(kernels="local")
    with pytest.raises(ValueError, match="resident sync interval must be >= 0 steps, got -1"):
        ClusterConfig(resident_sync_every=-1)


def test_a_resident_trace_calibrates_the_simulator(workers, tmp_path):
    trace = tmp_path / "trace.jsonl"
    with Cluster(workers.addresses, config=ClusterConfig(**RESIDENT)) as cluster:
        train_strong_lrn(tmp_path, "traced", cluster, trace=str(trace), steps=4)
    cal = calibrate(str(trace), str(tmp_path / "strong-lrn.json"))
    assert cal.kernel_modes == {"conv1": "resident", "conv2": "resident"}
    assert cal.check()["step_s"] > 0


def test_a_worker_restarted_between_steps_is_refused_then_replayed(local, tmp_path):
    """A worker process replaced on the same port between two steps holds no slice: its
    first call is refused (FAILED_PRECONDITION), never computed with whatever it has; the
    master replays the slice and covers it (it is retried like any lost worker)."""
    with LocalWorkers(2) as started:
        address = started.addresses[1]
        port = address.rsplit(":", 1)[1]
        replacement = []

        def restart(cluster):
            started.processes[1].kill()
            started.processes[1].wait()
            process = subprocess.Popen(
                [sys.executable, "-I", "-m", "hetconv", "worker", "--listen",
                 f"127.0.0.1:{port}", "--backend", "cpu", "--no-startup-probe"],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            )  # fmt: skip
            replacement.append(process)
            for line in process.stdout:
                if line.startswith(READY_LINE):
                    break

        try:
            with Disturbed(started.addresses, {(4, None): restart}) as cluster:
                got = train_strong_lrn(tmp_path, "restarted", cluster)
                events = cluster.events
        finally:
            for process in replacement:
                process.terminate()
                process.wait(10)
    same_as_local(got, local)
    lost = [e for e in events if e["event"] == "worker_lost"]
    assert [(e["worker"], e["step"]) for e in lost] == [(address, 4)]
    assert "FAILED_PRECONDITION" in lost[0]["reason"]
    assert "no resident slice for this session" in lost[0]["reason"]


def test_a_strided_convolution_keeps_sending_its_kernels(workers, tmp_path):
    """A strided convolution runs as the stride-1 one of its phases, whose kernels the model
    rearranges each step: such a layer sends its kernels; the others stay resident."""
    strided = [dict(e) for e in STRONG_LRN]
    strided[0]["stride"] = 2
    spec = tmp_path / "strided.json"
    spec.write_text(json.dumps(strided))
    run = dict(RUN, steps=6, preset=str(spec))
    want = train(TrainConfig(save=str(tmp_path / "local.npz"), **run), LocalConv(), io.StringIO())
    config = ClusterConfig(**{**RESIDENT, "shares": None})
    with Cluster(workers.addresses, config=config) as cluster:
        got = train(TrainConfig(save=str(tmp_path / "c.npz"), **run), cluster, io.StringIO())
        assert cluster.kernel_modes == {"conv1": "sent", "conv2": "resident"}
    same_as_local(
        (got.losses, dict(np.load(tmp_path / "c.npz"))),
        (want.losses, dict(np.load(tmp_path / "local.npz"))),
    )


class RedoneAt(Cluster):
    """Asks for step ``at`` to be computed again once, as when a spot check catches a worker
    in a layer that sends its kernels (the resident layers' first-pass updates are undone)."""

    def __init__(self, addresses, at, **config):
        super().__init__(addresses, config=ClusterConfig(**{**RESIDENT, **config}))
        self.at, self.redone = at, 0

    def redo_step(self):
        if self.step == self.at and not self.redone:
            self.redone += 1
            self.resident.undo_step(self.step)
            return True
        return super().redo_step()


def test_a_step_computed_again_undoes_the_resident_updates(local, workers, tmp_path):
    trace = tmp_path / "trace.jsonl"
    with RedoneAt(workers.addresses, 4, resident_sync_every=3) as cluster:
        got = train_strong_lrn(tmp_path, "redone", cluster, trace=str(trace))
        assert cluster.redone == 1
    same_as_local(got, local)
    records = {r["step"]: r for r in _steps(trace)}
    # Undone by replay on the master (each of the two slices: step 3 of its log, synced at 3),
    # then placed again for the second pass.
    assert records[4]["resident"]["conv2"]["replayed_steps"] == 2
    assert records[4]["resident"]["conv2"]["placed_bytes"] > 0
