"""The cpu backend against an independent float64 reference convolution, and its input checks.

The reference below loops over the kernel taps and contracts channels with einsum: no
lowering, no GEMM, no batching, so it shares nothing with the backend but the definition.

Tolerance: the backend accumulates in float32, so each result is compared with the float64
reference to ``1e-5 * max|reference|`` (the round-off of sums of a few thousand O(1) terms is
~1e-6 relative). Chunked and unchunked runs of the backend only differ in summation order,
so they must agree to ``1e-6 * max|result|``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from backend_cases import assert_close, assert_results_close, make_problem, run_all
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from hetconv.backends import (
    Backend,
    ConvShape,
    CpuBackend,
    DeviceInfo,
    Padding,
    available_backends,
    conv_shape,
    get_backend,
)

try:  # white-box helpers, used only to size scratch_bytes for exact chunk sizes
    from hetconv.backends.cpu import _Plan, _plan
except ImportError:  # pragma: no cover - the black-box sweep below still runs
    _Plan = _plan = None

REF_RTOL = 1e-5
#: A batch in chunks against whole: the same terms summed in another order. The kernel
#: gradient's 6 x 144 positions give a few ulps of its largest value (1.1e-6 with scipy 1.17's
#: OpenBLAS, 1e-6 before).
CHUNK_RTOL = 4e-6

# ------------------------------------------------------------------------ reference (float64)


def _sides(padding, kh: int, kw: int) -> tuple[int, int, int, int]:
    """Explicit (top, bottom, left, right), written out independently of Padding.resolve."""
    if padding == "valid":
        return 0, 0, 0, 0
    if padding == "same":  # PyTorch: the odd extra row/column goes to the bottom/right
        return (kh - 1) // 2, kh // 2, (kw - 1) // 2, kw // 2
    if isinstance(padding, int):
        return padding, padding, padding, padding
    if len(padding) == 2:
        return padding[0], padding[0], padding[1], padding[1]
    return tuple(padding)


def _pad(x: np.ndarray, sides) -> np.ndarray:
    top, bottom, left, right = sides
    return np.pad(x.astype(np.float64), ((0, 0), (0, 0), (top, bottom), (left, right)))


def ref_forward(x, w, b, padding):
    kh, kw = w.shape[2:]
    xp = _pad(x, _sides(padding, kh, kw))
    ho, wo = xp.shape[2] - kh + 1, xp.shape[3] - kw + 1
    y = np.zeros((x.shape[0], w.shape[0], ho, wo))
    w64 = w.astype(np.float64)
    for i in range(kh):
        for j in range(kw):
            y += np.einsum("nchw,kc->nkhw", xp[:, :, i : i + ho, j : j + wo], w64[:, :, i, j])
    if b is not None:
        y += b.astype(np.float64)[None, :, None, None]
    return y


def ref_grad_input(dy, w, input_hw, padding):
    kh, kw = w.shape[2:]
    top, bottom, left, right = _sides(padding, kh, kw)
    h, wd = input_hw
    ho, wo = dy.shape[2:]
    dxp = np.zeros((dy.shape[0], w.shape[1], h + top + bottom, wd + left + right))
    w64, dy64 = w.astype(np.float64), dy.astype(np.float64)
    for i in range(kh):
        for j in range(kw):
            dxp[:, :, i : i + ho, j : j + wo] += np.einsum("nkhw,kc->nchw", dy64, w64[:, :, i, j])
    return dxp[:, :, top : top + h, left : left + wd]


def ref_grad_kernels(x, dy, kernel_hw, padding):
    kh, kw = kernel_hw
    xp = _pad(x, _sides(padding, kh, kw))
    ho, wo = dy.shape[2:]
    dy64 = dy.astype(np.float64)
    dw = np.zeros((dy.shape[1], x.shape[1], kh, kw))
    for i in range(kh):
        for j in range(kw):
            dw[:, :, i, j] = np.einsum("nkhw,nchw->kc", dy64, xp[:, :, i : i + ho, j : j + wo])
    return dw, dy64.sum(axis=(0, 2, 3))


def _out_hw(h, w, kh, kw, padding):
    top, bottom, left, right = _sides(padding, kh, kw)
    return h + top + bottom - kh + 1, w + left + right - kw + 1


def check_against_reference(backend: Backend, rng, n, c, h, w, k, kh, kw, padding):
    """All three operations of ``backend`` against the reference; returns the problem and
    the results."""
    # dy's size from the reference's own geometry, not the backend's conv_shape.
    out_hw = _out_hw(h, w, kh, kw, padding)
    problem = make_problem(rng, n, c, h, w, k, kh, kw, padding, out_hw=out_hw)
    original = problem.copy()
    results = run_all(backend, problem)
    problem.assert_unchanged(original)
    x, wt, b, dy = problem.arrays
    reference = (
        ref_forward(x, wt, b, padding),
        ref_grad_input(dy, wt, (h, w), padding),
        *ref_grad_kernels(x, dy, (kh, kw), padding),
    )
    assert_results_close(results, reference, REF_RTOL)
    # Without bias, the forward is the biased one minus the bias.
    y0 = backend.conv_forward(x, wt, None, padding)
    assert_close(y0, ref_forward(x, wt, None, padding), "forward without bias", REF_RTOL)
    return problem, results


def _lowering_mode(c: int, kw: int) -> str:
    from hetconv.backends.cpu import _FULL_LOWERING_BELOW

    return "row" if kw * c >= _FULL_LOWERING_BELOW else "full"


# --------------------------------------------------------------------------------- the grid

GRID = [
    # (N, C, H, W, K, kh, kw, padding)
    pytest.param(1, 1, 5, 5, 1, 3, 3, 0, id="all-ones"),
    pytest.param(1, 3, 6, 6, 1, 3, 3, 1, id="one-kernel"),
    pytest.param(1, 2, 6, 7, 4, 3, 3, 1, id="one-image"),
    pytest.param(3, 1, 6, 6, 2, 3, 3, "same", id="one-channel"),
    pytest.param(2, 3, 8, 8, 4, 5, 5, "same", id="5x5-full"),
    pytest.param(2, 20, 8, 7, 3, 5, 5, "same", id="5x5-row"),
    pytest.param(3, 2, 6, 6, 2, 1, 1, 0, id="1x1-full"),
    pytest.param(2, 70, 4, 5, 3, 1, 1, 0, id="1x1-row"),
    pytest.param(2, 70, 4, 5, 3, 1, 1, 1, id="1x1-row-pad1"),
    pytest.param(2, 4, 7, 6, 3, 2, 3, (1, 0), id="2x3-full-tuple2"),
    pytest.param(2, 40, 7, 6, 3, 2, 3, "same", id="2x3-row-same"),
    pytest.param(2, 3, 6, 6, 2, 4, 4, "same", id="4x4-full-same"),
    pytest.param(2, 20, 6, 6, 2, 4, 4, "same", id="4x4-row-same"),
    pytest.param(3, 20, 6, 5, 2, 4, 4, "valid", id="4x4-row-valid"),
    pytest.param(2, 2, 3, 3, 2, 5, 5, 2, id="kernel-larger-full"),
    pytest.param(2, 16, 2, 3, 2, 5, 5, (2, 3, 1, 4), id="kernel-larger-row-asym"),
    pytest.param(3, 5, 6, 5, 2, 3, 3, (0, 2, 1, 0), id="asym-full"),
    pytest.param(3, 30, 5, 5, 2, 3, 3, (3, 0, 0, 3), id="asym-row-top-only"),
    pytest.param(3, 30, 5, 5, 2, 3, 3, (0, 3, 2, 0), id="asym-row-bottom-only"),
    pytest.param(4, 1, 9, 9, 1, 3, 3, "valid", id="valid"),
    pytest.param(3, 3, 4, 4, 2, 3, 3, 4, id="pad-larger-than-kernel-full"),
    pytest.param(3, 30, 4, 4, 2, 1, 1, 3, id="pad-larger-than-kernel-row"),
    pytest.param(2, 2, 1, 1, 3, 1, 1, 0, id="1x1-image"),
    pytest.param(2, 13, 5, 4, 2, 5, 5, "same", id="full-row-boundary"),  # 5 * 13 = 65
    pytest.param(2, 12, 5, 4, 2, 5, 5, "same", id="full-row-boundary-below"),  # 60
    pytest.param(2, 4, 5, 4, 2, 4, 4, "same", id="full-row-boundary-16"),  # 4 * 4 = 16
    pytest.param(2, 3, 5, 4, 2, 5, 5, "same", id="full-row-boundary-15"),  # 15
    pytest.param(2, 8, 6, 5, 70, 3, 3, 1, id="kernels-last-70"),  # (K, positions) forward
    pytest.param(2, 24, 6, 6, 40, 3, 3, 1, id="row-correlation"),
]


@pytest.fixture(scope="module")
def backend() -> CpuBackend:
    # One backend for the module: its per-thread scratch buffers get reused across geometries.
    return CpuBackend()


@pytest.mark.parametrize("n, c, h, w, k, kh, kw, padding", GRID)
def test_against_reference_grid(backend, rng, n, c, h, w, k, kh, kw, padding):
    problem, results = check_against_reference(backend, rng, n, c, h, w, k, kh, kw, padding)
    # Batch chunking: scratch_bytes=1 forces one image per chunk.
    chunked = run_all(CpuBackend(scratch_bytes=1), problem)
    assert_results_close(chunked, results, CHUNK_RTOL, what=" (chunked)")


def test_grid_covers_both_lowering_modes():
    modes = {_lowering_mode(p.values[1], p.values[6]) for p in GRID}
    assert modes == {"row", "full"}


@pytest.mark.parametrize("scratch", [1, 2**12, 2**14, 2**15, 2**16, 2**17, 2**18])
@pytest.mark.parametrize("c", [3, 30], ids=["full", "row"])
def test_scratch_sweep(rng, c, scratch):
    """Any scratch bound gives the reference results (5 images: chunks of 1, 2, 3, 5 ...)."""
    check_against_reference(CpuBackend(scratch_bytes=scratch), rng, 5, c, 6, 6, 3, 3, 3, 1)


@pytest.mark.skipif(_plan is None, reason="the cpu backend's private _plan/_Plan changed")
@pytest.mark.parametrize("per_chunk", [1, 2, 3, 4])
@pytest.mark.parametrize("c", [3, 30], ids=["full", "row"])
def test_exact_chunk_sizes(rng, c, per_chunk):
    """5 images in chunks of exactly 1 .. 4 (so the last chunk is smaller for 2, 3 and 4)."""
    shape = conv_shape((5, c, 6, 6), (3, c, 3, 3), 1)
    layout = _plan(shape, 2**40)
    assert layout.images == 5
    assert layout.rows_per_group == (3 if _lowering_mode(c, 3) == "full" else 1)
    scratch = _Plan(shape, per_chunk, layout.rows_per_group).scratch_bytes()
    assert _plan(shape, scratch).images == per_chunk
    check_against_reference(CpuBackend(scratch_bytes=scratch), rng, 5, c, 6, 6, 3, 3, 3, 1)


def _forward_orientation(n, c, h, w, k, kh, kw, padding) -> str:
    shape = conv_shape((n, c, h, w), (k, c, kh, kw), padding)
    return "positions-first" if _plan(shape, 2**40).positions_first else "kernels-first"


def test_grid_covers_both_forward_orientations():
    """The forward's GEMM writes (positions, K) for a few kernels of enough terms and
    (K, positions) otherwise; the grid checks both against the reference."""
    used = {_forward_orientation(*p.values) for p in GRID}
    assert used == {"positions-first", "kernels-first"}


@pytest.mark.skipif(_plan is None, reason="the cpu backend's private _plan/_Plan changed")
def test_a_batch_runs_in_cache_sized_chunks(rng, monkeypatch):
    """However large ``scratch_bytes``, a batch whose scratch exceeds ``CHUNK_BYTES`` runs in
    chunks of about that size (still in the caches when the GEMMs read them), but of at least
    ``CHUNK_POSITIONS`` output positions, with the reference's results, equal to one chunk's
    up to summation order."""
    import hetconv.backends.cpu as cpu

    shape = conv_shape((6, 32, 12, 12), (8, 32, 3, 3), 1)  # rows lowered (kw * C >= 64)
    one = _Plan(shape, 1, 1).scratch_bytes()
    monkeypatch.setattr(cpu, "CHUNK_BYTES", 2 * one)
    results, problem = {}, None
    try:
        for positions, images in ((0, 2), (3 * 144, 3), (10**9, 6)):
            monkeypatch.setattr(cpu, "CHUNK_POSITIONS", positions)
            _plan.cache_clear()
            assert _plan(shape, 2**40).images == images
            if problem is None:  # in chunks of 2, against the reference
                problem, results[images] = check_against_reference(
                    CpuBackend(), rng, 6, 32, 12, 12, 8, 3, 3, 1
                )
            else:
                results[images] = run_all(CpuBackend(), problem)
    finally:
        _plan.cache_clear()
    assert_results_close(results[2], results[6], CHUNK_RTOL, what=" (chunks of 2 images)")
    assert_results_close(results[3], results[6], CHUNK_RTOL, what=" (chunks of 3 images)")


def test_scratch_reuse_across_geometries(rng):
    backend = CpuBackend()
    for shape in [(3, 30, 8, 8, 4, 5, 5, 2), (1, 2, 3, 3, 1, 3, 3, 0), (3, 30, 8, 8, 4, 5, 5, 2)]:
        check_against_reference(backend, rng, *shape)


def test_threads_get_their_own_scratch(rng):
    backend = CpuBackend()
    shapes = [(2, 20, 7, 7, 3, 3, 3, 1), (3, 4, 5, 6, 2, 5, 5, "same")]
    errors: list[BaseException] = []

    def work(shape, seed):
        try:
            local = np.random.default_rng(seed)
            for _ in range(5):
                check_against_reference(backend, local, *shape)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(s, i)) for i, s in enumerate(shapes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


# ------------------------------------------------------------------------------ hypothesis


@st.composite
def conv_problems(draw):
    n = draw(st.integers(1, 3))
    c = draw(st.sampled_from([1, 2, 3, 5, 13, 24, 40, 70]))
    h, w = draw(st.integers(1, 7)), draw(st.integers(1, 7))
    k = draw(st.integers(1, 4))
    kh, kw = draw(st.integers(1, 5)), draw(st.integers(1, 5))
    padding = draw(
        st.one_of(
            st.sampled_from(["same", "valid"]),
            st.integers(0, 3),
            st.tuples(st.integers(0, 3), st.integers(0, 3)),
            st.tuples(*[st.integers(0, 3)] * 4),
        )
    )
    return n, c, h, w, k, kh, kw, padding


_HYPOTHESIS_BACKENDS = {"plain": CpuBackend(), "chunked": CpuBackend(scratch_bytes=1)}


@settings(max_examples=75, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problem=conv_problems(), seed=st.integers(0, 2**32 - 1))
def test_against_reference_hypothesis(problem, seed):
    n, c, h, w, k, kh, kw, padding = problem
    ho, wo = _out_hw(h, w, kh, kw, padding)
    assume(ho >= 1 and wo >= 1)
    for backend in _HYPOTHESIS_BACKENDS.values():
        check_against_reference(backend, np.random.default_rng(seed), *problem)


# ------------------------------------------------------------------------------- bad input


def _ok(rng):
    """Valid x (2, 3, 5, 5), kernels (4, 3, 3, 3), bias and dy (2, 4, 5, 5) for padding 1."""
    return make_problem(rng, 2, 3, 5, 5, 4, 3, 3, 1).arrays


def test_rejects_float64(backend, rng):
    x, w, b, dy = _ok(rng)
    with pytest.raises(TypeError, match="input has dtype float64"):
        backend.conv_forward(x.astype(np.float64), w, b, 1)
    with pytest.raises(TypeError, match="kernels has dtype float64"):
        backend.conv_forward(x, w.astype(np.float64), b, 1)
    with pytest.raises(TypeError, match="bias has dtype float64"):
        backend.conv_forward(x, w, b.astype(np.float64), 1)
    with pytest.raises(TypeError, match="output gradient has dtype float64"):
        backend.conv_grad_input(dy.astype(np.float64), w, (5, 5), 1)
    with pytest.raises(TypeError, match="output gradient has dtype float64"):
        backend.conv_grad_kernels(x, dy.astype(np.float64), (3, 3), 1)


def test_rejects_non_arrays(backend, rng):
    x, w, b, _ = _ok(rng)
    with pytest.raises(TypeError, match="numpy array"):
        backend.conv_forward(x.tolist(), w, b, 1)


def test_rejects_non_contiguous(backend, rng):
    x, w, b, dy = _ok(rng)
    with pytest.raises(ValueError, match="input is not C-contiguous"):
        backend.conv_forward(x.transpose(0, 1, 3, 2), w, b, 1)
    with pytest.raises(ValueError, match="kernels is not C-contiguous"):
        backend.conv_forward(x, np.asfortranarray(w), b, 1)
    with pytest.raises(ValueError, match="bias is not C-contiguous"):
        backend.conv_forward(x, w, np.repeat(b, 2)[::2], 1)
    with pytest.raises(ValueError, match="output gradient is not C-contiguous"):
        backend.conv_grad_input(dy[:, :, :, ::-1], w, (5, 5), 1)
    with pytest.raises(ValueError, match="input is not C-contiguous"):
        backend.conv_grad_kernels(x[:, :, ::-1], dy, (3, 3), 1)


def test_rejects_wrong_ndim(backend, rng):
    x, w, b, _ = _ok(rng)
    with pytest.raises(ValueError, match="dimensions"):
        backend.conv_forward(x[0], w, b, 1)
    with pytest.raises(ValueError, match="dimensions"):
        backend.conv_forward(x, w, b[None], 1)


def test_rejects_channel_mismatch(backend, rng):
    x, w, b, dy = _ok(rng)
    with pytest.raises(ValueError, match="channels"):
        backend.conv_forward(x[:, :2].copy(), w, b, 1)
    with pytest.raises(ValueError, match="channels"):
        backend.conv_forward(x, w[:, :2].copy(), b, 1)


def test_rejects_wrong_output_gradient_shape(backend, rng):
    x, w, _, dy = _ok(rng)
    with pytest.raises(ValueError, match="output gradient has shape"):
        backend.conv_grad_input(dy, w, (6, 5), 1)  # expects Ho = 6
    with pytest.raises(ValueError, match="output gradient has shape"):
        backend.conv_grad_input(dy[:, :3].copy(), w, (5, 5), 1)  # 3 maps for 4 kernels
    with pytest.raises(ValueError, match="output gradient has shape"):
        backend.conv_grad_kernels(x, dy[:1].copy(), (3, 3), 1)  # 1 image for 2
    with pytest.raises(ValueError, match="output gradient has shape"):
        backend.conv_grad_kernels(x, dy, (3, 3), 0)  # valid output is 3x3


def test_rejects_wrong_bias_length(backend, rng):
    x, w, b, _ = _ok(rng)
    with pytest.raises(ValueError, match="bias"):
        backend.conv_forward(x, w, b[:3].copy(), 1)


@pytest.mark.parametrize("padding", [-1, (1, -1), (0, 0, -2, 0)])
def test_rejects_negative_padding(backend, rng, padding):
    x, w, b, dy = _ok(rng)
    with pytest.raises(ValueError, match="negative"):
        backend.conv_forward(x, w, b, padding)
    with pytest.raises(ValueError, match="negative"):
        backend.conv_grad_kernels(x, dy, (3, 3), padding)


@pytest.mark.parametrize("padding", ["full", "SAME", (1, 2, 3), [1, 1], 1.5, None])
def test_rejects_bad_padding_spec(backend, rng, padding):
    x, w, b, _ = _ok(rng)
    with pytest.raises(ValueError, match="padding"):
        backend.conv_forward(x, w, b, padding)


def test_rejects_kernel_that_does_not_fit(backend, rng):
    x, _, b, _ = _ok(rng)
    w = rng.standard_normal((4, 3, 7, 3), dtype=np.float32)
    with pytest.raises(ValueError, match="does not fit"):
        backend.conv_forward(x, w, b, 0)


def test_rejects_empty_arrays(backend):
    x = np.zeros((0, 3, 5, 5), np.float32)
    w = np.zeros((4, 3, 3, 3), np.float32)
    with pytest.raises(ValueError, match="empty"):
        backend.conv_forward(x, w, None, 1)


def test_rejects_non_positive_scratch():
    with pytest.raises(ValueError, match="scratch_bytes"):
        CpuBackend(scratch_bytes=0)


# -------------------------------------------------------------------------- geometry helpers


def test_padding_resolve():
    assert Padding.resolve("valid", (5, 5)) == Padding(0, 0, 0, 0)
    assert Padding.resolve("same", (5, 3)) == Padding(2, 2, 1, 1)
    assert Padding.resolve("same", (4, 2)) == Padding(1, 2, 0, 1)
    assert Padding.resolve(2, (3, 3)) == Padding(2, 2, 2, 2)
    assert Padding.resolve(np.int64(1), (3, 3)) == Padding(1, 1, 1, 1)
    assert Padding.resolve((1, 2), (3, 3)) == Padding(1, 1, 2, 2)
    assert Padding.resolve((1, 2, 3, 4), (3, 3)) == Padding(1, 2, 3, 4)


def test_conv_shape_geometry():
    shape = conv_shape((2, 3, 8, 9), (4, 3, 5, 3), (2, 1, 0, 1))
    assert isinstance(shape, ConvShape)
    assert shape.out_hw == (8 + 3 - 5 + 1, 9 + 1 - 3 + 1)
    assert shape.flops_forward == 2 * 2 * 7 * 8 * 4 * 3 * 5 * 3


# ------------------------------------------------------------------------ describe, registry


def test_describe():
    info = CpuBackend().describe()
    assert isinstance(info, DeviceInfo)
    assert info.backend == "cpu" and info.kind == "cpu"
    assert isinstance(info.name, str) and info.name.strip()
    assert isinstance(info.memory_bytes, int) and info.memory_bytes > 0
    assert isinstance(info.cores, int) and info.cores >= 1


def test_get_backend():
    assert "cpu" in available_backends()
    assert isinstance(get_backend("cpu"), CpuBackend)
    assert isinstance(get_backend(), CpuBackend)
    assert isinstance(get_backend("auto"), CpuBackend)
    assert get_backend("cpu", scratch_bytes=1234).scratch_bytes == 1234


def test_get_backend_unknown_lists_available():
    with pytest.raises(ValueError, match="nope") as info:
        get_backend("nope")
    for name in available_backends():
        assert name in str(info.value)


@pytest.mark.parametrize("padding", [2, (0, 1, 2, 3), "same"])
def test_time_step_positive(padding):
    shape = conv_shape((2, 3, 8, 8), (4, 3, 5, 5), padding)
    for with_grad_input in (True, False):
        seconds = CpuBackend().time_step(shape, repeats=2, with_grad_input=with_grad_input)
        assert isinstance(seconds, float)
        assert 0.0 < seconds < 10.0


# -- the GEMM: scipy's sgemm through ctypes, which releases the GIL -------------------------------


@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("through", ["ctypes", "f2py"])
def test_gemm_accumulates_in_place_for_every_transpose(trans_a, trans_b, through, monkeypatch):
    from hetconv.backends import cpu

    if through == "f2py":
        monkeypatch.setattr(cpu, "_SGEMM", None)  # the fallback where no capsule is found
    else:
        assert cpu._SGEMM is not None, "scipy's cython_blas sgemm capsule was not found"
    rng = np.random.default_rng(1)
    rows = rng.standard_normal((9, 12), dtype=np.float32)
    a = rows[:5, :7] if trans_a else rows[:7, :5]  # rows of a wider array: a strided operand
    b = rng.standard_normal((6, 5) if trans_b else (5, 6), dtype=np.float32)
    out = rng.standard_normal((7, 6), dtype=np.float32)
    before, address = out.copy(), out.ctypes.data
    cpu._gemm(a, b, out, trans_a, trans_b, beta=1.0)
    want = (a.T if trans_a else a).astype(np.float64) @ (b.T if trans_b else b) + before
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    assert out.ctypes.data == address
    cpu._gemm(a, b, out, trans_a, trans_b, beta=0.0)
    np.testing.assert_allclose(out, want - before, rtol=1e-5, atol=1e-5)


def test_gemm_lets_other_threads_run():
    # A thread streaming tensors to other workers needs the GIL for every chunk; the master's
    # GEMM must not hold it. While three long GEMMs run on another thread, this one keeps
    # running (f2py's sgemm stops it for each whole GEMM).
    from hetconv.backends import cpu

    n = 2048  # ~0.1-0.3 s per GEMM here: far longer than any scheduling pause
    a = np.ones((n, n), np.float32)
    out = np.empty((n, n), np.float32)
    window: list[float] = []

    def gemm():
        start = time.perf_counter()
        for _ in range(3):
            cpu._gemm(a, a, out)
        window.extend((start, time.perf_counter()))

    ticks = []
    thread = threading.Thread(target=gemm)
    thread.start()
    while thread.is_alive():
        ticks.append(time.perf_counter())
    thread.join()
    start, end = window
    inside = [t for t in ticks if start <= t <= end]
    edges = [start, *inside, end]
    # Time this thread stood still for over 20 ms at a stretch: with the GIL held, nearly the
    # whole window; released, ~0 (a busy machine may pause a thread now and then, not for half).
    stalled = sum(gap for gap in np.diff(edges) if gap > 0.02)
    assert stalled < 0.5 * (end - start), (stalled, end - start)
    assert out[0, 0] == n


def test_a_kernel_memo_lays_the_kernels_out_once_for_its_calls():
    """Inside one memo the kernels are rearranged once for every call that uses them (the
    forward and the input gradient by col2im, kept for many channels, share the layout);
    outside it, every call does its own."""
    rng = np.random.default_rng(11)
    backend = CpuBackend()
    x = rng.standard_normal((4, 80, 8, 8), dtype=np.float32)
    w = rng.standard_normal((6, 80, 5, 5), dtype=np.float32)
    dy = rng.standard_normal((4, 6, 8, 8), dtype=np.float32)
    calls = []
    real = backend._grouped_kernels.__func__

    def counted(self, plan, kernels, *flipped):
        layout = real(self, plan, kernels, *flipped)
        calls.append(layout.ctypes.data)
        return layout

    backend._grouped_kernels = counted.__get__(backend)
    memo = backend.kernel_memo()
    for rows in (slice(0, 2), slice(2, 4)):
        with memo:
            backend.conv_forward(x[rows], w, None, 2)
            backend.conv_grad_input(dy[rows], w, (8, 8), 2)
    assert len(memo.layouts) == 1 and len(set(calls)) == 1 and len(calls) == 4
    whole = backend.conv_forward(x, w, None, 2)  # outside: the thread's scratch, not the memo's
    assert calls[-1] not in calls[:4]
    assert_close(whole, CpuBackend().conv_forward(x, w, None, 2), "after the memo", 1e-6)


def _formulation(n, c, h, w, k, kh, kw, padding) -> str:
    from hetconv.backends.cpu import _correlation_shape

    shape = conv_shape((n, c, h, w), (k, c, kh, kw), padding)
    return "col2im" if _correlation_shape(shape) is None else "correlation"


def test_grid_covers_both_input_gradient_formulations():
    """The grid checks the input gradient as col2im and as a full correlation against the
    reference, the correlation with asymmetric and one-sided padding too."""
    used = [(_formulation(*p.values), p.id) for p in GRID]
    assert {f for f, _ in used} == {"col2im", "correlation"}
    assert ("correlation", "asym-full") in used and ("correlation", "5x5-full") in used
    assert ("col2im", "pad-larger-than-kernel-full") in used


def test_resnet_stages_take_their_input_gradient_as_a_correlation():
    """ResNet's 16-, 32- and 64-channel 3x3 layers (row-lowered from 16 channels) run their
    input gradient as a correlation; VGG's 128 channels keep col2im."""
    for c, hw in ((16, 32), (32, 16), (64, 8)):
        assert _formulation(16, c, hw, hw, c, 3, 3, 1) == "correlation", c
    assert _formulation(16, 128, 8, 8, 256, 3, 3, 1) == "col2im"


@pytest.mark.parametrize(
    "c, k, padding",
    [(16, 16, 1), (8, 32, 1), (5, 4, (0, 2, 1, 0)), (16, 80, 1)],
    ids=["resnet-stage", "k-4x-c", "asym", "k-above-4x-c"],
)
def test_input_gradient_as_correlation_equals_col2im(c, k, padding):
    """A few-channel layer's input gradient as a full correlation with the flipped kernels
    equals col2im's to float32 round-off, inside a kernel memo too (whose forward layout is
    the unflipped kernels': the two are kept apart)."""
    rng = np.random.default_rng(5)
    backend = CpuBackend()
    x = rng.standard_normal((3, c, 8, 7), dtype=np.float32)
    w = rng.standard_normal((k, c, 3, 3), dtype=np.float32)
    y = backend.conv_forward(x, w, None, padding)
    dy = rng.standard_normal(y.shape, dtype=np.float32)
    shape = conv_shape(x.shape, w.shape, padding)
    col2im = backend._grad_input_col2im(dy, w, shape)
    assert_close(col2im, ref_grad_input(dy, w, (8, 7), padding), "col2im", REF_RTOL)
    with backend.kernel_memo():
        forward = backend.conv_forward(x, w, None, padding)
        dx = backend.conv_grad_input(dy, w, (8, 7), padding)
        again = backend.conv_forward(x, w, None, padding)
    assert_close(dx, col2im, "correlation against col2im", CHUNK_RTOL * 10)
    np.testing.assert_array_equal(forward, y)
    np.testing.assert_array_equal(again, y)


# ---------------------------------------------------------- benchmarks/conv_vs_torch.py's rows

BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "conv_vs_torch.py"
ROW_FIELDS = {"network", "layer", "kind", "batch", "threads", "cap", "cpu", "blas", "engine",
              "ours_s", "torch_s", "ratio"}  # fmt: skip


def _benchmark(*argv: str) -> subprocess.CompletedProcess:
    command = [sys.executable, str(BENCHMARK), *argv]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


def _rows(tmp_path, *caps: str) -> list[dict]:
    out = tmp_path / "rows.json"
    argv = ["--network", "tiny", "--batch", "2", "--threads", "1", "--repeats", "1"]
    argv += ["--kinds", "conv forward", "step", "--cap", *caps, "--json", str(out)]
    done = _benchmark(*argv)
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())
    for row in rows:
        assert set(row) == ROW_FIELDS
        assert row["ratio"] == pytest.approx(row["ours_s"] / row["torch_s"])
    return rows


TINY_ROWS = {("conv1", "conv forward"), ("conv2", "conv forward"), ("step", "step")}


@pytest.mark.slow
def test_conv_vs_torch_rows_carry_cap_none_uncapped(tmp_path):
    """On the tiny preset, uncapped (the default): every row carries cap "none"."""
    pytest.importorskip("torch")
    rows = _rows(tmp_path, "none")
    assert {r["cap"] for r in rows} == {"none"}
    assert {(r["layer"], r["kind"]) for r in rows} == TINY_ROWS


@pytest.mark.slow
@pytest.mark.skipif(
    os.geteuid() != 0 or not Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").exists(),
    reason="capping needs root and the cgroup v1 cpu controller mounted",
)
def test_conv_vs_torch_capped_rows_come_from_a_capped_child(tmp_path):
    """``--cap none 0.9``: the same rows again from a child capped at 0.9 of a core by a cgroup
    v1 cpu group, carrying cap 0.9; the group is gone afterwards."""
    pytest.importorskip("torch")
    before = set(Path("/sys/fs/cgroup/cpu").iterdir())
    rows = _rows(tmp_path, "none", "0.9")
    assert {r["cap"] for r in rows} == {"none", 0.9}
    for cap in ("none", 0.9):
        assert {(r["layer"], r["kind"]) for r in rows if r["cap"] == cap} == TINY_ROWS
    assert set(Path("/sys/fs/cgroup/cpu").iterdir()) == before


def test_conv_vs_torch_refuses_a_cap_that_is_not_a_fraction_of_a_core():
    pytest.importorskip("torch")
    done = _benchmark("--cap", "0")
    assert done.returncode == 2
    assert "'none' or a fraction of a core in (0, 64], got '0'" in done.stderr
