"""Spot checks: a worker answering finite but wrong values is caught, dropped and kept out, and
the run stays exact; honest workers are never flagged, whatever the wire format.

The liars are real gRPC worker processes (``tests/lying_worker.py``: the real worker service,
its answers changed in place before they are sent) next to real ``hetconv worker`` processes
started by :class:`~hetconv.master.launch.LocalWorkers`. Tolerances for "same as local
training" are those of ``tests/test_faults.py``: losses rtol 1e-5, weights atol 1e-5 (the
master covering a slice sums the input-gradient parts in another order).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from hetconv.backends import get_backend
from hetconv.batchnorm import BatchNorm2d
from hetconv.calls import READY as READY_LINE
from hetconv.cli import main
from hetconv.conv import LocalConv
from hetconv.formats import BFLOAT16, FLOAT16, FLOAT32, FORMATS
from hetconv.master.cluster import Cluster, ClusterConfig
from hetconv.master.launch import LocalWorkers
from hetconv.master.membership import DISTRUSTED
from hetconv.master.spotcheck import (
    DEFAULT_RTOL,
    Comparison,
    Sample,
    SpotCheckConfig,
    SpotChecker,
    as_received,
    kernel_backward_sample,
    kernel_forward_sample,
    relative_error,
    stage_backward_sample,
    stage_forward_sample,
    tolerance,
)
from hetconv.stages import BatchNormSlice, StageSpec, stage_backward, stage_forward
from hetconv.training import TrainConfig, train

LIAR = Path(__file__).with_name("lying_worker.py")
RUN = dict(steps=10, batch=8, train_size=64, eval_size=16, progress=False)
FAST = dict(deadline_floor=1.0, deadline_factor=5.0, retry_min=0.2, retry_max=1.0)
SHARES = {"conv1": (3, 3, 2), "conv2": (6, 5, 5)}  # the tiny preset: master, worker, liar


@contextlib.contextmanager
def lying_worker(kind: str, from_step: int = 0):
    """A real worker process answering ``kind`` lies from training step ``from_step`` on."""
    process = subprocess.Popen(
        [sys.executable, "-I", str(LIAR), kind, str(from_step)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=dict(os.environ, OPENBLAS_NUM_THREADS="1"),
    )  # fmt: skip
    try:
        address = None
        for line in process.stdout:
            if line.startswith(READY_LINE):
                address = line[len(READY_LINE) :].strip()
                break
        assert address, f"the lying worker did not start (status {process.poll()})"
        yield address
    finally:
        process.stdin.close()
        process.terminate()
        process.wait(10)


class Paused(Cluster):
    """A cluster that sleeps ``pause`` seconds before step ``at``: time for the monitor to
    re-admit a lost worker (it retries after ``retry_min``, 0.2 s here)."""

    def __init__(self, addresses, at=None, pause=0.0, **config):
        every_step = {"spot_checks": SpotCheckConfig(every=1)}  # unless a test says otherwise
        super().__init__(addresses, config=ClusterConfig(**{**FAST, **every_step, **config}))
        self.at, self.pause = at, pause

    def begin_step(self, step):
        if step == self.at:
            time.sleep(self.pause)
        super().begin_step(step)


def _train(tmp_path, name, executor, **overrides):
    weights = tmp_path / f"{name}.npz"
    trace = tmp_path / f"{name}.jsonl"
    config = TrainConfig(save=str(weights), trace=str(trace), **{**RUN, **overrides})
    result = train(config, executor, log=io.StringIO())
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    return result.losses, dict(np.load(weights)), [r for r in records if "step" in r]


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("local"), "local", LocalConv())


def _same_as_local(got, local):
    np.testing.assert_allclose(got[0], local[0], rtol=1e-5)
    for name in got[1]:
        np.testing.assert_allclose(got[1][name], local[1][name], rtol=0, atol=1e-5)


def _lost(events):
    return [(e["worker"], e["step"]) for e in events if e["event"] == "worker_lost"]


# -- a worker that lies ----------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["scale", pytest.param("noise", marks=pytest.mark.slow)])
def test_a_lying_worker_is_dropped_at_the_first_check_and_kept_out(local, tmp_path, kind):
    # "scale": every answer times 1.5; "noise": times 1 + 1e-3 N(0, 1), elementwise. Both lie
    # from the first call, which is checked (step 0, conv1 forward): the master computes the
    # liar's slice itself from then on, so training equals local training step by step. The
    # pause before step 5 gives the monitor (retrying after 0.2 s) time to re-admit it, as it
    # would a worker that died: a liar stays out.
    with LocalWorkers(1) as workers, lying_worker(kind) as liar:
        addresses = workers.addresses + [liar]
        with Paused(addresses, at=5, pause=1.5, shares=SHARES) as cluster:
            got = _train(tmp_path, kind, cluster)
            events = list(cluster.events)
            states = {node.name: node.state for node in cluster.nodes}
    _same_as_local(got, local)
    assert _lost(events) == [(liar, 0)]
    (lost,) = [e for e in events if e["event"] == "worker_lost"]
    assert "forward conv1: spot check failed" in lost["reason"]
    assert "not re-admitted" in lost["reason"] and "tolerance" in lost["reason"]
    assert states[liar] == DISTRUSTED and states[workers.addresses[0]] == "active"
    assert not [e for e in events if e["event"] in ("worker_rejoined", "worker_unreachable")]
    # Later steps check the honest worker only; the liar's share went to the others.
    for record in got[2][1:]:
        assert set(record["spot_checks"]["workers"]) == {workers.addresses[0]}
        assert liar not in record["nodes"]


def test_a_lying_worker_is_caught_in_fused_stages(tmp_path):
    # The fused stage calls are checked like the kernel split's: a liar scaling its stage
    # outputs is caught at the first check and training equals fused training without it.
    spec = tmp_path / "strong.json"
    spec.write_text(json.dumps(STRONG_SPEC))
    run = dict(preset=str(spec))
    local = _train(tmp_path, "fused-local", LocalConv(), **run)
    with LocalWorkers(1) as workers, lying_worker("scale") as liar:
        addresses = workers.addresses + [liar]
        config = dict(stages="fused", shares={"conv1": (3, 3, 2), "conv2": (6, 5, 5)})
        with Paused(addresses, **config) as cluster:
            got = _train(tmp_path, "fused-liar", cluster, **run)
            events = list(cluster.events)
    _same_as_local(got, local)
    (lost,) = [e for e in events if e["event"] == "worker_lost"]
    assert lost["worker"] == liar and lost["step"] == 0
    assert "forward conv1: spot check failed" in lost["reason"], lost["reason"]
    assert got[2][0]["stage_modes"] == {"conv1": "fused", "conv2": "fused"}


def test_a_lying_worker_is_caught_in_fused_stages_with_batch_norm(tmp_path):
    # A stage holding batch norm is sampled too (a channel's statistics are its own: the
    # sampled kernels' stages over every image); before, it was never checked.
    spec = tmp_path / "bn.json"
    spec.write_text(json.dumps(BATCHNORM_SPEC))
    run = dict(preset=str(spec), steps=3)
    with LocalWorkers(1) as workers, lying_worker("scale") as liar:
        addresses = workers.addresses + [liar]
        config = dict(stages="fused", shares={"conv1": (3, 3, 2), "conv2": (6, 5, 5)})
        with Paused(addresses, **config) as cluster:
            got = _train(tmp_path, "bn-liar", cluster, **run)
            events = list(cluster.events)
    (lost,) = [e for e in events if e["event"] == "worker_lost"]
    assert lost["worker"] == liar and lost["step"] == 0
    assert "forward conv1: spot check failed" in lost["reason"], lost["reason"]
    assert got[2][0]["stage_modes"] == {"conv1": "fused", "conv2": "fused"}
    assert set(got[2][1]["spot_checks"]["workers"]) == set(workers.addresses)


BATCHNORM_SPEC = [
    {"type": "conv", "name": "conv1", "out": 8, "kernel": 3, "padding": 1, "bias": False},
    {"type": "batchnorm"},
    {"type": "relu"},
    {"type": "maxpool", "kernel": 2},
    {"type": "conv", "name": "conv2", "out": 16, "kernel": 3, "padding": 1},
    {"type": "batchnorm"},
    {"type": "relu"},
    {"type": "lrn", "size": 3, "alpha": 1.0, "beta": 0.75, "k": 1.0},
    {"type": "maxpool", "kernel": 2},
    {"type": "fc", "name": "fc", "out": 10},
]


STRONG_SPEC = [
    {"type": "conv", "name": "conv1", "out": 8, "kernel": 3, "padding": 1},
    {"type": "relu"},
    {"type": "lrn", "size": 3, "alpha": 1.0, "beta": 0.75, "k": 1.0},
    {"type": "maxpool", "kernel": 2},
    {"type": "conv", "name": "conv2", "out": 16, "kernel": 3, "padding": 1},
    {"type": "relu"},
    {"type": "maxpool", "kernel": 2},
    {"type": "fc", "name": "fc", "out": 10},
]


def _seed_missing_then_catching(liar_first: dict[str, int], shares: dict[str, tuple]) -> int:
    """A sample seed under which step 0 checks the liar's (node 2's) first kernel of each
    layer in neither forward call but in conv2's backward (the first backward call)."""

    def sampled(seed, layer, phase):
        checker = SpotChecker(SpotCheckConfig(seed=seed, unpredictable=False))
        start = sum(shares[layer][:2])
        part = slice(start, start + shares[layer][2])
        return liar_first[layer] in checker.sample(layer, phase, 2, part, 8, 3).kernels

    for seed in range(1000):
        forward = sampled(seed, "conv1", "forward") or sampled(seed, "conv2", "forward")
        if not forward and sampled(seed, "conv2", "backward"):
            return seed
    raise AssertionError("no such seed in 1000")


def test_wrong_values_that_passed_earlier_checks_in_the_step_are_recomputed(
    local, tmp_path, monkeypatch
):
    # The liar gets wrong one kernel of its slice per layer (feature maps, kernel and bias
    # gradients). Under this seed both forward checks of step 0 sample other kernels, so its
    # wrong feature maps are used, and conv2's backward check catches it. The step is then
    # computed again without it: training equals local training. Without the second pass
    # (redo_step off, the control) step 0's loss is already another.
    shares = {"conv1": (2, 2, 4), "conv2": (4, 4, 8)}
    seed = _seed_missing_then_catching({"conv1": 4, "conv2": 8}, shares)
    checks = SpotCheckConfig(seed=seed, unpredictable=False)  # the samples the seed says
    runs = {}
    with LocalWorkers(1) as workers:
        for redo in (True, False):
            if not redo:
                monkeypatch.setattr(Cluster, "redo_step", lambda self: False)
            with lying_worker("kernel") as liar:
                addresses = workers.addresses + [liar]
                with Paused(addresses, shares=shares, spot_checks=checks) as cluster:
                    got = _train(tmp_path, f"redo-{redo}", cluster)
                    events = list(cluster.events)
            assert _lost(events) == [(liar, 0)]
            (lost,) = [e for e in events if e["event"] == "worker_lost"]
            assert "backward conv2: spot check failed: kernel gradients" in lost["reason"]
            runs[redo] = got
    _same_as_local(runs[True], local)
    assert abs(runs[False][0][0] - local[0][0]) > 1e-3


def test_a_lie_that_starts_later_is_caught_at_the_next_checked_step(tmp_path):
    # Checked at steps 0, 3, 6, 9 (predictably: the steps are unpredictable by default, see
    # test_checked_steps_and_samples_follow_a_secret); the lie starts at step 4, so steps 4
    # and 5 go unnoticed (the price of checking every third step) and the liar is dropped at
    # step 6.
    every_third = SpotCheckConfig(every=3, unpredictable=False)
    with LocalWorkers(1) as workers, lying_worker("scale", from_step=4) as liar:
        addresses = workers.addresses + [liar]
        with Paused(addresses, shares=SHARES, spot_checks=every_third) as cluster:
            got = _train(tmp_path, "later", cluster)
            events = list(cluster.events)
    assert _lost(events) == [(liar, 6)]
    checked = [r["step"] for r in got[2] if "spot_checks" in r]
    assert checked == [0, 3, 6, 9]


def test_with_checks_off_a_lie_goes_unnoticed(local, tmp_path):
    # The control: the same liar, no checks. Training goes on with its wrong values, so this
    # file's tests can fail.
    with LocalWorkers(1) as workers, lying_worker("scale") as liar:
        addresses = workers.addresses + [liar]
        with Paused(addresses, shares=SHARES, spot_checks=SpotCheckConfig(every=0)) as cluster:
            got = _train(tmp_path, "unchecked", cluster)
            events = list(cluster.events)
    assert _lost(events) == []
    assert not any("spot_checks" in r for r in got[2])
    assert np.max(np.abs(np.subtract(got[0], local[0]))) > 1e-3  # visibly another model


# -- honest workers --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fmt",
    [
        pytest.param(f, marks=pytest.mark.slow) if f.label == "float16" else f
        for f in FORMATS.values()
    ],
    ids=lambda f: f.label,
)
def test_honest_workers_are_never_flagged(local, tmp_path, fmt):
    # Two real `hetconv worker` processes and every answer of every step checked: 2 layers x
    # (forward + backward) = 4 checks per worker per step, none flagged, whatever the format.
    steps = RUN["steps"]
    with LocalWorkers(2) as workers:
        with Paused(workers.addresses, wire_format=fmt) as cluster:
            got = _train(tmp_path, f"honest-{fmt.label}", cluster)
            events = list(cluster.events)
    assert _lost(events) == []
    records = got[2]
    assert [r["step"] for r in records if "spot_checks" in r] == list(range(steps))
    for record in records:
        checks = record["spot_checks"]
        assert {w: v["checks"] for w, v in checks["workers"].items()} == dict.fromkeys(
            workers.addresses, 4
        )
        worst = max(v["worst"] for v in checks["workers"].values())
        assert worst < tolerance(SpotCheckConfig().rtol, fmt, wire_rounded=True)[0]
    if fmt is FLOAT32:
        _same_as_local(got, local)


def test_checks_change_nothing_that_honest_workers_compute(tmp_path):
    # --deterministic runs with checks on every step and off are bitwise identical: a check
    # only reads the answers.
    runs = []
    with LocalWorkers(2) as workers:
        for every in (1, 0):
            config = dict(deterministic=True, spot_checks=SpotCheckConfig(every=every))
            with Paused(workers.addresses, **config) as cluster:
                runs.append(_train(tmp_path, f"deterministic-{every}", cluster))
    (checked, *_), (unchecked, *_) = runs
    assert checked == unchecked
    for name, weights in runs[0][1].items():
        np.testing.assert_array_equal(weights, runs[1][1][name])
    assert all("spot_checks" in r for r in runs[0][2])


# -- the comparisons themselves --------------------------------------------------------------

SHAPES = [
    # (N, C, H, W, K, kh, kw, sides)
    (4, 3, 9, 7, 6, 3, 3, (1, 1, 1, 1)),
    (3, 5, 8, 8, 4, 5, 5, (2, 2, 2, 2)),
    (2, 4, 6, 9, 3, 3, 2, (0, 1, 2, 0)),  # asymmetric padding, non-square kernel
    (5, 2, 5, 5, 1, 5, 5, (0, 0, 0, 0)),  # one kernel, one output pixel
]


def _answers(backend, fmt, x, w, b, dy, sides, part):
    """What an honest worker holding kernels ``part`` returns (in its wire format)."""
    x_seen = as_received(fmt, x)
    y = as_received(fmt, backend.conv_forward(x_seen, w[part], b[part], sides))
    dy_seen = as_received(fmt, np.ascontiguousarray(dy[:, part]))
    dw, db = backend.conv_grad_kernels(x_seen, dy_seen, w.shape[2:], sides)
    dx = as_received(fmt, backend.conv_grad_input(dy_seen, w[part], x.shape[2:], sides))
    return y, dw, db, dx


def _failures(comparisons, fmt, rtol=DEFAULT_RTOL):
    out = []
    for c in comparisons:
        relative, absolute = tolerance(rtol, fmt, c.wire_rounded)
        error, worst = relative_error(c)
        if worst > relative * c.scale + absolute:
            out.append(c.tensor)
    return out


@pytest.mark.parametrize("fmt", [FLOAT32, FLOAT16, BFLOAT16], ids=lambda f: f.label)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:7])))
def test_samples_of_honest_answers_pass_and_lies_of_every_tensor_fail(rng, shape, fmt):
    n, c, h, w_, k, kh, kw, sides = shape
    backend = get_backend("cpu")
    x = rng.standard_normal((n, c, h, w_), dtype=np.float32)
    w = rng.standard_normal((k, c, kh, kw), dtype=np.float32)
    b = rng.standard_normal(k, dtype=np.float32)
    ho, wo = h + sides[0] + sides[1] - kh + 1, w_ + sides[2] + sides[3] - kw + 1
    dy = rng.standard_normal((n, k, ho, wo), dtype=np.float32)
    part = slice(k // 2, k)
    y_part, dw_part, db_part, dx = _answers(backend, fmt, x, w, b, dy, sides, part)
    y = np.zeros((n, k, ho, wo), np.float32)
    dw, db = np.zeros_like(w), np.zeros(k, np.float32)
    y[:, part], dw[part], db[part] = y_part, dw_part, db_part
    checker = SpotChecker(SpotCheckConfig(kernels=2, images=2, channels=2))
    sample = checker.sample("conv", "backward", 1, part, n, c)

    def both():
        return kernel_forward_sample(fmt, x, w, b, sides, y, sample) + kernel_backward_sample(
            fmt, x, w, dy, sides, part, dw, db, dx, sample
        )

    honest = both()
    assert [c.tensor for c in honest] == ["y", "dw", "db", "dx"]
    assert _failures(honest, fmt) == []
    # Each tensor scaled by 1.5 alone is caught.
    for name, array in [("y", y), ("dw", dw), ("db", db), ("dx", dx)]:
        array *= 1.5
        assert _failures(both(), fmt) == [name], name
        array /= 1.5
    # A relative perturbation of 1e-3 is caught where nothing is rounded to 16 bits.
    if fmt is FLOAT32:
        for name, array in [("y", y), ("dw", dw), ("dx", dx)]:
            saved = array.copy()
            array *= 1 + 1e-3 * rng.standard_normal(array.shape).astype(np.float32)
            assert _failures(both(), fmt) == [name], name
            array[...] = saved


STRONG_STAGE = StageSpec.from_entries(
    [
        {"type": "relu"},
        {"type": "lrn", "size": 3, "alpha": 1.0, "beta": 0.75, "k": 1.0},
        {"type": "maxpool", "kernel": 2},
    ]
)


@pytest.mark.parametrize("fmt", [FLOAT32, BFLOAT16], ids=lambda f: f.label)
def test_stage_samples_of_honest_answers_pass_and_lies_fail(rng, fmt):
    # A fused stage (ReLU, a strong LRN whose halo matters, max-pool) on a worker owning
    # kernels 3..6 of 8: its answers computed by the stage code on the wire-rounded inputs pass;
    # the stage output, kernel gradients or bias gradients scaled by 1.5 alone fail.
    backend = get_backend("cpu")
    n, c, h, k, sides = 4, 3, 8, 8, (1, 1, 1, 1)
    x = rng.standard_normal((n, c, h, h), dtype=np.float32)
    w = rng.standard_normal((k, c, 3, 3), dtype=np.float32)
    b = rng.standard_normal(k, dtype=np.float32)
    part = slice(3, 6)
    wide = STRONG_STAGE.widened(part, k)
    grad = STRONG_STAGE.grad_range(part, k)
    own = slice(part.start - wide.start, part.stop - wide.start)
    x_seen = as_received(fmt, x)
    y_part, run = stage_forward(backend, x_seen, w[wide], b[wide], sides, STRONG_STAGE, own)
    y = np.zeros((n, k, *y_part.shape[2:]), np.float32)
    y[:, part] = as_received(fmt, y_part)
    dy = rng.standard_normal(y.shape, dtype=np.float32)
    rel = slice(grad.start - wide.start, grad.stop - wide.start)
    dy_seen = as_received(fmt, np.ascontiguousarray(dy[:, grad]))
    _, dw_part, db_part = stage_backward(backend, run, dy_seen, rel, False)
    dw, db = np.zeros_like(w), np.zeros(k, np.float32)
    dw[part], db[part] = dw_part, db_part
    sample = SpotChecker(SpotCheckConfig(kernels=2, images=2, channels=2)).sample(
        "conv", "forward", 1, part, n, c
    )

    def both():
        return stage_forward_sample(
            fmt, x, w, b, sides, STRONG_STAGE, y, sample
        ) + stage_backward_sample(fmt, x, w, b, dy, sides, STRONG_STAGE, dw, db, sample)

    honest = both()
    assert [c.tensor for c in honest] == ["y", "dw", "db"]
    assert _failures(honest, fmt) == []
    for name, array in [("y", y), ("dw", dw), ("db", db)]:
        array *= 1.5
        assert _failures(both(), fmt) == [name], name
        array /= 1.5


BATCHNORM_STAGE = StageSpec.from_entries(
    [
        {"type": "batchnorm"},
        {"type": "relu"},
        {"type": "lrn", "size": 3, "alpha": 1.0, "beta": 0.75, "k": 1.0},
        {"type": "maxpool", "kernel": 2},
    ]
)


@pytest.mark.parametrize("training", [True, False], ids=["training", "evaluation"])
def test_stage_samples_with_batch_norm_pass_honest_answers_and_fail_lies(rng, training):
    # Batch norm normalises a channel by its own statistics over the batch: the sampled
    # kernels' stages over every image are computable, a few images compared. Before, a stage
    # with batch norm was never sampled.
    backend = get_backend("cpu")
    n, c, h, k, sides = 6, 3, 8, 8, (1, 1, 1, 1)
    x = rng.standard_normal((n, c, h, h), dtype=np.float32)
    w = rng.standard_normal((k, c, 3, 3), dtype=np.float32)
    b = rng.standard_normal(k, dtype=np.float32)
    norm = BatchNorm2d("bn", k)
    norm.params["weight"][...] = rng.uniform(0.5, 2.0, k)
    norm.params["bias"][...] = rng.standard_normal(k)
    norm.buffers["running_mean"][...] = rng.standard_normal(k)
    norm.buffers["running_var"][...] = rng.uniform(0.5, 2.0, k)
    norm.training = training
    part = slice(3, 6)
    wide = BATCHNORM_STAGE.widened(part, k)
    grad = BATCHNORM_STAGE.grad_range(part, k)
    own = slice(part.start - wide.start, part.stop - wide.start)
    bn = [BatchNormSlice.of(norm, wide)]
    y_part, run = stage_forward(backend, x, w[wide], b[wide], sides, BATCHNORM_STAGE, own, bn)
    y = np.zeros((n, k, *y_part.shape[2:]), np.float32)
    y[:, part] = y_part
    dy = rng.standard_normal(y.shape, dtype=np.float32)
    rel = slice(grad.start - wide.start, grad.stop - wide.start)
    _, dw_part, db_part = stage_backward(backend, run, dy[:, grad], rel, False)
    dw, db = np.zeros_like(w), np.zeros(k, np.float32)
    dw[part], db[part] = dw_part, db_part
    sample = SpotChecker(SpotCheckConfig(kernels=2, images=2, channels=2)).sample(
        "conv", "forward", 1, part, n, c
    )
    whole = [BatchNormSlice.of(norm, slice(0, k))]

    def both():
        forward = stage_forward_sample(
            FLOAT32, x, w, b, sides, BATCHNORM_STAGE, y, sample, batchnorm=whole
        )
        backward = stage_backward_sample(
            FLOAT32, x, w, b, dy, sides, BATCHNORM_STAGE, dw, db, sample, batchnorm=whole
        )
        return forward + backward

    assert _failures(both(), FLOAT32) == []
    lies = [("y", y), ("dw", dw), ("db", db)]
    if training:  # a channel's mean is taken out: its conv bias gets no gradient to scale
        assert np.abs(db).max() < 1e-5 * np.abs(dw).max()
        lies.pop()
    for name, array in lies:
        array *= 1.5
        assert _failures(both(), FLOAT32) == [name], name
        array /= 1.5


def test_a_bias_gradient_that_cancels_to_nothing_is_not_flagged(rng):
    # db is a sum over the batch; when the output gradient sums to ~0 it carries only round-off.
    # It shares its scale with the kernel gradients, so round-off is not taken for a lie.
    backend = get_backend("cpu")
    x = rng.standard_normal((4, 3, 6, 6), dtype=np.float32)
    w = rng.standard_normal((2, 3, 3, 3), dtype=np.float32)
    dy = rng.standard_normal((4, 2, 6, 6), dtype=np.float32)
    dy -= dy.mean(axis=(0, 2, 3), keepdims=True, dtype=np.float64).astype(np.float32)
    dw, db = backend.conv_grad_kernels(x, dy, (3, 3), (1, 1, 1, 1))
    sample = SpotChecker(SpotCheckConfig()).sample("conv", "backward", 1, slice(0, 2), 4, 3)
    comparisons = kernel_backward_sample(
        FLOAT32, x, w, dy, (1, 1, 1, 1), slice(0, 2), dw, db, None, sample
    )
    assert [c.tensor for c in comparisons] == ["dw", "db"]
    assert np.abs(db).max() < 1e-5 * np.abs(dw).max()  # it did cancel
    assert _failures(comparisons, FLOAT32) == []


def test_samples_follow_seed_step_layer_phase_and_node():
    # unpredictable=False: the samples follow these alone (a run repeated checks the same).
    def draw(seed=0, step=3, layer="conv2", phase="forward", node=1, part=slice(10, 30)):
        config = SpotCheckConfig(kernels=3, images=2, channels=2, seed=seed, unpredictable=False)
        checker = SpotChecker(config)
        checker.start_step(step)
        s = checker.sample(layer, phase, node, part, 16, 8)
        return s.kernels.tolist(), s.images.tolist(), s.channels.tolist()

    kernels, images, channels = draw()
    assert draw() == (kernels, images, channels)  # the same every time
    assert all(10 <= k < 30 for k in kernels) and kernels == sorted(set(kernels))
    assert len(images) == 2 and len(set(images)) == 2 and all(0 <= i < 16 for i in images)
    assert len(channels) == 2 and all(0 <= c < 8 for c in channels)
    others = [draw(seed=1), draw(step=4), draw(layer="conv1"), draw(phase="backward"), draw(node=2)]
    assert all(other != (kernels, images, channels) for other in others)
    # A piece smaller than the sample is checked whole.
    assert draw(part=slice(5, 7))[0] == [5, 6]


def test_checks_fall_on_every_nth_step_and_none_when_off():
    checker = SpotChecker(SpotCheckConfig(every=4, unpredictable=False))
    due = []
    for step in range(10):
        checker.start_step(step)
        due.append(checker.due)
    assert [s for s, d in enumerate(due) if d] == [0, 4, 8]
    off = SpotChecker(SpotCheckConfig(every=0))
    off.start_step(0)
    assert not off.due


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (dict(every=-1), "spot-check interval must be >= 0 steps (0: off), got -1"),
        (dict(kernels=0), "at least 1 kernel, 1 image and 1 input channel, got 0 kernels"),
        (dict(images=0), "got 2 kernels, 0 images"),
        (dict(rtol=0.0), "spot-check tolerance must be in (0, 1), got 0.0"),
    ],
)
def test_bad_settings_are_refused_naming_the_value(config, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        SpotCheckConfig(**config)


def test_float16_overflow_on_the_masters_side_only_is_no_error():
    # The worker's float32 65519 reaches the master as float16's largest, 65504; the master's
    # own 65520.5 would round to inf. A finite answer cannot say more: no lie.
    x = np.ones((1, 1, 1, 1), np.float32)
    w = np.full((1, 1, 1, 1), 65520.5, np.float32)
    y = np.full((1, 1, 1, 1), 65504.0, np.float32)
    sample = Sample(np.array([0]), np.array([0]), np.array([0]))
    b = np.zeros(1, np.float32)
    assert _failures(kernel_forward_sample(FLOAT16, x, w, b, (0,) * 4, y, sample), FLOAT16) == []
    y[...] = 60000.0  # but a finite answer far from it is still wrong
    assert _failures(kernel_forward_sample(FLOAT16, x, w, b, (0,) * 4, y, sample), FLOAT16) == ["y"]


def test_comparison_of_equal_infinities_is_no_error():
    inf = np.array([np.inf, 1.0], np.float32)
    assert relative_error(Comparison("y", "y", inf, inf.copy(), 1.0, True)) == (0.0, 0.0)


# -- the command line ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--local", "--spot-check-every", "2"], "nothing to spot-check: drop --spot-check-*"),
        (["--spot-check-every", "0", "--spot-check-sample", "3"], "checks nothing"),
    ],
)
def test_cli_refuses_spot_check_flags_that_would_do_nothing(capsys, argv, message):
    assert main(["train", "--no-progress", "--steps", "1", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_cli_refuses_a_negative_interval(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--spot-check-every", "-1"])
    assert exit_info.value.code == 2
    assert "--spot-check-every" in capsys.readouterr().err


def test_cli_spot_check_flags_reach_the_trace(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    argv = ["train", "--no-progress", "--steps", "2", "--batch", "4", "--train-size", "16"]
    argv += ["--eval-size", "4", "--local-workers", "1", "--trace", str(trace)]
    argv += ["--spot-check-every", "2", "--spot-check-sample", "3", "--seed", "7"]
    assert main(argv) == 0
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    plan = records[0]
    assert plan["spot_checks"] == dict(
        every=2, kernels=3, images=3, channels=3, ranges=3, seed=7, rtol=1e-4, unpredictable=True
    )
