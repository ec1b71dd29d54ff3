"""The array-module-generic convolutions (hetconv.backends.xpconv) with xp=numpy, against the
cpu backend, on every machine. The cuda backend runs this same code with xp=cupy.

Tolerance: both sides accumulate in float32 in different orders (one GEMM over C*kh*kw or
N*Ho*Wo terms here, row-group GEMMs there), so results are compared to
``2e-5 * max(1, max|cpu result|)``; the cpu backend itself is checked against a float64
reference in test_backend_cpu.py.
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from backend_cases import assert_close, make_problem
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from hetconv.backends import CpuBackend, Padding, conv_shape, xpconv

RTOL = 2e-5


def _problem(rng, n, c, h, w, k, kh, kw, padding):
    """(shape, x, kernels, bias, dy) of a random problem (see backend_cases.make_problem)."""
    problem = make_problem(rng, n, c, h, w, k, kh, kw, padding)
    return (problem.shape, *problem.arrays)


def _assert_matches(got: np.ndarray, expected: np.ndarray, what: str) -> None:
    assert_close(got, expected, what, RTOL)


def check_against_cpu(cpu: CpuBackend, rng, n, c, h, w, k, kh, kw, padding) -> None:
    """All three operations (and forward without bias) of xpconv vs the cpu backend."""
    problem = make_problem(rng, n, c, h, w, k, kh, kw, padding)
    original = problem.copy()
    shape = problem.shape
    x, wt, b, dy = problem.arrays
    pad = shape.padding.sides

    _assert_matches(xpconv.forward(np, x, wt, b, shape), cpu.conv_forward(x, wt, b, pad), "fwd")
    _assert_matches(
        xpconv.forward(np, x, wt, None, shape), cpu.conv_forward(x, wt, None, pad), "fwd no bias"
    )
    _assert_matches(
        xpconv.grad_input(np, dy, wt, shape),
        cpu.conv_grad_input(dy, wt, (h, w), pad),
        "grad input",
    )
    dw, db = xpconv.grad_kernels(np, x, dy, shape)
    ref_dw, ref_db = cpu.conv_grad_kernels(x, dy, (kh, kw), pad)
    _assert_matches(dw, ref_dw, "grad kernels")
    _assert_matches(db, ref_db, "grad bias")
    problem.assert_unchanged(original, "xpconv")


@pytest.fixture(scope="module")
def cpu() -> CpuBackend:
    return CpuBackend()


GRID = [
    # (N, C, H, W, K, kh, kw, padding)
    pytest.param(2, 3, 6, 7, 4, 1, 1, 0, id="1x1"),
    pytest.param(2, 16, 5, 5, 3, 1, 1, 2, id="1x1-pad2"),
    pytest.param(3, 3, 7, 6, 4, 3, 3, 1, id="3x3-pad1"),
    pytest.param(2, 16, 8, 8, 5, 3, 3, "valid", id="3x3-valid"),
    pytest.param(2, 3, 8, 8, 4, 5, 5, "same", id="5x5-same"),
    pytest.param(2, 16, 9, 7, 3, 5, 5, 2, id="5x5-c16"),
    pytest.param(2, 3, 6, 6, 2, 2, 2, "same", id="2x2-same-even"),
    pytest.param(2, 16, 6, 7, 3, 4, 4, "same", id="4x4-same-even"),
    pytest.param(2, 3, 7, 6, 3, 2, 3, (1, 0), id="2x3-tuple2"),
    pytest.param(2, 3, 6, 5, 2, 3, 3, (0, 2, 1, 0), id="asym-bottom-left"),
    pytest.param(2, 16, 5, 5, 2, 3, 3, (3, 0, 0, 3), id="asym-top-right-only"),
    pytest.param(2, 3, 4, 4, 2, 5, 5, (2, 3, 1, 4), id="asym-kernel-larger-than-image"),
    pytest.param(2, 3, 4, 4, 2, 3, 3, 4, id="padding-larger-than-kernel"),
    pytest.param(3, 1, 6, 6, 2, 3, 3, "same", id="c1"),
    pytest.param(1, 1, 5, 5, 1, 3, 3, 0, id="c1-k1-n1"),
    pytest.param(2, 16, 6, 6, 1, 5, 5, "same", id="k1"),
    pytest.param(1, 16, 7, 6, 4, 3, 3, 1, id="n1"),
    pytest.param(1, 3, 6, 6, 3, 5, 5, "same", id="n1-5x5"),
    pytest.param(2, 2, 1, 1, 3, 1, 1, 0, id="1x1-image"),
    pytest.param(2, 3, 1, 8, 2, 1, 3, (0, 0, 1, 1), id="one-row"),
]


@pytest.mark.parametrize("n, c, h, w, k, kh, kw, padding", GRID)
def test_against_cpu_grid(cpu, rng, n, c, h, w, k, kh, kw, padding):
    check_against_cpu(cpu, rng, n, c, h, w, k, kh, kw, padding)


@st.composite
def conv_problems(draw):
    n = draw(st.integers(1, 3))
    c = draw(st.sampled_from([1, 2, 3, 5, 16]))
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


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problem=conv_problems(), seed=st.integers(0, 2**32 - 1))
def test_against_cpu_hypothesis(problem, seed):
    n, c, h, w, k, kh, kw, padding = problem
    p = Padding.resolve(padding, (kh, kw))
    assume(h + p.top + p.bottom >= kh and w + p.left + p.right >= kw)
    check_against_cpu(CpuBackend(), np.random.default_rng(seed), *problem)


# --------------------------------------------------------------------------------- float32


def test_outputs_stay_float32_with_numpy_scalars_around(rng):
    """Inputs that went through numpy scalar arithmetic (the usual source of silent float64)
    must still give float32, C-contiguous outputs; nothing inside promotes."""
    shape, x, wt, b, dy = _problem(rng, 2, 3, 6, 6, 4, 3, 3, "same")
    scale = np.float32(0.5)
    x, wt, b, dy = x * scale, wt * scale, b * scale, dy * scale
    assert {a.dtype for a in (x, wt, b, dy)} == {np.dtype(np.float32)}
    outputs = [
        xpconv.forward(np, x, wt, b, shape),
        xpconv.forward(np, x[:1], wt, None, conv_shape(x[:1].shape, wt.shape, "same")),
        xpconv.grad_input(np, dy, wt, shape),
        *xpconv.grad_kernels(np, x, dy, shape),
    ]
    for out in outputs:
        assert out.dtype == np.float32
        assert out.flags.c_contiguous


def test_rejects_float64_and_wrong_shapes(rng):
    shape, x, wt, b, dy = _problem(rng, 2, 3, 5, 5, 4, 3, 3, 1)
    with pytest.raises(TypeError, match="input has dtype float64"):
        xpconv.forward(np, x.astype(np.float64), wt, b, shape)
    with pytest.raises(TypeError, match="bias has dtype float64"):
        xpconv.forward(np, x, wt, b.astype(np.float64), shape)
    with pytest.raises(TypeError, match="output gradient has dtype float64"):
        xpconv.grad_input(np, dy.astype(np.float64), wt, shape)
    with pytest.raises(ValueError, match=r"input has shape \(1, 3, 5, 5\), expected \(2, 3"):
        xpconv.forward(np, x[:1], wt, b, shape)
    with pytest.raises(ValueError, match="kernels has shape"):
        xpconv.grad_input(np, dy, wt[:3], shape)
    with pytest.raises(ValueError, match="output gradient has shape"):
        xpconv.grad_kernels(np, x, dy[:, :3], shape)


# ------------------------------------------------------------------- memory accounting


# Three operands of numpy iterator buffers (8192 float32 each) and the call's Python objects.
_NUMPY_SLACK_BYTES = 3 * 8192 * 4 + 16 * 1024


@pytest.mark.parametrize(
    "n, c, h, w, k, kh, kw, padding",
    [
        (4, 16, 12, 12, 8, 5, 5, "same"),
        (4, 3, 32, 32, 32, 3, 3, 0),  # more kernels than taps: outputs dominate
        (1, 16, 24, 24, 8, 3, 3, (0, 2, 1, 0)),
        (3, 32, 24, 24, 16, 1, 1, 0),
    ],
)
def test_peak_values_bound_numpy_allocations(rng, n, c, h, w, k, kh, kw, padding):
    """What numpy really allocates (tracemalloc's peak, plus the caller's inputs) stays within
    peak_values, and not absurdly below it: the accounting the cuda backend budgets with.

    numpy-only extras are allowed for: a ufunc over non-contiguous or broadcast operands (the
    bias add, col2im's tap-adds) allocates iterator buffers of up to 8192 elements per
    operand, and tracemalloc also counts the Python objects of the call. cupy's elementwise
    kernels need no such buffers.
    """
    shape, x, wt, b, dy = _problem(rng, n, c, h, w, k, kh, kw, padding)
    predicted = xpconv.peak_values(shape)
    calls = {
        "forward": (lambda: xpconv.forward(np, x, wt, b, shape), x.nbytes + wt.nbytes + b.nbytes),
        "grad_input": (lambda: xpconv.grad_input(np, dy, wt, shape), dy.nbytes + wt.nbytes),
        "grad_kernels": (lambda: xpconv.grad_kernels(np, x, dy, shape), x.nbytes + dy.nbytes),
    }
    for name, (call, inputs_bytes) in calls.items():
        tracemalloc.start()
        try:
            tracemalloc.reset_peak()
            result = call()
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        del result
        used = peak + inputs_bytes
        bound = 4 * predicted[name]
        assert used <= bound + _NUMPY_SLACK_BYTES, (
            f"{name}: numpy used {used} bytes, peak_values says {bound}"
        )
        assert used >= bound // 2, f"{name}: numpy used {used} bytes, peak_values says {bound}"
    assert xpconv.workspace_values(shape) == max(predicted.values())


# --------------------------------------------------------- only what cupy also provides


class _RecordingModule:
    """numpy, recording which module-level names the generic code asks for."""

    def __init__(self) -> None:
        self.used: set[str] = set()

    def __getattr__(self, name: str):
        self.used.add(name)
        return getattr(np, name)


def test_generic_code_uses_only_names_cupy_has(rng):
    """Every ``xp.<name>`` xpconv touches exists in cupy too (cupy imports without a GPU)."""
    cupy = pytest.importorskip("cupy", reason="cupy is not installed (pip install cupy-cuda12x)")
    xp = _RecordingModule()
    shape, x, wt, b, dy = _problem(rng, 2, 3, 6, 6, 4, 3, 3, (1, 0, 2, 1))
    xpconv.forward(xp, x, wt, b, shape)
    xpconv.forward(xp, x, wt, None, shape)
    xpconv.grad_input(xp, dy, wt, shape)
    xpconv.grad_kernels(xp, x, dy, shape)
    assert xp.used >= {"float32", "matmul", "ascontiguousarray", "zeros", "empty", "lib"}
    missing = sorted(name for name in xp.used if not hasattr(cupy, name))
    assert not missing, f"xpconv uses xp.{missing}, which cupy does not provide"
    assert callable(cupy.lib.stride_tricks.as_strided)
