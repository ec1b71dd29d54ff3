"""One mode table: the master's choice of each layer's modes at prepare (hetconv.master.modes,
called as the cluster's prepare calls them) and the simulator's (hetconv.costmodel.step_modes)
agree, over the presets and specs with stride, batch norm and dropout, 1-8 nodes, a switched
network and a shared medium, and every value of every mode flag."""

from __future__ import annotations

import dataclasses
import itertools
import json
import random

import pytest

from hetconv.costmodel import MBIT, SWITCHED, WIFI, SimCluster, SimNode, WireCosts, step_modes
from hetconv.formats import BFLOAT16, FLOAT32
from hetconv.head import HEAD_MODES
from hetconv.master import modes
from hetconv.master.config import ClusterConfig
from hetconv.master.membership import Node as MasterNode
from hetconv.master.planning import LayerPlan
from hetconv.model import PRESETS, Model
from hetconv.modetable import ModeFlags
from hetconv.overlap import OVERLAP_MODES
from hetconv.replica import MASTER_BLOCKS, REPLICATE_MODES, REPLICATED
from hetconv.resident import KERNEL_MODES
from hetconv.stages import STAGE_MODES
from hetconv.workload import network_layers


def _conv(name, out, kernel=5, **more):
    return {"type": "conv", "name": name, "out": out, "kernel": kernel, "padding": "same", **more}


POOL = {"type": "maxpool", "kernel": 2, "stride": 2}
FC = {"type": "fc", "name": "fc", "out": 10}
SPECS = {
    # a strided second convolution (its kernels cannot stay on the workers), and a strided first
    "strided": [
        _conv("conv1", 16, 3), {"type": "relu"}, POOL,
        {**_conv("conv2", 64, 3), "stride": 2, "padding": 1}, {"type": "relu"}, POOL, FC,
    ],
    "strided-first": [
        {**_conv("conv1", 32, 3), "stride": 2, "padding": 1}, {"type": "relu"},
        _conv("conv2", 128), {"type": "relu"}, POOL, FC,
    ],
    "batchnorm": [
        _conv("conv1", 32), {"type": "batchnorm"}, {"type": "relu"}, POOL,
        _conv("conv2", 128), {"type": "batchnorm"}, {"type": "relu"}, POOL, FC,
    ],
    # convolutions without bias before batch norm (as PyTorch's CNNs write them)
    "nobias": [
        _conv("conv1", 32, 3, bias=False), {"type": "batchnorm"}, {"type": "relu"}, POOL,
        _conv("conv2", 128, 3, bias=False), {"type": "batchnorm"}, {"type": "relu"}, POOL,
        {"type": "dropout"}, FC,
    ],
    # the first block feeds dropout, not a convolution; the last stage feeds dropout, not the fc
    "dropout": [
        _conv("conv1", 32), {"type": "relu"}, POOL, {"type": "dropout"},
        _conv("conv2", 128), {"type": "relu"}, POOL, {"type": "dropout"}, FC,
    ],
    "three": [
        _conv("conv1", 24), {"type": "relu"}, POOL, _conv("conv2", 96), {"type": "relu"},
        {"type": "lrn", "size": 5}, POOL, _conv("conv3", 128, 3), {"type": "relu"},
        {"type": "gap"}, FC,
    ],
}  # fmt: skip
FLAGS = {
    "stages": STAGE_MODES,
    "kernels": KERNEL_MODES,
    "replicate": REPLICATE_MODES,
    "master_block": MASTER_BLOCKS,
    "overlap": OVERLAP_MODES,
    "head": HEAD_MODES,
    "resident_sync_every": (0, 1, 20),
    "wire_format": (FLOAT32, BFLOAT16),
    "master_compute": (True, False),
}
CASES = 2000  # of the grid, sampled; every flag value many times over


@pytest.fixture(scope="module")
def networks(tmp_path_factory):
    """Name -> (the spec as the cluster prepares it: Model.conv_specs(); the spec's path or
    preset, as the simulator reads it)."""
    folder = tmp_path_factory.mktemp("specs")
    out = {}
    for name, spec in {**PRESETS, **SPECS}.items():
        where = name
        if name in SPECS:
            where = str(folder / f"{name}.json")
            with open(where, "w", encoding="utf-8") as f:
                json.dump(spec, f)
        out[name] = (Model(spec).conv_specs(), where)
    return out


def _nodes(rng: random.Random, count: int):
    """(gflops, link) of each node, master first."""
    return [
        (rng.choice([4.0, 12.0, 40.0]), rng.choice([10, 100, 1000]) * MBIT) for _ in range(count)
    ]


def _shares(rng: random.Random, kernels: int, count: int, master_compute: bool) -> tuple:
    """A split of ``kernels`` over ``count`` nodes, some workers maybe with none."""
    weights = [rng.choice([0, 1, 3]) for _ in range(count)]
    if not master_compute:
        weights[0] = 0
    if not any(weights):
        weights[-1 if count > 1 else 0] = 1
    total = sum(weights)
    shares = [kernels * w // total for w in weights]
    shares[max(range(count), key=lambda i: weights[i])] += kernels - sum(shares)
    return tuple(shares)


def _case(rng: random.Random, networks):
    name = rng.choice(sorted(networks))
    count = rng.randint(1, 8)
    flags = {key: rng.choice(values) for key, values in FLAGS.items()}
    if count == 1:
        flags["master_compute"] = True
    network = rng.choice([SWITCHED, WIFI])
    batch = rng.choice([4, 8, 16, 32])
    return name, count, flags, network, batch


def _both(case, networks, rng: random.Random):
    """(the master's choice, the simulator's) for one case of the grid."""
    name, count, flags, network, batch = case
    try:
        config = ClusterConfig(**flags)
    except ValueError:  # a combination the run refuses: nothing to compare
        return None
    specs, where = networks[name]
    layers = network_layers(where, batch)
    figures = _nodes(rng, count)
    sim_nodes = [SimNode(f"n{i}", g, bytes_per_s=link) for i, (g, link) in enumerate(figures)]
    cluster = SimCluster(
        sim_nodes[0], tuple(sim_nodes[1:]), network, figures[0][1],
        flags["master_compute"], WireCosts(format=flags["wire_format"]),
    )  # fmt: skip
    shares = {ly.name: _shares(rng, ly.kernels, count, flags["master_compute"]) for ly in layers}
    # the master's nodes: their probes as the simulated nodes would time them (a master that
    # does not compute probes nothing), their links as measured
    nodes = [
        MasterNode(
            sim.name, None if i == 0 else object(), link_bytes_per_second=link,
            probe_seconds={ly.name: sim.probe_seconds(ly) for ly in layers}
            if i or flags["master_compute"] else {},
        )
        for i, (sim, (_, link)) in enumerate(zip(sim_nodes, figures, strict=True))
    ]  # fmt: skip
    plans = {ly.name: LayerPlan.of(ly.shape, shares[ly.name]) for ly in layers}
    c, wifi = config, network == WIFI
    stage = modes.stage_modes(c, specs, batch, plans, nodes)
    replica = modes.replica(c, specs, batch, stage, plans, nodes, None, wifi)
    if replica.blocks is not None:
        stage[specs[0].name] = REPLICATED
    kernels = modes.kernel_modes(c, specs, batch, stage, plans, nodes)
    head = modes.heads(c, specs, kernels)
    overlap = modes.overlap_images(c, specs, batch, stage, head.heads, plans, nodes)
    master = (stage, kernels, head.heads, head.refused, overlap, _replica(replica.blocks))
    sim = step_modes(
        cluster, layers, shares, flags["stages"], flags["kernels"], flags["replicate"],
        flags["overlap"], flags["head"], flags["resident_sync_every"], flags["master_block"],
    )  # fmt: skip
    decision = sim.replica
    split = None
    if decision is not None and decision.replicated:
        split = (decision.split, decision.split_all, decision.master_images, decision.split_refused)
    _, refused = modes.modetable.split_heads(ModeFlags.of(c), layers, sim.kernels)
    simulated = (
        sim.stages, sim.kernels, sim.heads, refused,
        {k: v for k, v in sim.overlap.items() if v}, split,
    )  # fmt: skip
    refusals = (replica.refused, decision.refused if decision is not None else None)
    return master, simulated, refusals


def _replica(blocks):
    if blocks is None:
        return None
    return (blocks.split, blocks.split_all, blocks.master_images, blocks.split_refused)


@pytest.fixture(autouse=True)
def _block_as_its_convolution(monkeypatch):
    """The master times its whole block on its backend (how much it costs over its
    convolution's probe); the simulator's nodes know only convolutions: the same here."""
    monkeypatch.setattr(modes, "block_cost_factor", lambda *args: 1.0)


@pytest.mark.slow
def test_the_master_and_the_simulator_choose_the_same_modes(networks):
    rng = random.Random(31)
    compared, seen = 0, {key: set() for key in FLAGS}
    for _ in range(CASES):
        case = _case(rng, networks)
        got = _both(case, networks, rng)
        if got is None:
            continue
        master, simulated, (refused, sim_refused) = got
        assert master == simulated, case
        assert refused == sim_refused, case
        compared += 1
        for key, value in case[2].items():
            seen[key].add(value)
    assert compared > CASES // 2
    for key, values in FLAGS.items():
        assert seen[key] == set(values), key  # every flag value compared


def test_every_flag_combination_on_one_network(networks):
    """The whole product of the stage, kernel, replicate and head flags on the reference
    network with a split that gives every worker kernels."""
    rng = random.Random(7)
    keys = ("stages", "kernels", "replicate", "head", "overlap")
    for values in itertools.product(*(FLAGS[key] for key in keys)):
        flags = {**{key: FLAGS[key][0] for key in FLAGS}, **dict(zip(keys, values, strict=True))}
        flags.update(master_block="share", resident_sync_every=20, wire_format=FLOAT32)
        for network in (SWITCHED, WIFI):
            case = ("paper-150-800", 5, flags, network, 16)
            got = _both(case, networks, rng)
            if got is not None:
                assert got[0] == got[1], case
                assert got[2][0] == got[2][1], case


def test_the_simulator_follows_the_table_where_it_drifted(networks):
    """Where the simulator's rules had drifted from the master's: a strided stage sends its
    kernels (a batch-norm stage and a convolution without bias keep them), a split on a shared
    medium is refused, a block that does not feed a convolution directly is not replicated."""
    fast = SimNode("w", 40.0, bytes_per_s=10 * MBIT)
    cluster = SimCluster(SimNode("m", 40.0), (fast, dataclasses.replace(fast, name="v")), WIFI, 1e6)

    def chosen(name, **flags):
        layers = network_layers(networks[name][1], 16)
        shares = {ly.name: (0, ly.kernels // 2, ly.kernels - ly.kernels // 2) for ly in layers}
        return step_modes(cluster, layers, shares, **flags)

    assert chosen("strided", stages="fused", kernels="resident").kernels == {
        "conv1": "resident",
        "conv2": "sent",
    }
    for name in ("batchnorm", "nobias"):
        kernels = chosen(name, stages="fused", kernels="resident").kernels
        assert set(kernels.values()) == {"resident"}, name
    split = chosen("paper-50-500", stages="fused", replicate="split")
    assert split.block == "conv1" and split.replicate == "first"
    assert split.replica.split_refused == "not split: the workers share one medium (wifi)"
    dropout = chosen("dropout", stages="fused", replicate="first")
    assert dropout.block is None
    assert dropout.replica.refused == "off: conv1's block does not feed a convolution directly"
    assert dropout.stages == {"conv1": "fused", "conv2": "fused"}
    with pytest.raises(ValueError, match="replicate 'sometimes'; expected off, first, auto"):
        chosen("tiny", replicate="sometimes")


def test_a_split_saves_the_workers_block_less_their_exchange():
    """costbytes.split_gain: equal workers on free links save all but their share of the
    block (the step waits for the slowest); on slow links the exchange costs more than that;
    fewer than two workers: nothing."""
    from hetconv.costbytes import split_gain

    block, consumer = network_layers("paper-150-800", 16)
    inf = float("inf")
    assert split_gain(block, consumer, [1.0] * 4, [inf] * 4) == pytest.approx(0.75)
    assert split_gain(block, consumer, [1.0], [inf]) == 0.0
    # each worker takes 12 of 16 images' output in, and sends 12 rows out, backward
    row = 150 * 16 * 16 * 4
    slow = split_gain(block, consumer, [1.0] * 4, [1e6] * 4)
    assert slow == pytest.approx(0.75 - 24 * row / 1e6 + 4 * block.images_bytes * 0.75 / 1e6)
    assert slow < 0
    # a slower worker gets fewer images: it still waits longest, but for less than its whole
    uneven = split_gain(block, consumer, [1.0, 1.0, 1.0, 3.0], [inf] * 4)
    assert 0 < uneven < 3.0


def test_auto_splits_the_block_where_compute_dominates_and_not_where_the_exchange_does(
    monkeypatch,
):
    """--replicate auto: replicated where the cost model says so, and then split by images
    among the workers where that is predicted faster still (slow devices, a 100 Mbit/s
    switch), on every node where the exchange would cost more (10 Mbit/s); the master's
    decision is the simulator's (above), and the line says why, in ms."""
    layers = network_layers("paper-150-800", 16)
    shares = {
        ly.name: (ly.kernels - 3 * (ly.kernels // 4), *[ly.kernels // 4] * 3) for ly in layers
    }

    def chosen(mbit):
        workers = tuple(SimNode(f"w{i}", 1.0, bytes_per_s=mbit * MBIT) for i in range(3))
        cluster = SimCluster(SimNode("m", 1.0, bytes_per_s=mbit * MBIT), workers, SWITCHED)
        return step_modes(cluster, layers, shares, "fused", "resident", "auto")

    fast = chosen(100)
    assert fast.replicate == "first" and fast.block == "conv1"  # AUTO_SPLITS is off
    assert fast.replica.split_refused.startswith("not split: the cost model predicts ")
    assert " ms saved per step, which auto does not take" in fast.replica.split_refused
    monkeypatch.setattr(modes.modetable, "AUTO_SPLITS", True)  # the rule, when it is on
    fast = chosen(100)
    assert fast.replicate == "split" and fast.block == "conv1"
    assert fast.replica.split_refused.startswith("split: the cost model predicts it ")
    assert fast.replica.split_refused.endswith(" ms faster per step")
    slow = chosen(10)
    assert slow.replicate == "first" and slow.block == "conv1"
    assert slow.replica.split_refused.startswith("not split: the cost model predicts a split ")
    # one worker with a share of the second layer: nothing to split with
    one = {ly.name: (ly.kernels - 1, 1, 0, 0) for ly in layers}
    workers = tuple(SimNode(f"w{i}", 1.0, bytes_per_s=10 * MBIT) for i in range(3))
    lone = step_modes(
        SimCluster(SimNode("m", 1.0, bytes_per_s=10 * MBIT), workers, SWITCHED),
        layers, one, "fused", "resident", "auto",
    )  # fmt: skip
    assert lone.replicate == "first"
    assert lone.replica.split_refused == "not split: fewer than two workers share the block"
