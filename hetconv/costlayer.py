"""One distributed call of one layer in the cost model (:mod:`hetconv.costmodel`): what each
worker's call moves and computes in a phase, and when the phase ends
(:func:`~hetconv.costphase.simulate_phase`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hetconv.costbytes import _computed, _wire
from hetconv.costcluster import SimCluster, SimNode
from hetconv.costphase import WorkerCall, simulate_phase
from hetconv.overlap import group_count
from hetconv.workload import BACKWARD, FORWARD, ConvLayer


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


def _exchange_seconds(layer: ConvLayer, part: ConvLayer, node: SimNode) -> float:
    """A worker's exchange of a split block's parts in one phase: the other workers' images'
    rows of ``layer``'s input (forward: their outputs in; backward: its rows of them out), at
    its link's rate."""
    others = layer.x_bytes * (layer.shape.n - part.shape.n) / max(layer.shape.n, 1)
    rate = node.bytes_per_s
    return others / rate if rate and math.isfinite(rate) else 0.0


@dataclass(frozen=True)
class _LayerCall:
    """What every worker call of one layer phase shares (:func:`simulate_layer_phase`'s
    arguments)."""

    cluster: SimCluster
    layer: ConvLayer
    phase: str
    step: int
    fused: bool
    resident: bool
    overlap_images: int
    replica_head_s: float
    head: int
    sync_every: int
    #: the replicated block's layers after its convolution, this phase, all its images
    chain_s: float = 0.0
    #: a fused stage's layers after the convolution, this phase, every channel
    stage_chain_s: float = 0.0

    def worker(self, node: SimNode, share: int, offset: int, block: ConvLayer | None):
        """``node``'s call for ``share`` kernels from ``offset``, its block (part) ``block``:
        (the call, its compute seconds, its bytes)."""
        layer, phase = self.layer, self.phase
        wire = _wire(
            layer, phase, share, offset, self.step, self.cluster.wire.format, self.fused,
            self.resident, self.sync_every, replica=block, head=self.head,
        )  # fmt: skip
        own = node.conv_seconds(
            layer, _computed(layer, share, offset, self.fused), layer.passes(phase)
        )
        own += self.stage_chain_s * share / layer.kernels
        compute = own
        if block is not None:
            block_s = node.conv_seconds(block, block.kernels, block.passes(phase))
            block_s += self.chain_s * block.shape.n / layer.shape.n
            if block.split_of is not None:  # and the others' parts, before the stage
                block_s += _exchange_seconds(layer, block, node)
            compute += max(0.0, block_s - (self.replica_head_s if phase == FORWARD else 0.0))
        groups = group_count(layer.shape.n, self.overlap_images) if self.fused else 1
        piped = groups > 1
        if piped:  # an overlapped call streams (hetconv.overlap), whatever its size
            wire = dataclasses.replace(wire, bundled=False)
        call = WorkerCall(
            wire.sent,
            wire.received,
            compute,
            self.cluster.wire.call_s(wire.bundled) + node.rtt_s / 2,
            node.rtt_s / 2,
            node.bytes_per_s,
            streamed=not wire.bundled,
            groups=groups if piped else 1,
            pipelined_s=own if piped else 0.0,
            overlap=("answer" if phase == FORWARD else "request") if piped else "",
        )
        return call, compute, wire.total


def simulate_layer_phase(
    cluster: SimCluster,
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
    replica_chain_s: float = 0.0,
    stage_chain_s: float = 0.0,
) -> PhaseResult:
    """One distributed call of ``layer`` (``phase``) with ``shares`` kernels per node (master
    first), as :meth:`hetconv.master.cluster.Cluster.forward` / ``backward`` runs it, or fused
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
    whose block it computes, plus the exchange of the others' parts on its link. The layers
    after a convolution, this phase, all images and channels: ``replica_chain_s`` the block's,
    which each worker's copy (or part) runs as the master's does; ``stage_chain_s`` (fused)
    the layer's stage's, of which each node runs its kernels' share."""
    if head and not (fused and resident):
        raise ValueError(f"{layer.name}: a split head needs a fused stage with resident kernels")
    if fused and layer.stage is None:
        raise ValueError(f"{layer.name} has no channel-local layers after it to fuse")
    stage_chain_s = stage_chain_s if fused else 0.0  # unfused: the master's, between calls
    master_s = (
        cluster.master.conv_seconds(
            layer, _computed(layer, shares[0], 0, fused), layer.passes(phase)
        )
        + stage_chain_s * shares[0] / layer.kernels
        if cluster.master_compute
        else 0.0
    )
    if phase == BACKWARD and replica is not None:
        master_s += replica_tail_s
    each = _LayerCall(
        cluster, layer, phase, step, fused, resident, overlap_images, replica_head_s, head,
        sync_every, replica_chain_s, stage_chain_s,
    )  # fmt: skip
    calls, computes, moved, offset = [], [master_s], 0, shares[0]
    for node, share in zip(cluster.workers, shares[1:], strict=True):
        if share:
            block = (split_replicas or {}).get(node.name, replica)
            call, compute, nbytes = each.worker(node, share, offset, block)
            calls.append(call)
            computes.append(compute)
            moved += nbytes
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


__all__ = ["PhaseResult", "simulate_layer_phase"]
