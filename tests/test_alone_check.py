"""``--split auto``'s alone check (:mod:`hetconv.master.alonecheck`): a few steps in, the split
chosen is timed against the master training alone; where it is slower the workers are released
mid-run, resident kernels and their momentum fetched first, and the run stays local training's.

Real worker processes on loopback, treated as machines of their own (as on the testbed: on the
master's machine they would share its cores, and the check leaves them be).
"""

from __future__ import annotations

import json

import pytest
from exactness import FAST, same_as_local, train_strong_lrn
from test_split_auto import _forced

from hetconv.master import alonecheck, splitchoice, splittrial
from hetconv.master.cluster import ClusterConfig
from hetconv.master.splitchoice import SplitChoice
from hetconv.master.spotcheck import SpotCheckConfig

DEFAULT_MODES = dict(stages="fused", kernels="resident", head="split", resident_sync_every=3)
# the step whose end runs the check: the SKIPPED first and CHECK_STEPS more timed
CHECKED = alonecheck.SKIPPED + alonecheck.CHECK_STEPS - 1


def _records(trace):
    return [json.loads(line) for line in trace.read_text().splitlines()]


def _kernels(monkeypatch):
    """The split by kernels chosen whatever the predictions, and the loopback workers taken for
    machines of their own."""
    _forced(monkeypatch, None, split="kernels")
    _no_trial(monkeypatch)


def _no_trial(monkeypatch):
    """No runner-up tried, however close predicted (the trial: tests/test_split_trial.py)."""
    monkeypatch.setattr(splittrial, "runner_up", lambda *args: None)


def test_a_cluster_slower_than_the_master_alone_is_released_and_stays_exact(
    tmp_path, local, workers, monkeypatch
):
    """The check releases the workers after step CHECKED (the master alone made to look
    faster; the timing itself is tested below). Resident kernels and the split head's columns
    come back with their momentum: the run equals local training step by step and in its
    final weights."""
    _kernels(monkeypatch)
    monkeypatch.setattr(splitchoice, "time_alone", lambda *args: 1e-9)
    trace = tmp_path / "trace.jsonl"
    config = ClusterConfig(**FAST, **DEFAULT_MODES, spot_checks=SpotCheckConfig(every=0))
    with SplitChoice(workers.addresses, config=config) as cluster:
        got = train_strong_lrn(tmp_path, "released", cluster, trace=str(trace))
        assert cluster.take_handover() is None  # taken once, by the loop
    same_as_local(got, local)
    steps = [r for r in _records(trace) if "step" in r]
    check = steps[CHECKED]["alone_check"]
    assert check["released"] and check["cluster_s"] > check["alone_s"], check
    assert check["steps"] == alonecheck.CHECK_STEPS
    assert all("alone_check" not in r for i, r in enumerate(steps) if i != CHECKED)
    assert all(r["workers_computed"] for r in steps[: CHECKED + 1])
    assert not any(r.get("workers_computed") for r in steps[CHECKED + 1 :])
    assert all(r["kernel_modes"]["conv2"] == "resident" for r in steps[: CHECKED + 1])
    # the simulator calibrates from the steps with workers, the master's alone left out
    from hetconv.simulations.calibrate import calibrate

    notes = calibrate(str(trace), str(tmp_path / "strong-lrn.json")).notes
    assert any("steps the master trained alone" in note for note in notes), notes


def test_a_cluster_faster_than_the_master_alone_stays(tmp_path, local, workers, monkeypatch):
    _kernels(monkeypatch)
    monkeypatch.setattr(splitchoice, "time_alone", lambda *args: 1e9)
    trace = tmp_path / "trace.jsonl"
    config = ClusterConfig(**FAST, **DEFAULT_MODES, spot_checks=SpotCheckConfig(every=0))
    with SplitChoice(workers.addresses, config=config) as cluster:
        got = train_strong_lrn(tmp_path, "kept", cluster, trace=str(trace), steps=8)
    steps = [r for r in _records(trace) if "step" in r]
    assert steps[CHECKED]["alone_check"]["released"] is False
    assert all(r["workers_computed"] for r in steps)
    same_as_local(got, (local[0][:8], got[1]))  # the losses (8 of local's 20 steps)


@pytest.mark.parametrize("exchange", ["master", "ring"])
def test_a_split_by_images_is_released_as_exactly(tmp_path, local, workers, monkeypatch, exchange):
    _forced(monkeypatch, exchange)
    _no_trial(monkeypatch)
    monkeypatch.setattr(splitchoice, "time_alone", lambda *args: 0.0)
    trace = tmp_path / "trace.jsonl"
    config = ClusterConfig(**FAST, deterministic=True, spot_checks=SpotCheckConfig(every=0))
    with SplitChoice(workers.addresses, config=config) as cluster:
        got = train_strong_lrn(tmp_path, f"images-{exchange}", cluster, trace=str(trace))
    same_as_local(got, local)
    steps = [r for r in _records(trace) if "step" in r]
    assert steps[CHECKED]["alone_check"]["released"] and steps[CHECKED]["split"] == "images"
    assert not any(r.get("workers_computed") for r in steps[CHECKED + 1 :])


def test_workers_on_this_machine_are_not_checked(tmp_path, workers, monkeypatch):
    # loopback workers share the master's cores: their timings compete, no check is made
    trace = tmp_path / "trace.jsonl"
    config = ClusterConfig(**FAST, deterministic=True)
    with SplitChoice(workers.addresses, config=config) as cluster:
        train_strong_lrn(tmp_path, "shared", cluster, trace=str(trace), steps=CHECKED + 2)
    assert not any("alone_check" in r for r in _records(trace))


def test_the_check_is_the_median_of_the_steps_after_the_first_two():
    check = alonecheck.AloneCheck(steps=3, margin=0.1)
    assert check.end() is False  # not begun: nothing timed
    check.seconds = [9.0, 5.0, 1.0, 3.0]
    check.begin()
    assert check.end() is True and len(check.seconds) == alonecheck.SKIPPED + 3
    got = check.decide(1.0)
    assert got["cluster_s"] == pytest.approx(1.0)  # the median of 1.0, 3.0 and ~0
    assert got["steps"] == 3 and check.done and check.end() is False
    kept = alonecheck.AloneCheck(steps=2, margin=0.1)
    kept.seconds = [5.0, 4.0, 1.05, 1.09]
    assert kept.decide(1.0)["released"] is False  # within the margin
    kept.seconds = [5.0, 4.0, 1.2, 1.2]
    assert kept.decide(1.0)["released"] is True
    line = alonecheck.describe({"cluster_s": 1.2, "alone_s": 0.9, "steps": 4, "released": True}, 5)
    assert "after step 5" in line and "released" in line and "1.2 s" in line and "0.9 s" in line


def test_the_master_alone_is_timed_on_a_twin_leaving_the_model_as_it_was():
    import numpy as np

    from hetconv.conv import LocalConv
    from hetconv.model import Model, load_spec
    from hetconv.optim import SGDConfig

    model = Model(load_spec("tiny"), seed=3, executor=LocalConv())
    before = {k: np.array(v) for k, v in model.state().items()}
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, *model.input_shape)).astype(np.float32)
    seconds = alonecheck.time_alone(model, x, np.array([0, 1, 2, 3]), 0, "cpu", SGDConfig())
    assert 0 < seconds < 10
    for name, value in model.state().items():
        np.testing.assert_array_equal(value, before[name], err_msg=name)


def test_alone_check_off_makes_none():
    """``--alone-check off``: the executor ``hetconv train`` builds checks nothing."""
    make = SplitChoice.with_exchange("auto", alone_check=False)
    with make(["127.0.0.1:1"], "cpu", ClusterConfig()) as off:
        assert off.alone_check is None
    with SplitChoice.with_exchange("auto")(["127.0.0.1:1"], "cpu", ClusterConfig()) as on:
        assert on.alone_check is not None and not on.alone_check.done
