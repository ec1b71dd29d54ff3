"""Pooling layers: max and average pooling over windows (:class:`Pool2d`, no padding, floor
mode) and the global average (:class:`GlobalAvgPool2d`), PyTorch's semantics; float32, NCHW, in
the array module of the array given (numpy or cupy). :mod:`hetconv.layers` exports them with the
other layers."""

from __future__ import annotations

import numpy as np

from .backends import onednn_layers
from .backends.arrays import array_module
from .graph import Layer


def pool_geometry(kernel_size: int, stride: int | None = None) -> tuple[int, int]:
    """(kernel, stride) of a max-pool; the stride defaults to the kernel size.

    Raises:
        ValueError: either is below 1.
    """
    kernel = int(kernel_size)
    step = int(stride) if stride is not None else kernel
    if kernel < 1 or step < 1:
        raise ValueError(f"pool kernel {kernel_size} and stride {stride} must be >= 1")
    return kernel, step


def pool_output_shape(input_shape: tuple[int, ...], kernel: int, stride: int) -> tuple[int, ...]:
    """Per-sample (C, Ho, Wo) of a max-pool (no padding, floor mode) over (C, H, W).

    Raises:
        ValueError: the window is larger than the input.
    """
    c, h, w = input_shape
    if h < kernel or w < kernel:
        raise ValueError(f"pool window {kernel} larger than input {h}x{w}")
    return (c, (h - kernel) // stride + 1, (w - kernel) // stride + 1)


#: What :class:`Pool2d` computes over each window, by mode.
POOL_MODES = ("max", "avg")


class Pool2d(Layer):
    """Max or average pooling (no padding, floor mode): ``torch.nn.MaxPool2d(kernel, stride)``
    with ``mode="max"``, ``torch.nn.AvgPool2d(kernel, stride)`` with ``mode="avg"``.

    Max pooling's ties go to the first maximum in row-major window order, as in PyTorch, so
    gradients match even where ReLU makes whole windows zero.
    """

    def __init__(
        self, name: str, kernel_size: int = 2, stride: int | None = None, mode: str = "max"
    ):
        super().__init__(name)
        if mode not in POOL_MODES:
            raise ValueError(f"{name}: pool mode {mode!r}; expected one of {POOL_MODES}")
        self.kernel_size, self.stride = pool_geometry(kernel_size, stride)
        self.mode = mode

    def output_shape(self, input_shape):
        try:
            return pool_output_shape(input_shape, self.kernel_size, self.stride)
        except ValueError as e:
            raise ValueError(f"{self.name}: {e}") from None

    def _tap(self, a: np.ndarray, i: int, j: int, ho: int, wo: int) -> np.ndarray:
        s = self.stride
        return a[:, :, i : i + s * (ho - 1) + 1 : s, j : j + s * (wo - 1) + 1 : s]

    def forward(self, x):
        _, ho, wo = self.output_shape(x.shape[1:])
        k = self.kernel_size
        self._workspace = None
        if self.mode == "max":
            pooled = onednn_layers.max_pool(x, k, self.stride)  # where oneDNN serves
            if pooled is not None:
                y, self._workspace = pooled
                self._x_shape, self._x, self._y = x.shape, None, None  # none kept for backward
                return y
        y = self._tap(x, 0, 0, ho, wo).copy()
        if self.mode == "max":
            xp = array_module(x)
            for t in range(1, k * k):
                xp.maximum(y, self._tap(x, t // k, t % k, ho, wo), out=y)
            self._x, self._y = x, y
            return y
        for t in range(1, k * k):
            y += self._tap(x, t // k, t % k, ho, wo)
        y *= np.float32(1.0 / (k * k))
        self._x_shape = x.shape
        return y

    def backward(self, dy):
        if self.mode == "avg":
            return self._avg_backward(dy)
        if self._workspace is not None:
            k, s = self.kernel_size, self.stride
            return onednn_layers.max_pool_backward(dy, self._workspace, self._x_shape, k, s)
        k = self.kernel_size
        ho, wo = dy.shape[2:]
        x, y = self._x, self._y
        xp = array_module(x)
        overlapping = self.stride < k
        dx = xp.zeros(x.shape, np.float32)
        # The first tap in window order that equals the maximum takes the gradient: route
        # what is left of dy to each tap in turn, then clear it where that tap took it.
        left = dy.copy()
        hit = xp.empty(y.shape, bool)
        for t in range(k * k):
            i, j = t // k, t % k
            xp.equal(self._tap(x, i, j, ho, wo), y, out=hit)
            target = self._tap(dx, i, j, ho, wo)
            if overlapping:  # windows share inputs: their gradients add up
                target += left * hit
            else:
                xp.multiply(left, hit, out=target)
            if t < k * k - 1:
                xp.logical_not(hit, out=hit)
                left *= hit
        return dx

    def _avg_backward(self, dy):
        k = self.kernel_size
        ho, wo = dy.shape[2:]
        dx = array_module(dy).zeros(self._x_shape, np.float32)
        share = dy * np.float32(1.0 / (k * k))
        for t in range(k * k):
            self._tap(dx, t // k, t % k, ho, wo)[...] += share
        return dx

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, {self.mode!r})"


def MaxPool2d(name: str, kernel_size: int = 2, stride: int | None = None) -> Pool2d:
    """A max-pool: :class:`Pool2d` with ``mode="max"``."""
    return Pool2d(name, kernel_size, stride, "max")


def AvgPool2d(name: str, kernel_size: int = 2, stride: int | None = None) -> Pool2d:
    """An average pool: :class:`Pool2d` with ``mode="avg"``."""
    return Pool2d(name, kernel_size, stride, "avg")


class GlobalAvgPool2d(Layer):
    """The mean of each channel's map: (N, C, H, W) -> (N, C, 1, 1), as
    ``torch.nn.AdaptiveAvgPool2d(1)`` (and ONNX's GlobalAveragePool)."""

    def output_shape(self, input_shape):
        return (input_shape[0], 1, 1)

    def forward(self, x):
        self._x_shape = x.shape
        return x.mean(axis=(2, 3), keepdims=True, dtype=np.float32)

    def backward(self, dy):
        n, c, h, w = self._x_shape
        xp = array_module(dy)
        return xp.broadcast_to(dy * np.float32(1.0 / (h * w)), self._x_shape).copy()
