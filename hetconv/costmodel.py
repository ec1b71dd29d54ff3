"""The cost of one training step on a simulated cluster: bytes, transfers, convolutions, the rest.

The model follows what :class:`hetconv.master.cluster.Cluster` does, call by call:

* **Shapes and bytes** (:mod:`hetconv.workload`): the network's convolution layers from its
  spec, and what each call moves on the wire, counted with the real messages.
* **Time of one distributed call** (:func:`simulate_phase`). All worker calls start together
  while the master computes its own share. Each call pays a fixed cost (software per call, plus
  the link's round trip), moves its request, computes, moves its answer. Transfers are fluid
  flows that share capacity max-min fairly: on a switched network (full duplex, one port per
  node) requests share the master's upstream and answers its downstream; on Wi-Fi every transfer,
  both directions, shares one medium. Each flow is also capped by its worker's own link. While the
  master computes its own share, streamed transfers lose :attr:`WireCosts.compute_stall` of their
  rate (0 by default: a master whose convolutions hold the GIL that every chunk needs would
  lose some). After the last answer the master
  sums the input-gradient parts (memory bound).
* **Fused stages** (:mod:`hetconv.stages`): a layer may run fused, each worker also running the
  channel-local layers after the convolution; its calls then move the stage's (pooled) maps
  instead of the feature maps (:func:`~hetconv.workload.stage_call_bytes`) and each node
  computes its kernels widened by the stage's halo. :func:`stage_mode` picks, per layer, the
  mode with fewer bytes on the master's link (``hetconv train --stages auto``).
* **A step** (:func:`simulate_step`): forward then backward of every conv layer, one after the
  other, plus the master's non-convolutional work ("comp"). As in the trace, a call's
  convolution time is its slowest node's compute and its communication the rest of its wall
  time.

Convolution time of a node is its kernels' FLOPs over its throughput: forward 2·N·Ho·Wo·k·C·kh·kw,
the kernel gradient as much again and the input gradient (when the layer needs it) as much again.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from hetconv.formats import FLOAT32, TensorFormat
from hetconv.head import HEAD_MODES
from hetconv.head import MASTER as HEAD_MASTER
from hetconv.overlap import AUTO as OVERLAP_AUTO
from hetconv.overlap import OFF as OVERLAP_OFF
from hetconv.overlap import ON as OVERLAP_ON
from hetconv.overlap import OVERLAP_MODES, group_count, group_images
from hetconv.replica import FIRST as REPLICATE_FIRST
from hetconv.replica import OFF as REPLICATE_OFF
from hetconv.replica import REPLICATED
from hetconv.replica import SPLIT as REPLICATE_SPLIT
from hetconv.replica import SPLIT_ALL as REPLICATE_SPLIT_ALL
from hetconv.resident import RESIDENT, SENT
from hetconv.split import SplitPlan, split_images
from hetconv.stages import AUTO, FUSED, UNFUSED, StageSpec
from hetconv.wire import BUNDLE_BYTES
from hetconv.workload import (
    BACKWARD,
    FORWARD,
    PHASES,
    ConvLayer,
    call_bytes,
    resident_call_bytes,
    resident_sync_bytes,
    split_part,
    stage_call_bytes,
)

WIFI, SWITCHED = "wifi", "switched"
FABRICS = (WIFI, SWITCHED)

# -- devices, links, the cluster -----------------------------------------------------------------

MBIT = 1e6 / 8  # bytes per second in one Mbit/s


@dataclass(frozen=True)
class WireCosts:
    """Costs of the transport beyond the link's bandwidth and round trip.

    Args:
        bundle_call_s: fixed cost of a bundled (one message each way) call: gRPC, protobuf and
            Python on both ends. Measured ~0.6-0.9 ms on loopback (benchmarks/transport.py).
        stream_call_s: the same for a streamed call; measured ~2-3 ms on loopback.
        software_bytes_per_s: how many tensor bytes per second the master's side of the wire
            moves at most, all calls together (copies, (de)serialisation): streaming ran at ~0.3
            of raw TCP's 2.3-3 GB/s on loopback (``benchmarks/transport.py`` measures both).
            Caps the master's link.
        sum_bytes_per_s: bytes of input-gradient parts per second the master adds up
            (``dx += part``, memory bound): ~5 GB/s measured here for 32 MB arrays.
        compute_stall: the fraction of its rate a streamed transfer loses while the master
            computes its own share. A streamed call needs the master's Python to start and for
            every chunk, so a master whose GEMMs hold the GIL stalls it: with hetconv's cpu
            backend on scipy's f2py ``sgemm`` (which holds the GIL) real runs over tc-shaped
            links measured 0.33-0.57. The cpu backend now calls the same sgemm through ctypes,
            which releases the GIL, and the same runs fit 0 within 1.7 % (paper-50-500, batch
            8 and 32, 20-1000 Mbit/s; ``python -m hetconv.simulations.validate``). Set it for a
            master whose convolutions hold the GIL.
        format: the wire format of activations and their gradients (``hetconv train
            --wire-format``): float32, or a 16-bit one that halves their bytes; kernels always
            travel as float32 (:func:`~hetconv.workload.call_bytes` counts both).
    """

    bundle_call_s: float = 0.75e-3
    stream_call_s: float = 2.5e-3
    software_bytes_per_s: float = 0.75e9
    sum_bytes_per_s: float = 5e9
    compute_stall: float = 0.0
    format: TensorFormat = FLOAT32

    def __post_init__(self) -> None:
        if not 0.0 <= self.compute_stall <= 1.0:
            raise ValueError(f"compute stall must be in [0, 1], got {self.compute_stall}")

    def call_s(self, bundled: bool) -> float:
        return self.bundle_call_s if bundled else self.stream_call_s


@dataclass(frozen=True)
class Node:
    """A device in a simulated cluster.

    Args:
        name: for tables.
        gflops: convolution throughput (forward and both gradients), GFLOP/s.
        layer_gflops: per layer name, a throughput that replaces ``gflops`` for that layer
            (a first layer with 3 input channels runs far below a deep one, for instance).
        bytes_per_s: the node's own link, each direction (a worker's Wi-Fi rate, a switch port).
        rtt_s: round trip between it and the master.
    """

    name: str
    gflops: float
    layer_gflops: Mapping[str, float] = field(default_factory=dict)
    bytes_per_s: float = math.inf
    rtt_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.gflops > 0:
            raise ValueError(f"device {self.name}: gflops must be positive, got {self.gflops}")
        for layer, value in self.layer_gflops.items():
            if not value > 0:
                raise ValueError(f"device {self.name}: {layer} gflops must be positive")
        if not self.bytes_per_s > 0:
            raise ValueError(f"device {self.name}: link must be positive, got {self.bytes_per_s}")
        if not self.rtt_s >= 0:
            raise ValueError(f"device {self.name}: latency must be >= 0, got {self.rtt_s}")

    def throughput(self, layer: str) -> float:
        """FLOP/s on ``layer``."""
        return 1e9 * self.layer_gflops.get(layer, self.gflops)

    def conv_seconds(self, layer: ConvLayer, kernels: int, passes: int) -> float:
        """Seconds to run ``passes`` convolutions of forward's size for ``kernels`` kernels."""
        return kernels * passes * layer.flops_per_kernel / self.throughput(layer.name)

    def probe_seconds(self, layer: ConvLayer) -> float:
        """What the probe of the reference method would time: forward + backward, all kernels."""
        return self.conv_seconds(layer, layer.kernels, layer.step_passes)


@dataclass(frozen=True)
class Cluster:
    """A master and its workers on one network.

    Args:
        master: the master's device; ``master.bytes_per_s`` is its switch port (switched) or is
            ignored (Wi-Fi, where ``medium_bytes_per_s`` counts).
        workers: in order; each with its own link.
        fabric: ``"switched"`` (full duplex, a port per node: requests share the master's
            upstream, answers its downstream) or ``"wifi"`` (one shared half-duplex medium: every
            transfer, both directions, shares its capacity).
        medium_bytes_per_s: the Wi-Fi medium's capacity, end to end between two nodes.
        master_compute: whether the master computes a share itself.
        wire: per-call and software costs.
    """

    master: Node
    workers: tuple[Node, ...]
    fabric: str = SWITCHED
    medium_bytes_per_s: float = math.inf
    master_compute: bool = True
    wire: WireCosts = field(default_factory=WireCosts)

    def __post_init__(self) -> None:
        if self.fabric not in FABRICS:
            raise ValueError(f"network {self.fabric!r} is not one of {', '.join(FABRICS)}")
        if not self.workers and not self.master_compute:
            raise ValueError("no workers and the master does not compute: nothing would")

    @property
    def nodes(self) -> tuple[Node, ...]:
        return (self.master, *self.workers)

    def shared_bytes_per_s(self) -> tuple[float, float]:
        """(upstream, downstream) capacity that every transfer to / from the master shares.

        On Wi-Fi both are the one medium (and :func:`simulate_phase` lets both directions share
        it); on a switched network they are the master's port. Either is capped by what the
        master's software moves (:attr:`WireCosts.software_bytes_per_s`).
        """
        link = self.medium_bytes_per_s if self.fabric == WIFI else self.master.bytes_per_s
        cap = min(link, self.wire.software_bytes_per_s)
        return cap, cap


# -- one distributed call ------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerCall:
    """One worker's call in a distributed layer phase, as times and bytes.

    ``before_s`` passes before the request moves (fixed call cost, half the round trip);
    ``after_s`` after the answer has moved (the other half). ``streamed``: the call goes in
    chunks (its transfers slow down while the master computes, see
    :attr:`WireCosts.compute_stall`).

    Overlap (:mod:`hetconv.overlap`): ``pipelined_s`` of ``compute_s`` runs in ``groups``
    image groups; ``overlap`` ``"answer"``: each group's answer bytes go once it is computed
    (the rest of the compute comes first); ``"request"``: each group starts once its request
    bytes are in (the rest of the compute comes after the last).
    """

    request_bytes: float
    answer_bytes: float
    compute_s: float
    before_s: float
    after_s: float
    link_bytes_per_s: float
    streamed: bool = False
    groups: int = 1
    pipelined_s: float = 0.0
    overlap: str = ""


def _waterfill(capacity: float, caps: np.ndarray) -> np.ndarray:
    """Max-min fair rates of flows sharing ``capacity``, each at most its own cap."""
    if caps.size == 0 or not math.isfinite(capacity):
        return caps.copy()
    order = np.argsort(caps)
    ordered = caps[order]
    before = np.concatenate(([0.0], np.cumsum(ordered)[:-1]))
    fair = (capacity - before) / (caps.size - np.arange(caps.size))
    above = ordered > fair
    if not above.any():
        return caps.copy()
    return np.minimum(caps, fair[int(np.argmax(above))])


# Stages of a worker call in simulate_phase.
_BEFORE, _REQUEST, _COMPUTE, _ANSWER, _AFTER, _DONE = range(6)


def simulate_phase(
    calls: Sequence[WorkerCall],
    fabric: str,
    upstream_bytes_per_s: float,
    downstream_bytes_per_s: float,
    master_busy_s: float = 0.0,
    compute_stall: float = 0.0,
) -> np.ndarray:
    """When each worker call of one distributed phase ends, in seconds from its start.

    A fluid simulation: between events every moving transfer gets its max-min fair share of
    the capacity it competes for (see :class:`Cluster`), at most its worker's link.

    Args:
        calls: the worker calls, all started at time 0.
        fabric: ``"switched"``: requests share ``upstream_bytes_per_s``, answers
            ``downstream_bytes_per_s``; ``"wifi"``: all transfers share ``upstream_bytes_per_s``.
        master_busy_s: how long the master computes its own share, from time 0.
        compute_stall: the fraction of their rate streamed transfers lose meanwhile.
    """
    n = len(calls)
    if n == 0:
        return np.zeros(0)
    request = np.array([c.request_bytes for c in calls], float)
    answer = np.array([c.answer_bytes for c in calls], float)
    compute = np.array([c.compute_s for c in calls], float)
    after = np.array([c.after_s for c in calls], float)
    caps = np.array([c.link_bytes_per_s for c in calls], float)
    streamed = np.array([c.streamed for c in calls], bool)
    groups = np.array([max(c.groups, 1) for c in calls], float)
    piped = np.array([min(c.pipelined_s, c.compute_s) for c in calls], float)
    out_piped = np.array([c.overlap == "answer" and c.groups > 1 for c in calls], bool)
    in_piped = np.array([c.overlap == "request" and c.groups > 1 for c in calls], bool)
    # Answer overlap: the compute stage ends with the first group; the answer then moves no
    # faster than the groups are made, until the last is (``made``).
    compute = np.where(out_piped, compute - piped + piped / groups, compute)
    made = np.full(n, -math.inf)
    # Request overlap: the groups start once the first group's bytes are in (``first_in``).
    first_in = np.full(n, math.nan)
    rest = request * (groups - 1) / groups  # request bytes left when the first group is in
    stage = np.full(n, _BEFORE)
    timer = np.array([c.before_s for c in calls], float)  # end of a timed stage
    left = np.zeros(n)  # bytes still to move in a transfer stage
    end = np.zeros(n)
    t = 0.0
    for _ in range(10 * n + 7):
        # Every stage that is over moves on, in stage order so zero-length stages chain.
        tol = 1e-12 * max(t, 1e-9)
        due = (stage == _BEFORE) & (timer <= t + tol)
        stage[due], left[due] = _REQUEST, request[due]
        came = (stage == _REQUEST) & in_piped & np.isnan(first_in) & (left <= rest * (1 + 1e-12))
        first_in[came] = t
        due = (stage == _REQUEST) & (left <= 0)
        timer[due] = t + compute[due]
        grouped = due & in_piped  # the last group after the last byte, or all after the first
        timer[grouped] = (
            np.maximum(t + piped[grouped] / groups[grouped], first_in[grouped] + piped[grouped])
            + compute[grouped]
            - piped[grouped]
        )
        stage[due] = _COMPUTE
        due = (stage == _COMPUTE) & (timer <= t + tol)
        stage[due], left[due] = _ANSWER, answer[due]
        made[due & out_piped] = (
            t + piped[due & out_piped] * (groups[due & out_piped] - 1) / groups[due & out_piped]
        )
        due = (stage == _ANSWER) & (left <= 0)
        stage[due], timer[due] = _AFTER, t + after[due]
        due = (stage == _AFTER) & (timer <= t + tol)
        stage[due], end[due] = _DONE, t
        if (stage == _DONE).all():
            return end
        rates = np.zeros(n)
        requests, answers = stage == _REQUEST, stage == _ANSWER
        if fabric == WIFI:
            moving = requests | answers
            rates[moving] = _waterfill(upstream_bytes_per_s, caps[moving])
        else:
            rates[requests] = _waterfill(upstream_bytes_per_s, caps[requests])
            rates[answers] = _waterfill(downstream_bytes_per_s, caps[answers])
        moving = requests | answers
        making = answers & out_piped & (made > t + tol)  # answer groups still being computed
        if making.any():
            with np.errstate(divide="ignore", invalid="ignore"):
                pace = np.where(piped > 0, answer / np.maximum(piped, 1e-300), math.inf)
            rates[making] = np.minimum(rates[making], pace[making])
        stalling = compute_stall > 0 and t < master_busy_s
        if stalling:  # (a full stall stops even an unlimited flow)
            slowed = moving & streamed
            rates[slowed] = rates[slowed] * (1.0 - compute_stall) if compute_stall < 1 else 0.0
        with np.errstate(divide="ignore"):
            finish = np.where(moving, left / np.where(moving, rates, 1.0), math.inf)
        timed = (stage == _BEFORE) | (stage == _COMPUTE) | (stage == _AFTER)
        wake = np.where(timed, timer - t, math.inf)
        wake = np.minimum(wake, np.where(making, made - t, math.inf))
        waiting = requests & in_piped & np.isnan(first_in)
        with np.errstate(divide="ignore", invalid="ignore"):
            first = np.where(waiting, (left - rest) / np.where(waiting, rates, 1.0), math.inf)
        wake = np.minimum(wake, np.where(first >= 0, first, math.inf))
        busy_left = master_busy_s - t if stalling else math.inf
        dt = max(min(float(finish.min()), float(wake.min()), busy_left), 0.0)
        if not math.isfinite(dt):
            raise ValueError("a transfer cannot move: some link has no capacity")
        t = master_busy_s if dt == busy_left else t + dt
        done = moving & (finish <= dt * (1 + 1e-12))
        with np.errstate(invalid="ignore"):  # an unlimited rate over dt = 0
            left[moving] -= rates[moving] * dt
        left[done] = 0.0
    raise RuntimeError("phase simulation did not converge")  # pragma: no cover


# -- a whole step --------------------------------------------------------------------------------


@dataclass(frozen=True)
class PhaseResult:
    """One layer's forward or backward as the trace would record it."""

    layer: str
    phase: str
    wall_s: float
    conv_s: float  # slowest node's compute
    comm_s: float  # wall - conv
    bytes: int  # sent + received, all workers
    worker_ends_s: tuple[float, ...]


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


def local_step_seconds(master: Node, layers: Sequence[ConvLayer], comp_s: float) -> float:
    """The step of local training on ``master`` alone: every convolution, no transfers."""
    # Summed phase by phase, as simulate_step sums, so one node gives exactly speedup 1.
    conv = sum(
        master.conv_seconds(layer, layer.kernels, layer.passes(phase))
        for layer in layers
        for phase in PHASES
    )
    return conv + comp_s


def _wire(
    layer: ConvLayer,
    phase: str,
    share: int,
    offset: int,
    step: int,
    fmt: TensorFormat,
    fused,
    resident: bool = False,
    sync_every: int = 20,
    replica: ConvLayer | None = None,
    head: int = 0,
):
    if replica is not None and not fused:
        raise ValueError(f"{layer.name}: a replicated block feeds only a fused layer")
    if fused and resident:
        wire = resident_call_bytes(
            layer, layer.stage, phase, share, offset, step, fmt, replica, head
        )
        if phase == BACKWARD and sync_every:  # the syncs, amortised over their interval
            sync = resident_sync_bytes(layer, share, head) // sync_every
            wire = dataclasses.replace(
                wire, received=wire.received + sync, tensors_received=wire.tensors_received + sync
            )
        return wire
    if fused:
        return stage_call_bytes(
            layer, layer.stage, phase, share, offset, step, fmt, replica=replica
        )
    return call_bytes(layer, phase, share, offset, step, fmt)


def _computed(layer: ConvLayer, share: int, offset: int, fused: bool) -> int:
    """Kernels a node computes for ``share`` owned ones: the stage's halo too when fused."""
    if not fused or not share:
        return share
    wide = layer.stage.widened(slice(offset, offset + share), layer.kernels)
    return wide.stop - wide.start


def layer_bytes(
    layer: ConvLayer,
    shares: Sequence[int],
    fused: bool = False,
    fmt: TensorFormat = FLOAT32,
    step: int = 1000,
    replica: ConvLayer | None = None,
) -> int:
    """Bytes one step of ``layer`` moves on the master's link (both phases, every worker with
    a share), fused (needs ``layer.stage``) or not, for ``shares`` kernels per node (master
    first); ``replica``: the replicated first block whose output is its input
    (:mod:`hetconv.replica`; fused only)."""
    total, offset = 0, shares[0]
    for share in shares[1:]:
        if share:
            total += sum(
                _wire(layer, p, share, offset, step, fmt, fused, replica=replica).total
                for p in PHASES
            )
        offset += share
    return total


def stage_mode(
    layer: ConvLayer, stage: StageSpec | None, shares: Sequence[int], fmt: TensorFormat = FLOAT32
) -> str:
    """``"fused"`` where running ``layer`` with its ``stage`` on the workers moves fewer bytes
    on the master's link than the plain kernel split, else ``"unfused"`` (also without a
    stage). With pooling it moves several times fewer (the pooled maps, not the feature
    maps), so bytes decide: the halo's extra compute is a few kernels per worker."""
    if stage is None:
        return UNFUSED
    layer = ConvLayer(layer.name, layer.shape, layer.need_input_grad, stage)
    fused = layer_bytes(layer, shares, True, fmt)
    return FUSED if fused < layer_bytes(layer, shares, False, fmt) else UNFUSED


def overlap_images(
    layer: ConvLayer, stage: StageSpec | None, shares: Sequence[int], fmt: TensorFormat = FLOAT32
) -> int:
    """Images per group for ``layer``'s fused stage calls (:mod:`hetconv.overlap`), 0 for
    none: :func:`~hetconv.overlap.group_images` where some worker's stage output is over one
    message (``BUNDLE_BYTES``), at least two groups come of the batch, and the stage holds no
    batch norm (its statistics are the whole batch's).

    Smaller answers are left whole, although an overlapped call streams at any size: measured
    on the testbed (``benchmarks/testbed.py``, paper-150-800 at batch 16, 4 workers capped at
    0.36 of a core, shared medium), groups of 2 images made each worker's stage 10-25 % slower
    and the step no faster, where this model, which counts no cost per group, predicted the
    layer 0.2 s faster. (That was before the groups shared their kernel layout and kernel
    gradient sum: ``benchmarks/overlap_groups.py`` now measures a stage in groups of 2 images
    at 1.09-1.19x its whole-batch compute, against 1.28-2.05x before; this rule is unchanged.)"""
    n = layer.shape.n
    if stage is None or stage.batchnorms or len(shares) < 2 or not any(shares[1:]):
        return 0
    images = group_images(n)
    if group_count(n, images) < 2:
        return 0
    ho, wo = stage.output_hw(layer.shape.out_hw)
    if fmt.nbytes((n, max(shares[1:]), ho, wo)) <= BUNDLE_BYTES:
        return 0
    return images


def resident_layer_bytes(
    layer: ConvLayer,
    shares: Sequence[int],
    fmt: TensorFormat = FLOAT32,
    step: int = 1000,
    sync_every: int = 20,
    replica: ConvLayer | None = None,
    head: int = 0,
    split: bool = False,
) -> float:
    """Bytes one step of fused ``layer`` moves on the master's link with resident kernels
    (:mod:`hetconv.master.resident`): both phases' calls of every worker with a share, plus the
    syncs that bound the replay log, amortised over ``sync_every`` steps (0: none);
    ``replica`` as :func:`layer_bytes`'s; ``head``: the classes of a split head
    (:mod:`hetconv.head`: logits instead of the stage output), 0 for none; ``split``: the
    workers with a share split ``replica`` by images, equally (:mod:`hetconv.split`), each
    sent its own images only."""
    if layer.stage is None:
        raise ValueError(f"{layer.name} has no stage: resident kernels need a fused stage")
    names = [f"worker {i}" for i in range(1, len(shares))]
    parts = _split_replicas(names, shares, layer, replica) if split and replica else {}
    total, offset = 0.0, shares[0]
    for name, share in zip(names, shares[1:], strict=True):
        if share:
            block = parts.get(name, replica)
            total += sum(
                resident_call_bytes(
                    layer, layer.stage, p, share, offset, step, fmt, block, head
                ).total
                for p in PHASES
            )
            if sync_every:
                total += resident_sync_bytes(layer, share, head) / sync_every
        offset += share
    return total


def kernel_mode(
    layer: ConvLayer,
    stage: StageSpec | None,
    shares: Sequence[int],
    sync_every: int = 20,
    fmt: TensorFormat = FLOAT32,
) -> str:
    """``"resident"`` where keeping the kernels on the workers moves fewer bytes on the
    master's link than sending them with every fused call (syncs included), else ``"sent"``
    (also without a stage: only fused layers keep their kernels)."""
    if stage is None:
        return SENT
    layer = ConvLayer(layer.name, layer.shape, layer.need_input_grad, stage)
    resident = resident_layer_bytes(layer, shares, fmt, sync_every=sync_every)
    return RESIDENT if resident < layer_bytes(layer, shares, True, fmt) else SENT


def replica_bytes(block: ConvLayer, consumer: ConvLayer, fmt: TensorFormat = FLOAT32):
    """(saved toward a worker, saved from it) per step when every node computes ``block``
    (the network's first convolution and its stage) itself (:mod:`hetconv.replica`): the
    consumer's input no longer goes out nor its input-gradient part comes back; the images
    (:attr:`~hetconv.workload.ConvLayer.images_format`) and the block's kernels (float32) go
    out and its kernel gradient parts come back. Negative: it costs bytes."""
    s, b = consumer.shape, block.shape
    x = fmt.nbytes((s.n, s.c, s.h, s.w))
    images = block.images_bytes
    kernels = FLOAT32.nbytes((b.k, b.c, b.kh, b.kw)) + FLOAT32.nbytes((b.k,))
    return x - images - kernels, x - kernels


def replicate_gain(
    block: ConvLayer,
    consumer: ConvLayer,
    block_seconds: Sequence[float],
    links: Sequence[float],
    wifi: bool = False,
    fmt: TensorFormat = FLOAT32,
) -> float:
    """Seconds per step a replicated first block is predicted to save (negative: to cost).

    Saved: the bytes :func:`replica_bytes` counts, for every worker with a share of the
    consumer, over the slowest of their ``links`` (bytes/s; the forward's requests share the
    master's port or the medium, as do the backward's answers). Cost: every node computes the
    whole block, so the step waits for the slowest node's whole block, ``max(block_seconds)``
    (each node's probe of it: forward and kernel gradients, all kernels; the master first). The
    block's own calls, which also go, are not counted: the estimate errs toward off."""
    if not links:
        return 0.0
    up, down = replica_bytes(block, consumer, fmt)
    saved = len(links) * (up + down) / min(links)
    return saved - max(block_seconds, default=0.0)


def _exchange_seconds(layer: ConvLayer, part: ConvLayer, node: Node) -> float:
    """A worker's exchange of a split block's parts in one phase: the other workers' images'
    rows of ``layer``'s input (forward: their outputs in; backward: its rows of them out), at
    its link's rate."""
    others = layer.x_bytes * (layer.shape.n - part.shape.n) / max(layer.shape.n, 1)
    rate = node.bytes_per_s
    return others / rate if rate and math.isfinite(rate) else 0.0


def _split_replicas(
    names: Sequence[str],
    shares,
    layer: ConvLayer,
    block: ConvLayer,
    weights=None,
    images=None,
    master: str | None = None,
) -> dict[str, ConvLayer]:
    """Worker name -> its part of ``block`` split by images among the workers (``names``, in
    order) with a share of ``layer`` (``shares``, master first), and with ``master`` (its name)
    the master's first: ``images`` each, in order, or in proportion to ``weights`` (per name;
    None: equal); {} when fewer than two nodes (the block is then computed whole)."""
    peers = [name for name, share in zip(names, shares[1:], strict=True) if share]
    if master is not None and peers:
        peers = [master, *peers]
    if len(peers) < 2 or layer.shape.n < len(peers):
        return {}
    if images is None:
        images = split_images(layer.shape.n, [(weights or {}).get(w, 1.0) for w in peers])
    plan = SplitPlan.of(peers, images)
    return {w: split_part(block, plan, w) for w in peers}


def _split_block_seconds(
    cluster: Cluster, layer: ConvLayer, parts: Mapping[str, ConvLayer], phase: str
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


def simulate_layer_phase(
    cluster: Cluster,
    layer: ConvLayer,
    phase: str,
    shares: Sequence[int],
    step: int = 1000,
    fused: bool = False,
    resident: bool = False,
    replica: ConvLayer | None = None,
    overlap_images: int = 0,
    replica_head_s: float = 0.0,
    head: int = 0,
    sync_every: int = 20,
    replica_tail_s: float = 0.0,
    split_replicas: Mapping[str, ConvLayer] | None = None,
) -> PhaseResult:
    """One distributed call of ``layer`` (``phase``) with ``shares`` kernels per node (master
    first), as :meth:`Cluster.forward` / ``backward`` runs it, or fused
    (:meth:`Cluster.stage_forward` / ``stage_backward``; needs ``layer.stage``), with
    ``resident`` kernels (:mod:`hetconv.master.resident`: halo out, edges back, the syncs
    amortised into backward's answer) or sent ones. ``replica``: the replicated first block
    whose output is the layer's input (:mod:`hetconv.replica`): each worker also computes the
    whole block's phase, and sends its gradient parts instead of an input-gradient part.
    ``overlap_images``: a fused layer's streamed calls run in groups of this many images
    (:mod:`hetconv.overlap`): forward sends each group's answer as it is computed, backward
    starts each group once its gradient is in (the block's part of the compute is not
    grouped). ``replica_head_s``: the workers start the block's forward this long before the
    phase (the master starts their ReplicaForward as it computes its own copy), so only the
    rest of it falls in the phase. ``head``: (resident) the classes of a split head
    (:mod:`hetconv.head`): the calls move logits and their gradient instead of the stage's
    output and its gradient, and the halo's and edges' fc columns. ``sync_every``: (resident)
    the steps between syncs of every slice, amortised into backward's answer (0: none).
    ``replica_tail_s``: (backward) the master's own backward through the replicated block,
    which it runs in the phase after its own piece, as the workers compute.
    ``split_replicas``: the block split by images (:mod:`hetconv.split`): worker name -> its
    part (:func:`~hetconv.workload.split_part`), whose images its ReplicaForward moves and
    whose block it computes, plus the exchange of the others' parts on its link."""
    if head and not (fused and resident):
        raise ValueError(f"{layer.name}: a split head needs a fused stage with resident kernels")
    if fused and layer.stage is None:
        raise ValueError(f"{layer.name} has no channel-local layers after it to fuse")
    passes = layer.passes(phase)
    master_s = (
        cluster.master.conv_seconds(layer, _computed(layer, shares[0], 0, fused), passes)
        if cluster.master_compute
        else 0.0
    )
    if phase == BACKWARD and replica is not None:
        master_s += replica_tail_s
    calls, computes, moved, offset = [], [master_s], 0, shares[0]
    for node, share in zip(cluster.workers, shares[1:], strict=True):
        if share:
            block = (split_replicas or {}).get(node.name, replica)
            wire = _wire(
                layer, phase, share, offset, step, cluster.wire.format, fused, resident,
                sync_every, replica=block, head=head,
            )  # fmt: skip
            own = node.conv_seconds(layer, _computed(layer, share, offset, fused), passes)
            compute = own
            if block is not None:
                block_s = node.conv_seconds(block, block.kernels, block.passes(phase))
                if block.split_of is not None:  # and the others' parts, before the stage
                    block_s += _exchange_seconds(layer, block, node)
                compute += max(0.0, block_s - (replica_head_s if phase == FORWARD else 0.0))
            groups = group_count(layer.shape.n, overlap_images) if fused else 1
            piped = groups > 1
            if piped:  # an overlapped call streams (hetconv.overlap), whatever its size
                wire = dataclasses.replace(wire, bundled=False)
            calls.append(
                WorkerCall(
                    wire.sent,
                    wire.received,
                    compute,
                    cluster.wire.call_s(wire.bundled) + node.rtt_s / 2,
                    node.rtt_s / 2,
                    node.bytes_per_s,
                    streamed=not wire.bundled,
                    groups=groups if piped else 1,
                    pipelined_s=own if piped else 0.0,
                    overlap=("answer" if phase == FORWARD else "request") if piped else "",
                )
            )
            computes.append(compute)
            moved += wire.total
        offset += share
    up, down = cluster.shared_bytes_per_s()
    ends = simulate_phase(calls, cluster.fabric, up, down, master_s, cluster.wire.compute_stall)
    wall = max(master_s, float(ends.max(initial=0.0)))
    if phase == BACKWARD and layer.need_input_grad and calls and replica is None:
        # The master adds every worker's dx part to its own (or to the first part).
        adds = len(calls) - (0 if shares[0] else 1)
        wall += adds * layer.x_bytes / cluster.wire.sum_bytes_per_s
    conv = max(computes)
    return PhaseResult(layer.name, phase, wall, conv, wall - conv, moved, tuple(ends))


def simulate_step(
    cluster: Cluster,
    layers: Sequence[ConvLayer],
    shares: Mapping[str, Sequence[int]],
    comp_s: float,
    stages: str | Mapping[str, str] = UNFUSED,
    kernels: str | Mapping[str, str] = SENT,
    replicate: str = REPLICATE_OFF,
    overlap: str | Mapping[str, int] = OVERLAP_OFF,
    head: str | Mapping[str, object] = HEAD_MASTER,
    sync_every: int = 20,
    split_images: Mapping[str, Sequence[int]] | None = None,
    split_master: Mapping[str, int] | None = None,
) -> StepResult:
    """One training step: forward and backward of every conv layer with ``shares`` (per layer
    name, kernels per node, master first), plus ``comp_s`` of the master's other work.

    ``stages`` as ``hetconv train --stages``: ``"unfused"``, ``"fused"`` (every layer with a
    stage) or ``"auto"`` (:func:`stage_mode` per layer); or per layer name, one of those (as a
    trace's ``stage_modes`` records them; a layer not named: unfused). ``comp_s`` stays as
    given: fused stages move the channel-local layers' work from the master to the workers,
    which the caller's ``comp_s`` (measured or assumed) has to say.

    ``kernels`` as ``hetconv train --kernels``: ``"sent"``, ``"resident"`` or ``"auto"``
    (:func:`kernel_mode`), or per layer name; only fused layers keep their kernels.

    ``replicate`` ``"first"``: the first layer's block is computed by every node
    (:mod:`hetconv.replica`): the master computes it alone (no calls) and each worker again in
    the second layer's calls, which move the images instead of that layer's input (the second
    layer must run fused); the master's backward of it runs in the second layer's backward
    phase, after its own piece, as the workers compute (when the master computes a share).
    A per-layer ``stages`` mapping may name the block ``"replicated"``
    instead (as a trace's ``stage_modes`` do). ``"split"``: as ``"first"``, the workers with a
    share of the second layer splitting the block by images in proportion to their speed on it
    (:mod:`hetconv.split`), or as ``split_images`` says (block name -> each one's images, as a
    trace's ``replica_split`` records them; given, the block is split whatever ``replicate``).
    ``"split_all"``: as ``"split"``, the master one of the peers (first, as ``split_master``
    says for a trace's blocks: block name -> the master's index in ``split_images``): it
    computes the block on its own images, and its exchange of parts on its port, in the
    block's forward phase (which ends once every worker's output is in) and in the next
    layer's backward phase.

    ``overlap`` as ``hetconv train --overlap``: ``"off"``, ``"on"`` (every fused layer whose
    stage holds no batch norm) or ``"auto"`` (:func:`overlap_images`); or per layer name, the
    images per group (as a trace's ``overlap_images`` records them; 0 or not named: none).

    ``head`` as ``hetconv train --head``: ``"master"``, ``"split"`` or ``"auto"`` (either:
    the layer whose stage feeds the final fc directly, :attr:`ConvLayer.head`, computes it on
    the nodes where its kernels are resident, :mod:`hetconv.head`); or the layer names that
    do (as a trace's ``heads`` records them). A split head's layer does not overlap.

    ``sync_every``: steps between the syncs of resident slices (``hetconv train
    --resident-sync-every``), their bytes amortised over them; 0: none (a run shorter than
    that interval, or steps between syncs).
    """
    if not isinstance(head, Mapping) and head not in HEAD_MODES:
        raise ValueError(f"head {head!r}; expected one of {', '.join(HEAD_MODES)}")
    kernel_modes = (
        kernels if isinstance(kernels, Mapping) else {layer.name: kernels for layer in layers}
    )
    for mode in kernel_modes.values():
        if mode not in (RESIDENT, SENT, AUTO):
            raise ValueError(f"kernels {mode!r}; expected resident, sent or auto")
    modes = stages if isinstance(stages, Mapping) else {layer.name: stages for layer in layers}
    if replicate not in (REPLICATE_OFF, REPLICATE_FIRST, REPLICATE_SPLIT, REPLICATE_SPLIT_ALL):
        raise ValueError(f"replicate {replicate!r}; expected off, first, split or split_all")
    for block, index in (split_master or {}).items():
        if index != 0:
            raise ValueError(f"{block}: the master is the split's first peer, not {index}")
    if not isinstance(overlap, Mapping) and overlap not in OVERLAP_MODES:
        raise ValueError(f"overlap {overlap!r}; expected one of {', '.join(OVERLAP_MODES)}")
    if replicate in (REPLICATE_FIRST, REPLICATE_SPLIT, REPLICATE_SPLIT_ALL) and layers:
        modes = {**modes, layers[0].name: REPLICATED}
    for mode in modes.values():
        if mode not in (FUSED, UNFUSED, AUTO, REPLICATED):
            raise ValueError(f"stages {mode!r}; expected fused, unfused, auto or replicated")
    phases = []
    block: ConvLayer | None = None  # a replicated block, feeding the next layer
    tail = 0.0  # its backward on the master, in the next layer's backward phase
    early = 0.0  # its forward on the master, which the workers' ReplicaForward runs beside
    parts: dict[str, ConvLayer] = {}  # the block split by images: node name -> its part
    for index, layer in enumerate(layers):
        if modes.get(layer.name) == REPLICATED:
            if block is not None or layer is not layers[0] or len(layers) < 2:
                raise ValueError(f"{layer.name}: only the first of several layers replicates")
            block = layer
            parts = _block_parts(
                cluster, layers[index + 1], block, shares, replicate, split_images, split_master
            )
            with_master = cluster.master.name in parts
            for phase in PHASES:
                if with_master:  # its own images, and the exchange
                    seconds = _split_block_seconds(cluster, layers[index + 1], parts, phase)
                else:  # the master alone, every kernel
                    seconds = cluster.master.conv_seconds(layer, layer.kernels, layer.passes(phase))
                if phase == FORWARD and cluster.master_compute:
                    early = seconds  # the workers' ReplicaForward starts with it
                if phase == BACKWARD and cluster.master_compute:
                    tail = seconds  # run inside the next layer's backward phase
                    seconds = 0.0
                phases.append(PhaseResult(layer.name, phase, seconds, seconds, 0.0, 0, ()))
            continue
        replica, block = block, None
        tail_s = tail if replica is not None else 0.0
        early_s = early if replica is not None else 0.0
        tail = early = 0.0
        split = tuple(int(s) for s in shares[layer.name])
        if len(split) != len(cluster.nodes) or sum(split) != layer.kernels or min(split) < 0:
            raise ValueError(
                f"shares {split} for {layer.name} must be {len(cluster.nodes)} non-negative "
                f"counts (master first) summing to its {layer.kernels} kernels"
            )
        if split[0] and not cluster.master_compute:
            raise ValueError(f"shares {split} give the master kernels, but it does not compute")
        mode = modes.get(layer.name, UNFUSED)
        if layer.stage is None:
            mode = UNFUSED
        elif mode == AUTO:
            mode = stage_mode(layer, layer.stage, split, cluster.wire.format)
        kept = kernel_modes.get(layer.name, SENT)
        if mode != FUSED:
            kept = SENT
        elif kept == AUTO:
            kept = kernel_mode(layer, layer.stage, split, fmt=cluster.wire.format)
        if replica is not None and mode != FUSED:
            raise ValueError(f"{layer.name} takes a replicated block's output: it must be fused")
        heads = head if isinstance(head, Mapping) else None
        classes = 0
        if kept == RESIDENT and layer.head:
            if (heads is not None and layer.name in heads) or (
                heads is None and head != HEAD_MASTER
            ):
                classes = layer.head
        images = 0
        if mode == FUSED and not classes:
            if isinstance(overlap, Mapping):
                images = int(overlap.get(layer.name, 0))
            elif overlap == OVERLAP_ON and not layer.stage.batchnorms:
                images = group_images(layer.shape.n)
            elif overlap == OVERLAP_AUTO:
                images = overlap_images(layer, layer.stage, split, cluster.wire.format)
        worker_parts = {n: p for n, p in parts.items() if n != cluster.master.name}
        parts = {}
        for phase in PHASES:
            phases.append(
                simulate_layer_phase(
                    cluster,
                    layer,
                    phase,
                    split,
                    fused=mode == FUSED,
                    resident=kept == RESIDENT,
                    replica=replica,
                    overlap_images=images,
                    replica_head_s=early_s,
                    head=classes,
                    sync_every=sync_every,
                    replica_tail_s=tail_s,
                    split_replicas=worker_parts,
                )  # fmt: skip
            )
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


def _block_parts(
    cluster: Cluster,
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


__all__ = [
    "REPLICATED",
    "kernel_mode",
    "overlap_images",
    "replica_bytes",
    "replicate_gain",
    "layer_bytes",
    "resident_layer_bytes",
    "stage_mode",
    "Cluster",
    "MBIT",
    "Node",
    "PhaseResult",
    "StepResult",
    "SWITCHED",
    "WIFI",
    "WireCosts",
    "WorkerCall",
    "local_step_seconds",
    "simulate_layer_phase",
    "simulate_phase",
    "simulate_step",
]
