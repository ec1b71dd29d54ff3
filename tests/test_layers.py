"""Numerical gradient checks for every layer in hetconv.layers, plus their edge cases.

Each check compares the analytic gradient of the scalar ``f = sum(layer(x) * r)`` (``r`` a fixed
random tensor, so ``df/dy = r``) against central differences of ``f``. The maths runs in float32,
so the step is large (1e-2 .. 5e-2 on values of order 1) and the tolerance is float32-sized:
rtol 1e-2, atol 1e-3. ``f`` itself is accumulated in float64 from the float32 outputs, and the
step actually taken (after float32 rounding of ``x +- eps``) is used as the divisor.

A check that cannot fail is worthless, so every comparison also asserts that the analytic
gradient is well above the tolerance and that a 10% error in it would be caught.
"""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

import hetconv.conv
from hetconv.backends import conv_shape, onednn_layers
from hetconv.conv import ConvSpec, LocalConv, kernel_pair
from hetconv.layers import (
    AvgPool2d,
    BatchNorm2d,
    Conv2d,
    Dropout,
    GlobalAvgPool2d,
    ImageChunks,
    Linear,
    LocalResponseNorm,
    MaxPool2d,
    ReLU,
    chunked,
    saved_arrays,
    softmax_cross_entropy,
)

RTOL = 1e-2
ATOL = 1e-3
MAX_COORDS = 48  # coordinates checked per array; arrays at most this large are checked fully


# ------------------------------------------------------------------------------------ helpers


def _coords(shape: tuple[int, ...], rng: np.random.Generator) -> list[tuple[int, ...]]:
    size = int(np.prod(shape))
    flat = np.arange(size) if size <= MAX_COORDS else rng.choice(size, MAX_COORDS, replace=False)
    return [tuple(int(v) for v in np.unravel_index(i, shape)) for i in flat]


def _numeric(f, a: np.ndarray, coords, eps: float) -> np.ndarray:
    """Central differences of scalar ``f()`` w.r.t. ``a[c]`` for each c (``a`` edited in place)."""
    out = np.empty(len(coords))
    for i, c in enumerate(coords):
        old = a[c].copy()
        a[c] = old + np.float32(eps)
        hi = float(a[c])
        f_plus = f()
        a[c] = old - np.float32(eps)
        lo = float(a[c])
        f_minus = f()
        a[c] = old
        out[i] = (f_plus - f_minus) / (hi - lo)
    return out


def _assert_gradient(what: str, analytic: np.ndarray, numeric: np.ndarray) -> None:
    np.testing.assert_allclose(analytic, numeric, rtol=RTOL, atol=ATOL, err_msg=what)
    # The check must be able to fail: a non-trivial gradient, and a 10% error is detected.
    assert np.abs(analytic).max() > 20 * ATOL, f"{what}: gradient too small to be checked"
    assert not np.allclose(analytic * 1.1, numeric, rtol=RTOL, atol=ATOL), what


def check_layer(layer, x: np.ndarray, rng: np.random.Generator, params=(), eps: float = 1e-2):
    """Gradient-check ``layer`` at ``x`` w.r.t. its input and the named parameters."""
    y = layer.forward(x)
    assert y.dtype == np.float32
    r = rng.standard_normal(y.shape).astype(np.float32)
    dy = r.copy()
    dx = layer.backward(dy)
    assert np.array_equal(dy, r), "backward modified its output-gradient argument"
    grads = {name: layer.grads[name].copy() for name in params}

    def f() -> float:
        return float(np.sum(layer.forward(x).astype(np.float64) * r))

    targets = [("input", x, dx)] + [(n, layer.params[n], grads[n]) for n in params]
    for name, array, grad in targets:
        assert grad.shape == array.shape, name
        assert grad.dtype == np.float32, name
        coords = _coords(array.shape, rng)
        numeric = _numeric(f, array, coords, eps)
        analytic = np.array([grad[c] for c in coords], np.float64)
        _assert_gradient(f"{layer!r} d/d{name}", analytic, numeric)
    return y, dx


def _randn(rng, *shape, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


# ------------------------------------------------------------------------------------- Conv2d

CONV_CASES = [
    # (N, C, H, W, K, kernel, padding)
    pytest.param(2, 2, 5, 6, 3, 3, 1, id="3x3-pad1"),
    pytest.param(2, 2, 5, 5, 2, 3, "same", id="3x3-same"),
    pytest.param(2, 2, 6, 5, 3, 4, "same", id="4x4-same-even"),
    pytest.param(1, 3, 5, 6, 2, 2, "same", id="2x2-same-even"),
    pytest.param(2, 2, 5, 6, 2, (2, 3), "valid", id="2x3-valid"),
    pytest.param(2, 2, 6, 6, 2, 5, (2, 1, 0, 3), id="5x5-asym4"),
    pytest.param(2, 3, 4, 5, 2, 3, (1, 2), id="3x3-pad-tuple2"),
    pytest.param(2, 3, 4, 4, 3, 1, 0, id="1x1"),
    pytest.param(1, 2, 3, 3, 2, 5, 2, id="kernel-larger-than-input"),
    pytest.param(1, 24, 4, 4, 2, 3, 1, id="3x3-row-lowering"),  # kw * C >= 64
    pytest.param(2, 1, 4, 4, 1, 3, (3, 0, 0, 3), id="pad-exceeds-kernel"),
]


@pytest.mark.parametrize("n, c, h, w, k, kernel, padding", CONV_CASES)
def test_conv2d_gradients(rng, n, c, h, w, k, kernel, padding):
    layer = Conv2d("conv", c, k, kernel, padding)
    layer.params["weight"][...] = _randn(rng, *layer.params["weight"].shape)
    layer.params["bias"][...] = _randn(rng, k)
    x = _randn(rng, n, c, h, w)
    # The convolution is linear in each argument: a large step costs no truncation error.
    y, _ = check_layer(layer, x, rng, params=("weight", "bias"), eps=5e-2)
    assert y.shape == (n, *layer.output_shape((c, h, w)))


def test_conv2d_same_keeps_size_for_even_and_odd_kernels(rng):
    for kernel in (1, 2, 3, 4, 5, (2, 5), (4, 1)):
        layer = Conv2d("conv", 2, 3, kernel, "same")
        assert layer.output_shape((2, 7, 6)) == (3, 7, 6)
        assert layer.forward(_randn(rng, 1, 2, 7, 6)).shape == (1, 3, 7, 6)


def test_conv2d_first_layer_skips_input_gradient(rng):
    layer = Conv2d("conv1", 3, 4, 3, 1)
    layer.params["weight"][...] = _randn(rng, 4, 3, 3, 3)
    layer.need_input_grad = False
    y = layer.forward(_randn(rng, 2, 3, 5, 5))
    assert layer.backward(np.ones_like(y)) is None
    assert layer.grads["weight"].shape == (4, 3, 3, 3)
    np.testing.assert_allclose(layer.grads["bias"], np.full(4, y[0, 0].size * 2.0))


def test_conv2d_backward_before_forward_raises():
    layer = Conv2d("conv7", 1, 1, 3)
    with pytest.raises(RuntimeError, match="conv7"):
        layer.backward(np.zeros((1, 1, 1, 1), np.float32))


class Recording(LocalConv):
    """A local executor that notes each call's layer name and ``need_input_grad``."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple] = []

    def forward(self, layer, x, w, b, padding):
        self.calls.append(("forward", layer, padding))
        return super().forward(layer, x, w, b, padding)

    def backward(self, layer, x, w, dy, padding, need_input_grad):
        self.calls.append(("backward", layer, padding, need_input_grad))
        return super().backward(layer, x, w, dy, padding, need_input_grad)


def test_conv2d_runs_on_its_executor(rng):
    executor = Recording()
    layer = Conv2d("convX", 1, 2, 3, "same", executor)
    layer.need_input_grad = False
    y = layer.forward(_randn(rng, 1, 1, 4, 4))
    assert layer.backward(y) is None
    assert executor.calls == [("forward", "convX", "same"), ("backward", "convX", "same", False)]


def test_conv2d_spec_is_its_geometry():
    layer = Conv2d("conv3", 2, 5, (2, 3), (1, 0, 2, 1))
    with pytest.raises(RuntimeError, match="conv3"):
        layer.spec  # noqa: B018 (the model sets the input shape)
    layer.input_shape = (2, 6, 7)
    layer.need_input_grad = False
    spec = layer.spec
    assert spec == ConvSpec("conv3", (2, 6, 7), 5, (2, 3), (1, 0, 2, 1), need_input_grad=False)
    assert spec.weight_shape == layer.params["weight"].shape
    assert spec.output_shape == layer.output_shape((2, 6, 7))
    assert spec.shape(4) == conv_shape((4, 2, 6, 7), (5, 2, 2, 3), (1, 0, 2, 1))


def test_conv_spec_refuses_kernel_sizes_that_are_not_integers():
    assert kernel_pair(3) == (3, 3) and kernel_pair((2, 5)) == (2, 5)
    with pytest.raises(TypeError):
        kernel_pair((2.0, 3.0))
    with pytest.raises(TypeError):
        Conv2d("conv", 1, 1, (2.0, 3.0))


def test_local_conv_has_no_plan():
    assert LocalConv().plan_record() is None


def test_the_executor_seam_imports_nothing_from_the_layers():
    tree = ast.parse(Path(hetconv.conv.__file__).read_text(encoding="utf-8"))
    imported = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            imported.append(node.module or "")
        elif isinstance(node, ast.Import):
            imported.extend(alias.name for alias in node.names)
    assert not [name for name in imported if name.endswith("layers")], imported


# --------------------------------------------------------------------------------------- ReLU


@pytest.fixture(params=["onednn", "numpy"])
def layer_path(request):
    """ReLU and max pooling by oneDNN where it serves (hetconv/backends/onednn_layers.py), and
    by numpy."""
    before = onednn_layers.set_enabled(request.param == "onednn")
    yield request.param
    onednn_layers.set_enabled(before)


def test_relu_gradient(rng, layer_path):
    # Keep every input at least 5 steps away from the kink at 0.
    magnitude = rng.uniform(0.05, 2.0, size=(2, 3, 4, 5))
    x = (magnitude * rng.choice([-1.0, 1.0], size=magnitude.shape)).astype(np.float32)
    y, dx = check_layer(ReLU("relu"), x, rng)
    np.testing.assert_array_equal(y, np.maximum(x, 0))
    assert np.any(dx == 0) and np.any(dx != 0)


def test_relu_gradient_at_zero_is_zero(layer_path):
    layer = ReLU("relu")
    x = np.array([[-1.0, 0.0, 2.0]], np.float32)
    layer.forward(x)
    np.testing.assert_array_equal(layer.backward(np.ones_like(x)), [[0.0, 0.0, 1.0]])


@pytest.mark.parametrize("threads", [2, 3])
def test_relu_on_several_threads_is_bit_for_bit_one_threads(rng, layer_path, threads,
                                                            monkeypatch):  # fmt: skip
    """A ReLU over more than a part's bytes runs a range of images on each thread: the same
    output and gradient as on one, NaN kept and passed, zero's gradient 0; a non-contiguous
    gradient too."""
    import threading

    import hetconv.layers as layers

    x = rng.standard_normal((7, 3, 5, 5)).astype(np.float32)
    x[0, 0, 0, 0], x[6, 2, 4, 4], x[3, 1, 2, 2] = np.nan, 0.0, -0.0
    dy = rng.standard_normal(x.shape).astype(np.float32)
    whole = ReLU("relu")
    y, dx = whole.forward(x), whole.backward(dy)
    odd = np.asfortranarray(dy)  # not C-contiguous: the numpy path, into the ranges' rows
    dx_odd = ReLU("relu")
    dx_odd.forward(x)
    dx_odd = dx_odd.backward(odd)
    seen = set()
    real_maximum = np.maximum

    def maximum(*args, **kwargs):
        seen.add(threading.current_thread().name)
        return real_maximum(*args, **kwargs)

    monkeypatch.setattr(layers, "RELU_PART_BYTES", x[:1].nbytes)
    monkeypatch.setattr(layers, "blas_threads", lambda: threads)
    monkeypatch.setattr(layers.np, "maximum", maximum)
    parted = ReLU("relu")
    got_y = parted.forward(x)
    assert len(seen) >= 2  # ranges on the calling thread and the pool's
    np.testing.assert_array_equal(got_y, y)  # NaN where NaN
    np.testing.assert_array_equal(parted.backward(dy), dx)
    np.testing.assert_array_equal(parted.backward(odd), dx_odd)
    assert np.isnan(got_y[0, 0, 0, 0]) and dx[6, 2, 4, 4] == 0.0


# -------------------------------------------------------------------------- LocalResponseNorm

LRN_CASES = [
    # (size, channels, alpha, beta, k, input scale)
    pytest.param(5, 7, 1.0, 0.75, 1.0, 1.0, id="size5"),
    pytest.param(4, 6, 1.0, 0.75, 1.0, 1.0, id="size4-even"),
    pytest.param(5, 3, 0.5, 0.6, 2.0, 1.0, id="size5-fewer-channels"),
    pytest.param(4, 2, 1.0, 0.75, 1.0, 1.0, id="size4-fewer-channels"),
    pytest.param(6, 1, 1.0, 0.75, 1.0, 1.0, id="size6-one-channel"),
    pytest.param(3, 5, 2.0, 1.5, 0.5, 1.0, id="size3"),
    pytest.param(5, 6, 1e-4, 0.75, 1.0, 30.0, id="size5-default-params"),
]


@pytest.mark.parametrize("size, c, alpha, beta, k, scale", LRN_CASES)
def test_lrn_gradient(rng, size, c, alpha, beta, k, scale):
    layer = LocalResponseNorm("lrn", size=size, alpha=alpha, beta=beta, k=k)
    x = _randn(rng, 2, c, 3, 3, scale=scale)
    eps = 1e-2 * scale
    check_layer(layer, x, rng, eps=eps)
    # The normalisation term must matter at this tolerance, or a backward pass that drops
    # it (dx = dy * inv, as if the denominator were constant) would pass unnoticed.
    r = rng.standard_normal(x.shape).astype(np.float32)
    y = layer.forward(x)
    diag_only = r * (y / x)
    coords = _coords(x.shape, rng)

    def f() -> float:
        return float(np.sum(layer.forward(x).astype(np.float64) * r))

    numeric = _numeric(f, x, coords, eps)
    assert not np.allclose([diag_only[i] for i in coords], numeric, rtol=RTOL, atol=ATOL)


def _lrn_reference(x: np.ndarray, size: int, alpha: float, beta: float, k: float) -> np.ndarray:
    """Direct float64 LRN: channel window c - size//2 .. c + (size-1)//2, divided by size."""
    x = x.astype(np.float64)
    c = x.shape[1]
    out = np.empty_like(x)
    for ch in range(c):
        lo, hi = max(0, ch - size // 2), min(c - 1, ch + (size - 1) // 2)
        s = (x[:, lo : hi + 1] ** 2).sum(axis=1)
        out[:, ch] = x[:, ch] / (k + alpha / size * s) ** beta
    return out


@pytest.mark.parametrize("size, c", [(5, 7), (4, 6), (5, 2), (2, 3), (1, 4)])
def test_lrn_forward_matches_direct_formula(rng, size, c):
    x = _randn(rng, 2, c, 3, 4, scale=3.0)
    layer = LocalResponseNorm("lrn", size=size, alpha=0.3, beta=0.75, k=1.5)
    np.testing.assert_allclose(
        layer.forward(x), _lrn_reference(x, size, 0.3, 0.75, 1.5), rtol=1e-5, atol=1e-6
    )


def test_lrn_rejects_size_zero():
    with pytest.raises(ValueError, match="size"):
        LocalResponseNorm("lrn", size=0)


# ---------------------------------------------------------------------------------- MaxPool2d


def _distinct(rng, *shape, spacing: float = 0.1) -> np.ndarray:
    """Distinct values at least ``spacing`` apart, so a small step never changes an argmax."""
    size = int(np.prod(shape))
    return ((rng.permutation(size) - size / 2) * spacing).astype(np.float32).reshape(shape)


POOL_CASES = [
    # (kernel, stride, H, W)
    pytest.param(2, 2, 6, 6, id="2x2s2"),
    pytest.param(2, 2, 7, 5, id="2x2s2-odd"),
    pytest.param(3, 2, 7, 7, id="3x3s2-overlap"),
    pytest.param(3, 2, 8, 9, id="3x3s2-overlap-even-odd"),
    pytest.param(3, 3, 9, 9, id="3x3s3"),
    pytest.param(3, 3, 10, 11, id="3x3s3-leftover"),
    pytest.param(2, 1, 4, 5, id="2x2s1"),
    pytest.param(2, 3, 8, 8, id="2x2s3-gaps"),
]


@pytest.mark.parametrize("kernel, stride, h, w", POOL_CASES)
def test_maxpool_gradient(rng, layer_path, kernel, stride, h, w):
    layer = MaxPool2d("pool", kernel, stride)
    x = _distinct(rng, 2, 2, h, w)
    y, dx = check_layer(layer, x, rng)
    ho, wo = (h - kernel) // stride + 1, (w - kernel) // stride + 1
    assert y.shape == (2, 2, ho, wo)
    assert layer.output_shape((2, h, w)) == (2, ho, wo)
    # Forward against the direct definition.
    for i in range(ho):
        for j in range(wo):
            window = x[:, :, i * stride : i * stride + kernel, j * stride : j * stride + kernel]
            np.testing.assert_array_equal(y[:, :, i, j], window.max(axis=(2, 3)))
    # Rows/columns no window covers get no gradient.
    np.testing.assert_array_equal(dx[:, :, (ho - 1) * stride + kernel :], 0)
    np.testing.assert_array_equal(dx[:, :, :, (wo - 1) * stride + kernel :], 0)


def test_maxpool_ties_go_to_first_in_row_major_order(layer_path):
    layer = MaxPool2d("pool", 2, 2)
    x = np.array([[[[0, 0, 1, 3], [0, 0, 3, 0]]]], np.float32)
    y = layer.forward(x)
    np.testing.assert_array_equal(y, [[[[0, 3]]]])
    dx = layer.backward(np.array([[[[5, 7]]]], np.float32))
    np.testing.assert_array_equal(dx, [[[[5, 0, 0, 7], [0, 0, 0, 0]]]])


def test_maxpool_overlapping_windows_accumulate(layer_path):
    layer = MaxPool2d("pool", 3, 1)
    x = np.zeros((1, 1, 4, 4), np.float32)
    x[0, 0, 1, 1] = 1.0  # the maximum of all 4 windows
    layer.forward(x)
    dx = layer.backward(np.ones((1, 1, 2, 2), np.float32))
    assert dx[0, 0, 1, 1] == 4.0
    assert dx.sum() == 4.0


def test_maxpool_bad_arguments():
    with pytest.raises(ValueError, match="must be >= 1"):
        MaxPool2d("pool", 0)
    with pytest.raises(ValueError, match="larger than input"):
        MaxPool2d("pool7", 3).output_shape((1, 2, 5))


# ------------------------------------------------------------------------------------- Linear


@pytest.mark.parametrize("in_shape", [(7,), (2, 3, 3)], ids=["flat", "nchw"])
def test_linear_gradients(rng, in_shape):
    features = int(np.prod(in_shape))
    layer = Linear("fc", features, 5)
    layer.params["weight"][...] = _randn(rng, 5, features)
    layer.params["bias"][...] = _randn(rng, 5)
    x = _randn(rng, 3, *in_shape)
    y, dx = check_layer(layer, x, rng, params=("weight", "bias"), eps=5e-2)
    assert y.shape == (3, 5)
    assert dx.shape == x.shape
    np.testing.assert_allclose(
        y,
        x.reshape(3, -1) @ layer.params["weight"].T + layer.params["bias"],
        rtol=1e-6,
        atol=1e-6,
    )


def test_linear_output_shape_checks_features():
    layer = Linear("fc9", 12, 4)
    assert layer.output_shape((3, 2, 2)) == (4,)
    with pytest.raises(ValueError, match="fc9"):
        layer.output_shape((3, 3, 3))


# ---------------------------------------------------------------------- softmax_cross_entropy


def test_softmax_cross_entropy_gradient(rng):
    logits = _randn(rng, 4, 6, scale=2.0)
    labels = rng.integers(0, 6, size=4)
    loss, grad, _ = softmax_cross_entropy(logits, labels)
    assert grad.dtype == np.float32 and grad.shape == logits.shape
    coords = _coords(logits.shape, rng)
    numeric = _numeric(lambda: softmax_cross_entropy(logits, labels)[0], logits, coords, 1e-2)
    _assert_gradient("softmax_cross_entropy", np.array([grad[c] for c in coords]), numeric)
    np.testing.assert_allclose(grad.sum(axis=1), 0.0, atol=1e-6)


def test_softmax_cross_entropy_value_and_correct(rng):
    logits = _randn(rng, 5, 4, scale=2.0)
    labels = np.array([0, 1, 2, 3, 0])
    loss, _, correct = softmax_cross_entropy(logits, labels)
    z = logits.astype(np.float64)
    log_prob = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    assert isinstance(loss, float)
    assert loss == pytest.approx(-log_prob[np.arange(5), labels].mean(), rel=1e-6)
    np.testing.assert_array_equal(correct, logits.argmax(axis=1) == labels)
    assert correct.dtype == np.bool_


def test_softmax_cross_entropy_is_stable_for_large_logits():
    logits = np.array([[1000.0, 0.0, -1000.0], [-500.0, 500.0, 0.0]], np.float32)
    loss, grad, correct = softmax_cross_entropy(logits, np.array([0, 2]))
    assert np.isfinite(loss) and np.all(np.isfinite(grad))
    assert loss == pytest.approx(250.0, rel=1e-6)  # (0 + 500) / 2
    np.testing.assert_allclose(grad, [[0, 0, 0], [0, 0.5, -0.5]], atol=1e-6)
    np.testing.assert_array_equal(correct, [True, False])


def test_softmax_cross_entropy_rejects_bad_labels(rng):
    with pytest.raises(ValueError, match="labels"):
        softmax_cross_entropy(_randn(rng, 3, 4), np.zeros(4, np.int64))


# ----------------------------------------------------------------------------- strided Conv2d

STRIDED_CASES = [
    # (N, C, H, W, K, kernel, padding, stride)
    pytest.param(2, 2, 7, 6, 3, 3, 1, 2, id="3x3-pad1-s2"),
    pytest.param(2, 2, 8, 7, 2, 3, 0, (2, 3), id="3x3-s2x3"),
    pytest.param(1, 3, 9, 9, 2, 5, 2, 3, id="5x5-pad2-s3"),
    pytest.param(2, 2, 6, 6, 2, 2, 0, 2, id="2x2-s2-exact-tiling"),
    pytest.param(1, 2, 5, 5, 2, 1, 0, 4, id="1x1-s4"),
]


@pytest.mark.parametrize("n, c, h, w, k, kernel, padding, stride", STRIDED_CASES)
def test_strided_conv2d_gradients(rng, n, c, h, w, k, kernel, padding, stride):
    layer = Conv2d("conv", c, k, kernel, padding, stride=stride)
    layer.params["weight"][...] = _randn(rng, *layer.params["weight"].shape)
    layer.params["bias"][...] = _randn(rng, k)
    x = _randn(rng, n, c, h, w)
    y, _ = check_layer(layer, x, rng, params=("weight", "bias"), eps=5e-2)
    assert y.shape == (n, *layer.output_shape((c, h, w)))
    # floor((H + pads - kh) / s) + 1, PyTorch's size
    sh, sw = kernel_pair(stride)
    full = layer.executor.backend.conv_forward(
        x, layer.params["weight"], layer.params["bias"], padding
    )
    assert y.shape[2:] == ((full.shape[2] - 1) // sh + 1, (full.shape[3] - 1) // sw + 1)
    np.testing.assert_allclose(y, full[:, :, ::sh, ::sw], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "kernel, stride, padding, hw",
    [(3, 2, 1, (9, 8)), (1, 2, 0, (7, 7)), (7, 2, 3, (12, 11)), ((2, 5), (3, 1), (1, 2), (10, 9)),
     (4, 4, 0, (9, 10)), (2, 3, 0, (5, 5))],
)  # fmt: skip
def test_stride_phases_are_the_strided_convolution(rng, kernel, stride, padding, hw):
    """Phasing the input and kernels is exact: the stride-1 convolution of the phases is every
    stride-th output of the stride-1 convolution, and the gradients turn back exactly (the
    phase maps are a permutation with zero fill, so their transposes are the gradients)."""
    from hetconv.backends import Padding
    from hetconv.conv import StridePhases

    backend = LocalConv().backend
    kh, kw = kernel_pair(kernel)
    sh, sw = kernel_pair(stride)
    x, w = _randn(rng, 2, 3, *hw), _randn(rng, 4, 3, kh, kw)
    phases = StridePhases((3, *hw), (kh, kw), Padding.resolve(padding, (kh, kw)), (sh, sw))
    y = backend.conv_forward(phases.input(x), phases.kernels(w), None, 0)
    full = backend.conv_forward(x, w, None, padding)[:, :, ::sh, ::sw]
    np.testing.assert_allclose(y, full, rtol=1e-5, atol=1e-5)
    assert y.shape[2:] == phases.output_hw
    # <phases.input(x), g> == <x, phases.input_grad(g)>, and the same for the kernels.
    g = _randn(rng, *phases.input(x).shape)
    np.testing.assert_allclose(
        np.vdot(phases.input(x), g), np.vdot(x, phases.input_grad(g)), rtol=1e-4
    )
    gw = _randn(rng, *phases.kernels(w).shape)
    np.testing.assert_allclose(
        np.vdot(phases.kernels(w), gw), np.vdot(w, phases.kernel_grad(gw)), rtol=1e-4
    )


def test_strided_conv2d_spec_says_its_stride():
    layer = Conv2d("conv", 2, 3, 3, 1, stride=(2, 1))
    layer.input_shape = (2, 7, 6)
    assert layer.spec.stride == (2, 1)
    assert layer.spec.output_shape == (3, 4, 6) == layer.output_shape((2, 7, 6))
    # Executors compute the stride-1 convolution of the phases: 2 row phases of 3 channels,
    # kernels of ceil(3 / 2) x 3 taps, no padding, the strided output's size.
    executed = layer.spec.executed
    assert (executed.input_shape, executed.kernel_size, executed.padding) == ((4, 5, 8), (2, 3), 0)
    assert layer.spec.shape(1).out_hw == (4, 6)
    with pytest.raises(ValueError, match="stride 0 must be >= 1"):
        Conv2d("conv", 2, 3, 3, stride=0)


# ------------------------------------------------------------------------- average pooling


@pytest.mark.parametrize(
    "kernel, stride, h, w", [(2, 2, 6, 6), (3, 2, 7, 6), (2, 1, 4, 5), (3, 3, 7, 8), (1, 1, 3, 3)]
)
def test_avgpool_gradient(rng, kernel, stride, h, w):
    layer = AvgPool2d("pool", kernel, stride)
    x = _randn(rng, 2, 3, h, w)
    y, _ = check_layer(layer, x, rng)
    assert y.shape == (2, *layer.output_shape((3, h, w)))
    np.testing.assert_allclose(y[0, 1, 0, 0], x[0, 1, :kernel, :kernel].mean(), rtol=1e-6)


def test_global_avgpool_gradient(rng):
    layer = GlobalAvgPool2d("gap")
    x = _randn(rng, 2, 3, 4, 5)
    y, _ = check_layer(layer, x, rng, eps=5e-2)
    assert y.shape == (2, 3, 1, 1) and layer.output_shape((3, 4, 5)) == (3, 1, 1)
    np.testing.assert_allclose(y[:, :, 0, 0], x.mean(axis=(2, 3)), rtol=1e-6)


# ---------------------------------------------------------------------------- batch norm


def test_batchnorm_training_gradients(rng):
    layer = BatchNorm2d("bn", 3)
    layer.params["weight"][...] = _randn(rng, 3) + 1
    layer.params["bias"][...] = _randn(rng, 3)
    x = _randn(rng, 4, 3, 3, 2, scale=2.0) + 0.5
    check_layer(layer, x, rng, params=("weight", "bias"))


def test_batchnorm_eval_gradients_and_statistics(rng):
    layer = BatchNorm2d("bn", 3, eps=1e-3, momentum=0.3)
    x = _randn(rng, 5, 3, 2, 2, scale=2.0) + 1.0
    y = layer.forward(x)
    mean, var = x.mean(axis=(0, 2, 3)), x.var(axis=(0, 2, 3))
    np.testing.assert_allclose(y.mean(axis=(0, 2, 3)), 0, atol=1e-5)
    np.testing.assert_allclose(y.var(axis=(0, 2, 3)), var / (var + 1e-3), rtol=1e-4)
    # running statistics: momentum towards the batch mean and the *unbiased* variance
    np.testing.assert_allclose(layer.buffers["running_mean"], 0.3 * mean, rtol=1e-5)
    np.testing.assert_allclose(layer.buffers["running_var"], 0.7 + 0.3 * var * 20 / 19, rtol=1e-5)
    assert layer.buffers["num_batches_tracked"] == 1
    layer.training = False
    layer.params["weight"][...] = _randn(rng, 3) + 1
    before = {k: v.copy() for k, v in layer.buffers.items()}
    y = layer.forward(x)
    rm, rv = before["running_mean"], before["running_var"]
    want = (x - rm[:, None, None]) / np.sqrt(rv[:, None, None] + 1e-3)
    want = want * layer.params["weight"][:, None, None] + layer.params["bias"][:, None, None]
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)
    for k, v in before.items():  # evaluation leaves the statistics alone
        np.testing.assert_array_equal(layer.buffers[k], v)
    check_layer(layer, x, rng, params=("bias",))


@pytest.mark.parametrize(
    "kwargs, message",
    [(dict(eps=0.0), "eps must be > 0"), (dict(momentum=1.5), r"momentum must be in \[0, 1\]")],
)
def test_batchnorm_bad_options(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BatchNorm2d("bn7", 3, **kwargs)


# ------------------------------------------------------------------------------- dropout


def test_dropout_masks_scale_and_backward(rng):
    layer = Dropout("drop", 0.25, seed=4)
    x = _randn(rng, 64, 8, 4, 4) + 3.0  # no zeros of its own
    y = layer.forward(x)
    kept = y != 0
    assert 0.70 < kept.mean() < 0.80  # about 1 - p of 8192 values
    np.testing.assert_allclose(y[kept], x[kept] / 0.75, rtol=1e-6)
    dy = _randn(rng, *x.shape)
    np.testing.assert_allclose(layer.backward(dy), np.where(kept, dy / 0.75, 0), rtol=1e-6)
    assert not np.array_equal(layer.forward(x) != 0, kept)  # a fresh mask each step
    again = Dropout("drop", 0.25, seed=4)
    np.testing.assert_array_equal(again.forward(x), y)  # the same seed, the same masks
    layer.training = False
    assert layer.forward(x) is x and layer.backward(dy) is dy
    with pytest.raises(ValueError, match=r"p must be in \[0, 1\)"):
        Dropout("drop", 1.0)


def _image_local_chain():
    return [
        ReLU("relu"),
        LocalResponseNorm("lrn", 5),
        MaxPool2d("pool", 3, 2),  # overlapping windows: gradients add up across taps
        AvgPool2d("avg", 2),
    ]


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("chunk_bytes", [1, 3 * 6 * 9 * 9 * 4, 10**9])
def test_image_chunks_are_bit_for_bit_the_layers_run_whole(rng, chunk_bytes, threads, monkeypatch):
    # one image per chunk, uneven chunks (7 images, 3 per chunk) and one chunk for all; the
    # chunks on one, two or three threads at once
    import hetconv.layers as layers

    monkeypatch.setattr(layers, "blas_threads", lambda: threads)
    x = rng.standard_normal((7, 6, 9, 9)).astype(np.float32)
    whole = _image_local_chain()
    y = x
    for layer in whole:
        y = layer.forward(y)
    dy = rng.standard_normal(y.shape).astype(np.float32)
    dx = dy
    for layer in reversed(whole):
        dx = layer.backward(dx)
    chunks = ImageChunks(_image_local_chain(), chunk_bytes)
    got_y = chunks.forward(x)
    got_dx = chunks.backward(dy)
    assert got_y.dtype == np.float32 and got_dx.dtype == np.float32
    np.testing.assert_array_equal(got_y, y)
    np.testing.assert_array_equal(got_dx, dx)
    assert chunks.output_shape(x.shape[1:]) == y.shape[1:]
    # what the chunks keep for backward is what the layers kept, split by images
    kept = sum(a.nbytes for a in chunks.saved_arrays())
    expected = sum(a.nbytes for layer in whole for a in saved_arrays(layer))
    assert kept == expected


def test_image_chunks_run_on_the_blas_threads(rng):
    """At two BLAS threads the chunks run on two threads at once, each group of chunks in
    order on one; at one, every chunk on the calling thread."""
    import threading

    from threadpoolctl import threadpool_limits

    class Where(ReLU):
        def forward(self, x):
            seen.append((threading.current_thread().name, x.shape[0]))
            return super().forward(x)

    x = rng.standard_normal((8, 4, 8, 8)).astype(np.float32)
    for threads, names in ((1, 1), (2, 2)):
        seen = []
        with threadpool_limits(threads, user_api="blas"):
            ImageChunks([Where("r"), MaxPool2d("p")], x[:1].nbytes).forward(x)
        assert len(seen) == 8 and len({name for name, _ in seen}) == names, seen
        if threads == 2:  # the first four images on the calling thread, the rest on another
            here = threading.current_thread().name
            assert [name == here for name, _ in seen].count(True) == 4


def test_chain_chunks_bench_times_the_chunks_at_more_threads_and_checks_their_bits():
    """``benchmarks/chain_chunks.py --threads 2``: a row with the chunks at two threads beside
    one, each run's results checked equal to the chain's run whole."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "chain_chunks.py"
    spec = importlib.util.spec_from_file_location("chain_chunks", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    row = bench.measure(6, 8, 4, repeats=1, chunk_bytes=6 * 8 * 8 * 4, threads=2)
    assert row["threads"] == 2 and row["threaded_s"] > 0
    assert row["threaded_ratio"] == pytest.approx(row["chunks_s"] / row["threaded_s"])
    assert "threaded_s" not in bench.measure(6, 8, 4, repeats=1, chunk_bytes=6 * 8 * 8 * 4)


def test_image_chunks_gradient_is_numerically_right(rng):
    # inputs away from ReLU's kink; one image per chunk
    magnitude = rng.uniform(0.1, 2.0, size=(3, 6, 6, 6))
    x = (magnitude * rng.choice([-1.0, 1.0], size=magnitude.shape)).astype(np.float32)
    chunks = ImageChunks([ReLU("r"), LocalResponseNorm("l", 3, alpha=0.5), MaxPool2d("p")], 1)
    check_layer(chunks, x, rng, eps=1e-3)


def test_image_chunks_refuse_layers_that_mix_images_and_backward_before_forward():
    with pytest.raises(ValueError, match="image-local"):
        ImageChunks([ReLU("r"), BatchNorm2d("bn", 4)])
    with pytest.raises(ValueError, match="image-local"):
        ImageChunks([])
    with pytest.raises(ValueError, match="chunk_bytes"):
        ImageChunks([ReLU("r")], 0)
    with pytest.raises(RuntimeError, match="backward before forward"):
        ImageChunks([ReLU("r")]).backward(np.zeros((1, 1, 2, 2), np.float32))


def test_chunked_groups_runs_of_image_local_layers_only():
    relu, lrn, bn, pool, gap = (
        ReLU("r"), LocalResponseNorm("l"), BatchNorm2d("bn", 4), MaxPool2d("p"),
        GlobalAvgPool2d("g"),
    )  # fmt: skip
    drop, fc = Dropout("d", 0.5), Linear("fc", 4, 2)
    steps = chunked([relu, lrn, bn, pool, drop, relu, fc])
    assert isinstance(steps[0], ImageChunks) and steps[0].layers == [relu, lrn]
    assert steps[1:] == [bn, pool, drop, relu, fc]  # a lone image-local layer runs as it is
    assert isinstance(chunked([pool, gap])[0], ImageChunks)
