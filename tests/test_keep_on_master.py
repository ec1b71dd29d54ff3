"""``--shares link`` keeps every kernel on the master where the whole step is predicted under
``KEEP_GAIN`` times the master alone (after the modes are chosen): a real worker process, the
prediction's speedup pinned."""

from __future__ import annotations

import dataclasses
import json

import pytest

from hetconv.master import records
from hetconv.master.cluster import Cluster, ClusterConfig
from hetconv.master.launch import LocalWorkers
from hetconv.master.planning import LINK_POLICY
from hetconv.training import TrainConfig, train

CONFIG = TrainConfig(preset="paper-50-500", steps=2, batch=8, eval_size=8, train_size=32)


def _pinned(monkeypatch, speedup: float) -> list[dict]:
    """Every prediction's speedup pinned; the workers' kernels seen at each, in order."""
    real, seen = records.predict_step, []

    def pinned(cluster, *args, **kwargs):
        out = real(cluster, *args, **kwargs)
        seen.append({n: sum(p.shares[1:]) for n, p in cluster.plans.items()})
        return None if out is None else {**out, "speedup": speedup}

    monkeypatch.setattr(records, "predict_step", pinned)
    return seen


@pytest.mark.parametrize("speedup, kept", [(1.05, True), (1.5, False)])
def test_a_split_predicted_under_the_gain_keeps_every_kernel_on_the_master(
    monkeypatch, tmp_path, speedup, kept
):
    seen = _pinned(monkeypatch, speedup)
    trace = tmp_path / "trace.jsonl"
    config = ClusterConfig(share_policy=LINK_POLICY, stages="fused", kernels="resident")
    with LocalWorkers(1) as workers, Cluster(workers.addresses, config=config) as cluster:
        result = train(dataclasses.replace(CONFIG, trace=str(trace)), cluster)
        workers_hold = {n: sum(p.shares[1:]) for n, p in cluster.plans.items()}
    prediction = json.loads(trace.read_text().splitlines()[0])["prediction"]
    assert seen[0]["conv2"] > 0  # the link shares split conv2 at first
    if kept:
        assert not any(workers_hold.values())
        assert "every kernel stays on the master" in prediction["kept"]
        assert "1.05x the master alone, under the 1.1x" in prediction["kept"]
    else:
        assert workers_hold["conv2"] > 0 and "kept" not in prediction
    assert result.losses and all(loss == loss for loss in result.losses)


def test_the_first_plan_prices_the_modes_auto_can_reach():
    """The first shares are planned as the modes ``auto`` may choose would run (kernels kept,
    the first block replicated), not as the paper's: priced with kernels sent and conv2's
    input crossing, a near-tie on a shared medium decided between 2.3x and 1.0x."""
    from types import SimpleNamespace

    from hetconv.master import runs
    from hetconv.master.planning import Planner
    from hetconv.model import Model, load_spec

    layers = Model(load_spec("paper-150-800"), seed=0).conv_specs()
    planned = []
    cluster = SimpleNamespace(
        config=ClusterConfig(share_policy=LINK_POLICY, stages="auto", kernels="auto",
                             replicate="auto"),
        planner=Planner(True, LINK_POLICY, "wifi", stages="auto"),
        replan=lambda: planned.append(cluster.planner),
    )  # fmt: skip
    runs.plan_first(cluster, layers)
    assert planned[0].resident == frozenset({"conv1", "conv2"})
    assert dict(planned[0].replicas) == {"conv2": "conv1"}
    cluster.config = ClusterConfig(share_policy=LINK_POLICY, stages="auto", kernels="sent",
                                   replicate="off")  # fmt: skip
    runs.plan_first(cluster, layers)
    assert planned[1].resident == frozenset() and not planned[1].replicas
