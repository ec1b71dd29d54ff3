"""oneDNN's C API through ctypes, what the onednn backend (:mod:`.onednn`) calls: the library
loaded once per process (:func:`library`), its primitives, memories and reorders.

The library is looked for in ``$HETCONV_ONEDNN_LIB`` (a file path), then next to the Python
environment (``<sys.prefix>/lib``, where pip puts it), then by the system loader.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading

import numpy as np

LIBRARY = "libdnnl.so.3"
ENV_LIBRARY = "HETCONV_ONEDNN_LIB"
#: Its wheel (onednn-cpu-gomp) is one of hetconv's dependencies where it is built.
INSTALL_HINT = "hetconv installs it on Linux x86-64 (pip install 'hetconv[onednn]' there)"

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
            "dnnl_memory_set_data_handle": [_p, _p],
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
        """OpenMP threads of the calling thread's next parallel regions, set every time (about
        a microsecond): others set them too, behind this library's back. threadpoolctl's
        limits (an embedded cluster giving its workers the cores) set one thread and restore
        the count on leaving; remembering what was set here had oneDNN's kernel gradients run
        on two threads after that, and a kernel slice's then differed from the whole layer's
        rows by round-off."""
        self.omp_set_num_threads(threads)

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

    def destroy(self) -> None:
        self.lib.dll.dnnl_primitive_destroy(self.primitive)
        self.lib.dll.dnnl_primitive_desc_destroy(self.pd)


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


#: The arguments a primitive writes: their blocked copies are reordered back after it runs.
_OUTPUTS = (_ARG_DST, _ARG_DIFF_SRC, _ARG_DIFF_WEIGHTS)


class _Bound:
    """One operation of a convolution as one thread runs it: its reorders into the blocked
    layouts, its primitive and its reorders back, with their memory objects made once (a
    memory object is used by one thread at a time) and their argument tables built once. A
    call points the memories at its arrays and at the thread's scratch buffers
    (``dnnl_memory_set_data_handle``) and executes: making and destroying the memories every
    call, with their tables, cost 40-60 us of Python a call (one thread; a 1x1 forward's
    oneDNN work is 10-30 us).

    Args:
        lib: the library.
        primitive: the operation's :class:`_Primitive`.
        roles: (role, argument, plain descriptor, :class:`_Reorder` or None) of each tensor.
        bias: (descriptor, argument) of the bias or its gradient, or None.
        owned: where the memories made are listed, for their owner to destroy.
    """

    def __init__(self, lib: _Library, primitive: _Primitive, roles, bias, owned: list):
        self.lib, self.owned = lib, owned
        self.arrays: list[tuple[ctypes.c_void_p, str]] = []  # (memory, role or "bias")
        self.buffers: dict[str, tuple[int, list]] = {}  # scratch name -> (bytes, memories)
        into, args, back = [], [], []
        for role, arg, plain_md, reorder in roles:
            plain = self._memory(plain_md)
            self.arrays.append((plain, role))
            if reorder is None:
                args.append((arg, plain))
                continue
            blocked = self._memory(reorder.blocked)
            self._buffer(f"onednn {role}", reorder.bytes, blocked)
            args.append((arg, blocked))
            if arg in _OUTPUTS:
                back.append(self._step(reorder.back, [(_ARG_SRC, blocked), (_ARG_DST, plain)]))
            else:
                into.append(self._step(reorder.into, [(_ARG_SRC, plain), (_ARG_DST, blocked)]))
        if bias is not None:
            memory = self._memory(bias[0])
            self.arrays.append((memory, "bias"))
            args.append((bias[1], memory))
        self.steps = [*into, self._step(primitive, args), *back]

    def _memory(self, md) -> ctypes.c_void_p:
        memory = _p()
        created = self.lib.dll.dnnl_memory_create(ctypes.byref(memory), md, self.lib.engine, None)
        self.lib.check(created, "memory_create")
        self.owned.append(memory)
        return memory

    def _buffer(self, name: str, nbytes: int, memory) -> None:
        """``memory`` is to lie in the thread's scratch buffer ``name`` (the largest of its
        users' sizes: one buffer serves them in turn)."""
        size, memories = self.buffers.get(name, (0, []))
        self.buffers[name] = (max(size, nbytes), [*memories, memory])

    def _step(self, primitive: _Primitive, args: list) -> tuple:
        if primitive.scratchpad_bytes:
            pad = self._memory(primitive.scratchpad)
            self._buffer("onednn scratchpad", primitive.scratchpad_bytes, pad)
            args = [*args, (_ARG_SCRATCHPAD, pad)]
        table = (_ExecArg * len(args))(*(_ExecArg(a, m) for a, m in args))
        return primitive.primitive, len(args), table, primitive.implementation

    def run(self, arrays: dict[str, np.ndarray], scratch) -> None:
        """Execute on the plain arrays of each role (``"bias"`` too where bound), the blocked
        copies in the calling thread's buffers (``scratch.address(name, nbytes)``)."""
        d = self.lib.dll
        point = d.dnnl_memory_set_data_handle
        failed = 0
        for memory, role in self.arrays:
            failed |= point(memory, arrays[role].ctypes.data)
        for name, (nbytes, memories) in self.buffers.items():
            address = scratch.address(name, nbytes)
            for memory in memories:
                failed |= point(memory, address)
        self.lib.check(failed, "memory_set_data_handle")
        stream = self.lib.stream()
        for primitive, count, table, implementation in self.steps:
            status = d.dnnl_primitive_execute(primitive, stream, count, table)
            if status != _SUCCESS:
                self.lib.check(status, f"execute ({implementation})")
