"""Batch norm's fast paths (per-plane dot products, channel planes broadcast along N only,
in-place passes) against the textbook formula in float64; ReLU's maximum with a zero plane
against the scalar one; and the rows of ``benchmarks/layers_vs_torch.py``, which times them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hetconv.batchnorm import (
    PLANE_VALUES,
    SMALL_PLANE,
    BatchNorm2d,
    batch_statistics,
    channel_planes,
    plane_sums,
)
from hetconv.layers import ReLU

SHAPES = [
    (4, 3, 5, 7),  # a plane of a few values: one dot product per plane
    (64, 8, 4, 4),  # planes smaller than SMALL_PLANE: summed across the images first
    (2, 5, 1, 1),  # one value per plane (a batch norm after a global pool)
    (2, 3, 70, 70),  # planes larger than PLANE_VALUES: summed row by row
    (1, 1, 3, 3),
]


def _reference(x, gamma, beta, dy, eps):
    """Training forward and backward of batch norm in float64, written as the textbook does."""
    x, dy = x.astype(np.float64), dy.astype(np.float64)
    mean = x.mean(axis=(0, 2, 3), keepdims=True)
    var = x.var(axis=(0, 2, 3), keepdims=True)
    x_hat = (x - mean) / np.sqrt(var + eps)
    g = gamma.reshape(1, -1, 1, 1).astype(np.float64)
    y = x_hat * g + beta.reshape(1, -1, 1, 1)
    d_beta = dy.sum(axis=(0, 2, 3))
    d_gamma = (dy * x_hat).sum(axis=(0, 2, 3))
    m = x.shape[0] * x.shape[2] * x.shape[3]
    dx = g / np.sqrt(var + eps) / m * (m * dy - d_beta.reshape(1, -1, 1, 1))
    dx -= g / np.sqrt(var + eps) / m * x_hat * d_gamma.reshape(1, -1, 1, 1)
    return y, dx, d_gamma, d_beta, mean.ravel(), var.ravel()


@pytest.mark.parametrize("shape", SHAPES)
def test_plane_sums_equal_float64_sums(rng, shape):
    a = (rng.standard_normal(shape) * 3 + 2).astype(np.float32)
    b = rng.standard_normal(shape).astype(np.float32)
    got, got_ab = plane_sums(a), plane_sums(a, b)
    assert got.dtype == got_ab.dtype == np.float64 and got.shape == (shape[1],)
    want = a.astype(np.float64).sum(axis=(0, 2, 3))
    want_ab = (a.astype(np.float64) * b).sum(axis=(0, 2, 3))
    scale = np.abs(a.astype(np.float64)).sum(axis=(0, 2, 3))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * scale.max())
    np.testing.assert_allclose(got_ab, want_ab, rtol=0, atol=1e-6 * (np.abs(a * b)).sum())


def test_plane_sums_of_a_view_equal_those_of_its_copy(rng):
    a = rng.standard_normal((3, 8, 6, 6)).astype(np.float32)
    view = a[:, ::2, :, 1:]  # neither C- nor F-contiguous
    np.testing.assert_array_equal(plane_sums(view), plane_sums(np.ascontiguousarray(view)))


PATHS = {"across images": (3, 9, 4, 5), "per plane": (3, 9, 6, 6), "per row": (2, 6, 70, 70)}


def _path(shape) -> str:
    plane = shape[2] * shape[3]
    if plane < SMALL_PLANE:
        return "across images"
    return "per row" if plane > PLANE_VALUES else "per plane"


@pytest.mark.parametrize("path", PATHS)
def test_plane_sums_of_a_channel_slice_are_bitwise_those_of_the_whole(rng, path):
    shape = PATHS[path]
    assert _path(shape) == path
    a = (rng.standard_normal(shape) * 2 + 1).astype(np.float32)
    whole, squares = plane_sums(a), plane_sums(a, a)
    for own in (slice(0, 1), slice(1, 4), slice(4, shape[1]), slice(2, 3)):
        part = np.ascontiguousarray(a[:, own])
        np.testing.assert_array_equal(plane_sums(part), whole[own])
        np.testing.assert_array_equal(plane_sums(part, part), squares[own])


def test_channel_planes_fill_each_channel(rng):
    v = rng.standard_normal(4).astype(np.float32)
    planes = channel_planes(v, (7, 4, 3, 2))
    assert planes.shape == (1, 4, 3, 2) and planes.dtype == np.float32
    np.testing.assert_array_equal(planes, np.broadcast_to(v.reshape(1, 4, 1, 1), planes.shape))


@pytest.mark.parametrize("shape", SHAPES)
def test_batch_statistics_equal_float64(rng, shape):
    x = (rng.standard_normal(shape) * 3 + 5).astype(np.float32)
    mean, var, centred = batch_statistics(x)
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(mean, x64.mean(axis=(0, 2, 3)), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(var, x64.var(axis=(0, 2, 3)), rtol=1e-5, atol=1e-6)
    assert centred.dtype == np.float32
    np.testing.assert_array_equal(centred, x - mean.astype(np.float32).reshape(1, -1, 1, 1))


@pytest.mark.parametrize("shape", SHAPES)
def test_training_forward_and_backward_equal_the_float64_formula(rng, shape):
    c = shape[1]
    x = (rng.standard_normal(shape) * 2 + 1).astype(np.float32)
    dy = rng.standard_normal(shape).astype(np.float32)
    layer = BatchNorm2d("bn", c, eps=1e-3)
    layer.params["weight"][...] = rng.uniform(0.5, 2, c)
    layer.params["bias"][...] = rng.standard_normal(c)
    gamma, beta = layer.params["weight"].copy(), layer.params["bias"].copy()
    kept = x.copy(), dy.copy()
    y = layer.forward(x)
    dx = layer.backward(dy)
    want_y, want_dx, d_gamma, d_beta, mean, var = _reference(x, gamma, beta, dy, 1e-3)
    np.testing.assert_array_equal(x, kept[0])  # the inputs are left as they were
    np.testing.assert_array_equal(dy, kept[1])
    assert y.dtype == dx.dtype == np.float32 and y.shape == dx.shape == shape
    np.testing.assert_allclose(y, want_y, rtol=0, atol=2e-5 * np.abs(want_y).max())
    np.testing.assert_allclose(dx, want_dx, rtol=0, atol=5e-5 * np.abs(want_dx).max())
    np.testing.assert_allclose(layer.grads["weight"], d_gamma, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(layer.grads["bias"], d_beta, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(layer.batch_stats[0], mean, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(layer.batch_stats[1], var, rtol=1e-5, atol=1e-6)


def test_evaluation_forward_and_backward_equal_the_float64_formula(rng):
    x = (rng.standard_normal((3, 4, 5, 5)) * 2 + 1).astype(np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    layer = BatchNorm2d("bn", 4)
    layer.buffers["running_mean"][...] = rng.standard_normal(4)
    layer.buffers["running_var"][...] = rng.uniform(0.5, 2, 4)
    layer.params["weight"][...] = rng.uniform(0.5, 2, 4)
    layer.params["bias"][...] = rng.standard_normal(4)
    layer.training = False
    y, dx = layer.forward(x), layer.backward(dy)

    def per_channel(name, table="buffers"):
        return getattr(layer, table)[name].astype(np.float64).reshape(1, -1, 1, 1)

    scale = per_channel("weight", "params") / np.sqrt(per_channel("running_var") + layer.eps)
    want = (x - per_channel("running_mean")) * scale + per_channel("bias", "params")
    np.testing.assert_allclose(y, want, rtol=0, atol=1e-5 * np.abs(want).max())
    np.testing.assert_allclose(dx, dy * scale, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(layer.grads["bias"], dy.sum(axis=(0, 2, 3)), rtol=1e-5)


@pytest.mark.parametrize("shape", [(3, 4, 5, 5), (6, 7)])
def test_relu_with_a_zero_plane_equals_the_scalar_maximum(rng, shape):
    x = rng.standard_normal(shape).astype(np.float32)
    x.flat[:3] = [np.nan, -0.0, 0.0]
    layer = ReLU("r")
    y = layer.forward(x)
    assert y.dtype == np.float32 and y.shape == shape
    np.testing.assert_array_equal(y, np.maximum(x, np.float32(0)))  # NaN stays NaN
    dy = rng.standard_normal(shape).astype(np.float32)
    np.testing.assert_array_equal(layer.backward(dy), np.where(x <= 0, 0, dy))  # torch's


# ------------------------------------------------- benchmarks/layers_vs_torch.py's rows

BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "layers_vs_torch.py"
ROW_FIELDS = {"network", "layer", "kind", "batch", "threads", "cap", "cpu", "blas", "ours_s",
              "torch_s", "ratio"}  # fmt: skip


@pytest.mark.slow
def test_layers_vs_torch_rows_carry_conv_vs_torchs_fields_and_the_revisions(tmp_path):
    """On the tiny preset with ``--before HEAD``: conv_vs_torch's row fields, and the layers
    timed as at that revision (before_s, before_ratio)."""
    pytest.importorskip("torch")
    out = tmp_path / "rows.json"
    argv = ["--network", "tiny", "--batch", "2", "--repeats", "1", "--kinds", "relu", "fc"]
    argv += ["step", "--before", "HEAD", "--json", str(out)]
    done = subprocess.run(
        [sys.executable, str(BENCHMARK), *argv], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())
    assert [(r["layer"], r["kind"]) for r in rows] == [
        ("relu1", "relu"), ("relu2", "relu"), ("fc", "fc"), ("step", "step"),
    ]  # fmt: skip
    for row in rows:
        assert set(row) == ROW_FIELDS | {"before_s", "before_ratio"}
        assert row["cap"] == "none" and row["threads"] == 1
        assert row["ratio"] == pytest.approx(row["ours_s"] / row["torch_s"])
        assert row["before_ratio"] == pytest.approx(row["before_s"] / row["torch_s"])


def test_layers_vs_torch_refuses_an_unknown_revision():
    pytest.importorskip("torch")
    done = subprocess.run(
        [sys.executable, str(BENCHMARK), "--before", "no-such-revision", "--kinds", "fc"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 1
    assert "--before no-such-revision: git show hetconv/batchnorm.py failed" in done.stderr
