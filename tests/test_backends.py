"""One test body for every backend: each is compared with the cpu backend.

Every known backend is a parameter; one that cannot run here (no package, no device) is
skipped with the reason the registry gives, never passed silently. The cpu backend takes part
too, compared with itself run in chunks of images (the shared batch-chunking path).

Tolerance: results agree with the cpu backend to ``2e-4 * max|cpu result|`` (different
summation orders of float32 sums with up to a few thousand terms; device GEMMs may block
differently or use fused multiply-adds).
"""

from __future__ import annotations

import numpy as np
import pytest
from backend_cases import assert_close, assert_results_close, make_problem, run_all, term_scales
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hetconv.backends import (
    KNOWN_BACKENDS,
    BackendUnavailable,
    CpuBackend,
    backend_class,
    conv_shape,
    get_backend,
)

RTOL = 2e-4

_cache: dict[str, object] = {}


def _backend(name: str):
    """One instance per backend for the whole module (device setup and kernel builds are slow)."""
    if name not in _cache:
        try:
            backend_class(name)
        except BackendUnavailable as e:
            _cache[name] = e
        else:
            if name == "cpu":
                # The cpu backend is the reference; as the subject it runs in chunks of images.
                backend = get_backend("cpu")
                backend.memory_limit = 1  # forces one image per call through the base class
                backend.working_set_bytes = lambda shape: shape.n  # type: ignore[method-assign]
                _cache[name] = backend
            else:
                _cache[name] = get_backend(name)
    got = _cache[name]
    if isinstance(got, BackendUnavailable):
        pytest.skip(str(got))
    return got


@pytest.fixture(params=sorted(KNOWN_BACKENDS))
def backend(request):
    return _backend(request.param)


REFERENCE = CpuBackend()


def _check_all(backend, n, c, h, w, k, kh, kw, padding, seed=0, bias=True):
    """All three operations against the cpu backend, to RTOL of their terms' magnitude."""
    problem = make_problem(np.random.default_rng(seed), n, c, h, w, k, kh, kw, padding, bias)
    assert_results_close(
        run_all(backend, problem),
        run_all(REFERENCE, problem),
        RTOL,
        scales=term_scales(REFERENCE, problem),
    )


GRID = [
    # n, c, h, w, k, kh, kw, padding
    (2, 3, 8, 8, 4, 3, 3, 1),
    (1, 1, 5, 5, 1, 1, 1, 0),
    (3, 3, 9, 7, 5, 5, 5, "same"),
    (2, 4, 6, 6, 3, 2, 2, "same"),  # even kernel: the extra row/column bottom/right
    (2, 2, 7, 9, 3, 3, 2, (0, 1, 2, 3)),  # asymmetric padding
    (2, 16, 8, 8, 7, 5, 5, 2),
    (1, 3, 32, 32, 8, 5, 5, "same"),  # the tiny preset's C1 at batch 1
    (2, 8, 16, 16, 16, 5, 5, "same"),  # its C2
    (4, 5, 6, 6, 1, 3, 3, "valid"),  # one kernel
    (2, 3, 4, 4, 2, 4, 4, "valid"),  # kernel as large as the image
]


@pytest.mark.parametrize("case", GRID, ids=lambda c: "x".join(map(str, c[:7])) + f"-p{c[7]}")
def test_grid_matches_cpu(backend, case):
    _check_all(backend, *case)


def test_forward_without_bias(backend):
    _check_all(backend, 2, 3, 6, 6, 4, 3, 3, 1, bias=False)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    n=st.integers(1, 3),
    c=st.integers(1, 6),
    h=st.integers(1, 10),
    w=st.integers(1, 10),
    k=st.integers(1, 6),
    kh=st.integers(1, 5),
    kw=st.integers(1, 5),
    pads=st.tuples(*[st.integers(0, 3)] * 4),
    seed=st.integers(0, 2**16),
)
def test_hypothesis_shapes_match_cpu(backend, n, c, h, w, k, kh, kw, pads, seed):
    top, bottom, left, right = pads
    if h + top + bottom < kh or w + left + right < kw:
        return  # the kernel does not fit: covered by the error test
    _check_all(backend, n, c, h, w, k, kh, kw, pads, seed=seed)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda b, x, w: b.conv_forward(x.astype(np.float64), w, None, 1), TypeError, "float64"),
        (lambda b, x, w: b.conv_forward(x[:, :, ::2], w, None, 1), ValueError, "contiguous"),
        (lambda b, x, w: b.conv_forward(x[:, :2].copy(), w, None, 1), ValueError, "channels"),
        (lambda b, x, w: b.conv_forward(x, w, np.zeros(3, np.float32), 1), ValueError, "bias"),
        (lambda b, x, w: b.conv_forward(x, w, None, -1), ValueError, "negative"),
        (
            lambda b, x, w: b.conv_grad_input(np.zeros((2, 4, 5, 5), np.float32), w, (6, 6), 1),
            ValueError,
            "output gradient",
        ),
    ],
)
def test_every_backend_rejects_bad_input_alike(backend, call, error, match):
    x = np.zeros((2, 3, 6, 6), np.float32)
    w = np.zeros((4, 3, 3, 3), np.float32)
    with pytest.raises(error, match=match):
        call(backend, x, w)


def test_describe_and_devices(backend):
    info = backend.describe()
    assert info.backend in KNOWN_BACKENDS
    assert info.name.strip() and info.memory_bytes > 0 and info.cores >= 1
    devices = type(backend).devices()
    assert devices and all(d.backend == info.backend for d in devices)


@pytest.fixture(params=sorted(set(KNOWN_BACKENDS) - {"cpu"}))
def device_backend(request):
    """The non-cpu backends (the cpu subject above always runs chunked)."""
    return _backend(request.param)


def test_memory_limit_runs_in_chunks_with_equal_results(device_backend):
    backend = device_backend
    rng = np.random.default_rng(3)
    x = rng.standard_normal((6, 4, 8, 8), dtype=np.float32)
    w = rng.standard_normal((5, 4, 3, 3), dtype=np.float32)
    b = rng.standard_normal(5, dtype=np.float32)
    whole = backend.conv_forward(x, w, b, 1)
    shape = conv_shape(x.shape, w.shape, 1)
    saved = backend.memory_limit
    try:
        backend.memory_limit = backend.working_set_bytes(
            conv_shape((2, 4, 8, 8), w.shape, 1)
        )  # two images per call
        images = backend._images_per_call(shape)
        assert 1 <= images < shape.n  # chunked (memory need may grow in steps, not linearly)
        assert backend.working_set_bytes(conv_shape((images, 4, 8, 8), w.shape, 1)) <= (
            backend.memory_limit
        )
        assert_close(backend.conv_forward(x, w, b, 1), whole, "chunked forward", RTOL, 1e-6)
    finally:
        backend.memory_limit = saved


@pytest.mark.parametrize("case", [GRID[2], GRID[5], GRID[6]], ids=["5x5", "16ch", "first"])
def test_image_groups_in_a_memo_and_a_gradient_sum_equal_the_whole_batch(backend, case):
    """A stage call's image groups (worker/overlap.py): every call inside one kernel memo, the
    kernel gradients added group by group; the results are the whole batch's to round-off,
    and a memo keeps no stale layout when other kernels come inside it."""
    n, c, h, w, k, kh, kw, padding = case
    problem = make_problem(np.random.default_rng(5), 2 * n + 1, c, h, w, k, kh, kw, padding)
    x, wt, b, dy = problem.x, problem.w, problem.b, problem.dy
    want = run_all(REFERENCE, problem)
    groups = [slice(0, n), slice(n, 2 * n), slice(2 * n, 2 * n + 1)]
    memo, total = backend.kernel_memo(), backend.kernel_gradient_sum()
    forward, grad_input = [], []
    for g in groups:
        with memo:
            forward.append(backend.conv_forward(x[g], wt, b, padding))
            grad_input.append(backend.conv_grad_input(dy[g], wt, (h, w), padding))
            total.add(x[g], dy[g], (kh, kw), padding)
    dw, db = total.result()
    got = (np.concatenate(forward), np.concatenate(grad_input), dw, db)
    assert_results_close(got, want, RTOL, scales=term_scales(REFERENCE, problem))
    other = np.ascontiguousarray(wt[::-1])  # other kernels, other address, same geometry
    with memo:
        flipped = backend.conv_forward(x, other, None, padding)
    assert_close(flipped, REFERENCE.conv_forward(x, other, None, padding), "memo", RTOL, 1e-6)


def test_a_gradient_sum_refuses_other_kernels_and_an_empty_result():
    total = REFERENCE.kernel_gradient_sum()
    with pytest.raises(ValueError, match="no part"):
        total.result()
    x = np.zeros((1, 3, 6, 6), np.float32)
    total.add(x, np.zeros((1, 4, 6, 6), np.float32), (3, 3), 1)
    with pytest.raises(ValueError, match="5 kernels .* a sum of 4"):
        total.add(x, np.zeros((1, 5, 6, 6), np.float32), (3, 3), 1)


def test_unknown_and_unavailable_backends_say_why():
    with pytest.raises(ValueError, match="unknown backend 'nope'"):
        get_backend("nope")
    for name in KNOWN_BACKENDS:
        try:
            backend_class(name)
        except BackendUnavailable as e:
            assert name in str(e) and len(str(e)) > len(name) + 10
