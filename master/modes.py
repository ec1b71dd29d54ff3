"""How each layer runs, as the master chooses it at prepare: its stage mode (fused or not),
whether the first block is replicated, its kernel mode (resident or sent), which stage computes
the final fc (a split head), and how many images each group of its calls streams.

Each is as configured where the layer allows it, or (``auto``) what the cost model predicts
faster on the shares planned so far, by the rules of :mod:`hetconv.modetable`, which the
simulator (:func:`hetconv.costmodel.simulate_step`) applies too. These are functions of the
configuration, the layers, the nodes (their probes and links) and the current plans;
:meth:`.cluster.Cluster.prepare` calls them in order, plans the shares again as the modes
change what each layer's calls move, and keeps what they choose.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from hetconv import modetable
from hetconv.backends import Backend
from hetconv.modetable import ModeFlags
from hetconv.replica import OFF as REPLICATE_OFF
from hetconv.stages import UNFUSED
from hetconv.workload import ConvLayer

from .membership import Node
from .planning import LayerPlan
from .replica import REPLICATED, ReplicatedBlocks, block_cost_factor


def _shares(plans: Mapping[str, LayerPlan], layer: str, nodes: Sequence[Node]) -> tuple:
    """``layer``'s planned shares, or one each before it has a plan."""
    plan = plans.get(layer)
    return plan.shares if plan is not None else (1,) * len(nodes)


def stage_modes(config, layers, batch: int, plans, nodes) -> dict[str, str]:
    """Each layer's stage mode (:func:`hetconv.modetable.stage_mode`): as configured, or
    (auto) by the cost model's bytes; unfused where no channel-local layers follow the
    convolution."""
    flags = ModeFlags.of(config)
    return {
        spec.name: modetable.stage_mode(
            flags, ConvLayer.from_spec(spec, batch), _shares(plans, spec.name, nodes)
        )
        for spec in layers
    }


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
    """Whether every node computes the first convolution's block itself
    (:func:`hetconv.modetable.replica`): as configured where the network allows it, or (auto)
    where the cost model predicts the step faster, each node's whole block timed from its
    probes and the block as timed here."""
    if config.replicate == REPLICATE_OFF or not layers:
        return ReplicaChoice()
    flags = ModeFlags.of(config)
    first = ConvLayer.from_spec(layers[0], batch)
    factor = 1.0
    if modetable.replica_refusal(first, modes.get(first.feeds)) is None:
        # every node computes the whole block: what it costs beyond its conv
        probe = nodes[0].probe_seconds.get(first.name, 0.0)
        factor = block_cost_factor(backend, layers[0], batch, probe)

    def inputs():  # the consumer, its shares, each node's whole block, the workers' links
        consumer = next(spec for spec in layers if spec.name == first.feeds)
        seconds = [
            modetable.block_seconds(
                nodes[0].probe_seconds, n.probe_seconds, first.name, consumer.name, factor
            )
            for n in nodes
        ]
        links = [n.link_bytes_per_second for n in nodes[1:]]
        shares = _shares(plans, consumer.name, nodes)
        return ConvLayer.from_spec(consumer, batch), shares, seconds, links

    def gain() -> float:
        consumer, shares, seconds, links = inputs()
        block_shares = _shares(plans, first.name, nodes)
        return modetable.replica_gain(
            flags, first, consumer, shares, seconds, links, wifi, block_shares
        )

    def split_gain() -> float | None:
        consumer, shares, seconds, links = inputs()
        return modetable.split_gain(flags, first, consumer, shares, seconds, links)

    decision = modetable.replica(flags, first, modes.get(first.feeds), wifi, gain, split_gain)
    if not decision.replicated:
        return ReplicaChoice(refused=decision.refused)
    blocks = ReplicatedBlocks(
        {first.name: first.feeds}, {first.name: layers[0].stage}, decision.split,
        decision.split_all,
    )  # fmt: skip
    blocks.master_images = decision.master_images
    blocks.split_refused = decision.split_refused
    return ReplicaChoice(blocks, {first.name: factor})


def kernel_modes(config, layers, batch: int, modes: Mapping[str, str], plans, nodes):
    """Each layer's kernel mode (:func:`hetconv.modetable.kernel_mode`): resident only where
    the layer runs fused at stride 1 (batch norm and no bias allowed); as configured, or (auto)
    by the cost model."""
    flags = ModeFlags.of(config)
    return {
        spec.name: modetable.kernel_mode(
            flags,
            ConvLayer.from_spec(spec, batch),
            modes.get(spec.name, UNFUSED),
            _shares(plans, spec.name, nodes),
        )
        for spec in layers
    }


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
    ``head`` is master (:func:`hetconv.modetable.split_heads`)."""
    described = [ConvLayer.from_spec(spec, 1) for spec in layers]
    names, refused = modetable.split_heads(ModeFlags.of(config), described, kernels)
    choice = HeadChoice(refused=refused)
    for spec in layers:
        if spec.name in names:
            choice.fcs[spec.name], choice.heads[spec.name] = spec.head
    return choice


def overlap_images(config, layers, batch: int, modes, head_layers, plans, nodes):
    """Images per group of each fused layer's worker calls
    (:func:`hetconv.modetable.overlap_images`): as configured where the stage allows it, or
    (auto) where the cost model says a worker's answer streams, on the shares planned for the
    other modes. A layer with a split head (in ``head_layers``) answers logits: nothing to
    stream."""
    flags = ModeFlags.of(config)
    groups = {}
    for spec in layers:
        images = modetable.overlap_images(
            flags,
            ConvLayer.from_spec(spec, batch),
            modes.get(spec.name, UNFUSED),
            spec.name in head_layers,
            _shares(plans, spec.name, nodes),
        )
        if images:
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
        note += "".join(
            f"; split: {address} left out of the exchange: {why}"
            for address, why in blocks.left_out.items()
        )
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
