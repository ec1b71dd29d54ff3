"""A training step in the cost model (:mod:`hetconv.costmodel`): forward then backward of
every conv layer, one after the other, plus the master's non-convolutional work ("comp"), each
layer in the modes the mode table (:mod:`hetconv.modetable`) gives it, or as a trace says it
ran. As in the trace, a call's convolution time is its slowest node's compute and its
communication the rest of its wall time.

The modes, as :func:`step_modes` and :func:`simulate_step` take them: ``stages`` as ``hetconv
train --stages``: ``"unfused"``, ``"fused"`` (every layer with a stage) or ``"auto"``
(:func:`~hetconv.costbytes.stage_mode` per layer); or per layer name, one of those (as a
trace's ``stage_modes`` records them; a layer not named: unfused).

``kernels`` as ``hetconv train --kernels``: ``"sent"``, ``"resident"`` or ``"auto"``
(:func:`~hetconv.costbytes.kernel_mode`), or per layer name; only fused layers at stride 1
keep their kernels.

``replicate`` ``"first"``: the first layer's block is computed by every node
(:mod:`hetconv.replica`) where the mode table allows it
(:func:`~hetconv.modetable.replica_refusal`; with per-layer ``stages``, as given): the
master computes it alone (no calls) and each worker again in the second layer's calls,
which move the images instead of that layer's input (the second layer must run fused); the
master's backward of it runs in the second layer's backward phase, after its own piece, as
the workers compute (when the master computes a share). A per-layer ``stages`` mapping may
name the block ``"replicated"`` instead (as a trace's ``stage_modes`` do). ``"auto"``:
where the mode table predicts it faster (:func:`~hetconv.modetable.replica_gain`, on the
nodes' own probes), split as ``"split"`` where it predicts that faster still
(:func:`~hetconv.modetable.split_gain`). ``"split"``: as ``"first"``, the workers with a
share of the second layer splitting the block by images in proportion to their speed on it
(:mod:`hetconv.split`; not on Wi-Fi, where the flags ask it), or as ``split_images`` says
(block name -> each one's images, as a trace's ``replica_split`` records them; given, the
block is split whatever ``replicate``). ``"split_all"``: as ``"split"``, the master one of
the peers where it computes (first, as ``split_master`` says for a trace's blocks: block
name -> the master's index in ``split_images``): it computes the block on its own images,
and its exchange of parts on its port, in the block's forward phase (which ends once every
worker's output is in) and in the next layer's backward phase.

``overlap`` as ``hetconv train --overlap``: ``"off"``, ``"on"`` (every fused layer whose
stage holds no batch norm) or ``"auto"`` (:func:`~hetconv.costbytes.overlap_images`); or
per layer name, the images per group (as a trace's ``overlap_images`` records them; 0 or
not named: none).

``head`` as ``hetconv train --head``: ``"master"``, ``"split"`` or ``"auto"`` (either:
the layer whose stage feeds the final fc directly, :attr:`ConvLayer.head`, computes it on
the nodes where its kernels are resident, :mod:`hetconv.head`); or the layer names that
do (as a trace's ``heads`` records them). A split head's layer does not overlap.

``sync_every``: steps between the syncs of resident slices (``hetconv train
--resident-sync-every``), their bytes amortised over them; 0: none (a run shorter than
that interval, or steps between syncs).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from hetconv import modetable
from hetconv.costbytes import _split_replicas
from hetconv.costcluster import WIFI, SimCluster, SimNode
from hetconv.costlayer import PhaseResult, _exchange_seconds, simulate_layer_phase
from hetconv.head import MASTER as HEAD_MASTER
from hetconv.modetable import ModeFlags
from hetconv.overlap import OFF as OVERLAP_OFF
from hetconv.replica import AUTO as REPLICATE_AUTO
from hetconv.replica import FIRST as REPLICATE_FIRST
from hetconv.replica import MASTER_BLOCK_SHARE, REPLICATED
from hetconv.replica import OFF as REPLICATE_OFF
from hetconv.replica import SPLIT as REPLICATE_SPLIT
from hetconv.replica import SPLIT_ALL as REPLICATE_SPLIT_ALL
from hetconv.resident import RESIDENT, SENT
from hetconv.stages import AUTO, FUSED, UNFUSED
from hetconv.workload import BACKWARD, FORWARD, PHASES, ConvLayer


@dataclass(frozen=True)
class StepResult:
    """A simulated step, in the trace's terms, and the master's local step for comparison."""

    step_s: float
    comm_s: float
    conv_s: float
    comp_s: float
    local_s: float
    shares: dict[str, tuple[int, ...]]
    bytes: int
    phases: tuple[PhaseResult, ...]

    @property
    def speedup(self) -> float:
        """Local training on the master alone / this step."""
        return self.local_s / self.step_s

    @property
    def amdahl_bound(self) -> float:
        """The speedup if convolutions and communication took no time at all."""
        return self.local_s / self.comp_s if self.comp_s > 0 else math.inf

    def workers_used(self) -> int:
        """Workers with a share of at least one layer."""
        if not self.shares:
            return 0
        width = len(next(iter(self.shares.values())))
        return sum(any(s[i] for s in self.shares.values()) for i in range(1, width))


def local_step_seconds(master: SimNode, layers: Sequence[ConvLayer], comp_s: float) -> float:
    """The step of local training on ``master`` alone: every convolution, no transfers."""
    # Summed phase by phase, as simulate_step sums, so one node gives exactly speedup 1.
    conv = sum(
        master.conv_seconds(layer, layer.kernels, layer.passes(phase))
        for layer in layers
        for phase in PHASES
    )
    return conv + comp_s


# -- the modes of a step -------------------------------------------------------------------------


@dataclass(frozen=True)
class StepModes:
    """How a simulated step runs each layer: ``stages`` (fused, unfused or replicated),
    ``kernels`` (resident or sent), ``heads`` (layer -> the classes of the split head its stage
    computes), ``overlap`` (layer -> images per group), ``block`` (the replicated block, or
    None) and how it splits (``replicate``: first, split or split_all), and the mode table's
    ``replica`` decision where the flags asked it (None: off, or as given)."""

    stages: dict[str, str] = field(default_factory=dict)
    kernels: dict[str, str] = field(default_factory=dict)
    heads: dict[str, int] = field(default_factory=dict)
    overlap: dict[str, int] = field(default_factory=dict)
    block: str | None = None
    replicate: str = REPLICATE_OFF
    replica: modetable.ReplicaDecision | None = None


def _flags(
    cluster: SimCluster, stages, kernels, replicate, overlap, head, sync_every, master_block
) -> ModeFlags:
    """The mode flags among the arguments (a per-layer mapping is no flag: its place holds the
    default), in the cluster's wire format and master."""
    return ModeFlags(
        stages=UNFUSED if isinstance(stages, Mapping) else stages,
        kernels=SENT if isinstance(kernels, Mapping) else kernels,
        replicate=replicate,
        master_block=master_block,
        overlap=OVERLAP_OFF if isinstance(overlap, Mapping) else overlap,
        head=HEAD_MASTER if isinstance(head, Mapping) else head,
        resident_sync_every=sync_every,
        wire_format=cluster.wire.format,
        master_compute=cluster.master_compute,
    )


def _check_given(layers: Sequence[ConvLayer], stages, kernels) -> None:
    """Per-layer modes as a trace records them: known values, a replicated block first of
    several layers."""
    for mode in kernels.values() if isinstance(kernels, Mapping) else ():
        if mode not in (RESIDENT, SENT, AUTO):
            raise ValueError(f"kernels {mode!r}; expected resident, sent or auto")
    if not isinstance(stages, Mapping):
        return
    for name, mode in stages.items():
        if mode not in (FUSED, UNFUSED, AUTO, REPLICATED):
            raise ValueError(f"stages {mode!r}; expected fused, unfused, auto or replicated")
        if mode == REPLICATED and (len(layers) < 2 or name != layers[0].name):
            raise ValueError(f"{name}: only the first of several layers replicates")


def _split(shares: Mapping[str, Sequence[int]], layer: ConvLayer) -> tuple[int, ...]:
    return tuple(int(s) for s in shares[layer.name])


def _gain(
    cluster: SimCluster, flags: ModeFlags, layers, shares, first: ConvLayer, split: bool = False
) -> float | None:
    """:func:`~hetconv.modetable.replica_gain` (``split``: :func:`~hetconv.modetable.split_gain`)
    on the simulated nodes, their probes as a master's probing would time them (a master that
    does not compute probes nothing)."""
    consumer = next(layer for layer in layers if layer.name == first.feeds)
    probes = [
        {first.name: node.probe_seconds(first), consumer.name: node.probe_seconds(consumer)}
        for node in cluster.nodes
    ]
    if not cluster.master_compute:
        probes[0] = {}
    seconds = [modetable.block_seconds(probes[0], p, first.name, consumer.name) for p in probes]
    links = [node.bytes_per_s for node in cluster.workers]
    wifi = cluster.fabric == WIFI
    split_shares = _split(shares, consumer)
    if split:
        return modetable.split_gain(flags, first, consumer, split_shares, seconds, links)
    return modetable.replica_gain(
        flags, first, consumer, split_shares, seconds, links, wifi,
        _split(shares, first) if first.name in shares else None,
    )  # fmt: skip


def _replica(cluster, flags: ModeFlags, layers, shares, stages, given: bool):
    """(the replicated block's name or None, how it splits, the table's decision or None)."""
    if not layers or flags.replicate == REPLICATE_OFF:
        block = next((name for name, mode in stages.items() if mode == REPLICATED), None)
        return block, REPLICATE_FIRST if block else REPLICATE_OFF, None
    first = layers[0]
    if given and flags.replicate != REPLICATE_AUTO:  # as the run chose it
        if len(layers) < 2:
            raise ValueError(f"{first.name}: only the first of several layers replicates")
        return first.name, flags.replicate, None
    wifi = cluster.fabric == WIFI
    decision = modetable.replica(
        flags, first, stages.get(first.feeds or ""), wifi,
        lambda: _gain(cluster, flags, layers, shares, first),
        lambda: _gain(cluster, flags, layers, shares, first, split=True),
    )  # fmt: skip
    if not decision.replicated:
        return None, REPLICATE_OFF, decision
    how = REPLICATE_FIRST
    if decision.split_all:
        how = REPLICATE_SPLIT_ALL
    elif decision.split:
        how = REPLICATE_SPLIT
    return first.name, how, decision


def step_modes(
    cluster: SimCluster,
    layers: Sequence[ConvLayer],
    shares: Mapping[str, Sequence[int]],
    stages: str | Mapping[str, str] = UNFUSED,
    kernels: str | Mapping[str, str] = SENT,
    replicate: str = REPLICATE_OFF,
    overlap: str | Mapping[str, int] = OVERLAP_OFF,
    head: str | Mapping[str, object] = HEAD_MASTER,
    sync_every: int = modetable.DEFAULT_SYNC_EVERY,
    master_block: str = MASTER_BLOCK_SHARE,
) -> StepModes:
    """The modes :func:`simulate_step` runs each layer in (its arguments of those names): a
    flag is decided by the mode table (:mod:`hetconv.modetable`) per layer, in the order the
    master decides them at prepare (stage modes, the replicated block, kernel modes, the split
    head, overlap), on ``shares``; a per-layer mapping is what a run chose (a trace's, the
    cluster's), kept where the layer allows it, and with it ``replicate`` as given.
    ``master_block`` (``hetconv train --master-block``) decides only whether the master
    computes images of a ``split_all`` block (:attr:`StepModes.replica`): the step counts it
    computing its share."""
    flags = _flags(cluster, stages, kernels, replicate, overlap, head, sync_every, master_block)
    _check_given(layers, stages, kernels)
    modes = {}
    for layer in layers:
        given = stages.get(layer.name, UNFUSED) if isinstance(stages, Mapping) else stages
        if given == REPLICATED:
            modes[layer.name] = REPLICATED
            continue
        modes[layer.name] = modetable.stage_mode(
            dataclasses.replace(flags, stages=given), layer, _split(shares, layer)
        )
    resolved = isinstance(stages, Mapping)
    block, how, decision = _replica(cluster, flags, layers, shares, modes, resolved)
    if block is not None:
        modes[block] = REPLICATED
    kept = {}
    for layer in layers:
        given = kernels.get(layer.name, SENT) if isinstance(kernels, Mapping) else kernels
        mine = dataclasses.replace(flags, kernels=given)
        kept[layer.name] = modetable.kernel_mode(
            mine, layer, modes[layer.name], _split(shares, layer)
        )
    heads = _heads(flags, layers, kept, head)
    images = {}
    for layer in layers:
        if isinstance(overlap, Mapping):
            fused = modes[layer.name] == FUSED and layer.name not in heads
            images[layer.name] = int(overlap.get(layer.name, 0)) if fused else 0
        else:
            images[layer.name] = modetable.overlap_images(
                flags, layer, modes[layer.name], layer.name in heads, _split(shares, layer)
            )
    return StepModes(modes, kept, heads, images, block, how, decision)


def _heads(flags: ModeFlags, layers, kept: Mapping[str, str], head) -> dict[str, int]:
    """Layer -> the classes of the split head its stage computes: the mode table's, or where
    ``head`` names the layers (as a trace's ``heads``), those with resident kernels."""
    if isinstance(head, Mapping):
        names = [
            ly.name for ly in layers if ly.head and kept[ly.name] == RESIDENT and ly.name in head
        ]
    else:
        names, _ = modetable.split_heads(flags, layers, kept)
    return {ly.name: ly.head for ly in layers if ly.name in names}


# -- the step ------------------------------------------------------------------------------------


def _split_block_seconds(
    cluster: SimCluster, layer: ConvLayer, parts: Mapping[str, ConvLayer], phase: str
) -> float:
    """``split_all``: the master's phase of the block split with it one of the peers: its
    own images' block and its exchange of parts (:func:`_exchange_seconds`) on its port; in
    forward it ends only once every worker's output is in (their images' block and
    exchange), so the slowest node's."""
    master = cluster.master
    own = parts[master.name]
    seconds = master.conv_seconds(own, own.kernels, own.passes(phase))
    seconds += _exchange_seconds(layer, own, master)
    if phase != FORWARD:
        return seconds
    for node in cluster.workers:
        part = parts.get(node.name)
        if part is not None:
            worker_s = node.conv_seconds(part, part.kernels, part.passes(phase))
            seconds = max(seconds, worker_s + _exchange_seconds(layer, part, node))
    return seconds


def _block_parts(
    cluster: SimCluster,
    consumer: ConvLayer,
    block: ConvLayer,
    shares: Mapping[str, Sequence[int]],
    replicate: str,
    split_images: Mapping[str, Sequence[int]] | None,
    split_master: Mapping[str, int] | None,
) -> dict[str, ConvLayer]:
    """Node name -> its part of the replicated ``block`` split by images (the master's too
    with ``split_all``), by ``split_images`` where it names the block, else in proportion to
    the nodes' speed on ``consumer``; {} when not split."""
    counts = (split_images or {}).get(block.name)
    with_master = (
        block.name in (split_master or {})
        if counts is not None
        else replicate == REPLICATE_SPLIT_ALL and cluster.master_compute
    )
    if counts is None and replicate not in (REPLICATE_SPLIT, REPLICATE_SPLIT_ALL):
        return {}
    nodes = [cluster.master, *cluster.workers]
    speed = {n.name: n.layer_gflops.get(consumer.name, n.gflops) for n in nodes}
    names = [n.name for n in cluster.workers]
    master = cluster.master.name if with_master else None
    split = tuple(int(s) for s in shares[consumer.name])
    return _split_replicas(names, split, consumer, block, speed, counts, master)


def _block_phases(
    cluster: SimCluster, block: ConvLayer, consumer: ConvLayer, parts, left: bool = False,
    chains: Mapping[str, float] | None = None,
):  # fmt: skip
    """The replicated ``block``'s phases on the master (alone, every kernel; or its own
    images and the exchange, ``parts`` naming it; ``left``: none, the block left to the
    workers, where the master holds no kernel of the resident ``consumer``), and (its
    forward, which the workers' ReplicaForward runs beside; its backward, run inside the
    consumer's backward phase). ``chains``: the block's layers after its convolution (all
    images, both passes), shared between them as the convolution's passes are."""
    phases, early, tail = [], 0.0, 0.0
    for phase in PHASES:
        chain = _chain_share(block, phase, chains or {})
        if left:
            seconds = 0.0
        elif cluster.master.name in parts:  # its own images, and the exchange
            seconds = _split_block_seconds(cluster, consumer, parts, phase)
            seconds += chain * parts[cluster.master.name].shape.n / block.shape.n
        else:  # the master alone, every kernel
            seconds = cluster.master.conv_seconds(block, block.kernels, block.passes(phase))
            seconds += chain
        if phase == FORWARD and cluster.master_compute:
            early = seconds
        if phase == BACKWARD and cluster.master_compute:
            tail, seconds = seconds, 0.0
        phases.append(PhaseResult(block.name, phase, seconds, seconds, 0.0, 0, ()))
    return phases, early, tail


def _chain_share(layer: ConvLayer | None, phase: str, chains: Mapping[str, float]) -> float:
    """The part of the layers after ``layer`` (``chains``' seconds for it, both passes) that
    ``phase`` runs: as its convolution's passes are shared."""
    if layer is None or not chains.get(layer.name):
        return 0.0
    return chains[layer.name] * layer.passes(phase) / sum(layer.passes(p) for p in PHASES)


def _checked_shares(cluster: SimCluster, shares, layer: ConvLayer) -> tuple[int, ...]:
    split = _split(shares, layer)
    if len(split) != len(cluster.nodes) or sum(split) != layer.kernels or min(split) < 0:
        raise ValueError(
            f"shares {split} for {layer.name} must be {len(cluster.nodes)} non-negative "
            f"counts (master first) summing to its {layer.kernels} kernels"
        )
    if split[0] and not cluster.master_compute:
        raise ValueError(f"shares {split} give the master kernels, but it does not compute")
    return split


def simulate_step(
    cluster: SimCluster,
    layers: Sequence[ConvLayer],
    shares: Mapping[str, Sequence[int]],
    comp_s: float,
    stages: str | Mapping[str, str] = UNFUSED,
    kernels: str | Mapping[str, str] = SENT,
    replicate: str = REPLICATE_OFF,
    overlap: str | Mapping[str, int] = OVERLAP_OFF,
    head: str | Mapping[str, object] = HEAD_MASTER,
    sync_every: int = modetable.DEFAULT_SYNC_EVERY,
    split_images: Mapping[str, Sequence[int]] | None = None,
    split_master: Mapping[str, int] | None = None,
    chains: Mapping[str, float] | None = None,
) -> StepResult:
    """One training step: forward and backward of every conv layer with ``shares`` (per layer
    name, kernels per node, master first), plus ``comp_s`` of the master's other work, in the
    modes :func:`step_modes` gives each layer (the arguments of the same names: see the
    module's note on them). ``comp_s`` stays as given, between the calls; ``chains`` (layer
    name -> the master's seconds alone, both passes) are the layers after a convolution run
    inside its calls: a fused stage's, every node on its own kernels' channels, a replicated
    block's, the master's inside the next layer's phases beside the workers' copies.
    ``split_images`` (block name -> each node's images, as a trace's ``replica_split``
    records them; given, the block is split whatever ``replicate``) and ``split_master``
    (block name -> the master's index in ``split_images``: a trace's block split with the
    master one of the peers) say how a trace's block was split."""
    chains = chains or {}
    for block, index in (split_master or {}).items():
        if index != 0:
            raise ValueError(f"{block}: the master is the split's first peer, not {index}")
    modes = step_modes(
        cluster, layers, shares, stages, kernels, replicate, overlap, head, sync_every
    )
    phases = []
    block: ConvLayer | None = None  # a replicated block, feeding the next layer
    tail = early = 0.0  # its backward and forward on the master (see _block_phases)
    parts: dict[str, ConvLayer] = {}  # the block split by images: node name -> its part
    for index, layer in enumerate(layers):
        if layer.name == modes.block:
            block, consumer = layer, layers[index + 1]
            parts = _block_parts(
                cluster, consumer, block, shares, modes.replicate, split_images, split_master
            )
            left = (
                not parts and not _split(shares, consumer)[0]
                and modes.kernels[consumer.name] == RESIDENT
            )  # fmt: skip
            done, early, tail = _block_phases(cluster, block, consumer, parts, left, chains)
            phases += done
            continue
        replica, block = block, None
        split = _checked_shares(cluster, shares, layer)
        mode = modes.stages[layer.name]
        if replica is not None and mode != FUSED:
            raise ValueError(f"{layer.name} takes a replicated block's output: it must be fused")
        worker_parts = {n: p for n, p in parts.items() if n != cluster.master.name}
        for phase in PHASES:
            result = simulate_layer_phase(
                cluster, layer, phase, split, fused=mode == FUSED,
                resident=modes.kernels[layer.name] == RESIDENT, replica=replica,
                overlap_images=modes.overlap[layer.name],
                replica_head_s=early if replica is not None else 0.0,
                head=modes.heads.get(layer.name, 0), sync_every=sync_every,
                replica_tail_s=tail if replica is not None else 0.0,
                split_replicas=worker_parts,
                replica_chain_s=_chain_share(replica, phase, chains),  # its copies'
                stage_chain_s=_chain_share(layer, phase, chains),
            )  # fmt: skip
            phases.append(result)
        tail = early = 0.0
        parts = {}
    return _step_result(cluster, layers, shares, comp_s, phases)


def _step_result(cluster: SimCluster, layers, shares, comp_s: float, phases) -> StepResult:
    comm = sum(p.comm_s for p in phases)
    conv = sum(p.conv_s for p in phases)
    return StepResult(
        step_s=comm + conv + comp_s,
        comm_s=comm,
        conv_s=conv,
        comp_s=comp_s,
        local_s=local_step_seconds(cluster.master, layers, comp_s),
        shares={name: tuple(int(v) for v in s) for name, s in shares.items()},
        bytes=sum(p.bytes for p in phases),
        phases=tuple(phases),
    )


__all__ = [
    "StepModes",
    "StepResult",
    "local_step_seconds",
    "simulate_step",
    "step_modes",
]
