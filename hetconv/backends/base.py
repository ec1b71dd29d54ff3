"""The device contract every convolution backend implements, and the checks they share.

Layout is NCHW for activations (batch, channels, height, width) and KCHW for kernels
(output channels, input channels, kernel height, kernel width), float32 and C-contiguous
at the boundary. Convolutions are cross-correlations with stride 1 (as in PyTorch).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

PaddingSpec = int | str | tuple[int, int] | tuple[int, int, int, int]


@dataclass(frozen=True)
class Padding:
    """Zero padding on each side of the image: top, bottom, left, right."""

    top: int
    bottom: int
    left: int
    right: int

    @classmethod
    def resolve(cls, spec: PaddingSpec, kernel_hw: tuple[int, int]) -> Padding:
        """Turn a user padding spec into explicit per-side padding.

        Args:
            spec: an int (same on every side), ``"valid"`` (none), ``"same"`` (output as large as
                the input; for even kernels the extra row/column goes to the bottom/right, as in
                PyTorch), ``(ph, pw)`` or ``(top, bottom, left, right)``.
            kernel_hw: kernel height and width.
        """
        kh, kw = kernel_hw
        if isinstance(spec, str):
            if spec == "valid":
                return cls(0, 0, 0, 0)
            if spec == "same":
                return cls(
                    (kh - 1) // 2, kh - 1 - (kh - 1) // 2, (kw - 1) // 2, kw - 1 - (kw - 1) // 2
                )
            raise ValueError(f"padding {spec!r} is not 'same', 'valid', an int or a tuple")
        if isinstance(spec, (int, np.integer)):
            sides = (int(spec),) * 4
        elif isinstance(spec, tuple) and len(spec) == 2:
            sides = (int(spec[0]), int(spec[0]), int(spec[1]), int(spec[1]))
        elif isinstance(spec, tuple) and len(spec) == 4:
            sides = tuple(int(v) for v in spec)
        else:
            raise ValueError(f"padding {spec!r} is not 'same', 'valid', an int or a 2/4-tuple")
        if min(sides) < 0:
            raise ValueError(f"padding {spec!r} has a negative side")
        return cls(*sides)


@dataclass(frozen=True)
class ConvShape:
    """The geometry of one stride-1 convolution: N images of C x H x W, K kernels of C x kh x kw."""

    n: int
    c: int
    h: int
    w: int
    k: int
    kh: int
    kw: int
    padding: Padding

    @property
    def out_hw(self) -> tuple[int, int]:
        p = self.padding
        return self.h + p.top + p.bottom - self.kh + 1, self.w + p.left + p.right - self.kw + 1

    @property
    def flops_forward(self) -> int:
        """Multiply-adds x 2 of the forward convolution (the same for each backward one)."""
        ho, wo = self.out_hw
        return 2 * self.n * ho * wo * self.k * self.c * self.kh * self.kw


@dataclass(frozen=True)
class DeviceInfo:
    """What a backend runs on. ``memory_bytes`` is what it may use for one request."""

    backend: str
    kind: str
    name: str
    memory_bytes: int
    cores: int


def _with_images(shape: ConvShape, n: int) -> ConvShape:
    return ConvShape(n, shape.c, shape.h, shape.w, shape.k, shape.kh, shape.kw, shape.padding)


def _check_array(name: str, a: np.ndarray, ndim: int) -> None:
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{name} must be a numpy array, got {type(a).__name__}")
    if a.dtype != np.float32:
        raise TypeError(f"{name} has dtype {a.dtype}, expected float32")
    if a.ndim != ndim:
        raise ValueError(f"{name} has shape {a.shape}, expected {ndim} dimensions")
    if not a.flags.c_contiguous:
        raise ValueError(f"{name} is not C-contiguous")


def conv_shape(x_shape, w_shape, padding: PaddingSpec) -> ConvShape:
    """Validate input and kernel shapes and return the convolution geometry."""
    n, c, h, w = (int(v) for v in x_shape)
    k, wc, kh, kw = (int(v) for v in w_shape)
    if wc != c:
        raise ValueError(f"kernels have {wc} input channels, input has {c}")
    if min(n, c, h, w, k, kh, kw) < 1:
        raise ValueError(f"empty convolution: input {tuple(x_shape)}, kernels {tuple(w_shape)}")
    shape = ConvShape(n, c, h, w, k, kh, kw, Padding.resolve(padding, (kh, kw)))
    ho, wo = shape.out_hw
    if ho < 1 or wo < 1:
        raise ValueError(
            f"kernel {kh}x{kw} does not fit input {h}x{w} with padding {shape.padding}"
        )
    return shape


class Backend(ABC):
    """A device that computes convolutions. Subclasses implement the ``_`` methods only.

    The public methods validate their arguments once, here, so every backend rejects the
    same bad input with the same error.
    """

    name: str = "abstract"
    #: Bytes one call may use on the device; None: what :meth:`describe` reports. A call whose
    #: working set (:meth:`working_set_bytes`) is larger runs in chunks of images.
    memory_limit: int | None = None

    @abstractmethod
    def describe(self) -> DeviceInfo:
        """The device this backend computes on."""

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        """(whether this backend can run here, why not if it cannot)."""
        return True, ""

    @classmethod
    def devices(cls) -> list[DeviceInfo]:
        """The devices this backend can compute on, in the order ``device=`` numbers them."""
        return [cls().describe()]

    def gemm_gflops(self, size: int = 1024, repeats: int = 3) -> float:
        """This device's measured float32 GEMM speed on ``size``-square matrices (best of
        ``repeats``): what convolution speeds are compared with.

        This default times a 1x1 convolution with ``size`` input channels, ``size`` kernels
        and ``size`` pixels, which is exactly a ``size``-cube GEMM, through the backend's own
        forward path; backends with a vendor GEMM (BLAS, cuBLAS) time that instead.
        """
        side = 32
        shape = ConvShape(1, size, side, max(1, size // side), size, 1, 1, Padding(0, 0, 0, 0))
        rng = np.random.default_rng(0)
        x = rng.standard_normal((1, size, shape.h, shape.w), dtype=np.float32)
        w = rng.standard_normal((size, size, 1, 1), dtype=np.float32)
        self.conv_forward(x, w, None, 0)
        self.synchronize()
        best = float("inf")
        for _ in range(max(1, repeats)):
            start = time.perf_counter()
            self.conv_forward(x, w, None, 0)
            self.synchronize()
            best = min(best, time.perf_counter() - start)
        return shape.flops_forward / best / 1e9

    def working_set_bytes(self, shape: ConvShape) -> int:
        """Device bytes one call on ``shape`` needs: inputs, kernels, outputs and a full
        lowering (im2col) of the input. Backends that need less may say so."""
        ho, wo = shape.out_hw
        values = (
            shape.n * shape.c * shape.h * shape.w
            + shape.k * shape.c * shape.kh * shape.kw
            + shape.n * shape.k * ho * wo
            + shape.n * ho * wo * shape.c * shape.kh * shape.kw
        )
        return 4 * values

    def _images_per_call(self, shape: ConvShape) -> int:
        """How many images one device call may take without exceeding the memory budget."""
        budget = self.memory_limit
        if budget is None:
            budget = getattr(self, "_device_memory", None)
            if budget is None:
                budget = self._device_memory = self.describe().memory_bytes
        need = self.working_set_bytes(shape)
        if need <= budget:
            return shape.n
        one = self.working_set_bytes(_with_images(shape, 1))
        if one > budget:
            raise MemoryError(
                f"one image of {shape} needs {one / 2**20:.1f} MiB on {self.name}, more than "
                f"its {budget / 2**20:.1f} MiB budget"
            )
        images = shape.n
        while images > 1 and self.working_set_bytes(_with_images(shape, images)) > budget:
            images = max(1, images * budget // self.working_set_bytes(_with_images(shape, images)))
            images = min(images, shape.n - 1)
        return int(images)

    def conv_forward(
        self, x: np.ndarray, w: np.ndarray, b: np.ndarray | None, padding: PaddingSpec
    ) -> np.ndarray:
        """Forward convolution.

        Args:
            x: float32 (N, C, H, W) inputs.
            w: float32 (K, C, kh, kw) kernels.
            b: float32 (K,) bias or None.
            padding: see :meth:`Padding.resolve`.

        Returns:
            float32 (N, K, Ho, Wo) feature maps.
        """
        _check_array("input", x, 4)
        _check_array("kernels", w, 4)
        shape = conv_shape(x.shape, w.shape, padding)
        if b is not None:
            _check_array("bias", b, 1)
            if b.shape[0] != shape.k:
                raise ValueError(f"bias has {b.shape[0]} entries, kernels {shape.k}")
        step = self._images_per_call(shape)
        if step >= shape.n:
            return self._forward(x, w, b, shape)
        ho, wo = shape.out_hw
        out = np.empty((shape.n, shape.k, ho, wo), np.float32)
        for first in range(0, shape.n, step):
            part = x[first : first + step]
            out[first : first + step] = self._forward(part, w, b, _with_images(shape, len(part)))
        return out

    def conv_grad_input(
        self, dy: np.ndarray, w: np.ndarray, input_hw: tuple[int, int], padding: PaddingSpec
    ) -> np.ndarray:
        """Gradient of the loss w.r.t. the convolution's input.

        Args:
            dy: float32 (N, K, Ho, Wo) gradient w.r.t. the output.
            w: float32 (K, C, kh, kw) kernels.
            input_hw: (H, W) of the forward input.
            padding: as in the forward call.

        Returns:
            float32 (N, C, H, W).
        """
        _check_array("output gradient", dy, 4)
        _check_array("kernels", w, 4)
        shape = conv_shape((dy.shape[0], w.shape[1], *input_hw), w.shape, padding)
        self._check_dy(dy, shape)
        step = self._images_per_call(shape)
        if step >= shape.n:
            return self._grad_input(dy, w, shape)
        out = np.empty((shape.n, shape.c, shape.h, shape.w), np.float32)
        for first in range(0, shape.n, step):
            part = dy[first : first + step]
            out[first : first + step] = self._grad_input(part, w, _with_images(shape, len(part)))
        return out

    def conv_grad_kernels(
        self, x: np.ndarray, dy: np.ndarray, kernel_hw: tuple[int, int], padding: PaddingSpec
    ) -> tuple[np.ndarray, np.ndarray]:
        """Gradients of the loss w.r.t. the kernels and the bias.

        Args:
            x: float32 (N, C, H, W) forward input.
            dy: float32 (N, K, Ho, Wo) gradient w.r.t. the output.
            kernel_hw: (kh, kw).
            padding: as in the forward call.

        Returns:
            float32 (K, C, kh, kw) kernel gradient and float32 (K,) bias gradient.
        """
        _check_array("input", x, 4)
        _check_array("output gradient", dy, 4)
        shape = conv_shape(x.shape, (dy.shape[1], x.shape[1], *kernel_hw), padding)
        self._check_dy(dy, shape)
        step = self._images_per_call(shape)
        if step >= shape.n:
            return self._grad_kernels(x, dy, shape)
        dw = np.zeros((shape.k, shape.c, shape.kh, shape.kw), np.float32)
        db = np.zeros(shape.k, np.float32)
        for first in range(0, shape.n, step):
            xs, dys = x[first : first + step], dy[first : first + step]
            part_w, part_b = self._grad_kernels(xs, dys, _with_images(shape, len(xs)))
            dw += part_w
            db += part_b
        return dw, db

    @staticmethod
    def _check_dy(dy: np.ndarray, shape: ConvShape) -> None:
        expected = (shape.n, shape.k, *shape.out_hw)
        if dy.shape != expected:
            raise ValueError(f"output gradient has shape {dy.shape}, expected {expected}")

    def synchronize(self) -> None:  # noqa: B027 - a no-op for host backends
        """Wait for queued device work (a no-op for host backends); used when timing."""

    def time_step(
        self, shape: ConvShape, repeats: int = 1, with_grad_input: bool = True, seed: int = 0
    ) -> float:
        """Seconds for one forward + backward of ``shape`` on random data (best of ``repeats``).

        This is the probe of the reference method: the real layer geometry, random values.
        """
        rng = np.random.default_rng(seed)
        x = rng.standard_normal((shape.n, shape.c, shape.h, shape.w), dtype=np.float32)
        w = rng.standard_normal((shape.k, shape.c, shape.kh, shape.kw), dtype=np.float32)
        b = rng.standard_normal(shape.k, dtype=np.float32)
        ho, wo = shape.out_hw
        dy = rng.standard_normal((shape.n, shape.k, ho, wo), dtype=np.float32)
        pad = (shape.padding.top, shape.padding.bottom, shape.padding.left, shape.padding.right)
        best = float("inf")
        for _ in range(max(1, repeats)):
            start = time.perf_counter()
            self.conv_forward(x, w, b, pad)
            self.conv_grad_kernels(x, dy, (shape.kh, shape.kw), pad)
            if with_grad_input:
                self.conv_grad_input(dy, w, (shape.h, shape.w), pad)
            self.synchronize()
            best = min(best, time.perf_counter() - start)
        return best

    @abstractmethod
    def _forward(
        self, x: np.ndarray, w: np.ndarray, b: np.ndarray | None, shape: ConvShape
    ) -> np.ndarray: ...

    @abstractmethod
    def _grad_input(self, dy: np.ndarray, w: np.ndarray, shape: ConvShape) -> np.ndarray: ...

    @abstractmethod
    def _grad_kernels(
        self, x: np.ndarray, dy: np.ndarray, shape: ConvShape
    ) -> tuple[np.ndarray, np.ndarray]: ...
