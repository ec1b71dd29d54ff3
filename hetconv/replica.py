"""A replicated first block: every node computes the network's first convolution and the
channel-local layers after it (its *block*) from the raw images itself, so the second layer's
input is never broadcast and its input gradient never travels back at full size.

Per step, each worker gets the images (N x C x H x W; as :data:`~hetconv.formats.PALETTE8`, a
quarter of float32's bytes and exact, when every channel holds at most 256 distinct values, as
normalised 8-bit pixels always do, else float32) and the block's kernels and biases (float32,
small: the first layer has few input channels) in one ReplicaForward call, runs the
block and keeps its output; the second layer's stage calls then send an empty ``x``
(``replica_layer`` names the block). Backward: the worker computes its part of the second
layer's input gradient as before, back-propagates it through the block (with what its forward
kept) to its part of the block's kernel and bias gradients, and answers those (``rw``, ``rb``)
instead of the input-gradient part. The master does the same with its own part (and the parts of
workers it covers) through the model's own layers, and adds the workers' parts: the block's
backward is linear in the incoming gradient, so the sum is the whole gradient, to float32
round-off. The master keeps the block's weights and updates them as any other layer's; they
travel with every step's ReplicaForward.

Which block is replicated: ``--replicate first`` replicates the first convolution's block when
the network starts with a convolution (stride 1, no batch norm in its block) whose block feeds
the next convolution directly and that next layer runs as a fused stage; ``auto`` does so when
the cost model predicts the step faster (:func:`hetconv.modetable.replica`); ``off``
never. Generalising to the first k blocks needs a worker to chain blocks; not built.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np

from hetconv.backends import ConvShape, conv_shape
from hetconv.formats import FLOAT32, PALETTE8, TensorFormat

OFF, FIRST, AUTO, SPLIT, SPLIT_ALL = "off", "first", "auto", "split", "split_all"
#: ``split``: as ``first``, the block split by images among the workers (:mod:`hetconv.split`);
#: ``split_all``: among the workers and the master.
REPLICATE_MODES = (OFF, FIRST, AUTO, SPLIT, SPLIT_ALL)
#: The modes that split the block by images.
SPLITS = (SPLIT, SPLIT_ALL)
#: ``split_all``: the master computes the block on its share of the images, or on none.
MASTER_BLOCK_SHARE, MASTER_BLOCK_NONE = "share", "none"
MASTER_BLOCKS = (MASTER_BLOCK_SHARE, MASTER_BLOCK_NONE)
#: A replicated block's stage mode, as the plan and the trace's ``stage_modes`` record it.
REPLICATED = "replicated"


def images_format(shape, fits: bool = True) -> TensorFormat:
    """The format images of ``shape`` travel in to a replicated block: palette8 when they
    ``fits`` it (at most 256 distinct values per channel) and it is the smaller, else
    float32."""
    smaller = PALETTE8.nbytes(shape) < FLOAT32.nbytes(shape)
    return PALETTE8 if fits and smaller else FLOAT32


@dataclass(frozen=True)
class ReplicaBlock:
    """One step's replicated block as the master sends it: the images, the block's kernels and
    biases, its padding sides (top, bottom, left, right) and its layers."""

    layer: str
    x: np.ndarray
    w: np.ndarray
    b: np.ndarray
    sides: tuple[int, int, int, int]
    stage: object  # a hetconv.stages.StageSpec
    # worker address -> its ReplicaForward of this step, started ahead (an object whose
    # result() gives the call's CallStats or raises its WorkerError): taken by the stage call
    started: dict = field(default_factory=dict, compare=False, repr=False)
    # the block split by images among the workers this step (hetconv.split): the master's
    # hetconv.master.replica.SplitStep; None: every worker computes every image
    split: object = field(default=None, compare=False, repr=False)

    @property
    def shape(self) -> ConvShape:
        return conv_shape(self.x.shape, self.w.shape, self.sides)

    @functools.cached_property
    def x_format(self) -> TensorFormat:
        """How the images travel (:func:`images_format`), with their encoding made once for
        every worker's call."""
        if images_format(self.x.shape) is FLOAT32:
            return FLOAT32
        return PALETTE8.prepared(self.x) or FLOAT32

    @property
    def nbytes(self) -> int:
        """Tensor bytes of its ReplicaForward request."""
        return self.x_format.nbytes(self.x.shape) + self.w.nbytes + self.b.nbytes

    @property
    def gradient_bytes(self) -> int:
        """Tensor bytes of the block's gradient parts a backward answers (rw, rb)."""
        return self.w.nbytes + self.b.nbytes


__all__ = [
    "AUTO", "FIRST", "MASTER_BLOCKS", "MASTER_BLOCK_NONE", "MASTER_BLOCK_SHARE", "OFF",
    "REPLICATED", "REPLICATE_MODES", "SPLIT", "SPLITS", "SPLIT_ALL",
    "ReplicaBlock",
    "images_format",
]  # fmt: skip
