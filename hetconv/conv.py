"""Where a model's convolutions run: one seam between the layers and the hardware.

A model's :class:`~hetconv.layers.Conv2d` layers never call a backend directly; they call a
:class:`ConvExecutor`. :class:`LocalConv` runs everything on one backend in this process; the
master's cluster implements the same two calls by splitting the kernels across workers.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from .backends import Backend, PaddingSpec, get_backend


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


class LocalConv:
    """Runs every convolution on one backend in this process.

    Args:
        backend: a :class:`~hetconv.backends.Backend`, or a backend name.
    """

    def __init__(self, backend: Backend | str = "cpu"):
        self.backend = get_backend(backend) if isinstance(backend, str) else backend

    def forward(self, layer, x, w, b, padding):
        return self.backend.conv_forward(x, w, b, padding)

    def backward(self, layer, x, w, dy, padding, need_input_grad):
        dw, db = self.backend.conv_grad_kernels(x, dy, w.shape[2:], padding)
        dx = self.backend.conv_grad_input(dy, w, x.shape[2:], padding) if need_input_grad else None
        return dx, dw, db
