"""A split head: the final fc computed on the kernel slices of the last resident stage.

The maths against the fc layer itself (its forward, its gradients), then real worker processes
on loopback: a cluster with a split head (fused stages, resident kernels, a strong LRN so that
a wrong halo column would show) trains as local training does step by step, with and without
the replicated first block, also when a worker holding the fc's columns is SIGKILLed mid-step,
and across a checkpoint and resume; what each call moves is what the cost model counts; the
worker refuses malformed head tensors, naming them.
"""

from __future__ import annotations

import json
import re

import grpc
import numpy as np
import pytest
from exactness import FAST, RUN, STRONG_LRN, same_as_local, train_strong_lrn

from hetconv.backends import get_backend
from hetconv.head import columns_grad, head_columns, partial_logits, stage_grad
from hetconv.layers import Linear
from hetconv.master.client import WorkerClient, WorkerError
from hetconv.master.cluster import Cluster, ClusterConfig
from hetconv.master.launch import LocalWorkers
from hetconv.model import Model, reference_spec
from hetconv.optim import SGDConfig
from hetconv.training.checkpoint import POINTER_NAME, read_checkpoint
from hetconv.workload import conv_layers, resident_call_bytes

# tiny: conv2 has 16 kernels, LRN size 5 (halo 4): uneven shares, one smaller than the halo
SHARES = {"conv1": (0, 1, 7), "conv2": (5, 9, 2)}
HEAD = dict(**FAST, shares=SHARES, stages="fused", kernels="resident", head="split")


def _linear(c=6, p=4, classes=3, n=5, seed=0):
    rng = np.random.default_rng(seed)
    fc = Linear("fc", c * p, classes)
    fc.params["weight"][...] = rng.standard_normal((classes, c * p))
    fc.params["bias"][...] = rng.standard_normal(classes)
    y = rng.standard_normal((n, c, 2, 2)).astype(np.float32)
    return fc, y


def test_columns_are_a_view_of_the_fc_weight():
    fc, _ = _linear()
    f = head_columns(fc.params["weight"], 6)
    assert f.shape == (6, 4, 3) and np.shares_memory(f, fc.params["weight"])
    f[2] = 7.0  # writing a channel's columns writes the fc's weight
    assert np.all(fc.params["weight"][:, 8:12] == 7.0)
    with pytest.raises(ValueError, match="does not split into 5 channels"):
        head_columns(fc.params["weight"], 5)


@pytest.mark.parametrize("cuts", [(0, 6), (0, 1, 6), (0, 2, 3, 6)])
def test_parts_sum_to_the_fc_and_give_its_gradients(cuts):
    fc, y = _linear()
    f = head_columns(fc.params["weight"], 6)
    parts = [slice(a, b) for a, b in zip(cuts, cuts[1:], strict=False)]
    z = sum(partial_logits(y[:, p], f[p]) for p in parts) + fc.params["bias"]
    np.testing.assert_allclose(z, fc.forward(y), rtol=1e-5, atol=1e-6)
    dz = np.random.default_rng(1).standard_normal(z.shape).astype(np.float32)
    dy = fc.backward(dz)
    for p in parts:
        np.testing.assert_allclose(stage_grad(dz, f[p], (2, 2)), dy[:, p], rtol=1e-5, atol=1e-6)
        want = head_columns(fc.grads["weight"], 6)[p]
        np.testing.assert_allclose(columns_grad(dz, y[:, p]), want, rtol=1e-5, atol=1e-6)


def test_the_model_finds_the_head():
    specs = Model(reference_spec(8, 16)).conv_specs()
    assert [s.head for s in specs] == [None, ("fc", 10)]
    dropout = reference_spec(8, 16)
    dropout.insert(-1, {"type": "dropout", "p": 0.5})
    assert [s.head for s in Model(dropout).conv_specs()] == [None, None]


def _records(trace):
    return [json.loads(line) for line in trace.read_text().splitlines()]


@pytest.mark.parametrize("replicate", ["off", "first"])
def test_a_split_head_trains_as_local(local, workers, tmp_path, replicate):
    trace = tmp_path / "trace.jsonl"
    config = ClusterConfig(**{**HEAD, "replicate": replicate})
    with Cluster(workers.addresses, config=config) as cluster:
        got = train_strong_lrn(tmp_path, "head", cluster, trace=str(trace))
        assert cluster.heads == {"conv2": 10}
        assert cluster.resident_parameters()[-1] == "fc.weight"
    same_as_local(got, local)
    records = _records(trace)
    assert records[0]["head"] == "split" and records[0]["heads"] == {"conv2": "fc"}
    steps = [r for r in records if "step" in r]
    layers = {layer.name: layer for layer in conv_layers(STRONG_LRN, RUN["batch"])}
    layer = layers["conv2"]
    offset = SHARES["conv2"][0]
    replica = layers["conv1"] if replicate == "first" else None
    for node, share in zip(workers.addresses, SHARES["conv2"][1:], strict=True):
        for phase in ("forward", "backward"):
            want = resident_call_bytes(
                layer, layer.stage, phase, share, offset, 5, replica=replica, head=10
            )
            got = steps[5]["nodes"][node]["conv2"][phase]
            assert (got["bytes_sent"], got["bytes_received"]) == (want.sent, want.received)
        offset += share
    # The forward answers logits: 8 images x 10 classes, not 8 x 9 kernels x 8 x 8 maps.
    first = steps[5]["nodes"][workers.addresses[0]]["conv2"]["forward"]["bytes_received"]
    assert first < 4 * 8 * 9 * 8 * 8 / 4


class Disturbed(Cluster):
    """Runs ``action`` just before conv2's stage forward at ``step`` in training."""

    def __init__(self, addresses, step, action, **config):
        super().__init__(addresses, config=ClusterConfig(**{**HEAD, **config}))
        self.at, self.action = step, action

    def stage_forward(self, layer, x, w, b, padding, stage, batchnorm=(), head=None):
        if (self.step, layer) == (self.at, "conv2") and x.shape[0] == RUN["batch"]:
            self.action()
        return super().stage_forward(layer, x, w, b, padding, stage, batchnorm, head)


def test_a_worker_killed_while_holding_the_heads_columns_stays_exact(local, tmp_path):
    trace = tmp_path / "trace.jsonl"
    with LocalWorkers(2) as started:
        victim = started.processes[1]

        def kill():
            victim.kill()  # SIGKILL: its kernels, fc columns and their momentum die with it
            victim.wait()

        with Disturbed(started.addresses, 5, kill, resident_sync_every=3) as cluster:
            got = train_strong_lrn(tmp_path, "killed", cluster, trace=str(trace))
            lost = [e for e in cluster.events if e["event"] == "worker_lost"]
    same_as_local(got, local)
    assert [(e["worker"], e["step"]) for e in lost] == [(started.addresses[1], 5)]
    records = {r["step"]: r for r in _records(trace) if "step" in r}
    assert records[5]["resident"]["conv2"]["replayed_steps"] == 2  # steps 3 and 4


def test_checkpoints_gather_the_heads_columns(local, workers, tmp_path):
    """A checkpoint with a split head holds what one with the fc on the master holds (the fc's
    weight and momentum gathered from the workers), and a run resumed from it places the
    columns again and ends as local training does."""
    runs = {}
    for head in ("master", "split"):
        with Cluster(workers.addresses, config=ClusterConfig(**{**HEAD, "head": head})) as c:
            runs[head] = train_strong_lrn(
                tmp_path, head, c, checkpoint_dir=str(tmp_path / head), checkpoint_every=7
            )
    same_as_local(runs["split"], local)
    for step in (7, 14):
        master = read_checkpoint(tmp_path / "master" / f"ckpt-{step:08d}.npz")
        split = read_checkpoint(tmp_path / "split" / f"ckpt-{step:08d}.npz")
        for what in ("model", "momentum"):
            a, b = getattr(master, what), getattr(split, what)
            assert a.keys() == b.keys()
            for name in a:
                np.testing.assert_allclose(b[name], a[name], rtol=0, atol=1e-5, err_msg=name)
    folder = tmp_path / "resumed"
    folder.mkdir()
    (folder / "ckpt-00000007.npz").write_bytes(
        (tmp_path / "split" / "ckpt-00000007.npz").read_bytes()
    )
    (folder / POINTER_NAME).write_text("ckpt-00000007.npz\n")
    with Cluster(workers.addresses, config=ClusterConfig(**HEAD)) as cluster:
        resumed = train_strong_lrn(
            tmp_path, "resumed", cluster, checkpoint_dir=str(folder), resume=True
        )
    same_as_local(resumed, local)


def test_the_head_needs_resident_kernels(workers, tmp_path):
    config = ClusterConfig(**{**HEAD, "kernels": "sent"})
    with Cluster(workers.addresses, config=config) as cluster:
        train_strong_lrn(tmp_path, "sent", cluster, steps=1)
        assert cluster.heads == {}
        assert "kernels are not resident" in cluster.describe_head()
    with pytest.raises(ValueError, match="head 'both'"):
        ClusterConfig(head="both")


def _slice(k=4, c=3):
    rng = np.random.default_rng(2)
    w = rng.standard_normal((k, c, 5, 5)).astype(np.float32)
    b = rng.standard_normal(k).astype(np.float32)
    return w, b, np.zeros_like(w), np.zeros_like(b)


@pytest.mark.parametrize(
    "f, message",
    [
        (np.zeros((3, 16, 10), np.float32), "f (3, 16, 10) and mf (3, 16, 10) must both be (4,"),
        (np.zeros((4, 0, 10), np.float32), "must both be (4, P, 10) (head_classes 10)"),
        (np.full((4, 16, 10), np.nan, np.float32), "f (the split head's columns) holds NaN"),
    ],
)
def test_bad_head_columns_are_refused(workers, f, message):
    client = WorkerClient(workers.addresses[0])
    try:
        with pytest.raises(WorkerError) as caught:
            client.place_kernels(
                7, "conv9", 0, 1 << 32, *_slice(), False, SGDConfig(), head=(f, np.zeros_like(f))
            )
        assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert message in str(caught.value)
    finally:
        client.close()


def test_link_shares_and_the_simulator_count_logits_not_maps(tmp_path):
    """With a split head a worker's answer is logits whatever its share: on a shared medium
    the link-aware split gives the workers more of the layer, and the simulator predicts the
    step faster with fewer bytes."""
    from hetconv.balance import link_aware_shares, shares_for
    from hetconv.cli.simulate import main as simulate_main
    from hetconv.costmodel import SimCluster, SimNode, simulate_step
    from hetconv.workload import network_layers

    layers = network_layers("paper-150-800", 16)
    block, conv2 = layers
    assert (block.head, conv2.head) == (0, 10)
    workers = tuple(SimNode(f"w{i}", 20.0, bytes_per_s=8e6) for i in range(4))
    cluster = SimCluster(SimNode("m", 20.0), workers, "wifi", 8e6)
    maps = link_aware_shares(cluster, conv2, True, True, block)
    logits = link_aware_shares(cluster, conv2, True, True, block, head=10)
    assert sum(maps) == sum(logits) == 800
    assert logits[0] < maps[0]  # the master keeps less
    planned = shares_for(cluster, layers, "link", "fused", "resident", "first", "auto", "split")
    assert list(planned["conv2"]) == logits
    modes = ("fused", "resident", "first", "auto")
    steps = {
        head: simulate_step(cluster, layers, planned, 0.1, *modes, head)
        for head in ("master", "split")
    }
    assert steps["split"].step_s < steps["master"].step_s
    assert steps["split"].bytes < steps["master"].bytes / 2
    with pytest.raises(ValueError, match="head 'both'"):
        simulate_step(cluster, layers, planned, 0.1, *modes, "both")
    rows = {}
    for head in ("master", "split"):
        out = tmp_path / f"{head}.json"
        argv = ["low-mid-range", "--preset", "paper-150-800", "--batch", "16", "--nodes", "5"]
        argv += ["--bandwidth", "100", "--stages", "fused", "--kernels", "resident"]
        argv += ["--replicate", "first", "--policy", "link", "--no-data-parallel", "--quiet"]
        assert simulate_main([*argv, "--head", head, "--json", str(out)]) == 0
        (rows[head],) = json.loads(out.read_text())
    assert rows["split"]["head"] == "split"
    assert rows["split"]["step_s"] < rows["master"]["step_s"]
    assert rows["split"]["mbytes_per_step"] < rows["master"]["mbytes_per_step"]


def test_a_worker_answers_logits_and_refuses_head_tensors_that_do_not_fit(workers):
    """A slice placed with fc columns answers its partial logits, takes dz back and updates
    the columns; halo columns or a gradient of the wrong shape are refused, naming them."""
    from hetconv.resident import placement_version
    from hetconv.stages import StageSpec, stage_forward

    stage = StageSpec.from_entries(
        [{"type": "relu"}, {"type": "lrn", "size": 5, "alpha": 1.0}, {"type": "maxpool"}]
    )
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 3, 8, 8)).astype(np.float32)
    w, b, mw, mb = _slice()
    hw, hb = rng.standard_normal((2, 3, 5, 5)).astype(np.float32), np.zeros(2, np.float32)
    f = rng.standard_normal((4, 16, 10)).astype(np.float32)  # 4 channels, P = 4 x 4, 10 classes
    hf = rng.standard_normal((2, 16, 10)).astype(np.float32)
    padding, session, version = (2, 2, 2, 2), 78, placement_version(1)
    client = WorkerClient(workers.addresses[0])
    try:
        client.place_kernels(
            session, "conv9", 2, version, w, b, mw, mb, False, SGDConfig(), head=(f, 0 * f)
        )
        z, _ = client.resident_stage_forward(
            session, 1, "conv9", x, hw, hb, 2, version, padding, stage, 4, hf=hf
        )
        wide_w, wide_b = np.concatenate([hw, w]), np.concatenate([hb, b])
        y, _ = stage_forward(get_backend("cpu"), x, wide_w, wide_b, padding, stage, slice(2, 6))
        np.testing.assert_allclose(z, partial_logits(y, f), rtol=1e-5, atol=1e-5)
        for bad, message in (
            (hf[:1], "halo columns hf (1, 16, 10)"),
            (np.zeros((2, 9, 10), np.float32), "hf must be (2, 16, 10)"),
        ):
            with pytest.raises(WorkerError, match=re.escape(message)) as caught:
                client.resident_stage_forward(
                    session, 2, "conv9", x, hw, hb, 2, version, padding, stage, 4, hf=bad
                )
            assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
        z, _ = client.resident_stage_forward(
            session, 1, "conv9", x, hw, hb, 2, version, padding, stage, 4, hf=hf
        )
        dy = np.ones((2, 1, 4, 4), np.float32)  # maps where the logits' gradient belongs
        with pytest.raises(WorkerError, match=r"takes dz \(2, 10\) and an empty dy") as caught:
            client.resident_stage_backward(session, 1, "conv9", dy, 0, version, True)
        assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
        dz = rng.standard_normal((2, 10)).astype(np.float32)
        empty = np.empty((2, 0, 4, 4), np.float32)
        ef = np.empty((4, 16, 10), np.float32)
        client.resident_stage_backward(
            session, 1, "conv9", empty, 0, version, True, edges_out=(None, None, ef), dz=dz
        )
        (_, _, _, _, f_now, mf_now), _ = client.fetch_kernels(session, "conv9", version + 1)
        want = f - 0.01 * (columns_grad(dz, y) + 5e-4 * f)  # the first SGD step, torch's rule
        np.testing.assert_allclose(f_now, want, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(ef, f_now)  # 4 channels: every one is an edge
        assert np.any(mf_now != 0)
    finally:
        client.close()
