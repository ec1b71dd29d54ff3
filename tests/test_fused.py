"""Fused worker stages: a conv slice plus the channel-local layers after it, on one node.

First the stage code alone (numpy, no processes): forward and backward on uneven kernel slices,
with LRN halos, equal the whole layers run one after another. Then real worker processes: a
cluster in fused mode trains exactly as local training does, also when a worker dies mid-run,
and a worker refuses bad stage descriptions naming the problem.
"""

from __future__ import annotations

import numpy as np
import pytest

from hetconv.backends import get_backend
from hetconv.balance import offsets
from hetconv.stages import StageOp, StageSpec, stage_backward, stage_forward, stage_of

PADDING = (2, 2, 2, 2)

CHAINS = {
    "relu-lrn-pool": [{"type": "relu"}, {"type": "lrn", "size": 5}, {"type": "maxpool"}],
    "relu-pool": [{"type": "relu"}, {"type": "maxpool", "kernel": 3, "stride": 2}],
    "lrn4": [{"type": "lrn", "size": 4, "alpha": 0.5, "beta": 0.6, "k": 2.0}],
    "two-lrn": [
        {"type": "lrn", "size": 3, "alpha": 0.3},
        {"type": "relu"},
        {"type": "lrn", "size": 5, "alpha": 0.2},
        {"type": "maxpool"},
    ],
}
# Kernels per node (master first): uneven, shares smaller than the halo, a node with none.
SPLITS = [(5, 7, 1, 0, 4), (1, 1, 15), (0, 17), (2, 3, 2, 0, 6, 4)]


def _whole(backend, x, w, b, spec: StageSpec, dy):
    """The layers one after another on every channel: what local training computes."""
    y_conv = backend.conv_forward(x, w, b, PADDING)
    layers = spec.build("whole")
    a = y_conv
    for layer in layers:
        a = layer.forward(a)
    g = dy
    for layer in reversed(layers):
        g = layer.backward(g)
    dw, db = backend.conv_grad_kernels(x, g, w.shape[2:], PADDING)
    dx = backend.conv_grad_input(g, w, x.shape[2:], PADDING)
    return a, dx, dw, db


def _pieces(backend, x, w, b, spec: StageSpec, dy, shares, halo=None):
    """Every node's stage on its slice, reassembled as the master does."""
    k = w.shape[0]
    ys, dws, dbs, dx = [], [], [], np.zeros_like(x)
    for start, share in zip(offsets(shares), shares, strict=True):
        if not share:
            continue
        own = slice(start, start + share)
        wide = spec.widened(own, k)
        if halo is not None:  # a narrower halo than the stage asks for (must fail)
            wide = slice(max(own.start - halo, 0), min(own.stop + halo, k))
        grad = spec.grad_range(own, k)
        grad = slice(max(grad.start, wide.start), min(grad.stop, wide.stop))
        rel_own = slice(own.start - wide.start, own.stop - wide.start)
        y, run = stage_forward(backend, x, w[wide], b[wide], PADDING, spec, rel_own)
        rel_grad = slice(grad.start - wide.start, grad.stop - wide.start)
        part, dw, db = stage_backward(backend, run, dy[:, grad], rel_grad, True)
        ys.append(y)
        dws.append(dw)
        dbs.append(db)
        dx += part
    return np.concatenate(ys, axis=1), dx, np.concatenate(dws), np.concatenate(dbs)


@pytest.fixture(scope="module")
def case():
    rng = np.random.default_rng(7)
    x = rng.standard_normal((3, 4, 8, 8)).astype(np.float32)
    w = rng.standard_normal((17, 4, 5, 5)).astype(np.float32) * 0.3
    b = rng.standard_normal(17).astype(np.float32) * 0.1
    return x, w, b


@pytest.mark.parametrize("shares", SPLITS)
@pytest.mark.parametrize("chain", sorted(CHAINS))
def test_stage_slices_equal_the_whole_layers(case, chain, shares):
    backend = get_backend("cpu")
    x, w, b = case
    spec = StageSpec.from_entries(CHAINS[chain])
    out_hw = spec.output_hw((8, 8))
    dy = np.random.default_rng(3).standard_normal((3, 17, *out_hw)).astype(np.float32)
    want = _whole(backend, x, w, b, spec, dy)
    got = _pieces(backend, x, w, b, spec, dy, shares)
    for name, g, e in zip(("y", "dx", "dw", "db"), got, want, strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("chain", ["relu-lrn-pool", "lrn4", "two-lrn"])
def test_a_narrower_halo_is_not_exact(case, chain):
    """The halo is needed: one channel less on each side changes the gradients (a strong
    normalisation, alpha 1, so the difference shows above round-off)."""
    backend = get_backend("cpu")
    x, w, b = case
    entries = [{**e, "alpha": 1.0} if e["type"] == "lrn" else e for e in CHAINS[chain]]
    spec = StageSpec.from_entries(entries)
    dy = np.random.default_rng(3).standard_normal((3, 17, *spec.output_hw((8, 8))))
    dy = dy.astype(np.float32)
    want = _whole(backend, x, w, b, spec, dy)
    got = _pieces(backend, x, w, b, spec, dy, (5, 6, 6), halo=spec.halo - 1)
    assert not all(np.allclose(g, e, rtol=1e-5, atol=1e-5) for g, e in zip(got, want, strict=True))


def test_halo_sizes():
    assert StageSpec.from_entries(CHAINS["relu-lrn-pool"]).halo == 4  # 2 * (5 // 2)
    assert StageSpec.from_entries(CHAINS["relu-lrn-pool"]).grad_reach == (2, 2)
    assert StageSpec.from_entries(CHAINS["lrn4"]).halo == 3
    assert StageSpec.from_entries(CHAINS["lrn4"]).grad_reach == (1, 2)
    assert StageSpec.from_entries(CHAINS["relu-pool"]).halo == 0
    spec = StageSpec.from_entries(CHAINS["relu-lrn-pool"])
    assert spec.widened(slice(3, 5), 17) == slice(0, 9)
    assert spec.widened(slice(14, 17), 17) == slice(10, 17)


def test_stage_of_takes_the_channel_local_run():
    entries = [{"type": "relu"}, {"type": "maxpool"}, {"type": "conv", "out": 3}, {"type": "relu"}]
    assert stage_of(entries) == StageSpec((StageOp("relu"), StageOp("maxpool", kernel=2, stride=2)))
    assert stage_of([{"type": "fc", "out": 3}]) is None


@pytest.mark.parametrize(
    "op, message",
    [
        (dict(kind="softmax"), "kind 'softmax'"),
        (dict(kind="lrn", size=0), "size must be >= 1"),
        (dict(kind="lrn", size=3, alpha=float("nan")), "alpha must be finite"),
        (dict(kind="maxpool", kernel=0, stride=1), "must be >= 1"),
    ],
)
def test_bad_stage_ops_are_refused(op, message):
    with pytest.raises(ValueError, match=message):
        StageOp(**op)
