"""``--deterministic``: two runs with the same settings over the same workers are bitwise
identical, real worker processes included.

What could make them differ, and what each test pins down: shares planned from timings (the
split is equal over the usable nodes, whatever the probes measure), rebalancing on measured
speed (off), and the order in which the input-gradient parts are summed (node order, whichever
worker answers first).
"""

from __future__ import annotations

import io
import json
import random
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from hetconv.backends import ConvShape, Padding
from hetconv.balance import kernel_shares
from hetconv.master import probing
from hetconv.master.client import CallStats
from hetconv.master.cluster import Cluster, ClusterConfig
from hetconv.master.dispatch import KernelSplit, PhaseRunner, WorkerRequest
from hetconv.master.launch import LocalWorkers
from hetconv.master.membership import LOST, Node
from hetconv.master.planning import LayerPlan, PlannedLayer, Planner
from hetconv.training import TrainConfig, train

SMALL = dict(steps=6, batch=8, train_size=64, eval_size=16, progress=False)
TINY_KERNELS = {"conv1": 8, "conv2": 16}  # the tiny preset's convolutions


@pytest.fixture(scope="module")
def workers():
    with LocalWorkers(2) as launched:
        yield launched.addresses


def _shape(k: int) -> ConvShape:
    return ConvShape(8, 3, 8, 8, k, 3, 3, Padding.resolve("same", (3, 3)))


def _nodes(*probe_seconds: float) -> list[Node]:
    """The master and workers with these probe figures on layer 'c' (a stand-in client)."""
    return [
        Node(f"n{i}", None if i == 0 else object(), probe_seconds={"c": t})
        for i, t in enumerate(probe_seconds)
    ]


# -- the planner: no timing decides a share ---------------------------------------------------


@pytest.mark.parametrize("master_compute", [True, False])
def test_deterministic_planner_splits_equally_whatever_the_probes(master_compute):
    layers = [PlannedLayer("c", _shape(16), True)]
    planner = Planner(master_compute, deterministic=True)
    fast = planner.plan(_nodes(0.001, 1.0, 0.5), layers, everyone_active=True)
    slow = planner.plan(_nodes(9.0, 0.002, 0.3), layers, everyone_active=True)
    want = (6, 5, 5) if master_compute else (0, 8, 8)
    assert fast["c"].shares == slow["c"].shares == want
    # Unseen layers too (split by the mean probe otherwise).
    unseen = planner.plan_unseen(_nodes(0.001, 1.0, 0.5), (8, 3, 8, 8), (16, 3, 3, 3), "same")
    assert unseen.shares == want
    # A lost worker leaves the split to the others, still equal.
    nodes = _nodes(0.001, 1.0, 0.5)
    nodes[1].state = LOST
    lost = planner.plan(nodes, layers, everyone_active=False)["c"].shares
    assert lost == ((8, 0, 8) if master_compute else (0, 0, 16))


def test_deterministic_planner_keeps_fixed_shares_and_refuses_the_link_policy():
    layers = [PlannedLayer("c", _shape(16), True)]
    planner = Planner(True, fixed={"c": (2, 4, 10)}, deterministic=True)
    assert planner.plan(_nodes(1, 1, 1), layers, everyone_active=True)["c"].shares == (2, 4, 10)
    with pytest.raises(ValueError, match="cannot be deterministic"):
        Planner(True, policy="link", deterministic=True)


# -- dispatch: the input-gradient parts are summed in node order ------------------------------


class _RecordingJob:
    """A backward-like job whose workers answer in an order the test chooses; it records the
    order in which the parts are added (what ``_KernelBackward._add_dx`` does)."""

    phase = "backward"
    images = 8

    def __init__(self, delays: dict[int, float]):
        self.delays, self.added, self.finished = delays, [], []
        self._lock = threading.Lock()

    def worker_request(self, piece):
        def call(index, timeout):
            time.sleep(self.delays[index])
            with self._lock:
                self.finished.append(index)
            return index

        return WorkerRequest(call, (piece.index,), {}, 0)

    def check(self, piece, answer) -> None:
        pass

    def compute_locally(self, piece) -> None:
        self.added.append(piece.index)

    def accept(self, piece, answer) -> CallStats:
        self.added.append(answer)
        return CallStats()

    def result(self):
        return self.added


def test_parts_are_summed_in_node_order_whichever_worker_answers_first():
    nodes = _nodes(1, 1, 1, 1)
    membership = SimpleNamespace(nodes=nodes, failed=set(), lose=None)
    runner = PhaseRunner(membership, deadline_floor=5.0, deadline_factor=10.0)
    plan = LayerPlan.of(_shape(16), (4, 4, 4, 4))
    # The last worker answers first, the first one last.
    job = _RecordingJob({1: 0.3, 2: 0.15, 3: 0.0})
    assert runner.run(KernelSplit(), job, "c", plan) == [0, 1, 2, 3]
    assert job.finished == [3, 2, 1]


# -- whole runs through real worker processes -------------------------------------------------


def _random_probes(monkeypatch, seed: int) -> None:
    """Every probe reports its real time scaled by a random factor: shares planned from them
    would differ from run to run."""
    real, rng = probing.probe, random.Random(seed)
    monkeypatch.setattr(
        probing, "probe", lambda *a, **k: real(*a, **k) * 10 ** rng.uniform(-1.5, 1.5)
    )


def _cluster_run(workers, tmp_path, name, monkeypatch, seed):
    _random_probes(monkeypatch, seed)
    trace, weights = tmp_path / f"{name}.jsonl", tmp_path / f"{name}.npz"
    # Rebalancing as eager as it gets: a deterministic cluster must ignore it.
    config = ClusterConfig(deterministic=True, rebalance_every=2, rebalance_change=1e-6)
    with Cluster(workers, config=config) as cluster:
        config = TrainConfig(save=str(weights), trace=str(trace), **SMALL)
        result = train(config, cluster, log=io.StringIO())
        plans = {name: plan.shares for name, plan in cluster.plans.items()}
        events = list(cluster.events)
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    return result.losses, dict(np.load(weights)), plans, events, records


def test_two_deterministic_cluster_runs_are_bitwise_identical(workers, tmp_path, monkeypatch):
    losses_a, weights_a, plans_a, events_a, records = _cluster_run(
        workers, tmp_path, "a", monkeypatch, seed=1
    )
    losses_b, weights_b, plans_b, events_b, _ = _cluster_run(
        workers, tmp_path, "b", monkeypatch, seed=2
    )
    equal = {name: tuple(kernel_shares(k, [1.0] * 3)) for name, k in TINY_KERNELS.items()}
    assert plans_a == plans_b == equal  # every node computes, equally, whatever the probes
    assert not [e for e in events_a + events_b if e["event"] == "shares_changed"]
    assert len(losses_a) == SMALL["steps"]
    assert np.array_equal(losses_a, losses_b)
    assert weights_a.keys() == weights_b.keys()
    for name in weights_a:
        assert np.array_equal(weights_a[name], weights_b[name]), name
    plan = records[0]
    assert plan["event"] == "plan" and plan["deterministic"] is True
    assert plan["shares"] == {name: list(shares) for name, shares in equal.items()}


def test_plan_record_says_when_a_run_is_not_deterministic(workers):
    with Cluster(workers[:1]) as cluster:
        cluster.prepare([], batch=8)
        assert cluster.plan_record()["deterministic"] is False


# -- the command line -------------------------------------------------------------------------

TINY_RUN = ["--steps", "4", "--batch", "8", "--train-size", "64", "--eval-size", "16"]


def _hetconv_train(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hetconv", "train", *TINY_RUN, "--no-progress", *args],
        capture_output=True,
        text=True,
        timeout=180,
    )


@pytest.mark.slow
def test_two_deterministic_command_line_runs_save_identical_weights(tmp_path):
    saved = []
    for name in ("a", "b"):
        weights, trace = tmp_path / f"{name}.npz", tmp_path / f"{name}.jsonl"
        # The embedded default: two local worker processes, started afresh for each run.
        run = _hetconv_train("--deterministic", "--save", str(weights), "--trace", str(trace))
        assert run.returncode == 0, run.stderr
        assert "--deterministic" in run.stderr  # the shares table says how it split
        plan = json.loads(trace.read_text().splitlines()[0])
        assert plan["event"] == "plan" and plan["deterministic"] is True
        saved.append(dict(np.load(weights)))
    a, b = saved
    assert a.keys() == b.keys() and a
    for name in a:
        assert np.array_equal(a[name], b[name]), name


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--shares", "link"], "--deterministic splits kernels equally"),
        (["--rebalance-every", "5"], "--deterministic never rebalances"),
        (["--settle-steps", "3"], "--deterministic never settles"),
    ],
)
def test_deterministic_refuses_what_would_follow_timings(args, message):
    run = _hetconv_train("--deterministic", *args)
    assert run.returncode == 2
    assert message in run.stderr
    assert "starting" not in run.stderr  # refused before any worker process starts
