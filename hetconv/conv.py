"""Where a model's convolutions run: one seam between the layers and the hardware.

A model's :class:`~hetconv.layers.Conv2d` layers never call a backend directly; they call a
:class:`ConvExecutor`. :class:`LocalConv` runs everything on one backend in this process; the
master's cluster implements the same calls by splitting the kernels across workers. Executors
learn the model's convolutions as :class:`ConvSpec` values (name and geometry, no weights), so
this module needs nothing from the layers.
"""

from __future__ import annotations

import operator
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TextIO

import numpy as np

from .backends import Backend, ConvShape, PaddingSpec, conv_shape, get_backend


def kernel_pair(kernel_size: int | Sequence[int]) -> tuple[int, int]:
    """(kh, kw) of a kernel size given as one int or two; floats are refused."""
    kh, kw = (kernel_size, kernel_size) if isinstance(kernel_size, int) else kernel_size
    return operator.index(kh), operator.index(kw)


def strided_hw(full_hw: Sequence[int], stride: tuple[int, int]) -> tuple[int, int]:
    """(Ho, Wo) of a convolution with ``stride`` whose stride-1 output is ``full_hw``:
    ``floor((H_padded - kh) / s) + 1``, PyTorch's size."""
    (h, w), (sh, sw) = full_hw, stride
    return -(-int(h) // sh), -(-int(w) // sw)


def stride_output(y: np.ndarray, stride: tuple[int, int]) -> np.ndarray:
    """A strided convolution's output from the stride-1 one: every ``stride``-th row and column
    of float32 (N, K, Ho1, Wo1), starting at the first (C-contiguous; ``y`` itself at stride 1)."""
    if stride == (1, 1):
        return y
    return np.ascontiguousarray(y[:, :, :: stride[0], :: stride[1]])


def stride_gradient(dy: np.ndarray, stride: tuple[int, int], full_hw: Sequence[int]) -> np.ndarray:
    """The stride-1 output gradient whose subsampling (:func:`stride_output`) is ``dy``: zeros
    of (N, K, *full_hw) with ``dy`` at every ``stride``-th row and column. Backward of the
    stride-1 convolution on it is backward of the strided one, exactly."""
    if stride == (1, 1):
        return dy
    full = np.zeros((*dy.shape[:2], *full_hw), np.float32)
    full[:, :, :: stride[0], :: stride[1]] = dy
    return full


@dataclass(frozen=True)
class ConvSpec:
    """One convolution layer as an executor sees it: its name and geometry, no weights.

    Attributes:
        name: the layer's name (the ``layer`` argument of every executor call).
        input_shape: per-sample input (C, H, W).
        kernels: output channels K.
        kernel_size: (kh, kw).
        padding: as the layer passes it to the executor (see :class:`~hetconv.backends.Padding`).
        need_input_grad: False for a network's first layer: nothing consumes that gradient.
        stage: the channel-local layers that follow it in the model
            (a :class:`hetconv.stages.StageSpec`), which an executor that supports stages may
            run with it on each kernel slice; None when a conv or fc follows. Not compared:
            it describes what follows the convolution, not the convolution.
        stride: (sh, sw). Executors compute the stride-1 convolution (:meth:`shape`), which
            the layer subsamples (:func:`stride_output`); :attr:`output_shape` is strided.
    """

    name: str
    input_shape: tuple[int, int, int]
    kernels: int
    kernel_size: tuple[int, int]
    padding: PaddingSpec = 0
    need_input_grad: bool = True
    stage: Any = field(default=None, compare=False)
    stride: tuple[int, int] = (1, 1)

    @property
    def weight_shape(self) -> tuple[int, int, int, int]:
        """The kernels' array shape (K, C, kh, kw)."""
        return (self.kernels, self.input_shape[0], *self.kernel_size)

    def shape(self, batch: int) -> ConvShape:
        """The geometry of one executor call on ``batch`` images (the stride-1 convolution
        that executors compute).

        Raises:
            ValueError: the kernels do not fit the input (or a size is not positive).
        """
        return conv_shape((batch, *self.input_shape), self.weight_shape, self.padding)

    @property
    def output_shape(self) -> tuple[int, int, int]:
        """Per-sample output (K, Ho, Wo) after the stride; raises ValueError as :meth:`shape`
        does."""
        return (self.kernels, *strided_hw(self.shape(1).out_hw, self.stride))


class ConvExecutor(Protocol):
    """Computes the convolutions of named layers, forward and backward."""

    def forward(
        self, layer: str, x: np.ndarray, w: np.ndarray, b: np.ndarray, padding: PaddingSpec
    ) -> np.ndarray:
        """float32 (N, K, Ho, Wo) feature maps of ``x`` (N, C, H, W) with kernels ``w``."""
        ...

    def backward(
        self,
        layer: str,
        x: np.ndarray,
        w: np.ndarray,
        dy: np.ndarray,
        padding: PaddingSpec,
        need_input_grad: bool,
    ) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
        """(input gradient or None, kernel gradient, bias gradient) for output gradient ``dy``."""
        ...

    def prepare(self, layers: Sequence[ConvSpec], batch: int, log: TextIO | None) -> None:
        """Called once before training with the model's conv layers (e.g. to probe devices)."""
        ...

    def plan_record(self) -> dict | None:
        """How the work is split, for the first record a training run writes to its trace (after
        :meth:`prepare`, at every start, fresh or resumed), or None for nothing to record.

        The dict must be JSON-ready and must not hold ``step`` (the trace's step records are the
        ones with a step); training writes ``{"event": "plan", "start_step": ..., **plan}``. The
        master's cluster gives its nodes (name, description, probe seconds per layer, measured
        link) and each layer's kernel shares, node by node.
        """
        ...

    def begin_step(self, step: int) -> None:
        """Calls until the next ``begin_step`` belong to training step ``step``."""
        ...

    def end_step(self) -> dict:
        """Trace fields for the step just done: at least ``comm_seconds`` and
        ``conv_seconds`` (seconds spent moving data, and computing on the slowest node)."""
        ...

    def close(self) -> None:
        """Release connections and threads."""
        ...


class StageExecutor(ConvExecutor, Protocol):
    """An executor that can also run *fused stages* (:mod:`hetconv.stages`): a convolution and
    the channel-local layers after it, on each node's kernel slice. A model groups a
    convolution with its stage when its executor has ``supports_stages = True``, and asks
    :meth:`stage_mode` per layer whether to run them fused."""

    supports_stages: bool

    def stage_mode(self, layer: str) -> str:
        """``"fused"`` or ``"unfused"`` for the named layer."""
        ...

    def stage_forward(
        self, layer: str, x: np.ndarray, w: np.ndarray, b: np.ndarray, padding: PaddingSpec, stage
    ) -> np.ndarray:
        """float32 (N, K, Ho', Wo'): the stage's output (after its last layer, e.g. pooled)."""
        ...

    def stage_backward(
        self,
        layer: str,
        x: np.ndarray,
        w: np.ndarray,
        b: np.ndarray,
        dy: np.ndarray,
        padding: PaddingSpec,
        need_input_grad: bool,
        stage,
    ) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
        """(input gradient or None, kernel gradient, bias gradient) for the gradient ``dy`` of
        the stage's output."""
        ...


class LocalConv:
    """Runs every convolution on one backend in this process.

    Args:
        backend: a :class:`~hetconv.backends.Backend`, or a backend name.
    """

    def __init__(self, backend: Backend | str = "cpu"):
        self.backend = get_backend(backend) if isinstance(backend, str) else backend
        self._seconds = 0.0

    def forward(self, layer, x, w, b, padding):
        start = time.perf_counter()
        y = self.backend.conv_forward(x, w, b, padding)
        self._seconds += time.perf_counter() - start
        return y

    def backward(self, layer, x, w, dy, padding, need_input_grad):
        start = time.perf_counter()
        dw, db = self.backend.conv_grad_kernels(x, dy, w.shape[2:], padding)
        dx = self.backend.conv_grad_input(dy, w, x.shape[2:], padding) if need_input_grad else None
        self._seconds += time.perf_counter() - start
        return dx, dw, db

    def prepare(self, layers, batch, log):
        pass

    def plan_record(self):
        return None

    def begin_step(self, step):
        self._seconds = 0.0

    def end_step(self):
        return {"comm_seconds": 0.0, "conv_seconds": self._seconds}

    def close(self):
        pass
