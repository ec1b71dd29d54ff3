"""Strided convolutions computed natively (oneDNN's strides, ``Backend.native_stride``) against
the same layers run as the stride-1 convolutions of their phases (``StridePhases``), which every
other backend and executor runs and which the cpu backend's tests check numerically.

Tolerance: test_backend_onednn.py's, ``2e-4`` of the magnitude of the summed terms (the two
compute the same sums in other orders: a strided kernel against its phases' taps).
"""

from __future__ import annotations

import platform

import numpy as np
import pytest
from backend_cases import assert_close, assert_results_close, make_problem, run_all

from hetconv.backends import CpuBackend, Padding, get_backend
from hetconv.conv import LocalConv, StridePhases
from hetconv.model import Model, load_spec

RTOL = 2e-4
pytestmark = pytest.mark.skipif(
    not (platform.system() == "Linux" and platform.machine() == "x86_64"),
    reason="oneDNN's wheel (onednn-cpu-gomp) is built for Linux x86-64 only",
)

# n, c, h, w, k, kh, kw, padding, stride
CASES = [
    (4, 16, 32, 32, 32, 3, 3, 1, (2, 2)),  # resnet20's stride-2 3x3 layer
    (4, 32, 16, 16, 64, 3, 3, 1, (2, 2)),  # and its second
    (4, 16, 32, 32, 32, 1, 1, 0, (2, 2)),  # a 1x1 shortcut
    (2, 3, 33, 33, 8, 7, 7, 3, (2, 2)),  # a 7x7 first layer on an odd size (resnet18's kind)
    (3, 5, 17, 13, 7, 3, 2, (0, 1, 2, 3), (3, 2)),  # odd sizes, asymmetric padding and stride
    (2, 4, 9, 9, 6, 5, 5, 2, (4, 4)),  # a stride near the kernel's size
    (1, 8, 8, 8, 4, 2, 2, 0, (3, 3)),  # a stride past the kernel: rows no tap reads
]


@pytest.fixture(scope="module")
def onednn():
    backend = get_backend("onednn")
    assert backend.native_stride
    return backend


def _phased(backend, problem, stride):
    """(y, dx, dw, db) of ``problem`` at ``stride`` through its phases on ``backend``."""
    x, w, b, dy = problem.arrays
    phases = StridePhases(
        tuple(x.shape[1:]), tuple(w.shape[2:]), Padding.resolve(problem.padding, w.shape[2:]),
        stride,
    )  # fmt: skip
    xe, we = phases.input(x), phases.kernels(w)
    y = backend.conv_forward(xe, we, b, 0)
    dx = phases.input_grad(backend.conv_grad_input(dy, we, xe.shape[2:], 0))
    dw, db = backend.conv_grad_kernels(xe, dy, we.shape[2:], 0)
    return y, dx, phases.kernel_grad(dw), db


def _native(backend, problem, stride):
    x, w, b, dy = problem.arrays
    y = backend.conv_forward(x, w, b, problem.padding, stride)
    dx = backend.conv_grad_input(dy, w, x.shape[2:], problem.padding, stride)
    dw, db = backend.conv_grad_kernels(x, dy, w.shape[2:], problem.padding, stride)
    return y, dx, dw, db


@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c[:7])) + f"s{c[8]}")
def test_strided_operations_equal_their_phases(onednn, case):
    *geometry, stride = case
    n, c, h, w, k, kh, kw, padding = geometry
    pads = Padding.resolve(padding, (kh, kw))
    out_hw = (
        (h + pads.top + pads.bottom - kh) // stride[0] + 1,
        (w + pads.left + pads.right - kw) // stride[1] + 1,
    )
    problem = make_problem(np.random.default_rng(7), *geometry, out_hw=out_hw)
    original = problem.copy()
    got = _native(onednn, problem, stride)
    problem.assert_unchanged(original)
    want = _phased(CpuBackend(), problem, stride)
    scales = tuple(
        max(1e-6, float(np.abs(r).max())) for r in _phased(CpuBackend(), problem.absolute(), stride)
    )
    assert_results_close(got, want, RTOL, scales=scales)
    # at stride 1 the keyword changes nothing
    plain = make_problem(np.random.default_rng(8), *geometry)
    for a, b in zip(_native(onednn, plain, (1, 1)), run_all(onednn, plain), strict=True):
        np.testing.assert_array_equal(a, b)


def test_the_phases_arithmetic_over_a_strided_kernels():
    def arithmetic(kernel, stride):
        return StridePhases((4, 16, 16), kernel, Padding.resolve(0, kernel), stride).arithmetic

    assert arithmetic((3, 3), (2, 2)) == pytest.approx(16 / 9)
    assert arithmetic((1, 1), (2, 2)) == 1
    assert arithmetic((7, 7), (2, 2)) == pytest.approx(64 / 49)
    assert arithmetic((3, 3), (3, 3)) == 1


def test_a_backend_without_strides_refuses_one_by_name():
    problem = make_problem(np.random.default_rng(0), 1, 2, 8, 8, 3, 3, 3, 1, out_hw=(4, 4))
    cpu = CpuBackend()
    assert not cpu.native_stride
    with pytest.raises(ValueError, match="cpu backend computes stride 1 only, got stride"):
        cpu.conv_forward(problem.x, problem.w, problem.b, 1, (2, 2))
    with pytest.raises(ValueError, match="stride 1 only"):
        cpu.conv_grad_input(problem.dy, problem.w, (8, 8), 1, (2, 2))
    with pytest.raises(ValueError, match="stride 1 only"):
        cpu.conv_grad_kernels(problem.x, problem.dy, (3, 3), 1, (2, 2))


def test_a_bad_stride_is_refused(onednn):
    problem = make_problem(np.random.default_rng(0), 1, 2, 8, 8, 3, 3, 3, 1)
    with pytest.raises(ValueError, match=r"stride \(0, 2\) must be >= 1"):
        onednn.conv_forward(problem.x, problem.w, problem.b, 1, (0, 2))
    with pytest.raises(ValueError, match="output gradient has shape"):  # dy of stride 1's size
        onednn.conv_grad_kernels(problem.x, problem.dy, (3, 3), 1, (2, 2))


class _Counting(LocalConv):
    """LocalConv that counts the strides its backend is called with."""

    def __init__(self, backend):
        super().__init__(backend)
        self.strides: list[tuple[int, int]] = []

    def forward(self, layer, x, w, b, padding, stride=(1, 1)):
        self.strides.append(tuple(stride))
        return super().forward(layer, x, w, b, padding, stride)


def test_resnet20_on_onednn_runs_its_strided_layers_natively_and_as_on_the_cpu_backend(onednn):
    """The model's 3x3 strided layers on LocalConv(onednn) get their own input, kernels and
    stride (its 1x1 shortcuts keep their phases: no more arithmetic); a forward and backward
    pass equals the cpu backend's (phases) within the tolerance."""
    spec = load_spec("resnet20")
    counting = _Counting(onednn)
    native, phased = Model(spec, seed=0, executor=counting), Model(spec, seed=0)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((4, 3, 32, 32), dtype=np.float32)
    labels = rng.integers(0, 10, 4)
    results = []
    for model in (native, phased):
        model.train()
        logits = model.forward(x)
        grad = np.zeros_like(logits)
        grad[np.arange(4), labels] = 1.0  # any fixed gradient of the logits
        model.backward(grad)
        results.append((logits, {n: g.copy() for n, g in model.gradients().items()}))
    assert counting.strides.count((2, 2)) == 2  # the two 3x3 layers
    (got, got_grads), (want, want_grads) = results
    assert_close(got, want, "logits", RTOL, scale=float(np.abs(want).max()) + 1.0)
    assert got_grads.keys() == want_grads.keys()
    for name, g in want_grads.items():
        assert_close(got_grads[name], g, name, 1e-3, scale=float(np.abs(g).max()) + 1e-3)
