"""Where a model's convolutions run: one seam between the layers and the hardware.

A model's :class:`~hetconv.layers.Conv2d` layers never call a backend directly; they call a
:class:`ConvExecutor`. :class:`LocalConv` runs everything on one backend in this process; the
master's cluster implements the same two calls by splitting the kernels across workers.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, TextIO

import numpy as np

from .backends import Backend, PaddingSpec, get_backend

if TYPE_CHECKING:
    from .layers import Conv2d


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

    def prepare(self, layers: Sequence[Conv2d], batch: int, log: TextIO | None) -> None:
        """Called once before training with the model's conv layers (e.g. to probe devices)."""
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

    def begin_step(self, step):
        self._seconds = 0.0

    def end_step(self):
        return {"comm_seconds": 0.0, "conv_seconds": self._seconds}

    def close(self):
        pass
