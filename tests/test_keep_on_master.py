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
