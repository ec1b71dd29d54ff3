"""What `hetconv train` tells a user about the cluster: at the start the cost model's step for
the plan and modes chosen against the master alone's, at the end the measured step against it.

Real worker processes on loopback; the figures themselves are this machine's (not asserted):
the lines, the trace's record and the arithmetic between them are.
"""

from __future__ import annotations

import io
import json
import re

import numpy as np
import pytest

from hetconv.master.cluster import Cluster, ClusterConfig
from hetconv.master.launch import LocalWorkers
from hetconv.model import Model, reference_spec
from hetconv.training import TrainConfig, train

FAST = dict(deadline_floor=1.0, deadline_factor=5.0, retry_min=0.2, retry_max=1.0)


def test_train_predicts_its_step_then_measures_it(tmp_path):
    trace = tmp_path / "trace.jsonl"
    log = io.StringIO()
    config = TrainConfig(steps=6, batch=8, train_size=48, eval_size=8, progress=False,
                         trace=str(trace))  # fmt: skip
    with LocalWorkers(2) as workers:
        cluster_config = ClusterConfig(**FAST, stages="fused", kernels="resident")
        with Cluster(workers.addresses, config=cluster_config) as cluster:
            train(config, cluster, log=log)
    text = log.getvalue()
    predicted = re.search(r"predicted: .* per step, ([0-9.]+)x the master alone \((.*?):", text)
    measured = re.search(r"measured: (.*?) per step, ([0-9.]+)x the master alone", text)
    assert predicted and measured, text
    plan = json.loads(trace.read_text().splitlines()[0])
    prediction = plan["prediction"]
    assert prediction["speedup"] == prediction["alone_s"] / prediction["step_s"]
    assert 0 <= prediction["comp_s"] < prediction["alone_s"]  # the master's other work
    assert float(predicted.group(1)) == round(prediction["speedup"], 2)
    assert f"predicted {prediction['speedup']:.2f}x" in text
    # and the peer on the same nodes, every node the whole model
    assert prediction["data_parallel_s"] > 0
    assert "plain data parallelism on the same nodes:" in text


def test_the_other_layers_are_timed_on_copies():
    spec = reference_spec(8, 16)
    spec.insert(-1, {"type": "dropout", "p": 0.5})
    spec.insert(1, {"type": "batchnorm"})
    model = Model(spec)
    before = {k: v.copy() for k, v in model.state().items()}
    seconds = model.other_seconds(4)
    assert set(seconds) == {
        layer.name for layer in model.layers if layer.name not in ("conv1", "conv2")
    }
    assert all(t > 0 for t in seconds.values())
    for name, value in model.state().items():  # running statistics untouched
        np.testing.assert_array_equal(value, before[name], err_msg=name)


def test_the_master_is_not_charged_the_layers_run_inside_the_calls():
    """A fused stage's layers run on the nodes, the last stage's too (a HeadStage, which
    wraps it), and with the head split the fc; a replicated block's on the master inside the
    next layer's calls: the prediction's ``comp_s`` leaves them out, ``chains_s`` has them."""
    from hetconv.conv import LocalConv
    from hetconv.replica import REPLICATED
    from hetconv.stages import FUSED, UNFUSED
    from hetconv.training.masterwork import other_work, stage_chains

    class Staged(LocalConv):
        supports_stages = supports_head = True

        def __init__(self, modes, head):
            super().__init__()
            self.modes, self.head = modes, head

        def stage_mode(self, layer):
            return self.modes.get(layer, UNFUSED)

        def head_split(self, layer):
            return self.head

    def chains(modes, head=False):
        return stage_chains(Model(reference_spec(8, 16), executor=Staged(modes, head)))

    assert chains({}) == {}
    assert chains({"conv2": FUSED}) == {"conv2": ["relu2", "lrn2", "maxpool2"]}  # a HeadStage
    assert chains({"conv1": FUSED, "conv2": FUSED}, head=True) == {
        "conv1": ["relu1", "lrn1", "maxpool1"], "conv2": ["relu2", "lrn2", "maxpool2", "fc"],
    }  # fmt: skip
    assert chains({"conv1": REPLICATED, "conv2": FUSED}, head=True) == {
        "conv1": ["relu1", "lrn1", "maxpool1"], "conv2": ["relu2", "lrn2", "maxpool2", "fc"],
    }  # fmt: skip
    assert stage_chains(Model(reference_spec(8, 16))) == {}  # no stages: all between calls
    model = Model(reference_spec(8, 16), executor=Staged({"conv1": REPLICATED}, False))
    alone, between, inside = other_work(model, 2)
    assert set(inside) == {"conv1"} and 0 < inside["conv1"] < alone
    assert between == pytest.approx(alone - inside["conv1"])  # conv2's stage and the fc


def test_a_local_run_predicts_nothing():
    log = io.StringIO()
    config = TrainConfig(steps=2, batch=8, train_size=16, eval_size=0, progress=False)
    train(config, log=log)
    assert "predicted:" not in log.getvalue() and "measured:" not in log.getvalue()


def test_under_a_share_of_a_core_the_other_layers_are_their_cpu_time_over_it(monkeypatch):
    """Where the process gets under SHARE_FLOOR of a core, each layer's figure is its CPU time
    (the thread's clock) divided by the share; else its wall time, as before."""
    import itertools

    from hetconv import model as model_module

    class Ticks:  # a clock that moves one second a reading
        def __init__(self):
            self.count = itertools.count()

        def __call__(self):
            return float(next(self.count))

    model = Model(reference_spec(8, 16))
    monkeypatch.setattr(model_module, "cpu_share", lambda: 0.25)
    monkeypatch.setattr(model_module.time, "thread_time", Ticks())
    slow = model.other_seconds(2)
    assert slow and all(v == pytest.approx(4.0 / _chunk(model, k)) for k, v in slow.items())
    monkeypatch.setattr(model_module, "cpu_share", lambda: model_module.SHARE_FLOOR)
    monkeypatch.setattr(model_module.time, "perf_counter", Ticks())
    whole = model.other_seconds(2)
    assert all(v == pytest.approx(1.0 / _chunk(model, k)) for k, v in whole.items())


def _chunk(model, name: str) -> int:
    """How many layers share ``name``'s timed run (an image-chunked run's are split evenly)."""
    from hetconv.model import ImageChunks

    for step in map(model._step, model._chunked()):
        layers = step.layers if isinstance(step, ImageChunks) else [step]
        if name in [layer.name for layer in layers]:
            return len(layers)
    raise KeyError(name)
