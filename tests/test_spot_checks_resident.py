"""Spot checks a liar cannot dodge, with the default modes (fused stages, resident kernels, a
split head): at each sync the master replays a secret sample of each resident slice (the whole
slice with a split head) from the last sync and compares the worker's forward answers of every
step since and its updates; the steps and samples follow a secret; an answer of which nothing
could be compared is not counted as a check.

The liars are real gRPC worker processes (``tests/lying_worker.py``) next to a real ``hetconv
worker`` process started by :class:`~hetconv.master.launch.LocalWorkers`.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_spot_checks import FAST, SHARES, _lost, _train, lying_worker

from hetconv.formats import FLOAT32
from hetconv.master.cluster import Cluster, ClusterConfig
from hetconv.master.launch import LocalWorkers
from hetconv.master.membership import DISTRUSTED
from hetconv.master.spotcheck import Comparison, SpotCheckConfig, SpotChecker

SYNC = 3  # steps between syncs: each lie is caught at the first, step 3
DEFAULT_MODES = dict(stages="fused", kernels="resident", head="split", resident_sync_every=SYNC)
RUN = dict(steps=6)


def _config(**overrides) -> ClusterConfig:
    every_step = SpotCheckConfig(every=1)  # every interval replayed: the catch's step is known
    return ClusterConfig(
        **{**FAST, **DEFAULT_MODES, "shares": SHARES, "spot_checks": every_step, **overrides}
    )


@pytest.mark.parametrize(
    ("kind", "layer", "what"),
    [
        # every other forward answer x1.5: here always the split head's logits (2 resident
        # layers a step); before, a split head's answers were never sampled
        ("every_other", "conv2", "partial logits of step 0"),
        # each SGD update x1.01: before, a worker's updates were never compared
        ("update", "conv1", "as updated since the sync"),
        ("head", "conv2", "partial logits of step 0"),  # the split head's logits x1.5
    ],
)
def test_each_lie_is_caught_at_the_first_sync_with_the_default_modes(tmp_path, kind, layer, what):
    with LocalWorkers(1) as workers, lying_worker(kind) as liar:
        with Cluster(workers.addresses + [liar], config=_config()) as cluster:
            got = _train(tmp_path, kind, cluster, **RUN)
            assert cluster.kernel_modes == {"conv1": "resident", "conv2": "resident"}
            assert cluster.head_fcs == {"conv2": "fc"}
            events = list(cluster.events)
            states = {node.name: node.state for node in cluster.nodes}
    assert _lost(events) == [(liar, SYNC)]
    (lost,) = [e for e in events if e["event"] == "worker_lost"]
    assert f"replay {layer}: spot check failed: " in lost["reason"], lost["reason"]
    assert what in lost["reason"] and "not re-admitted" in lost["reason"]
    assert states[liar] == DISTRUSTED and states[workers.addresses[0]] == "active"
    assert all(liar not in r["nodes"] for r in got[2][SYNC + 1 :])


def test_honest_workers_pass_every_replay_and_empty_samples_are_not_counted(tmp_path):
    # The control: two honest workers, every interval replayed, none dropped. Between syncs a
    # resident layer's forward can be compared with nothing (its weights are the worker's
    # alone): those steps have no spot-check record at all (before, {"checks": 2,
    # "worst": 0.0} per worker, answers of which nothing was compared counted as checks).
    with LocalWorkers(2) as workers:
        with Cluster(workers.addresses, config=_config(shares=None)) as cluster:
            got = _train(tmp_path, "honest", cluster, **RUN)
            events = list(cluster.events)
    assert _lost(events) == []
    records = {r["step"]: r for r in got[2]}
    syncs = {0, SYNC}  # placed at step 0 (the first forward is compared), synced at step 3
    assert {step for step, r in records.items() if "spot_checks" in r} == syncs
    replayed = records[SYNC]["spot_checks"]["workers"]
    assert set(replayed) == set(workers.addresses)
    for worker in replayed.values():
        assert worker["checks"] >= 2  # a replay of each layer's slice
        assert worker["worst"] < 1e-3


def test_an_answer_of_which_nothing_is_compared_is_not_counted():
    class Nothing:
        phase = "forward"

        def spot_sample(self, piece, answer, draw):
            return []

    class Node:
        name = "w"

    class Piece:
        index, part, node = 1, slice(0, 4), Node()

    checker = SpotChecker(SpotCheckConfig(every=1))
    checker.check(Nothing(), Piece(), None, "conv1")
    assert checker.record() is None
    Node.client = type("Client", (), {"wire_format": FLOAT32})
    one = np.ones(2)
    checker.compare(Node(), "conv1", "replay", [Comparison("y", "y", one, one, 1.0, False)])
    assert checker.record()["workers"] == {"w": {"checks": 1, "worst": 0.0, "at": "conv1 replay y"}}


def test_checked_steps_and_samples_follow_a_secret():
    # Two runs with the same settings check other steps and sample other kernels: a worker
    # cannot tell from the step number (or its seed) which answers are compared. Each step is
    # checked with probability 1 / every.
    config = SpotCheckConfig(every=4)
    a, b = SpotChecker(config), SpotChecker(config)
    due = [[s for s in range(400) if c.due_at(s)] for c in (a, b)]
    assert due[0] != due[1]
    assert all(60 < len(d) < 140 for d in due)
    draws = [c.watch("conv2", "w", slice(0, 64), 3).tolist() for c in (a, b)]
    samples = [
        c.sample("conv2", "forward", 1, slice(0, 64), 16, 8).kernels.tolist() for c in (a, b)
    ]
    assert draws[0] != draws[1] or samples[0] != samples[1]
    # The same checker draws the same for the same step (the sync's watch is kept).
    assert a.watch("conv2", "w", slice(0, 64), 3).tolist() == draws[0]
    # Predictable on request: every 4th step from 0, the samples from the settings alone.
    fixed = SpotCheckConfig(every=4, unpredictable=False)
    assert [s for s in range(12) if SpotChecker(fixed).due_at(s)] == [0, 4, 8]
