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
are created once (creation takes milliseconds) and kept per backend instance, geometry and
thread count; each takes its scratchpad from the caller, so any thread may run any of them.

Threads: oneDNN runs on OpenMP threads; each call sets the calling thread's OpenMP thread count
to the backend's ``threads`` or, by default, to the BLAS thread count (``threadpoolctl``'s
limit, what ``hetconv train --threads`` and a worker's ``--threads`` set), so both engines use
the same share of the cores. At one thread a slice of a layer's kernels computes bit for bit
the rows the whole layer does; at more, its kernel gradient only to round-off.

The library is looked for in ``$HETCONV_ONEDNN_LIB`` (a file path), then next to the Python
environment (``<sys.prefix>/lib``, where pip puts it), then by the system loader.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading

import numpy as np

from .base import ConvShape, DeviceInfo, KernelGradientSum, Padding, device_number
from .cpu import CpuBackend

LIBRARY = "libdnnl.so.3"
ENV_LIBRARY = "HETCONV_ONEDNN_LIB"
INSTALL_HINT = "pip install 'hetconv[onednn]'"
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
_NO_PADDING = Padding(0, 0, 0, 0)


def op_layouts(layout: str, shape: ConvShape) -> dict[str, str]:
    """Operation -> "plain" or "blocked" for ``shape`` under ``layout`` (see :data:`LAYOUTS`)."""
    if layout != "auto":
        return dict.fromkeys(OPS, layout)
    few = shape.c < FEW_CHANNELS
    return {"forward": "blocked", "input": "plain" if few else "blocked", "kernels": "blocked"}


# oneDNN 3.2's C enums (include/oneapi/dnnl/dnnl_types.h at tag v3.2)
_SUCCESS, _CPU, _F32 = 0, 1, 3
_TAG_ANY, _TAG_X, _TAG_NCHW, _TAG_OIHW = 1, 2, 5, 5
_FORWARD_TRAINING, _DIRECT = 64, 1
_STREAM_DEFAULT = 1
_QUERY_IMPL, _QUERY_SCRATCHPAD, _SCRATCHPAD_USER, _ARG_SCRATCHPAD = 8, 136, 1, 80
_ARG_SRC, _ARG_DST, _ARG_WEIGHTS, _ARG_BIAS = 1, 17, 33, 41
_ARG_DIFF_SRC, _ARG_DIFF_DST, _ARG_DIFF_WEIGHTS, _ARG_DIFF_BIAS = 129, 145, 161, 169
_QUERY = {
    _ARG_SRC: 129, _ARG_DIFF_SRC: 130, _ARG_WEIGHTS: 131, _ARG_DIFF_WEIGHTS: 132,
    _ARG_DST: 133, _ARG_DIFF_DST: 134,
}  # fmt: skip
_ISA = {
    0x3: "avx", 0x7: "avx2", 0xF: "avx2_vnni", 0x1F: "avx2_vnni_2", 0x27: "avx512_core",
    0x67: "avx512_core_vnni", 0xE7: "avx512_core_bf16", 0x1EF: "avx512_core_fp16",
    0xFEF: "avx512_core_amx", 0x1FEF: "avx512_core_amx_fp16",
}  # fmt: skip

_Dims = ctypes.c_int64 * 12
_p = ctypes.c_void_p


class _ExecArg(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_int), ("memory", _p)]


class OneDnnError(RuntimeError):
    """A oneDNN call that did not succeed (its status code in the message)."""


def _candidates() -> list[str]:
    explicit = os.environ.get(ENV_LIBRARY)
    if explicit:
        return [explicit]
    return [os.path.join(sys.prefix, "lib", LIBRARY), LIBRARY]


class _Library:
    """libdnnl loaded once per process, with one CPU engine and OpenMP's thread setter."""

    def __init__(self) -> None:
        errors = []
        for path in _candidates():
            try:
                self.dll = ctypes.CDLL(path)
                break
            except OSError as e:
                errors.append(f"{path}: {e}")
        else:
            raise OSError("; ".join(errors))
        d = self.dll
        status = ctypes.c_int
        for name, args in {
            "dnnl_engine_create": [ctypes.POINTER(_p), ctypes.c_int, ctypes.c_size_t],
            "dnnl_stream_create": [ctypes.POINTER(_p), _p, ctypes.c_uint],
            "dnnl_memory_desc_create_with_tag": [
                ctypes.POINTER(_p), ctypes.c_int, _Dims, ctypes.c_int, ctypes.c_int
            ],
            "dnnl_convolution_forward_primitive_desc_create": [
                ctypes.POINTER(_p), _p, ctypes.c_int, ctypes.c_int, _p, _p, _p, _p,
                _Dims, _Dims, _Dims, _Dims, _p,
            ],
            "dnnl_convolution_backward_data_primitive_desc_create": [
                ctypes.POINTER(_p), _p, ctypes.c_int, _p, _p, _p, _Dims, _Dims, _Dims, _Dims,
                _p, _p,
            ],
            "dnnl_convolution_backward_weights_primitive_desc_create": [
                ctypes.POINTER(_p), _p, ctypes.c_int, _p, _p, _p, _p, _Dims, _Dims, _Dims,
                _Dims, _p, _p,
            ],
            "dnnl_reorder_primitive_desc_create": [ctypes.POINTER(_p), _p, _p, _p, _p, _p],
            "dnnl_primitive_create": [ctypes.POINTER(_p), _p],
            "dnnl_primitive_execute": [_p, _p, ctypes.c_int, _p],
            "dnnl_memory_create": [ctypes.POINTER(_p), _p, _p, _p],
            "dnnl_primitive_attr_create": [ctypes.POINTER(_p)],
            "dnnl_primitive_attr_set_scratchpad_mode": [_p, ctypes.c_int],
            **dict.fromkeys(("dnnl_primitive_desc_destroy", "dnnl_primitive_destroy",
                             "dnnl_memory_destroy", "dnnl_memory_desc_destroy"), [_p]),
        }.items():  # fmt: skip
            fn = getattr(d, name)
            fn.argtypes, fn.restype = args, status
        d.dnnl_primitive_desc_query.argtypes = [_p, ctypes.c_int, ctypes.c_int, _p]
        d.dnnl_primitive_desc_query.restype = ctypes.c_int
        d.dnnl_primitive_desc_query_md.argtypes = [_p, ctypes.c_int, ctypes.c_int]
        d.dnnl_primitive_desc_query_md.restype = _p
        d.dnnl_memory_desc_get_size.argtypes = [_p]
        d.dnnl_memory_desc_get_size.restype = ctypes.c_size_t
        d.dnnl_memory_desc_equal.argtypes = [_p, _p]
        d.dnnl_memory_desc_equal.restype = ctypes.c_int
        d.dnnl_version.restype = ctypes.POINTER(ctypes.c_int * 3)  # major, minor, patch first
        d.dnnl_get_effective_cpu_isa.restype = ctypes.c_int
        self.engine = _p()
        self.check(d.dnnl_engine_create(ctypes.byref(self.engine), _CPU, 0), "engine_create")
        # Every primitive takes its scratchpad from the caller (a buffer kept per thread): the
        # library's own is one for all primitives, and a primitive may then run only on the
        # thread that created it, where hetconv calls each from whichever thread serves.
        self.attr = _p()
        self.check(d.dnnl_primitive_attr_create(ctypes.byref(self.attr)), "attr_create")
        user = d.dnnl_primitive_attr_set_scratchpad_mode(self.attr, _SCRATCHPAD_USER)
        self.check(user, "attr_set_scratchpad_mode")
        # libdnnl links libgomp: the same library, already loaded, is found by its name
        self.omp_set_num_threads = ctypes.CDLL("libgomp.so.1").omp_set_num_threads
        self.omp_set_num_threads.argtypes = [ctypes.c_int]
        self._streams = threading.local()

    @staticmethod
    def check(status: int, what: str) -> None:
        if status != _SUCCESS:
            raise OneDnnError(f"oneDNN {what} failed with status {status}")

    def stream(self) -> ctypes.c_void_p:
        """The calling thread's stream (a stream is used by one thread at a time)."""
        stream = getattr(self._streams, "stream", None)
        if stream is None:
            stream = _p()
            created = self.dll.dnnl_stream_create(
                ctypes.byref(stream), self.engine, _STREAM_DEFAULT
            )
            self.check(created, "stream_create")
            self._streams.stream = stream
        return stream

    def set_threads(self, threads: int) -> None:
        """OpenMP threads of the calling thread's next parallel regions (set when changed)."""
        if getattr(self._streams, "threads", None) != threads:
            self.omp_set_num_threads(threads)
            self._streams.threads = threads

    def implementation(self, pd) -> str:
        """The name of the implementation oneDNN chose for primitive descriptor ``pd``."""
        text = ctypes.c_char_p()
        status = self.dll.dnnl_primitive_desc_query(pd, _QUERY_IMPL, 0, ctypes.byref(text))
        return text.value.decode() if status == _SUCCESS and text.value else "?"

    def version(self) -> str:
        return ".".join(map(str, self.dll.dnnl_version().contents))

    def isa(self) -> str:
        code = self.dll.dnnl_get_effective_cpu_isa()
        return _ISA.get(code, hex(code))

    def md(self, dims: tuple[int, ...], tag: int) -> ctypes.c_void_p:
        md = _p()
        created = self.dll.dnnl_memory_desc_create_with_tag(
            ctypes.byref(md), len(dims), _Dims(*dims), _F32, tag
        )
        self.check(created, f"memory_desc_create({dims})")
        return md


_library: _Library | None = None
_library_error: str | None = None
_library_lock = threading.Lock()


def library() -> _Library:
    """The process's libdnnl (loaded on first use); OSError when it cannot be loaded."""
    global _library, _library_error
    with _library_lock:
        if _library is None and _library_error is None:
            try:
                _library = _Library()
            except (OSError, AttributeError, OneDnnError) as e:
                _library_error = str(e)
        if _library is None:
            raise OSError(_library_error)
        return _library


def _roles(mds: dict, bias=None) -> tuple:
    """The descriptors a convolution primitive takes, in its argument order: src, weights,
    (bias,) dst."""
    return (mds["src"], mds["weights"], *(() if bias is None else (bias,)), mds["dst"])


class _Primitive:
    """One oneDNN primitive with its descriptor (kept: it owns the descriptors queried from
    it) and the size of the scratchpad it needs."""

    def __init__(self, lib: _Library, pd: ctypes.c_void_p, what: str):
        self.lib, self.pd, self.primitive = lib, pd, _p()
        lib.check(lib.dll.dnnl_primitive_create(ctypes.byref(self.primitive), pd), what)
        self.scratchpad = lib.dll.dnnl_primitive_desc_query_md(pd, _QUERY_SCRATCHPAD, 0)
        self.scratchpad_bytes = lib.dll.dnnl_memory_desc_get_size(self.scratchpad)
        self.implementation = lib.implementation(pd)

    def md(self, arg: int) -> ctypes.c_void_p:
        """The descriptor the primitive computes argument ``arg`` in (owned by its pd)."""
        return self.lib.dll.dnnl_primitive_desc_query_md(self.pd, _QUERY[arg], 0)

    def execute(self, stream, args: list[tuple[int, ctypes.c_void_p]], scratch, made) -> None:
        """Run on memory objects ``args`` ((argument, memory) pairs), with a scratchpad from
        ``scratch(name, shape)`` when it needs one; memories it creates go to ``made``."""
        if self.scratchpad_bytes:
            buffer = _aligned(scratch, "onednn scratchpad", self.scratchpad_bytes)
            args = [*args, (_ARG_SCRATCHPAD, _memory(self.lib, self.scratchpad, buffer, made))]
        table = (_ExecArg * len(args))(*(_ExecArg(a, m) for a, m in args))
        status = self.lib.dll.dnnl_primitive_execute(self.primitive, stream, len(args), table)
        self.lib.check(status, f"execute ({self.implementation})")

    def destroy(self) -> None:
        self.lib.dll.dnnl_primitive_destroy(self.primitive)
        self.lib.dll.dnnl_primitive_desc_destroy(self.pd)


def _aligned(scratch, name: str, nbytes: int) -> np.ndarray:
    """At least ``nbytes`` of the calling thread's buffer ``name`` (``scratch(name, shape)``),
    starting on a 64-byte boundary, as oneDNN aligns its own buffers (a cache line; AVX-512's
    aligned loads)."""
    buffer = scratch(name, (nbytes // 4 + 17,))
    return buffer[(-buffer.ctypes.data % 64) // 4 :]


def _memory(lib: _Library, md, array: np.ndarray, made: list) -> ctypes.c_void_p:
    """A oneDNN memory of descriptor ``md`` over ``array``'s data (appended to ``made``, to
    be destroyed after the call)."""
    memory = _p()
    created = lib.dll.dnnl_memory_create(
        ctypes.byref(memory), md, lib.engine, _p(array.ctypes.data)
    )
    lib.check(created, "memory_create")
    made.append(memory)
    return memory


class _Reorder:
    """The two reorders between a tensor's plain layout and the blocked one a primitive
    computes in: ``into`` (plain to blocked) and ``back``."""

    def __init__(self, lib: _Library, plain, blocked):
        self.lib, self.plain, self.blocked = lib, plain, blocked
        self.bytes = lib.dll.dnnl_memory_desc_get_size(blocked)
        self.into, self.back = self._create(plain, blocked), self._create(blocked, plain)

    def _create(self, source, target) -> _Primitive:
        lib, pd = self.lib, _p()
        created = lib.dll.dnnl_reorder_primitive_desc_create(
            ctypes.byref(pd), source, lib.engine, target, lib.engine, lib.attr
        )
        lib.check(created, "reorder_primitive_desc_create")
        return _Primitive(lib, pd, "reorder")


class _Convolution:
    """The three primitives of one geometry (and, blocked, their reorders), kept together.

    Roles name the tensors: ``src`` (x), ``weights`` (w), ``dst`` (y or dy); each role's
    plain descriptor and, per primitive, the descriptor it computes in.
    """

    def __init__(self, lib: _Library, shape: ConvShape, layout: str):
        self.lib, self.shape = lib, shape
        self._owned_mds, self._pds = [], []
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
        p = shape.padding
        geometry = (_Dims(1, 1), _Dims(0, 0), _Dims(p.top, p.left), _Dims(p.bottom, p.right))
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
        bias gradient for ``"kernels"``), reordering to and from the primitive's layouts in
        buffers ``scratch(name, shape)`` keeps for the calling thread (fresh pages cost as much
        as a reorder). Inputs are read, outputs written, in place."""
        lib = self.lib
        stream = lib.stream()
        primitive, args = self.primitives[op], self.args[op]
        made, outputs, exec_args = [], [], []
        try:
            for role, arg in args.items():
                plain = _memory(lib, self.plain[role], arrays[role], made)
                reorder = self.reorders[op, role]
                if reorder is None:
                    exec_args.append((arg, plain))
                    continue
                buffer = _aligned(scratch, f"onednn {role}", reorder.bytes)
                blocked = _memory(lib, reorder.blocked, buffer, made)
                exec_args.append((arg, blocked))
                if arg in (_ARG_DST, _ARG_DIFF_SRC, _ARG_DIFF_WEIGHTS):
                    outputs.append((reorder, blocked, plain))
                else:
                    into = [(_ARG_SRC, plain), (_ARG_DST, blocked)]
                    reorder.into.execute(stream, into, scratch, made)
            if bias is not None:
                arg = _ARG_DIFF_BIAS if op == "kernels" else _ARG_BIAS
                exec_args.append((arg, _memory(lib, self.bias_md, bias, made)))
            primitive.execute(stream, exec_args, scratch, made)
            for reorder, blocked, plain in outputs:
                back = [(_ARG_SRC, blocked), (_ARG_DST, plain)]
                reorder.back.execute(stream, back, scratch, made)
        finally:
            for memory in made:
                lib.dll.dnnl_memory_destroy(memory)


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
        self._blas = None

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        try:
            library()
        except OSError as e:
            return False, f"oneDNN library {LIBRARY} cannot be loaded ({e}); {INSTALL_HINT}"
        return True, ""

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
        if self._blas is None:
            from threadpoolctl import ThreadpoolController

            self._blas = ThreadpoolController().select(user_api="blas").lib_controllers
        counts = [c.num_threads for c in self._blas]
        return max(1, min(counts)) if counts else (os.cpu_count() or 1)

    def implementations(self, shape: ConvShape) -> dict[str, str]:
        """The implementation oneDNN runs each operation of ``shape`` with (its name)."""
        return dict(self._convolution(shape).implementations)

    def _convolution(self, shape: ConvShape) -> _Convolution:
        """The primitives of ``shape`` for the thread count of this call, which is set for
        the calling thread first: oneDNN plans a primitive's work split (a kernel gradient's
        partial sums, for one) for the threads there are when it is created, so the
        primitives are kept per (geometry, threads)."""
        threads = self._threads()
        self._lib.set_threads(threads)
        key = (shape, threads)
        conv = self._convolutions.get(key)
        if conv is None:
            with self._lock:
                conv = self._convolutions.get(key)
                if conv is None:
                    if len(self._convolutions) >= MAX_KEPT:
                        self._convolutions.clear()  # freed once calls running them finish
                    conv = self._exact_convolution(shape)
                    self._convolutions[key] = conv
        return conv

    def _exact_convolution(self, shape: ConvShape) -> _Convolution:
        """The primitives of ``shape``; where they are GEMM-based (:attr:`_Convolution.
        exact_slices`) and padded, those of the same convolution on an input padded here
        instead (no padding left to oneDNN: its direct kernels take that), if they are not."""
        conv = _Convolution(self._lib, shape, self.layout)
        if conv.exact_slices or shape.padding == _NO_PADDING:
            return conv
        hp, wp = shape.padded_hw
        padded = ConvShape(shape.n, shape.c, hp, wp, shape.k, shape.kh, shape.kw, _NO_PADDING)
        direct = _Convolution(self._lib, padded, self.layout)
        return direct if direct.exact_slices else conv

    def _padded_input(self, x: np.ndarray, shape: ConvShape) -> np.ndarray:
        """``x`` zero-padded as ``shape`` says, in a buffer kept for the calling thread."""
        xp = self._scratch.get("onednn padded", (shape.n, shape.c, *shape.padded_hw), zero=True)
        rows, cols = shape.interior
        xp[:, :, rows, cols] = x
        return xp

    def _forward(self, x, w, b, shape):
        y = np.empty((shape.n, shape.k, *shape.out_hw), np.float32)
        conv = self._convolution(shape)
        bias = conv.zero_bias if b is None else b
        if conv.shape != shape:  # padded here: x is copied in
            x = self._padded_input(x, shape)
        conv.run("forward", {"src": x, "weights": w, "dst": y}, bias, self._scratch.get)
        return y

    def _grad_input(self, dy, w, shape):
        conv = self._convolution(shape)
        if conv.shape != shape:  # padded here: the padded input's gradient, cut out
            dxp = self._scratch.get("onednn padded", (shape.n, shape.c, *shape.padded_hw))
            conv.run("input", {"src": dxp, "weights": w, "dst": dy}, None, self._scratch.get)
            rows, cols = shape.interior
            return np.ascontiguousarray(dxp[:, :, rows, cols])
        dx = np.empty((shape.n, shape.c, shape.h, shape.w), np.float32)
        arrays = {"src": dx, "weights": w, "dst": dy}
        conv.run("input", arrays, None, self._scratch.get)
        return dx

    def _grad_kernels(self, x, dy, shape):
        dw = np.empty((shape.k, shape.c, shape.kh, shape.kw), np.float32)
        db = np.empty(shape.k, np.float32)
        conv = self._convolution(shape)
        if conv.shape != shape:  # padded here: x is copied in
            x = self._padded_input(x, shape)
        arrays = {"src": x, "weights": dw, "dst": dy}
        conv.run("kernels", arrays, db, self._scratch.get)
        return dw, db
