"""The opencl backend: convolutions as implicit GEMMs in tiled, local-memory OpenCL kernels.

Each of the three operations is one matrix product whose second operand is the lowered
(im2col) input, but the lowering is never written out: a work-group stages a TK-deep slice of
both operands in local memory, reading the input through the im2col index arithmetic (zero
outside the image, so padding costs no copy), and every work-item accumulates a WM x WN block
of outputs in registers (the register-blocked SGEMM of Nugteren's "myGEMM" tutorial, kernel 6).

=============  ===========  =================  =====================  ====================
operation      rows (M)     columns            depth (summed over)    lowered operand
=============  ===========  =================  =====================  ====================
forward        K kernels    N*Ho*Wo positions  C*kh*kw taps           input, im2col
grad input     C channels   N*H*W pixels       K*kh*kw taps           output grad, "full"
grad kernels   K kernels    C*kh*kw taps       N*Ho*Wo positions      input, im2col
=============  ===========  =================  =====================  ====================

The input gradient is a "full" correlation of the output gradient with the flipped kernels,
so it gathers (no col2im scatter, no atomics). The kernel gradient has few outputs and a long
sum; it is split over the depth (split-K) until the device has enough work-groups, and the
slices are summed by a second kernel. The bias gradient is a work-group tree reduction.

No device memory is needed beyond inputs, kernels and outputs (plus the split-K partial sums),
which :meth:`OpenCLBackend.working_set_bytes` reports. The program does not depend on the
geometry: it is built once per device and kept for every backend on that device.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from string import Template
from typing import Any

import numpy as np

from .base import Backend, ConvShape, DeviceInfo, _with_images

try:
    import pyopencl as cl
except Exception as error:  # ImportError, or a broken OpenCL loader under it
    cl = None
    _IMPORT_ERROR: Exception | None = error
else:
    _IMPORT_ERROR = None

# Largest buffer the kernels may index: they use 32-bit int element offsets.
_INT_INDEX_BYTES = 4 * (2**31 - 1)
# Split the kernel-gradient sum until there are this many work-groups per compute unit.
_GROUPS_PER_COMPUTE_UNIT = 4
_MAX_SLICES = 64


@dataclass(frozen=True)
class _Tiling:
    """Work-group shape of the GEMM kernels: an RN x RM grid of work-items, each computing
    WM x WN outputs, so a work-group computes a (RM*WM) x (RN*WN) tile, TK terms at a time."""

    rm: int
    rn: int
    wm: int
    wn: int
    tk: int

    def __post_init__(self) -> None:
        # The tile loaders give every work-item the same number of values of each operand.
        items = self.items
        if items % self.tk or items % self.tile_n or (self.tile_m * self.tk) % items:
            raise ValueError(f"{self} does not split its tiles evenly over {items} work-items")

    @property
    def tile_m(self) -> int:
        return self.rm * self.wm

    @property
    def tile_n(self) -> int:
        return self.rn * self.wn

    @property
    def items(self) -> int:
        return self.rm * self.rn

    @property
    def reduce_group(self) -> int:
        """Work-items of the bias-gradient reduction (a power of two)."""
        return min(64, 1 << (self.items.bit_length() - 1))

    @property
    def local_bytes(self) -> int:
        return 4 * self.tk * (self.tile_m + self.tile_n + 2)

    def defines(self) -> list[str]:
        return [
            f"-DRM={self.rm}",
            f"-DRN={self.rn}",
            f"-DWM={self.wm}",
            f"-DWN={self.wn}",
            f"-DTK={self.tk}",
            f"-DREDUCE_GROUP={self.reduce_group}",
        ]


# 64 x 64 tiles. GPUs: 256 work-items of 4 x 4 outputs (occupancy, few registers each). CPUs:
# 64 work-items of 8 x 8 (PoCL keeps per-work-item state in memory across barriers, so fewer,
# fatter work-items win: 5.4 vs 4.0 GFLOPS on the C2 forward here). Smaller ones are fallbacks
# for devices whose work-groups or registers do not allow these.
_GPU_TILING = _Tiling(16, 16, 4, 4, 16)
_CPU_TILING = _Tiling(8, 8, 8, 8, 16)
_FALLBACK_TILINGS = (_Tiling(8, 8, 4, 4, 16), _Tiling(4, 4, 4, 4, 16))


def _tilings(kind: str) -> tuple[_Tiling, ...]:
    """Tilings to try for a device of ``kind``, best first."""
    first = (_CPU_TILING, _GPU_TILING) if kind == "cpu" else (_GPU_TILING, _CPU_TILING)
    return first + _FALLBACK_TILINGS


# ----------------------------------------------------------------------------- kernel source

_GEMM_TEMPLATE = Template(
    r"""
__kernel __attribute__((reqd_work_group_size(RN, RM, 1)))
void $name($buffers,
           const int N, const int C, const int H, const int W, const int K,
           const int KH, const int KW, const int PT, const int PL,
           const int HO, const int WO, const int k_slice)
{
    const int KK = KH * KW, HW = H * W, P = HO * WO;
    $sizes
    const int lx = get_local_id(0), ly = get_local_id(1);
    const int tid = ly * RN + lx;
    const int row0 = get_group_id(1) * TILE_M;
    const int col0 = get_group_id(0) * TILE_N;
    const int k_begin = get_group_id(2) * k_slice;
    const int k_end = min(k_begin + k_slice, DEPTH);

    __local float a_tile[TK][TILE_M + 1];
    __local float b_tile[TK][TILE_N + 1];

    /* Each work-item loads the same operand-B column on every step: decompose it once. */
    const int a_term = tid % TK, a_row = tid / TK;
    const int b_tile_col = tid % TILE_N, b_term = tid / TILE_N;
    const int b_col = col0 + b_tile_col;
    const bool b_col_ok = b_col < COLS;
    $b_setup

    float acc[WM][WN];
    #pragma unroll
    for (int i = 0; i < WM; i++) {
        #pragma unroll
        for (int j = 0; j < WN; j++) acc[i][j] = 0.0f;
    }

    for (int k0 = k_begin; k0 < k_end; k0 += TK) {
        #pragma unroll
        for (int q = 0; q < TILE_M * TK / (RM * RN); q++) {
            const int r = a_row + q * (RM * RN / TK);
            const int row = row0 + r, t = k0 + a_term;
            float v = 0.0f;
            if (row < ROWS && t < k_end) { $a_load }
            a_tile[a_term][r] = v;
        }
        #pragma unroll
        for (int q = 0; q < TILE_N * TK / (RM * RN); q++) {
            const int tt = b_term + q * (RM * RN / TILE_N);
            const int t = k0 + tt;
            float v = 0.0f;
            if (b_col_ok && t < k_end) { $b_load }
            b_tile[tt][b_tile_col] = v;
        }
        barrier(CLK_LOCAL_MEM_FENCE);
        #pragma unroll
        for (int t = 0; t < TK; t++) {
            float a[WM], b[WN];
            #pragma unroll
            for (int i = 0; i < WM; i++) a[i] = a_tile[t][ly + i * RM];
            #pragma unroll
            for (int j = 0; j < WN; j++) b[j] = b_tile[t][lx + j * RN];
            #pragma unroll
            for (int i = 0; i < WM; i++) {
                #pragma unroll
                for (int j = 0; j < WN; j++) acc[i][j] += a[i] * b[j];
            }
        }
        barrier(CLK_LOCAL_MEM_FENCE);
    }

    #pragma unroll
    for (int i = 0; i < WM; i++) {
        const int row = row0 + ly + i * RM;
        #pragma unroll
        for (int j = 0; j < WN; j++) {
            const int col = col0 + lx + j * RN;
            if (row < ROWS && col < COLS) { $store }
        }
    }
}
"""
)

# Forward: y[n,k,oy,ox] = sum_{c,i,j} w[k,c,i,j] * x[n,c,oy+i-PT,ox+j-PL].
_FORWARD = {
    "name": "conv_forward",
    "buffers": "__global const float *restrict x, __global const float *restrict w, "
    "__global const float *restrict bias, __global float *restrict y, const int has_bias",
    "sizes": "const int ROWS = K, COLS = N * P, DEPTH = C * KK;",
    "b_setup": """
    const int b_n = b_col / P, b_p = b_col - b_n * P;
    const int b_oy = b_p / WO, b_ox = b_p - b_oy * WO;
    const int b_y0 = b_oy - PT, b_x0 = b_ox - PL;
    const int b_base = b_n * C * HW;""",
    "a_load": "v = w[row * DEPTH + t];",
    "b_load": """
                const int c = t / KK, ij = t - c * KK, i = ij / KW, j = ij - i * KW;
                const int yy = b_y0 + i, xx = b_x0 + j;
                if (yy >= 0 && yy < H && xx >= 0 && xx < W)
                    v = x[b_base + c * HW + yy * W + xx];""",
    "store": """
                const int n = col / P, p = col - n * P;
                y[(n * K + row) * P + p] = acc[i][j] + (has_bias ? bias[row] : 0.0f);""",
}

# Input gradient: dx[n,c,y,x] = sum_{k,i,j} w[k,c,i,j] * dy[n,k,y+PT-i,x+PL-j] (in range).
_GRAD_INPUT = {
    "name": "conv_grad_input",
    "buffers": "__global const float *restrict dy, __global const float *restrict w, "
    "__global float *restrict dx",
    "sizes": "const int ROWS = C, COLS = N * HW, DEPTH = K * KK;",
    "b_setup": """
    const int b_n = b_col / HW, b_rest = b_col - b_n * HW;
    const int b_y = b_rest / W, b_x = b_rest - b_y * W;
    const int b_y0 = b_y + PT, b_x0 = b_x + PL;
    const int b_base = b_n * K * P;""",
    "a_load": "const int k = t / KK; v = w[(k * C + row) * KK + (t - k * KK)];",
    "b_load": """
                const int k = t / KK, ij = t - k * KK, i = ij / KW, j = ij - i * KW;
                const int oy = b_y0 - i, ox = b_x0 - j;
                if (oy >= 0 && oy < HO && ox >= 0 && ox < WO)
                    v = dy[b_base + k * P + oy * WO + ox];""",
    "store": """
                const int n = col / HW;
                dx[(n * C + row) * HW + (col - n * HW)] = acc[i][j];""",
}

# Kernel gradient: dw[k,c,i,j] = sum_{n,oy,ox} dy[n,k,oy,ox] * x[n,c,oy+i-PT,ox+j-PL], written
# as slice get_group_id(2) of the depth into partial[slice, k, c*kh*kw].
_GRAD_KERNELS = {
    "name": "conv_grad_kernels",
    "buffers": "__global const float *restrict x, __global const float *restrict dy, "
    "__global float *restrict partial",
    "sizes": "const int ROWS = K, COLS = C * KK, DEPTH = N * P;",
    "b_setup": """
    const int b_c = b_col / KK, b_ij = b_col - b_c * KK;
    const int b_i = b_ij / KW, b_j = b_ij - b_i * KW;
    const int b_base = b_c * HW, b_dy = b_i - PT, b_dx = b_j - PL;""",
    "a_load": "const int n = t / P; v = dy[(n * K + row) * P + (t - n * P)];",
    "b_load": """
                const int n = t / P, p = t - n * P, oy = p / WO, ox = p - oy * WO;
                const int yy = oy + b_dy, xx = ox + b_dx;
                if (yy >= 0 && yy < H && xx >= 0 && xx < W)
                    v = x[n * C * HW + b_base + yy * W + xx];""",
    "store": """
                partial[(get_group_id(2) * ROWS + row) * COLS + col] = acc[i][j];""",
}

_REDUCTIONS = r"""
/* out[e] = sum over slices s of partial[s, e]. */
__kernel void sum_slices(__global const float *restrict partial, __global float *restrict out,
                         const int slices, const int size)
{
    const int e = get_global_id(0);
    if (e >= size) return;
    float s = 0.0f;
    for (int z = 0; z < slices; z++) s += partial[z * size + e];
    out[e] = s;
}

/* db[k] = sum over n, p of dy[n, k, p]: one work-group per kernel, a tree in local memory. */
__kernel __attribute__((reqd_work_group_size(REDUCE_GROUP, 1, 1)))
void bias_grad(__global const float *restrict dy, __global float *restrict db,
               const int N, const int K, const int P)
{
    const int k = get_group_id(0), lid = get_local_id(0);
    __local float part[REDUCE_GROUP];
    float s = 0.0f;
    for (int n = 0; n < N; n++)
        for (int p = lid; p < P; p += REDUCE_GROUP) s += dy[(n * K + k) * P + p];
    part[lid] = s;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int step = REDUCE_GROUP / 2; step > 0; step /= 2) {
        if (lid < step) part[lid] += part[lid + step];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    if (lid == 0) db[k] = part[0];
}
"""


def _program_source() -> str:
    header = "#define TILE_M (RM * WM)\n#define TILE_N (RN * WN)\n"
    gemms = [_GEMM_TEMPLATE.substitute(part) for part in (_FORWARD, _GRAD_INPUT, _GRAD_KERNELS)]
    return header + "".join(gemms) + _REDUCTIONS


_KERNEL_NAMES = ("conv_forward", "conv_grad_input", "conv_grad_kernels", "sum_slices", "bias_grad")

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
    tiling: _Tiling


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
        elif isinstance(device, bool) or not isinstance(device, (int, np.integer)):
            raise ValueError(f"OpenCL device must be an int, got {device!r}")
        elif not 0 <= device < len(found):
            listing = "; ".join(f"{i}: {info.name}" for i, info in enumerate(infos))
            raise ValueError(
                f"OpenCL device {device} does not exist; valid: 0..{len(found) - 1} ({listing})"
            )
        self.device_index = int(device)
        self._platform, self._device = found[self.device_index]
        self._info = infos[self.device_index]
        self._max_alloc = min(int(self._device.max_mem_alloc_size), _INT_INDEX_BYTES)
        try:
            compiled = self._compile(self._platform, self._device)
        except DeviceCannotBuild as error:
            from . import BackendUnavailable

            raise BackendUnavailable(
                f"OpenCL device {device} ({self._info.name}) cannot run hetconv: {error}"
            ) from None
        self._context = compiled.context
        self._tiling = compiled.tiling
        self._queue = cl.CommandQueue(
            self._context, self._device, properties=cl.command_queue_properties.PROFILING_ENABLE
        )
        # Own kernel objects: setting arguments on a shared one would race between threads.
        self._kernels = {name: cl.Kernel(compiled.program, name) for name in _KERNEL_NAMES}
        self._lock = threading.Lock()
        #: Device seconds spent in kernels by this backend so far (from queue profiling;
        #: transfers excluded). The difference around a call is that call's kernel time.
        self.device_seconds = 0.0

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
        source = _program_source()
        failures = []
        sizes = device.max_work_item_sizes
        for tiling in _tilings(_kind(device)):
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

    def _upload(self, **arrays: np.ndarray | None) -> list[Any]:
        """Read-only device copies of ``arrays`` (None stays None, a null buffer). Every array
        is checked to be float32 and C-contiguous before the first buffer is made."""
        for key, a in arrays.items():
            name = key.replace("_", " ")
            if a is None:
                continue
            if a.dtype != np.float32:
                raise TypeError(f"{name} has dtype {a.dtype}, expected float32")
            if not a.flags.c_contiguous:
                raise ValueError(f"{name} is not C-contiguous")
        flags = cl.mem_flags.READ_ONLY | cl.mem_flags.COPY_HOST_PTR
        return [
            None if a is None else cl.Buffer(self._context, flags, hostbuf=a)
            for a in arrays.values()
        ]

    def _output(self, values: int) -> Any:
        return cl.Buffer(self._context, cl.mem_flags.READ_WRITE, 4 * max(1, values))

    def _download(self, buffer: Any, shape: tuple[int, ...]) -> np.ndarray:
        out = np.empty(shape, np.float32)
        cl.enqueue_copy(self._queue, out, buffer, is_blocking=True)
        return out

    def _geometry(self, shape: ConvShape, k_slice: int) -> list[np.int32]:
        ho, wo = shape.out_hw
        p = shape.padding
        values = (shape.n, shape.c, shape.h, shape.w, shape.k, shape.kh, shape.kw)
        return [np.int32(v) for v in (*values, p.top, p.left, ho, wo, k_slice)]

    def _run_gemm(
        self, name: str, buffers: list, rows: int, cols: int, slices: int, shape, k_slice: int
    ) -> Any:
        t = self._tiling
        groups = (-(-cols // t.tile_n), -(-rows // t.tile_m), slices)
        global_size = (groups[0] * t.rn, groups[1] * t.rm, slices)
        kernel = self._kernels[name]
        kernel.set_args(*buffers, *self._geometry(shape, k_slice))
        return cl.enqueue_nd_range_kernel(self._queue, kernel, global_size, (t.rn, t.rm, 1))

    def _grad_kernel_split(self, shape: ConvShape) -> tuple[int, int]:
        """(slices, terms per slice) of the kernel gradient's depth N*Ho*Wo (split-K): enough
        work-groups to fill the device, each slice at least 8 depth tiles."""
        t = self._tiling
        ho, wo = shape.out_hw
        depth = shape.n * ho * wo
        groups = -(-shape.k // t.tile_m) * -(-(shape.c * shape.kh * shape.kw) // t.tile_n)
        wanted = -(-_GROUPS_PER_COMPUTE_UNIT * self._info.cores // groups)
        slices = max(1, min(wanted, _MAX_SLICES, depth // (8 * t.tk)))
        k_slice = -(-depth // slices)
        k_slice = -(-k_slice // t.tk) * t.tk
        return -(-depth // k_slice), k_slice

    def _account(self, events: list) -> None:
        for event in events:
            event.wait()
            self.device_seconds += (event.profile.end - event.profile.start) * 1e-9

    # -- the three operations ------------------------------------------------------------

    def _forward(self, x, w, b, shape):
        ho, wo = shape.out_hw
        depth = shape.c * shape.kh * shape.kw
        with self._lock:
            x_buf, w_buf, b_buf = self._upload(input=x, kernels=w, bias=b)
            y_buf = self._output(shape.n * shape.k * ho * wo)
            event = self._run_gemm(
                "conv_forward",
                [x_buf, w_buf, b_buf, y_buf, np.int32(b is not None)],
                shape.k,
                shape.n * ho * wo,
                1,
                shape,
                depth,
            )
            y = self._download(y_buf, (shape.n, shape.k, ho, wo))
            self._account([event])
        return y

    def _grad_input(self, dy, w, shape):
        depth = shape.k * shape.kh * shape.kw
        with self._lock:
            dy_buf, w_buf = self._upload(output_gradient=dy, kernels=w)
            dx_buf = self._output(shape.n * shape.c * shape.h * shape.w)
            event = self._run_gemm(
                "conv_grad_input",
                [dy_buf, w_buf, dx_buf],
                shape.c,
                shape.n * shape.h * shape.w,
                1,
                shape,
                depth,
            )
            dx = self._download(dx_buf, (shape.n, shape.c, shape.h, shape.w))
            self._account([event])
        return dx

    def _grad_kernels(self, x, dy, shape):
        ho, wo = shape.out_hw
        taps = shape.c * shape.kh * shape.kw
        size = shape.k * taps
        slices, k_slice = self._grad_kernel_split(shape)
        with self._lock:
            x_buf, dy_buf = self._upload(input=x, output_gradient=dy)
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
                group = self._tiling.reduce_group
                global_size = (-(-size // group) * group,)
                events.append(
                    cl.enqueue_nd_range_kernel(self._queue, kernel, global_size, (group,))
                )
            kernel = self._kernels["bias_grad"]
            kernel.set_args(dy_buf, db_buf, np.int32(shape.n), np.int32(shape.k), np.int32(ho * wo))
            group = self._tiling.reduce_group
            events.append(
                cl.enqueue_nd_range_kernel(self._queue, kernel, (shape.k * group,), (group,))
            )
            dw = self._download(dw_buf, (shape.k, shape.c, shape.kh, shape.kw))
            db = self._download(db_buf, (shape.k,))
            self._account(events)
        return dw, db
