"""What every exactness test shares: the run it trains (the tiny network with a strong LRN,
20 steps), and the check that a run through the cluster equals local training."""

from __future__ import annotations

import io
import json

import numpy as np

from hetconv.master.cluster import Cluster, ClusterConfig
from hetconv.master.runs import ReplicatedBlock
from hetconv.model import reference_spec
from hetconv.training import TrainConfig, train

RUN = dict(steps=20, batch=8, train_size=48, eval_size=16, progress=False)
# The tiny network with a strong normalisation (alpha 1 instead of 1e-4): with the usual alpha
# LRN is so near the identity that a missing halo channel, a stale halo kernel or a wrong
# back-propagation through a replicated block would hide below the tolerance.
STRONG_LRN = [{**e, "alpha": 1.0} if e["type"] == "lrn" else e for e in reference_spec(8, 16)]
#: Deadlines and retries short enough that a lost worker costs a test little time.
FAST = dict(deadline_floor=1.0, deadline_factor=5.0, retry_min=0.2, retry_max=1.0)


def train_strong_lrn(tmp_path, name, executor, trace=None, **overrides):
    """:data:`RUN` of :data:`STRONG_LRN` through ``executor`` (``overrides`` replace RUN's
    settings); returns (losses, saved weights by name)."""
    weights = tmp_path / f"{name}.npz"
    spec = tmp_path / "strong-lrn.json"  # one path per test: a resume's fingerprint holds it
    spec.write_text(json.dumps(STRONG_LRN))
    run = {**RUN, "preset": str(spec), **overrides}
    config = TrainConfig(save=str(weights), trace=trace, **run)
    result = train(config, executor, log=io.StringIO())
    return result.losses, dict(np.load(weights))


def same_as_local(got, local) -> None:
    """``got`` and ``local``, each (losses, weights), agree to float32 round-off: the same
    losses step by step and the same final weights, name by name."""
    losses, weights = got
    np.testing.assert_allclose(losses, local[0], rtol=1e-5)
    assert weights.keys() == local[1].keys()
    for name in weights:
        np.testing.assert_allclose(weights[name], local[1][name], rtol=0, atol=1e-5, err_msg=name)


class Killing(Cluster):
    """A cluster of :attr:`BASE`'s configuration (and ``config``'s changes) that SIGKILLs the
    worker process ``victim`` at step ``at``: between its forward and its backward
    (``when="backward"``), or after the replicated block's ReplicaForward started, before the
    second layer's stage calls (``"forward"``)."""

    BASE: dict = {}

    def __init__(self, addresses, victim, at, when="backward", **config):
        super().__init__(addresses, config=ClusterConfig(**{**self.BASE, **config}))
        self.victim, self.at, self.when = victim, at, when

    def _kill(self, phase: str) -> None:
        if phase == self.when and self.step == self.at and self.victim.poll() is None:
            self.victim.kill()
            self.victim.wait()

    def prepare(self, *args, **kwargs):
        super().prepare(*args, **kwargs)
        for run in self.runs.values():
            if isinstance(run, ReplicatedBlock):  # its ReplicaForward started, the stage's not
                start_ahead = run.consumer.start_ahead

                def kill_then_start(block, start_ahead=start_ahead):
                    self._kill("forward")
                    return start_ahead(block)

                run.consumer.start_ahead = kill_then_start

    def stage_forward(self, layer, *args, **kwargs):
        self._kill("forward")
        return super().stage_forward(layer, *args, **kwargs)

    def stage_backward(self, layer, *args, **kwargs):
        self._kill("backward")
        return super().stage_backward(layer, *args, **kwargs)
