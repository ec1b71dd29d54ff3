"""The onednn backend: the cpu backend with its three convolutions run by oneDNN.

oneDNN (Intel's deep-learning primitives library; PyTorch's CPU convolutions are its) is a
compiled library, ``libdnnl.so.3``, that ``pip install 'hetconv[onednn]'`` brings as the wheel
``onednn-cpu-gomp`` (oneDNN 3.2, CPU only, GNU OpenMP threads, no Python dependency). It is
called here through ctypes, its C API only: no compiler and no PyTorch are needed. Its JIT
picks kernels for the CPU it runs on (AVX2, AVX-512, AMX), where the cpu backend's im2col +
BLAS GEMMs depend on the BLAS's kernel for that CPU.

Everything that is not a convolution (pooling, LRN, batch norm, the stages) is the cpu
backend's: :class:`OneDnnBackend` subclasses :class:`~hetconv.backends.cpu.CpuBackend` and
overrides the three convolution calls only.

Arrays cross as they are, in hetconv's NCHW / KCHW float32 layout (oneDNN's ``nchw`` and
``oihw`` tags); most operations compute in oneDNN's own blocked layouts, reordered into and out
of buffers kept per thread (:data:`LAYOUTS` says which and why). The primitives of a geometry
are created once (creation takes milliseconds) and kept per backend instance and geometry;
each takes its scratchpad from the caller, so any thread may run any of them.

Threads: every primitive runs at one OpenMP thread, and a call is cut into parts run at
once on a pool of threads (ctypes lets go of the GIL while oneDNN computes), as many as the
backend's ``threads`` or, by default, the BLAS thread count (``threadpoolctl``'s limit, what
``hetconv train --threads`` and a worker's ``--threads`` set), so both engines use the same
share of the cores. oneDNN's own threads would sum a kernel gradient in per-thread parts that
it plans by the thread count and the number of kernels; here every result is the same at any
thread count and for any slice of a layer's kernels, bit for bit (:meth:`OneDnnBackend.
_grad_kernels` says how).

The C API's calls are :mod:`.onednn_library`'s; it looks for the library in
``$HETCONV_ONEDNN_LIB`` (a file path), then next to the Python environment
(``<sys.prefix>/lib``, where pip puts it), then by the system loader.
"""

from __future__ import annotations

import ctypes
import math
import threading
from concurrent.futures import wait
from dataclasses import replace
from functools import partial

import numpy as np

from .base import (
    ConvShape,
    DeviceInfo,
    KernelGradientSum,
    Padding,
    _with_images,
)
from .checks import device_number
from .cpu import CpuBackend
from .hostthreads import blas_threads, shared_pool
from .hostthreads import groups as _ranges  # [0, total) in contiguous ranges of whole blocks
from .onednn_library import (  # the C API's names, as its header spells them
    _ARG_BIAS,
    _ARG_DIFF_BIAS,
    _ARG_DIFF_DST,
    _ARG_DIFF_SRC,
    _ARG_DIFF_WEIGHTS,
    _ARG_DST,
    _ARG_SRC,
    _ARG_WEIGHTS,
    _DIRECT,
    _FORWARD_TRAINING,
    _TAG_ANY,
    _TAG_NCHW,
    _TAG_OIHW,
    _TAG_X,
    ENV_LIBRARY,
    INSTALL_HINT,
    LIBRARY,
    OneDnnError,
    _Bound,
    _Dims,
    _Library,
    _p,
    _Primitive,
    _Reorder,
    library,
)

__all__ = ["ENV_LIBRARY", "LAYOUTS", "OneDnnBackend", "OneDnnError", "library", "op_layouts"]

#: The three operations, as :class:`_Convolution` names them.
OPS = ("forward", "input", "kernels")
#: Which layout each operation computes in: "plain" (NCHW, no reorders) or "blocked" (oneDNN's
#: choice, reordered both ways every call in buffers kept per thread); "auto" (the default):
#: blocked, but the input gradient of layers with fewer than :data:`FEW_CHANNELS` input
#: channels plain. One thread, batch 16, ms, plain / blocked: resnet20's 16-channel 3x3 layer
#: forward 1.27 / 0.66, input gradient 1.51 / 0.50, kernel gradient 2.14 / 0.46; its first
#: layer (3 channels, 16 kernels) forward 0.29 / 0.18; paper-500-1500's (500 kernels of 5x5)
#: forward 6.7 / 9.8 (torch 9.2), input gradient 7.7 / 33.2. The choice may depend on
#: everything but the number of kernels: blocked and plain primitives sum in other orders, and
#: a slice of a layer's kernels must run as the whole layer does to equal its rows bitwise
#: (at one thread; tests/test_backend_onednn.py).
LAYOUTS = ("auto", "blocked", "plain")
DEFAULT_LAYOUT = "auto"
FEW_CHANNELS = 8
#: Geometries whose primitives a backend keeps; past this many all are dropped (a worker
#: serving many batch sizes), and made again as calls need them.
MAX_KEPT = 256
#: A kernel gradient is the sum, in order, of one primitive's per part of the batch (its images
#: in a fixed order), the parts set by the number of images alone, not by the thread count, so
#: the sum is the same at any: as many parts as :data:`IMAGES_PER_PART` fit, at most
#: :data:`MAX_IMAGE_PARTS`. Threads beyond one a part take ranges of the kernels (a kernel's
#: sum does not depend on the kernels beside it), each reordering the input again, which a part
#: of the images does not; a part costs about 50 us of calls, so small batches stay in one
#: (resnet20's 16-kernel layer at batch 16, one thread: 0.52 ms in two parts, 0.44 in one).
IMAGES_PER_PART = 32
MAX_IMAGE_PARTS = 4
#: A part of the images holds at least this many output pixels (images x output rows x
#: columns), so that its own copy of the gradient (a kernel's, ``c x kh x kw`` values per
#: kernel) is small beside what it computes: layers of small outputs take more images a part.
#: vgg11's 512-kernel layers at batch 64, 4x4 and 2x2 outputs, two parts / one, min of 7:
#: one thread 50.4 / 49.2 and 19.6 / 18.4 ms, two threads 42.9 / 24.3 and 14.4 / 9.3 ms (the
#: parts' gradients, 9.4 MB each, written and summed). Like the images, it depends on the
#: geometry alone, never on the kernels or the threads.
PIXELS_PER_PART = 2048
#: Kernel ranges a call is cut into begin at multiples of this (oneDNN computes kernels in
#: blocks of 8 on AVX2, 16 on AVX-512: a range of fewer pads its block).
KERNEL_BLOCK = 16
#: The least arithmetic (flops, :attr:`ConvShape.flops_forward`) a part of a call must hold for
#: the call to be cut into more parts than one, whatever the threads: below it, the parts' own
#: cost (their hand-off to the pool, reorders, calls) outweighs what a second core does. It
#: sets how many parts there are, never where a sum's order changes (a range of images or of
#: kernels computes the same bits whatever the ranges), so it costs no exactness. At two
#: threads, resnet20's and vgg11's convolutions at batch 16 and 64 (88 rows of
#: ``benchmarks/conv_vs_torch.py``, torch at two threads too, two alternated runs each): 15-16
#: rows over 1.1x torch's at 10^8 (resnet20's 3x3 forwards at batch 64 1.26-1.63x, run on one
#: core), 9 at 2.5 x 10^7.
MIN_PART_FLOPS = 25_000_000
_NO_PADDING = Padding(0, 0, 0, 0)
_BIAS_ARG = {"forward": _ARG_BIAS, "kernels": _ARG_DIFF_BIAS}


def op_layouts(layout: str, shape: ConvShape) -> dict[str, str]:
    """Operation -> "plain" or "blocked" for ``shape`` under ``layout`` (see :data:`LAYOUTS`)."""
    if layout != "auto":
        return dict.fromkeys(OPS, layout)
    few = shape.c < FEW_CHANNELS
    return {"forward": "blocked", "input": "plain" if few else "blocked", "kernels": "blocked"}


def _worth(flops: int, threads: int) -> int:
    """The parts a call of ``flops`` is cut into on ``threads``: each at least
    :data:`MIN_PART_FLOPS`, one at the least."""
    return max(1, min(threads, flops // MIN_PART_FLOPS))


def _image_parts(shape: ConvShape) -> int:
    """How many ranges of the images a kernel gradient of ``shape`` is summed from (see
    :data:`IMAGES_PER_PART` and :data:`PIXELS_PER_PART`)."""
    ho, wo = shape.out_hw
    per_part = max(IMAGES_PER_PART, -(-PIXELS_PER_PART // max(1, ho * wo)))
    return max(1, min(MAX_IMAGE_PARTS, shape.n // per_part))


class _PartScratch:
    """The calling thread's scratch buffers (``CpuBackend._scratch``), lent to the thread that
    runs group ``group`` of a call's parts under names of that group's own: the worker's
    :meth:`trim_scratch`, on the calling thread, frees them too."""

    def __init__(self, buffers: dict[str, np.ndarray], group: int):
        self.buffers, self.suffix = buffers, f" {group}" if group else ""

    def __call__(self, name: str, shape: tuple[int, ...], zero: bool = False) -> np.ndarray:
        """Buffer ``name`` as a float32 array of ``shape`` (its values left as they were, or
        zeros)."""
        size = math.prod(shape)
        view = self._buffer(name, size)[:size].reshape(shape)
        if zero:
            view.fill(0.0)
        return view

    def address(self, name: str, nbytes: int) -> int:
        """The address of at least ``nbytes`` of buffer ``name`` on a 64-byte boundary, as
        oneDNN aligns its own buffers (a cache line; AVX-512's aligned loads)."""
        address = self._buffer(name, nbytes // 4 + 16).ctypes.data
        return address + -address % 64

    def _buffer(self, name: str, size: int) -> np.ndarray:
        name += self.suffix
        buffer = self.buffers.get(name)
        if buffer is None or buffer.size < size:
            buffer = self.buffers[name] = np.empty(size, np.float32)
        return buffer


def _one_thread(lib: _Library, tasks: list, scratch: _PartScratch) -> None:
    lib.set_threads(1)
    for task in tasks:
        task(scratch)


def _in_parallel(lib: _Library, tasks: list, threads: int, buffers: dict) -> None:
    """Run ``tasks`` (callables of a :class:`_PartScratch` over ``buffers``)
    on at most ``threads`` threads at once, in as many contiguous groups, each in order: the
    first group on the calling thread, the others on the shared pool; each at one OpenMP
    thread. Returns when all are done; raises the first failure."""
    if threads == 1 or len(tasks) == 1:  # on the calling thread: no hand-off to wait for
        _one_thread(lib, tasks, _PartScratch(buffers, 0))
        return
    groups = [tasks[i:j] for i, j in _ranges(len(tasks), threads)]
    pool = shared_pool()
    futures = [
        pool.submit(_one_thread, lib, group, _PartScratch(buffers, g))
        for g, group in enumerate(groups[1:], 1)
    ]
    try:
        _one_thread(lib, groups[0], _PartScratch(buffers, 0))
    finally:
        wait(futures)  # every part done before its buffers are used or freed
    for future in futures:
        future.result()


def _roles(mds: dict, bias=None) -> tuple:
    """The descriptors a convolution primitive takes, in its argument order: src, weights,
    (bias,) dst."""
    return (mds["src"], mds["weights"], *(() if bias is None else (bias,)), mds["dst"])


class _Convolution:
    """The three primitives of one geometry (and, blocked, their reorders), kept together.

    Roles name the tensors: ``src`` (x), ``weights`` (w), ``dst`` (y or dy); each role's
    plain descriptor and, per primitive, the descriptor it computes in.
    """

    def __init__(self, lib: _Library, shape: ConvShape, layout: str):
        self.lib, self.shape = lib, shape
        self._owned_mds, self._pds = [], []
        self._memories: list = []  # every thread's bound memories (:class:`_Bound`)
        self._bound = threading.local()
        self.primitives: dict[str, _Primitive] = {}
        self.args: dict[str, dict[str, int]] = {}
        ho, wo = shape.out_hw
        dims = {
            "src": (shape.n, shape.c, shape.h, shape.w),
            "weights": (shape.k, shape.c, shape.kh, shape.kw),
            "dst": (shape.n, shape.k, ho, wo),
        }
        self.plain = {
            role: self._md(d, _TAG_OIHW if role == "weights" else _TAG_NCHW)
            for role, d in dims.items()
        }
        bias = self._md((shape.k,), _TAG_X)
        blocked = {role: self._md(d, _TAG_ANY) for role, d in dims.items()}
        chosen = op_layouts(layout, shape)
        pick = {op: blocked if chosen[op] == "blocked" else self.plain for op in OPS}
        p, strides = shape.padding, _Dims(*shape.stride)
        geometry = (strides, _Dims(0, 0), _Dims(p.top, p.left), _Dims(p.bottom, p.right))
        d = lib.dll
        # a backward primitive's hint is the forward of its own layout: oneDNN picks its
        # implementation by the hint, and one geometry must always get the same (a slice of
        # kernels equals the whole layer's rows only if both run the same implementation)
        hints = {
            kind: self._pd(
                d.dnnl_convolution_forward_primitive_desc_create, lib.engine, _FORWARD_TRAINING,
                _DIRECT, *_roles(mds, bias), *geometry, lib.attr,
            )
            for kind, mds in (("plain", self.plain), ("blocked", blocked))
            if kind in chosen.values()
        }  # fmt: skip
        fwd = hints[chosen["forward"]]
        bwd_data = self._pd(
            d.dnnl_convolution_backward_data_primitive_desc_create, lib.engine, _DIRECT,
            *_roles(pick["input"]), *geometry, hints[chosen["input"]], lib.attr,
        )  # fmt: skip
        bwd_weights = self._pd(
            d.dnnl_convolution_backward_weights_primitive_desc_create, lib.engine, _DIRECT,
            *_roles(pick["kernels"], bias), *geometry, hints[chosen["kernels"]], lib.attr,
        )  # fmt: skip
        self.bias_md = bias
        self.zero_bias = np.zeros(shape.k, np.float32)  # the primitive has a bias: none is 0
        roles = {"src": _ARG_SRC, "weights": _ARG_WEIGHTS, "dst": _ARG_DST}
        self.reorders: dict[tuple[str, str], _Reorder | None] = {}
        self.implementations: dict[str, str] = {}
        for op, pd, args in (
            ("forward", fwd, roles),
            ("input", bwd_data, {**roles, "src": _ARG_DIFF_SRC, "dst": _ARG_DIFF_DST}),
            ("kernels", bwd_weights, {**roles, "weights": _ARG_DIFF_WEIGHTS, "dst": _ARG_DIFF_DST}),
        ):
            self._pds.remove(pd)  # the primitive owns it now
            primitive = self.primitives[op] = _Primitive(lib, pd, f"{op} primitive")
            self.args[op] = args
            self.implementations[op] = primitive.implementation
            for role, arg in args.items():
                computes_in = primitive.md(arg)
                same = d.dnnl_memory_desc_equal(computes_in, self.plain[role])
                reorder = None if same else _Reorder(lib, self.plain[role], computes_in)
                self.reorders[op, role] = reorder

    @property
    def exact_slices(self) -> bool:
        """Whether a slice of the kernels runs as the whole layer does: oneDNN's direct
        convolutions compute each kernel's outputs and gradient alike whatever the kernels
        beside it; its GEMM-based fallback (padding its direct kernels do not take, on AVX2
        padding wider than the kernel) blocks its sums by the number of kernels."""
        return all("gemm" not in self.implementations[op] for op in ("forward", "kernels"))

    def _md(self, dims, tag):
        md = self.lib.md(dims, tag)
        self._owned_mds.append(md)
        return md

    def _pd(self, create, *args):
        pd = _p()
        self.lib.check(create(ctypes.byref(pd), *args), f"{create.__name__}({self.shape})")
        self._pds.append(pd)
        return pd

    def __del__(self) -> None:
        d = getattr(self.lib, "dll", None)
        if d is None:  # pragma: no cover - interpreter shutdown
            return
        for memory in self._memories:
            d.dnnl_memory_destroy(memory)
        for primitive in self.primitives.values():
            primitive.destroy()
        for reorder in self.reorders.values():
            if reorder is not None:
                reorder.into.destroy()
                reorder.back.destroy()
        for pd in self._pds:
            d.dnnl_primitive_desc_destroy(pd)
        for md in self._owned_mds:
            d.dnnl_memory_desc_destroy(md)

    def run(self, op: str, arrays: dict[str, np.ndarray], bias: np.ndarray | None, scratch) -> None:
        """Execute primitive ``op`` on the plain arrays of each role (and the bias, or the
        bias gradient for ``"kernels"``; none for ``"input"``), reordering to and from the
        primitive's layouts in buffers ``scratch`` (a :class:`_PartScratch`) keeps for the
        calling thread (fresh pages cost as much as a reorder). Inputs are read, outputs
        written, in place."""
        bound = getattr(self._bound, op, None)
        if bound is None:  # the calling thread's first call of op
            roles = [
                (role, arg, self.plain[role], self.reorders[op, role])
                for role, arg in self.args[op].items()
            ]
            biased = None if op == "input" else (self.bias_md, _BIAS_ARG[op])
            bound = _Bound(self.lib, self.primitives[op], roles, biased, self._memories)
            setattr(self._bound, op, bound)
        bound.run(arrays if bias is None else {**arrays, "bias": bias}, scratch)


class OneDnnBackend(CpuBackend):
    """The cpu backend with oneDNN's convolutions (see the module docstring).

    Args:
        threads: OpenMP threads per call; None: the BLAS thread count at the time of the call
            (``threadpoolctl``), so a ``--threads`` limit holds for both engines.
        layout: ``"auto"``, ``"blocked"`` or ``"plain"`` (:data:`LAYOUTS`).
        device: None or 0: the host's CPU, its one device.
        cpu_options: the cpu backend's (``scratch_bytes``), for the layers that stay its.
    """

    name = "onednn"
    native_stride = True  # oneDNN's strided convolutions: no phases (1.78x 3x3's arithmetic)

    def __init__(
        self,
        threads: int | None = None,
        layout: str = DEFAULT_LAYOUT,
        device: int | None = None,
        **cpu_options,
    ):
        super().__init__(**cpu_options)
        if device is not None:  # one device, the host's CPU (`hetconv devices` numbers it 0)
            device_number("onednn", device, 1, lambda _: "the host's CPU")
        if layout not in LAYOUTS:
            raise ValueError(f"onednn layout {layout!r} is not one of {', '.join(LAYOUTS)}")
        if threads is not None and (isinstance(threads, bool) or int(threads) < 1):
            raise ValueError(f"onednn threads must be a positive integer, got {threads!r}")
        self.threads = None if threads is None else int(threads)
        self.layout = layout
        self._lib = library()
        self._convolutions: dict[tuple[ConvShape, int], _Convolution] = {}
        self._lock = threading.Lock()

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        try:
            library()
        except OSError as e:
            return False, f"oneDNN library {LIBRARY} cannot be loaded ({e}); {INSTALL_HINT}"
        return True, ""

    @staticmethod
    def library_version() -> str:
        """oneDNN's version (``3.2.0``); OSError when its library cannot be loaded."""
        return library().version()

    def describe(self) -> DeviceInfo:
        info = super().describe()
        lib = self._lib
        name = f"{info.name} (oneDNN {lib.version()}, {lib.isa()})"
        return DeviceInfo(self.name, info.kind, name, info.memory_bytes, info.cores)

    def kernel_gradient_sum(self) -> KernelGradientSum:
        return KernelGradientSum(self)

    def working_set_bytes(self, shape: ConvShape) -> int:
        s, (ho, wo) = shape, shape.out_hw  # the plain tensors and a reordered copy of each
        return 8 * (s.n * s.c * s.h * s.w + s.k * s.c * s.kh * s.kw + s.n * s.k * ho * wo)

    def _threads(self) -> int:
        if self.threads is not None:
            return self.threads
        return blas_threads()

    def implementations(self, shape: ConvShape) -> dict[str, str]:
        """The implementation oneDNN runs each operation of ``shape`` with (its name)."""
        return dict(self._convolution(shape).implementations)

    def _convolution(self, shape: ConvShape) -> _Convolution:
        """The primitives of ``shape``, made (for one OpenMP thread, the calling thread's
        count set first: oneDNN plans a primitive's work for the threads there are when it is
        created) on first use and kept."""
        self._lib.set_threads(1)
        conv = self._convolutions.get(shape)
        if conv is None:
            with self._lock:
                conv = self._convolutions.get(shape)
                if conv is None:
                    if len(self._convolutions) >= MAX_KEPT:
                        self._convolutions.clear()  # freed once calls running them finish
                    conv = self._exact_convolution(shape)
                    self._convolutions[shape] = conv
        return conv

    def _exact_convolution(self, shape: ConvShape) -> _Convolution:
        """The primitives of ``shape``; where they are GEMM-based (:attr:`_Convolution.
        exact_slices`) and padded, those of the same convolution on an input padded here
        instead (no padding left to oneDNN: its direct kernels take that), if they are not."""
        conv = _Convolution(self._lib, shape, self.layout)
        if conv.exact_slices or shape.padding == _NO_PADDING:
            return conv
        hp, wp = shape.padded_hw
        padded = replace(shape, h=hp, w=wp, padding=_NO_PADDING)
        direct = _Convolution(self._lib, padded, self.layout)
        return direct if direct.exact_slices else conv

    def _padded_input(self, x: np.ndarray, shape: ConvShape, scratch) -> np.ndarray:
        """``x`` zero-padded as ``shape`` says, in a buffer kept for the calling thread."""
        xp = scratch("onednn padded", (shape.n, shape.c, *shape.padded_hw), zero=True)
        rows, cols = shape.interior
        xp[:, :, rows, cols] = x
        return xp

    def _forward(self, x, w, b, shape):
        """Ranges of the images, one per thread (an image's outputs do not depend on the
        images beside it); ranges of the kernels (nor on the kernels) where the weights
        outweigh the images (each thread then reads its own kernels only: vgg11's 512-kernel
        layers of 2x2 and 4x4 outputs) or there is a single image."""
        y = np.empty((shape.n, shape.k, *shape.out_hw), np.float32)
        threads = _worth(shape.flops_forward, self._threads())
        weights, images = (
            shape.k * shape.c * shape.kh * shape.kw,
            shape.n * shape.c * shape.h * shape.w,
        )
        if threads == 1 or (shape.n > 1 and weights <= images):
            parts = [
                (x[i:j], w, b, y[i:j], _with_images(shape, j - i))
                for i, j in _ranges(shape.n, threads)
            ]
        else:  # y's rows of a range of kernels: contiguous for one image, else copied out
            parts = [
                (x, w[i:j], None if b is None else b[i:j], y[:, i:j], replace(shape, k=j - i))
                for i, j in _ranges(shape.k, threads, KERNEL_BLOCK)
            ]
        tasks = [partial(self._forward_part, *part) for part in parts]
        _in_parallel(self._lib, tasks, threads, self._scratch.buffers)
        return y

    def _forward_part(self, x, w, b, y, shape, scratch):
        conv = self._convolution(shape)
        bias = conv.zero_bias if b is None else b
        if conv.shape != shape:  # padded here: x is copied in
            x = self._padded_input(x, shape, scratch)
        if y.flags.c_contiguous:
            conv.run("forward", {"src": x, "weights": w, "dst": y}, bias, scratch)
            return
        part_y = scratch("onednn y", y.shape)  # a range of the kernels of several images
        conv.run("forward", {"src": x, "weights": w, "dst": part_y}, bias, scratch)
        y[...] = part_y

    def _grad_input(self, dy, w, shape):
        """Ranges of the images, one per thread (the gradient of an image's input is a sum
        over the kernels, all of them in every part)."""
        dx = np.empty((shape.n, shape.c, shape.h, shape.w), np.float32)
        threads = _worth(shape.flops_forward, self._threads())
        parts = [
            (dy[i:j], w, dx[i:j], _with_images(shape, j - i)) for i, j in _ranges(shape.n, threads)
        ]
        tasks = [partial(self._grad_input_part, *part) for part in parts]
        _in_parallel(self._lib, tasks, threads, self._scratch.buffers)
        return dx

    def _grad_input_part(self, dy, w, dx, shape, scratch):
        conv = self._convolution(shape)
        if conv.shape != shape:  # padded here: the padded input's gradient, cut out
            dxp = scratch("onednn padded", (shape.n, shape.c, *shape.padded_hw))
            conv.run("input", {"src": dxp, "weights": w, "dst": dy}, None, scratch)
            rows, cols = shape.interior
            dx[...] = dxp[:, :, rows, cols]
            return
        conv.run("input", {"src": dx, "weights": w, "dst": dy}, None, scratch)

    def _grad_kernels(self, x, dy, shape):
        """The sum over ranges of the images, in order, of each range's gradient (see
        :data:`IMAGES_PER_PART`); the threads beyond one per range take ranges of the kernels."""
        parts = _image_parts(shape)
        images, threads = _ranges(shape.n, parts), self._threads()
        per_part = _worth(shape.flops_forward // len(images), max(1, threads // len(images)))
        kernels = _ranges(shape.k, per_part, KERNEL_BLOCK)
        sums = [
            (np.empty((shape.k, shape.c, shape.kh, shape.kw), np.float32),
             np.empty(shape.k, np.float32))
            for _ in images
        ]  # fmt: skip
        tasks = [
            partial(self._grad_kernels_part, x, dy, (i, j), (k0, k1), dw[k0:k1], db[k0:k1], shape)
            for (i, j), (dw, db) in zip(images, sums, strict=True)
            for k0, k1 in kernels
        ]
        _in_parallel(self._lib, tasks, threads, self._scratch.buffers)
        dw, db = sums[0]
        for part_dw, part_db in sums[1:]:
            dw += part_dw
            db += part_db
        return dw, db

    def _grad_kernels_part(self, x, dy, images, kernels, dw, db, shape, scratch):
        (i, j), (k0, k1) = images, kernels
        part = replace(shape, n=j - i, k=k1 - k0)
        x, dy = x[i:j], dy[i:j]
        if part.k != shape.k:  # a range of the kernels: its dy copied out
            part_dy = scratch("onednn dy", (part.n, part.k, *shape.out_hw))
            part_dy[...] = dy[:, k0:k1]
            dy = part_dy
        conv = self._convolution(part)
        if conv.shape != part:  # padded here: x is copied in
            x = self._padded_input(x, part, scratch)
        conv.run("kernels", {"src": x, "weights": dw, "dst": dy}, db, scratch)
