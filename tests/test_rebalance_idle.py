"""A worker left with no kernel is probed again and earns its work back (real worker processes).

Two workers on loopback, one of which is slow while a flag file exists (its calls sleep three
times their compute more, and say so: ``test_faults.BUSY_WORKER``). Its figures are scaled far
up at step 1, as a drift far up leaves them (the ``link`` policy then gives such a worker
nothing; which drift does that depends on timing, so the test scales the figures itself), and
the shares are planned again: it has no kernel. At step 2 it is normal again. It must be probed
again (``rebalance_every`` steps after it fell idle), get kernels back, and be listed as idle
in the trace meanwhile, never as lost. No assertion on any time: the probes on
a busy machine say what they say (best of 3, against a moment's stall; a probe that still
leaves it idle is followed by another, twice as late, as in any run), so "kernels back" is some
kernel of some layer, and "idle from step 1" allows a start on which its first probe already
came out too slow for a kernel.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import threading

import pytest
from test_faults import BUSY_WORKER

from hetconv.calls import READY as READY_LINE
from hetconv.master.cluster import Cluster, ClusterConfig
from hetconv.master.launch import LocalWorkers
from hetconv.training import TrainConfig, train

RUN = dict(steps=12, batch=8, train_size=64, eval_size=0, progress=False)


class Scripted(Cluster):
    """A cluster that runs ``actions[step](cluster)`` at that step's boundary, first, and waits
    there for the idle workers' probes in flight, so that no step count depends on time."""

    def __init__(self, addresses, actions, **config):
        super().__init__(addresses, config=ClusterConfig(**config))
        self.actions = actions

    def begin_step(self, step):
        if step in self.actions:
            self.actions[step](self)
        for _, call in list(self.idle._calls.values()):
            call.notify(done := threading.Event())
            assert done.wait(60), "the probe did not end"
        super().begin_step(step)


def _train(tmp_path, executor) -> list[dict]:
    """Train on ``executor``; the trace's step records."""
    trace = tmp_path / "trace.jsonl"
    train(TrainConfig(trace=str(trace), **RUN), executor, log=io.StringIO())
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    return [r for r in records if "step" in r and "loss" in r]


@pytest.fixture
def slow_worker(tmp_path):
    flag = tmp_path / "slow"
    flag.touch()
    process = subprocess.Popen(
        [sys.executable, "-c", BUSY_WORKER, str(flag)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    address = None
    for line in process.stdout:
        if line.startswith(READY_LINE):
            address = line[len(READY_LINE) :].strip()
            break
    assert address, "the slow worker did not start"
    try:
        yield address, flag
    finally:
        process.terminate()
        process.wait(10)


def test_a_worker_starved_of_kernels_is_probed_again_and_gets_them_back(tmp_path, slow_worker):
    address, flag = slow_worker
    index = 2  # master, the normal worker, then this one
    kernels = {}

    def drifted_far(cluster):
        node = cluster.nodes[index]
        for layer in node.probe_seconds:
            node.probe_seconds[layer] *= 1e4
        cluster.replan()
        kernels["idle"] = [plan.shares[index] for plan in cluster.plans.values()]

    actions = {1: drifted_far, 2: lambda cluster: flag.unlink()}
    config = dict(rebalance_every=2, rebalance_change=100.0, settle_steps=0, probe_repeats=3)
    with LocalWorkers(1) as workers:
        with Scripted(workers.addresses + [address], actions, **config) as cluster:
            steps = _train(tmp_path, cluster)
            events = [(e["event"], e.get("worker"), e["step"]) for e in cluster.events]
            reasons = [e["reason"] for e in cluster.events if e["event"] == "shares_changed"]
            after = [plan.shares[index] for plan in cluster.plans.values()]
    assert kernels["idle"] == [0, 0]
    assert any(after), after  # kernels back
    fell = [step for kind, who, step in events if kind == "worker_idle" and who == address]
    assert fell and fell[0] <= 1, events
    # probed after step fell + 2, the probe's figures taken at the next boundary; a probe that
    # left it idle (a stall on a busy machine) is followed by one twice as late
    reprobed = [step for kind, who, step in events if kind == "worker_reprobed" and who == address]
    assert reprobed[:2] == [fell[0] + 3, fell[0] + 3 + 5][: len(reprobed[:2])], events
    assert any(f"{address} had no kernel and was probed again" in r for r in reasons), reasons
    assert not [e for e in events if e[0] == "worker_lost"]
    idle_steps = [r["step"] for r in steps if address in r.get("idle", ())]
    back = idle_steps[-1] + 1
    assert back in reprobed and idle_steps == list(range(fell[0], back)), (idle_steps, events)
    assert address in steps[-1]["nodes"]  # it computed in the last step
