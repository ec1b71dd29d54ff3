"""What the backend test files share: random problems, running all three operations, and
comparing results within a tolerance scaled by their magnitude.

Imported by test_backends.py, test_backend_cpu.py, test_backend_cuda.py,
test_backend_opencl.py and test_xpconv.py (pytest puts this directory on ``sys.path``).

Tolerances: every comparison here is ``max|got - want| <= rtol * scale``, where ``scale`` is
``max(floor, max|want|)`` unless the caller gives it; each test file states its ``rtol`` and
``floor`` and why. :func:`term_scales` gives the scale of the summed terms instead of the
result's, for sums that may cancel.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hetconv.backends import Backend, ConvShape, CpuBackend, PaddingSpec, conv_shape

#: The results :func:`run_all` returns, in its order.
OPERATIONS = ("forward", "grad input", "grad kernels", "grad bias")


@dataclass
class Problem:
    """Random float32 inputs of all three operations on one geometry."""

    x: np.ndarray  # (N, C, H, W) input
    w: np.ndarray  # (K, C, kh, kw) kernels
    b: np.ndarray | None  # (K,) bias
    dy: np.ndarray  # (N, K, Ho, Wo) output gradient
    padding: PaddingSpec

    @property
    def shape(self) -> ConvShape:
        return conv_shape(self.x.shape, self.w.shape, self.padding)

    @property
    def arrays(self) -> tuple[np.ndarray | None, ...]:
        return self.x, self.w, self.b, self.dy

    def without_bias(self) -> Problem:
        return Problem(self.x, self.w, None, self.dy, self.padding)

    def absolute(self) -> Problem:
        """The same problem on the absolute values: each operation then sums the magnitudes
        of its terms."""
        x, w, b, dy = (None if a is None else np.abs(a) for a in self.arrays)
        return Problem(x, w, b, dy, self.padding)

    def copy(self) -> Problem:
        x, w, b, dy = (None if a is None else a.copy() for a in self.arrays)
        return Problem(x, w, b, dy, self.padding)

    def assert_unchanged(self, original: Problem, who: str = "the backend") -> None:
        """Every array still equals ``original``'s (made with :meth:`copy` before the calls)."""
        for before, after in zip(original.arrays, self.arrays, strict=True):
            np.testing.assert_array_equal(before, after, err_msg=f"{who} modified an input")


def make_problem(
    rng: np.random.Generator,
    n: int,
    c: int,
    h: int,
    w: int,
    k: int,
    kh: int,
    kw: int,
    padding: PaddingSpec,
    bias: bool = True,
    out_hw: tuple[int, int] | None = None,
) -> Problem:
    """Standard-normal x, kernels, bias (unless ``bias`` is False: then none is drawn) and dy,
    drawn from ``rng`` in that order. ``out_hw`` is dy's (Ho, Wo); by default from
    :func:`~hetconv.backends.conv_shape` (the cpu tests compute it independently)."""
    if out_hw is None:
        out_hw = conv_shape((n, c, h, w), (k, c, kh, kw), padding).out_hw
    x = rng.standard_normal((n, c, h, w), dtype=np.float32)
    kernels = rng.standard_normal((k, c, kh, kw), dtype=np.float32)
    b = rng.standard_normal(k, dtype=np.float32) if bias else None
    dy = rng.standard_normal((n, k, *out_hw), dtype=np.float32)
    return Problem(x, kernels, b, dy, padding)


def run_all(backend: Backend, problem: Problem) -> tuple[np.ndarray, ...]:
    """(y, dx, dw, db): the forward, input-gradient and kernel-gradient calls of ``backend``
    on ``problem`` (see :data:`OPERATIONS`)."""
    p = problem
    kh, kw = p.w.shape[2:]
    y = backend.conv_forward(p.x, p.w, p.b, p.padding)
    dx = backend.conv_grad_input(p.dy, p.w, p.x.shape[2:], p.padding)
    dw, db = backend.conv_grad_kernels(p.x, p.dy, (kh, kw), p.padding)
    return y, dx, dw, db


def assert_close(
    got: np.ndarray,
    want: np.ndarray,
    what: str,
    rtol: float,
    floor: float = 1.0,
    scale: float | None = None,
) -> None:
    """``got`` is a float32, C-contiguous, finite array of ``want``'s shape, within
    ``rtol * scale`` of it everywhere; ``scale`` defaults to ``max(floor, max|want|)``."""
    assert isinstance(got, np.ndarray), f"{what}: a {type(got).__name__}, not an array"
    assert got.dtype == np.float32, f"{what}: dtype {got.dtype}"
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert got.flags.c_contiguous, f"{what}: not C-contiguous"
    assert np.isfinite(got).all(), f"{what}: non-finite values (read before the copy landed?)"
    if scale is None:
        scale = max(floor, float(np.abs(want).max()))
    err = float(np.abs(got.astype(np.float64) - want.astype(np.float64)).max())
    assert err <= rtol * scale, f"{what}: max error {err:.3g} > {rtol} * {scale:.3g}"


def assert_results_close(
    got: tuple[np.ndarray, ...],
    want: tuple[np.ndarray, ...],
    rtol: float,
    floor: float = 1.0,
    scales: tuple[float, ...] | None = None,
    what: str = "",
) -> None:
    """Each result of :func:`run_all` against ``want``'s (see :func:`assert_close`)."""
    for i, name in enumerate(OPERATIONS):
        scale = None if scales is None else scales[i]
        assert_close(got[i], want[i], f"{name}{what}", rtol, floor, scale)


def term_scales(reference: Backend, problem: Problem, floor: float = 1e-6) -> tuple[float, ...]:
    """Per operation, ``max(floor, max|result|)`` of it on the absolute inputs: the size of
    the terms it sums. A sum of O(1) terms may cancel to almost nothing, and float32
    round-off scales with the terms, not with the result (a bias gradient of -0.0021 from 15
    terms of size ~1 differs by 5e-7 between two summation orders)."""
    return tuple(max(floor, float(np.abs(r).max())) for r in run_all(reference, problem.absolute()))


def matches_cpu(
    backend: Backend,
    problem: Problem,
    rtol: float,
    floor: float = 1.0,
    cpu: Backend | None = None,
    what: str = "",
) -> tuple[np.ndarray, ...]:
    """All three operations of ``backend`` against the cpu backend's on ``problem`` (see
    :func:`assert_results_close`); returns ``backend``'s results."""
    got = run_all(backend, problem)
    want = run_all(cpu if cpu is not None else CpuBackend(), problem)
    assert_results_close(got, want, rtol, floor, what=what)
    return got
