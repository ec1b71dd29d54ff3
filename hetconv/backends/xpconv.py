"""Convolutions written once for any NumPy-compatible array module (``xp``: numpy or cupy).

Every function takes the array module as its first argument and only calls what numpy and
cupy both provide with the same meaning (``zeros``, ``empty``, ``matmul``, ``copyto``,
``add``, ``ascontiguousarray``, ``lib.stride_tricks.as_strided``, basic slicing), so the same
code runs on the host with numpy -- and is tested there, on every machine -- and on a GPU
with cupy, where each call is one kernel (or one cuBLAS GEMM) on the current stream. The
CUDA backend adds only what is CUDA-specific around it: devices, streams, pinned memory.

Layout: inputs NCHW, kernels KCHW, float32, stride-1 cross-correlation with explicit
per-side zero padding (``shape.padding``), exactly as :class:`~hetconv.backends.CpuBackend`.

The method is im2col + one GEMM per operation:

* **im2col.** The (zero-padded) input is viewed through ``as_strided`` as the 6-D array
  (C, kh, kw, N, Ho, Wo) whose element (c, i, j, n, y, x) is ``xpad[n, c, y + i, x + j]``,
  and copied once into a contiguous column matrix ``cols`` of shape (C*kh*kw, N*Ho*Wo).
  The row order (c, i, j) is the memory order of a KCHW kernel, so ``w.reshape(K, C*kh*kw)``
  is the other GEMM operand without any copy.
* **forward:** ``(K, C*kh*kw) @ cols -> (K, N*Ho*Wo)``, then one transposing copy to NCHW
  (bias added in the same pass).
* **kernel gradient:** ``dy`` as (K, N*Ho*Wo) ``@ cols.T -> (K, C*kh*kw)``; ``cols.T`` is a
  transposed view, which BLAS/cuBLAS take as an operand flag, not a copy.
* **input gradient:** ``w.T @ dy -> dcols (C*kh*kw, N*Ho*Wo)``, then col2im: the kh*kw taps
  are added back onto a zeroed, padded (C, N, Hp, Wp) image one slice at a time, and the
  padding is cropped away while transposing to NCHW.

Why col2im by tap-wise slice-adds rather than a full correlation of the zero-padded output
gradient with the flipped, channel-swapped kernels: (1) its GEMM and its column matrix are the
forward's (C*kh*kw rows), while the full correlation lowers dy into K*kh*kw rows -- 10x more
memory and work for a 50 -> 500 kernel layer; (2) it needs no special case when the padding
is larger than the kernel (the full correlation then needs negative padding, i.e. a crop);
(3) each tap is one deterministic elementwise kernel on a GPU -- no atomics, so results are
bit-reproducible, which the cluster's exactness test relies on. The price is kh*kw
read-modify-write passes over the padded input gradient, and a fused col2im kernel is the
obvious CUDA-specific refinement if it ever shows in a profile. Measured with numpy on a CPU
(``python benchmarks/input_grad_formulations.py``: the C1 and C2 layers of the 50:500 and
150:800 networks at batch 16, each formulation's time over PyTorch's oneDNN input gradient;
three runs on a shared 2-core AMD EPYC, so the ranges are wide): on the C2 layers, where the
time goes, col2im took 0.7-1.6x and the full correlation 1.6-4.3x PyTorch's time; on the C1
layers (3 input channels) col2im took 0.2-0.8x and the full correlation 1.0-19x.

.. note::
    Results agree with :class:`~hetconv.backends.CpuBackend` to float32 round-off, not
    bit for bit: the GEMMs sum the C*kh*kw (or N*Ho*Wo) terms in a different order.
    Everything stays float32 -- no Python or numpy float scalars enter the arithmetic, and
    reductions pass ``dtype=float32`` explicitly.
"""

from __future__ import annotations

from typing import Any

from .base import ConvShape
from .checks import check_float32, check_shape

# An array module (numpy or cupy) and its arrays. Typed loosely on purpose: cupy is optional.
ArrayModule = Any
Array = Any

__all__ = ["forward", "grad_input", "grad_kernels", "peak_values", "workspace_values"]


# ----------------------------------------------------------------------------- shared steps


def _taps(shape: ConvShape) -> int:
    """Rows of the column matrix: C * kh * kw."""
    return shape.c * shape.kh * shape.kw


def _check(name: str, a: Array, expected: tuple[int, ...]) -> None:
    """float32 and shape ``expected`` (numpy and cupy arrays alike: both have numpy dtypes)."""
    check_float32(name, a)
    check_shape(name, a, expected)


def _pad(xp: ArrayModule, x: Array, shape: ConvShape) -> Array:
    """x (N, C, H, W) zero-padded to (N, C, Hp, Wp); x itself when there is no padding."""
    if not any(shape.padding.sides):
        return x
    padded = xp.zeros((shape.n, shape.c, *shape.padded_hw), dtype=xp.float32)
    rows, cols = shape.interior
    padded[:, :, rows, cols] = x
    return padded


def _im2col(xp: ArrayModule, x: Array, shape: ConvShape) -> Array:
    """The column matrix of input ``x``: float32 (C*kh*kw, N*Ho*Wo), C-contiguous.

    Row (c, i, j) and column (n, y, x) hold ``xpad[n, c, y + i, x + j]``: one strided view
    of the padded input, copied once.
    """
    padded = _pad(xp, x, shape)
    ho, wo = shape.out_hw
    sn, sc, sh, sw = padded.strides  # bytes, for numpy and cupy alike
    windows = xp.lib.stride_tricks.as_strided(
        padded,
        shape=(shape.c, shape.kh, shape.kw, shape.n, ho, wo),
        strides=(sc, sh, sw, sn, sh, sw),
    )
    cols = xp.ascontiguousarray(windows)
    return cols.reshape(_taps(shape), shape.n * ho * wo)


def _output_major(xp: ArrayModule, dy: Array, shape: ConvShape) -> Array:
    """dy (N, K, Ho, Wo) as float32 (K, N*Ho*Wo), C-contiguous (a copy unless N == 1)."""
    ho, wo = shape.out_hw
    by_kernel = dy.reshape(shape.n, shape.k, ho * wo).transpose(1, 0, 2)
    return xp.ascontiguousarray(by_kernel).reshape(shape.k, shape.n * ho * wo)


# --------------------------------------------------------------------------- the operations


def forward(xp: ArrayModule, x: Array, w: Array, b: Array | None, shape: ConvShape) -> Array:
    """Forward convolution on ``xp``'s device.

    Args:
        xp: the array module (numpy or cupy) that ``x``, ``w`` and ``b`` belong to.
        x: float32 (N, C, H, W) inputs.
        w: float32 (K, C, kh, kw) kernels, C-contiguous.
        b: float32 (K,) bias, or None.
        shape: the geometry (from :func:`~hetconv.backends.conv_shape`).

    Returns:
        float32 (N, K, Ho, Wo) feature maps, C-contiguous, on ``xp``'s device.
    """
    ho, wo = shape.out_hw
    _check("input", x, (shape.n, shape.c, shape.h, shape.w))
    _check("kernels", w, (shape.k, shape.c, shape.kh, shape.kw))
    if b is not None:
        _check("bias", b, (shape.k,))
    cols = _im2col(xp, x, shape)
    by_kernel = xp.matmul(w.reshape(shape.k, _taps(shape)), cols)  # (K, N*Ho*Wo)
    del cols
    maps = by_kernel.reshape(shape.k, shape.n, ho, wo).transpose(1, 0, 2, 3)
    if shape.n == 1 and b is None:
        return by_kernel.reshape(1, shape.k, ho, wo)  # already NCHW: no copy
    y = xp.empty((shape.n, shape.k, ho, wo), dtype=xp.float32)
    if b is None:
        xp.copyto(y, maps)
    else:
        xp.add(maps, b.reshape(1, shape.k, 1, 1), out=y)
    return y


def grad_kernels(xp: ArrayModule, x: Array, dy: Array, shape: ConvShape) -> tuple[Array, Array]:
    """Gradients w.r.t. the kernels and the bias, on ``xp``'s device.

    Args:
        xp: the array module (numpy or cupy) that ``x`` and ``dy`` belong to.
        x: float32 (N, C, H, W) forward inputs.
        dy: float32 (N, K, Ho, Wo) gradient w.r.t. the output, C-contiguous.
        shape: the geometry.

    Returns:
        float32 (K, C, kh, kw) kernel gradient and float32 (K,) bias gradient, both summed
        over the N images and C-contiguous.
    """
    ho, wo = shape.out_hw
    _check("input", x, (shape.n, shape.c, shape.h, shape.w))
    _check("output gradient", dy, (shape.n, shape.k, ho, wo))
    cols = _im2col(xp, x, shape)
    dy_by_kernel = _output_major(xp, dy, shape)
    dw = xp.matmul(dy_by_kernel, cols.T)  # (K, C*kh*kw)
    db = dy.sum(axis=(0, 2, 3), dtype=xp.float32)
    return dw.reshape(shape.k, shape.c, shape.kh, shape.kw), db


def grad_input(xp: ArrayModule, dy: Array, w: Array, shape: ConvShape) -> Array:
    """Gradient w.r.t. the convolution's input, on ``xp``'s device.

    Args:
        xp: the array module (numpy or cupy) that ``dy`` and ``w`` belong to.
        dy: float32 (N, K, Ho, Wo) gradient w.r.t. the output, C-contiguous.
        w: float32 (K, C, kh, kw) kernels, C-contiguous.
        shape: the geometry (H, W are the forward input's).

    Returns:
        float32 (N, C, H, W), C-contiguous, on ``xp``'s device.
    """
    ho, wo = shape.out_hw
    _check("output gradient", dy, (shape.n, shape.k, ho, wo))
    _check("kernels", w, (shape.k, shape.c, shape.kh, shape.kw))
    dy_by_kernel = _output_major(xp, dy, shape)
    dcols = xp.matmul(w.reshape(shape.k, _taps(shape)).T, dy_by_kernel)  # (C*kh*kw, N*Ho*Wo)
    del dy_by_kernel
    dcols = dcols.reshape(shape.c, shape.kh, shape.kw, shape.n, ho, wo)
    # col2im: channel-major (C, N, Hp, Wp) so each tap's slice-add walks both operands in
    # the same memory order (coalesced on a GPU); one transposing crop at the end.
    dpadded = xp.zeros((shape.c, shape.n, *shape.padded_hw), dtype=xp.float32)
    for i in range(shape.kh):
        for j in range(shape.kw):
            dpadded[:, :, i : i + ho, j : j + wo] += dcols[:, i, j]
    del dcols
    rows, cols = shape.interior
    inner = dpadded[:, :, rows, cols]
    dx = xp.empty((shape.n, shape.c, shape.h, shape.w), dtype=xp.float32)
    xp.copyto(dx, inner.transpose(1, 0, 2, 3))
    return dx


# ------------------------------------------------------------------------------ memory use


def peak_values(shape: ConvShape) -> dict[str, int]:
    """Most float32 values each operation holds at once, inputs and outputs included.

    An upper bound on the device memory (in values; x4 for bytes) one call of
    :func:`forward`, :func:`grad_input` or :func:`grad_kernels` needs on ``shape``, counting
    the caller's input arrays and the returned outputs as well as the temporaries (padded
    input, column matrix, transposed copies), at the moment the most of them are alive.
    Allocator rounding and library workspaces (cuBLAS) come on top.
    """
    ho, wo = shape.out_hw
    hp, wp = shape.padded_hw
    inputs = shape.n * shape.c * shape.h * shape.w  # x or dx
    outputs = shape.n * shape.k * ho * wo  # y or dy (and each transposed copy of them)
    kernels = shape.k * _taps(shape)
    cols = _taps(shape) * shape.n * ho * wo
    padded = shape.n * shape.c * hp * wp if any(shape.padding.sides) else 0
    dy_copy = 0 if shape.n == 1 else outputs
    forward_peak = (
        inputs
        + kernels
        + shape.k
        + max(padded + cols, cols + outputs, 2 * outputs)  # im2col, GEMM, transposing copy
    )
    grad_kernels_peak = (
        inputs
        + outputs
        + max(padded + cols, cols + dy_copy + kernels + shape.k)  # im2col, GEMM and dy sum
    )
    dpadded = shape.n * shape.c * hp * wp
    grad_input_peak = (
        outputs
        + kernels
        + max(dy_copy + cols, cols + dpadded, dpadded + inputs)  # GEMM, col2im, crop
    )
    return {
        "forward": forward_peak,
        "grad_input": grad_input_peak,
        "grad_kernels": grad_kernels_peak,
    }


def workspace_values(shape: ConvShape) -> int:
    """The largest of :func:`peak_values` over the three operations."""
    return max(peak_values(shape).values())
