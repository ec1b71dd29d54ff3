"""Resident kernels in stages with batch norm, and of convolutions without bias.

A stage conv-bn-relu(-lrn)-maxpool keeps its kernel slices on the workers; the batch norm's
weight and bias stay with the master, travel with each call, and come back as gradients; the
batch statistics move the master's running statistics. A convolution without bias keeps its
zero bias exactly zero (workers never update it; nor do the master's rows, replay and syncs).
Real worker processes on loopback train a few steps as local training does (losses, weights,
running statistics, the evaluation after the last step, which normalises by the running ones),
also with a worker SIGKILLed mid-step (its slices' updates replayed on the master, batch norm
included), and each call moves the bytes the cost model counts.
"""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
from exactness import FAST, Killing

from hetconv.conv import LocalConv
from hetconv.costmodel import MBIT, SWITCHED, SimCluster, SimNode, step_modes
from hetconv.master.client import WorkerClient, WorkerError
from hetconv.master.cluster import Cluster, ClusterConfig
from hetconv.master.launch import LocalWorkers
from hetconv.modetable import ModeFlags, keeps_kernels, kernel_mode
from hetconv.optim import SGDConfig
from hetconv.resident import placement_version
from hetconv.stages import FUSED, BatchNormSlice, StageSpec
from hetconv.training import TrainConfig, train
from hetconv.training.checkpoint import POINTER_NAME, read_checkpoint
from hetconv.workload import conv_layers, network_layers, resident_call_bytes

# conv1 8 kernels without bias, batch norm; conv2 16 without bias, batch norm and a strong LRN
# (halo 2: the halo's batch norm rows matter), feeding the fc directly (a split head can take
# it). Shares smaller than the halo, none for the master on conv1.
SPEC = [
    {"type": "conv", "name": "conv1", "out": 8, "kernel": 3, "padding": 1, "bias": False},
    {"type": "batchnorm"},
    {"type": "relu"},
    {"type": "maxpool", "kernel": 2, "stride": 2},
    {"type": "conv", "name": "conv2", "out": 16, "kernel": 3, "padding": 1, "bias": False},
    {"type": "batchnorm"},
    {"type": "relu"},
    {"type": "lrn", "size": 5, "alpha": 1.0},
    {"type": "maxpool", "kernel": 2, "stride": 2},
    {"type": "fc", "name": "fc", "out": 10},
]
RUN = dict(steps=5, batch=8, train_size=40, eval_size=16, progress=False)
SHARES = {"conv1": (0, 1, 7), "conv2": (5, 9, 2)}
RESIDENT = dict(**FAST, shares=SHARES, stages="fused", kernels="resident")


def _train(tmp_path, name, executor, trace=None, **overrides):
    """:data:`RUN` of :data:`SPEC` through ``executor`` (``overrides`` replace RUN's settings):
    (losses, final evaluation, saved weights and running statistics by name)."""
    spec = tmp_path / "bn.json"
    spec.write_text(json.dumps(SPEC))
    weights = tmp_path / f"{name}.npz"
    run = {**RUN, **overrides}
    config = TrainConfig(preset=str(spec), save=str(weights), trace=trace, **run)
    result = train(config, executor, log=io.StringIO())
    return result.losses, (result.eval_loss, result.eval_accuracy), dict(np.load(weights))


def _same(got, want) -> None:
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, err_msg="losses")
    np.testing.assert_allclose(got[1][0], want[1][0], rtol=1e-5, err_msg="evaluation loss")
    assert got[1][1] == want[1][1]
    assert got[2].keys() == want[2].keys()
    assert "conv1.bias" not in got[2] and got[2]["batchnorm2.running_mean"].any()
    for name, value in want[2].items():
        np.testing.assert_allclose(got[2][name], value, rtol=0, atol=1e-5, err_msg=name)


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("local"), "local", LocalConv())


@pytest.fixture(scope="module")
def workers():
    with LocalWorkers(2) as started:
        yield started


def _steps(trace):
    return [json.loads(line) for line in trace.read_text().splitlines() if '"step"' in line]


def _zero_biases(cluster) -> None:
    """The bias-free layers' zero bias and momentum, on the master and on the workers."""
    momentum = cluster.gather_resident()
    assert "conv1.bias" not in momentum and "conv2.bias" not in momentum
    assert "conv1.weight" in momentum
    for name in ("conv1", "conv2"):
        layer = cluster.resident.layers[name]
        assert not layer.bias
        assert not layer.b.any() and not layer.mb.any(), name


@pytest.mark.parametrize("head", ["master", "split"])
def test_batchnorm_stages_with_resident_kernels_train_as_local(local, workers, tmp_path, head):
    trace = tmp_path / "trace.jsonl"
    config = ClusterConfig(**RESIDENT, head=head)
    with Cluster(workers.addresses, config=config) as cluster:
        got = _train(tmp_path, "resident", cluster, trace=str(trace))
        assert cluster.kernel_modes == {"conv1": "resident", "conv2": "resident"}
        assert bool(cluster.head_fcs) == (head == "split")
        _zero_biases(cluster)
    _same(got, local)
    steps = _steps(trace)
    assert len(steps) == RUN["steps"]
    # Placed once (step 0), never sent again: the kernels stayed on the workers.
    for name in SHARES:
        placed = [r["step"] for r in steps if "placed_bytes" in r.get("resident", {}).get(name, {})]
        assert placed == [0], name
    # Each call moved what the cost model counts for a resident call with batch norm.
    layers = {layer.name: layer for layer in conv_layers(SPEC, RUN["batch"])}
    classes = 10 if head == "split" else 0
    for record in steps:
        for name, shares in SHARES.items():
            offset, layer = shares[0], layers[name]
            assert layer.stage.batchnorms == 1 and not layer.bias
            for node, share in zip(workers.addresses, shares[1:], strict=True):
                for phase in ("forward", "backward"):
                    got_bytes = record["nodes"][node][name][phase]
                    split = classes if name == "conv2" else 0
                    want = resident_call_bytes(
                        layer, layer.stage, phase, share, offset, record["step"], head=split
                    )
                    assert got_bytes["bytes_sent"] == want.sent, (name, phase)
                    assert got_bytes["bytes_received"] == want.received, (name, phase)
                offset += share


def test_a_worker_killed_mid_step_is_replayed_with_its_batch_norm(local, tmp_path):
    trace = tmp_path / "trace.jsonl"
    with LocalWorkers(2) as started:
        victim = started.processes[1]
        # Synced at step 2; killed before conv2's backward at step 3: the master replays the
        # victim's conv1 and conv2 slices' update of step 2 (and covers step 3's pieces).
        config = dict(RESIDENT, resident_sync_every=2)
        with KillingResident(started.addresses, victim, 3, **config) as cluster:
            got = _train(tmp_path, "killed", cluster, trace=str(trace))
            lost = [e for e in cluster.events if e["event"] == "worker_lost"]
            _zero_biases(cluster)
    _same(got, local)
    assert [(e["worker"], e["step"]) for e in lost] == [(started.addresses[1], 3)]
    records = {r["step"]: r for r in _steps(trace)}
    assert records[3]["resident"]["conv2"]["replayed_steps"] == 1
    assert records[3]["resident"]["conv1"]["replayed_steps"] == 1


class KillingResident(Killing):
    BASE = RESIDENT


def test_checkpoints_gather_the_slices_and_a_resume_places_them_again(local, workers, tmp_path):
    """Checkpoints written with resident kernels hold what the same cluster sending its
    kernels holds (weights, running statistics, momentum: none for the missing biases); a run
    resumed from one places the slices again and ends as local training does."""
    runs = {}
    for kernels in ("sent", "resident"):
        config = ClusterConfig(**{**RESIDENT, "kernels": kernels})
        with Cluster(workers.addresses, config=config) as cluster:
            folder = str(tmp_path / kernels)
            runs[kernels] = _train(
                tmp_path, kernels, cluster, checkpoint_dir=folder, checkpoint_every=2
            )
    _same(runs["resident"], local)
    for step in (2, 4):
        sent = read_checkpoint(tmp_path / "sent" / f"ckpt-{step:08d}.npz")
        resident = read_checkpoint(tmp_path / "resident" / f"ckpt-{step:08d}.npz")
        assert "conv1.bias" not in resident.momentum and "conv1.weight" in resident.momentum
        for what in ("model", "momentum"):
            a, b = getattr(sent, what), getattr(resident, what)
            assert a.keys() == b.keys()
            for name in a:
                np.testing.assert_allclose(b[name], a[name], atol=1e-6, err_msg=f"{step} {name}")
    folder = tmp_path / "resumed"
    folder.mkdir()
    name = "ckpt-00000002.npz"
    (folder / name).write_bytes((tmp_path / "resident" / name).read_bytes())
    (folder / POINTER_NAME).write_text(f"{name}\n")
    with Cluster(workers.addresses, config=ClusterConfig(**RESIDENT)) as cluster:
        resumed = _train(tmp_path, "resumed", cluster, checkpoint_dir=str(folder), resume=True)
        _zero_biases(cluster)
    _same(resumed, local)


def test_keeps_kernels_allows_batch_norm_and_no_bias():
    layers = conv_layers(SPEC, 8)
    assert [keeps_kernels(layer, FUSED) for layer in layers] == [True, True]
    assert [keeps_kernels(layer, "unfused") for layer in layers] == [False, False]


def test_resident_bytes_count_the_batch_norm_rows():
    layer = conv_layers(SPEC, 8)[1]  # 16 kernels, batch norm, LRN halo 2
    plain = conv_layers([e for e in SPEC if e["type"] != "batchnorm"], 8)[1]
    share, offset = 4, 6
    wide = layer.stage.widened(slice(offset, offset + share), layer.kernels)
    forward = [
        resident_call_bytes(one, one.stage, "forward", share, offset) for one in (layer, plain)
    ]
    backward = [
        resident_call_bytes(one, one.stage, "backward", share, offset) for one in (layer, plain)
    ]
    # weight and bias of the widened slice out; batch mean and variance of the owned back
    assert forward[0].tensors_sent - forward[1].tensors_sent == 2 * 4 * (wide.stop - wide.start)
    assert forward[0].tensors_received - forward[1].tensors_received == 2 * 4 * share
    # weight and bias gradients of the owned back
    assert backward[0].tensors_received - backward[1].tensors_received == 2 * 4 * share
    assert backward[0].tensors_sent == backward[1].tensors_sent


def test_vgg11_keeps_kernels_where_the_cost_model_says_it_pays():
    # batch 64, 4 equal workers on a switched network, train's defaults (auto)
    layers = network_layers("vgg11", 64)
    flags = ModeFlags(stages="auto", kernels="auto")
    shares = {ly.name: (0, *[ly.kernels // 4] * 4) for ly in layers}
    modes = {ly.name: kernel_mode(flags, ly, FUSED, shares[ly.name]) for ly in layers}
    kept = [ly.name for ly in layers if modes[ly.name] == "resident"]
    assert kept, modes
    assert all(ly.stage.batchnorms and not ly.bias for ly in layers if ly.name in kept)
    workers = tuple(SimNode(f"w{i}", 60.0, bytes_per_s=1000 * MBIT) for i in range(4))
    cluster = SimCluster(SimNode("m", 60.0), workers, SWITCHED, 1e6)
    chosen = step_modes(cluster, layers, shares, stages="fused", kernels="auto")
    assert {name for name, mode in chosen.kernels.items() if mode == "resident"} == set(kept)


def _place(client, session, b, fixed_bias):
    w = np.ones((2, 3, 3, 3), np.float32)
    client.place_kernels(
        session, "conv1", 0, placement_version(1), w, b, np.zeros_like(w), np.zeros(2, np.float32),
        False, SGDConfig(lr=0.1), fixed_bias=fixed_bias,
    )  # fmt: skip


def test_a_worker_refuses_a_nonzero_fixed_bias_and_bad_batch_norm_rows(workers):
    client = WorkerClient(workers.addresses[0])
    try:
        with pytest.raises(WorkerError, match="fixed_bias is set .* b or mb is not zero"):
            _place(client, 7, np.array([0.0, 1.0], np.float32), True)
        _place(client, 7, np.zeros(2, np.float32), True)
        stage = StageSpec.from_entries([{"type": "batchnorm"}, {"type": "relu"}])
        x = np.ones((2, 3, 4, 4), np.float32)
        halo = np.empty((0, 3, 3, 3), np.float32), np.empty(0, np.float32)
        bad = BatchNormSlice(np.ones(3, np.float32), np.zeros(3, np.float32))  # 3 rows, not 2
        with pytest.raises(WorkerError, match=r"weight"):
            client.resident_stage_forward(
                7, 1, "conv1", x, *halo, 0, placement_version(1), (1, 1, 1, 1), stage, 2,
                batchnorm=[bad],
            )  # fmt: skip
        good = BatchNormSlice(np.ones(2, np.float32), np.zeros(2, np.float32))
        stats = np.empty((2, 2), np.float32)
        y, _ = client.resident_stage_forward(
            7, 1, "conv1", x, *halo, 0, placement_version(1), (1, 1, 1, 1), stage, 2,
            batchnorm=[good], stats_out=stats,
        )  # fmt: skip
        assert y.shape == (2, 2, 4, 4) and np.isfinite(stats).all()
        dbn = np.empty((2, 2), np.float32)
        client.resident_stage_backward(
            7, 1, "conv1", np.ones_like(y), 0, placement_version(1), False, dbn_out=dbn
        )
        fetched, _ = client.fetch_kernels(7, "conv1", placement_version(1) + 1)
        w, b, mw, mb = fetched[:4]
        assert not b.any() and not mb.any()  # the update skipped the fixed bias
        assert mw.any() and not np.array_equal(w, np.ones_like(w))
        assert np.isfinite(dbn).all() and dbn.any()  # batch norm's gradients came back
    finally:
        client.close()
