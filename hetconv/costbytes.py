"""What each mode moves on the master's link in the cost model (:mod:`hetconv.costmodel`),
and the ``auto`` decisions made of it: a layer fused or not (:func:`stage_mode`), its kernels
resident or sent (:func:`kernel_mode`), its calls in image groups (:func:`overlap_images`), the
first block replicated (:func:`replicate_gain`) and split by images among the workers
(:func:`split_gain`). :mod:`hetconv.modetable` applies them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from hetconv.formats import FLOAT32, TensorFormat
from hetconv.overlap import group_count, group_images
from hetconv.resident import RESIDENT, SENT
from hetconv.split import SplitPlan, split_images
from hetconv.stages import FUSED, UNFUSED, StageSpec
from hetconv.wire import BUNDLE_BYTES
from hetconv.workload import (
    BACKWARD,
    PHASES,
    ConvLayer,
    call_bytes,
    resident_call_bytes,
    resident_sync_bytes,
    split_part,
    stage_call_bytes,
)


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
    split_seconds: float = 0.0,
) -> float:
    """Seconds per step a replicated first block is predicted to save (negative: to cost).

    Saved: the bytes :func:`replica_bytes` counts, for every worker with a share of the
    consumer, over the slowest of their ``links`` (bytes/s; the forward's requests share the
    master's port or the medium, as do the backward's answers). Cost: every node computes the
    whole block, so the step waits for the slowest node's whole block, ``max(block_seconds)``
    (each node's probe of it: forward and kernel gradients, all kernels; the master first),
    less what the block's layer split by kernels costs the step anyway (``split_seconds``: its
    slowest node's share of its block; a worker that holds every kernel of it computes the
    whole block either way). The block's own calls, which also go, are not counted: the
    estimate errs toward off."""
    if not links:
        return 0.0
    up, down = replica_bytes(block, consumer, fmt)
    saved = len(links) * (up + down) / min(links)
    return saved - max(max(block_seconds, default=0.0) - split_seconds, 0.0)


def split_gain(
    block: ConvLayer,
    consumer: ConvLayer,
    block_seconds: Sequence[float],
    links: Sequence[float],
    fmt: TensorFormat = FLOAT32,
    master_seconds: float = 0.0,
) -> float:
    """Seconds per step a replicated ``block`` split by images among the workers
    (:mod:`hetconv.split`) is predicted to save over every worker computing it whole
    (negative: to cost); 0 with fewer than two workers.

    ``block_seconds``: each worker's whole block (forward and kernel gradients, every image;
    :func:`~hetconv.modetable.block_seconds`), ``links``: its link (bytes/s), in the same
    order. Saved: the step waits for the slowest worker's block, whole (``max(block_seconds)``)
    against its share of the images, which are shared in proportion to speed
    (:func:`~hetconv.split.split_images`); and the master's link carries each worker only its
    own images. Cost: each worker's exchange on its own link, full duplex (switched; on one
    shared medium a split is refused before this is asked): forward it receives the other
    workers' images' block output; backward it sends its rows of their images and receives
    theirs of its own, the larger of the two. The step waits for the slowest worker's part
    and exchange, and for the master's own whole block (``master_seconds``: it computes the
    block on every image either way), so a split saves nothing where the master is the
    slowest."""
    if len(links) < 2 or len(links) != len(block_seconds) or consumer.shape.n < len(links):
        return 0.0
    n = consumer.shape.n
    s = consumer.shape
    row = fmt.nbytes((1, s.c, s.h, s.w))  # one image's block output
    weights = [1.0 / t if t > 0 else 1.0 for t in block_seconds]
    counts = split_images(n, weights)
    slowest = 0.0
    for whole, link, own in zip(block_seconds, links, counts, strict=True):
        others = n - own
        into = others * row  # forward: the others' output in
        back = max(others * row, (len(links) - 1) * own * row)  # backward: rows out and in
        exchange = (into + back) / link if link and link != float("inf") else 0.0
        slowest = max(slowest, whole * own / n + exchange)
    images = sum(block.images_bytes * (n - own) / n for own in counts) / min(links)
    return max(max(block_seconds) + images, master_seconds) - max(slowest, master_seconds)


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


__all__ = [
    "kernel_mode",
    "layer_bytes",
    "overlap_images",
    "replica_bytes",
    "replicate_gain",
    "resident_layer_bytes",
    "split_gain",
    "stage_mode",
]
