"""A network cut in two (``--split LAYER=images``, :mod:`hetconv.cutsplit`): its first part
split by images among real worker processes with the ring, the rest on the master; trains as
local training does, step by step, a worker SIGKILLed mid-step too."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import threading
import time

import numpy as np
import pytest

from hetconv.cutsplit import cut_after, cut_layer, cut_spec
from hetconv.spec import load_spec

#: Two convolution blocks with batch norm, a third convolution, the head: cut after conv2's.
CUT_NET = [
    {"type": "conv", "name": "conv1", "out": 4, "kernel": 3, "padding": 1},
    {"type": "batchnorm"},
    {"type": "relu"},
    {"type": "maxpool", "kernel": 2},
    {"type": "conv", "name": "conv2", "out": 6, "kernel": 3, "padding": 1},
    {"type": "batchnorm"},
    {"type": "relu"},
    {"type": "maxpool", "kernel": 2},
    {"type": "conv", "name": "conv3", "out": 8, "kernel": 3, "padding": 1},
    {"type": "batchnorm"},
    {"type": "relu"},
    {"type": "dropout", "p": 0.25},
    {"type": "fc", "out": 10},
]


# -- where to cut ------------------------------------------------------------------------------


def test_split_values_name_a_layer_or_none():
    assert cut_layer("auto") is None and cut_layer("images") is None
    assert cut_layer("conv4=images") == "conv4"
    for bad in ("conv4=kernels", "=images", "conv4="):
        with pytest.raises(ValueError, match="LAYER=images"):
            cut_layer(bad)


def test_vgg11_is_cut_after_a_convolutions_block_and_its_parts_keep_their_names():
    spec = load_spec("vgg11")
    last = cut_after(spec, "conv4")
    assert spec[last]["type"] == "maxpool"  # conv4, bn4, relu4, maxpool3
    first, rest = cut_spec(spec, last)
    assert [e["name"] for e in first[-4:]] == ["conv4", "bn4", "relu4", "maxpool3"]
    assert rest[0]["name"] == "conv5" and rest[-1]["name"] == "fc"
    assert cut_after(spec, "conv3") == last - 4  # no pool after conv3: bn3, relu3


@pytest.mark.parametrize(
    "network, layer, says",
    [
        ("vgg11", "conv9", "has no layer 'conv9' (its convolutions: conv1, conv2"),
        ("vgg11", "fc", "'fc' is a fc: cut after a convolution's block"),
        ("resnet20", "s1b0_conv1", "reads relu1, before it"),
        ("resnet20", "s1b0_bn2", "reads relu1, before it"),
    ],
)
def test_a_cut_no_single_tensor_crosses_is_refused_by_name(network, layer, says):
    with pytest.raises(ValueError, match="--split " + layer) as e:
        cut_after(load_spec(network), layer)
    assert says in str(e.value)


# -- real worker processes ---------------------------------------------------------------------


def _train(tmp_path, name, executor, steps=20, preset=None):
    from exactness import RUN

    from hetconv.training import TrainConfig, train

    if preset is None:
        spec = tmp_path / "cut-net.json"
        spec.write_text(json.dumps(CUT_NET))
        preset = str(spec)
    weights = tmp_path / f"{name}.npz"
    config = TrainConfig(**{**RUN, "preset": preset, "save": str(weights), "steps": steps})
    with executor:
        losses = train(config, executor, log=io.StringIO()).losses
    return losses, dict(np.load(weights))


def _cut(addresses, layer="conv2", **config):
    from hetconv.master.cluster import ClusterConfig
    from hetconv.master.cutsplit import cut_split_class

    class Recorded(cut_split_class(layer)):
        def __init__(self):
            super().__init__(addresses, config=ClusterConfig(deterministic=True, **config))
            self.steps, self.actions = [], {}

        def _calls(self, phase, *args):
            calls = super()._calls(phase, *args)
            if (self.step, phase) in self.actions:
                self.actions.pop((self.step, phase))()
            return calls

        def end_step(self):
            record = super().end_step()
            self.steps.append(record)
            return record

    return Recorded()


def test_a_cut_network_trains_as_local_training(tmp_path, workers):
    from exactness import same_as_local

    from hetconv.conv import LocalConv

    local = _train(tmp_path, "local", LocalConv())
    cluster = _cut(workers.addresses)
    got = _train(tmp_path, "cut", cluster)
    same_as_local(got, local)  # the running statistics too: the weight file holds them
    assert all(r["exchange"] == "ring" and r["cut"] == "conv2" for r in cluster.steps)
    assert all("master" not in r["images"] for r in cluster.steps)
    assert all(
        r["nodes"][name]["digest"] == r["digest"] for r in cluster.steps for name in r["nodes"]
    )  # every worker's copy of the first part is the master's


def test_resnet20_cut_between_its_stages_trains_as_local_training(tmp_path, workers):
    """resnet20 cut after its first stage (the block's output read by the next block's
    convolution and by its sum: the rest reads it through an identity). One step, as
    tests/test_image_syncbn.py trains resnet20 split by images: at batch 8 the second step's
    batch holds a ReLU input within round-off of zero, which summing by images flips (3 steps
    here: the weights 2.8e-5 apart, over the 1e-5 the check allows)."""
    from exactness import same_as_local

    from hetconv.conv import LocalConv

    run = dict(steps=1, preset="resnet20")
    local = _train(tmp_path, "local", LocalConv(), **run)
    cluster = _cut(workers.addresses, layer="s1b2_add")
    got = _train(tmp_path, "cut", cluster, **run)
    same_as_local(got, local)
    assert all(r["exchange"] == "ring" and r["cut"] == "s1b2_add" for r in cluster.steps)


def test_the_paper_network_cut_after_its_first_block_trains_as_local_training(tmp_path, workers):
    """The tiny paper network (a strong LRN, no batch norm: the FORWARD sums nothing) cut
    after conv1's ReLU, LRN and pooling."""
    from exactness import same_as_local, train_strong_lrn

    from hetconv.conv import LocalConv

    local = train_strong_lrn(tmp_path, "local", LocalConv())
    cluster = _cut(workers.addresses, layer="conv1")
    with cluster:
        got = train_strong_lrn(tmp_path, "cut", cluster)
    same_as_local(got, local)
    assert all(r["exchange"] == "ring" for r in cluster.steps)


def test_split_auto_may_choose_the_cut_and_it_trains_as_local_training(tmp_path, workers,
                                                                        monkeypatch):  # fmt: skip
    """``--split auto`` predicts each cut beside the other ways (``cut:LAYER``); chosen, the
    master opens the cut over the same workers and the run is local training's."""
    from exactness import same_as_local, train_strong_lrn
    from test_split_auto import _forced

    from hetconv.conv import LocalConv
    from hetconv.master.cluster import ClusterConfig
    from hetconv.master.splitchoice import SplitChoice

    local = train_strong_lrn(tmp_path, "local", LocalConv())
    _forced(monkeypatch, "cut:conv1")
    trace = tmp_path / "trace.jsonl"
    config = ClusterConfig(deterministic=True)
    with SplitChoice(workers.addresses, config=config, alone_check=False) as cluster:
        got = train_strong_lrn(tmp_path, "auto-cut", cluster, trace=str(trace))
    same_as_local(got, local)
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    plan, steps = records[0], [r for r in records if "step" in r]
    assert plan["cut"] == "conv1" and plan["split_choice"]["exchange"] == "cut:conv1"
    assert plan["split_choice"]["predicted_s"]["images (cut:conv1)"] > 0
    assert all(r["split"] == "images" and r["cut"] == "conv1" for r in steps)


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_a_worker_killed_mid_step_the_master_computes_the_first_part(tmp_path, phase):
    """A worker stopped once step 3's FORWARD (or BACKWARD) calls are out and SIGKILLed 0.3 s
    later: the survivor's batch norm sums (or the ring) fail, the master computes the first
    part on the whole batch (the same step), and the next steps ring over the survivor."""
    from exactness import FAST, same_as_local

    from hetconv.conv import LocalConv
    from hetconv.cutsplit import BACKWARD, FORWARD
    from hetconv.master.launch import LocalWorkers

    local = _train(tmp_path, "local", LocalConv(), steps=8)
    with LocalWorkers(2) as started:
        victim = started.processes[1]
        cluster = _cut(started.addresses, **FAST)

        def stop_then_kill() -> None:  # frozen where it is, its peer waiting on it; then gone
            os.kill(victim.pid, signal.SIGSTOP)

            def kill() -> None:
                time.sleep(0.3)
                victim.kill()
                victim.wait()

            threading.Thread(target=kill, daemon=True).start()

        at = FORWARD if phase == "forward" else BACKWARD
        cluster.actions[(3, at)] = stop_then_kill
        got = _train(tmp_path, "killed", cluster, steps=8)
    same_as_local(got, local)
    assert cluster.steps[3]["exchange"] == "master"
    assert cluster.steps[3]["nodes"][started.addresses[1]].get("covered_by") == "master"
    assert all(r["exchange"] == "ring" for r in cluster.steps[5:])


def test_train_says_the_cut_and_refuses_a_bad_one(tmp_path, capsys):
    from hetconv.cli import main

    spec = tmp_path / "cut-net.json"
    spec.write_text(json.dumps(CUT_NET))
    trace = tmp_path / "trace.jsonl"
    argv = ["train", "--split", "conv2=images", "--model", str(spec), "--steps", "2",
            "--batch", "4", "--train-size", "16", "--eval-size", "4", "--no-run-dir",
            "--no-progress", "--trace", str(trace), "--deterministic",
            "--local-workers", "2"]  # fmt: skip
    assert main(argv) == 0
    plan = json.loads(trace.read_text().splitlines()[0])
    assert plan["cut"] == "conv2" and plan["exchange"] == "ring"
    assert plan["cut_output"] == [6, 8, 8]
    err = capsys.readouterr().err
    assert "split at conv2's block: the workers run the network up to it" in err
    bad = ["train", "--split", "conv7=images", "--model", str(spec), "--steps", "1",
           "--no-run-dir"]  # fmt: skip
    assert main(bad) == 2
    assert "no layer 'conv7' (its convolutions: conv1, conv2, conv3)" in capsys.readouterr().err
    master = [*bad[:2], "conv2=images", *bad[3:], "--exchange", "master"]
    assert main(master) == 2
    assert "not with --exchange master" in capsys.readouterr().err


# -- in the plan -------------------------------------------------------------------------------


def test_the_plan_predicts_each_cut_and_ranks_the_fastest():
    """Each place vgg11 may be cut is predicted (the first part split by images, the rest on
    the master, the activations at the cut both ways); the plan ranks the fastest with the
    command that runs it; a network that cannot be cut gets no row."""
    from hetconv.costcluster import MBIT, SimCluster, SimNode
    from hetconv.coststep import local_step_seconds
    from hetconv.cutcost import cut_points, cut_step
    from hetconv.simulations.plan import candidates
    from hetconv.workload import conv_layers

    spec = load_spec("vgg11")
    assert cut_points(spec) == [f"conv{i}" for i in range(1, 8)]
    assert cut_points(load_spec("resnet20"))[:3] == ["conv1", "s1b0_add", "s1b1_add"]
    link = MBIT * 940
    workers = tuple(SimNode(f"w{i}", 60.0, bytes_per_s=link, rtt_s=0.003) for i in range(4))
    cluster = SimCluster(SimNode("m", 60.0, bytes_per_s=link), workers, "switched")
    shape = (3, 32, 32)
    alone = local_step_seconds(cluster.master, conv_layers(spec, 64, shape), 0.25)
    steps = {name: cut_step(cluster, spec, 64, 0.25, shape, name) for name in cut_points(spec)}
    assert all(0 < s < 2 * alone and b > 0 for s, b in steps.values())
    assert steps["conv4"][0] < alone < steps["conv1"][0] * 1.2  # a cut pays where it should
    assert steps["conv7"][1] > steps["conv4"][1]  # more of the model's gradient in the ring
    rows = [c for c in candidates(cluster, "vgg11", 64, 0.25) if c.label.startswith("cut after")]
    assert len(rows) == 1
    best = min(steps, key=lambda name: steps[name][0])
    assert rows[0].label.startswith(f"cut after {best}:") and rows[0].exact
    assert f"--split {best}=images" in rows[0].how
    assert len([c for c in candidates(cluster, "resnet20", 64, 0.05) if "cut" in c.label]) == 1


# -- the worker refuses what a cut's calls cannot be ------------------------------------------


def _cut_request(first_spec, phase, ring=True, place=False, batch=4, peers=("x",)):
    from hetconv.calls import IMAGES_STEP
    from hetconv.proto import worker_pb2 as pb

    images = pb.ImagesStep(spec_json=json.dumps(first_spec), input_shape=[3, 32, 32], seed=0,
                           first=0, batch=batch, cut_phase=phase)  # fmt: skip
    if ring:
        images.ring.CopyFrom(pb.ImagesRing(peers=list(peers), rank=0, version=0, place=place,
                                           lr=0.01, answer_sum=True, wait_seconds=5.0))  # fmt: skip
    return pb.ConvRequest(phase=IMAGES_STEP.phase, session=9, step=0, images=images)


def test_a_worker_refuses_bad_cut_calls_by_name_and_goes_on_serving(workers):
    """No ring, an unknown phase, a gradient of the wrong shape, a BACKWARD with no FORWARD
    kept: each refused naming it (the last FAILED_PRECONDITION, the others INVALID_ARGUMENT);
    then a FORWARD and its BACKWARD on a ring of one are answered."""
    import grpc

    from hetconv.formats import FLOAT32
    from hetconv.master.client import WorkerClient
    from hetconv.master.cutsplit import cut_call
    from hetconv.model import Model
    from hetconv.ring import buffer_name

    spec = load_spec("vgg11")
    first, _ = cut_spec(spec, cut_after(spec, "conv1"))  # conv1, bn1, relu1, maxpool1
    model = Model(first)
    names = tuple(model.parameters())
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 3, 32, 32)).astype(np.float32)
    dy = rng.standard_normal((4, 64, 16, 16)).astype(np.float32)
    address = workers.addresses[0]
    client = WorkerClient(address, 10.0)
    forward_arrays = [("x", x), ("labels", np.zeros(4, np.float32))]

    def call(request, arrays):
        return cut_call(client, request, arrays, [FLOAT32] * len(arrays), 10.0, names, 10**8)

    try:
        for request, arrays, says, code in [
            (_cut_request(first, 1, ring=False), forward_arrays, "needs a ring",
             grpc.StatusCode.INVALID_ARGUMENT),
            (_cut_request(first, 3, peers=[address]), forward_arrays, "cut_phase 3",
             grpc.StatusCode.INVALID_ARGUMENT),
            (_cut_request(first, 2, peers=[address]), [("dy", dy[:, :8])],
             "expected float32 (count >= 1, 64, 16, 16)", grpc.StatusCode.INVALID_ARGUMENT),
            (_cut_request(first, 2, peers=[address]), [("dy", dy)], "no forward of it kept",
             grpc.StatusCode.FAILED_PRECONDITION),
        ]:  # fmt: skip
            with pytest.raises(Exception, match=re.escape(says)) as caught:
                call(request, arrays)
            assert getattr(caught.value, "code", None) == code, says
        buffers = [(buffer_name(k), np.asarray(v, np.float32)) for k, v in model.buffers().items()]
        placed = [*model.parameters().items(), *buffers]
        got, outcome, _, _, _ = call(_cut_request(first, 1, place=True, peers=[address]),
                                     [*placed, *forward_arrays])  # fmt: skip
        assert got["y"].shape == (4, 64, 16, 16) and outcome == 2  # DONE
        got, outcome, _, _, _ = call(_cut_request(first, 2, peers=[address]), [("dy", dy)])
        assert outcome == 1 and all(got[n].shape == model.parameters()[n].shape for n in names)
    finally:
        client.close()
