"""Fused worker stages: a conv slice plus the channel-local layers after it, on one node.

First the stage code alone (numpy, no processes): forward and backward on uneven kernel slices,
with LRN halos, equal the whole layers run one after another. Then real worker processes: a
cluster in fused mode trains exactly as local training does, also when a worker dies mid-run,
and a worker refuses bad stage descriptions naming the problem.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys

import grpc
import numpy as np
import pytest
from exactness import FAST, RUN, STRONG_LRN, same_as_local, train_strong_lrn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hetconv.backends import get_backend
from hetconv.balance import kernel_shares, offsets
from hetconv.cli import main as cli_main
from hetconv.conv import LocalConv
from hetconv.layers import BatchNorm2d, batch_statistics
from hetconv.master import client as client_module
from hetconv.master.client import WorkerClient, WorkerError
from hetconv.master.cluster import Cluster, ClusterConfig
from hetconv.master.launch import LocalWorkers
from hetconv.proto import worker_pb2 as pb
from hetconv.simulations.calibrate import calibrate
from hetconv.stages import (
    STAGE_MODES,
    BatchNormSlice,
    StageOp,
    StageSpec,
    ops_to_proto,
    spec_from_proto,
    stage_backward,
    stage_forward,
    stage_of,
)
from hetconv.training import TrainConfig, train
from hetconv.workload import conv_layers, network_layers, stage_call_bytes

PADDING = (2, 2, 2, 2)

CHAINS = {
    "relu-lrn-pool": [{"type": "relu"}, {"type": "lrn", "size": 5}, {"type": "maxpool"}],
    "relu-pool": [{"type": "relu"}, {"type": "maxpool", "kernel": 3, "stride": 2}],
    "lrn4": [{"type": "lrn", "size": 4, "alpha": 0.5, "beta": 0.6, "k": 2.0}],
    "pool-then-lrn": [{"type": "maxpool"}, {"type": "lrn", "size": 3, "alpha": 0.5}],
    "two-lrn": [
        {"type": "lrn", "size": 3, "alpha": 0.3},
        {"type": "relu"},
        {"type": "lrn", "size": 5, "alpha": 0.2},
        {"type": "maxpool"},
    ],
}
# Kernels per node (master first): uneven, shares smaller than the halo, a node with none.
SPLITS = [(5, 7, 1, 0, 4), (1, 1, 15), (0, 17), (2, 3, 2, 0, 6, 4)]


def _whole(backend, x, w, b, spec: StageSpec, dy):
    """The layers one after another on every channel: what local training computes."""
    y_conv = backend.conv_forward(x, w, b, PADDING)
    layers = spec.build("whole")
    a = y_conv
    for layer in layers:
        a = layer.forward(a)
    g = dy
    for layer in reversed(layers):
        g = layer.backward(g)
    dw, db = backend.conv_grad_kernels(x, g, w.shape[2:], PADDING)
    dx = backend.conv_grad_input(g, w, x.shape[2:], PADDING)
    return a, dx, dw, db


def _pieces(backend, x, w, b, spec: StageSpec, dy, shares, halo=None):
    """Every node's stage on its slice, reassembled as the master does."""
    k = w.shape[0]
    ys, dws, dbs, dx = [], [], [], np.zeros_like(x)
    for start, share in zip(offsets(shares), shares, strict=True):
        if not share:
            continue
        own = slice(start, start + share)
        wide = spec.widened(own, k)
        if halo is not None:  # a narrower halo than the stage asks for (must fail)
            wide = slice(max(own.start - halo, 0), min(own.stop + halo, k))
        grad = spec.grad_range(own, k)
        grad = slice(max(grad.start, wide.start), min(grad.stop, wide.stop))
        rel_own = slice(own.start - wide.start, own.stop - wide.start)
        y, run = stage_forward(backend, x, w[wide], b[wide], PADDING, spec, rel_own)
        rel_grad = slice(grad.start - wide.start, grad.stop - wide.start)
        part, dw, db = stage_backward(backend, run, dy[:, grad], rel_grad, True)
        ys.append(y)
        dws.append(dw)
        dbs.append(db)
        dx += part
    return np.concatenate(ys, axis=1), dx, np.concatenate(dws), np.concatenate(dbs)


@pytest.fixture(scope="module")
def case():
    rng = np.random.default_rng(7)
    x = rng.standard_normal((3, 4, 8, 8)).astype(np.float32)
    w = rng.standard_normal((17, 4, 5, 5)).astype(np.float32) * 0.3
    b = rng.standard_normal(17).astype(np.float32) * 0.1
    return x, w, b


@pytest.mark.parametrize("shares", SPLITS)
@pytest.mark.parametrize("chain", sorted(CHAINS))
def test_stage_slices_equal_the_whole_layers(case, chain, shares):
    backend = get_backend("cpu")
    x, w, b = case
    spec = StageSpec.from_entries(CHAINS[chain])
    out_hw = spec.output_hw((8, 8))
    dy = np.random.default_rng(3).standard_normal((3, 17, *out_hw)).astype(np.float32)
    want = _whole(backend, x, w, b, spec, dy)
    got = _pieces(backend, x, w, b, spec, dy, shares)
    for name, g, e in zip(("y", "dx", "dw", "db"), got, want, strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("chain", ["relu-lrn-pool", "lrn4", "two-lrn", "pool-then-lrn"])
def test_a_narrower_halo_is_not_exact(case, chain):
    """The halo is needed: one channel less on each side changes the gradients (a strong
    normalisation, alpha 1, so the difference shows above round-off)."""
    backend = get_backend("cpu")
    x, w, b = case
    entries = [{**e, "alpha": 1.0} if e["type"] == "lrn" else e for e in CHAINS[chain]]
    spec = StageSpec.from_entries(entries)
    dy = np.random.default_rng(3).standard_normal((3, 17, *spec.output_hw((8, 8))))
    dy = dy.astype(np.float32)
    want = _whole(backend, x, w, b, spec, dy)
    got = _pieces(backend, x, w, b, spec, dy, (5, 6, 6), halo=spec.halo - 1)
    assert not all(np.allclose(g, e, rtol=1e-5, atol=1e-5) for g, e in zip(got, want, strict=True))


def test_halo_sizes():
    assert StageSpec.from_entries(CHAINS["relu-lrn-pool"]).halo == 4  # 2 * (5 // 2)
    assert StageSpec.from_entries(CHAINS["relu-lrn-pool"]).grad_reach == (2, 2)
    assert StageSpec.from_entries(CHAINS["lrn4"]).halo == 3
    assert StageSpec.from_entries(CHAINS["lrn4"]).grad_reach == (1, 2)
    assert StageSpec.from_entries(CHAINS["relu-pool"]).halo == 0
    spec = StageSpec.from_entries(CHAINS["relu-lrn-pool"])
    assert spec.widened(slice(3, 5), 17) == slice(0, 9)
    assert spec.widened(slice(14, 17), 17) == slice(10, 17)


def test_stage_of_takes_the_channel_local_run():
    entries = [{"type": "relu"}, {"type": "maxpool"}, {"type": "conv", "out": 3}, {"type": "relu"}]
    assert stage_of(entries) == StageSpec((StageOp("relu"), StageOp("maxpool", kernel=2, stride=2)))
    assert stage_of([{"type": "fc", "out": 3}]) is None


@pytest.mark.parametrize(
    "op, message",
    [
        (dict(kind="softmax"), "kind 'softmax'"),
        (dict(kind="lrn", size=0), "size must be >= 1"),
        (dict(kind="lrn", size=3, alpha=float("nan")), "alpha must be finite"),
        (dict(kind="maxpool", kernel=0, stride=1), "must be >= 1"),
    ],
)
def test_bad_stage_ops_are_refused(op, message):
    with pytest.raises(ValueError, match=message):
        StageOp(**op)


# -- batch norm in a stage --------------------------------------------------------------------

BN_CHAINS = {
    "bn-relu-pool": [
        {"type": "batchnorm", "eps": 1e-3, "momentum": 0.3},
        {"type": "relu"},
        {"type": "maxpool"},
    ],
    # halo channels are batch-normalised too: the LRN after it reads them
    "bn-lrn": [{"type": "batchnorm"}, {"type": "lrn", "size": 5, "alpha": 1.0}],
    "relu-bn-gap-bn": [
        {"type": "relu"},
        {"type": "batchnorm", "momentum": 0.5},
        {"type": "gap"},
        {"type": "batchnorm", "eps": 0.1},
    ],
}


def _bn_layers(spec: StageSpec, k: int, training: bool, rng) -> list[BatchNorm2d]:
    """The whole model's batch norm layers of ``spec``: random parameters and statistics."""
    out = []
    for i, op in enumerate(o for o in spec.ops if o.kind == "batchnorm"):
        layer = BatchNorm2d(f"bn{i}", k, op.eps, op.momentum)
        layer.params["weight"][...] = rng.uniform(0.5, 1.5, k)
        layer.params["bias"][...] = rng.standard_normal(k) * 0.2
        layer.buffers["running_mean"][...] = rng.standard_normal(k) * 0.3
        layer.buffers["running_var"][...] = rng.uniform(0.5, 2.0, k)
        layer.training = training
        out.append(layer)
    return out


@pytest.mark.parametrize("training", [True, False], ids=["training", "eval"])
@pytest.mark.parametrize("shares", SPLITS)
@pytest.mark.parametrize("chain", sorted(BN_CHAINS))
def test_batchnorm_stage_slices_equal_the_whole_layers(case, chain, shares, training):
    """Every node's stage with batch norm on its (widened) slice gives the whole layers'
    output and gradients, batch norm's weight and bias gradients of its owned channels, and
    batch statistics from which ``track`` moves the running statistics bit for bit as the
    whole layer's forward does."""
    backend = get_backend("cpu")
    x, w, b = case
    k = w.shape[0]
    spec = StageSpec.from_entries(BN_CHAINS[chain])
    dy = np.random.default_rng(3).standard_normal((3, k, *spec.output_hw((8, 8))))
    dy = dy.astype(np.float32)
    whole_bns = _bn_layers(spec, k, training, np.random.default_rng(5))
    master_bns = _bn_layers(spec, k, training, np.random.default_rng(5))  # the master's copy

    # the whole layers, as local training runs them
    a = backend.conv_forward(x, w, b, PADDING)
    layers = spec.build("whole", k)
    bn_at = iter(whole_bns)
    layers = [next(bn_at) if isinstance(layer, BatchNorm2d) else layer for layer in layers]
    for layer in layers:
        a = layer.forward(a)
    g = dy
    for layer in reversed(layers):
        g = layer.backward(g)
    want_dw, want_db = backend.conv_grad_kernels(x, g, w.shape[2:], PADDING)
    want_dx = backend.conv_grad_input(g, w, x.shape[2:], PADDING)

    ys, dws, dbs, dx = [], [], [], np.zeros_like(x)
    bn_grads = [([], []) for _ in master_bns]
    for start, share in zip(offsets(shares), shares, strict=True):
        if not share:
            continue
        own = slice(start, start + share)
        wide = spec.widened(own, k)
        grad = spec.grad_range(own, k)
        rel_own = slice(own.start - wide.start, own.stop - wide.start)
        slices = [
            BatchNormSlice(
                bn.params["weight"][wide].copy(),
                bn.params["bias"][wide].copy(),
                training,
                None if training else bn.buffers["running_mean"][wide].copy(),
                None if training else bn.buffers["running_var"][wide].copy(),
            )
            for bn in master_bns
        ]
        y, run = stage_forward(backend, x, w[wide], b[wide], PADDING, spec, rel_own, slices)
        stats = run.batch_statistics()
        assert len(stats) == (len(master_bns) if training else 0)
        for bn, (mean, var, count) in zip(master_bns, stats, strict=False):
            bn.track(mean, var, count, own)
        rel_grad = slice(grad.start - wide.start, grad.stop - wide.start)
        part, dw, db = stage_backward(backend, run, dy[:, grad], rel_grad, True)
        for (dgammas, dbetas), (dgamma, dbeta) in zip(bn_grads, run.batchnorm_grads(), strict=True):
            dgammas.append(dgamma)
            dbetas.append(dbeta)
        ys.append(y)
        dws.append(dw)
        dbs.append(db)
        dx += part
    got = [np.concatenate(ys, axis=1), dx, np.concatenate(dws), np.concatenate(dbs)]
    for name, g, e in zip(
        ("y", "dx", "dw", "db"), got, [a, want_dx, want_dw, want_db], strict=True
    ):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-5, err_msg=name)
    for whole, master, (dgammas, dbetas) in zip(whole_bns, master_bns, bn_grads, strict=True):
        # the slice's convolution may round differently (another GEMM shape) in the last
        # bit; from the same values the statistics are bitwise equal (the test below)
        for name in ("running_mean", "running_var"):
            np.testing.assert_allclose(
                master.buffers[name], whole.buffers[name], rtol=1e-6, atol=1e-6, err_msg=name
            )
        np.testing.assert_allclose(np.concatenate(dgammas), whole.grads["weight"], atol=1e-5)
        np.testing.assert_allclose(np.concatenate(dbetas), whole.grads["bias"], atol=1e-5)


@pytest.mark.parametrize("shares", SPLITS)
def test_batch_statistics_of_slices_track_bitwise(shares):
    """From the same values, each slice's batch statistics moved into the running statistics
    by ``track`` give exactly what the whole layer's training forward gives."""
    rng = np.random.default_rng(11)
    a = (rng.standard_normal((5, 17, 6, 7)) * 3 + 1).astype(np.float32)
    whole = BatchNorm2d("whole", 17, momentum=0.3)
    master = BatchNorm2d("master", 17, momentum=0.3)
    for bn in (whole, master):
        bn.buffers["running_mean"][...] = np.arange(17, dtype=np.float32) / 7
    whole.forward(a)
    for start, share in zip(offsets(shares), shares, strict=True):
        if share:
            own = slice(start, start + share)
            mean, var, _ = batch_statistics(np.ascontiguousarray(a[:, own]))
            master.track(mean, var, 5 * 6 * 7, own)
    master.buffers["num_batches_tracked"] += 1
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        np.testing.assert_array_equal(master.buffers[name], whole.buffers[name], name)
    with pytest.raises(ValueError, match=r"shapes \(3,\) and \(3,\) for 2 channels"):
        master.track(np.zeros(3), np.zeros(3), 4, slice(0, 2))


def test_batchnorm_stage_parameters_are_checked(case):
    backend = get_backend("cpu")
    x, w, b = case
    spec = StageSpec.from_entries(BN_CHAINS["bn-relu-pool"])
    ones, zeros = np.ones(17, np.float32), np.zeros(17, np.float32)
    with pytest.raises(ValueError, match="1 batch norm layers but 0"):
        stage_forward(backend, x, w, b, PADDING, spec, slice(0, 17))
    with pytest.raises(ValueError, match=r"bias is float32 \(16,\), expected float32 \(17,\)"):
        stage_forward(
            backend, x, w, b, PADDING, spec, slice(0, 17), [BatchNormSlice(ones, zeros[:16])]
        )
    with pytest.raises(ValueError, match="evaluation needs its running_mean"):
        stage_forward(
            backend, x, w, b, PADDING, spec, slice(0, 17), [BatchNormSlice(ones, zeros, False)]
        )
    # the wire carries batch norm's options
    assert spec_from_proto(ops_to_proto(spec)) == spec
    with pytest.raises(ValueError, match="eps must be finite and > 0"):
        StageOp("batchnorm", eps=0.0)
    with pytest.raises(ValueError, match=r"momentum must be in \[0, 1\]"):
        StageOp("batchnorm", momentum=1.5)
    # batch norm joins the stage; dropout ends it
    entries = [{"type": "relu"}, {"type": "batchnorm", "eps": 0.5}, {"type": "dropout"}]
    assert stage_of(entries) == StageSpec((StageOp("relu"), StageOp("batchnorm", eps=0.5)))


# -- real worker processes ----------------------------------------------------------------------

# tiny: conv1 8 kernels, conv2 16; LRN size 5 (halo 4). Shares smaller than the halo, a node
# with none (the master on conv1), uneven.
SHARES = {"conv1": (0, 1, 7), "conv2": (5, 9, 2)}


def test_fused_cluster_trains_as_local(local, workers, tmp_path):
    trace = tmp_path / "trace.jsonl"
    config = ClusterConfig(**FAST, shares=SHARES, stages="fused")
    with Cluster(workers.addresses, config=config) as cluster:
        got = train_strong_lrn(tmp_path, "fused", cluster, trace=str(trace))
    same_as_local(got, local)
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    plan = records[0]
    assert plan["stages"] == "fused"
    assert plan["stage_modes"] == {"conv1": "fused", "conv2": "fused"}
    steps = [r for r in records if "step" in r]
    assert steps and all(r["stage_modes"] == {"conv1": "fused", "conv2": "fused"} for r in steps)
    # The workers computed (no silent fallback to the master): conv2's worker 1 took 9 kernels.
    assert all(r["nodes"][workers.addresses[0]]["conv2"]["kernels"] == 9 for r in steps)
    # The cost model counts every fused call's bytes as the run moved them.
    layers = {layer.name: layer for layer in conv_layers(STRONG_LRN, RUN["batch"])}
    for record in steps:
        for name, shares in SHARES.items():
            offset = shares[0]
            for node, share in zip(workers.addresses, shares[1:], strict=True):
                for phase in ("forward", "backward"):
                    got = record["nodes"][node][name][phase]
                    want = stage_call_bytes(
                        layers[name], layers[name].stage, phase, share, offset, record["step"]
                    )
                    assert (got["bytes_sent"], got["bytes_received"]) == (want.sent, want.received)
                offset += share
    # The simulator calibrated from this trace models the fused calls it ran.
    cal = calibrate(str(trace), str(tmp_path / "strong-lrn.json"))
    assert cal.stage_modes == {"conv1": "fused", "conv2": "fused"}
    assert cal.check()["step_s"] > 0


def test_auto_picks_fused_for_pooled_stages(workers, tmp_path):
    config = ClusterConfig(**FAST, shares=SHARES, stages="auto")
    with Cluster(workers.addresses, config=config) as cluster:
        train_strong_lrn(tmp_path, "auto", cluster, steps=1)
        assert cluster.stage_modes == {"conv1": "fused", "conv2": "fused"}


class KilledMidStep(Cluster):
    """Kills ``victim`` just before ``layer``'s stage forward at ``step`` (training calls)."""

    def __init__(self, addresses, victim, step, layer, **config):
        super().__init__(addresses, config=ClusterConfig(**{**FAST, **config}))
        self.victim, self.at = victim, (step, layer)

    def stage_forward(self, layer, x, w, b, padding, stage, batchnorm=()):
        if (self.step, layer) == self.at and x.shape[0] == RUN["batch"]:
            self.victim.kill()
            self.victim.wait()
        return super().stage_forward(layer, x, w, b, padding, stage, batchnorm)


def test_fused_worker_killed_mid_step_stays_exact(local, tmp_path):
    with LocalWorkers(2) as started:
        # Killed after conv1's stage forward at step 3: its conv2 forward fails, and conv1's
        # backward piece, whose forward ran on the dead worker, is recomputed by the master.
        victim = started.processes[1]
        with KilledMidStep(
            started.addresses, victim, 3, "conv2", shares=SHARES, stages="fused"
        ) as cluster:
            got = train_strong_lrn(tmp_path, "killed", cluster)
            lost = [e for e in cluster.events if e["event"] == "worker_lost"]
    same_as_local(got, local)
    assert [(e["worker"], e["step"]) for e in lost] == [(started.addresses[1], 3)]


def _stage_call(address, **changes):
    """A StageForward of 8 kernels owning 2..5, with ``changes`` to the stage description."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 3, 8, 8)).astype(np.float32)
    w = rng.standard_normal((8, 3, 5, 5)).astype(np.float32)
    b = np.zeros(8, np.float32)
    client = WorkerClient(address)
    stage = StageSpec.from_entries(CHAINS["relu-lrn-pool"])
    own = changes.pop("own", slice(2, 6))
    ops = changes.pop("ops", None)
    try:
        if ops is not None:
            real = client_module.ops_to_proto
            client_module.ops_to_proto = lambda spec: ops
        try:
            return client.stage_forward(1, 1, "conv9", x, w, b, PADDING, stage, own, **changes)
        finally:
            if ops is not None:
                client_module.ops_to_proto = real
    finally:
        client.close()


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(ops=[]), "the stage has no layers"),
        (dict(ops=[pb.StageOp(layer=9)]), "stage layer 0 has kind 9"),
        (dict(ops=[pb.StageOp(layer=pb.LRN, size=0)]), "stage layer 0: stage lrn size must be"),
        (
            dict(ops=[pb.StageOp(layer=pb.MAXPOOL, kernel=20, stride=1)]),
            "pool window 20 larger than input 8x8",
        ),
        (dict(own=slice(6, 10)), "owns 4 kernels from 6, but the request sends 8"),
        (dict(own=slice(3, 3)), "owns 0 kernels"),
        # batch norm parameters for a stage without batch norm
        (
            dict(batchnorm=[BatchNormSlice(np.ones(8, np.float32), np.zeros(8, np.float32))]),
            r"bn has shape \(2, 8\), expected \(0, channels\): 0 batch norm layers",
        ),
        # a batch norm whose parameters did not come
        (
            dict(ops=[pb.StageOp(layer=pb.BATCHNORM, eps=1e-5, momentum=0.1)]),
            r"bn has shape \(0, 8\), expected \(2, channels\): 1 batch norm layers in training",
        ),
        (
            dict(ops=[pb.StageOp(layer=pb.BATCHNORM, eps=-1.0, momentum=0.1)]),
            "stage layer 0: stage batchnorm eps must be finite and > 0",
        ),
    ],
)
def test_bad_stage_requests_are_refused(workers, change, message):
    with pytest.raises(WorkerError, match=message) as caught:
        _stage_call(workers.addresses[0], **change)
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    y, _, _ = _stage_call(workers.addresses[0])  # and it goes on serving
    assert y.shape == (2, 4, 4, 4)


def test_stage_backward_checks_its_gradient(workers):
    address = workers.addresses[0]
    _stage_call(address)
    client = WorkerClient(address)
    try:
        dy = np.zeros((2, 2, 4, 4), np.float32)  # covers only 2 of the 4 owned channels
        with pytest.raises(WorkerError, match="must cover the owned 2..5") as caught:
            client.stage_backward(1, 1, "conv9", dy, 2, True)
        assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(WorkerError, match="no stage forward of layer 'conv9'"):
            client.stage_backward(1, 2, "conv9", np.zeros((2, 8, 4, 4), np.float32), 0, True)
    finally:
        client.close()


@pytest.mark.parametrize("stages", [None, pytest.param("unfused", marks=pytest.mark.slow)])
def test_hetconv_train_stages_flag_records_modes(tmp_path, stages):
    """``hetconv train`` picks per layer by default (auto: fused, as pooling cuts the bytes)."""
    trace = tmp_path / "t.jsonl"
    args = ["--steps", "2", "--batch", "4", "--train-size", "8", "--eval-size", "0"]
    run = subprocess.run(
        [sys.executable, "-m", "hetconv", "train", *args, "--no-progress",
         "--local-workers", "1", "--trace", str(trace),
         *(["--stages", stages] if stages else [])],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    mode = stages or "fused"
    assert records[0]["stages"] == (stages or "auto")
    assert records[0]["stage_modes"] == {"conv1": mode, "conv2": mode}
    assert all(r["stage_modes"] == {"conv1": mode, "conv2": mode} for r in records if "step" in r)


def test_local_refuses_stages(capsys):
    assert cli_main(["train", "--local", "--stages", "fused", "--steps", "1"]) == 2
    assert "--local runs no workers, so nothing is fused" in capsys.readouterr().err


# -- the cost model and the simulator -----------------------------------------------------------


@pytest.mark.parametrize("network", ["paper-50-500", "paper-500-1500"])
def test_the_cost_model_picks_fused_and_counts_fewer_bytes(network):
    from hetconv import costmodel

    for layer in network_layers(network, 16):
        shares = kernel_shares(layer.kernels, [1.0] * 5)
        fused = costmodel.layer_bytes(layer, shares, fused=True)
        unfused = costmodel.layer_bytes(layer, shares, fused=False)
        # Forward answers and backward requests carry pooled maps (a quarter of the workers'
        # feature maps), backward's with a halo of 2 channels on each side, forward's kernels
        # with one of 4: at most 3/4 of the maps saved, and not much less.
        ho, wo = layer.shape.out_hw
        maps = 2 * 4 * layer.shape.n * sum(shares[1:]) * ho * wo
        assert 0.5 * maps < unfused - fused < 0.75 * maps
        assert costmodel.stage_mode(layer, layer.stage, shares) == "fused"
        assert costmodel.stage_mode(layer, None, shares) == "unfused"


def test_the_simulator_models_each_mode():
    from hetconv.costmodel import MBIT, SWITCHED, SimCluster, SimNode, simulate_step

    workers = tuple(SimNode(f"w{i}", 100.0, bytes_per_s=MBIT * 100) for i in range(4))
    cluster = SimCluster(SimNode("master", 100.0), workers, SWITCHED, medium_bytes_per_s=MBIT * 100)
    layers = network_layers("paper-150-800", 16)
    shares = {layer.name: kernel_shares(layer.kernels, [1.0] * 5) for layer in layers}
    steps = {mode: simulate_step(cluster, layers, shares, 0.1, mode) for mode in STAGE_MODES}
    assert steps["fused"].bytes < steps["unfused"].bytes
    assert steps["auto"].bytes == steps["fused"].bytes
    assert steps["fused"].comm_s < steps["unfused"].comm_s  # fewer bytes on a 100 Mbit/s link
    per_layer = simulate_step(cluster, layers, shares, 0.1, {"conv1": "fused"})
    assert steps["fused"].bytes < per_layer.bytes < steps["unfused"].bytes
    with pytest.raises(ValueError, match="stages 'fast'"):
        simulate_step(cluster, layers, shares, 0.1, "fast")


def test_a_bad_stage_mode_is_refused():
    with pytest.raises(ValueError, match="stages 'fast'; expected one of fused, unfused, auto"):
        ClusterConfig(stages="fast")


@pytest.mark.slow
def test_fused_paper_network_trains_as_local(workers, tmp_path):
    """paper-50-500 (LRN size 5 after both convolutions) over 20 steps, uneven probed shares."""
    run = dict(preset="paper-50-500", steps=20, batch=8, train_size=64, eval_size=0)
    want = train_strong_lrn(tmp_path, "local-paper", LocalConv(), **run)
    config = ClusterConfig(**FAST, stages="fused")
    with Cluster(workers.addresses, config=config) as cluster:
        got = train_strong_lrn(tmp_path, "fused-paper", cluster, **run)
        assert cluster.stage_modes == {"conv1": "fused", "conv2": "fused"}
    same_as_local(got, want)


stage_ops = st.lists(
    st.builds(
        pb.StageOp,
        layer=st.integers(0, 5),
        size=st.one_of(st.integers(0, 9), st.just(2**32 - 1)),
        alpha=st.one_of(st.floats(-2, 2), st.just(float("nan")), st.just(float("inf"))),
        beta=st.floats(0, 2),
        k=st.floats(0.5, 3),
        kernel=st.integers(0, 10),
        stride=st.integers(0, 4),
    ),
    max_size=4,
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=stage_ops, own_start=st.integers(0, 9), own_count=st.integers(0, 9))
def test_any_stage_description_is_answered_or_refused_by_name(workers, ops, own_start, own_count):
    """Generated stage descriptions: the worker answers the owned kernels' output, or refuses
    with INVALID_ARGUMENT; it never fails otherwise, and goes on serving."""
    try:
        y, _, _ = _stage_call(
            workers.addresses[1], ops=ops, own=slice(own_start, own_start + own_count)
        )
    except WorkerError as e:
        assert e.code == grpc.StatusCode.INVALID_ARGUMENT, str(e)
    else:
        assert y.shape[:2] == (2, own_count) and own_start + own_count <= 8


def test_calibration_reads_a_trace_where_a_worker_has_no_share_of_a_layer(workers, tmp_path):
    # --shares link may give a worker nothing of a layer: its step records then have no entry
    # for that layer (and name it after the workers that computed the first layer), and the
    # simulator calibrated from the trace still models the run, its slices in node order.
    trace = tmp_path / "trace.jsonl"
    shares = {"conv1": (4, 0, 4), "conv2": SHARES["conv2"]}
    config = ClusterConfig(**FAST, shares=shares, stages="fused")
    with Cluster(workers.addresses, config=config) as cluster:
        train_strong_lrn(tmp_path, "no-share", cluster, trace=str(trace), steps=3)
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    steps = [r for r in records if "step" in r]
    assert all("conv1" not in r["nodes"][workers.addresses[0]] for r in steps)
    assert list(steps[-1]["nodes"])[1] == workers.addresses[1]  # first called, second named
    cal = calibrate(str(trace), str(tmp_path / "strong-lrn.json"))
    assert cal.shares["conv1"] == (4, 0, 4) and cal.shares["conv2"] == SHARES["conv2"]
    assert cal.check()["step_s"] > 0


# -- batch norm in fused stages, real worker processes -------------------------------------------

# conv1 (stride 2) -> batchnorm -> relu -> maxpool and conv2 -> batchnorm -> relu -> gap: both
# stages hold their batch norm.
BN_SPEC = [
    {"type": "conv", "out": 8, "kernel": 3, "stride": 2, "padding": 1},
    {"type": "batchnorm", "momentum": 0.2},
    {"type": "relu"},
    {"type": "maxpool"},
    {"type": "conv", "out": 12, "kernel": 3, "padding": 1},
    {"type": "batchnorm", "eps": 1e-3},
    {"type": "relu"},
    {"type": "gap"},
    {"type": "fc", "out": 10},
]
BN_SHARES = {"conv1": (1, 5, 2), "conv2": (5, 3, 4)}


def _train_bn(tmp_path, name, executor, trace=None):
    weights = tmp_path / f"{name}.npz"
    spec = tmp_path / "bn.json"
    spec.write_text(json.dumps(BN_SPEC))
    config = TrainConfig(save=str(weights), trace=trace, **{**RUN, "preset": str(spec)})
    result = train(config, executor, log=io.StringIO())
    return result, dict(np.load(weights))


@pytest.fixture(scope="module")
def local_bn(tmp_path_factory):
    return _train_bn(tmp_path_factory.mktemp("local-bn"), "local", LocalConv())


def _same_as_local_bn(got, local):
    (result, weights), (want, want_weights) = got, local
    np.testing.assert_allclose(result.losses, want.losses, rtol=1e-5)
    assert set(weights) == set(want_weights)
    assert {
        "batchnorm1.running_mean",
        "batchnorm1.running_var",
        "batchnorm2.num_batches_tracked",
    } <= set(weights)
    for name in weights:  # parameters and running statistics, PyTorch's names
        np.testing.assert_allclose(
            weights[name], want_weights[name], rtol=0, atol=1e-5, err_msg=name
        )
    assert weights["batchnorm2.num_batches_tracked"] == RUN["steps"]
    # the held-out evaluation ran the stages in evaluation mode (running statistics)
    np.testing.assert_allclose(result.eval_loss, want.eval_loss, rtol=1e-5)
    assert result.eval_accuracy == want.eval_accuracy


def test_fused_batchnorm_cluster_trains_as_local(local_bn, workers, tmp_path):
    trace = tmp_path / "trace.jsonl"
    config = ClusterConfig(**FAST, shares=BN_SHARES, stages="fused", kernels="sent")
    with Cluster(workers.addresses, config=config) as cluster:
        got = _train_bn(tmp_path, "fused", cluster, trace=str(trace))
        kernel_modes = dict(cluster.kernel_modes)
    _same_as_local_bn(got, local_bn)
    # kernels sent with the batch norm rows (resident: tests/test_resident_batchnorm.py)
    assert kernel_modes == {"conv1": "sent", "conv2": "sent"}
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    steps = [r for r in records if "step" in r]
    assert len(steps) == RUN["steps"]
    assert all(r["stage_modes"] == {"conv1": "fused", "conv2": "fused"} for r in steps)
    # the workers computed their pieces (no silent fallback to the master)
    assert all(r["nodes"][workers.addresses[1]]["conv2"]["kernels"] == 4 for r in steps)
    # the cost model counts the batch norm tensors as the run moved them
    layers = {layer.name: layer for layer in conv_layers(BN_SPEC, RUN["batch"])}
    for record in steps:
        for name, shares in BN_SHARES.items():
            layer = layers[name]
            for node, kernels, offset in zip(
                workers.addresses, shares[1:], offsets(shares)[1:], strict=True
            ):
                phases = record["nodes"][node][name]
                for phase in ("forward", "backward"):
                    want = stage_call_bytes(
                        layer, layer.stage, phase, kernels, offset, record["step"]
                    )
                    assert phases[phase]["bytes_sent"] == want.sent, (name, phase)
                    assert phases[phase]["bytes_received"] == want.received, (name, phase)


def test_fused_batchnorm_worker_killed_mid_step_stays_exact(local_bn, tmp_path):
    with LocalWorkers(2) as started:
        # Killed after conv1's stage forward at step 3 (its batch statistics taken): conv2's
        # forward piece and conv1's backward piece are computed by the master instead.
        victim = started.processes[1]
        with KilledMidStep(
            started.addresses, victim, 3, "conv2", shares=BN_SHARES, stages="fused"
        ) as cluster:
            got = _train_bn(tmp_path, "killed", cluster)
            lost = [e for e in cluster.events if e["event"] == "worker_lost"]
    _same_as_local_bn(got, local_bn)
    assert [(e["worker"], e["step"]) for e in lost] == [(started.addresses[1], 3)]
