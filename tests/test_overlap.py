"""Overlap of transfer and compute within fused stage calls (``--overlap``).

Real worker processes on loopback: a worker asked to overlap runs its stage on image groups and
streams each group's output as it is computed (the answer's timings come last), and its backward
starts on each group as its gradient arrives; the answers equal whole-batch ones to round-off,
and training with overlap (every call streamed) equals local training step by step, also when a
worker holding resident kernels is SIGKILLed mid-step. The wire's closing-timings rule is
checked on its own, and the cost model's pipelines against their closed forms.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from exactness import FAST, same_as_local, train_strong_lrn

from hetconv.backends import get_backend
from hetconv.costmodel import (
    SimCluster,
    SimNode,
    WorkerCall,
    overlap_images,
    simulate_phase,
    simulate_step,
)
from hetconv.errors import MalformedMessage
from hetconv.master import client as client_module
from hetconv.master.client import WorkerClient, WorkerError
from hetconv.master.cluster import Cluster, ClusterConfig
from hetconv.master.launch import LocalWorkers
from hetconv.optim import SGDConfig
from hetconv.overlap import group_count, group_images
from hetconv.proto import worker_pb2 as pb
from hetconv.simulations.calibrate import calibrate
from hetconv.stages import StageSpec, stage_backward, stage_forward
from hetconv.wire import TensorReceiver, receive_stream
from hetconv.workload import network_layers

SHARES = {"conv1": (2, 3, 3), "conv2": (5, 9, 2)}
STAGE = StageSpec.from_entries(
    [{"type": "relu"}, {"type": "lrn", "size": 3, "alpha": 1.0}, {"type": "maxpool", "kernel": 2}]
)


@pytest.fixture
def streamed(monkeypatch):
    """Every call streams (none is small enough to go as one message), so every overlapped
    answer goes group by group with its timings last."""
    monkeypatch.setattr(client_module, "BUNDLE_BYTES", -1)


@pytest.mark.parametrize(
    "kernels, replicate",
    [
        pytest.param("sent", "first", marks=pytest.mark.slow),
        ("resident", "first"),
        ("resident", "off"),
    ],
)
def test_overlapped_training_equals_local(local, workers, tmp_path, kernels, replicate):
    """Every call here is small enough for one message; overlapped, each streams anyway."""
    trace = tmp_path / "trace.jsonl"
    config = ClusterConfig(
        **FAST, shares=SHARES, stages="fused", kernels=kernels, replicate=replicate, overlap="on"
    )
    with Cluster(workers.addresses, config=config) as cluster:
        got = train_strong_lrn(tmp_path, "overlap", cluster, trace=str(trace))
    same_as_local(got, local)
    plan = json.loads(trace.read_text().splitlines()[0])
    fused = ["conv2"] if replicate == "first" else ["conv1", "conv2"]
    assert plan["overlap"] == "on"
    assert plan["overlap_images"] == {name: 2 for name in fused}  # 4 groups of 2 images
    steps = [json.loads(line) for line in trace.read_text().splitlines()[1:]]
    steps = [r for r in steps if "step" in r]
    assert all(r["overlap_images"] == {name: 2 for name in fused} for r in steps)
    # the simulator calibrated from the trace models the groups (and times no link by them)
    assert calibrate(str(trace)).overlap_images == {name: 2 for name in fused}
    for record in steps:  # every worker call streamed, and its closing timings came
        for node in workers.addresses:
            for phase in ("forward", "backward"):
                call = record["nodes"][node]["conv2"][phase]
                assert not call["bundled"]
                assert call["compute_seconds"] > 0


class Killing(Cluster):
    def __init__(self, addresses, victim, at, **config):
        super().__init__(addresses, config=ClusterConfig(**config))
        self.victim, self.at = victim, at

    def stage_backward(self, layer, *args, **kwargs):
        if self.step == self.at and self.victim.poll() is None:
            self.victim.kill()  # SIGKILL between its overlapped forward and its backward
            self.victim.wait()
        return super().stage_backward(layer, *args, **kwargs)


def test_a_worker_killed_mid_step_stays_exact_with_overlap(local, tmp_path, streamed):
    with LocalWorkers(2) as started:
        victim = started.processes[1]
        config = dict(
            **FAST, shares=SHARES, stages="fused", kernels="resident", replicate="first",
            overlap="on", resident_sync_every=3,
        )  # fmt: skip
        with Killing(started.addresses, victim, 4, **config) as cluster:
            got = train_strong_lrn(tmp_path, "killed", cluster)
            lost = [e for e in cluster.events if e["event"] == "worker_lost"]
    same_as_local(got, local)
    assert [(e["worker"], e["step"]) for e in lost] == [(started.addresses[1], 4)]


def _stage_problem(n=7):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((n, 4, 8, 8)).astype(np.float32)
    w = rng.standard_normal((6, 4, 3, 3)).astype(np.float32)
    b = rng.standard_normal(6).astype(np.float32)
    return x, w, b


@pytest.fixture(params=["streamed", "bundled"])
def how(request, monkeypatch):
    """``streamed``: as the client sends an overlapped call; ``bundled``: as one message each
    way (another client may), which the worker computes group by group and answers whole."""
    if request.param == "bundled":
        original = WorkerClient._call

        def one_message(self, *args, stream=False, **kwargs):
            return original(self, *args, **kwargs)

        monkeypatch.setattr(WorkerClient, "_call", one_message)
    return request.param


@pytest.mark.parametrize("kernels", ["sent", "resident"])
def test_a_worker_streams_groups_that_equal_the_whole_batch(workers, how, kernels):
    """Groups of 3 of 7 images (the last holds 1): the answer and the gradients are the whole
    batch's, to round-off; the closing timings arrive."""
    backend = get_backend("cpu")
    x, w, b = _stage_problem()
    own = slice(1, 5)  # owned kernels 1..4 of the 6 sent (the LRN's halo around them)
    want, run = stage_forward(backend, x, w, b, (1, 1, 1, 1), STAGE, own)
    dy = np.random.default_rng(4).standard_normal(want.shape).astype(np.float32)
    dx_want, dw_want, db_want = stage_backward(backend, run, dy, own, True)
    client = WorkerClient(workers.addresses[0])
    try:
        if kernels == "sent":
            y, _, stats = client.stage_forward(
                21, 0, "conv", x, w, b, (1, 1, 1, 1), STAGE, own, overlap_images=3
            )
            dx, dw, db, _, back = client.stage_backward(
                21, 0, "conv", dy, 1, True, answer_bytes=1, grouped=True
            )
        else:
            w_own, b_own = w[own].copy(), b[own].copy()
            zero_w, zero_b = np.zeros_like(w_own), np.zeros_like(b_own)
            sgd = SGDConfig(lr=0.5, momentum=0.0, weight_decay=0.0)
            client.place_kernels(21, "conv", 1, 1, w_own, b_own, zero_w, zero_b, False, sgd)
            hw, hb = np.concatenate([w[:1], w[5:]]), np.concatenate([b[:1], b[5:]])
            y, stats = client.resident_stage_forward(
                21, 0, "conv", x, hw, hb, 1, 1, (1, 1, 1, 1), STAGE, 4, overlap_images=3
            )
            dx, _, _, back = client.resident_stage_backward(
                21, 0, "conv", dy, 1, 1, True, answer_bytes=1, grouped=True
            )
            (dw, db, _, _, _, _), _ = client.fetch_kernels(21, "conv", 2)
            dw, db = (w_own - dw) / 0.5, (b_own - db) / 0.5  # the summed gradient it applied
        np.testing.assert_allclose(y, want, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(dx, dx_want, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(dw, dw_want, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(db, db_want, rtol=1e-4, atol=1e-4)
        assert stats.bundled == back.bundled == (how == "bundled")
        assert stats.compute_seconds > 0 and back.compute_seconds > 0
    finally:
        client.close()


def test_overlap_with_batch_norm_is_refused(workers, streamed):
    x, w, b = _stage_problem()
    bn_stage = StageSpec.from_entries([{"type": "batchnorm"}, {"type": "relu"}])
    from hetconv.stages import BatchNormSlice

    ones, zeros = np.ones(6, np.float32), np.zeros(6, np.float32)
    batchnorm = [BatchNormSlice(ones, zeros, True)]
    client = WorkerClient(workers.addresses[0])
    try:
        with pytest.raises(WorkerError, match="overlap_images 2 with a stage that holds 1 batch"):
            client.stage_forward(
                22, 0, "conv", x, w, b, (1, 1, 1, 1), bn_stage, slice(0, 6),
                batchnorm=batchnorm, overlap_images=2,
            )  # fmt: skip
        # and the worker goes on serving
        y, _, _ = client.stage_forward(
            22, 0, "conv", x, w, b, (1, 1, 1, 1), bn_stage, slice(0, 6), batchnorm=batchnorm
        )
        assert y.shape == (7, 6, 8, 8)
    finally:
        client.close()


# -- the closing timings on the wire ------------------------------------------------------------


def _answer(timings_follow=True):
    header = pb.TensorHeader(name="y", shape=[2], dtype=pb.FLOAT32, nbytes=8)
    return pb.ConvMessage(result=pb.ConvResult(tensors=[header], timings_follow=timings_follow))


def _receiver(first):
    return TensorReceiver([(2,)])


def _timings(compute=0.25, receive=0.5):
    return pb.ConvMessage(result=pb.ConvResult(compute_seconds=compute, receive_seconds=receive))


def test_the_closing_timings_are_read_into_the_first_result():
    data = memoryview(np.array([1.0, 2.0], np.float32).tobytes())
    first, (y,) = receive_stream(iter([_answer(), data, _timings()]), _receiver)
    assert list(y) == [1.0, 2.0]
    assert first.result.compute_seconds == 0.25 and first.result.receive_seconds == 0.5


@pytest.mark.parametrize(
    "messages, error",
    [
        (lambda d: [_answer(), d], "ended without them"),
        (lambda d: [_answer(), d[:4], _timings(), d[4:]], "second result message"),
        (lambda d: [_answer(), d, _timings(), _timings()], "after the closing timings"),
        (lambda d: [_answer(False), d, _timings()], "second result message"),
        (lambda d: [_answer(), d, _answer(False)], "carries more than timings"),
    ],
)
def test_bad_closing_timings_are_refused(messages, error):
    data = memoryview(np.array([1.0, 2.0], np.float32).tobytes())
    with pytest.raises(MalformedMessage, match=error):
        receive_stream(iter(messages(data)), _receiver)


# -- the cost model ------------------------------------------------------------------------------


def _phase(call):
    return float(simulate_phase([call], "switched", np.inf, np.inf)[0])


@pytest.mark.parametrize("groups", [2, 4, 8])
def test_an_overlapped_answer_goes_while_later_groups_compute(groups):
    compute, answer_s = 2.0, 3.0  # compute, and the answer's transfer at the link's rate
    plain = WorkerCall(0.0, 300.0, compute, 0.0, 0.0, 100.0, streamed=True)
    piped = WorkerCall(
        0.0, 300.0, compute, 0.0, 0.0, 100.0, streamed=True, groups=groups,
        pipelined_s=compute, overlap="answer",
    )  # fmt: skip
    assert _phase(plain) == pytest.approx(compute + answer_s)
    want = max(compute + answer_s / groups, compute / groups + answer_s)
    assert _phase(piped) == pytest.approx(want)
    # a slow link: the answer's transfer decides; a fast one: the compute and one group's send
    fast = WorkerCall(
        0.0, 10.0, compute, 0.0, 0.0, 100.0, streamed=True, groups=groups,
        pipelined_s=compute, overlap="answer",
    )  # fmt: skip
    assert _phase(fast) == pytest.approx(compute + 0.1 / groups)


@pytest.mark.parametrize("groups", [2, 4, 8])
def test_an_overlapped_request_computes_while_later_groups_arrive(groups):
    compute, request_s, after = 2.0, 3.0, 0.5  # ``after``: compute not grouped (a block's)
    piped = WorkerCall(
        300.0, 0.0, compute + after, 0.0, 0.0, 100.0, streamed=True, groups=groups,
        pipelined_s=compute, overlap="request",
    )  # fmt: skip
    want = max(request_s + compute / groups, request_s / groups + compute) + after
    assert _phase(piped) == pytest.approx(want)
    plain = WorkerCall(300.0, 0.0, compute + after, 0.0, 0.0, 100.0, streamed=True)
    assert _phase(plain) == pytest.approx(request_s + compute + after)


def test_the_cost_model_overlaps_only_streamed_answers_without_batch_norm():
    big = {layer.name: layer for layer in network_layers("paper-150-800", 64)}["conv2"]
    small = {layer.name: layer for layer in network_layers("paper-150-800", 4)}["conv2"]
    shares = (200, 150, 150, 150, 150)
    assert overlap_images(big, big.stage, shares) == group_images(64) == 8
    assert group_count(64, 8) == 8
    assert overlap_images(small, small.stage, shares) == 0  # one message: nothing to overlap
    bn = StageSpec.from_entries([{"type": "batchnorm"}, {"type": "relu"}])
    assert overlap_images(big, bn, shares) == 0
    assert overlap_images(big, big.stage, (800,)) == 0  # no workers
    assert overlap_images(big, big.stage, (800, 0, 0)) == 0  # no worker with a share


def test_overlap_shortens_the_predicted_step_on_a_shared_medium():
    layers = network_layers("paper-150-800", 64)
    workers = tuple(SimNode(f"w{i}", 20.0, bytes_per_s=8e6) for i in range(4))
    cluster = SimCluster(SimNode("m", 20.0), workers, "wifi", 8e6)
    shares = {"conv1": (150, 0, 0, 0, 0), "conv2": (160, 160, 160, 160, 160)}
    args = (cluster, layers, shares, 1.0, "fused", "resident", "first")
    off = simulate_step(*args, overlap="off")
    on = simulate_step(*args, overlap="on")
    assert on.step_s < off.step_s
    assert on.bytes == off.bytes  # the same bytes, sooner
    with pytest.raises(ValueError, match="overlap 'sometimes'"):
        simulate_step(*args, overlap="sometimes")


def test_link_shares_give_workers_more_when_their_maps_move_beside_the_compute():
    """Overlapped, a worker's maps cost only what the compute does not hide: the link-aware
    split gives the workers more of the layer, and the cost model predicts the layer faster."""
    from hetconv.balance import link_aware_shares, shares_for

    layers = network_layers("paper-150-800", 64)
    block, conv2 = layers
    workers = tuple(SimNode(f"w{i}", 20.0, bytes_per_s=8e6) for i in range(4))
    cluster = SimCluster(SimNode("m", 20.0), workers, "wifi", 8e6)
    whole = link_aware_shares(cluster, conv2, True, True, block)
    grouped = link_aware_shares(cluster, conv2, True, True, block, overlap_images=8)
    assert sum(grouped) == sum(whole) == 800
    assert grouped[0] < whole[0]  # the master keeps less
    planned = shares_for(cluster, layers, "link", "fused", "resident", "first", "on")
    assert list(planned["conv2"]) == grouped
    assert shares_for(cluster, layers, "link", "fused", "resident", "first", "auto") == planned
    # At batch 16 a worker's answer would fit one message, but an overlapped call streams
    # whatever its size: its maps move beside the compute too
    small_block, small = network_layers("paper-150-800", 16)
    small_grouped = link_aware_shares(cluster, small, True, True, small_block, 2)
    assert small_grouped[0] < link_aware_shares(cluster, small, True, True, small_block)[0]


def test_simulate_models_overlap(tmp_path):
    from hetconv.cli.simulate import main as simulate_main

    rows = {}
    for overlap in ("off", "on"):
        out = tmp_path / f"{overlap}.json"
        argv = ["low-mid-range", "--preset", "paper-150-800", "--batch", "64", "--nodes", "5"]
        argv += ["--bandwidth", "100"]
        argv += ["--stages", "fused", "--kernels", "resident", "--replicate", "first"]
        argv += ["--head", "master"]  # the last stage answers its maps, which overlap streams
        argv += ["--policy", "link", "--no-data-parallel", "--quiet"]
        assert simulate_main([*argv, "--overlap", overlap, "--json", str(out)]) == 0
        (rows[overlap],) = json.loads(out.read_text())
    assert rows["on"]["overlap"] == "on" and rows["off"]["overlap"] == "off"
    assert rows["on"]["step_s"] < rows["off"]["step_s"]


@pytest.mark.parametrize("fmt", ["float32", "float16", "bfloat16"])
def test_rows_decoded_early_are_not_decoded_again(fmt):
    """A receiver hands out leading rows as they arrive; finish converts only the rest."""
    from hetconv.formats import format_named

    wire = format_named(fmt)
    values = np.arange(12, dtype=np.float32).reshape(4, 3)
    data = b"".join(bytes(v) for v in wire.encode(values))
    receiver = TensorReceiver([(4, 3)], formats=[wire])
    half = len(data) // 2
    receiver.feed(memoryview(data)[:half])
    assert receiver.rows_in(0) == 2
    receiver.decode_rows(0, slice(0, 2))
    np.testing.assert_array_equal(receiver.arrays[0][:2], values[:2])
    with pytest.raises(ValueError, match="the next are from row 2"):
        receiver.decode_rows(0, slice(0, 2))
    with pytest.raises(ValueError, match="only 2 are in"):
        receiver.decode_rows(0, slice(2, 4))
    receiver.arrays[0][:2] = -1  # finish leaves the decoded rows alone
    receiver.feed(memoryview(data)[half:])
    (got,) = receiver.finish()
    np.testing.assert_array_equal(got[2:], values[2:])
    if fmt != "float32":  # (float32 rows are the received bytes themselves)
        np.testing.assert_array_equal(got[:2], -1)


def test_the_group_benchmark_runs_and_checks_its_groups(tmp_path):
    """``benchmarks/overlap_groups.py`` on the tiny preset: it runs the worker's own group
    code, checks it against the whole batch (it exits non-zero when they differ) and writes
    its rows."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "overlap_groups.py"
    out = tmp_path / "rows.json"
    args = ["--networks", "tiny", "--batches", "5", "--kernels", "3", "16", "--repeats", "1"]
    done = subprocess.run(
        [sys.executable, str(script), *args, "--json", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())
    assert [(r["kernels"], r["groups"], r["group_images"]) for r in rows] == [(3, 3, 2), (16, 3, 2)]
    assert all(r["whole_s"] > 0 and r["grouped_s"] > 0 for r in rows)
