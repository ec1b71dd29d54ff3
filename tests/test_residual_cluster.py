"""A residual network through the cluster: every convolution of ``resnet20`` split by kernels
over real worker processes computes what local training computes, step after step (loss, every
gradient, batch norm's running statistics), also in the step a worker is SIGKILLed.

Why step by step on the cluster's own weights, not two 20-step trajectories compared at the
end: resnet20 at batch 4 is chaotic in float32. Two local runs whose initial weights differ by
1e-7 relative (float32's last bits) end 20 steps apart by up to 0.7 in a weight and 6 % in a
loss (`python benchmarks/trajectory_sensitivity.py`); a kernel split reorders sums exactly that
much (each node's GEMM has other sizes). So
each step is compared on the same state: the local model gets the cluster model's weights and
statistics, both compute the step, and the cluster's update carries the trajectory on.

Even one step is not always well conditioned: where a pre-ReLU value sits within round-off of
zero, its gradient path switches, and batch norm over 4 images amplifies it (two local steps
from states 1e-7 apart differed by 0.8 % in a gradient's norm on 2 steps of 20). So a step
whose gradients differ by more than 1e-4 (relative, in norm) must be such a step: the same
step computed locally from the state perturbed by round-off (1e-6 relative) differs from the
unperturbed one by at least a twentieth as much (the largest of up to ten draws). A wrong split (a
lost skip, a wrong slice) differs on every step, and by far more than round-off moves it.
"""

from __future__ import annotations

import numpy as np
import pytest
from exactness import FAST

from hetconv.layers import softmax_cross_entropy
from hetconv.master.cluster import Cluster, ClusterConfig
from hetconv.master.launch import LocalWorkers
from hetconv.model import Model, load_spec
from hetconv.modetable import keeps_kernels
from hetconv.optim import SGD, SGDConfig
from hetconv.stages import FUSED
from hetconv.workload import ConvLayer

STEPS, BATCH = 20, 4


@pytest.fixture(scope="module")
def workers():
    with LocalWorkers(2) as started:
        yield started


def test_the_graph_has_residual_adds_and_projection_shortcuts():
    spec = load_spec("resnet20")
    kinds = [entry["type"] for entry in spec]
    assert kinds.count("add") == 9 and kinds.count("conv") == 21  # 19 + 2 projections
    convs = [entry for entry in spec if entry["type"] == "conv"]
    projections = [c for c in convs if c["kernel"] == 1 and c["stride"] == 2]
    assert len(projections) == 2 and sum(c["stride"] == 2 for c in convs) == 4
    executed = Model(spec, seed=0).conv_specs()  # a strided conv runs as its phases' (stride 1)
    assert sum(c.phased_from == (2, 2) for c in executed) == 4


def _step(model: Model, x, labels, step: int) -> float:
    loss, grad, _ = softmax_cross_entropy(model.forward(x, step=step), labels)
    model.backward(grad)
    return loss


def _difference(got: dict, want: dict) -> tuple[float, str]:
    """The largest relative difference in norm between two sets of arrays, and its name."""
    assert got.keys() == want.keys()
    worst = {
        name: float(np.linalg.norm(got[name] - value) / max(np.linalg.norm(value), 1e-12))
        for name, value in want.items()
    }
    name = max(worst, key=worst.get)
    return worst[name], name


def _perturbed(state: dict, rng: np.random.Generator) -> dict:
    """``state`` moved by float32 round-off: each value by ~1e-6 relative (the size of the
    differences a reordered sum of a few hundred terms leaves)."""
    return {
        name: (value * (1 + 1e-6 * rng.standard_normal(value.shape))).astype(value.dtype)
        for name, value in state.items()
    }


def lockstep(cluster: Cluster, steps: int = STEPS) -> None:
    """``steps`` SGD steps of resnet20 through ``cluster``, each compared with the same step
    computed locally from the same weights and statistics."""
    spec = load_spec("resnet20")
    on_cluster, local = Model(spec, seed=0, executor=cluster), Model(spec, seed=0)
    cluster.prepare(on_cluster.conv_specs(), BATCH, None)
    sgd = SGD(on_cluster.parameters(), SGDConfig(lr=0.05, momentum=0.9, weight_decay=5e-4))
    rng, noise = np.random.default_rng(0), np.random.default_rng(1)
    kinked = []
    for step in range(steps):
        x = rng.standard_normal((BATCH, 3, 32, 32)).astype(np.float32)
        labels = rng.integers(0, 10, BATCH)
        state = on_cluster.state()
        local.load_state(state)
        cluster.begin_step(step)
        loss = _step(on_cluster, x, labels, step)
        while cluster.redo_step():
            loss = _step(on_cluster, x, labels, step)
        cluster.end_step()
        want = _step(local, x, labels, step)
        np.testing.assert_allclose(loss, want, rtol=1e-5, err_msg=f"loss, step {step}")
        moved, name = _difference(on_cluster.buffers(), local.buffers())
        assert moved < 1e-5, f"statistic {name} differs by {moved:.1e} at step {step}"
        wanted = {k: v.copy() for k, v in local.gradients().items()}
        differs, name = _difference(on_cluster.gradients(), wanted)
        if differs > 1e-4:  # must be a step round-off moves as much (the module's note)
            itself = 0.0
            for _ in range(10):  # draws until one moves it as much (a kink: often 1 in 3)
                local.load_state(_perturbed(state, noise))
                _step(local, x, labels, step)
                itself = max(itself, _difference(local.gradients(), wanted)[0])
                if differs < 20 * itself:
                    break
            assert differs < 20 * itself, (
                f"gradient {name} differs by {differs:.1e} at step {step}; round-off in the "
                f"state (1e-6) moves the local step by {itself:.1e}"
            )
            kinked.append(step)
        sgd.step(on_cluster.gradients())
    assert len(kinked) <= steps // 4, kinked


# Auto and unfused run with -m slow (auto ~70 s on a busy machine, unfused 8 s; the fast run
# keeps fused): auto only picks fused or unfused per layer, both tested here, and its choice is
# the mode table's (tests/test_mode_table.py).
@pytest.mark.parametrize(
    "stages",
    [
        pytest.param("unfused", marks=pytest.mark.slow),
        "fused",
        pytest.param("auto", marks=pytest.mark.slow),
    ],
)
def test_resnet20_through_two_workers_computes_every_step_as_locally(workers, stages):
    # kernels sent: the lockstep compares gradients and applies its own SGD; resident kernels
    # are updated on the workers (their batch-norm stages: tests/test_resident_batchnorm.py).
    # Deterministic: equal shares, so no probe timing picks the split and with it which
    # round-off kinks a step meets (one run under load split by probe time met a kink at step 6
    # that the perturbation check's three draws did not reproduce).
    config = ClusterConfig(stages=stages, kernels="sent", deterministic=True, **FAST)
    with Cluster(workers.addresses, config=config) as cluster:
        lockstep(cluster)
        assert all(plan.shares[1] and plan.shares[2] for plan in cluster.plans.values())
        assert not [e for e in cluster.events if e["event"] == "worker_lost"]
        if stages == "fused":  # batch norm and ReLU ran on the workers with the convolutions
            assert "fused" in cluster.stage_modes.values()


class KilledMidStep(Cluster):
    """SIGKILLs ``victim`` at the first backward call of step ``at`` (its forward answers of
    that step already in)."""

    def __init__(self, addresses, victim, at, **config):
        super().__init__(addresses, config=ClusterConfig(**config))
        self.victim, self.at = victim, at

    def _kill(self):
        if self.step == self.at and self.victim.poll() is None:
            self.victim.kill()
            self.victim.wait()

    def backward(self, layer, *args, **kwargs):
        self._kill()
        return super().backward(layer, *args, **kwargs)

    def stage_backward(self, layer, *args, **kwargs):
        self._kill()
        return super().stage_backward(layer, *args, **kwargs)


# Both run with -m slow (~50-90 s each on a busy machine): the lockstep is the one above, and
# a worker killed mid-step leaves every step as local's in tests/test_faults.py (unfused),
# tests/test_fused.py (fused, with and without batch norm) and tests/test_resident_batchnorm.py.
@pytest.mark.slow
@pytest.mark.parametrize("stages", ["unfused", "fused"])
def test_resnet20_with_a_worker_killed_mid_step_computes_every_step_as_locally(stages):
    with LocalWorkers(2) as started:
        victim = started.processes[1]
        with KilledMidStep(started.addresses, victim, 5, stages=stages, **FAST) as cluster:
            lockstep(cluster)
            lost = [e for e in cluster.events if e["event"] == "worker_lost"]
    assert [(e["worker"], e["step"]) for e in lost] == [(started.addresses[1], 5)]


def test_a_conv_without_bias_keeps_its_kernels_on_the_workers_too(workers):
    # A bias-free conv's slice is placed with fixed_bias: the workers never update its zero
    # bias (tests/test_resident_batchnorm.py trains such layers), so --kernels resident keeps
    # it there as any other (master and simulator alike: the mode table's keeps_kernels).
    spec = [
        {"type": "conv", "name": "conv1", "out": 8, "kernel": 3, "padding": 1, "bias": False},
        {"type": "relu"},
        {"type": "maxpool", "kernel": 2},
        {"type": "conv", "name": "conv2", "out": 8, "kernel": 3, "padding": 1},
        {"type": "relu"},
        {"type": "maxpool", "kernel": 2},
        {"type": "fc", "name": "fc", "out": 10},
    ]
    layers = [ConvLayer.from_spec(c, BATCH) for c in Model(spec, seed=0).conv_specs()]
    assert [keeps_kernels(layer, FUSED) for layer in layers] == [True, True]
    config = ClusterConfig(stages="fused", kernels="resident", **FAST)
    with Cluster(workers.addresses, config=config) as cluster:
        Model(spec, seed=0, executor=cluster)
        cluster.prepare(Model(spec, seed=0).conv_specs(), BATCH, None)
        assert cluster.kernel_modes == {"conv1": "resident", "conv2": "resident"}
