"""The opencl backend: convolutions as implicit GEMMs in tiled, local-memory OpenCL kernels.

The kernels, their tilings and the launch arithmetic are in :mod:`.opencl_kernels` (which
needs no pyopencl); this module finds the devices, builds the program, moves the data and
launches the kernels.

No device memory is needed beyond inputs, kernels and outputs (plus the split-K partial sums),
which :meth:`OpenCLBackend.working_set_bytes` reports. The program does not depend on the
geometry: it is built once per device and kept for every backend on that device.

The command queue has profiling enabled: every upload, kernel and download is an event the
device timestamps. :attr:`OpenCLBackend.device_seconds` and :attr:`OpenCLBackend.transfer_seconds`
add them up, and the probe (``time_step``) reads them instead of the host's clock (see
:meth:`OpenCLBackend.probe_clock`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import opencl_kernels
from .base import (
    Backend,
    ConvShape,
    DeviceClock,
    DeviceInfo,
    _with_images,
)
from .checks import check_contiguous, check_float32, device_number

try:
    import pyopencl as cl
except Exception as error:  # ImportError, or a broken OpenCL loader under it
    cl = None
    _IMPORT_ERROR: Exception | None = error
else:
    _IMPORT_ERROR = None

# Largest buffer the kernels may index: they use 32-bit int element offsets.
_INT_INDEX_BYTES = 4 * (2**31 - 1)

# ----------------------------------------------------------------------------- devices


def _kind(device: Any) -> str:
    if device.type & cl.device_type.GPU:
        return "gpu"
    if device.type & cl.device_type.CPU:
        return "cpu"
    return "accelerator"  # ACCELERATOR, CUSTOM


def _all_devices() -> list[tuple[Any, Any]]:
    """(platform, device) for every device of every platform. Platforms are sorted by name,
    vendor and version (the ICD loader's own order may change between runs); devices keep
    their platform's order. Raises what pyopencl raises when there is no platform."""
    platforms = cl.get_platforms()
    order = sorted(
        range(len(platforms)),
        key=lambda i: (platforms[i].name, platforms[i].vendor, platforms[i].version, i),
    )
    found = []
    for i in order:
        try:
            devices = platforms[i].get_devices()
        except cl.Error:  # a platform with no device raises DEVICE_NOT_FOUND
            continue
        found.extend((platforms[i], device) for device in devices)
    return found


def _device_info(index: int, platform: Any, device: Any) -> DeviceInfo:
    return DeviceInfo(
        backend="opencl",
        kind=_kind(device),
        name=f"{device.name.strip()} ({platform.name.strip()}, opencl device {index})",
        memory_bytes=int(device.global_mem_size),
        cores=int(device.max_compute_units),
    )


def _preference_order(infos: list[DeviceInfo]) -> list[int]:
    """Device numbers, best first: GPUs before accelerators before CPUs; among equals the most
    compute units, then the lowest number."""
    rank = {"gpu": 0, "accelerator": 1, "cpu": 2}
    return sorted(range(len(infos)), key=lambda i: (rank[infos[i].kind], -infos[i].cores, i))


def _default_device(infos: list[DeviceInfo]) -> int:
    """The most preferred device (see :func:`_preference_order`), whether or not it builds."""
    return _preference_order(infos)[0]


def _compiler_says(error: Exception) -> str:
    """The compiler's own error lines from a failed build (its log repeats them per try)."""
    lines = [line.strip() for line in str(error).splitlines()]
    errors = list(dict.fromkeys(line for line in lines if line.startswith("error:")))
    return "build failed: " + ("; ".join(errors) if errors else lines[0][:300])


class DeviceCannotBuild(RuntimeError):
    """The device's OpenCL compiler rejects the kernels (a broken or too old driver: PoCL 3.0
    bundled with pyopencl's wheels, for one, knows no target for some virtual CPUs)."""


@dataclass
class _Compiled:
    """The context and built program of one device, shared by every backend on it."""

    context: Any
    program: Any
    tiling: opencl_kernels.Tiling


class OpenCLBackend(Backend):
    """Convolutions on an OpenCL device (see the module docstring for the kernels).

    Args:
        device: number of the device in :meth:`devices` order; None picks a GPU before an
            accelerator before a CPU, the one with the most compute units among equals.

    Raises:
        ValueError: ``device`` is not a valid device number.

    .. note::
        Sums run in float32 in a different order from the cpu backend's BLAS; results agree
        with it to float32 round-off (the tests allow ``1e-5 * max|result|``).
    """

    name = "opencl"

    #: device key -> built program, shared by all instances: building costs ~0.7 s on PoCL.
    _compiled: dict[tuple[int, int], _Compiled] = {}
    #: device key -> why its compiler failed (a failed build is not tried again).
    _cannot_build: dict[tuple[int, int], str] = {}
    _compile_lock = threading.Lock()
    #: How many programs this process has built (the kernel-cache test reads it).
    builds = 0

    def __init__(self, device: int | None = None):
        ok, why = self.is_available()
        if not ok:
            from . import BackendUnavailable

            raise BackendUnavailable(f"backend opencl is not available here: {why}")
        found = _all_devices()
        infos = [_device_info(i, p, d) for i, (p, d) in enumerate(found)]
        if device is None:
            device = self._first_that_builds(found, infos)
        self.device_index = device_number("OpenCL", device, len(found), lambda i: infos[i].name)
        self._platform, self._device = found[self.device_index]
        self._info = infos[self.device_index]
        self._max_alloc = min(int(self._device.max_mem_alloc_size), _INT_INDEX_BYTES)
        try:
            compiled = self._compile(self._platform, self._device)
        except DeviceCannotBuild as error:
            from . import BackendUnavailable

            raise BackendUnavailable(
                f"OpenCL device {self.device_index} ({self._info.name}) cannot run hetconv: {error}"
            ) from None
        self._context = compiled.context
        self._tiling = compiled.tiling
        self._queue = cl.CommandQueue(
            self._context, self._device, properties=cl.command_queue_properties.PROFILING_ENABLE
        )
        # Own kernel objects: setting arguments on a shared one would race between threads.
        names = opencl_kernels.KERNEL_NAMES
        self._kernels = {name: cl.Kernel(compiled.program, name) for name in names}
        self._lock = threading.Lock()
        #: Device seconds spent in kernels by this backend so far (from queue profiling;
        #: transfers excluded). The difference around a call is that call's kernel time.
        self.device_seconds = 0.0
        #: Device seconds spent in host<->device copies by this backend so far (from queue
        #: profiling, like :attr:`device_seconds`).
        self.transfer_seconds = 0.0

    # -- contract ------------------------------------------------------------------------

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        if cl is None:
            return False, f"pyopencl cannot be imported: {_IMPORT_ERROR}"
        try:
            found = _all_devices()
        except Exception as error:  # pyopencl raises when there is no platform at all
            return False, f"no OpenCL platform: {error}"
        if not found:
            return False, "no OpenCL device on any platform"
        try:
            cls._first_that_builds(found, [_device_info(i, p, d) for i, (p, d) in enumerate(found)])
        except DeviceCannotBuild as error:
            return False, str(error)
        return True, ""

    @classmethod
    def _first_that_builds(cls, found: list[tuple[Any, Any]], infos: list[DeviceInfo]) -> int:
        """The most preferred device whose compiler builds the kernels (each device is built
        once per process; the built program is kept for the backends that use it).

        Raises:
            DeviceCannotBuild: no device builds them; the message says why for each.
        """
        reasons = []
        for number in _preference_order(infos):
            try:
                cls._compile(*found[number])
            except DeviceCannotBuild as error:
                reasons.append(f"device {number}: {error}")
                continue
            return number
        raise DeviceCannotBuild("no OpenCL device builds the kernels: " + " | ".join(reasons))

    @classmethod
    def devices(cls) -> list[DeviceInfo]:
        """Every device of every platform (see :func:`_all_devices` for the order); empty
        when OpenCL is not available."""
        ok, _ = cls.is_available()
        if not ok:
            return []
        return [_device_info(i, p, d) for i, (p, d) in enumerate(_all_devices())]

    def describe(self) -> DeviceInfo:
        return self._info

    def synchronize(self) -> None:
        self._queue.finish()

    def probe_clock(self) -> DeviceClock:
        """The probe (:meth:`time_step`) reads the device's profiling timestamps, never the
        host's clock: the sum, over every command the step's calls enqueue, of its
        ``profile.end - profile.start`` -- the uploads of inputs, kernels and bias, the GEMM,
        split-K sum and bias-gradient kernels, and the downloads of the results. The queue
        is in order, so the commands never overlap and the sum is their device time. Not
        counted: argument checks, buffer allocation, setting kernel arguments, and the time
        commands wait in the queue before the device starts them."""
        return DeviceClock(self)

    def working_set_bytes(self, shape: ConvShape) -> int:
        """Inputs, kernels, outputs and bias, plus the kernel gradient's split-K partial sums;
        no lowered copy of the input is ever made."""
        ho, wo = shape.out_hw
        kernel_values = shape.k * shape.c * shape.kh * shape.kw
        slices = self._grad_kernel_split(shape)[0]
        values = (
            shape.n * shape.c * shape.h * shape.w
            + shape.n * shape.k * ho * wo
            + kernel_values
            + shape.k
            + (kernel_values * slices if slices > 1 else 0)
        )
        return 4 * values

    def _images_per_call(self, shape: ConvShape) -> int:
        """The base's memory budget, and also no single buffer larger than the device allows
        in one allocation (nor than 32-bit indexing reaches)."""
        images = super()._images_per_call(shape)
        ho, wo = shape.out_hw
        per_image = 4 * max(shape.c * shape.h * shape.w, shape.k * ho * wo)
        fixed = 4 * shape.k * shape.c * shape.kh * shape.kw
        fixed *= self._grad_kernel_split(_with_images(shape, images))[0]
        if max(per_image, fixed) > self._max_alloc:
            raise MemoryError(
                f"{shape} needs a {max(per_image, fixed) / 2**20:.1f} MiB buffer, more than the "
                f"{self._max_alloc / 2**20:.1f} MiB one allocation may take on {self._info.name}"
            )
        return max(1, min(images, self._max_alloc // per_image))

    # -- building ------------------------------------------------------------------------

    @classmethod
    def _compile(cls, platform: Any, device: Any) -> _Compiled:
        key = (platform.int_ptr, device.int_ptr)
        with cls._compile_lock:
            if key in cls._cannot_build:
                raise DeviceCannotBuild(cls._cannot_build[key])
            compiled = cls._compiled.get(key)
            if compiled is None:
                try:
                    compiled = cls._build(device)
                except DeviceCannotBuild as error:
                    cls._cannot_build[key] = str(error)
                    raise
                cls._compiled[key] = compiled
            return compiled

    @classmethod
    def _build(cls, device: Any) -> _Compiled:
        context = cl.Context([device])
        source = opencl_kernels.program_source()
        failures = []
        sizes = device.max_work_item_sizes
        for tiling in opencl_kernels.tilings(_kind(device)):
            if (
                tiling.items > device.max_work_group_size
                or tiling.rn > sizes[0]
                or tiling.rm > sizes[1]
                or tiling.local_bytes > device.local_mem_size
            ):
                failures.append(f"{tiling}: exceeds the device's work-group or local memory")
                continue
            try:
                program = cl.Program(context, source).build(options=tiling.defines())
            except cl.Error as error:
                failures.append(f"{tiling}: {_compiler_says(error)}")
                continue
            finally:
                cls.builds += 1
            limit = min(
                cl.Kernel(program, name).get_work_group_info(
                    cl.kernel_work_group_info.WORK_GROUP_SIZE, device
                )
                for name in ("conv_forward", "conv_grad_input", "conv_grad_kernels")
            )
            if limit >= tiling.items:
                return _Compiled(context, program, tiling)
            failures.append(f"{tiling}: kernels allow only {limit} work-items per group")
        if len({failure.split(": ", 1)[1] for failure in failures}) == 1:  # one cause for all
            failures = [f"every tiling: {failures[0].split(': ', 1)[1]}"]
        raise DeviceCannotBuild(
            f"no tiling of the OpenCL kernels runs on {device.name.strip()}: " + "; ".join(failures)
        )

    # -- helpers -------------------------------------------------------------------------

    def _upload(self, events: list, **arrays: np.ndarray | None) -> list[Any]:
        """Read-only device copies of ``arrays`` (None stays None, a null buffer), their copy
        events appended to ``events``. Every array is checked to be float32 and C-contiguous
        before the first buffer is made (the base class checked the public call's arguments;
        this guards the kernels' raw reads on every path to them)."""
        for key, a in arrays.items():
            if a is not None:
                check_float32(key.replace("_", " "), a)
                check_contiguous(key.replace("_", " "), a)
        buffers = []
        for a in arrays.values():
            if a is None:
                buffers.append(None)
                continue
            buffer = cl.Buffer(self._context, cl.mem_flags.READ_ONLY, a.nbytes)
            events.append(cl.enqueue_copy(self._queue, buffer, a, is_blocking=False))
            buffers.append(buffer)
        return buffers

    def _output(self, values: int) -> Any:
        return cl.Buffer(self._context, cl.mem_flags.READ_WRITE, 4 * max(1, values))

    def _download(self, buffer: Any, shape: tuple[int, ...], events: list) -> np.ndarray:
        out = np.empty(shape, np.float32)
        events.append(cl.enqueue_copy(self._queue, out, buffer, is_blocking=True))
        return out

    def _geometry(self, shape: ConvShape, k_slice: int) -> list[np.int32]:
        ho, wo = shape.out_hw
        p = shape.padding
        values = (shape.n, shape.c, shape.h, shape.w, shape.k, shape.kh, shape.kw)
        return [np.int32(v) for v in (*values, p.top, p.left, ho, wo, k_slice)]

    def _run_gemm(
        self, name: str, buffers: list, rows: int, cols: int, slices: int, shape, k_slice: int
    ) -> Any:
        global_size, local_size = self._tiling.gemm_ndrange(rows, cols, slices)
        kernel = self._kernels[name]
        kernel.set_args(*buffers, *self._geometry(shape, k_slice))
        return cl.enqueue_nd_range_kernel(self._queue, kernel, global_size, local_size)

    def _grad_kernel_split(self, shape: ConvShape) -> tuple[int, int]:
        """(slices, terms per slice) of the kernel gradient's depth on this device."""
        return opencl_kernels.grad_kernel_split(shape, self._tiling, self._info.cores)

    def _account(self, kernel_events: list, transfer_events: list) -> None:
        """Wait for the events; add their device-measured durations to
        :attr:`device_seconds`, :attr:`transfer_seconds` and any probe clock open here."""
        spent = []
        for events in (kernel_events, transfer_events):
            seconds = 0.0
            for event in events:
                event.wait()
                seconds += (event.profile.end - event.profile.start) * 1e-9
            spent.append(seconds)
        self.device_seconds += spent[0]
        self.transfer_seconds += spent[1]
        self._charge_device_time(spent[0] + spent[1])

    # -- the three operations ------------------------------------------------------------

    def _forward(self, x, w, b, shape):
        ho, wo = shape.out_hw
        transfers: list = []
        with self._lock:
            x_buf, w_buf, b_buf = self._upload(transfers, input=x, kernels=w, bias=b)
            y_buf = self._output(shape.n * shape.k * ho * wo)
            event = self._run_gemm(
                "conv_forward",
                [x_buf, w_buf, b_buf, y_buf, np.int32(b is not None)],
                shape.k,
                shape.n * ho * wo,
                1,
                shape,
                shape.c * shape.kh * shape.kw,
            )
            y = self._download(y_buf, (shape.n, shape.k, ho, wo), transfers)
            self._account([event], transfers)
        return y

    def _grad_input(self, dy, w, shape):
        transfers: list = []
        with self._lock:
            dy_buf, w_buf = self._upload(transfers, output_gradient=dy, kernels=w)
            dx_buf = self._output(shape.n * shape.c * shape.h * shape.w)
            event = self._run_gemm(
                "conv_grad_input",
                [dy_buf, w_buf, dx_buf],
                shape.c,
                shape.n * shape.h * shape.w,
                1,
                shape,
                shape.k * shape.kh * shape.kw,
            )
            dx = self._download(dx_buf, (shape.n, shape.c, shape.h, shape.w), transfers)
            self._account([event], transfers)
        return dx

    def _grad_kernels(self, x, dy, shape):
        ho, wo = shape.out_hw
        taps = shape.c * shape.kh * shape.kw
        size = shape.k * taps
        slices, k_slice = self._grad_kernel_split(shape)
        group = self._tiling.reduce_group
        transfers: list = []
        with self._lock:
            x_buf, dy_buf = self._upload(transfers, input=x, output_gradient=dy)
            dw_buf = self._output(size)
            partial_buf = self._output(slices * size) if slices > 1 else dw_buf
            db_buf = self._output(shape.k)
            events = [
                self._run_gemm(
                    "conv_grad_kernels",
                    [x_buf, dy_buf, partial_buf],
                    shape.k,
                    taps,
                    slices,
                    shape,
                    k_slice,
                )
            ]
            if slices > 1:
                kernel = self._kernels["sum_slices"]
                kernel.set_args(partial_buf, dw_buf, np.int32(slices), np.int32(size))
                global_size = (-(-size // group) * group,)
                events.append(
                    cl.enqueue_nd_range_kernel(self._queue, kernel, global_size, (group,))
                )
            kernel = self._kernels["bias_grad"]
            kernel.set_args(dy_buf, db_buf, np.int32(shape.n), np.int32(shape.k), np.int32(ho * wo))
            events.append(
                cl.enqueue_nd_range_kernel(self._queue, kernel, (shape.k * group,), (group,))
            )
            dw = self._download(dw_buf, (shape.k, shape.c, shape.kh, shape.kw), transfers)
            db = self._download(db_buf, (shape.k,), transfers)
            self._account(events, transfers)
        return dw, db
