"""The geometry of each call of :mod:`hetconv.calls` and how each tensor's shape follows from it.

A tensor's shape follows from the call's geometry, a :class:`~hetconv.backends.ConvShape` of the
worker's slice (N images of C x H x W, k kernels of C x kh x kw, padding): ``x`` and ``dx`` are
(N, C, H, W), ``w`` and ``dw`` (k, C, kh, kw), ``b`` and ``db`` (k,), ``y`` and ``dy`` the
feature maps (N, k, Ho, Wo).

A fused stage call (:mod:`hetconv.stages`) has a :class:`StageShape` for geometry instead: its
``conv`` is the widened slice's ConvShape (``x``, ``w``, ``b``, ``dx`` as above), ``y`` is
(N, own, Ho', Wo') and ``dy`` (N, grad, Ho', Wo'), the stage output of the owned kernels and its
gradient over the owned and halo channels; ``dw`` (own, C, kh, kw) and ``db`` (own,). Its
batch norm layers' tensors (all empty in a stage without one): ``bn`` (rows, k), per batch norm
its weight and bias of the widened slice and in evaluation its running mean and variance;
``stats`` (rows, own), per batch norm in training the batch mean and biased variance of the
owned channels (float32: the master's running statistics move by them); ``dbn`` (rows, own),
per batch norm the weight and bias gradients of the owned channels.

Resident calls (:mod:`hetconv.resident`) have a :class:`SliceShape` (PlaceKernels,
FetchKernels: ``w``, ``mw`` (k, C, kh, kw), ``b``, ``mb`` (k,)) or a :class:`ResidentStageShape`
(``hw`` (halo, C, kh, kw) and ``hb`` (halo,): the widened slice's kernels that are not the
worker's own; ``ew`` (edges, C, kh, kw) and ``eb`` (edges,)). With a split head
(:mod:`hetconv.head`) the slice also holds the final fully connected layer's columns of its
channels, ``f`` and ``mf`` (k, P, classes), P the stage output's positions; ``hf`` (halo, P,
classes) and ``ef`` (edges, P, classes) are those of the halo and edge channels; the forward
answers ``z`` (N, classes), the slice's partial logits, instead of ``y`` (then (N, 0, Ho',
Wo')), and the backward sends ``dz`` (N, classes) instead of ``dy``. Without a head ``f``,
``mf``, ``hf``, ``ef`` are (rows, 0, 0) and ``z``, ``dz`` (N, 0): no bytes.

A replicated first block (:mod:`hetconv.replica`): ReplicaForward has a :class:`ConvShape`
(the block's convolution over the images, all its kernels). A stage call that names the
block (``replica_layer``) sends an empty ``x`` (the worker has the input) and its backward
answers, instead of ``dx``, the block's kernel and bias gradient parts ``rw`` (k0, C0, kh0, kw0)
and ``rb`` (k0,), from the geometry's ``replica`` (the block's ConvShape).

A replicated block split by images (:mod:`hetconv.split`): PutPart and FetchPart carry one
part ``p``, whose geometry is its own shape, (count, k0, Ho0', Wo0'): a block output on some
images, or an input-gradient part for them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hetconv.backends import ConvShape, Padding

#: A tensor's shape.
Shape = tuple[int, ...]


def input_shape(s: ConvShape) -> Shape:
    """``x``, ``dx``: (N, C, H, W)."""
    return (s.n, s.c, s.h, s.w)


def kernel_shape(s: ConvShape) -> Shape:
    """``w``, ``dw``: (k, C, kh, kw)."""
    return (s.k, s.c, s.kh, s.kw)


def bias_shape(s: ConvShape) -> Shape:
    """``b``, ``db``: (k,)."""
    return (s.k,)


def map_shape(s: ConvShape) -> Shape:
    """``y``, ``dy``: (N, k, Ho, Wo)."""
    return (s.n, s.k, *s.out_hw)


def call_shape(
    x_shape: Sequence[int], w_shape: Sequence[int], padding: tuple[int, int, int, int]
) -> ConvShape:
    """The geometry of a call with input ``x_shape``, kernels ``w_shape`` and ``padding`` (top,
    bottom, left, right) as the master states it: not validated (the worker does that)."""
    n, c, h, w = (int(v) for v in x_shape)
    k, _, kh, kw = (int(v) for v in w_shape)
    top, bottom, left, right = (int(v) for v in padding)
    return ConvShape(n, c, h, w, k, kh, kw, Padding(top, bottom, left, right))


@dataclass(frozen=True)
class StageShape:
    """The geometry of one fused stage call (:mod:`hetconv.stages`).

    Attributes:
        conv: the convolution of the widened kernel slice (halo included).
        own: the kernels the node owns (answers ``y``, ``dw``, ``db`` for).
        grad: the channels of the stage-output gradient backward sends.
        out_hw: the stage output's (Ho', Wo') (after pooling).
        batchnorms: the stage's batch norm layers.
        training: whether they normalise by the batch's statistics (or the running ones).
        replica: the convolution of the replicated block whose output is this layer's input
            (:mod:`hetconv.replica`); None: the input travels.
    """

    conv: ConvShape
    own: int
    grad: int
    out_hw: tuple[int, int]
    batchnorms: int = 0
    training: bool = True
    replica: ConvShape | None = None


def stage_input_shape(s: StageShape) -> Shape:
    return input_shape(s.conv)


def stage_kernel_shape(s: StageShape) -> Shape:
    return kernel_shape(s.conv)


def stage_bias_shape(s: StageShape) -> Shape:
    return bias_shape(s.conv)


def stage_output_shape(s: StageShape) -> Shape:
    """``y``: (N, own, Ho', Wo')."""
    return (s.conv.n, s.own, *s.out_hw)


def stage_grad_shape(s: StageShape) -> Shape:
    """``dy``: (N, grad, Ho', Wo')."""
    return (s.conv.n, s.grad, *s.out_hw)


def stage_bn_shape(s: StageShape) -> Shape:
    """``bn``: (2 or 4 per batch norm, k): weight, bias (evaluation: running mean, var)."""
    return (s.batchnorms * (2 if s.training else 4), s.conv.k)


def stage_stats_shape(s: StageShape) -> Shape:
    """``stats``: (2 per batch norm in training, own): batch mean and biased variance."""
    return (2 * s.batchnorms if s.training else 0, s.own)


def stage_dbn_shape(s: StageShape) -> Shape:
    """``dbn``: (2 per batch norm, own): weight and bias gradients."""
    return (2 * s.batchnorms, s.own)


def stage_sent_input_shape(s: StageShape) -> Shape:
    """``x`` as a stage request sends it: (N, C, H, W), or empty with a replicated block."""
    return (0, 0, 0, 0) if s.replica is not None else input_shape(s.conv)


def replica_kernel_shape(s: StageShape) -> Shape:
    """``rw``: the replicated block's kernels (k0, C0, kh0, kw0)."""
    if s.replica is None:
        raise ValueError("rw needs the replicated block's geometry")
    return kernel_shape(s.replica)


def replica_bias_shape(s: StageShape) -> Shape:
    """``rb``: (k0,)."""
    if s.replica is None:
        raise ValueError("rb needs the replicated block's geometry")
    return bias_shape(s.replica)


def stage_dw_shape(s: StageShape) -> Shape:
    """``dw``: (own, C, kh, kw)."""
    return (s.own, s.conv.c, s.conv.kh, s.conv.kw)


def stage_db_shape(s: StageShape) -> Shape:
    """``db``: (own,)."""
    return (s.own,)


@dataclass(frozen=True)
class SliceShape:
    """A resident kernel slice: ``k`` kernels of C x kh x kw; with a split head, the final fc's
    columns of its channels: ``positions`` (the stage output's Ho' * Wo') by ``classes``."""

    k: int
    c: int
    kh: int
    kw: int
    positions: int = 0
    classes: int = 0


def slice_kernel_shape(s: SliceShape) -> Shape:
    """``w``, ``mw``: (k, C, kh, kw)."""
    return (s.k, s.c, s.kh, s.kw)


def slice_bias_shape(s: SliceShape) -> Shape:
    """``b``, ``mb``: (k,)."""
    return (s.k,)


def head_rows_shape(rows: int, positions: int, classes: int) -> Shape:
    """A split head's fc columns of ``rows`` channels: (rows, P, classes), or (rows, 0, 0)
    without a head (``classes`` 0)."""
    return (rows, positions, classes) if classes else (rows, 0, 0)


def slice_head_shape(s: SliceShape) -> Shape:
    """``f``, ``mf``: (k, P, classes), or (k, 0, 0) without a head."""
    return head_rows_shape(s.k, s.positions, s.classes)


@dataclass(frozen=True)
class ResidentStageShape:
    """A resident stage call: the stage geometry, how many edge kernels come back and the
    split head's classes (0: none)."""

    stage: StageShape
    edges: int
    classes: int = 0

    @property
    def positions(self) -> int:
        """The stage output's positions per channel, Ho' * Wo'."""
        return self.stage.out_hw[0] * self.stage.out_hw[1]

    @property
    def halo(self) -> int:
        """Kernels of the widened slice that are not the worker's own (sent as hw, hb)."""
        return self.stage.conv.k - self.stage.own


def resident_input_shape(s: ResidentStageShape) -> Shape:
    return input_shape(s.stage.conv)


def resident_sent_input_shape(s: ResidentStageShape) -> Shape:
    return stage_sent_input_shape(s.stage)


def resident_replica_kernel_shape(s: ResidentStageShape) -> Shape:
    return replica_kernel_shape(s.stage)


def resident_replica_bias_shape(s: ResidentStageShape) -> Shape:
    return replica_bias_shape(s.stage)


def halo_kernel_shape(s: ResidentStageShape) -> Shape:
    """``hw``: (halo, C, kh, kw)."""
    c = s.stage.conv
    return (s.halo, c.c, c.kh, c.kw)


def halo_bias_shape(s: ResidentStageShape) -> Shape:
    """``hb``: (halo,)."""
    return (s.halo,)


def halo_head_shape(s: ResidentStageShape) -> Shape:
    """``hf``: (halo, P, classes), or (halo, 0, 0) without a head."""
    return head_rows_shape(s.halo, s.positions, s.classes)


def resident_output_shape(s: ResidentStageShape) -> Shape:
    """``y``: (N, own, Ho', Wo'); with a split head (N, 0, Ho', Wo')."""
    n, own, *hw = stage_output_shape(s.stage)
    return (n, 0 if s.classes else own, *hw)


def resident_logits_shape(s: ResidentStageShape) -> Shape:
    """``z``, ``dz``: (N, classes), or (N, 0) without a head."""
    return (s.stage.conv.n, s.classes)


def resident_grad_shape(s: ResidentStageShape) -> Shape:
    """``dy``: (N, grad, Ho', Wo'); with a split head (N, 0, Ho', Wo')."""
    n, grad, *hw = stage_grad_shape(s.stage)
    return (n, 0 if s.classes else grad, *hw)


def resident_bn_shape(s: ResidentStageShape) -> Shape:
    """``bn``: as :func:`stage_bn_shape`, of the widened slice."""
    return stage_bn_shape(s.stage)


def resident_stats_shape(s: ResidentStageShape) -> Shape:
    """``stats``: as :func:`stage_stats_shape`, of the owned channels."""
    return stage_stats_shape(s.stage)


def resident_dbn_shape(s: ResidentStageShape) -> Shape:
    """``dbn``: as :func:`stage_dbn_shape`, of the owned channels."""
    return stage_dbn_shape(s.stage)


def edge_kernel_shape(s: ResidentStageShape) -> Shape:
    """``ew``: (edges, C, kh, kw)."""
    c = s.stage.conv
    return (s.edges, c.c, c.kh, c.kw)


def edge_bias_shape(s: ResidentStageShape) -> Shape:
    """``eb``: (edges,)."""
    return (s.edges,)


def edge_head_shape(s: ResidentStageShape) -> Shape:
    """``ef``: (edges, P, classes), or (edges, 0, 0) without a head."""
    return head_rows_shape(s.edges, s.positions, s.classes)


def part_shape(s: Sequence[int]) -> Shape:
    """``p``: a split block's part, whose geometry is its shape."""
    return tuple(int(v) for v in s)


__all__ = [
    "ResidentStageShape",
    "Shape",
    "SliceShape",
    "StageShape",
    "bias_shape",
    "call_shape",
    "edge_bias_shape",
    "edge_head_shape",
    "edge_kernel_shape",
    "halo_bias_shape",
    "halo_head_shape",
    "halo_kernel_shape",
    "head_rows_shape",
    "input_shape",
    "kernel_shape",
    "map_shape",
    "part_shape",
    "replica_bias_shape",
    "replica_kernel_shape",
    "resident_bn_shape",
    "resident_dbn_shape",
    "resident_grad_shape",
    "resident_input_shape",
    "resident_logits_shape",
    "resident_output_shape",
    "resident_replica_bias_shape",
    "resident_replica_kernel_shape",
    "resident_sent_input_shape",
    "resident_stats_shape",
    "slice_bias_shape",
    "slice_head_shape",
    "slice_kernel_shape",
    "stage_bias_shape",
    "stage_bn_shape",
    "stage_db_shape",
    "stage_dbn_shape",
    "stage_dw_shape",
    "stage_grad_shape",
    "stage_input_shape",
    "stage_kernel_shape",
    "stage_output_shape",
    "stage_sent_input_shape",
    "stage_stats_shape",
]
