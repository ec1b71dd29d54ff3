"""What a fused stage is: the channel-local layers after a convolution, as values.

:class:`StageOp` is one layer of the chain with the options that define it, :class:`StageSpec`
the chain, :class:`BatchNormSlice` what a node needs of a batch norm to run it on its kernel
slice. How a stage runs, travels and is split is :mod:`hetconv.stages`, which re-exports all
of these.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from .layers import (
    BatchNorm2d,
    GlobalAvgPool2d,
    Layer,
    LocalResponseNorm,
    Pool2d,
    ReLU,
    pool_geometry,
    pool_output_shape,
)

#: The layer types a stage may hold after its convolution (the spec's names).
CHANNEL_LOCAL = ("relu", "lrn", "maxpool", "avgpool", "gap", "batchnorm")
POOL_KINDS = ("maxpool", "avgpool")
#: The :class:`~hetconv.layers.Pool2d` mode of each pool kind.
POOL_MODES = {"maxpool": "max", "avgpool": "avg"}
FUSED, UNFUSED, AUTO = "fused", "unfused", "auto"
STAGE_MODES = (FUSED, UNFUSED, AUTO)


@dataclass(frozen=True)
class StageOp:
    """One channel-local layer of a stage, with the options that define it.

    ``kind`` is ``"relu"``, ``"lrn"`` (``size``, ``alpha``, ``beta``, ``k`` as
    :class:`~hetconv.layers.LocalResponseNorm`), ``"maxpool"`` or ``"avgpool"`` (``kernel``,
    ``stride`` as :class:`~hetconv.layers.Pool2d`), ``"gap"`` or ``"batchnorm"`` (``eps``,
    ``momentum`` as :class:`~hetconv.layers.BatchNorm2d`).

    Raises:
        ValueError: an unknown kind or an option out of range, naming it.
    """

    kind: str
    size: int = 0
    alpha: float = 0.0
    beta: float = 0.0
    k: float = 0.0
    kernel: int = 0
    stride: int = 0
    eps: float = 1e-5
    momentum: float = 0.1

    def __post_init__(self) -> None:
        if self.kind not in CHANNEL_LOCAL:
            raise ValueError(
                f"stage layer kind {self.kind!r}; expected one of {', '.join(CHANNEL_LOCAL)}"
            )
        if self.kind == "batchnorm":
            if not (math.isfinite(self.eps) and self.eps > 0):
                raise ValueError(f"stage batchnorm eps must be finite and > 0, got {self.eps}")
            if not 0.0 <= self.momentum <= 1.0:
                raise ValueError(f"stage batchnorm momentum must be in [0, 1], got {self.momentum}")
        if self.kind == "lrn":
            if self.size < 1:
                raise ValueError(f"stage lrn size must be >= 1, got {self.size}")
            for name in ("alpha", "beta", "k"):
                if not math.isfinite(getattr(self, name)):
                    raise ValueError(f"stage lrn {name} must be finite, got {getattr(self, name)}")
        if self.kind in POOL_KINDS:
            pool_geometry(self.kernel, self.stride)  # both >= 1

    @classmethod
    def from_entry(cls, entry: Mapping) -> StageOp:
        """The op of a model spec entry (``{"type": "lrn", "size": 5}``), defaults as the
        layers have them."""
        kind = entry.get("type")
        if kind == "lrn":
            return cls(
                "lrn",
                size=int(entry.get("size", 5)),
                alpha=float(entry.get("alpha", 1e-4)),
                beta=float(entry.get("beta", 0.75)),
                k=float(entry.get("k", 1.0)),
            )
        if kind in POOL_KINDS:
            kernel, stride = pool_geometry(entry.get("kernel", 2), entry.get("stride"))
            return cls(kind, kernel=kernel, stride=stride)
        if kind == "batchnorm":
            return cls(
                kind,
                eps=float(entry.get("eps", 1e-5)),
                momentum=float(entry.get("momentum", 0.1)),
            )
        return cls(kind)

    @property
    def reach(self) -> tuple[int, int]:
        """(before, after): output channel c reads input channels c - before .. c + after."""
        if self.kind == "lrn":
            return self.size // 2, (self.size - 1) // 2
        return 0, 0

    def build(self, name: str, channels: int = 0) -> Layer:
        """A fresh layer object computing this op (on ``channels``: batch norm's count)."""
        if self.kind == "batchnorm":
            return BatchNorm2d(name, channels, self.eps, self.momentum)
        if self.kind == "relu":
            return ReLU(name)
        if self.kind == "lrn":
            return LocalResponseNorm(name, self.size, self.alpha, self.beta, self.k)
        if self.kind == "gap":
            return GlobalAvgPool2d(name)
        return Pool2d(name, self.kernel, self.stride, POOL_MODES[self.kind])


@dataclass(frozen=True)
class StageSpec:
    """The channel-local chain after a convolution: the part of a stage that is not the
    convolution itself (which the call's tensors and padding describe)."""

    ops: tuple[StageOp, ...]

    def __post_init__(self) -> None:
        if not self.ops:
            raise ValueError("a stage needs at least one channel-local layer after its conv")

    @classmethod
    def from_entries(cls, entries: Sequence[Mapping]) -> StageSpec:
        return cls(tuple(StageOp.from_entry(e) for e in entries))

    @property
    def halo(self) -> int:
        """Extra kernels a node computes on each side of its slice (``W`` above)."""
        return sum(sum(op.reach) for op in self.ops)

    @property
    def grad_reach(self) -> tuple[int, int]:
        """(A, B): backward needs the chain-output gradient of channels s - A .. e + B - 1."""
        return sum(op.reach[1] for op in self.ops), sum(op.reach[0] for op in self.ops)

    def widened(self, own: slice, kernels: int) -> slice:
        """The kernels a node computes for owning ``own`` of a layer's ``kernels``."""
        return slice(max(own.start - self.halo, 0), min(own.stop + self.halo, kernels))

    def grad_range(self, own: slice, kernels: int) -> slice:
        """The channels of the chain-output gradient backward sends for ``own``."""
        a, b = self.grad_reach
        return slice(max(own.start - a, 0), min(own.stop + b, kernels))

    def output_hw(self, hw: tuple[int, int]) -> tuple[int, int]:
        """The chain's output (Ho, Wo) for a convolution output of ``hw``.

        Raises:
            ValueError: a pool window larger than what reaches it.
        """
        shape = (1, *hw)
        for op in self.ops:
            if op.kind in POOL_KINDS:
                shape = pool_output_shape(shape, op.kernel, op.stride)
            elif op.kind == "gap":
                shape = (1, 1, 1)
        return shape[1], shape[2]

    @property
    def batchnorms(self) -> int:
        """How many batch norm ops the stage holds (each needs a :class:`BatchNormSlice`)."""
        return sum(op.kind == "batchnorm" for op in self.ops)

    def batchnorm_hw(self, hw: tuple[int, int]) -> list[tuple[int, int]]:
        """The (H, W) each batch norm op sees, in order, for a convolution output of ``hw``:
        its statistics are over N * H * W values per channel."""
        out, shape = [], (1, *hw)
        for op in self.ops:
            if op.kind == "batchnorm":
                out.append(shape[1:])
            elif op.kind in POOL_KINDS:
                shape = pool_output_shape(shape, op.kernel, op.stride)
            elif op.kind == "gap":
                shape = (1, 1, 1)
        return out

    def build(self, layer: str, channels: int = 0) -> list[Layer]:
        return [op.build(f"{layer}.{op.kind}{i}", channels) for i, op in enumerate(self.ops)]


@dataclass(frozen=True)
class BatchNormSlice:
    """What a node needs of one batch norm layer to run it on its widened kernel slice.

    ``weight``, ``bias``: float32 (k,) of the widened slice's channels (halo included: an LRN
    after the batch norm reads them). ``training``: normalise by the batch's statistics
    (``running_mean`` and ``running_var`` are then not needed) or, in evaluation, by the
    running statistics, float32 (k,) of the same channels.
    """

    weight: np.ndarray
    bias: np.ndarray
    training: bool = True
    running_mean: np.ndarray | None = None
    running_var: np.ndarray | None = None

    @classmethod
    def of(cls, layer: BatchNorm2d, channels: slice) -> BatchNormSlice:
        """What ``channels`` of the model's ``layer`` are, in its current mode (copies)."""
        params, buffers = layer.params, layer.buffers
        running = (None, None)
        if not layer.training:
            running = (buffers["running_mean"][channels], buffers["running_var"][channels])
        return cls(
            params["weight"][channels].copy(),
            params["bias"][channels].copy(),
            layer.training,
            *(None if a is None else a.copy() for a in running),
        )

    def check(self, index: int, channels: int) -> None:
        """Raise ValueError naming the array that is not float32 (``channels``,)."""
        arrays = {"weight": self.weight, "bias": self.bias}
        if not self.training:
            arrays |= {"running_mean": self.running_mean, "running_var": self.running_var}
        for name, a in arrays.items():
            if a is None:
                raise ValueError(f"stage batchnorm {index}: evaluation needs its {name}")
            if a.dtype != np.float32 or a.shape != (channels,):
                raise ValueError(
                    f"stage batchnorm {index}: {name} is {a.dtype} {a.shape}, expected "
                    f"float32 ({channels},) for the {channels} kernels computed"
                )


def stage_of(entries: Sequence[Mapping]) -> StageSpec | None:
    """The stage of the spec entries that follow a convolution: the leading run of
    channel-local ones, or None when there is none."""
    chain = []
    for entry in entries:
        if entry.get("type") not in CHANNEL_LOCAL:
            break
        chain.append(entry)
    return StageSpec.from_entries(chain) if chain else None
