"""The cuda backend: on a real GPU when there is one, and everywhere on a numpy-backed fake.

Three groups:

* **Everywhere:** ``is_available()`` answers (False, reason) without raising when CuPy is
  missing, sees no GPU, cannot query the runtime or cannot run a kernel, and the registry
  then raises ``BackendUnavailable`` naming that reason; the pure helpers (chunk bounds,
  working set).
* **Every backend body twice** -- ``gpu`` (skipped, with ``is_available()``'s reason, when
  this machine has no usable CUDA GPU) and ``fake``: CuPy replaced by numpy plus a fake
  ``cupy.cuda`` (fake_cupy.py) whose streams *defer* device->host copies until the host waits
  on the stream (and poison the pinned target meanwhile), and check at that wait that a
  pinned input was not overwritten while its upload could still be running. So the
  pipeline's bookkeeping -- chunk offsets, slot reuse, waits, delivery -- is proven here
  against host/device races; what only the ``gpu`` run proves is CuPy itself, real
  asynchrony and the two one-line transfer calls (``_to_device`` / ``_to_host``) the fake
  replaces. The fake's streams also
  keep a device clock (1 ms per copy) that its events read, so the probe's timing by CUDA
  events is checked exactly there.
* Results are compared with the cpu backend to ``2e-5 * max(1, max|cpu result|)`` (float32,
  different summation orders); pipelined and unpipelined runs to ``1e-6`` relative (they
  differ only in how the kernel gradient's per-chunk sums are added).
"""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest
from backend_cases import (
    assert_close,
    assert_results_close,
    make_problem,
    matches_cpu,
    run_all,
)
from fake_cupy import FakeCupy, fake_to_device, fake_to_host

from hetconv.backends import (
    BackendUnavailable,
    CpuBackend,
    DeviceInfo,
    available_backends,
    conv_shape,
    get_backend,
)
from hetconv.backends import cuda as cuda_module
from hetconv.backends.cuda import CudaBackend, chunk_bounds, pipelined_working_set_bytes

CUDA_OK, CUDA_WHY = CudaBackend.is_available()
needs_gpu = pytest.mark.skipif(
    not CUDA_OK, reason=f"CudaBackend.is_available() is False here: {CUDA_WHY}"
)

RTOL = 2e-5
PIPELINE_RTOL = 1e-6


def _install_fake(monkeypatch, fake) -> None:
    """Make the cuda module see ``fake`` as cupy (or a callable raising on import)."""
    importer = fake if callable(fake) and not isinstance(fake, FakeCupy) else (lambda: fake)
    monkeypatch.setattr(cuda_module, "_import_cupy", importer)
    monkeypatch.setattr(cuda_module, "_to_device", fake_to_device)
    monkeypatch.setattr(cuda_module, "_to_host", fake_to_host)
    cuda_module._availability.cache_clear()


@pytest.fixture
def fresh_availability():
    """Clear is_available()'s cache around a test that changes what it sees."""
    cuda_module._availability.cache_clear()
    yield
    cuda_module._availability.cache_clear()


@pytest.fixture
def fake_cupy(monkeypatch, fresh_availability) -> FakeCupy:
    fake = FakeCupy(count=2)
    _install_fake(monkeypatch, fake)
    return fake


@pytest.fixture(params=[pytest.param("gpu", marks=needs_gpu), "fake"])
def device_kind(request) -> str:
    """Every test taking this runs on the real GPU (when present) and on the fake."""
    if request.param == "fake":
        request.getfixturevalue("fake_cupy")
    return request.param


# -------------------------------------------------------------------------- helpers


def _check_against_cpu(backend, rng, n, c, h, w, k, kh, kw, padding):
    """All three operations and the forward without bias against the cpu backend, inputs
    unchanged; returns the problem and ``backend``'s results."""
    problem = make_problem(rng, n, c, h, w, k, kh, kw, padding)
    original = problem.copy()
    got = matches_cpu(backend, problem, RTOL)
    assert_close(
        backend.conv_forward(problem.x, problem.w, None, padding),
        CpuBackend().conv_forward(problem.x, problem.w, None, padding),
        "forward without bias",
        RTOL,
    )
    problem.assert_unchanged(original)
    return problem, got


# ------------------------------------------------------------------ runs everywhere


def test_is_available_answers_without_raising():
    ok, why = CudaBackend.is_available()
    assert isinstance(ok, bool) and isinstance(why, str)
    assert ok == (why == ""), (ok, why)


@pytest.mark.skipif(CUDA_OK, reason="this machine has a usable CUDA GPU")
def test_unavailable_here_and_the_registry_names_why():
    ok, why = CudaBackend.is_available()
    assert ok is False
    assert why.strip()
    with pytest.raises(BackendUnavailable) as info:
        get_backend("cuda")
    assert why in str(info.value)
    with pytest.raises(BackendUnavailable, match="cuda"):
        get_backend("cuda", device=0)
    with pytest.raises(BackendUnavailable):
        CudaBackend()
    assert why in available_backends()["cuda"]
    assert CudaBackend.devices() == []


def _raise_import_error():
    raise ImportError("No module named 'cupy'")


def _broken_runtime():
    fake = FakeCupy()

    def no_driver():
        raise RuntimeError("cudaErrorInsufficientDriver: CUDA driver version is insufficient")

    fake.cuda.runtime.getDeviceCount = no_driver
    return fake


def _no_nvrtc():
    fake = FakeCupy()

    def arange(*args, **kwargs):
        raise RuntimeError("CuPy failed to load libnvrtc.so.12")

    fake.arange = arange
    return fake


@pytest.mark.parametrize(
    "make_fake, expected",
    [
        pytest.param(lambda: _raise_import_error, "cupy cannot be imported", id="no-cupy"),
        pytest.param(lambda: FakeCupy(count=0), "is_available() is False", id="no-gpu"),
        pytest.param(_broken_runtime, "cudaErrorInsufficientDriver", id="no-driver"),
        pytest.param(_no_nvrtc, "libnvrtc", id="no-nvrtc"),
    ],
)
def test_unavailable_reasons_reach_the_registry(
    monkeypatch, fresh_availability, make_fake, expected
):
    """Each way CuPy can be unusable gives (False, why) -- never an exception -- and
    get_backend("cuda") raises BackendUnavailable carrying that why, on any machine."""
    _install_fake(monkeypatch, make_fake())
    ok, why = CudaBackend.is_available()
    assert ok is False and expected in why
    with pytest.raises(BackendUnavailable) as info:
        get_backend("cuda")
    assert why in str(info.value)
    assert CudaBackend.devices() == []


def test_chunk_bounds():
    assert chunk_bounds(5, 4) == [(0, 1), (1, 2), (2, 3), (3, 5)]
    assert chunk_bounds(8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert chunk_bounds(2, 4) == [(0, 1), (1, 2)]
    assert chunk_bounds(7, 1) == [(0, 7)]
    for n in range(1, 30):
        for chunks in range(1, 9):
            bounds = chunk_bounds(n, chunks)
            sizes = [stop - start for start, stop in bounds]
            assert bounds[0][0] == 0 and bounds[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))
            assert len(bounds) == min(n, chunks) and max(sizes) - min(sizes) <= 1
    with pytest.raises(ValueError, match="chunks=0"):
        chunk_bounds(3, 0)


def test_pipelined_working_set_bytes():
    from hetconv.backends import xpconv

    one_image = conv_shape((1, 50, 16, 16), (500, 50, 5, 5), 2)
    per_image = xpconv.workspace_values(one_image)
    kernel_values = 500 * 50 * 25 + 500
    # One image: one chunk, one stream.
    assert pipelined_working_set_bytes(one_image, 4) == 4 * (per_image + kernel_values)
    # 8 images in 4 chunks of 2: two chunks of 2 images in flight.
    eight = conv_shape((8, 50, 16, 16), (500, 50, 5, 5), 2)
    two = conv_shape((2, 50, 16, 16), (500, 50, 5, 5), 2)
    expected = 4 * (2 * xpconv.workspace_values(two) + 2 * kernel_values)
    assert pipelined_working_set_bytes(eight, 4) == expected
    # Unpipelined, the whole batch is one chunk.
    assert pipelined_working_set_bytes(eight, 1) == 4 * (
        xpconv.workspace_values(eight) + kernel_values
    )
    # More images never need less memory.
    sizes = [
        pipelined_working_set_bytes(conv_shape((n, 3, 8, 8), (4, 3, 3, 3), 1), 4)
        for n in range(1, 40)
    ]
    assert sizes == sorted(sizes)


# --------------------------------------------------- every backend body: gpu and fake


GRID = [
    # (N, C, H, W, K, kh, kw, padding)
    pytest.param(1, 1, 5, 5, 1, 3, 3, 0, id="n1-c1-k1"),
    pytest.param(5, 3, 8, 8, 4, 5, 5, "same", id="5x5-same-uneven-chunks"),
    pytest.param(4, 16, 7, 6, 3, 3, 3, (0, 2, 1, 0), id="asym"),
    pytest.param(3, 16, 6, 6, 2, 4, 4, "same", id="even-kernel"),
    pytest.param(2, 3, 4, 4, 2, 1, 1, 2, id="1x1-pad2"),
    pytest.param(6, 2, 3, 3, 2, 5, 5, (2, 3, 1, 4), id="kernel-larger-than-image"),
]


@pytest.mark.parametrize("n, c, h, w, k, kh, kw, padding", GRID)
def test_against_cpu(device_kind, rng, n, c, h, w, k, kh, kw, padding):
    _check_against_cpu(CudaBackend(), rng, n, c, h, w, k, kh, kw, padding)


@pytest.mark.parametrize("chunks", [2, 3, 4, 7])
def test_pipelined_equals_unchunked(device_kind, rng, chunks):
    """5 images in `chunks` pipeline chunks (uneven for 2, 3, 4; one image each for 7)
    equal one unpipelined chunk."""
    problem, whole = _check_against_cpu(CudaBackend(pipeline_chunks=1), rng, 5, 8, 7, 7, 3, 3, 3, 1)
    pipelined = run_all(CudaBackend(pipeline_chunks=chunks), problem)
    assert_results_close(pipelined, whole, PIPELINE_RTOL, what=" (pipelined)")


def test_repeated_calls_reuse_buffers(device_kind, rng):
    """One backend, many geometries in turn: staging buffers grow and are reused safely."""
    backend = CudaBackend(pipeline_chunks=3)
    for problem in [(6, 4, 9, 9, 5, 3, 3, 1), (2, 2, 3, 3, 1, 1, 1, 0), (7, 4, 9, 9, 5, 3, 3, 1)]:
        _check_against_cpu(backend, rng, *problem)


def test_memory_limit_chunks_the_batch(device_kind, rng):
    """A memory limit below the whole batch's working set makes the base class split the
    batch into sub-batches (each pipelined); results still equal the cpu backend's."""
    shape = conv_shape((9, 8, 10, 10), (6, 8, 3, 3), "same")
    probe = CudaBackend(pipeline_chunks=2)
    limit = probe.working_set_bytes(conv_shape((3, 8, 10, 10), (6, 8, 3, 3), "same"))
    assert limit < probe.working_set_bytes(shape)
    backend = get_backend("cuda", memory_limit=limit, pipeline_chunks=2)
    seen: list[int] = []
    original = backend._pipeline

    def spy(call_shape, *args, **kwargs):
        seen.append(call_shape.n)
        assert backend.working_set_bytes(call_shape) <= limit
        return original(call_shape, *args, **kwargs)

    backend._pipeline = spy
    _check_against_cpu(backend, rng, 9, 8, 10, 10, 6, 3, 3, "same")
    assert seen and max(seen) < 9, f"sub-batches {seen}: the batch was not split"
    tiny = get_backend("cuda", memory_limit=1024)
    x, wt = np.zeros((1, 8, 10, 10), np.float32), np.zeros((6, 8, 3, 3), np.float32)
    with pytest.raises(MemoryError, match="on cuda"):
        tiny.conv_forward(x, wt, None, "same")


def test_devices_and_describe(device_kind):
    if device_kind == "fake":
        count = 2
    else:
        import cupy

        count = cupy.cuda.runtime.getDeviceCount()
    devices = CudaBackend.devices()
    assert len(devices) == count
    for info in devices:
        assert isinstance(info, DeviceInfo)
        assert info.backend == "cuda" and info.kind == "gpu"
        assert info.name.strip() and info.memory_bytes > 0 and info.cores > 0
    for number in range(count):
        info = get_backend("cuda", device=number).describe()
        assert info.name == devices[number].name and info.cores == devices[number].cores
        assert 0 < info.memory_bytes <= devices[number].memory_bytes
    if device_kind == "fake":
        assert [d.name for d in devices] == ["Fake GPU 0", "Fake GPU 1"]
        assert devices[1].cores == 41 and devices[0].memory_bytes == 8 * 2**30


def test_bad_device_number(device_kind):
    count = len(CudaBackend.devices())
    with pytest.raises(ValueError, match=rf"CUDA device {count} does not exist.*has {count}"):
        get_backend("cuda", device=count)
    with pytest.raises(ValueError, match="CUDA device -1 does not exist"):
        CudaBackend(device=-1)
    with pytest.raises(ValueError, match="integer"):
        CudaBackend(device="0")
    with pytest.raises(ValueError, match="pipeline_chunks"):
        CudaBackend(pipeline_chunks=0)


def test_time_step(device_kind):
    shape = conv_shape((4, 3, 8, 8), (4, 3, 5, 5), "same")
    seconds = CudaBackend().time_step(shape, repeats=2)
    assert isinstance(seconds, float) and 0.0 < seconds < 10.0


@pytest.mark.parametrize(
    "chunks, spans_ms",
    [
        # One chunk: forward x up + y down; kernel gradient x, dy up + dw, db down; input
        # gradient dy up + dx down (kernels and bias go up through cp.asarray: untimed here).
        (1, 2 + 4 + 2),
        # Four chunks of one image, two on each stream at once: each stream's copies count,
        # the other stream's overlapping ones do not; the kernel gradient's final downloads
        # follow both streams.
        (4, 4 + 6 + 4),
    ],
)
def test_probe_is_gpu_time_from_cuda_events(device_kind, monkeypatch, chunks, spans_ms):
    """The probe reads the GPU's clock through events around each operation, never the
    host's clock (which jumps an hour at every reading here)."""
    hours = itertools.count(0.0, 3600.0)
    monkeypatch.setattr(time, "perf_counter", lambda: next(hours))
    backend = CudaBackend(pipeline_chunks=chunks)
    shape = conv_shape((4, 3, 8, 8), (4, 3, 5, 5), "same")
    seconds = backend.time_step(shape, repeats=2)
    assert 0.0 < seconds < 10.0
    if device_kind == "fake":
        assert seconds == pytest.approx(spans_ms / 1e3)


def test_calls_outside_a_probe_read_no_events(fake_cupy, rng):
    backend = CudaBackend(pipeline_chunks=2)
    run_all(backend, make_problem(rng, 4, 3, 6, 6, 2, 3, 3, 1))
    assert fake_cupy.cuda.elapsed_reads == 0
    backend.time_step(conv_shape((4, 3, 6, 6), (2, 3, 3, 3), 1))
    assert fake_cupy.cuda.elapsed_reads > 0


# ----------------------------------------------------------- the fake catches races


def test_fake_catches_a_pipeline_that_does_not_wait(fake_cupy, monkeypatch, rng):
    """Proof that the fake would catch the races it is meant to: a pipeline that reuses a
    slot without waiting on its stream reads poisoned (not yet copied) results."""

    def settle_without_waiting(self, slot):
        slot.done = None  # forgot the wait
        if slot.deliver is not None:
            pinned, target = slot.deliver
            np.copyto(target, pinned)
            slot.deliver = None

    monkeypatch.setattr(CudaBackend, "_settle", settle_without_waiting)
    p = make_problem(rng, 6, 3, 6, 6, 2, 3, 3, 1)
    y = CudaBackend(pipeline_chunks=3).conv_forward(p.x, p.w, p.b, 1)
    assert np.isnan(y).any()


def test_fake_pins_staging_buffers_once(fake_cupy, rng):
    backend = CudaBackend(pipeline_chunks=4)
    problem = make_problem(rng, 8, 3, 6, 6, 2, 3, 3, 1)
    run_all(backend, problem)
    allocated = fake_cupy.cuda.pinned_allocations
    for _ in range(3):
        run_all(backend, problem)
    assert fake_cupy.cuda.pinned_allocations == allocated, "pinned buffers were not reused"
