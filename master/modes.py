"""How each layer runs, as the master chooses it at prepare: its stage mode (fused or not),
whether the first block is replicated, its kernel mode (resident or sent), which stage computes
the final fc (a split head), and how many images each group of its calls streams.

Each is as configured where the layer allows it, or (``auto``) what the cost model predicts
faster on the shares planned so far. These are functions of the configuration, the layers, the
nodes (their probes and links) and the current plans; :meth:`.cluster.Cluster.prepare` calls
them in order, plans the shares again as the modes change what each layer's calls move, and
keeps what they choose.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from hetconv import costmodel
from hetconv.backends import Backend
from hetconv.head import MASTER as HEAD_MASTER
from hetconv.overlap import AUTO as OVERLAP_AUTO
from hetconv.overlap import ON as OVERLAP_ON
from hetconv.overlap import group_count, group_images
from hetconv.replica import FIRST as REPLICATE_FIRST
from hetconv.replica import MASTER_BLOCK_NONE
from hetconv.replica import OFF as REPLICATE_OFF
from hetconv.replica import SPLIT_ALL as REPLICATE_SPLIT_ALL
from hetconv.replica import SPLITS as REPLICATE_SPLITS
from hetconv.resident import RESIDENT, SENT
from hetconv.stages import AUTO, FUSED, UNFUSED
from hetconv.workload import ConvLayer

from .membership import Node
from .planning import LayerPlan
from .replica import REPLICATED, ReplicatedBlocks, block_cost_factor, block_seconds, replica_refusal


def _shares(plans: Mapping[str, LayerPlan], layer: str, nodes: Sequence[Node]) -> tuple:
    """``layer``'s planned shares, or one each before it has a plan."""
    plan = plans.get(layer)
    return plan.shares if plan is not None else (1,) * len(nodes)


def stage_modes(config, layers, batch: int, plans, nodes) -> dict[str, str]:
    """Each layer's stage mode: as configured, or (auto) by the cost model's bytes; unfused
    where no channel-local layers follow the convolution."""
    modes = {}
    for spec in layers:
        mode = config.stages
        if spec.stage is None:
            mode = UNFUSED
        elif mode == AUTO:
            shares = plans[spec.name].shares if spec.name in plans else None
            layer = ConvLayer.from_spec(spec, batch)
            mode = costmodel.stage_mode(layer, spec.stage, shares or (1,) * len(nodes))
        modes[spec.name] = mode
    return modes


@dataclass
class ReplicaChoice:
    """Whether the first block is replicated (:mod:`hetconv.replica`): ``blocks`` (None: not),
    what the whole block costs over its convolution's probe, and why not (None: it is, or the
    configuration said off)."""

    blocks: ReplicatedBlocks | None = None
    block_cost: dict[str, float] = field(default_factory=dict)
    refused: str | None = None


def replica(
    config, layers, batch: int, modes: Mapping[str, str], plans, nodes, backend: Backend, wifi
) -> ReplicaChoice:
    """Whether every node computes the first convolution's block itself: as configured where
    the network allows it, or (auto) where the cost model predicts the step faster."""
    if config.replicate == REPLICATE_OFF or not layers:
        return ReplicaChoice()
    first = layers[0]
    why = replica_refusal(first, modes)
    factor = 1.0
    if why is None:  # every node computes the whole block: what it costs beyond its conv
        probe = nodes[0].probe_seconds.get(first.name, 0.0)
        factor = block_cost_factor(backend, first, batch, probe)
    if why is None and config.replicate not in (REPLICATE_FIRST, *REPLICATE_SPLITS):
        consumer = next(spec for spec in layers if spec.name == first.feeds)
        shares = _shares(plans, consumer.name, nodes)
        workers = [n for i, n in enumerate(nodes) if i and shares[i]]
        gain = costmodel.replicate_gain(
            ConvLayer.from_spec(first, batch),
            ConvLayer.from_spec(consumer, batch),
            [
                block_seconds(nodes[0], n, first.name, consumer.name, factor)
                for n in [nodes[0], *workers]
            ],
            [n.link_bytes_per_second for n in workers],
            wifi=wifi,
            fmt=config.wire_format,
        )
        if gain <= 0:
            why = f"the cost model predicts it {-1e3 * gain:.1f} ms slower per step"
    if why is not None:
        return ReplicaChoice(refused=f"off: {why}")
    # On one shared medium every byte the workers exchanged would cross it with the master's.
    split = config.replicate in REPLICATE_SPLITS and not wifi
    # The master a peer of the split only where it computes.
    split_all = split and config.replicate == REPLICATE_SPLIT_ALL and config.master_compute
    blocks = ReplicatedBlocks(
        {first.name: first.feeds}, {first.name: first.stage}, split and not split_all, split_all
    )
    blocks.master_images = config.master_block != MASTER_BLOCK_NONE
    if config.replicate in REPLICATE_SPLITS and wifi:
        blocks.split_refused = "not split: the workers share one medium (wifi)"
    elif split and not split_all and config.replicate == REPLICATE_SPLIT_ALL:
        blocks.split_refused = "split among the workers only: the master does not compute"
    return ReplicaChoice(blocks, {first.name: factor})


def kernel_modes(config, layers, batch: int, modes: Mapping[str, str], plans, nodes):
    """Each layer's kernel mode: resident only where the layer runs fused at stride 1 without
    batch norm; as configured, or (auto) by the cost model."""
    kernels = {}
    for spec in layers:
        mode = config.kernels
        # A strided convolution runs as the stride-1 one of its phases: the executor gets
        # a rearranged copy of the kernels each step, not the model's array to keep.
        strided = getattr(spec, "phased_from", None) is not None
        # Resident stages do not run batch norm (its parameters stay with the master): a
        # stage holding one sends its kernels.
        batchnorm = spec.stage is not None and spec.stage.batchnorms > 0
        if modes.get(spec.name) != FUSED or strided or batchnorm:
            mode = SENT
        elif mode == AUTO:
            shares = plans[spec.name].shares if spec.name in plans else None
            mode = costmodel.kernel_mode(
                ConvLayer.from_spec(spec, batch),
                spec.stage,
                shares or (1,) * len(nodes),
                config.resident_sync_every,
                config.wire_format,
            )
        kernels[spec.name] = mode
    return kernels


@dataclass
class HeadChoice:
    """Which stage computes the final fc on the nodes (:mod:`hetconv.head`): layer -> the
    fc's classes, layer -> the fc's name, and why none does (None: one does, or the
    configuration said master)."""

    heads: dict[str, int] = field(default_factory=dict)
    fcs: dict[str, str] = field(default_factory=dict)
    refused: str | None = None


def heads(config, layers, kernels: Mapping[str, str]) -> HeadChoice:
    """The layer whose fused, resident stage feeds the final fc directly computes it, unless
    ``head`` is master."""
    choice = HeadChoice()
    if config.head == HEAD_MASTER:
        return choice
    for spec in layers:
        if not spec.head:
            continue
        if kernels.get(spec.name) != RESIDENT:
            choice.refused = (
                f"off: {spec.name}'s kernels are not resident "
                f"({kernels.get(spec.name, SENT)}); the fc's columns would travel every step"
            )
            return choice
        choice.fcs[spec.name], choice.heads[spec.name] = spec.head
    if not choice.heads:  # (the loop returned on a refusal)
        choice.refused = "off: no fused stage feeds the final fc directly"
    return choice


def overlap_images(config, layers, batch: int, modes, head_layers, plans, nodes):
    """Images per group of each fused layer's worker calls (:mod:`hetconv.overlap`): as
    configured where the stage allows it, or (auto) where the cost model says a worker's
    answer streams, on the shares planned for the other modes. A layer with a split head
    (in ``head_layers``) answers logits: nothing to stream."""
    groups = {}
    for spec in layers:
        if modes.get(spec.name) != FUSED or spec.stage is None or spec.name in head_layers:
            continue
        images = 0
        if config.overlap == OVERLAP_ON and not spec.stage.batchnorms:
            images = group_images(batch)
        elif config.overlap == OVERLAP_AUTO:
            images = costmodel.overlap_images(
                ConvLayer.from_spec(spec, batch),
                spec.stage,
                _shares(plans, spec.name, nodes),
                config.wire_format,
            )
        if images and group_count(batch, images) > 1:
            groups[spec.name] = images
    return groups


def describe_head(choice: HeadChoice) -> str:
    """One line: which stage computes the fc on the nodes, or why none does."""
    if choice.heads:
        return ", ".join(
            f"{name} answers logits ({classes} classes), the fc's columns resident"
            for name, classes in choice.heads.items()
        )
    return choice.refused or "off"


def describe_overlap(groups: Mapping[str, int]) -> str:
    """One line: which fused layers run their calls in image groups, of how many."""
    if not groups:
        return "off"
    return ", ".join(f"{name} in groups of {images} images" for name, images in groups.items())


def describe_replica(blocks: ReplicatedBlocks, block_cost: Mapping[str, float], refused) -> str:
    """One line: which block is replicated into which layer, or why none is."""
    if blocks.feeds:
        if blocks.split_all and not blocks.master_images:
            where = (
                "split by images among the workers, who exchange the parts with each other and "
                "the master (which computes none of it)"
            )
        elif blocks.split_all:
            where = "split by images among the master and the workers, who exchange the parts"
        elif blocks.split:
            where = (
                "by the master whole and split by images among the workers, who exchange the parts"
            )
        else:
            where = "on every node"
        note = f"; {blocks.split_refused}" if blocks.split_refused else ""
        return ", ".join(
            f"{block} computed {where}, {consumer}'s input not sent (the whole block "
            f"costs {block_cost.get(block, 1.0):.1f}x its convolution's probe){note}"
            for block, consumer in blocks.feeds.items()
        )
    return refused or "off"


__all__ = [
    "REPLICATED",
    "HeadChoice",
    "ReplicaChoice",
    "describe_head",
    "describe_overlap",
    "describe_replica",
    "heads",
    "kernel_modes",
    "overlap_images",
    "replica",
    "stage_modes",
]
