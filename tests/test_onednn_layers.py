"""oneDNN's ReLU and max pooling (hetconv/backends/onednn_layers.py) give the numpy path's bits:
on ties (ReLU's zeros, whole windows of them), odd shapes, from several threads at once, and in
whole models' steps; what it does not serve (overlapping windows, float64, views) stays numpy's."""

from __future__ import annotations

import platform
import threading

import numpy as np
import pytest

from hetconv.backends import onednn_layers, onednn_library
from hetconv.layers import ReLU, softmax_cross_entropy
from hetconv.model import Model, load_spec
from hetconv.pooling import MaxPool2d

WHEEL_HERE = platform.system() == "Linux" and platform.machine() == "x86_64"
pytestmark = pytest.mark.skipif(
    not WHEEL_HERE, reason="oneDNN's wheel (onednn-cpu-gomp) is built for Linux x86-64 only"
)


@pytest.fixture(autouse=True)
def served():
    """oneDNN's library loads here (hetconv's dependencies install it); each test leaves the
    layers on oneDNN."""
    onednn_library.library()
    yield
    onednn_layers.set_enabled(True)


def _relu_pool(x: np.ndarray, kernel: int, stride: int, dy_seed: int = 1):
    """(y, dx, served) of a ReLU then a max pool, forward and backward."""
    relu, pool = ReLU("relu"), MaxPool2d("pool", kernel, stride)
    y = pool.forward(relu.forward(x))
    dy = np.random.default_rng(dy_seed).standard_normal(y.shape).astype(np.float32)
    dx = relu.backward(pool.backward(dy))
    return y, dx, (relu._y is not None, pool._workspace is not None)


def _both(fn):
    onednn_layers.set_enabled(True)
    fast = fn()
    onednn_layers.set_enabled(False)
    slow = fn()
    onednn_layers.set_enabled(True)
    return fast, slow


@pytest.mark.parametrize(
    "shape, kernel, stride",
    [
        ((4, 3, 8, 8), 2, 2),
        ((3, 5, 9, 7), 2, 2),  # rows and columns no window covers
        ((2, 4, 9, 9), 3, 3),
        ((2, 3, 8, 8), 2, 3),  # gaps between windows
        ((1, 1, 2, 2), 2, 2),
        ((5, 16, 32, 32), 2, 2),
    ],
)
def test_relu_and_max_pool_are_bit_for_bit_the_numpy_path(rng, shape, kernel, stride):
    x = rng.standard_normal(shape).astype(np.float32)
    x[0] = 0.0  # whole windows of ties, as ReLU leaves them
    x[:, :, ::3] = np.abs(x[:, :, ::3]).round()  # ties among positive values too
    (y, dx, served), (y0, dx0, served0) = _both(lambda: _relu_pool(x, kernel, stride))
    assert served == (True, True) and served0 == (False, False)
    np.testing.assert_array_equal(y, y0)
    np.testing.assert_array_equal(dx, dx0)


def test_ties_go_to_the_first_maximum_in_window_order():
    x = np.array([[[[0, 0, 1, 3], [0, 0, 3, 0]]]], np.float32)
    pool = MaxPool2d("pool", 2, 2)
    np.testing.assert_array_equal(pool.forward(x), [[[[0, 3]]]])
    assert pool._workspace is not None
    dx = pool.backward(np.array([[[[5, 7]]]], np.float32))
    np.testing.assert_array_equal(dx, [[[[5, 0, 0, 7], [0, 0, 0, 0]]]])


def test_overlapping_windows_keep_the_numpy_path(rng):
    x = rng.standard_normal((2, 3, 9, 9)).astype(np.float32)
    (y, dx, served), (y0, dx0, _) = _both(lambda: _relu_pool(x, 3, 2))
    assert served == (True, False)  # oneDNN would add a pixel's gradients in another order
    np.testing.assert_array_equal(y, y0)
    np.testing.assert_array_equal(dx, dx0)


def test_arrays_it_does_not_serve_take_the_numpy_path(rng):
    x = rng.standard_normal((2, 3, 4, 4)).astype(np.float32)
    assert onednn_layers.serves_relu(x)
    assert not onednn_layers.serves_relu(x.astype(np.float64))
    assert not onednn_layers.serves_relu(x.transpose(0, 1, 3, 2))  # a view, not in a row
    assert not onednn_layers.serves_relu(x[:, :0])
    assert onednn_layers.max_pool(x[0], 2, 2) is None  # not NCHW
    relu = ReLU("relu")
    y = relu.forward(x)
    assert relu._y is not None
    dy = rng.standard_normal((2, 3, 4, 4)).astype(np.float32).transpose(0, 1, 3, 2)
    np.testing.assert_array_equal(relu.backward(dy), dy * (x > 0))  # a view of a gradient
    np.testing.assert_array_equal(relu.backward(dy.astype(np.float64)), dy * (y > 0))
    onednn_layers.set_enabled(False)
    assert not onednn_layers.serves_relu(x) and onednn_layers.max_pool(x, 2, 2) is None


def test_nan_stays_nan_forward_and_its_gradient_passes(rng):
    """As PyTorch's ReLU, on both paths: a diverged layer's NaN reaches the loss."""
    x = rng.standard_normal((2, 3, 4, 4)).astype(np.float32)
    x.flat[:4] = [np.nan, -0.0, 0.0, np.inf]
    x[1, 2, 3] = np.nan
    dy = rng.standard_normal(x.shape).astype(np.float32)
    relu = ReLU("relu")
    y = relu.forward(x)
    assert relu._y is not None
    np.testing.assert_array_equal(y, np.maximum(x, np.float32(0)))
    np.testing.assert_array_equal(relu.backward(dy), np.where(x <= 0, 0, dy))  # torch's
    relu = ReLU("relu")
    onednn_layers.set_enabled(False)
    relu.forward(x)
    np.testing.assert_array_equal(relu.backward(dy), np.where(x <= 0, 0, dy))
    onednn_layers.set_enabled(True)
    pool = MaxPool2d("pool", 2, 2)
    (p, _, _), (p0, _, _) = _both(lambda: _relu_pool(x, 2, 2))
    np.testing.assert_array_equal(p, p0)
    assert np.isnan(pool.forward(x)).sum() == np.isnan(p0).sum() > 0


def test_threads_share_the_primitives(rng):
    inputs = [rng.standard_normal((3, 8, 12, 12)).astype(np.float32) for _ in range(8)]
    onednn_layers.set_enabled(False)
    want = [_relu_pool(x, 2, 2) for x in inputs]
    onednn_layers.set_enabled(True)
    got: list = [None] * len(inputs)
    barrier = threading.Barrier(4)

    def run(first: int) -> None:
        barrier.wait()
        for _ in range(5):
            for i in range(first, len(inputs), 4):
                got[i] = _relu_pool(inputs[i], 2, 2)

    threads = [threading.Thread(target=run, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for (y, dx, served), (y0, dx0, _) in zip(got, want, strict=True):
        assert served == (True, True)
        np.testing.assert_array_equal(y, y0)
        np.testing.assert_array_equal(dx, dx0)


@pytest.mark.parametrize("name", ["vgg11", "resnet20", "paper-50-500"])
def test_a_models_step_is_bit_for_bit_the_numpy_path(rng, name):
    spec = load_spec(name)
    x = rng.standard_normal((4, 3, 32, 32)).astype(np.float32)
    labels = rng.integers(0, 10, 4)

    def step():
        model = Model(spec, seed=3)
        value, dlogits, _ = softmax_cross_entropy(model.forward(x), labels)
        model.backward(dlogits)
        return value, {k: v.copy() for k, v in model.gradients().items()}

    (loss, grads), (loss0, grads0) = _both(step)
    assert loss == loss0
    assert grads.keys() == grads0.keys()
    for key in grads:
        np.testing.assert_array_equal(grads[key], grads0[key], err_msg=key)
