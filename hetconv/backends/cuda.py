"""The cuda backend: the array-module-generic convolutions of :mod:`.xpconv` run by CuPy on one
NVIDIA GPU, with host<->device copies overlapped with computation.

The arithmetic is not here: it is :mod:`.xpconv` with ``xp=cupy`` (im2col + one cuBLAS GEMM
per operation), the same code the tests run with ``xp=numpy`` on every machine. This module
adds only what is CUDA-specific:

* **Devices.** ``devices()`` lists the GPUs CuPy sees; ``device=N`` selects one, and all
  work of a call runs inside ``cupy.cuda.Device(N)``.
* **A pipeline over image chunks.** A call's images are split into up to
  ``pipeline_chunks`` chunks that alternate between two non-blocking streams. For each
  chunk the host copies it into that stream's pinned (page-locked) staging buffer, then
  queues, on the stream: the host->device copy, the convolution, and the device->host copy
  into a pinned output buffer. The copy engines run the upload of chunk i+1 and the download
  of chunk i-1 while the SMs compute chunk i. Before a stream's buffers are reused the host
  waits on the event recorded after that stream's previous chunk; only then does it move
  that chunk's result out of pinned memory (so the host copy-out also overlaps the GPU).
  Kernels and bias go up once per call, and the second stream waits on an event for them.
  The kernel gradient is accumulated per stream on the device and summed once at the end.
* **Memory.** :meth:`CudaBackend.working_set_bytes` is the device memory of two chunks in
  flight (from :func:`.xpconv.peak_values`) plus the kernels; the base class splits a batch
  whose working set exceeds the budget before the pipeline splits it further. The budget
  (``describe().memory_bytes``) is a fraction of the device memory free when the backend
  was created.
* **Device arrays.** The public operations also take arrays already on the GPU (cupy's) and
  answer there, with no pipeline and no copy, on the current stream; :meth:`CudaBackend.to_device`,
  :meth:`CudaBackend.to_host` (pinned memory from 1 MiB) and :attr:`CudaBackend.xp` let a whole
  stage run on the GPU (:mod:`hetconv.stages`): its input up once, every layer there, its answer
  down once.
* **The probe** (``time_step``) times device work with CUDA events on the GPU's clock, not
  the host's: see :meth:`CudaBackend.probe_clock` for exactly what it counts.

CuPy is imported lazily (module import needs only numpy), so the pure helper here
(:func:`pipelined_working_set_bytes`; the chunk split is :func:`.base.chunk_bounds`) and
``is_available()`` are tested on machines without CuPy or without a GPU;
``is_available()`` never raises.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from . import xpconv
from .arrays import on_host, register_array_module
from .base import (
    Backend,
    ConvShape,
    DeviceClock,
    DeviceInfo,
    _with_images,
    chunk_bounds,
)
from .checks import device_number

#: Default number of image chunks a call is pipelined in (two streams alternate over them).
DEFAULT_PIPELINE_CHUNKS = 4
#: Chunks in flight at once: one per stream.
STREAMS = 2
#: Device->host copies of at least this many bytes land in pinned host memory (from CuPy's
#: pinned pool, reused once freed): DMA at the link's speed instead of the driver's staging.
PINNED_FROM = 1 << 20
#: Share of the device memory free at construction that one call may use; the rest is
#: headroom for CuPy's pool rounding, cuBLAS workspaces and other users of the GPU.
MEMORY_FRACTION = 0.8

_INSTALL_HINT = "pip install 'hetconv[cuda]'; a GPU machine may need 'cupy-cuda12x[ctk]'"


# ------------------------------------------------------------------------------ pure helpers


def pipelined_working_set_bytes(shape: ConvShape, chunks: int) -> int:
    """Device bytes one pipelined call on ``shape`` needs: :data:`STREAMS` chunks of the
    largest chunk size in flight at once, each with :func:`.xpconv.workspace_values`, plus one
    per-stream kernel-gradient accumulator and bias accumulator (the kernels themselves are
    counted inside each chunk's workspace, which over-counts them by one copy).
    """
    bounds = chunk_bounds(shape.n, chunks)
    largest = max(stop - start for start, stop in bounds)
    in_flight = min(STREAMS, len(bounds))
    per_chunk = xpconv.workspace_values(_with_images(shape, largest))
    accumulators = in_flight * (shape.k * shape.c * shape.kh * shape.kw + shape.k)
    return 4 * (in_flight * per_chunk + accumulators)


# ----------------------------------------------------------------------------- cupy access


def _import_cupy() -> Any:
    """The cupy module; raises ImportError (or whatever importing it raises)."""
    return importlib.import_module("cupy")


@functools.lru_cache(maxsize=1)
def _availability() -> tuple[bool, str]:
    """(whether CuPy can compute on GPU 0 here, why not). Cached: it runs a smoke kernel."""
    try:
        cp = _import_cupy()
    except Exception as e:  # ImportError, or a broken install raising something else
        return False, f"cupy cannot be imported ({type(e).__name__}: {e}); {_INSTALL_HINT}"
    try:
        if not cp.cuda.is_available():
            return False, (
                f"cupy {cp.__version__} is installed but finds no usable CUDA GPU "
                "(cupy.cuda.is_available() is False: no GPU, no driver, or "
                "CUDA_VISIBLE_DEVICES hides them)"
            )
        count = int(cp.cuda.runtime.getDeviceCount())
        if count < 1:
            return False, "the CUDA runtime reports 0 devices"
    except Exception as e:
        return False, f"the CUDA runtime cannot be queried ({type(e).__name__}: {e})"
    try:
        # One elementwise kernel (needs NVRTC) and one GEMM (needs cuBLAS): what every
        # operation uses, so a missing toolkit library is reported here, not mid-training.
        with cp.cuda.Device(0):
            a = cp.arange(4, dtype=cp.float32).reshape(2, 2)
            got = float(cp.matmul(a * a, a).sum())
        if got != 54.0:
            return False, f"a CuPy smoke test on GPU 0 computed {got}, expected 54.0"
    except Exception as e:
        return False, (
            f"CuPy cannot run kernels on GPU 0 ({type(e).__name__}: {e}); {_INSTALL_HINT}"
        )
    return True, ""


def _device_info(cp: Any, device: int, memory_bytes: int | None = None) -> DeviceInfo:
    props = cp.cuda.runtime.getDeviceProperties(device)
    name = props["name"]
    if isinstance(name, bytes):
        name = name.decode("utf-8", errors="replace")
    return DeviceInfo(
        backend="cuda",
        kind="gpu",
        name=str(name).rstrip("\x00").strip() or f"CUDA device {device}",
        memory_bytes=int(props["totalGlobalMem"] if memory_bytes is None else memory_bytes),
        cores=int(props["multiProcessorCount"]),  # streaming multiprocessors
    )


def _to_device(device_array: Any, host: np.ndarray, stream: Any) -> None:
    """Queue the copy of ``host`` (pinned for it to be asynchronous) into ``device_array``."""
    device_array.set(host, stream=stream)


def _to_host(device_array: Any, host: np.ndarray, stream: Any) -> None:
    """Queue the copy of ``device_array`` into pinned ``host``; wait on ``stream`` before
    reading it."""
    device_array.get(stream=stream, out=host, blocking=False)


# -------------------------------------------------------------------------------- backend


class _Slot:
    """One stream of the pipeline, its pinned staging buffers, and the chunk it still owes."""

    def __init__(self, stream: Any):
        self.stream = stream
        self.buffers: dict[str, tuple[Any, np.ndarray]] = {}  # name -> (pinned memory, view)
        self.done: Any = None  # event recorded after this slot's last queued chunk
        self.deliver: tuple[np.ndarray, np.ndarray] | None = None  # (pinned result, target)


class _Span:
    """One operation's span on the GPU clock, for the probe: from an event recorded on the
    first stream before the operation's first upload to the latest of the events recorded
    after its downloads, on whichever stream."""

    def __init__(self, stream: Any):
        self.start = stream.record()
        self.ends: list[Any] = []

    def seconds(self, cp: Any) -> float:
        return max(cp.cuda.get_elapsed_time(self.start, end) for end in self.ends) / 1e3


class CudaBackend(Backend):
    """Convolutions on one NVIDIA GPU through CuPy (see the module docstring for the method).

    Args:
        device: CUDA device number, as :meth:`devices` orders them; None: device 0.
        pipeline_chunks: image chunks one call is split into to overlap copies with compute
            (1: no pipelining; more than the images in a call: one image per chunk).

    Raises:
        BackendUnavailable: CuPy is missing or cannot compute on a GPU here.
        ValueError: ``device`` is not a device number of this machine, or
            ``pipeline_chunks`` < 1.
    """

    name = "cuda"

    def __init__(self, device: int | None = None, pipeline_chunks: int = DEFAULT_PIPELINE_CHUNKS):
        ok, why = self.is_available()
        if not ok:
            from . import BackendUnavailable

            raise BackendUnavailable(f"backend cuda is not available here: {why}")
        if int(pipeline_chunks) < 1:
            raise ValueError(f"pipeline_chunks must be at least 1, got {pipeline_chunks}")
        cp = _import_cupy()
        count = int(cp.cuda.runtime.getDeviceCount())
        self._cp = cp
        self.device = device_number(
            "CUDA", 0 if device is None else device, count, lambda i: _device_info(cp, i).name
        )
        self.pipeline_chunks = int(pipeline_chunks)
        self._lock = threading.Lock()  # one call at a time: the slots' buffers are shared
        self._span: _Span | None = None  # the GPU-clock span of the call being probed
        with cp.cuda.Device(self.device):
            free, _total = cp.cuda.runtime.memGetInfo()
            free += cp.get_default_memory_pool().free_bytes()  # pooled blocks are reusable
            self._slots = [_Slot(cp.cuda.Stream(non_blocking=True)) for _ in range(STREAMS)]
        self._info = _device_info(cp, self.device, int(MEMORY_FRACTION * free))
        register_array_module(cp.ndarray, cp)  # layers take cupy's module from its arrays

    # -- contract ------------------------------------------------------------------------------

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        """(True, "") when CuPy imports and can run a kernel and a GEMM on GPU 0; otherwise
        (False, why). Never raises; the answer is cached for the process."""
        return _availability()

    @classmethod
    def devices(cls) -> list[DeviceInfo]:
        """Every GPU CuPy sees, numbered as ``device=`` takes them, with its total memory
        and its number of streaming multiprocessors as ``cores``; [] when unavailable."""
        if not cls.is_available()[0]:
            return []
        cp = _import_cupy()
        return [_device_info(cp, i) for i in range(int(cp.cuda.runtime.getDeviceCount()))]

    def describe(self) -> DeviceInfo:
        """This backend's GPU. ``memory_bytes`` is what one call may use:
        :data:`MEMORY_FRACTION` of the memory that was free when the backend was created."""
        return self._info

    def working_set_bytes(self, shape: ConvShape) -> int:
        return pipelined_working_set_bytes(shape, self.pipeline_chunks)

    def synchronize(self) -> None:
        """Wait for all work queued on this backend's GPU (the operations already wait for
        their own results; this is for timing code that queues more)."""
        self._cp.cuda.Device(self.device).synchronize()

    def probe_clock(self) -> DeviceClock:
        """The probe (:meth:`time_step`) reads the GPU's clock (CUDA events), not the host's.

        Each operation counts its span on the GPU clock: from an event recorded on the first
        stream before its first upload (kernels, bias) to the latest of the events recorded
        on either stream after each chunk's download (for the kernel gradient: after the
        download of the summed gradients). So it counts the uploads, kernels and downloads a
        real call pays, transfers that overlap computation once, and any moment within the
        span the GPU waited for the host (staging the next chunk in pinned memory). Not
        counted: the argument checks and batch split before the first upload, and moving the
        last results out of pinned memory after the GPU is done.
        """
        return DeviceClock(self)

    @contextlib.contextmanager
    def _timed(self) -> Iterator[None]:
        """Around one operation, inside its lock and device: when a probe's clock is open in
        this thread, measure the operation's :class:`_Span` and charge it to the clock."""
        if not self._device_clock_open():
            yield
            return
        self._span = _Span(self._slots[0].stream)
        for slot in self._slots[1:]:  # nothing of the operation may start before the span
            slot.stream.wait_event(self._span.start)
        try:
            yield
            seconds = self._span.seconds(self._cp)
        finally:
            self._span = None
        self._charge_device_time(seconds)

    def gemm_gflops(self, size: int = 4096, repeats: int = 3) -> float:
        """cuBLAS SGEMM speed (``cupy.matmul``) on ``size``-square matrices on this GPU."""
        cp = self._cp
        with cp.cuda.Device(self.device):
            a = cp.random.standard_normal((size, size), dtype=cp.float32)
            b = cp.random.standard_normal((size, size), dtype=cp.float32)
            out = cp.matmul(a, b)
            best = float("inf")
            for _ in range(max(1, repeats)):
                start, stop = cp.cuda.Event(), cp.cuda.Event()
                start.record()
                cp.matmul(a, b, out=out)
                stop.record()
                stop.synchronize()
                best = min(best, cp.cuda.get_elapsed_time(start, stop) / 1e3)
        return 2 * size**3 / best / 1e9

    # -- device arrays: a whole stage on the GPU ---------------------------------------------

    @property
    def xp(self) -> Any:
        """CuPy: the module of this backend's device arrays."""
        return self._cp

    @property
    def on_device(self) -> bool:
        return True

    def scope(self) -> contextlib.AbstractContextManager:
        """This backend's GPU as the current device (device arrays are allocated there)."""
        return self._cp.cuda.Device(self.device)

    def to_device(self, a: Any) -> Any:
        """``a`` copied to this backend's GPU (one host->device copy on the current stream); a
        device array stays as it is."""
        if not on_host(a):
            return a
        with self.scope():
            return self._cp.asarray(a)

    def to_host(self, a: Any) -> np.ndarray:
        """``a`` copied to the host (a numpy array stays as it is): into pinned memory from
        CuPy's pinned pool when it is :data:`PINNED_FROM` bytes or more, so the copy runs at
        the link's speed; the array keeps its pinned block until it is freed."""
        if on_host(a):
            return a
        with self.scope():
            if a.nbytes < PINNED_FROM:
                return a.get()
            memory = self._cp.cuda.alloc_pinned_memory(a.nbytes)
            host = np.frombuffer(memory, a.dtype, a.size).reshape(a.shape)
            a.get(out=host)
            return host

    def _on_device(self, operation: Callable[..., Any], shape: ConvShape, *arrays: Any) -> Any:
        """``operation`` of :mod:`.xpconv` on device arrays, on the current stream: no
        pipeline, no copies (an argument still on the host is uploaded first)."""
        with self._lock, self.scope():
            on_gpu = [None if a is None else self.to_device(a) for a in arrays]
            return operation(self._cp, *on_gpu, shape)

    # -- the pipeline ------------------------------------------------------------------------

    def _staging(self, slot: _Slot, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """A pinned float32 host buffer of ``shape`` owned by ``slot`` (grown, then reused)."""
        size = int(np.prod(shape))
        held = slot.buffers.get(name)
        if held is None or held[1].size < size:
            memory = self._cp.cuda.alloc_pinned_memory(4 * size)
            held = (memory, np.frombuffer(memory, np.float32, size))
            slot.buffers[name] = held
        return held[1][:size].reshape(shape)

    def _settle(self, slot: _Slot) -> None:
        """Wait for the slot's last chunk; hand its result from pinned memory to its target."""
        if slot.done is not None:
            slot.done.synchronize()
            slot.done = None
        if slot.deliver is not None:
            pinned, target = slot.deliver
            np.copyto(target, pinned)
            slot.deliver = None

    def _pipeline(
        self,
        shape: ConvShape,
        inputs: tuple[np.ndarray, ...],
        compute: Callable[..., Any],
        out: np.ndarray | None,
    ) -> None:
        """Run ``compute(slot_index, chunk_shape, *device_chunks)`` over image chunks.

        Each array of ``inputs`` (leading axis: images) is uploaded chunk by chunk through the
        slot's pinned buffers; when ``out`` is given, ``compute`` returns the chunk's device
        result, which is downloaded into ``out``'s rows of that chunk. Returns when every
        chunk is done and delivered.
        """
        cp = self._cp
        try:
            for index, (start, stop) in enumerate(chunk_bounds(shape.n, self.pipeline_chunks)):
                slot_index = index % len(self._slots)
                slot = self._slots[slot_index]
                self._settle(slot)  # its pinned buffers are free again after this
                chunk = _with_images(shape, stop - start)
                with slot.stream:
                    on_device = []
                    for position, host in enumerate(inputs):
                        staged = self._staging(slot, f"in{position}", (chunk.n, *host.shape[1:]))
                        np.copyto(staged, host[start:stop])
                        device_array = cp.empty(staged.shape, dtype=cp.float32)
                        _to_device(device_array, staged, slot.stream)
                        on_device.append(device_array)
                    result = compute(slot_index, chunk, *on_device)
                    if out is not None:
                        pinned = self._staging(slot, "out", tuple(result.shape))
                        _to_host(result, pinned, slot.stream)
                        slot.deliver = (pinned, out[start:stop])
                    slot.done = slot.stream.record()
                    if self._span is not None:
                        self._span.ends.append(slot.done)
        finally:  # also after an error: no stream may still use buffers or freed arrays
            for slot in self._slots:
                try:
                    self._settle(slot)
                except Exception:  # noqa: BLE001 - the first error is the one to report
                    slot.done = slot.deliver = None

    def _upload_constants(self, *arrays: np.ndarray | None) -> list[Any]:
        """Kernels/bias to the device on the first stream; the other streams wait for them."""
        first = self._slots[0].stream
        with first:
            uploaded = [None if a is None else self._cp.asarray(a) for a in arrays]
            ready = first.record()
        for slot in self._slots[1:]:
            slot.stream.wait_event(ready)
        return uploaded

    # -- the three operations ----------------------------------------------------------------

    def _forward(self, x, w, b, shape):
        if not on_host(x):
            return self._on_device(xpconv.forward, shape, x, w, b)
        ho, wo = shape.out_hw
        y = np.empty((shape.n, shape.k, ho, wo), np.float32)
        with self._lock, self._cp.cuda.Device(self.device), self._timed():
            w_dev, b_dev = self._upload_constants(w, b)

            def compute(_slot, chunk, x_dev):
                return xpconv.forward(self._cp, x_dev, w_dev, b_dev, chunk)

            self._pipeline(shape, (x,), compute, y)
        return y

    def _grad_input(self, dy, w, shape):
        if not on_host(dy):
            return self._on_device(xpconv.grad_input, shape, dy, w)
        dx = np.empty((shape.n, shape.c, shape.h, shape.w), np.float32)
        with self._lock, self._cp.cuda.Device(self.device), self._timed():
            (w_dev,) = self._upload_constants(w)

            def compute(_slot, chunk, dy_dev):
                return xpconv.grad_input(self._cp, dy_dev, w_dev, chunk)

            self._pipeline(shape, (dy,), compute, dx)
        return dx

    def _grad_kernels(self, x, dy, shape):
        if not on_host(x):
            return self._on_device(xpconv.grad_kernels, shape, x, dy)
        cp = self._cp
        with self._lock, cp.cuda.Device(self.device), self._timed():
            sums: list[list[Any] | None] = [None] * len(self._slots)

            def compute(slot, chunk, x_dev, dy_dev):
                dw, db = xpconv.grad_kernels(cp, x_dev, dy_dev, chunk)
                if sums[slot] is None:
                    sums[slot] = [dw, db]
                else:  # queued on the same stream as the previous chunk's sum: ordered
                    sums[slot][0] += dw
                    sums[slot][1] += db

            self._pipeline(shape, (x, dy), compute, None)
            # Every stream is idle now; sum the per-stream partials in a fixed order.
            used = [s for s in sums if s is not None]
            first = self._slots[0]
            with first.stream:
                dw_dev, db_dev = used[0]
                for more_dw, more_db in used[1:]:
                    dw_dev = dw_dev + more_dw
                    db_dev = db_dev + more_db
                dw = np.empty((shape.k, shape.c, shape.kh, shape.kw), np.float32)
                db = np.empty(shape.k, np.float32)
                dw_pinned = self._staging(first, "dw", dw.shape)
                db_pinned = self._staging(first, "db", db.shape)
                _to_host(dw_dev, dw_pinned, first.stream)
                _to_host(db_dev, db_pinned, first.stream)
                if self._span is not None:
                    self._span.ends.append(first.stream.record())
                first.stream.synchronize()
            np.copyto(dw, dw_pinned)
            np.copyto(db, db_pinned)
        return dw, db
