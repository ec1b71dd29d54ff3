"""The mode table: how each layer runs, by one set of rules for the master and the simulator.

A layer's modes are its stage mode (fused or not), its kernel mode (resident or sent), whether
the network's first block is replicated into it and how that block splits, whether its stage
computes the final fc (a split head), and how many images each group of its calls streams.
:mod:`hetconv.master.modes` asks these functions at prepare (the cluster's nodes, probes and
planned shares), :func:`hetconv.costmodel.simulate_step` asks them for a simulated cluster, so
the plan a user is shown (``hetconv simulate``, ``hetconv plan``, the cluster's predicted step)
describes the run that happens.

Each rule is a function of :class:`ModeFlags` (the mode flags of ``hetconv train``), one layer
as the core describes it (:class:`~hetconv.workload.ConvLayer`: its shape, its stage, the fc
its stage feeds, whether it is strided, the convolution its stage feeds) and the shares planned
so far (kernels per node, master first). An ``auto`` decision is the cost model's
(:mod:`hetconv.costbytes`): fewer bytes on the master's link, in the run's wire format.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from hetconv import costbytes
from hetconv.formats import FLOAT32, TensorFormat
from hetconv.head import HEAD_MODES
from hetconv.head import MASTER as HEAD_MASTER
from hetconv.overlap import AUTO as OVERLAP_AUTO
from hetconv.overlap import OFF as OVERLAP_OFF
from hetconv.overlap import ON as OVERLAP_ON
from hetconv.overlap import OVERLAP_MODES, group_count, group_images
from hetconv.replica import AUTO as REPLICATE_AUTO
from hetconv.replica import MASTER_BLOCK_NONE, MASTER_BLOCK_SHARE, MASTER_BLOCKS, REPLICATE_MODES
from hetconv.replica import OFF as REPLICATE_OFF
from hetconv.replica import SPLIT_ALL as REPLICATE_SPLIT_ALL
from hetconv.replica import SPLITS as REPLICATE_SPLITS
from hetconv.resident import KERNEL_MODES, RESIDENT, SENT
from hetconv.stages import AUTO, FUSED, STAGE_MODES, UNFUSED
from hetconv.workload import ConvLayer

#: steps between syncs of resident slices unless the run says otherwise
DEFAULT_SYNC_EVERY = 20


def _one_of(values: Sequence[str]) -> str:
    return f"{', '.join(values[:-1])} or {values[-1]}" if len(values) > 1 else values[0]


@dataclass(frozen=True)
class ModeFlags:
    """The mode flags of a run (``hetconv train``'s, which ``simulate`` and ``plan`` share):
    ``stages``, ``kernels``, ``replicate``, ``master_block``, ``overlap``, ``head`` as the
    flags of those names; ``resident_sync_every``: steps between syncs of resident slices;
    ``wire_format``: activations' format on the wire; ``master_compute``: whether the master
    computes a share.

    Raises:
        ValueError: a value a flag does not take.
    """

    stages: str = UNFUSED
    kernels: str = SENT
    replicate: str = REPLICATE_OFF
    master_block: str = MASTER_BLOCK_SHARE
    overlap: str = OVERLAP_OFF
    head: str = HEAD_MASTER
    resident_sync_every: int = DEFAULT_SYNC_EVERY
    wire_format: TensorFormat = FLOAT32
    master_compute: bool = True

    def __post_init__(self) -> None:
        for name, allowed in (
            ("stages", STAGE_MODES),
            ("kernels", KERNEL_MODES),
            ("replicate", REPLICATE_MODES),
            ("master_block", MASTER_BLOCKS),
            ("overlap", OVERLAP_MODES),
            ("head", HEAD_MODES),
        ):
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"{name} {value!r}; expected {_one_of(allowed)}")
        every = self.resident_sync_every
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise ValueError(f"resident sync interval must be an int >= 0 steps, got {every!r}")
        if not isinstance(self.wire_format, TensorFormat):
            raise ValueError(f"wire format {self.wire_format!r} is not a TensorFormat")

    @classmethod
    def of(cls, config) -> ModeFlags:
        """The flags of a configuration that has attributes of these names
        (:class:`hetconv.master.config.ClusterConfig`)."""
        return cls(**{name: getattr(config, name) for name in cls.__dataclass_fields__})


# -- per layer -----------------------------------------------------------------------------------


def stage_mode(flags: ModeFlags, layer: ConvLayer, shares: Sequence[int]) -> str:
    """``layer``'s stage mode: unfused without channel-local layers after it; else as
    ``flags.stages`` says, ``auto`` by the bytes on the master's link
    (:func:`~hetconv.costbytes.stage_mode`)."""
    if layer.stage is None:
        return UNFUSED
    if flags.stages == AUTO:
        return costbytes.stage_mode(layer, layer.stage, shares, flags.wire_format)
    return flags.stages


def keeps_kernels(layer: ConvLayer, mode: str) -> bool:
    """Whether ``layer`` may keep its kernels on the workers in stage mode ``mode``: only
    fused, at stride 1 (a strided layer runs as the stride-1 convolution of its phases, whose
    kernels are a rearranged copy each step). Batch norm in its stage runs there with its
    parameters sent each call (they stay with the master), and a layer without bias keeps its
    zero bias on the workers, never updated (:mod:`hetconv.master.resident`)."""
    return mode == FUSED and not layer.strided


def kernel_mode(flags: ModeFlags, layer: ConvLayer, mode: str, shares: Sequence[int]) -> str:
    """``layer``'s kernel mode in stage mode ``mode``: sent where it cannot keep them
    (:func:`keeps_kernels`); else as ``flags.kernels`` says, ``auto`` by the bytes
    (:func:`~hetconv.costbytes.kernel_mode`, the syncs amortised)."""
    if not keeps_kernels(layer, mode):
        return SENT
    if flags.kernels == AUTO:
        return costbytes.kernel_mode(
            layer, layer.stage, shares, flags.resident_sync_every, flags.wire_format
        )
    return flags.kernels


def overlap_images(
    flags: ModeFlags, layer: ConvLayer, mode: str, split_head: bool, shares: Sequence[int]
) -> int:
    """Images per group of ``layer``'s worker calls (:mod:`hetconv.overlap`), 0 for none:
    only a fused stage that does not answer logits (``split_head``) streams; ``on`` where its
    stage holds no batch norm, ``auto`` by :func:`~hetconv.costbytes.overlap_images`; and only
    where the batch makes more than one group."""
    if mode != FUSED or layer.stage is None or split_head:
        return 0
    images = 0
    if flags.overlap == OVERLAP_ON and not layer.stage.batchnorms:
        images = group_images(layer.shape.n)
    elif flags.overlap == OVERLAP_AUTO:
        images = costbytes.overlap_images(layer, layer.stage, shares, flags.wire_format)
    return images if images and group_count(layer.shape.n, images) > 1 else 0


def split_heads(
    flags: ModeFlags, layers: Sequence[ConvLayer], kernels: Mapping[str, str]
) -> tuple[list[str], str | None]:
    """The layers whose stage computes the final fc on the nodes (:mod:`hetconv.head`), and
    why none does (None: one does, or ``head`` is master): the layer whose stage feeds the fc
    directly (:attr:`~hetconv.workload.ConvLayer.head`), where its kernels are resident."""
    if flags.head == HEAD_MASTER:
        return [], None
    names = []
    for layer in layers:
        if not layer.head:
            continue
        if kernels.get(layer.name) != RESIDENT:
            return [], (
                f"off: {layer.name}'s kernels are not resident "
                f"({kernels.get(layer.name, SENT)}); the fc's columns would travel every step"
            )
        names.append(layer.name)
    return names, None if names else "off: no fused stage feeds the final fc directly"


# -- the replicated first block ------------------------------------------------------------------


def replica_refusal(first: ConvLayer, consumer_mode: str | None) -> str | None:
    """Why the block of ``first`` (the network's first convolution) cannot be replicated into
    the convolution it feeds (in stage mode ``consumer_mode``); None when it can."""
    if first.need_input_grad:
        return f"{first.name} is not the network's first layer"
    if first.strided:
        return f"{first.name} is strided"
    if first.stage is None or first.feeds is None:
        return f"{first.name}'s block does not feed a convolution directly"
    if first.stage.batchnorms:
        return f"{first.name}'s block holds batch norm"
    if consumer_mode != FUSED:
        return f"{first.feeds} does not run as a fused stage (--stages)"
    return None


@dataclass(frozen=True)
class ReplicaDecision:
    """Whether the first block is replicated, and how: ``refused`` (None: it is, or the flags
    say off) says why not; ``split``: split by images (among the workers, the master
    computing it whole; or, ``split_all``, among the master and the workers);
    ``master_images``: with ``split_all``, whether the master computes images of its own;
    ``split_refused``: why a split the flags asked for is not (or not with the master), and
    with ``auto`` why it is or is not split (the seconds per step the cost model predicts a
    split to save)."""

    replicated: bool = False
    refused: str | None = None
    split: bool = False
    split_all: bool = False
    master_images: bool = True
    split_refused: str | None = None


def replica(
    flags: ModeFlags,
    first: ConvLayer,
    consumer_mode: str | None,
    wifi: bool,
    gain: Callable[[], float] | None = None,
    split_gain: Callable[[], float | None] | None = None,
) -> ReplicaDecision:
    """Whether every node computes ``first``'s block itself (:mod:`hetconv.replica`): as the
    flags say where :func:`replica_refusal` allows it, ``auto`` where ``gain()`` (seconds per
    step saved, :func:`replica_gain`) is positive, and then split by images among the workers
    where ``split_gain()`` (:func:`split_gain`: seconds per step a split saves over the block
    whole on every worker; None: fewer than two workers share it) is positive too. On one
    shared medium (``wifi``) a split is refused: every byte the workers exchanged would cross
    it with the master's; the master is a peer of ``split_all`` only where it computes."""
    if flags.replicate == REPLICATE_OFF:
        return ReplicaDecision()
    why = replica_refusal(first, consumer_mode)
    if why is None and flags.replicate == REPLICATE_AUTO and gain is not None:
        seconds = gain()
        if seconds <= 0:
            why = f"the cost model predicts it {-1e3 * seconds:.1f} ms slower per step"
    if why is not None:
        return ReplicaDecision(refused=f"off: {why}")
    if flags.replicate == REPLICATE_AUTO:
        return _auto_split(flags, wifi, split_gain)
    asked = flags.replicate in REPLICATE_SPLITS
    split = asked and not wifi
    split_all = split and flags.replicate == REPLICATE_SPLIT_ALL and flags.master_compute
    refused = None
    if asked and wifi:
        refused = "not split: the workers share one medium (wifi)"
    elif split and not split_all and flags.replicate == REPLICATE_SPLIT_ALL:
        refused = "split among the workers only: the master does not compute"
    master_images = flags.master_block != MASTER_BLOCK_NONE
    return ReplicaDecision(True, None, split, split_all, master_images, refused)


#: Whether ``--replicate auto`` splits the block where :func:`split_gain` predicts it faster.
#: Off: on the scaled testbed (paper-150-800, batch 16, 4 workers at 0.36 of a core, switched)
#: the split it chose took 1.04 s per step against 0.63 s with the block whole on every worker
#: (``benchmarks/vs_ddp.py --mode default`` against ``--mode exact_head``): a step whose split
#: parts are spot-checked took 0.7 s more, and the others about 5 % more, neither of which the
#: gain counts. ``--replicate split`` still asks for it.
AUTO_SPLITS = False


def _auto_split(flags: ModeFlags, wifi: bool, split_gain) -> ReplicaDecision:
    """``auto``'s replicated block: split by images among the workers where the cost model
    predicts it faster than every worker computing it whole (never on one shared medium), and
    only while :data:`AUTO_SPLITS` says so; the note says what the cost model predicts."""
    master_images = flags.master_block != MASTER_BLOCK_NONE
    if wifi:
        note = "not split: the workers share one medium (wifi)"
        return ReplicaDecision(True, None, master_images=master_images, split_refused=note)
    seconds = split_gain() if split_gain is not None else None
    if seconds is None:
        note = "not split: fewer than two workers share the block"
    elif seconds <= 0:
        note = f"not split: the cost model predicts a split {-1e3 * seconds:.1f} ms slower per step"
    elif AUTO_SPLITS:
        note = f"split: the cost model predicts it {1e3 * seconds:.1f} ms faster per step"
    else:
        note = (
            f"not split: the cost model predicts {1e3 * seconds:.1f} ms saved per step, which "
            "auto does not take (measured slower: its spot checks and messages are not counted; "
            "--replicate split asks for it)"
        )
    split = AUTO_SPLITS and seconds is not None and seconds > 0
    return ReplicaDecision(True, None, split, False, master_images, note)


def block_seconds(
    master_probes: Mapping[str, float],
    node_probes: Mapping[str, float],
    block: str,
    consumer: str,
    factor: float = 1.0,
) -> float:
    """A node's whole replicated block, forward and backward, in seconds: the master's probe
    of the block's convolution times ``factor`` (the whole block over its convolution), times
    how much slower the node is than the master on the probe of the layer the block feeds
    (that long probe varies less than the block convolution's own); without the consumer's
    probes, the node's own block probe times ``factor``."""
    mine, theirs = node_probes.get(consumer, 0.0), master_probes.get(consumer, 0.0)
    base = master_probes.get(block, 0.0) * factor
    if mine > 0 and theirs > 0 and base > 0:
        return base * mine / theirs
    return node_probes.get(block, 0.0) * factor


def replica_gain(
    flags: ModeFlags,
    block: ConvLayer,
    consumer: ConvLayer,
    shares: Sequence[int],
    seconds: Sequence[float],
    links: Sequence[float],
    wifi: bool,
    block_shares: Sequence[int] | None = None,
) -> float:
    """Seconds per step a replicated ``block`` feeding ``consumer`` is predicted to save
    (:func:`~hetconv.costbytes.replicate_gain`), for the workers with a share of the consumer
    (``shares``, master first): ``seconds``, each node's whole block (master first,
    :func:`block_seconds`); ``links``, each worker's link (bytes/s); ``block_shares``, the
    block's own kernel shares (master first): the slowest node's part of its block is what the
    split by kernels costs anyway (None: nothing)."""
    workers = [i for i in range(1, len(shares)) if shares[i]]
    split_seconds = 0.0
    if block_shares is not None and block.kernels:
        split_seconds = max(
            (seconds[i] * block_shares[i] / block.kernels for i in range(len(block_shares))
             if block_shares[i]),
            default=0.0,
        )  # fmt: skip
    return costbytes.replicate_gain(
        block,
        consumer,
        [seconds[0], *(seconds[i] for i in workers)],
        [links[i - 1] for i in workers],
        wifi=wifi,
        fmt=flags.wire_format,
        split_seconds=split_seconds,
    )


def split_gain(
    flags: ModeFlags,
    block: ConvLayer,
    consumer: ConvLayer,
    shares: Sequence[int],
    seconds: Sequence[float],
    links: Sequence[float],
) -> float | None:
    """Seconds per step splitting the replicated ``block`` by images among the workers with a
    share of ``consumer`` (``shares``, master first) is predicted to save over each computing
    it whole (:func:`~hetconv.costbytes.split_gain`); ``seconds`` and ``links`` as
    :func:`replica_gain`'s. None when fewer than two workers (or images) share it."""
    workers = [i for i in range(1, len(shares)) if shares[i]]
    if len(workers) < 2 or consumer.shape.n < len(workers):
        return None
    return costbytes.split_gain(
        block,
        consumer,
        [seconds[i] for i in workers],
        [links[i - 1] for i in workers],
        fmt=flags.wire_format,
        master_seconds=seconds[0],
    )


__all__ = [
    "DEFAULT_SYNC_EVERY",
    "ModeFlags",
    "ReplicaDecision",
    "block_seconds",
    "keeps_kernels",
    "kernel_mode",
    "overlap_images",
    "replica",
    "replica_gain",
    "replica_refusal",
    "split_gain",
    "split_heads",
    "stage_mode",
]
