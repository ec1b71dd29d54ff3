"""oneDNN's ReLU backward and max pooling for the model's layers on host arrays, where its
library loads.

numpy computes a ReLU's backward in two passes over the tensor (a mask, then the masked
gradient; the mask was a third pass in the forward) where oneDNN's eltwise primitive reads the
output and the gradient in one (``relu_use_dst_for_bwd``), and a max pool in a pass per window
tap each way, four more per tap backward, where oneDNN's pooling keeps each window's maximum's
index in its forward and routes the gradient by it in its backward. Both are exact (a routed
gradient; oneDNN keeps the first maximum in window order, as PyTorch and the numpy path do),
so either way gives the same bits, on the master and on every worker. The ReLU's forward stays
numpy's maximum, one pass already, which keeps a NaN (oneDNN's ReLU makes it 0). On this
project's AMD EPYC, ``python benchmarks/conv_vs_torch.py --network resnet20 vgg11 --batch 64
--kinds relu maxpool`` with and without ``--numpy-layers`` gives the ratios to torch before and
after (benchmarks/README.md).

:class:`~hetconv.layers.ReLU` and :class:`~hetconv.pooling.Pool2d` call :func:`relu_backward`
and :func:`max_pool` with float32 C-contiguous numpy arrays (:func:`serves_relu`,
:func:`max_pool` returning None: not served, where there is no library, :func:`set_enabled` is
off or the array is of another kind; the layer then takes its numpy path). Each call runs on
one OpenMP thread, as the onednn backend's parts do.
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np

from .onednn_library import (
    _ARG_DIFF_DST,
    _ARG_DIFF_SRC,
    _ARG_DST,
    _ARG_SCRATCHPAD,
    _ARG_SRC,
    _FORWARD_TRAINING,
    _TAG_NCHW,
    _ExecArg,
    _Library,
    _Primitive,
    library,
)

# oneDNN 3.2's C enums (include/oneapi/dnnl/dnnl_types.h at tag v3.2)
_RELU_USE_DST, _POOLING_MAX = 0x100, 0x1FF
_TAG_A = 2  # one dimension, in a row
_ARG_WORKSPACE, _QUERY_WORKSPACE = 64, 135

_p = ctypes.c_void_p
_Dims = ctypes.c_int64 * 12

_enabled = True
_declared = False
_lock = threading.Lock()
_ops: dict[tuple, _Op] = {}


def set_enabled(flag: bool) -> bool:
    """Use oneDNN for the layers (True, the default) or always numpy; returns the setting
    before (tests and benchmarks compare both paths)."""
    global _enabled
    before, _enabled = _enabled, bool(flag)
    return before


def _library() -> _Library | None:
    if not _enabled:
        return None
    try:
        lib = library()
    except OSError:
        return None
    global _declared
    if not _declared:
        with _lock:
            _declare(lib)
            _declared = True
    return lib


def _declare(lib: _Library) -> None:
    d, i, f = lib.dll, ctypes.c_int, ctypes.c_float
    pd = ctypes.POINTER(_p)
    d.dnnl_eltwise_forward_primitive_desc_create.argtypes = [pd, _p, i, i, _p, _p, f, f, _p]
    d.dnnl_eltwise_backward_primitive_desc_create.argtypes = [pd, _p, i, _p, _p, _p, f, f, _p, _p]
    d.dnnl_pooling_forward_primitive_desc_create.argtypes = [
        pd, _p, i, i, _p, _p, _Dims, _Dims, _Dims, _Dims, _Dims, _p,
    ]  # fmt: skip
    d.dnnl_pooling_backward_primitive_desc_create.argtypes = [
        pd, _p, i, _p, _p, _Dims, _Dims, _Dims, _Dims, _Dims, _p, _p,
    ]  # fmt: skip
    for name in (
        "dnnl_eltwise_forward_primitive_desc_create",
        "dnnl_eltwise_backward_primitive_desc_create",
        "dnnl_pooling_forward_primitive_desc_create",
        "dnnl_pooling_backward_primitive_desc_create",
    ):
        getattr(d, name).restype = ctypes.c_int


class _Op:
    """One operation's primitive (shared) and, per thread, its memory objects and argument
    table (a memory is used by one thread at a time); :meth:`run` points them at the arrays."""

    def __init__(self, lib: _Library, pd: ctypes.c_void_p, what: str, args: list[tuple[int, _p]]):
        self.lib, self.what = lib, what
        self.primitive = _Primitive(lib, pd, what)
        self.args = args  # (argument, descriptor) in the order run() takes the arrays
        if self.primitive.scratchpad_bytes:  # a pool's backward on plain layouts: one per thread
            self.args = [*args, (_ARG_SCRATCHPAD, self.primitive.scratchpad)]
        self._threads = threading.local()

    def run(self, *arrays: np.ndarray) -> None:
        bound = getattr(self._threads, "bound", None)
        d = self.lib.dll
        if bound is None:
            memories = []
            for _, md in self.args:
                memory = _p()
                made = d.dnnl_memory_create(ctypes.byref(memory), md, self.lib.engine, None)
                self.lib.check(made, "memory_create")
                memories.append(memory)
            table = (_ExecArg * len(memories))(
                *(_ExecArg(arg, m) for (arg, _), m in zip(self.args, memories, strict=True))
            )
            pad = np.empty(self.primitive.scratchpad_bytes, np.uint8)
            bound = self._threads.bound = (memories, table, pad)
        memories, table, pad = bound
        if len(memories) > len(arrays):
            arrays = (*arrays, pad)
        failed = 0
        for memory, array in zip(memories, arrays, strict=True):
            failed |= d.dnnl_memory_set_data_handle(memory, array.ctypes.data)
        self.lib.check(failed, "memory_set_data_handle")
        self.lib.set_threads(1)
        status = d.dnnl_primitive_execute(self.primitive.primitive, self.lib.stream(),
                                          len(memories), table)  # fmt: skip
        if status:
            self.lib.check(status, f"execute ({self.what}, {self.primitive.implementation})")


def _op(key: tuple, make) -> _Op:
    op = _ops.get(key)
    if op is None:
        with _lock:
            op = _ops.get(key)
            if op is None:
                op = _ops[key] = make()
    return op


def _served(a: np.ndarray, ndim: int | None = None) -> bool:
    return (
        type(a) is np.ndarray
        and a.dtype == np.float32
        and a.flags.c_contiguous
        and a.size > 0
        and (ndim is None or a.ndim == ndim)
    )


def _relu_backward_op(lib: _Library, size: int) -> _Op:
    """A ReLU's backward over ``size`` values in a row (any shape's, element-wise). Its
    descriptor needs the forward's as a hint, kept with it; the forward itself is numpy's."""

    def make() -> _Op:
        d, md = lib.dll, lib.md((size,), _TAG_A)
        forward, backward = _p(), _p()
        lib.check(d.dnnl_eltwise_forward_primitive_desc_create(
            ctypes.byref(forward), lib.engine, _FORWARD_TRAINING, _RELU_USE_DST, md, md, 0.0,
            0.0, lib.attr), "eltwise_forward_primitive_desc_create")  # fmt: skip
        lib.check(d.dnnl_eltwise_backward_primitive_desc_create(
            ctypes.byref(backward), lib.engine, _RELU_USE_DST, md, md, md, 0.0, 0.0, forward,
            lib.attr), "eltwise_backward_primitive_desc_create")  # fmt: skip
        op = _Op(lib, backward, "relu backward",
                 [(_ARG_DST, md), (_ARG_DIFF_DST, md), (_ARG_DIFF_SRC, md)])  # fmt: skip
        op.hint = forward  # never destroyed while the backward's descriptor may read it
        return op

    return _op(("relu", size), make)


def serves_relu(y: np.ndarray) -> bool:
    """Whether :func:`relu_backward` computes on oneDNN from the ReLU's output ``y``."""
    return _served(y) and _library() is not None


def relu_backward(dy: np.ndarray, y: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """The gradient of a ReLU's input from its output ``y``: 0 where ``y <= 0``, else ``dy``
    (as PyTorch's: 0 at 0, passed where the input was NaN); into ``out`` (float32, C-contiguous,
    ``y``'s shape) where given."""
    lib = _library()
    if lib is None or dy.shape != y.shape or not _served(dy):  # numpy's way
        mask = ~(y <= 0)
        return dy * mask if out is None else np.multiply(dy, mask, out=out)
    dx = np.empty_like(y) if out is None else out
    _relu_backward_op(lib, y.size).run(y, dy, dx)
    return dx


def _pool_ops(lib: _Library, shape: tuple[int, ...], kernel: int, stride: int):
    n, c, h, w = shape
    out = (n, c, (h - kernel) // stride + 1, (w - kernel) // stride + 1)

    def make():
        d = lib.dll
        src, dst = lib.md(shape, _TAG_NCHW), lib.md(out, _TAG_NCHW)
        geometry = (_Dims(stride, stride), _Dims(kernel, kernel), _Dims(0, 0), _Dims(0, 0),
                    _Dims(0, 0))  # fmt: skip
        forward, backward = _p(), _p()
        lib.check(d.dnnl_pooling_forward_primitive_desc_create(
            ctypes.byref(forward), lib.engine, _FORWARD_TRAINING, _POOLING_MAX, src, dst,
            *geometry, lib.attr), "pooling_forward_primitive_desc_create")  # fmt: skip
        lib.check(d.dnnl_pooling_backward_primitive_desc_create(
            ctypes.byref(backward), lib.engine, _POOLING_MAX, src, dst, *geometry, forward,
            lib.attr), "pooling_backward_primitive_desc_create")  # fmt: skip
        workspace = d.dnnl_primitive_desc_query_md(forward, _QUERY_WORKSPACE, 0)
        nbytes = d.dnnl_memory_desc_get_size(workspace)
        fwd_args = [(_ARG_SRC, src), (_ARG_DST, dst), (_ARG_WORKSPACE, workspace)]
        bwd_args = [(_ARG_DIFF_DST, dst), (_ARG_WORKSPACE, workspace), (_ARG_DIFF_SRC, src)]
        fwd = _Op(lib, forward, "max pool forward", fwd_args)
        bwd = _Op(lib, backward, "max pool backward", bwd_args)
        return fwd, bwd, out, nbytes

    return _op(("maxpool", shape, kernel, stride), make)


def max_pool(x: np.ndarray, kernel: int, stride: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(output, workspace) of a max pool (no padding, floor mode) by oneDNN, or None where it
    does not serve; the workspace (each window's maximum's place) is what
    :func:`max_pool_backward` reads. Windows that overlap (``stride < kernel``) are not
    served: oneDNN adds an input's gradients from its windows in another order than the numpy
    path, and the last bit would differ from a machine without oneDNN. Nor is an input holding
    a NaN (oneDNN passes over it; numpy's maximum, as PyTorch's pool, keeps it): one read-only
    pass looks for it."""
    lib = _library() if _served(x, 4) and stride >= kernel else None
    if lib is None or np.isnan(x.max()):  # a window's NaN is its maximum, as numpy's; not oneDNN's
        return None
    forward, _, out, nbytes = _pool_ops(lib, x.shape, kernel, stride)
    y, workspace = np.empty(out, np.float32), np.empty(nbytes, np.uint8)
    forward.run(x, y, workspace)
    return y, workspace


def max_pool_backward(
    dy: np.ndarray, workspace: np.ndarray, x_shape: tuple[int, ...], kernel: int, stride: int
) -> np.ndarray:
    """The input's gradient of :func:`max_pool` from its workspace: each output's gradient on
    its window's first maximum."""
    lib = library()  # max_pool served this call: the library is loaded
    dy = np.ascontiguousarray(dy, dtype=np.float32)
    backward = _pool_ops(lib, tuple(x_shape), kernel, stride)[1]
    dx = np.empty(x_shape, np.float32)
    backward.run(dy, workspace, dx)
    return dx
