"""The verdict at the end of a cluster run: the measured step against the master alone's as
timed after the run (the same network and batch, trained as ``--local`` trains them), never
against the master's own probe, which a loaded master distorts; a run in which no worker
computed is the master alone, with no ratio; workers on loopback are said to share the master's
machine. And the console's evaluation lines: about ten a run, every one in the trace.

Real worker processes on loopback; the figures themselves are this machine's (not asserted):
the wording, which figure each line uses and the arithmetic between them are.
"""

from __future__ import annotations

import io
import json
import re

import numpy as np

from hetconv.backends import get_backend
from hetconv.master.cluster import Cluster, ClusterConfig
from hetconv.master.launch import LocalWorkers
from hetconv.training import TrainConfig, train
from hetconv.training.console import _seconds

FAST = dict(deadline_floor=1.0, deadline_factor=5.0, retry_min=0.2, retry_max=1.0,
            connect_timeout=5.0, share_policy="compute")  # fmt: skip
LOADED = 1000.0  # the master's probe, distorted this many times


class _LoadedMaster:
    """The cpu backend of a master whose probe comes out :data:`LOADED` times slow (as a
    master busy with something else when it probed)."""

    def __init__(self):
        self._backend = get_backend("cpu")

    def time_step(self, *args, **kwargs):
        return LOADED * self._backend.time_step(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._backend, name)


def _records(trace) -> list[dict]:
    return [json.loads(line) for line in trace.read_text().splitlines()]


def _train(tmp_path, cluster, steps: int = 3) -> tuple[str, list[dict]]:
    trace, log = tmp_path / "trace.jsonl", io.StringIO()
    config = TrainConfig(steps=steps, batch=8, train_size=32, eval_size=0, progress=False,
                         trace=str(trace))  # fmt: skip
    train(config, cluster, log=log)
    return log.getvalue(), _records(trace)


def _parse(figure: str) -> float:
    value, unit = figure.split()
    return float(value) * (1e-3 if unit == "ms" else 1.0)


def _verdict(text: str) -> str:
    (line,) = [x for x in text.splitlines() if x.startswith("measured: ")]
    return line


def test_a_loaded_master_is_compared_with_its_timed_steps_not_its_probe(tmp_path):
    with LocalWorkers(1) as workers:
        with Cluster(workers.addresses, _LoadedMaster(), ClusterConfig(**FAST)) as cluster:
            text, records = _train(tmp_path, cluster)
    prediction = records[0]["prediction"]
    assert prediction["workers"] == 1
    (alone,) = [r for r in records if r.get("event") == "master_alone"]
    steps = [r for r in records if "step" in r]
    assert all(r["workers_computed"] == 1 for r in steps)
    step = np.mean([r["comm_seconds"] + r["conv_seconds"] + r["comp_seconds"] for r in steps[1:]])
    seconds = alone["seconds_per_step"]
    line = _verdict(text)
    said = re.match(r"measured: (.+?) per step, ([0-9.]+)x the master alone: (faster|slower) "
                    r"than it \((.+?) per step, timed after the run: (\d+) steps of the same "
                    r"network and batch trained as --local trains them; predicted ([0-9.]+)x, "
                    r"estimated from the master's probe\)$", line)  # fmt: skip
    assert said, line
    # the figures: the cluster's mean step, the master alone's median, their ratio
    assert said[1] == _seconds(step) or abs(_parse(said[1]) - step) < 0.002, (said[1], step)
    assert said[4] == _seconds(seconds) and int(said[5]) == len(alone["steps_seconds"])
    assert abs(float(said[2]) - seconds / step) < 0.0051 + 1e-3 * seconds / step
    assert said[3] == ("faster" if seconds / step >= 1 else "slower")
    assert said[6] == f"{prediction['speedup']:.2f}"
    # the probe's figure, LOADED times too slow, is the prediction's alone, not the verdict's
    assert prediction["alone_s"] > 50 * seconds
    assert f"(estimated from its probe: {_seconds(prediction['alone_s'])}," in text
    assert 3 <= len(alone["steps_seconds"]) <= 10
    assert seconds == np.median(alone["steps_seconds"])
    assert "timing the master alone (a few steps as --local trains them) to compare" in text
    # the worker is on loopback: said before the run and after it
    assert f"note: every worker runs on this machine ({workers.addresses[0]}), competing " in text
    assert f"note: every worker ran on this machine ({workers.addresses[0]}), competing " in text
    assert records[0]["this_machine"] == workers.addresses


def test_a_dead_worker_leaves_the_master_alone_with_no_ratio(tmp_path):
    with LocalWorkers(1) as workers:
        workers.processes[0].kill()
        workers.processes[0].wait()
        with Cluster(workers.addresses, config=ClusterConfig(**FAST)) as cluster:
            text, records = _train(tmp_path, cluster)
    assert records[0]["prediction"]["workers"] == 0
    assert "predicted: " in text and "per step: no worker reached yet, so the master alone" in text
    line = _verdict(text)
    assert line.endswith(
        "per step, but no worker computed in any of the 3 steps run here (every worker lost, "
        "or given no kernels): the run was the master alone, so there is no speedup to report"
    ), line
    assert "x the master alone" not in text  # the master is never compared with itself
    assert not [r for r in records if r.get("event") == "master_alone"]
    assert "note: every worker ran" not in text  # it ran nowhere
    assert all(r["workers_computed"] == 0 for r in records if "step" in r)


class _KilledAt(Cluster):
    """A cluster whose only worker process is killed before step ``at`` begins."""

    def __init__(self, workers: LocalWorkers, at: int):
        super().__init__(workers.addresses, config=ClusterConfig(**FAST))
        self.workers, self.at = workers, at

    def begin_step(self, step):
        if step == self.at:
            self.workers.processes[0].kill()
            self.workers.processes[0].wait()
        super().begin_step(step)


def test_a_worker_lost_mid_run_is_counted_in_the_verdict(tmp_path):
    with LocalWorkers(1) as workers, _KilledAt(workers, at=2) as cluster:
        text, records = _train(tmp_path, cluster, steps=4)
    assert [r["workers_computed"] for r in records if "step" in r] == [1, 1, 0, 0]
    line = _verdict(text)
    assert "x the master alone: " in line and line.endswith(
        "; workers computed in 2 of the 4 steps"
    )


def test_about_ten_evaluation_lines_a_run_and_every_evaluation_in_the_trace(tmp_path):
    trace, log = tmp_path / "trace.jsonl", io.StringIO()
    config = TrainConfig(steps=20, batch=4, train_size=40, eval_size=2, eval_every=1,
                         progress=False, trace=str(trace))  # fmt: skip
    train(config, log=log)
    printed = [int(m[1]) for m in re.finditer(r"^eval after step (\d+) ", log.getvalue(), re.M)]
    assert printed == [2, 4, 6, 8, 10, 12, 14, 16, 18]  # one a tenth of the run
    evals = [r for r in _records(trace) if r.get("event") == "eval"]
    assert [r["trained_steps"] for r in evals] == list(range(1, 21))
    assert [r["final"] for r in evals] == [False] * 19 + [True]


def test_workers_partly_on_this_machine_are_counted_in_the_note():
    from hetconv.training.console import _this_machine

    nodes = [{"name": "master"}, {"name": "127.0.0.1:50052"}, {"name": "10.0.0.7:50051"}]
    plan = {"nodes": nodes, "this_machine": ["127.0.0.1:50052"]}
    assert _this_machine(plan, now=True).startswith(
        "note: 1 of the 2 workers run on this machine (127.0.0.1:50052), competing with the "
        "master for its cores: "
    )
    assert _this_machine({"nodes": nodes, "this_machine": []}, now=False) == ""
    assert _this_machine(None, now=False) == ""  # a local run: no plan
