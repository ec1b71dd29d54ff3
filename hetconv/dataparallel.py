"""The cost of one step of heterogeneous data parallelism: the peer hetconv must beat.

Every node holds the whole model and trains it on a slice of the global batch; the slices are
proportional to the nodes' speeds (largest remainder, as kernel shares are split), and the
gradients are averaged with weights equal to each node's share of the batch, which is exact:
the weighted average of per-slice mean gradients is the global batch's mean gradient. A step:

* **Compute** (every rank at once): forward and backward of the whole model on the rank's
  slice. Convolutions at the node's per-layer throughput (:meth:`~hetconv.costmodel.SimNode
  .conv_seconds`), the rest at the master's ``comp`` per image scaled by the node's speed
  relative to the master's (``gflops`` ratio); a third of it in forward, two thirds in
  backward, spread over the blocks in proportion to their convolution's output maps (what the
  channel-local layers after it touch). ``image_seconds`` replaces each rank's total with a
  measured one (the profile keeps its shape).
* **Gradient exchange**: the model's parameters, float32 (:func:`parameter_tensors`), summed
  over the ranks by

  - ``ring`` all-reduce: ``2 (N - 1)`` rounds, each rank sending ``bytes / N`` to the next and
    receiving as much from the one before; a round is limited by the slowest link (or, on a
    shared medium, moves ``bytes`` in all through it) and pays one message's latency (half the
    round trip plus :attr:`CollectiveCosts.message_s`); the reduce-scatter half adds
    ``(N - 1) / N x bytes`` on every rank;
  - ``ps``, a parameter server on the master: every other rank pushes its gradient to the
    master (which receives ``(N - 1) x bytes`` on its port, or through the shared medium) and
    pulls the sum back (as much again, the other way).

  With ``overlap`` (what PyTorch's DDP does) the gradients go in buckets (DDP's: 1 MiB first,
  then 25 MiB, a tensor larger than that alone) in the reverse order of the model's
  parameters, each bucket's exchange starting once every rank's backward has produced it and
  the previous bucket is done; the step ends when the last exchange and the slowest rank's
  backward both have. Without overlap, one exchange of every gradient after the slowest rank's
  backward.

A link here is what :class:`~hetconv.costmodel.SimCluster` says: on a switched network every
node's own port (the master's ``bytes_per_s`` too), full duplex; on Wi-Fi one half-duplex
medium (``medium_bytes_per_s``) that every transfer, between any two nodes, shares.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from hetconv.balance import kernel_shares
from hetconv.costmodel import WIFI, SimCluster, SimNode, local_step_seconds
from hetconv.model import CIFAR_INPUT, walk_spec
from hetconv.onnx_import import Network, load_network
from hetconv.workload import BACKWARD, FORWARD, ConvLayer, conv_layers

RING, PARAMETER_SERVER = "ring", "ps"
ALGORITHMS = (RING, PARAMETER_SERVER)
FLOAT32_BYTES = 4
#: PyTorch DDP's default bucket sizes (``bucket_cap_mb=25``; the first bucket 1 MiB).
BUCKET_BYTES = 25 * 2**20
FIRST_BUCKET_BYTES = 2**20
#: Of the non-convolutional work of a step, the part in forward (backward costs about twice).
FORWARD_SHARE = 1 / 3


@dataclass(frozen=True)
class CollectiveCosts:
    """Costs of a collective beyond the links' bandwidth and round trip.

    Args:
        message_s: fixed software cost of one message of a collective (gloo over TCP: a few
            tens of microseconds on a fast core).
        tcp_bytes_per_s: what one process's TCP moves at most, each direction (raw TCP on
            loopback measured 2.3-3 GB/s here): caps every link.
        sum_bytes_per_s: gradient bytes per second a rank adds into its sum (memory bound).
        bucket_bytes, first_bucket_bytes: gradient bucket sizes when overlapping.
    """

    message_s: float = 50e-6
    tcp_bytes_per_s: float = 2.5e9
    sum_bytes_per_s: float = 5e9
    bucket_bytes: int = BUCKET_BYTES
    first_bucket_bytes: int = FIRST_BUCKET_BYTES

    def __post_init__(self) -> None:
        for name in ("tcp_bytes_per_s", "sum_bytes_per_s", "bucket_bytes", "first_bucket_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not self.message_s >= 0:
            raise ValueError(f"message_s must be >= 0, got {self.message_s}")

    @property
    def core(self) -> float:
        """The share of a core these costs were :meth:`scaled` to (1: unscaled), from
        ``message_s`` against the default's."""
        return CollectiveCosts().message_s / self.message_s if self.message_s else 1.0

    def scaled(self, cpu: float) -> CollectiveCosts:
        """The costs of a process that gets ``cpu`` of a core (a capped one): its software
        runs ``1 / cpu`` times slower."""
        return CollectiveCosts(
            self.message_s / cpu,
            self.tcp_bytes_per_s * cpu,
            self.sum_bytes_per_s * cpu,
            self.bucket_bytes,
            self.first_bucket_bytes,
        )


# -- the model's parameters ----------------------------------------------------------------------


def parameter_tensors(
    spec: Sequence[Mapping], input_shape: tuple[int, int, int] = CIFAR_INPUT
) -> list[tuple[str, int, int]]:
    """Every parameter tensor of a model spec, in the model's order: (name, elements, index of
    the last convolution at or before it among the spec's convolutions, -1 before the first),
    for images of ``input_shape`` (C, H, W: a fully connected layer's inputs follow it).

    Convolutions and fully connected layers have a weight and a bias, batch norm a scale and a
    shift per channel; the other layer types have none.
    """
    tensors, conv_index = [], -1
    for layer in walk_spec(spec, input_shape):
        if layer.conv is not None:
            conv_index += 1
            c = layer.conv
            weight = c.kernels * c.input_shape[0] * c.kernel_size[0] * c.kernel_size[1]
            tensors += [
                (f"{layer.name}.weight", weight, conv_index),
                (f"{layer.name}.bias", c.kernels, conv_index),
            ][: 2 if layer.options["bias"] else 1]
        elif layer.kind == "fc":
            inputs = math.prod(layer.input_shape)
            outputs = layer.output_shape[0]
            tensors += [
                (f"{layer.name}.weight", inputs * outputs, conv_index),
                (f"{layer.name}.bias", outputs, conv_index),
            ]
        elif layer.kind == "batchnorm":
            channels = layer.input_shape[0]
            tensors += [
                (f"{layer.name}.weight", channels, conv_index),
                (f"{layer.name}.bias", channels, conv_index),
            ]
    return tensors


def parameter_bytes(
    spec: Sequence[Mapping], input_shape: tuple[int, int, int] = CIFAR_INPUT
) -> int:
    """Bytes of every parameter (and so of every gradient) of a model spec, float32."""
    return FLOAT32_BYTES * sum(count for _, count, _ in parameter_tensors(spec, input_shape))


def buckets(
    spec: Sequence[Mapping],
    costs: CollectiveCosts,
    input_shape: tuple[int, int, int] = CIFAR_INPUT,
) -> list[tuple[int, int]]:
    """DDP's gradient buckets: (bytes, index of the earliest conv block whose gradient it
    holds, -1 for none), in the order they fill (the model's parameters reversed). A bucket
    closes once it reaches its cap (the first's is smaller), so a large tensor goes alone."""
    out: list[tuple[int, int]] = []
    size, block, cap = 0, math.inf, costs.first_bucket_bytes
    for _, count, conv_index in reversed(parameter_tensors(spec, input_shape)):
        size += FLOAT32_BYTES * count
        block = min(block, conv_index)
        if size >= cap:
            out.append((size, int(block)))
            size, block, cap = 0, math.inf, costs.bucket_bytes
    if size:
        out.append((size, int(block)))
    return out


# -- batches -------------------------------------------------------------------------------------


def proportional_batches(batch: int, image_seconds: Sequence[float]) -> list[int]:
    """The global ``batch`` split in proportion to each rank's speed (``1 / image_seconds``),
    largest remainder, summing exactly to ``batch`` (:func:`hetconv.balance.kernel_shares`'s
    rule: ties to the faster rank, then the earlier)."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    return kernel_shares(batch, image_seconds)


def batch_weights(batches: Sequence[int]) -> list[float]:
    """Each rank's gradient weight: its share of the global batch (the weights sum to 1)."""
    total = sum(batches)
    if total < 1 or min(batches) < 0:
        raise ValueError(f"batches {list(batches)} must be >= 0 with at least one image")
    return [b / total for b in batches]


# -- one rank's compute --------------------------------------------------------------------------


@dataclass(frozen=True)
class _Profile:
    """Seconds per image of one rank: forward, and backward per conv block (last first)."""

    forward_s: float
    backward_s: tuple[float, ...]  # block j's backward, in backward order (last block first)
    #: Seconds into each block's backward (same order) until its kernel gradient is computed,
    #: where a convolution computes it before its input gradient.
    kernels_s: tuple[float, ...] = ()

    @property
    def total_s(self) -> float:
        return self.forward_s + sum(self.backward_s)

    def scaled(self, factor: float) -> _Profile:
        return _Profile(self.forward_s * factor, tuple(b * factor for b in self.backward_s),
                        tuple(k * factor for k in self.kernels_s))  # fmt: skip


def _profile(
    node: SimNode, master: SimNode, layers: Sequence[ConvLayer], comp_s: float
) -> _Profile:
    batch = layers[0].shape.n if layers else 1
    other = comp_s / batch * master.gflops / node.gflops
    maps = [layer.map_bytes for layer in layers] or [1]
    weights = [m / sum(maps) for m in maps]
    forward = other * FORWARD_SHARE + sum(
        node.conv_seconds(layer, layer.kernels, layer.passes(FORWARD)) / batch for layer in layers
    )
    backward = [
        other * (1 - FORWARD_SHARE) * w
        + node.conv_seconds(layer, layer.kernels, layer.passes(BACKWARD)) / batch
        for layer, w in zip(layers, weights, strict=True)
    ] or [other * (1 - FORWARD_SHARE)]
    kernels = [  # the layers after the convolution, then its kernel gradient (one pass)
        other * (1 - FORWARD_SHARE) * w + node.conv_seconds(layer, layer.kernels, 1) / batch
        for layer, w in zip(layers, weights, strict=True)
    ]
    return _Profile(forward, tuple(reversed(backward)), tuple(reversed(kernels)))


# -- the exchange --------------------------------------------------------------------------------


def _ranks(cluster: SimCluster) -> tuple[SimNode, ...]:
    return cluster.nodes if cluster.master_compute else cluster.workers


def exchange_seconds(
    cluster: SimCluster, nbytes: float, algorithm: str, costs: CollectiveCosts | None = None
) -> float:
    """Seconds to sum ``nbytes`` of gradients over the ranks of ``cluster`` (every node; the
    workers only where the master computes nothing) with ``algorithm``, links idle."""
    costs = costs or CollectiveCosts()
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm {algorithm!r} is not one of {', '.join(ALGORITHMS)}")
    ranks = _ranks(cluster)
    n = len(ranks)
    if n < 2 and not (algorithm == PARAMETER_SERVER and not cluster.master_compute):
        return 0.0
    latency = costs.message_s + max((r.rtt_s for r in cluster.workers), default=0.0) / 2
    links = [min(r.bytes_per_s, costs.tcp_bytes_per_s) for r in ranks]
    medium = cluster.medium_bytes_per_s if cluster.fabric == WIFI else math.inf
    if algorithm == RING:
        chunk = nbytes / n
        # A round: every rank sends a chunk to the next at once.
        round_s = max(chunk / min(links), n * chunk / medium)
        adds = (n - 1) * chunk / costs.sum_bytes_per_s
        return 2 * (n - 1) * (round_s + latency) + adds
    # Parameter server on the master: the others push, the master sums, they pull.
    pushers = [r for r in ranks if r is not cluster.master]
    port = min(cluster.master.bytes_per_s, costs.tcp_bytes_per_s)
    if cluster.fabric == WIFI:
        port = min(port, medium)
    one_way = max(len(pushers) * nbytes / port, nbytes / min(links))
    adds = len(pushers) * nbytes / costs.sum_bytes_per_s
    return 2 * (one_way + latency) + adds


#: Seconds of a whole core one round of a small all-reduce costs a rank when DDP syncs batch
#: norm (:func:`synced_batchnorm_seconds`): gloo's message out and in, the sum, and the Python
#: around each all-reduce (the values joined and split). Fitted to one run on the scaled
#: testbed (resnet20 batch 64, 5 ranks at 0.36 of a core, ``benchmarks/vs_ddp.py
#: --ddp-synced-batchnorm``): DDP's step 0.298 s with each rank's own statistics, 1.028 s with
#: the batch's, 17 ms for each of the 42 sums of 8 rounds. hetconv's own sums' rounds, frames
#: on kept connections, cost 0.35 ms (:data:`hetconv.imagecost.ROUND_S` and ``PUT_S``). A
#: sum's own software beside its rounds: :data:`GLOO_SUM_S`, as hetconv's (``SUM_S``).
GLOO_ROUND_S = 0.65e-3
GLOO_SUM_S = 0.5e-3
#: All-reduces a synced batch norm layer takes a step: forward's values and squares at once,
#: backward's two sums at once.
SYNCED_SUMS_PER_LAYER = 2


def synced_batchnorm_seconds(
    cluster: SimCluster, norms: int, costs: CollectiveCosts | None = None
) -> float:
    """Seconds a data-parallel step waits on ``norms`` batch norm layers' statistics summed over
    its ranks (the same model as one machine's; a rank's own slice's statistics cost nothing
    but train another): two all-reduces of a few hundred values per layer a step, none
    overlapped (the next layer needs each), each gloo's ring over the ranks, ``2 (N - 1)``
    rounds of one small message: each round :data:`GLOO_ROUND_S` and each sum
    :data:`GLOO_SUM_S` of a core (at the share of a core ``costs`` were scaled to), and half a
    round trip and a message's cost a round."""
    costs = costs or CollectiveCosts()
    n = len(_ranks(cluster))
    if n < 2 or norms < 1:
        return 0.0
    hop = costs.message_s + max((r.rtt_s for r in cluster.workers), default=0.0) / 2
    rounds = 2 * (n - 1)
    each = (GLOO_SUM_S + rounds * GLOO_ROUND_S) / costs.core + rounds * hop
    return SYNCED_SUMS_PER_LAYER * norms * each


def batchnorm_layers(spec: Sequence[Mapping]) -> int:
    """How many batch norm layers ``spec`` has."""
    return sum(1 for entry in spec if entry.get("type") == "batchnorm")


def master_link_bytes(cluster: SimCluster, nbytes: float, algorithm: str) -> float:
    """Gradient bytes through the master's link in one exchange, both directions."""
    n = len(_ranks(cluster))
    if algorithm == RING:
        return 0.0 if n < 2 or not cluster.master_compute else 4 * (n - 1) / n * nbytes
    pushers = len(cluster.workers)
    return 2 * pushers * nbytes


# -- a step --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DataParallelResult:
    """A simulated data-parallel step.

    ``compute_s``: the slowest rank's forward and backward, split into ``conv_s`` and
    ``other_s`` (its non-convolutional work); ``comm_s``: the part of the step the gradient
    exchange adds beyond it (all of ``exchange_s`` without overlap, what backward does not
    hide with it); ``exchange_s``: every exchange end to end, idle links;
    ``local_s``: the master alone on the global batch."""

    algorithm: str
    overlap: bool
    step_s: float
    compute_s: float
    conv_s: float
    other_s: float
    comm_s: float
    exchange_s: float
    batches: tuple[int, ...]  # master first (0 where it computes nothing)
    gradient_bytes: int
    master_bytes: float  # on the master's link per step, both directions
    local_s: float
    bucket_ends_s: tuple[float, ...] = field(default=())

    @property
    def speedup(self) -> float:
        """The master alone on the global batch / this step."""
        return self.local_s / self.step_s

    @property
    def label(self) -> str:
        """``dp-ring``, ``dp-ps``; ``-seq`` without overlap."""
        return f"dp-{self.algorithm}" + ("" if self.overlap else "-seq")


def simulate_data_parallel(
    cluster: SimCluster,
    network: str | Sequence[Mapping],
    batch: int,
    comp_s: float,
    algorithm: str = RING,
    overlap: bool = True,
    costs: CollectiveCosts | None = None,
    image_seconds: Sequence[float] | None = None,
    batches: Sequence[int] | None = None,
    input_shape: tuple[int, int, int] | None = None,
    synced_batchnorm: bool = False,
    kernels_first: bool = False,
) -> DataParallelResult:
    """One step of heterogeneous data parallelism on ``cluster``.

    Args:
        cluster: its nodes are the ranks (the master only where ``master_compute``); their
            ``gflops`` / ``layer_gflops`` time the convolutions, their links the exchange.
        network: a preset name, a ``.json`` spec file, or a spec (list of layer dicts).
        batch: the global batch.
        comp_s: the master's non-convolutional seconds for the whole ``batch`` (as
            :func:`~hetconv.costmodel.simulate_step` takes it).
        algorithm: ``"ring"`` or ``"ps"`` (parameter server on the master).
        overlap: exchange buckets during backward (DDP), or all after it.
        image_seconds: per rank, measured seconds per image of a whole training step; replaces
            the modelled total (keeping its forward/backward profile).
        batches: per rank, the batch slice; default proportional to speed.
        input_shape: the (C, H, W) of an image; default: a graph's own, else CIFAR's.
        synced_batchnorm: the batch's statistics summed over the ranks (one machine's model;
            :func:`synced_batchnorm_seconds` added), else each rank's own slice's (no cost).
        kernels_first: a convolution's bucket ready once its kernel gradient is computed, before
            its input gradient (hetconv's split by images without batch norm), else at its end.

    Returns:
        :class:`DataParallelResult`; ``batches`` master first, 0 where it computes nothing.
    """
    costs = costs or CollectiveCosts()
    named = load_network(network) if isinstance(network, str) else Network(list(network))
    spec, shape = named.spec, input_shape or named.input_shape or CIFAR_INPUT
    layers = conv_layers(spec, batch, shape)
    ranks = _ranks(cluster)
    profiles = [_profile(node, cluster.master, layers, comp_s) for node in ranks]
    conv_fractions = [
        _conv_fraction(n, layers, p, batch) for n, p in zip(ranks, profiles, strict=True)
    ]
    profiles, batches = _rank_batches(profiles, batch, image_seconds, batches)
    forward_end, block_ends = _timeline(profiles, batches)
    compute_ends = [e[-1] if e else f for e, f in zip(block_ends, forward_end, strict=True)]
    compute = max(compute_ends)
    conv_fraction = conv_fractions[compute_ends.index(compute)]
    total_bytes = parameter_bytes(spec, shape)
    exchange_all = exchange_seconds(cluster, total_bytes, algorithm, costs)
    exchange, step, ends = exchange_all, compute + exchange_all, []
    if overlap:
        ready = _timeline(profiles, batches, kernels_first)[1]
        exchange, t, ends = _bucket_exchange(cluster, spec, len(layers), algorithm, costs,
                                             forward_end, ready, shape)  # fmt: skip
        step = max(compute, t)
    if synced_batchnorm:  # mid-pass, every rank waiting: the step (and its buckets) later
        step += synced_batchnorm_seconds(cluster, batchnorm_layers(spec), costs)
    local = local_step_seconds(cluster.master, layers, comp_s)
    if image_seconds is not None and cluster.master_compute:  # the master's measured speed
        local = image_seconds[0] * batch
    full = (*([] if cluster.master_compute else [0]), *batches)
    return DataParallelResult(
        algorithm=algorithm,
        overlap=overlap,
        step_s=step,
        compute_s=compute,
        conv_s=compute * conv_fraction,
        other_s=compute * (1 - conv_fraction),
        comm_s=step - compute,
        exchange_s=exchange,
        batches=tuple(int(b) for b in full),
        gradient_bytes=total_bytes,
        master_bytes=master_link_bytes(cluster, total_bytes, algorithm),
        local_s=local,
        bucket_ends_s=tuple(ends),
    )


def _rank_batches(
    profiles: list[_Profile],
    batch: int,
    image_seconds: Sequence[float] | None,
    batches: Sequence[int] | None,
) -> tuple[list[_Profile], Sequence[int]]:
    """The ranks' profiles scaled to ``image_seconds`` (when measured), and their batch slices:
    ``batches`` checked, or proportional to speed."""
    if image_seconds is not None:
        if len(image_seconds) != len(profiles) or not all(t > 0 for t in image_seconds):
            raise ValueError(
                f"image_seconds needs {len(profiles)} positive values, one per rank, got "
                f"{list(image_seconds)}"
            )
        profiles = [p.scaled(t / p.total_s) for p, t in zip(profiles, image_seconds, strict=True)]
    if batches is None:
        batches = proportional_batches(batch, [p.total_s for p in profiles])
    elif len(batches) != len(profiles) or sum(batches) != batch or min(batches) < 0:
        raise ValueError(
            f"batches {list(batches)} must be {len(profiles)} counts >= 0 summing to {batch}"
        )
    return profiles, batches


def _timeline(
    profiles: Sequence[_Profile], batches: Sequence[int], kernels_first: bool = False
) -> tuple[list[float], list[list[float]]]:
    """Per rank: when its forward ends, and when each conv block's backward ends (last block
    first; ``kernels_first``: when its kernel gradient is computed, before its input
    gradient), seconds into the step."""
    forward_end = [p.forward_s * b for p, b in zip(profiles, batches, strict=True)]
    block_ends = []
    for p, b, start in zip(profiles, batches, forward_end, strict=True):
        ends, t = [], start
        firsts = p.kernels_s if kernels_first and p.kernels_s else p.backward_s
        for seconds, first in zip(p.backward_s, firsts, strict=True):
            ends.append(t + first * b)
            t += seconds * b
        block_ends.append(ends)
    return forward_end, block_ends


def _bucket_exchange(
    cluster: SimCluster,
    spec: Sequence[Mapping],
    blocks: int,
    algorithm: str,
    costs: CollectiveCosts,
    forward_end: Sequence[float],
    block_ends: Sequence[Sequence[float]],
    input_shape: tuple[int, int, int] = CIFAR_INPUT,
) -> tuple[float, float, list[float]]:
    """The buckets exchanged during backward (DDP), each once every rank has passed its earliest
    conv block: (seconds exchanging, when the last ends, when each ends)."""
    t = 0.0
    exchange = 0.0
    ends = []
    for size, block in buckets(spec, costs, input_shape):
        # Ready once every rank's backward has passed the bucket's earliest conv block
        # (-1: no conv weights in it: ready when backward starts).
        if block < 0 or not blocks:
            ready = max(forward_end)
        else:
            ready = max(ends_[blocks - 1 - block] for ends_ in block_ends)
        took = exchange_seconds(cluster, size, algorithm, costs)
        exchange += took
        t = max(t, ready) + took
        ends.append(t)
    return exchange, t, ends


def _conv_fraction(node: SimNode, layers: Sequence[ConvLayer], profile: _Profile, batch: int):
    """The convolutions' part of a rank's modelled compute."""
    if not layers or profile.total_s <= 0:
        return 0.0
    conv = sum(node.conv_seconds(ly, ly.kernels, ly.step_passes) for ly in layers) / batch
    return min(1.0, conv / profile.total_s)


__all__ = [
    "ALGORITHMS",
    "BUCKET_BYTES",
    "FIRST_BUCKET_BYTES",
    "GLOO_ROUND_S",
    "GLOO_SUM_S",
    "PARAMETER_SERVER",
    "RING",
    "CollectiveCosts",
    "DataParallelResult",
    "batch_weights",
    "batchnorm_layers",
    "buckets",
    "exchange_seconds",
    "master_link_bytes",
    "parameter_bytes",
    "parameter_tensors",
    "proportional_batches",
    "simulate_data_parallel",
    "synced_batchnorm_seconds",
]
