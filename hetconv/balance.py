"""Kernel shares: how many of a layer's kernels each node computes, by the paper's rule or
one that sees links. The real cluster (``hetconv.master``) and the simulator both split here.

The paper's rule (Marques, Falcao & Alexandre 2017): every device runs a probe convolution of
the layer's real shape and reports its time ``t_i``; device ``i`` gets the fraction
``w_i = 1/t_i / sum_j 1/t_j`` of the kernels, so all finish at about the same time. Kernel
counts are integers: the largest-remainder rule rounds the quotas so they sum exactly to the
layer's kernel count (:func:`kernel_shares`).

Policies over a cost-model cluster (:mod:`hetconv.costmodel`):

``compute``: the paper's rule as the real cluster runs it: each node's probe time of the layer,
then :func:`kernel_shares` (``w_i ∝ 1/t_i``). Links play no part.

``link``: minimise the layer's predicted time, transfers included. A worker with ``k`` kernels
takes about ``a + s·k`` seconds in each phase: ``a`` is what it costs whatever its share (the
call's fixed cost and round trip, and the input ``x`` sent to it forward or, for layers that need
it, the full-size ``dx`` part it returns backward), ``s`` what each kernel adds (its weights and
feature maps, and its FLOPs). The master has ``a = 0``. The master's shared link enters as each
worker's rate ``min(own link, shared capacity / m)`` when ``m`` workers take part, and the
master's summing of ``dx`` parts as one add per worker. A quick pass finds, for every ``m``
(workers taken in order of ``a``), the time at which all would finish the whole layer together
(``k_i = (T - a_i)/s_i``, ``Σ k_i = K``); a worker with ``a_i >= T`` would need a negative
share, so that ``m`` is out. For the few best ``m`` a small linear program then splits the kernels
so that *forward's slowest node plus backward's slowest node* is least, as the step pays it.
Last, the cost model's own simulation of the layer compares the result with the master alone and
keeps the faster, so a worker whose link makes it a net loss gets 0 and the policy is never
predicted slower than local training.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction

import numpy as np

from hetconv.costmodel import SimCluster, simulate_layer_phase, step_modes
from hetconv.formats import FLOAT32
from hetconv.head import MASTER as HEAD_MASTER
from hetconv.overlap import OFF as OVERLAP_OFF
from hetconv.overlap import group_count
from hetconv.replica import OFF as REPLICATE_OFF
from hetconv.resident import RESIDENT, SENT
from hetconv.stages import AUTO, FUSED, UNFUSED
from hetconv.workload import BACKWARD, FORWARD, ConvLayer, call_bytes, stage_call_bytes


def kernel_shares(kernels: int, probe_seconds: Sequence[float]) -> list[int]:
    """Split ``kernels`` across devices in proportion to ``1 / probe_seconds``.

    Args:
        kernels: the layer's kernel (output-channel) count, >= 0.
        probe_seconds: each device's probe time for the whole layer; ``math.inf`` excludes a
            device (it gets 0). At least one must be finite.

    Returns:
        Non-negative integers, one per device, summing to ``kernels``. A device may get 0 (more
        devices than kernels, or too slow to earn one). Ties in the remainders go to the faster
        device, then to the earlier one, so the result is deterministic.
    """
    if kernels < 0:
        raise ValueError(f"kernel count must be >= 0, got {kernels}")
    if not probe_seconds:
        raise ValueError("no devices to share kernels between")
    for i, t in enumerate(probe_seconds):
        if not t > 0:  # also catches NaN
            raise ValueError(f"probe time of device {i} is {t}; it must be positive")
    # Exact rational arithmetic: no overflow for tiny times, and ties are real ties.
    speeds = [Fraction(0) if math.isinf(t) else 1 / Fraction(t) for t in probe_seconds]
    total = sum(speeds)
    if total == 0:
        raise ValueError("every device is excluded (infinite probe time)")
    quotas = [kernels * s / total for s in speeds]
    shares = [math.floor(q) for q in quotas]
    left = kernels - sum(shares)
    order = sorted(range(len(quotas)), key=lambda i: (-(quotas[i] - shares[i]), -speeds[i], i))
    for i in order[:left]:
        shares[i] += 1
    return shares


def offsets(shares: Sequence[int]) -> list[int]:
    """Where each device's slice starts: the running sum of the shares before it."""
    out, total = [], 0
    for share in shares:
        out.append(total)
        total += share
    return out


COMPUTE, LINK = "compute", "link"
POLICIES = (COMPUTE, LINK)


def compute_shares(cluster: SimCluster, layer: ConvLayer) -> list[int]:
    """The paper's shares: kernels in proportion to 1 / each node's probe time of the layer."""
    probes = [node.probe_seconds(layer) for node in cluster.nodes]
    if not cluster.master_compute:
        probes[0] = math.inf
    return kernel_shares(layer.kernels, probes)


def _call_seconds(
    cluster: SimCluster, layer: ConvLayer, phase: str, kernels: int, fused, groups: int = 1
) -> float:
    """The fixed cost of a worker's call of ``phase`` at about ``kernels`` kernels (in
    ``groups`` > 1 image groups it streams, :mod:`hetconv.overlap`)."""
    k, fmt = max(1, kernels), cluster.wire.format
    if fused:
        wire = stage_call_bytes(layer, layer.stage, phase, k, layer.kernels // 2, fmt=fmt)
    else:
        wire = call_bytes(layer, phase, k, fmt=fmt)
    return cluster.wire.call_s(wire.bundled and groups <= 1)


def _phase_terms(
    cluster: SimCluster,
    layer: ConvLayer,
    workers: int,
    fused=False,
    resident: bool = False,
    replica: ConvLayer | None = None,
    groups: int = 1,
    head: int = 0,
) -> np.ndarray:
    """Per node (master first) the forward and backward times as ``a + s·k`` for ``k`` kernels,
    when ``workers`` workers take part: rows (a_forward, s_forward, a_backward, s_backward).

    Fused (``layer.stage`` runs on the nodes, :mod:`hetconv.stages`): a kernel's maps travel
    pooled, and a worker also computes, and is sent the weights of, the stage's halo of
    neighbouring kernels on each side, and is sent their output gradient back: a fixed cost
    whatever its share (a slice at a layer's edge has half of it; counted whole).

    ``resident`` (fused only, :mod:`hetconv.master.resident`): a kernel's weights and gradients
    stay on its worker. ``replica``: the replicated first block whose output is the layer's
    input (:mod:`hetconv.replica`): a worker gets the images and the block's kernels instead of
    the input, answers the block's kernel gradients instead of an input-gradient part, and
    computes the whole block: fixed costs; the master's own block backward runs in the
    backward phase too (after its piece, before the workers' answers): a fixed cost of its.
    ``groups`` > 1: a fused layer's calls overlap
    (:mod:`hetconv.overlap`): a kernel's maps travel beside its compute (forward's answer,
    backward's gradient), so a worker's per-kernel cost is the larger of the two plus the
    smaller over the groups. ``head`` (resident): the classes of a split head
    (:mod:`hetconv.head`): logits and their gradient travel instead of a kernel's maps (fixed
    costs), and the halo's and edges' fc columns with the halo and edge kernels."""
    shared = min(cluster.shared_bytes_per_s())
    nodes = cluster.nodes
    links = np.array([n.bytes_per_s for n in nodes[1:]], float)
    rates = np.minimum(links, shared / max(workers, 1))
    rtts = np.array([n.rtt_s for n in nodes[1:]], float)
    seconds = np.array([layer.flops_per_kernel / n.throughput(layer.name) for n in nodes])
    guess = layer.kernels // (workers + 1)
    fmt = cluster.wire.format  # of x, y, dy and dx; kernels are float32
    x_bytes = layer.x_wire_bytes(fmt)
    maps, halo_forward, halo_backward, fixed_forward, fixed_backward = _fused_bytes(
        layer, fmt, rates, fused, resident, head
    )
    per_kernel = maps if resident else layer.kernel_bytes + maps  # weights, maps (or outputs)
    dx = x_bytes if layer.need_input_grad else 0
    block = np.zeros((2, len(nodes) - 1))  # a replicated block's work on each worker
    master_block = 0.0
    if replica is not None:
        x_bytes, dx, block, master_block = _replicated_block(cluster, replica)
    terms = np.zeros((4, len(nodes)))
    calls = [_call_seconds(cluster, layer, p, guess, fused, groups) for p in (FORWARD, BACKWARD)]
    terms[0, 1:] = calls[0] + rtts + x_bytes / rates
    terms[0, 1:] += block[0]
    terms[1] = seconds * layer.passes(FORWARD)
    terms[2, 1:] = calls[1] + rtts + dx / rates
    terms[2, 1:] += block[1]
    if replica is not None:
        terms[2, 0] += master_block
    terms[3] = seconds * layer.passes(BACKWARD)
    # An overlapped call streams whatever its size (hetconv.overlap): its maps move beside
    # the compute.
    for row in (1, 3):
        if groups > 1 and fused:
            compute, moved = terms[row, 1:], maps / rates
            both = np.maximum(compute, moved) + np.minimum(compute, moved) / groups
            terms[row, 1:] = both + (per_kernel - maps) / rates
        else:
            terms[row, 1:] += per_kernel / rates
    if fused:
        halo = 2 * layer.stage.halo
        terms[0, 1:] += halo_forward + halo * seconds[1:] * layer.passes(FORWARD)
        terms[2, 1:] += halo_backward + halo * seconds[1:] * layer.passes(BACKWARD)
        terms[0, 1:] += fixed_forward
        terms[2, 1:] += fixed_backward
    if not cluster.master_compute:
        terms[1, 0] = terms[3, 0] = math.inf
    return terms


def _fused_bytes(
    layer: ConvLayer, fmt, rates: np.ndarray, fused, resident: bool, head: int
) -> tuple:
    """What :func:`_phase_terms` moves per kernel and per call beside the input: (one kernel's
    maps or stage output in bytes; per worker the seconds of the halo's weights sent forward
    and of its output gradient sent backward; of a split head's fixed forward and backward
    traffic)."""
    maps = layer.map_wire_bytes(fmt)  # one kernel's feature maps
    halo_forward = halo_backward = 0.0
    if fused:
        s = layer.shape
        ho, wo = layer.stage.output_hw(s.out_hw)
        maps = fmt.nbytes((s.n, 1, ho, wo))  # one kernel's stage output
        halo = 2 * layer.stage.halo
        reach = sum(layer.stage.grad_reach)
        halo_forward = (halo * layer.kernel_bytes) / rates  # their weights, sent
        halo_backward = (reach * maps) / rates  # their output gradient, sent
    fixed_forward = fixed_backward = 0.0
    if fused and resident and head:
        s = layer.shape
        ho, wo = layer.stage.output_hw(s.out_hw)
        logits = FLOAT32.nbytes((s.n, head))
        columns = FLOAT32.nbytes((2 * layer.stage.halo, ho * wo, head))
        fixed_forward = (logits + columns) / rates  # z back, the halo's columns out
        fixed_backward = (logits + columns) / rates  # dz out, the edges' columns back
        maps = 0
        halo_backward = 0.0
    return maps, halo_forward, halo_backward, fixed_forward, fixed_backward


def _replicated_block(
    cluster: SimCluster, replica: ConvLayer
) -> tuple[int, int, np.ndarray, float]:
    """A replicated first block in :func:`_phase_terms`: (what a worker is sent instead of the
    input, and answers instead of an input-gradient part, in bytes; the block's forward and
    backward seconds on each worker, rows (forward, backward); the master's own block backward,
    seconds)."""
    nodes = cluster.nodes
    x_bytes = replica.images_bytes + replica.kernel_bytes * replica.kernels
    dx = replica.kernel_bytes * replica.kernels
    block = np.zeros((2, len(nodes) - 1))
    for row, phase in enumerate((FORWARD, BACKWARD)):
        block[row] = [
            n.conv_seconds(replica, replica.kernels, replica.passes(phase)) for n in nodes[1:]
        ]
    master_block = 0.0
    if cluster.master_compute:  # the workers start it as the master computes its own
        ahead = nodes[0].conv_seconds(replica, replica.kernels, replica.passes(FORWARD))
        block[0] = np.maximum(block[0] - ahead, 0.0)
        # and the master takes its part back through its block in the backward phase,
        # after its own piece, as the workers compute
        master_block = nodes[0].conv_seconds(replica, replica.kernels, replica.passes(BACKWARD))
    return x_bytes, dx, block, master_block


def _split(terms: np.ndarray, chosen: np.ndarray, kernels: int) -> tuple[float, np.ndarray]:
    """Kernels per node of ``chosen`` (indices, master 0 first) minimising max forward time +
    max backward time (a small linear program); returns (that time, kernels as reals)."""
    af, sf, ab, sb = (row[chosen] for row in terms)
    usable = np.isfinite(sf)
    count = len(chosen)
    # Variables: k (count), Tf, Tb. Minimise Tf + Tb.
    cost = np.concatenate((np.zeros(count), [1.0, 1.0]))
    upper = np.zeros((2 * count, count + 2))
    rows = np.arange(count)
    upper[rows, rows] = np.where(usable, sf, 0.0)
    upper[rows, count] = -1.0
    upper[count + rows, rows] = np.where(usable, sb, 0.0)
    upper[count + rows, count + 1] = -1.0
    bound = -np.concatenate((af, ab))
    equal = np.concatenate((np.ones(count), [0.0, 0.0]))[None, :]
    limits = [(0.0, None if ok else 0.0) for ok in usable] + [(0.0, None), (0.0, None)]
    from scipy.optimize import linprog  # here: a worker never balances, and its start skips it

    result = linprog(cost, upper, bound, equal, [float(kernels)], bounds=limits, method="highs")
    if result.status != 0:  # pragma: no cover - the program is always feasible and bounded
        raise RuntimeError(f"kernel split failed: {result.message}")
    return float(result.fun), np.maximum(result.x[:count], 0.0)


def link_aware_shares(
    cluster: SimCluster,
    layer: ConvLayer,
    fused: bool = False,
    resident: bool = False,
    replica: ConvLayer | None = None,
    overlap_images: int = 0,
    head: int = 0,
) -> list[int]:
    """Shares that minimise the layer's predicted time, transfers included (module docstring).

    Args:
        fused: the layer runs with its stage on the nodes (needs ``layer.stage``): maps travel
            as the stage's output and each worker computes the stage's halo too.
        resident: (fused) workers keep their kernels (:mod:`hetconv.master.resident`).
        replica: the replicated first block whose output is the layer's input (fused;
            :mod:`hetconv.replica`).
        overlap_images: (fused) the calls run in groups of this many images, transfers beside
            the compute (:mod:`hetconv.overlap`); 0: whole batches.
        head: (resident) the classes of a split head (:mod:`hetconv.head`); 0: none.

    Returns kernels per node, master first, summing to the layer's kernel count; a worker whose
    link would make it slow the layer down gets 0.
    """
    if fused and layer.stage is None:
        raise ValueError(f"{layer.name} has no channel-local layers after it to fuse")
    kernels = layer.kernels
    n = len(cluster.workers)
    master_only = [kernels] + [0] * n
    sum_s = layer.x_bytes / cluster.wire.sum_bytes_per_s if layer.need_input_grad else 0.0
    if replica is not None:
        sum_s = 0.0  # the workers' parts stay on them (the block's gradients are small)
    modes = {
        "resident": resident, "replica": replica, "overlap_images": overlap_images, "head": head
    }  # fmt: skip
    groups = group_count(layer.shape.n, overlap_images) if fused else 1
    # First a quick pass: everyone finishing the whole layer together, for every m.
    estimates = {}
    for m in range(1, n + 1):
        terms = _phase_terms(cluster, layer, m, fused, resident, replica, groups, head)
        a, s = terms[0] + terms[2], terms[1] + terms[3]
        order = 1 + np.lexsort((s[1:], a[1:]))[:m]
        chosen = np.concatenate(([0], order))
        slopes, offsets = s[chosen], a[chosen]
        time = (kernels + np.sum(offsets / slopes)) / np.sum(1.0 / slopes)
        if np.all(offsets[1:] < time):
            adds = m if cluster.master_compute else m - 1
            estimates[m] = (time + adds * sum_s, chosen, terms)
    best_time, best = math.inf, None
    if cluster.master_compute:
        best_time = kernels * (cluster.master.conv_seconds(layer, 1, layer.step_passes))
    # Then the exact split of the best few sets: forward and backward each end with their
    # slowest node, so the phases are balanced separately, not just their sum.
    for m in sorted(estimates, key=lambda m: estimates[m][0])[:4]:
        _, chosen, terms = estimates[m]
        time, quotas = _split(terms, chosen, kernels)
        adds = int(np.count_nonzero(quotas[1:] > 0.5)) - (0 if quotas[0] > 0.5 else 1)
        time += max(adds, 0) * sum_s
        if time < best_time:
            shares = np.zeros(n + 1)
            shares[chosen] = quotas
            best_time, best = time, shares
    if best is None:
        return master_only
    # Integer kernels by the same largest-remainder rule, in proportion to the real quotas.
    shares = kernel_shares(kernels, [1.0 / q if q > 0 else math.inf for q in best])
    if cluster.master_compute and _layer_seconds(
        cluster, layer, shares, fused, **modes
    ) >= _layer_seconds(cluster, layer, master_only, fused, **modes):
        return master_only  # the model's own simulation has the last word
    return shares


def _layer_seconds(
    cluster: SimCluster,
    layer: ConvLayer,
    shares,
    fused: bool = False,
    resident=False,
    replica=None,
    overlap_images: int = 0,
    head: int = 0,
) -> float:
    return sum(
        simulate_layer_phase(
            cluster, layer, phase, shares, fused=fused, resident=resident, replica=replica,
            overlap_images=overlap_images, head=head,
        ).wall_s
        for phase in (FORWARD, BACKWARD)
    )  # fmt: skip


def shares_for(
    cluster: SimCluster,
    layers,
    policy: str,
    stages: str = UNFUSED,
    kernels: str = SENT,
    replicate: str = REPLICATE_OFF,
    overlap: str = OVERLAP_OFF,
    head: str = HEAD_MASTER,
) -> dict[str, tuple[int, ...]]:
    """Per layer name, kernels per node (master first) under ``policy``; the ``link`` policy
    plans each layer in the modes the simulated step runs it in (the mode table's for these
    flags, :func:`~hetconv.coststep.step_modes`, judged on the compute shares): fused or not,
    its kernels kept on the workers or sent, fed by the replicated first block
    (:mod:`hetconv.replica`), its calls overlapped in image groups, its stage computing the
    final fc (:mod:`hetconv.head`). A replicated block is the master's alone under either
    policy."""
    if policy not in POLICIES:
        raise ValueError(f"policy {policy!r} is not one of {', '.join(POLICIES)}")
    if stages not in (FUSED, UNFUSED, AUTO):
        raise ValueError(f"stages {stages!r}; expected fused, unfused or auto")
    compute = {layer.name: tuple(compute_shares(cluster, layer)) for layer in layers}
    modes = step_modes(cluster, layers, compute, stages, kernels, replicate, overlap, head)
    block = next((layer for layer in layers if layer.name == modes.block), None)
    out = {}
    for index, layer in enumerate(layers):
        if layer is block:  # every node computes it; the master's share is all
            out[layer.name] = (layer.kernels,) + (0,) * len(cluster.workers)
        elif policy == COMPUTE:
            out[layer.name] = compute[layer.name]
        else:
            fused = modes.stages[layer.name] == FUSED
            resident = modes.kernels[layer.name] == RESIDENT
            replica = block if block is not None and index == 1 else None
            classes = modes.heads.get(layer.name, 0)
            images = modes.overlap[layer.name]
            out[layer.name] = tuple(
                link_aware_shares(cluster, layer, fused, resident, replica, images, classes)
            )
    return out
