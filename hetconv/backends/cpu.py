"""The cpu backend: convolutions as BLAS GEMMs over a row-lowered, channels-last input.

Plain im2col copies every input value kh*kw times and then runs one GEMM. Here the input is
lowered only along the width (each position keeps its kw neighbouring columns: kw times the
input instead of kh*kw times), and the kh kernel rows become kh GEMMs that accumulate into the
same output with BLAS's ``beta = 1``. The lowered input is laid out as (padded row, image,
column, kernel column, channel), so the operand of kernel row i -- output rows 0..Ho-1 of every
image of a chunk, read from padded rows i..i+Ho-1 -- is one contiguous block: no GEMM operand
is ever copied and no output position is computed twice or thrown away.

Layers with few input channels (the first layer of a CNN: 3 channels) lower fully instead
(classic im2col, kh*kw copies), because a GEMM with 15 terms per dot product is inefficient.

All three operations use the same lowered layout, so they share one plan per geometry.
Scratch memory is bounded: a batch is processed in chunks of images whose buffers fit
``scratch_bytes`` (at least one image per chunk), and for speed about :data:`CHUNK_BYTES`
(cache-sized, but at least :data:`CHUNK_POSITIONS` output positions).
"""

from __future__ import annotations

import ctypes
import os
import platform
import threading
import time
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numpy.lib.stride_tricks import as_strided
from scipy.linalg import blas

from .base import (
    Backend,
    ConvShape,
    DeviceInfo,
    KernelGradientSum,
    Padding,
    PaddingSpec,
    fit_images,
    image_ranges,
)

DEFAULT_SCRATCH_BYTES = 256 * 2**20
#: Chunks of a batch are sized to this much scratch too (at least one image): a chunk's lowered
#: input is then still in the caches when its GEMMs read it. One thread, resnet20's 16-channel
#: 32x32 layers at batch 64: forward, input and kernel gradient 35.8 ms in one chunk, 20.8 in
#: chunks of 4 MiB (8 MiB: 21.5, 2 MiB: 21.6); smaller layers and batches: no change.
CHUNK_BYTES = 4 * 2**20
#: ... but of at least this many output positions (as ``scratch_bytes`` allows): each chunk's
#: GEMMs read the kernels and write or accumulate the kernel gradient, whole, once per kernel
#: row; in chunks of one image (256 positions) paper-500-1500's step took 5-8 % longer.
CHUNK_POSITIONS = 4096
# Below this many values per GEMM term group (kw * C) the full im2col lowering is used (a
# first layer's 3 channels, ResNet's 16). Above, rows are lowered (kw * C terms, kh GEMMs). At
# 16 channels, 3x3, one thread, batch 16, rows would take 1.35 ms for the forward against 1.81
# fully lowered (input gradient 1.31 / 1.57, kernel gradient 1.71 / 1.88), but a worker's
# slice of such a layer then sums a kernel's terms otherwise than the whole layer does: in a
# network with batch norm, max pooling and a strong LRN (tests/test_resident_batchnorm.py)
# conv2's weights came 2e-5 apart from local training after one step, where full lowering
# keeps them within 1e-8 (ties and ReLU zeros flip on the smallest difference). Kept at 64
# until a lowering keeps slices and whole layers equal.
_FULL_LOWERING_BELOW = 64
#: Up to this many kernels, the forward writes (positions, K) (:attr:`_Plan.positions_first`),
#: and up to this many input channels the input gradient is such a forward
#: (:func:`_correlation_shape`).
FEW_KERNELS = 64


def _blas_sgemm_without_gil():
    """scipy's BLAS ``sgemm`` called through ctypes, or None where that cannot be had.

    ``scipy.linalg.blas.sgemm`` (f2py) holds the GIL for the whole GEMM: while the master
    computes its share, the threads that stream other workers' tensors wait up to one GEMM
    (measured: 160 ms gaps in a second thread during a 2000x2000 sgemm; none with this).
    A ctypes call releases the GIL. The function is the same one: scipy exports its BLAS to
    Cython as ``scipy.linalg.cython_blas.__pyx_capi__`` capsules (numba takes BLAS from there
    too), with the Fortran signature and 32-bit integers.
    """
    try:
        from scipy.linalg import cython_blas

        capsule = cython_blas.__pyx_capi__["sgemm"]
        get_name = ctypes.pythonapi.PyCapsule_GetName
        get_name.restype, get_name.argtypes = ctypes.c_char_p, [ctypes.py_object]
        get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
        get_pointer.restype = ctypes.c_void_p
        get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
        address = get_pointer(capsule, get_name(capsule))
    except Exception:  # noqa: BLE001 - any failure: the f2py wrapper still works
        return None
    if not address:
        return None
    int_p, float_p = ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_float)
    prototype = ctypes.CFUNCTYPE(
        None, ctypes.c_char_p, ctypes.c_char_p, int_p, int_p, int_p, float_p,
        ctypes.c_void_p, int_p, ctypes.c_void_p, int_p, float_p, ctypes.c_void_p, int_p,
    )  # fmt: skip
    return prototype(address)


_SGEMM = _blas_sgemm_without_gil()
_INT_MAX = 2**31 - 1


def _row_stride(m: np.ndarray) -> int | None:
    """Elements between rows of a float32 matrix whose rows are contiguous, else None."""
    if m.ndim != 2 or m.dtype != np.float32 or m.strides[1] != 4 or m.strides[0] % 4:
        return None
    stride = m.strides[0] // 4
    return stride if m.shape[1] <= stride <= _INT_MAX else None


def _gemm(
    a: np.ndarray,
    b: np.ndarray,
    out: np.ndarray,
    trans_a: bool = False,
    trans_b: bool = False,
    beta: float = 0.0,
) -> None:
    """``out = op(a) @ op(b) + beta * out`` in place, for float32 2-D arrays with contiguous
    rows (C-contiguous, or row slices of one).

    BLAS is column-major: a C-ordered matrix is the Fortran-ordered transpose, so
    ``out.T = op(b).T @ op(a).T`` is what is handed to sgemm; no operand is copied. The GIL is
    released while it runs (see :func:`_blas_sgemm_without_gil`).
    """
    m, n = out.shape
    k = a.shape[0] if trans_a else a.shape[1]
    lda, ldb, ldc = _row_stride(a), _row_stride(b), _row_stride(out)
    usable = _SGEMM is not None and None not in (lda, ldb, ldc)
    if usable and min(m, n, k) > 0 and max(m, n, k) <= _INT_MAX:
        c_int, c_float = ctypes.c_int, ctypes.c_float
        _SGEMM(
            b"T" if trans_b else b"N", b"T" if trans_a else b"N",
            ctypes.byref(c_int(n)), ctypes.byref(c_int(m)), ctypes.byref(c_int(k)),
            ctypes.byref(c_float(1.0)), b.ctypes.data, ctypes.byref(c_int(ldb)),
            a.ctypes.data, ctypes.byref(c_int(lda)), ctypes.byref(c_float(beta)),
            out.ctypes.data, ctypes.byref(c_int(ldc)),
        )  # fmt: skip
        return
    result = blas.sgemm(
        1.0, b.T, a.T, beta=beta, c=out.T, trans_a=trans_b, trans_b=trans_a, overwrite_c=1
    )
    if result.ctypes.data != out.ctypes.data:  # pragma: no cover - only if scipy copied
        np.copyto(out, result.T)


@dataclass(frozen=True)
class _Plan:
    """The lowered layout of one chunk of ``images`` images of a convolution geometry."""

    shape: ConvShape
    images: int
    rows_per_group: int  # L: kernel rows folded into one GEMM (1, or kh for full im2col)

    @property
    def groups(self) -> int:
        return self.shape.kh // self.rows_per_group

    @property
    def in_rows(self) -> int:  # padded image height
        return self.shape.padded_hw[0]

    @property
    def lowered_rows(self) -> int:
        return self.in_rows - self.rows_per_group + 1

    @property
    def padded_width(self) -> int:
        return self.shape.padded_hw[1]

    @property
    def terms(self) -> int:  # inner GEMM dimension: L * kw * C
        return self.rows_per_group * self.shape.kw * self.shape.c

    @property
    def positions_first(self) -> bool:
        """Whether the forward's GEMM writes (positions, K) rather than (K, positions).

        BLAS runs rows @ kernels.T faster than kernels @ rows.T where the kernels are few
        (one thread, 16 kernels of 144 terms: 97 against 59 GFLOPS on OpenBLAS's Haswell
        kernel, 148 against 94 on SkylakeX; 32 of 288: 114 against 82), enough to pay for
        the output's transpose back to (N, K, H, W) with its K values far apart; with more
        kernels, or with a first layer's few terms, the transpose costs more than it saves
        (VGG's 512 kernels at 4x4: 7 % slower; 64 kernels of 27 terms: 25 %).
        """
        return self.shape.k <= FEW_KERNELS and self.terms >= 32

    @property
    def positions(self) -> int:  # GEMM rows: output positions of the chunk
        ho, wo = self.shape.out_hw
        return ho * self.images * wo

    def scratch_bytes(self) -> int:
        s = self.shape
        padded = self.in_rows * self.images * self.padded_width * s.c
        lowered = self.lowered_rows * self.images * s.out_hw[1] * self.terms
        output = s.k * self.positions
        return 4 * (2 * padded + lowered + output)


@lru_cache(maxsize=256)
def _plan(shape: ConvShape, scratch_bytes: int) -> _Plan:
    rows_per_group = shape.kh if shape.kw * shape.c < _FULL_LOWERING_BELOW else 1
    need = lambda n: _Plan(shape, n, rows_per_group).scratch_bytes()  # noqa: E731
    images = fit_images(shape.n, need, min(scratch_bytes, CHUNK_BYTES))
    ho, wo = shape.out_hw
    enough = -(-CHUNK_POSITIONS // (ho * wo))
    if images < enough:  # large layers: GEMMs deep enough, as far as scratch_bytes allows
        images = fit_images(min(shape.n, enough), need, scratch_bytes)
    return _Plan(shape, images, rows_per_group)


class _Scratch(threading.local):
    """Per-thread reusable buffers: re-faulting fresh pages costs as much as a lowering copy."""

    def __init__(self) -> None:
        self.buffers: dict[str, np.ndarray] = {}
        self.memos: list[_KernelMemo] = []  # entered on this thread, innermost last

    def get(self, name: str, shape: tuple[int, ...], zero: bool = False) -> np.ndarray:
        size = int(np.prod(shape))
        buf = self.buffers.get(name)
        if buf is None or buf.size < size:
            buf = np.empty(size, np.float32)
            self.buffers[name] = buf
        view = buf[:size].reshape(shape)
        if zero:
            view.fill(0.0)
        return view


class _KernelMemo:
    """Kernel layouts kept for the calls run inside it (:meth:`Backend.kernel_memo`): the
    image groups of one stage call rearrange their kernels once, not once per group and
    operation (measured in ``benchmarks/overlap_groups.py``). Keyed by the kernels' address,
    shape and strides; each entry keeps its kernels alive, so no other array takes that
    address while the memo lives."""

    def __init__(self, scratch: _Scratch):
        self._scratch = scratch
        self.layouts: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}

    def __enter__(self) -> _KernelMemo:
        self._scratch.memos.append(self)
        return self

    def __exit__(self, *exc) -> None:
        self._scratch.memos.remove(self)


class _CpuKernelGradientSum(KernelGradientSum):
    """Image groups' kernel gradients accumulated by the GEMMs themselves (``beta = 1``) in
    their own layout, rearranged into (K, C, kh, kw) once in :meth:`result`."""

    def __init__(self, backend: CpuBackend):
        super().__init__(backend)
        self._shape: ConvShape | None = None
        self._grouped: np.ndarray | None = None

    def add(self, x, dy, kernel_hw, padding: PaddingSpec) -> None:
        backend = self.backend
        shape = backend._grad_kernels_shape(x, dy, kernel_hw, padding)
        if self._shape is not None and (shape.k, shape.c, shape.kh, shape.kw) != (
            self._shape.k, self._shape.c, self._shape.kh, self._shape.kw
        ):  # fmt: skip
            raise ValueError(
                f"a part of {shape.k} kernels of {shape.c}x{shape.kh}x{shape.kw} added to a "
                f"sum of {self._shape.k} of {self._shape.c}x{self._shape.kh}x{self._shape.kw}"
            )
        for images, chunk in backend._batch_chunks(shape):
            first = self._grouped is None
            if first:
                self._grouped = backend._kernel_grad_buffer(chunk)
                self._db = np.zeros(shape.k, np.float32)
            backend._add_kernel_grads(x[images], dy[images], chunk, self._grouped, not first)
            self._db += dy[images].sum(axis=(0, 2, 3), dtype=np.float32)
            self._shape = chunk
        self.parts += 1

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        if self._grouped is None:
            raise ValueError("no part of the batch was added to the kernel-gradient sum")
        return self.backend._laid_out_kernel_grads(self._grouped, self._shape), self._db


class CpuBackend(Backend):
    """Convolutions on the host CPU with BLAS (see the module docstring for the method).

    Args:
        scratch_bytes: bound on the lowered-input and output scratch buffers one call keeps
            per thread (kept between calls; a single image that needs more still runs). One
            reordered copy of the kernels comes on top of it.
    """

    name = "cpu"

    def __init__(self, scratch_bytes: int = DEFAULT_SCRATCH_BYTES):
        if scratch_bytes < 1:
            raise ValueError(f"scratch_bytes must be positive, got {scratch_bytes}")
        self.scratch_bytes = int(scratch_bytes)
        self._scratch = _Scratch()

    def trim_scratch(self, keep_bytes: int) -> int:
        buffers = self._scratch.buffers
        held = sum(b.nbytes for b in buffers.values())
        if held <= keep_bytes:
            return 0
        buffers.clear()
        return held

    def describe(self) -> DeviceInfo:
        return DeviceInfo(
            backend=self.name,
            kind="cpu",
            name=_cpu_model(),
            memory_bytes=_physical_memory(),
            cores=os.cpu_count() or 1,
        )

    def gemm_gflops(self, size: int = 2048, repeats: int = 3) -> float:
        rng = np.random.default_rng(0)
        a = rng.standard_normal((size, size), dtype=np.float32)
        b = rng.standard_normal((size, size), dtype=np.float32)
        out = np.empty((size, size), np.float32)
        best = float("inf")
        for _ in range(max(1, repeats)):
            start = time.perf_counter()
            np.matmul(a, b, out=out)
            best = min(best, time.perf_counter() - start)
        return 2 * size**3 / best / 1e9

    # -- shared steps ------------------------------------------------------------------------

    def _lower(self, plan: _Plan, x: np.ndarray, first: int) -> np.ndarray:
        """Lower images ``first .. first + plan.images - 1``: (lowered rows, images*Wo*terms)."""
        s = plan.shape
        image_rows, image_cols = s.interior
        padded = self._scratch.get("padded", (plan.in_rows, plan.images, plan.padded_width, s.c))
        # only the border is zeroed: the image overwrites the rest
        padded[: image_rows.start] = 0.0
        padded[image_rows.stop :] = 0.0
        padded[image_rows, :, : image_cols.start] = 0.0
        padded[image_rows, :, image_cols.stop :] = 0.0
        padded[image_rows, :, image_cols] = x[first : first + plan.images].transpose(2, 0, 3, 1)
        lowered = self._scratch.get(
            "lowered",
            (plan.lowered_rows, plan.images, s.out_hw[1], plan.rows_per_group, s.kw, s.c),
        )
        # Each (row, image, column, kernel row)'s kw * C values are one contiguous run of
        # the padded row: copied as such, not C values at a time.
        rows, images, cols, _ = padded.strides
        windows = as_strided(
            padded,
            (plan.lowered_rows, plan.images, s.out_hw[1], plan.rows_per_group, s.kw * s.c),
            (rows, images, cols, rows, padded.itemsize),
            writeable=False,
        )
        np.copyto(lowered.reshape(windows.shape), windows)
        return lowered.reshape(plan.lowered_rows, -1)

    def _group_rows(self, plan: _Plan, lowered: np.ndarray, group: int) -> np.ndarray:
        """The (positions, terms) GEMM operand of kernel-row group ``group``."""
        start = group * plan.rows_per_group
        return lowered[start : start + plan.shape.out_hw[0]].reshape(plan.positions, plan.terms)

    def kernel_memo(self) -> _KernelMemo:
        return _KernelMemo(self._scratch)

    def kernel_gradient_sum(self) -> _CpuKernelGradientSum:
        return _CpuKernelGradientSum(self)

    def _grouped_kernels(self, plan: _Plan, w: np.ndarray, flipped: bool = False) -> np.ndarray:
        """Kernels as (groups, K, L*kw*C) matching the lowered column order (the innermost
        memo's, when one is open on this thread and has them). ``flipped``: those of
        :func:`_flipped` of ``w`` (what :meth:`_grad_input` correlates with)."""
        s = plan.shape
        taps = plan.rows_per_group * s.kw
        memo = self._scratch.memos[-1] if self._scratch.memos else None
        source, w = w, (_flipped(w) if flipped else w)
        if memo is not None:
            key = (source.ctypes.data, source.shape, source.strides, plan.rows_per_group, flipped)
            kept = memo.layouts.get(key)
            if kept is not None:
                return kept[1]
            grouped = np.empty((plan.groups, s.k, taps, s.c), np.float32)
        else:
            grouped = self._scratch.get("kernels", (plan.groups, s.k, taps, s.c))
        flat = w.reshape(s.k, s.c, s.kh * s.kw)
        for g in range(plan.groups):
            np.copyto(grouped[g], flat[:, :, g * taps : (g + 1) * taps].transpose(0, 2, 1))
        layout = grouped.reshape(plan.groups, s.k, plan.terms)
        if memo is not None:
            memo.layouts[key] = (source, layout)
        return layout

    def _stack_output_grad(self, plan: _Plan, dy: np.ndarray, first: int) -> np.ndarray:
        """dy of a chunk as (K, positions), positions ordered (row, image, column)."""
        s = plan.shape
        ho, wo = s.out_hw
        # the forward's output buffer: a call never needs both, so one is kept, not two
        stacked = self._scratch.get("out", (s.k, ho, plan.images, wo))
        np.copyto(stacked, dy[first : first + plan.images].transpose(1, 2, 0, 3))
        return stacked.reshape(s.k, plan.positions)

    def _chunks(self, plan: _Plan):
        for first, stop in image_ranges(plan.shape.n, plan.images):
            count = stop - first
            yield (
                (plan if count == plan.images else _Plan(plan.shape, count, plan.rows_per_group)),
                first,
            )

    # -- the three operations ----------------------------------------------------------------

    def _forward(self, x, w, b, shape, flipped: bool = False):
        ho, wo = shape.out_hw
        plan = _plan(shape, self.scratch_bytes)
        kernels = self._grouped_kernels(plan, w, flipped)
        y = np.empty((shape.n, shape.k, ho, wo), np.float32)
        for chunk, first in self._chunks(plan):
            lowered = self._lower(chunk, x, first)
            first_axis = chunk.positions_first  # (positions, K), or (K, positions)
            out = self._scratch.get(
                "out", (chunk.positions, shape.k) if first_axis else (shape.k, chunk.positions)
            )
            for g in range(chunk.groups):
                rows, beta = self._group_rows(chunk, lowered, g), 0.0 if g == 0 else 1.0
                if first_axis:
                    _gemm(rows, kernels[g], out, trans_b=True, beta=beta)
                else:
                    _gemm(kernels[g], rows, out, trans_b=True, beta=beta)
            if b is not None:  # in place, contiguous: then one copy, not a strided add
                out += b if first_axis else b[:, None]
            if first_axis:
                images = out.reshape(ho, chunk.images, wo, shape.k).transpose(1, 3, 0, 2)
            else:
                images = out.reshape(shape.k, ho, chunk.images, wo).transpose(2, 0, 1, 3)
            np.copyto(y[first : first + chunk.images], images)
        return y

    def _grad_kernels(self, x, dy, shape):
        grouped = self._kernel_grad_buffer(shape)
        self._add_kernel_grads(x, dy, shape, grouped, accumulate=False)
        db = dy.sum(axis=(0, 2, 3), dtype=np.float32)
        return self._laid_out_kernel_grads(grouped, shape), db

    def _kernel_grad_buffer(self, shape: ConvShape) -> np.ndarray:
        """An uninitialised buffer for :meth:`_add_kernel_grads` (its layout depends on the
        kernels' geometry, not on the images)."""
        plan = _plan(shape, self.scratch_bytes)
        return np.empty((plan.groups, plan.terms, shape.k), np.float32)

    def _add_kernel_grads(self, x, dy, shape, grouped: np.ndarray, accumulate: bool) -> None:
        """The kernel gradient of ``x`` and ``dy`` in the GEMMs' layout, written into
        ``grouped`` (or, with ``accumulate``, added to it)."""
        plan = _plan(shape, self.scratch_bytes)
        # Each group's gradient is (terms, K) = rows.T @ stacked.T: the same products as
        # stacked @ rows, but BLAS runs this orientation faster when the positions (the inner
        # dimension) far outnumber the kernels, as on a worker's slice (one thread, batch 64:
        # 77-81 -> 102-105 GFLOPS for 160 kernels of paper-150-800's conv2, 105-106 -> 119-126
        # for 300 of paper-500-1500's, 2-5 % for whole layers;
        # `python benchmarks/backends.py --backends cpu --batch 64 --share 5`), and as fast
        # for a fully lowered layer.
        for index, (chunk, first) in enumerate(self._chunks(plan)):
            lowered = self._lower(chunk, x, first)
            stacked = self._stack_output_grad(chunk, dy, first)
            beta = 1.0 if accumulate or index else 0.0
            for g in range(chunk.groups):
                _gemm(self._group_rows(chunk, lowered, g), stacked, grouped[g], True, True, beta)

    def _laid_out_kernel_grads(self, grouped: np.ndarray, shape: ConvShape) -> np.ndarray:
        """(K, C, kh, kw) kernel gradient from :meth:`_add_kernel_grads`' layout."""
        plan = _plan(shape, self.scratch_bytes)
        taps = plan.rows_per_group * shape.kw
        dw = np.empty((shape.k, shape.c, shape.kh * shape.kw), np.float32)
        grouped = grouped.reshape(plan.groups, taps, shape.c, shape.k)
        for g in range(plan.groups):
            np.copyto(dw[:, :, g * taps : (g + 1) * taps], grouped[g].transpose(2, 1, 0))
        return dw.reshape(shape.k, shape.c, shape.kh, shape.kw)

    def _grad_input(self, dy, w, shape):
        correlation = _correlation_shape(shape)
        if correlation is not None:
            return self._forward(dy, w, None, correlation, flipped=True)
        return self._grad_input_col2im(dy, w, shape)

    def _grad_input_col2im(self, dy, w, shape):
        """The input gradient as GEMMs into the lowered layout, folded back by col2im."""
        plan = _plan(shape, self.scratch_bytes)
        image_rows, image_cols = shape.interior
        wo = shape.out_hw[1]
        kernels = self._grouped_kernels(plan, w)
        dx = np.empty((shape.n, shape.c, shape.h, shape.w), np.float32)
        for chunk, first in self._chunks(plan):
            stacked = self._stack_output_grad(chunk, dy, first)
            lowered = self._scratch.get(
                "lowered",
                (chunk.lowered_rows, chunk.images, wo, chunk.rows_per_group, shape.kw, shape.c),
                zero=True,
            )
            flat = lowered.reshape(chunk.lowered_rows, -1)
            for g in range(chunk.groups):
                _gemm(stacked, kernels[g], self._group_rows(chunk, flat, g), True, False, 1.0)
            # Fold the lowered gradient back onto the padded images (col2im, L*kw adds).
            padded = self._scratch.get(
                "padded", (chunk.in_rows, chunk.images, chunk.padded_width, shape.c), zero=True
            )
            for row in range(chunk.rows_per_group):
                for col in range(shape.kw):
                    padded[row : row + chunk.lowered_rows, :, col : col + wo] += lowered[
                        :, :, :, row, col
                    ]
            inner = padded[image_rows, :, image_cols]
            np.copyto(dx[first : first + chunk.images], inner.transpose(1, 3, 0, 2))
        return dx


#: A fully lowered input gradient (col2im of kh*kw taps) runs as a full correlation where its
#: output gradient has at most this many channels per input channel (:func:`_correlation_shape`).
CORRELATION_MAX_RATIO = 4


def _flipped(w: np.ndarray) -> np.ndarray:
    """(C, K, kh, kw) kernels rotated by 180 degrees, input and output channels swapped."""
    return np.ascontiguousarray(w[:, :, ::-1, ::-1].transpose(1, 0, 2, 3))


def _correlation_shape(shape: ConvShape) -> ConvShape | None:
    """The forward geometry that computes ``shape``'s input gradient as a full correlation of
    the output gradient with :func:`_flipped` kernels, padded by ``kernel - 1 - padding`` on
    each side; or None where col2im is kept.

    col2im adds the lowered gradient's taps back onto the padded input, reading and writing
    it each time; the correlation lowers the output gradient once, as the forward does, and
    for a layer of at most :data:`FEW_KERNELS` input channels (ResNet's stages) its GEMM
    writes (positions, channels), the faster orientation there. One thread, 3x3, batch 64:
    32 channels at 16x16 3.8-4.0 ms against 4.6-5.0, 64 at 8x8 3.2 against 3.5-3.7 (a fully
    lowered 16-channel layer's col2im: 51 ms against 21). With more channels col2im is as
    fast or faster (VGG's 128 to 256 channels: 3-10 %) and is kept, as it is for paddings
    wider than the kernel reaches and output gradients with more than
    :data:`CORRELATION_MAX_RATIO` times the input's channels.
    """
    p = shape.padding
    sides = (shape.kh - 1 - p.top, shape.kh - 1 - p.bottom)
    sides += (shape.kw - 1 - p.left, shape.kw - 1 - p.right)
    few_channels = shape.c <= FEW_KERNELS
    if not few_channels or min(sides) < 0 or shape.k > CORRELATION_MAX_RATIO * shape.c:
        return None
    ho, wo = shape.out_hw
    return ConvShape(shape.n, shape.k, ho, wo, shape.c, shape.kh, shape.kw, Padding(*sides))


def _cpu_model() -> str:
    cpuinfo = "/proc/cpuinfo"
    if os.path.exists(cpuinfo):
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "cpu"


def _physical_memory() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):  # Windows has no sysconf
        return 0
