"""The opencl backend's own behaviour: device listing and choice, the kernel cache, input
checks, and its three operations against the cpu backend on a grid of geometries.

Runs wherever an OpenCL device exists (``pip install pyopencl pocl-binary-distribution`` gives
a CPU one); skipped with the reason otherwise.

Tolerance: both backends sum in float32 in different orders, so results are compared with the
cpu backend's to ``1e-5 * max|cpu result|`` (observed: below 2e-6 on the paper's C2 shape).
Runs of the same backend that only split the batch differently agree to ``1e-6 * max``.
"""

from __future__ import annotations

import itertools
import re
import threading
import time

import numpy as np
import pytest
from backend_cases import assert_close, make_problem, matches_cpu

from hetconv.backends import (
    BackendUnavailable,
    ConvShape,
    CpuBackend,
    DeviceInfo,
    Padding,
    conv_shape,
    get_backend,
    opencl_kernels,
)

pytest.importorskip(
    "pyopencl", reason="pyopencl is not installed (pip install pyopencl pocl-binary-distribution)"
)
opencl = pytest.importorskip("hetconv.backends.opencl")
OpenCLBackend = opencl.OpenCLBackend

_available, _why = OpenCLBackend.is_available()
if not _available:
    pytest.skip(f"opencl backend unavailable: {_why}", allow_module_level=True)

CPU_RTOL = 1e-5
CHUNK_RTOL = 1e-6


@pytest.fixture(scope="module")
def backend() -> OpenCLBackend:
    return OpenCLBackend()


@pytest.fixture(scope="module")
def cpu() -> CpuBackend:
    return CpuBackend()


# Tolerance scale: max|cpu result| with no floor (1e-30 only avoids a zero scale).
FLOOR = 1e-30


def _compare_all(ocl, cpu, rng, n, c, h, w, k, kh, kw, padding, with_bias=True):
    problem = make_problem(rng, n, c, h, w, k, kh, kw, padding)
    problem = problem if with_bias else problem.without_bias()
    what = f" N{n} C{c} {h}x{w} K{k} {kh}x{kw} pad {padding}"
    matches_cpu(ocl, problem, CPU_RTOL, floor=FLOOR, cpu=cpu, what=what)


# ----------------------------------------------------------------------------- devices


def test_devices_are_listed_stably_and_described():
    listed = OpenCLBackend.devices()
    assert listed, "is_available() said yes, so there is a device"
    assert listed == OpenCLBackend.devices()
    assert len({info.name for info in listed}) == len(listed)
    for info in listed:
        assert isinstance(info, DeviceInfo)
        assert info.backend == "opencl"
        assert info.kind in {"gpu", "cpu", "accelerator"}
        assert info.memory_bytes > 0 and info.cores >= 1


def _builds(number: int) -> bool:
    try:
        OpenCLBackend(device=number)
    except BackendUnavailable:
        return False
    return True


def test_each_device_number_selects_that_device():
    listed = OpenCLBackend.devices()
    usable = []
    for number, info in enumerate(listed):
        try:
            chosen = OpenCLBackend(device=number)
        except BackendUnavailable as error:  # a driver whose compiler rejects the kernels
            assert f"OpenCL device {number} (" in str(error) and "cannot run" in str(error)
            continue
        usable.append(number)
        assert chosen.device_index == number
        assert chosen.describe() == info
        assert chosen.describe().memory_bytes == chosen._device.global_mem_size
    assert usable, "is_available() said a device builds the kernels"
    assert get_backend("opencl", device=usable[-1]).describe() == listed[usable[-1]]


def test_default_device_prefers_gpu_then_accelerator_then_most_cores():
    listed = OpenCLBackend.devices()
    rank = {"gpu": 0, "accelerator": 1, "cpu": 2}
    builds = [info for i, info in enumerate(listed) if _builds(i)]
    best = min(builds, key=lambda info: (rank[info.kind], -info.cores))
    chosen = OpenCLBackend().describe()
    assert (chosen.kind, chosen.cores) == (best.kind, best.cores)
    assert chosen == get_backend("opencl").describe()

    def info(kind, cores):
        return DeviceInfo("opencl", kind, f"{kind}{cores}", 1, cores)

    assert opencl._default_device([info("cpu", 64), info("gpu", 2)]) == 1
    assert opencl._default_device([info("cpu", 64), info("accelerator", 2)]) == 1
    assert opencl._default_device([info("gpu", 20), info("gpu", 40), info("gpu", 40)]) == 1


@pytest.mark.parametrize("devices", ["every device", "the first alone"])
def test_a_device_whose_compiler_fails_is_passed_over(monkeypatch, devices):
    """The preferred device's compiler rejecting the kernels (seen: PoCL 3.0 on a virtual CPU
    LLVM names 'generic') leaves the default to the next device, and naming it says why: the
    device's number and the compiler's own words, however the message around them reads (a
    machine with one device says it as the reason no device builds)."""
    monkeypatch.setattr(OpenCLBackend, "_compiled", {})
    monkeypatch.setattr(OpenCLBackend, "_cannot_build", {})
    found = opencl._all_devices()
    if devices == "the first alone":
        found = found[:1]
        monkeypatch.setattr(opencl, "_all_devices", lambda: list(found))
    infos = [opencl._device_info(i, p, d) for i, (p, d) in enumerate(found)]
    broken = opencl._preference_order(infos)[0]
    real_build = OpenCLBackend._build.__func__

    def build(cls, device):
        if device.int_ptr == found[broken][1].int_ptr:
            raise opencl.DeviceCannotBuild("error: unknown target CPU 'generic'")
        return real_build(cls, device)

    monkeypatch.setattr(OpenCLBackend, "_build", classmethod(build))
    with pytest.raises(BackendUnavailable) as refused:
        OpenCLBackend(device=broken)
    said = str(refused.value)
    assert re.search(rf"\bdevice {broken}\b", said), said
    assert "unknown target CPU 'generic'" in said, said
    if len(found) == 1:
        ok, why = OpenCLBackend.is_available()
        assert not ok and "unknown target CPU 'generic'" in why
        with pytest.raises(BackendUnavailable, match="no OpenCL device builds the kernels"):
            OpenCLBackend()
    else:
        assert OpenCLBackend().device_index != broken


@pytest.mark.parametrize("bad", [-1, "count", 99, True, "0", 1.0])
def test_bad_device_number_names_the_valid_range(bad):
    count = len(OpenCLBackend.devices())
    bad = count if bad == "count" else bad
    with pytest.raises(ValueError, match="device") as raised:
        OpenCLBackend(device=bad)
    if isinstance(bad, int) and not isinstance(bad, bool):
        assert f"0..{count - 1}" in str(raised.value)
    with pytest.raises(ValueError):
        get_backend("opencl", device=99)


def test_unavailable_is_reported_never_raised(monkeypatch):
    import pyopencl

    def no_platform():
        raise pyopencl.LogicError("clGetPlatformIDs failed: PLATFORM_NOT_FOUND_KHR")

    monkeypatch.setattr(pyopencl, "get_platforms", no_platform)
    ok, why = OpenCLBackend.is_available()
    assert not ok and "platform" in why
    assert OpenCLBackend.devices() == []
    with pytest.raises(BackendUnavailable):
        OpenCLBackend()

    monkeypatch.setattr(pyopencl, "get_platforms", lambda: [])
    assert OpenCLBackend.is_available() == (False, "no OpenCL device on any platform")

    monkeypatch.setattr(opencl, "cl", None)
    monkeypatch.setattr(opencl, "_IMPORT_ERROR", ImportError("No module named 'pyopencl'"))
    ok, why = OpenCLBackend.is_available()
    assert not ok and "pyopencl" in why


# ----------------------------------------------------------------------------- kernel cache


def test_second_backend_on_a_device_reuses_the_built_program(backend, monkeypatch):
    builds = OpenCLBackend.builds
    assert builds >= 1
    again = OpenCLBackend(device=backend.device_index)
    assert OpenCLBackend.builds == builds, "the program was built again"
    assert again._context is backend._context

    # From an empty cache the first backend builds and every later one reuses its build.
    built = OpenCLBackend._compiled[(backend._platform.int_ptr, backend._device.int_ptr)]
    calls = []

    def counting_build(cls, device):
        calls.append(device)
        return built

    monkeypatch.setattr(OpenCLBackend, "_compiled", {})
    monkeypatch.setattr(OpenCLBackend, "_build", classmethod(counting_build))
    first = OpenCLBackend(device=backend.device_index)
    OpenCLBackend(device=backend.device_index)
    OpenCLBackend(device=backend.device_index)
    assert len(calls) == 1
    x = np.ones((1, 1, 3, 3), np.float32)
    assert first.conv_forward(x, np.ones((1, 1, 3, 3), np.float32), None, 0)[0, 0, 0, 0] == 9


# ----------------------------------------------------------------------------- input checks


def test_float64_and_strided_inputs_are_rejected_before_any_buffer(backend, monkeypatch, rng):
    import pyopencl

    made = []
    real_buffer = pyopencl.Buffer

    def counting_buffer(*args, **kwargs):
        made.append(args)
        return real_buffer(*args, **kwargs)

    monkeypatch.setattr(pyopencl, "Buffer", counting_buffer)
    x, w, b, dy = make_problem(rng, 2, 3, 6, 6, 4, 3, 3, 1).arrays
    shape = conv_shape(x.shape, w.shape, 1)
    wide = x.astype(np.float64)
    with pytest.raises(TypeError, match="float32"):
        backend.conv_forward(wide, w, b, 1)
    with pytest.raises(TypeError, match="float32"):
        backend.conv_forward(x, w, b.astype(np.float64), 1)
    with pytest.raises(TypeError, match="float32"):
        backend.conv_grad_input(dy.astype(np.float64), w, (6, 6), 1)
    with pytest.raises(TypeError, match="float32"):
        backend.conv_grad_kernels(x, dy.astype(np.float64), (3, 3), 1)
    # The backend's own check, below the base class's: the last array is the bad one, so a
    # check made array by array would already have made buffers for the others.
    with pytest.raises(TypeError, match="kernels has dtype float64"):
        backend._forward(x, w.astype(np.float64), None, shape)
    with pytest.raises(TypeError, match="output gradient has dtype float64"):
        backend._grad_kernels(x, dy.astype(np.float64), shape)
    with pytest.raises(ValueError, match="C-contiguous"):
        backend._grad_input(dy, np.asfortranarray(w), shape)
    assert made == []
    backend.conv_forward(x, w, b, 1)
    assert len(made) == 4  # input, kernels, bias and the output


# ----------------------------------------------------------------------------- results

GRID = [
    # n, c, h, w, k, kh, kw, padding
    (2, 3, 7, 9, 4, 1, 1, 0),  # 1x1 kernel
    (2, 3, 7, 9, 4, 3, 3, 1),
    (3, 1, 8, 8, 5, 5, 5, 2),  # C=1
    (2, 3, 6, 5, 1, 3, 3, "same"),  # K=1
    (1, 4, 9, 7, 6, 5, 5, "valid"),  # N=1
    (2, 3, 6, 6, 5, 2, 2, "same"),  # even kernel: extra padding bottom/right
    (2, 2, 7, 6, 3, 2, 4, (1, 0, 2, 1)),  # even, non-square kernel, asymmetric padding
    (2, 3, 8, 6, 7, 5, 3, (1, 2, 0, 3)),  # asymmetric padding
    (1, 3, 3, 3, 2, 5, 5, 2),  # kernel as large as the padded input
    (2, 3, 9, 11, 70, 3, 3, 1),  # K beyond one 64-row tile, columns over several tiles
    (4, 2, 12, 12, 4, 3, 3, 0),  # few kernel-gradient outputs: the depth is split (split-K)
]


@pytest.mark.parametrize("n,c,h,w,k,kh,kw,padding", GRID)
def test_operations_match_cpu(backend, cpu, rng, n, c, h, w, k, kh, kw, padding):
    _compare_all(backend, cpu, rng, n, c, h, w, k, kh, kw, padding)


def test_forward_without_bias_and_split_kernel_gradient(backend, cpu, rng):
    _compare_all(backend, cpu, rng, 2, 3, 7, 9, 4, 3, 3, 1, with_bias=False)
    shape = conv_shape((4, 2, 12, 12), (4, 2, 3, 3), 0)
    assert backend._grad_kernel_split(shape)[0] > 1, "the grid should exercise split-K"


def test_paper_c2_shape_at_small_batch(backend, cpu, rng):
    """C2 of the paper's 50:500 network (50 x 16 x 16 input, 500 kernels of 5 x 5), batch 2."""
    _compare_all(backend, cpu, rng, 2, 50, 16, 16, 500, 5, 5, 2)


# The GPU tiling is what GPUs run, and CI has none: test it here. The rarely used fallbacks cost
# ~8 s of PoCL compilation each, so they run with -m slow.
_TILINGS = [
    opencl_kernels.GPU_TILING,
    opencl_kernels.CPU_TILING,
    *(pytest.param(t, marks=pytest.mark.slow) for t in opencl_kernels.FALLBACK_TILINGS),
]


@pytest.mark.parametrize("tiling", _TILINGS, ids=str)
def test_every_tiling_matches_cpu(tiling, cpu, rng, monkeypatch):
    """Each tiling the backend may pick runs correctly on this device."""
    monkeypatch.setattr(OpenCLBackend, "_compiled", {})
    monkeypatch.setattr(opencl_kernels, "tilings", lambda kind: (tiling,))
    ocl = OpenCLBackend()
    assert ocl._tiling == tiling
    _compare_all(ocl, cpu, rng, 3, 5, 9, 10, 70, 3, 3, (1, 2, 0, 1))
    _compare_all(ocl, cpu, rng, 4, 2, 12, 12, 3, 3, 3, 0)


def test_invalid_tiling_is_refused():
    with pytest.raises(ValueError, match="evenly"):
        opencl_kernels.Tiling(8, 8, 4, 4, 48)


# ----------------------------------------------------------------------------- memory


def test_working_set_has_no_lowered_copy(backend):
    """Inputs, outputs, kernels and bias, and the split-K partial kernel gradients where this
    device splits the depth (PoCL's CPU device does not for this shape; NVIDIA's OpenCL does,
    in 4); never a lowered copy of the input (25 times the input for these 5 x 5 kernels)."""
    shape = ConvShape(8, 50, 16, 16, 500, 5, 5, Padding(2, 2, 2, 2))
    kernel_values = 500 * 50 * 25
    values = 8 * 50 * 256 + 8 * 500 * 256 + kernel_values + 500
    slices = backend._grad_kernel_split(shape)[0]
    partials = kernel_values * slices if slices > 1 else 0
    assert backend.working_set_bytes(shape) == 4 * (values + partials)


@pytest.mark.parametrize("limit_images", [1, 3])
def test_memory_limit_chunks_the_batch_with_equal_results(backend, rng, monkeypatch, limit_images):
    n, c, h, w, k, kh, kw, padding = 7, 3, 8, 8, 5, 3, 3, 1
    x, kernels, bias, dy = make_problem(rng, n, c, h, w, k, kh, kw, padding).arrays
    shape = conv_shape(x.shape, kernels.shape, padding)
    one_chunk = (
        backend.conv_forward(x, kernels, bias, padding),
        backend.conv_grad_input(dy, kernels, (h, w), padding),
        *backend.conv_grad_kernels(x, dy, (kh, kw), padding),
    )
    small = OpenCLBackend(device=backend.device_index)
    small.memory_limit = small.working_set_bytes(opencl._with_images(shape, limit_images))
    step = small._images_per_call(shape)
    assert 1 <= step <= limit_images
    calls = []
    for name in ("_forward", "_grad_input", "_grad_kernels"):
        real = getattr(small, name)
        monkeypatch.setattr(
            small, name, lambda *a, _real=real, _n=name: calls.append(_n) or _real(*a)
        )
    chunked = (
        small.conv_forward(x, kernels, bias, padding),
        small.conv_grad_input(dy, kernels, (h, w), padding),
        *small.conv_grad_kernels(x, dy, (kh, kw), padding),
    )
    assert len(calls) == 3 * -(-n // step)
    for part, whole, what in zip(chunked, one_chunk, ("y", "dx", "dw", "db"), strict=True):
        assert_close(part, whole, what, CHUNK_RTOL, FLOOR)


def test_allocation_limit_chunks_and_refuses_an_image_too_large(backend, rng):
    n, c, h, w, k = 5, 2, 6, 6, 3
    x, kernels, bias, _ = make_problem(rng, n, c, h, w, k, 3, 3, 1).arrays
    capped = OpenCLBackend(device=backend.device_index)
    capped._max_alloc = 2 * 4 * k * h * w  # two images' outputs per buffer
    assert capped._images_per_call(conv_shape(x.shape, kernels.shape, 1)) == 2
    assert_close(
        capped.conv_forward(x, kernels, bias, 1),
        backend.conv_forward(x, kernels, bias, 1),
        "forward in allocation-sized chunks",
        CHUNK_RTOL,
        FLOOR,
    )
    capped._max_alloc = 16
    with pytest.raises(MemoryError, match="allocation"):
        capped.conv_forward(x, kernels, bias, 1)


# ----------------------------------------------------------------------------- use


def test_probe_and_device_time(backend):
    before = backend.device_seconds
    seconds = backend.time_step(ConvShape(2, 3, 8, 8, 4, 3, 3, Padding(1, 1, 1, 1)))
    assert seconds > 0
    assert backend.device_seconds > before


def test_probe_is_device_time_of_kernels_and_transfers(backend, monkeypatch):
    """The probe's figure is what the device measured: the sum of the profiled durations of
    every upload, kernel and download of the step, and never the host's clock (which jumps an
    hour at every reading here)."""
    shape = ConvShape(2, 3, 8, 8, 4, 3, 3, Padding(1, 1, 1, 1))
    kernel_ns: list[int] = []
    transfer_ns: list[int] = []
    real_account = backend._account

    def spy(kernel_events, transfer_events):
        real_account(kernel_events, transfer_events)
        kernel_ns.extend(e.profile.end - e.profile.start for e in kernel_events)
        transfer_ns.extend(e.profile.end - e.profile.start for e in transfer_events)

    monkeypatch.setattr(backend, "_account", spy)
    hours = itertools.count(0.0, 3600.0)
    monkeypatch.setattr(time, "perf_counter", lambda: next(hours))
    before = backend.device_seconds + backend.transfer_seconds
    seconds = backend.time_step(shape, repeats=1)
    after = backend.device_seconds + backend.transfer_seconds

    # forward: input, kernels, bias up, y down; kernel gradient: input, dy up, dw, db down;
    # input gradient: dy, kernels up, dx down. Kernels: one GEMM each, the split-K sum when
    # the depth is split, and the bias-gradient reduction.
    assert len(transfer_ns) == 4 + 4 + 3
    split = backend._grad_kernel_split(shape)[0] > 1
    assert len(kernel_ns) == 3 + int(split) + 1
    assert all(ns >= 0 for ns in kernel_ns + transfer_ns)
    assert seconds == pytest.approx((sum(kernel_ns) + sum(transfer_ns)) * 1e-9, rel=1e-9)
    assert seconds == pytest.approx(after - before, rel=1e-9)
    assert 0 < seconds < 60


def test_probe_counts_only_its_own_thread(backend, rng):
    """A call another thread makes on the backend while a probe is open is not in its figure
    (the worker serves training calls on other threads)."""
    x, kernels, bias, _ = make_problem(rng, 2, 3, 8, 8, 4, 3, 3, 1).arrays
    with backend.probe_clock() as clock:
        before = backend.device_seconds
        other = threading.Thread(target=backend.conv_forward, args=(x, kernels, bias, 1))
        other.start()
        other.join()
        assert backend.device_seconds > before, "the other thread's call ran on the device"
        assert clock.seconds == 0.0
        backend.conv_forward(x, kernels, bias, 1)
    assert clock.seconds > 0.0


def test_concurrent_calls_on_one_backend(backend, cpu, rng):
    x, kernels, bias, _ = make_problem(rng, 3, 4, 10, 10, 6, 3, 3, 1).arrays
    expected = cpu.conv_forward(x, kernels, bias, 1)
    results, errors = [], []

    def work():
        try:
            for _ in range(5):
                results.append(backend.conv_forward(x, kernels, bias, 1))
        except Exception as error:  # pragma: no cover - reported below
            errors.append(error)

    threads = [threading.Thread(target=work) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert len(results) == 15
    for y in results:
        assert_close(y, expected, "concurrent forward", CPU_RTOL, FLOOR)
