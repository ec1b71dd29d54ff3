"""The device contract every convolution backend implements, and what they share.

Layout is NCHW for activations (batch, channels, height, width) and KCHW for kernels
(output channels, input channels, kernel height, kernel width), float32 and C-contiguous
at the boundary. Convolutions are cross-correlations (as in PyTorch), with stride 1 but on a
backend that takes strides (:attr:`Backend.native_stride`).

Shared here, once, above the backends: the geometry and its padding arithmetic
(:class:`Padding`, :class:`ConvShape`, :func:`conv_shape`; the array and device-number checks
are :mod:`.checks`'), splitting a batch into chunks of images (:func:`image_ranges`,
:func:`chunk_bounds`, :func:`fit_images`), and in :class:`Backend` the argument checks of the
public calls, the memory-budget split and the probe (:meth:`Backend.time_step`, timed by the
clocks of :mod:`.clocks`).

Where a call's arrays live: :attr:`Backend.xp` (the array module of the backend's device
arrays), :meth:`Backend.to_device`, :meth:`Backend.to_host` and :meth:`Backend.scope` let a
caller run a whole stage on a device backend's own arrays (:mod:`hetconv.stages`); on host
backends they are numpy and the identity, and the public operations take and answer numpy
arrays as before.
"""

from __future__ import annotations

import contextlib
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from ..cpushare import process_quota_share
from .arrays import array_module
from .checks import _check_array, check_shape
from .clocks import DeviceClock, WallClock, clocks_open_here

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

    @property
    def sides(self) -> tuple[int, int, int, int]:
        """(top, bottom, left, right): the explicit spec that resolves to this padding."""
        return self.top, self.bottom, self.left, self.right


@dataclass(frozen=True)
class ConvShape:
    """The geometry of one convolution: N images of C x H x W, K kernels of C x kh x kw, at
    ``stride`` (sh, sw): (1, 1) but on a backend with :attr:`Backend.native_stride`."""

    n: int
    c: int
    h: int
    w: int
    k: int
    kh: int
    kw: int
    padding: Padding
    stride: tuple[int, int] = (1, 1)

    @property
    def padded_hw(self) -> tuple[int, int]:
        """Height and width of the zero-padded input."""
        p = self.padding
        return self.h + p.top + p.bottom, self.w + p.left + p.right

    @property
    def interior(self) -> tuple[slice, slice]:
        """The rows and columns of the padded input that hold the image itself."""
        p = self.padding
        return slice(p.top, p.top + self.h), slice(p.left, p.left + self.w)

    @property
    def out_hw(self) -> tuple[int, int]:
        (hp, wp), (sh, sw) = self.padded_hw, self.stride
        return (hp - self.kh) // sh + 1, (wp - self.kw) // sw + 1

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
    return replace(shape, n=n)


# ------------------------------------------------------------------------------- chunking


def image_ranges(n: int, per_chunk: int) -> list[tuple[int, int]]:
    """Consecutive (start, stop) ranges of ``per_chunk`` of ``n`` images (the last may be
    smaller), covering 0..n-1 in order."""
    return [(first, min(first + per_chunk, n)) for first in range(0, n, per_chunk)]


def chunk_bounds(n: int, chunks: int) -> list[tuple[int, int]]:
    """Split ``n`` images into ``min(chunks, n)`` consecutive ranges whose sizes differ by at
    most one (the largest is ``ceil(n / chunks)`` images).

    Returns:
        [(start, stop), ...] covering 0..n-1 in order.
    """
    if n < 1 or chunks < 1:
        raise ValueError(f"need at least one image and one chunk, got n={n}, chunks={chunks}")
    parts = min(chunks, n)
    return [(i * n // parts, (i + 1) * n // parts) for i in range(parts)]


def fit_images(n: int, need: Callable[[int], int], budget: int) -> int:
    """The most images, at most ``n`` and at least 1, whose ``need(images)`` fits ``budget``:
    from ``n``, shrunk in proportion to the excess until it fits (or is 1)."""
    images = n
    while images > 1 and need(images) > budget:
        images = max(1, images * budget // need(images))
    return images


def conv_shape(x_shape, w_shape, padding: PaddingSpec, stride=(1, 1)) -> ConvShape:
    """Validate input and kernel shapes and return the convolution geometry."""
    n, c, h, w = (int(v) for v in x_shape)
    k, wc, kh, kw = (int(v) for v in w_shape)
    if wc != c:
        raise ValueError(f"kernels have {wc} input channels, input has {c}")
    if min(n, c, h, w, k, kh, kw) < 1:
        raise ValueError(f"empty convolution: input {tuple(x_shape)}, kernels {tuple(w_shape)}")
    sh, sw = stride
    if min(sh, sw) < 1:
        raise ValueError(f"stride {tuple(stride)} must be >= 1")
    shape = ConvShape(n, c, h, w, k, kh, kw, Padding.resolve(padding, (kh, kw)), (sh, sw))
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
    #: Whether the three convolution calls take a ``stride`` above 1 (oneDNN's strided
    #: convolutions); others compute stride 1 only, and a strided layer runs on them as the
    #: stride-1 convolution of its phases (:class:`hetconv.conv.StridePhases`).
    native_stride: bool = False

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
        return int(
            fit_images(shape.n, lambda n: self.working_set_bytes(_with_images(shape, n)), budget)
        )

    def _batch_chunks(self, shape: ConvShape) -> list[tuple[slice, ConvShape]]:
        """(images, their geometry) of each device call a call on ``shape`` is split into by
        :meth:`_images_per_call`: one for the whole batch when it fits."""
        return [
            (slice(start, stop), _with_images(shape, stop - start))
            for start, stop in image_ranges(shape.n, self._images_per_call(shape))
        ]

    def conv_forward(
        self,
        x: np.ndarray,
        w: np.ndarray,
        b: np.ndarray | None,
        padding: PaddingSpec,
        stride: tuple[int, int] = (1, 1),
    ) -> np.ndarray:
        """Forward convolution.

        Args:
            x: float32 (N, C, H, W) inputs.
            w: float32 (K, C, kh, kw) kernels.
            b: float32 (K,) bias or None.
            padding: see :meth:`Padding.resolve`.
            stride: (sh, sw); above 1 only where :attr:`native_stride`.

        Returns:
            float32 (N, K, Ho, Wo) feature maps.
        """
        _check_array("input", x, 4)
        _check_array("kernels", w, 4)
        shape = self._strided(conv_shape(x.shape, w.shape, padding, stride))
        if b is not None:
            _check_array("bias", b, 1)
            if b.shape[0] != shape.k:
                raise ValueError(f"bias has {b.shape[0]} entries, kernels {shape.k}")
        chunks = self._batch_chunks(shape)
        if len(chunks) == 1:
            return self._forward(x, w, b, shape)
        out = array_module(x).empty((shape.n, shape.k, *shape.out_hw), np.float32)
        for images, chunk in chunks:
            out[images] = self._forward(x[images], w, b, chunk)
        return out

    def conv_grad_input(
        self,
        dy: np.ndarray,
        w: np.ndarray,
        input_hw: tuple[int, int],
        padding: PaddingSpec,
        stride: tuple[int, int] = (1, 1),
    ) -> np.ndarray:
        """Gradient of the loss w.r.t. the convolution's input.

        Args:
            dy: float32 (N, K, Ho, Wo) gradient w.r.t. the output.
            w: float32 (K, C, kh, kw) kernels.
            input_hw: (H, W) of the forward input.
            padding: as in the forward call.
            stride: as in the forward call.

        Returns:
            float32 (N, C, H, W).
        """
        _check_array("output gradient", dy, 4)
        _check_array("kernels", w, 4)
        shape = conv_shape((dy.shape[0], w.shape[1], *input_hw), w.shape, padding, stride)
        self._check_dy(dy, self._strided(shape))
        chunks = self._batch_chunks(shape)
        if len(chunks) == 1:
            return self._grad_input(dy, w, shape)
        out = array_module(dy).empty((shape.n, shape.c, shape.h, shape.w), np.float32)
        for images, chunk in chunks:
            out[images] = self._grad_input(dy[images], w, chunk)
        return out

    def conv_grad_kernels(
        self,
        x: np.ndarray,
        dy: np.ndarray,
        kernel_hw: tuple[int, int],
        padding: PaddingSpec,
        stride: tuple[int, int] = (1, 1),
    ) -> tuple[np.ndarray, np.ndarray]:
        """Gradients of the loss w.r.t. the kernels and the bias.

        Args:
            x: float32 (N, C, H, W) forward input.
            dy: float32 (N, K, Ho, Wo) gradient w.r.t. the output.
            kernel_hw: (kh, kw).
            padding: as in the forward call.
            stride: as in the forward call.

        Returns:
            float32 (K, C, kh, kw) kernel gradient and float32 (K,) bias gradient.
        """
        shape = self._grad_kernels_shape(x, dy, kernel_hw, padding, stride)
        chunks = self._batch_chunks(shape)
        if len(chunks) == 1:
            return self._grad_kernels(x, dy, shape)
        xp = array_module(x)
        dw = xp.zeros((shape.k, shape.c, shape.kh, shape.kw), np.float32)
        db = xp.zeros(shape.k, np.float32)
        for images, chunk in chunks:
            part_w, part_b = self._grad_kernels(x[images], dy[images], chunk)
            dw += part_w
            db += part_b
        return dw, db

    def _grad_kernels_shape(
        self,
        x: np.ndarray,
        dy: np.ndarray,
        kernel_hw: tuple[int, int],
        padding: PaddingSpec,
        stride: tuple[int, int] = (1, 1),
    ) -> ConvShape:
        """The geometry of a kernel-gradient call, its arguments checked."""
        _check_array("input", x, 4)
        _check_array("output gradient", dy, 4)
        shape = conv_shape(x.shape, (dy.shape[1], x.shape[1], *kernel_hw), padding, stride)
        self._check_dy(dy, self._strided(shape))
        return shape

    def _strided(self, shape: ConvShape) -> ConvShape:
        """``shape``; ValueError where it has a stride above 1 and this backend computes
        stride 1 only."""
        if shape.stride != (1, 1) and not self.native_stride:
            raise ValueError(
                f"the {self.name} backend computes stride 1 only, got stride {shape.stride} "
                "(a strided layer runs on it as the stride-1 convolution of its phases)"
            )
        return shape

    @staticmethod
    def _check_dy(dy: np.ndarray, shape: ConvShape) -> None:
        check_shape("output gradient", dy, (shape.n, shape.k, *shape.out_hw))

    # -- where a call's arrays live ------------------------------------------------------------

    @property
    def xp(self):
        """The array module of this backend's device arrays: numpy here (host backends), cupy
        on the cuda backend. Code that runs a whole stage on the device (:mod:`hetconv.stages`)
        uploads its inputs once (:meth:`to_device`), calls the public operations and the layers
        on the device arrays, and downloads its answers once (:meth:`to_host`)."""
        return np

    @property
    def on_device(self) -> bool:
        """Whether :meth:`to_device` moves arrays off the host (False here: a host backend)."""
        return False

    def to_device(self, a: np.ndarray):
        """``a`` on this backend's device (a device array stays as it is). Here, on the host:
        ``a`` itself, no copy. The public operations take device arrays and answer device
        arrays; numpy arrays in, numpy arrays out."""
        return a

    def to_host(self, a) -> np.ndarray:
        """``a`` as a numpy array (a numpy array stays as it is). Here: ``a`` itself."""
        return a

    def scope(self) -> contextlib.AbstractContextManager:
        """Where device work of this backend runs (the cuda backend: its GPU as the current
        device). Here: nothing to enter."""
        return contextlib.nullcontext()

    def kernel_memo(self) -> contextlib.AbstractContextManager:
        """A scope for the calls of one convolution made on parts of its batch (a stage call's
        image groups): calls run inside it (``with memo:``, on any thread, one at a time) may
        keep work that depends on the kernels alone, such as their layout for the device, and
        reuse it for the same kernels. The caller promises that kernels passed inside do not
        change in place while the memo lives. Here: nothing is kept."""
        return contextlib.nullcontext()

    def kernel_gradient_sum(self) -> KernelGradientSum:
        """A sum of one convolution's kernel and bias gradients over parts of its batch,
        added part by part (:class:`KernelGradientSum`)."""
        return KernelGradientSum(self)

    def synchronize(self) -> None:  # noqa: B027 - a no-op for host backends
        """Wait for queued device work (a no-op for host backends); used when timing."""

    def trim_scratch(self, keep_bytes: int) -> int:
        """Free the calling thread's scratch buffers when they hold more than ``keep_bytes``
        (a worker calls this after each call); returns the bytes freed (0: none kept here)."""
        return 0

    def time_step(
        self, shape: ConvShape, repeats: int = 1, with_grad_input: bool = True, seed: int = 0
    ) -> float:
        """Seconds for one forward + backward of ``shape`` on random data (best of ``repeats``).

        This is the probe of the reference method: the real layer geometry, random values.
        The seconds are what :meth:`probe_clock` measures over the public calls
        (``conv_forward``, ``conv_grad_kernels`` and, with ``with_grad_input``,
        ``conv_grad_input``) and a final :meth:`synchronize`: wall time here, device time on
        backends that can time their own work (see their ``probe_clock``). Under a CPU quota
        of under a core (:func:`hetconv.cpushare.process_quota_share`) a wall-clock probe is
        at least its CPU time over the quota's share: a call shorter than the quota's period
        may run at the whole core's speed, a step's layers one after another do not.
        """
        rng = np.random.default_rng(seed)
        x = rng.standard_normal((shape.n, shape.c, shape.h, shape.w), dtype=np.float32)
        w = rng.standard_normal((shape.k, shape.c, shape.kh, shape.kw), dtype=np.float32)
        b = rng.standard_normal(shape.k, dtype=np.float32)
        dy = rng.standard_normal((shape.n, shape.k, *shape.out_hw), dtype=np.float32)
        pad = shape.padding.sides
        best = best_cpu = float("inf")
        for _ in range(max(1, repeats)):
            cpu = time.process_time()
            with self.probe_clock() as clock:
                self.conv_forward(x, w, b, pad)
                self.conv_grad_kernels(x, dy, (shape.kh, shape.kw), pad)
                if with_grad_input:
                    self.conv_grad_input(dy, w, (shape.h, shape.w), pad)
                self.synchronize()
            best = min(best, clock.seconds)
            best_cpu = min(best_cpu, time.process_time() - cpu)
        share = process_quota_share() if isinstance(clock, WallClock) else None
        return max(best, best_cpu / share) if share else best

    def probe_clock(self) -> WallClock | DeviceClock:
        """The clock :meth:`time_step` reads: here the host's wall clock around the calls and
        a final :meth:`synchronize`, so it counts everything a call costs (argument checks,
        host work, copies, device work, waiting). Backends that time their own device work
        return a :class:`DeviceClock` and charge it with :meth:`_charge_device_time`."""
        return WallClock()

    def _charge_device_time(self, seconds: float) -> None:
        """Add ``seconds`` of device time, measured by the device, to every
        :class:`DeviceClock` of this backend open in the calling thread."""
        for clock in clocks_open_here():
            if clock.backend is self:
                clock.seconds += seconds

    def _device_clock_open(self) -> bool:
        """Whether a :class:`DeviceClock` of this backend is open in the calling thread (so
        that a backend may skip the cost of timing its work when nobody reads the time)."""
        return any(clock.backend is self for clock in clocks_open_here())

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


class KernelGradientSum:
    """One convolution's kernel and bias gradients summed over parts of its batch: each
    :meth:`add` is :meth:`Backend.conv_grad_kernels` of one part (image group), and
    :meth:`result` is their sum, equal to the whole batch's gradient to float32 round-off.
    Backends that can accumulate in their own layout do so (the cpu backend's sums in the
    layout of its GEMMs and rearranges once); this one adds the parts' gradients in order.
    Parts are added one at a time, in the order they come."""

    def __init__(self, backend: Backend):
        self.backend = backend
        self.parts = 0
        self._dw: np.ndarray | None = None
        self._db: np.ndarray | None = None

    def add(
        self, x: np.ndarray, dy: np.ndarray, kernel_hw: tuple[int, int], padding: PaddingSpec
    ) -> None:
        dw, db = self.backend.conv_grad_kernels(x, dy, kernel_hw, padding)
        if self._dw is None:
            self._dw, self._db = dw, db
        else:
            self._dw += dw
            self._db += db
        self.parts += 1

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        """(dw, db) summed over every part added.

        Raises:
            ValueError: nothing was added.
        """
        if self._dw is None:
            raise ValueError("no part of the batch was added to the kernel-gradient sum")
        return self._dw, self._db
