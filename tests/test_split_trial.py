"""``--split auto``'s trial of the runner-up (:mod:`hetconv.master.splittrial`): where the split
not chosen is predicted close, it is run after the chosen one, both timed, and the faster kept;
the run stays local training's through every change of split.

Real worker processes on loopback, treated as machines of their own (as on the testbed).
"""

from __future__ import annotations

import json

import pytest
from exactness import FAST, same_as_local, train_strong_lrn

from hetconv.master import alonecheck, probing, splitchoice, splittrial
from hetconv.master.cluster import ClusterConfig
from hetconv.master.splitchoice import SplitChoice
from hetconv.master.spotcheck import SpotCheckConfig

DEFAULT_MODES = dict(stages="fused", kernels="resident", head="split", resident_sync_every=3)
# the step whose end opens the runner-up, and the one whose end decides
OPENED = alonecheck.SKIPPED + alonecheck.CHECK_STEPS - 1
DECIDED = OPENED + alonecheck.SKIPPED + alonecheck.CHECK_STEPS


def _records(trace):
    return [json.loads(line) for line in trace.read_text().splitlines()]


def _close(
    monkeypatch, split: str, kept: str | None = None, other_s: float = 1.1, unit: float = 1e-6
):
    """The choice ``split`` predicted 1 ``unit`` a step with the other split ``other_s`` units
    (the ring for the split by images), the trial's decision ``kept`` (None: as measured), the
    master alone slower than any, and the loopback workers taken for machines of their own.
    The unit, a microsecond, is below any step measured here: the runner-up is worth trying
    (:func:`~hetconv.master.splittrial.worth_trying`)."""

    def forced(kernels_s, images_s, allowed, ruled_out=None, **margin):
        images = split == "images"
        return {
            "split": split, "exchange": "ring" if images else None,
            "predicted_s": {"kernels": (other_s if images else 1.0) * unit,
                            "images (master)": 5.0 * unit,
                            "images (ring)": (1.0 if images else other_s) * unit},
            "why": "forced by the test",
        }  # fmt: skip

    monkeypatch.setattr(splitchoice, "choose_split", forced)
    monkeypatch.setattr(splitchoice, "on_this_machine", lambda address: False)
    monkeypatch.setattr(splitchoice, "time_alone", lambda *args: 1e9)
    if kept is not None:
        monkeypatch.setattr(splittrial, "decide", lambda *args: kept)


def _splits(trace) -> list[str]:
    return [r.get("split", "kernels") if r.get("workers_computed") else "alone"
            for r in _records(trace) if "step" in r]  # fmt: skip


@pytest.mark.parametrize(
    "first,kept,after",
    [
        ("kernels", splittrial.FIRST, "kernels"),
        ("kernels", splittrial.TRIED, "images"),
        ("images", splittrial.FIRST, "images"),
        ("images", splittrial.ALONE, "alone"),
    ],
)
def test_the_runner_up_is_tried_and_the_run_stays_local_trainings(
    tmp_path, local, workers, monkeypatch, first, kept, after
):
    """The split chosen runs until the alone check, the runner-up until its own timing, then
    the one decided; resident kernels, the split head and the ring's parameters change hands
    with their momentum each time: the run equals local training step by step and in its
    final weights."""
    _close(monkeypatch, first, kept)
    probed = []  # (node, layer) of every probe: each once, the split by kernels opened again
    real_probe = probing.probe
    monkeypatch.setattr(probing, "probe", lambda node, layer, *a: probed.append(
        (node.name, layer.name)) or real_probe(node, layer, *a))  # fmt: skip
    trace = tmp_path / "trace.jsonl"
    config = ClusterConfig(**FAST, **DEFAULT_MODES, spot_checks=SpotCheckConfig(every=0))
    with SplitChoice(workers.addresses, config=config) as cluster:
        got = train_strong_lrn(tmp_path, f"{first}-{kept}", cluster, trace=str(trace))
        assert cluster.take_handover() is None  # each taken once, by the loop
    same_as_local(got, local)
    assert probed and len(probed) == len(set(probed)), probed
    second = "images" if first == "kernels" else "kernels"
    splits = _splits(trace)
    assert splits[: OPENED + 1] == [first] * (OPENED + 1)
    assert splits[OPENED + 1 : DECIDED + 1] == [second] * (DECIDED - OPENED)
    assert splits[DECIDED + 1 :] == [after] * (len(splits) - DECIDED - 1)
    steps = [r for r in _records(trace) if "step" in r]
    check = steps[OPENED]["alone_check"]
    assert check["trial"] and not check["released"]
    record = steps[DECIDED]["split_trial"]
    assert record["kept"] == kept
    assert record["first"]["split"] == first and record["trial"]["split"] == second
    assert record["trial"]["seconds"] > 0 and record["alone_s"] == 1e9
    assert all("split_trial" not in r for i, r in enumerate(steps) if i != DECIDED)
    assert record["switch_s"] >= 0 and check["switch_s"] > 0
    if first == "kernels":  # the simulator calibrates from the kernel split's steps alone
        from hetconv.simulations.calibrate import calibrate

        notes = calibrate(str(trace), str(tmp_path / "strong-lrn.json")).notes
        assert any("split by images (a split trial)" in note for note in notes), notes


def test_no_trial_where_the_runner_up_is_predicted_far_slower(tmp_path, local, workers,
                                                              monkeypatch):  # fmt: skip
    _close(monkeypatch, "kernels", other_s=1.3)
    trace = tmp_path / "trace.jsonl"
    config = ClusterConfig(**FAST, **DEFAULT_MODES, spot_checks=SpotCheckConfig(every=0))
    with SplitChoice(workers.addresses, config=config) as cluster:
        train_strong_lrn(tmp_path, "far", cluster, trace=str(trace), steps=OPENED + 3)
    assert set(_splits(trace)) == {"kernels"}
    steps = [r for r in _records(trace) if "step" in r]
    assert "trial" not in steps[OPENED]["alone_check"]
    assert "trial" not in _records(trace)[0]["split_choice"]


def test_no_trial_where_the_split_chosen_already_ran_as_fast_as_the_runner_up_is_predicted(
    tmp_path, local, workers, monkeypatch
):
    """The runner-up predicted within the range, so planned, but at 1.1 s a step, which the
    kernel split measured at the alone check already beats: it is not tried, the check's record
    and the console say so, and the kernel split runs on."""
    _close(monkeypatch, "kernels", unit=1.0)
    lines = []
    monkeypatch.setattr(SplitChoice, "_say", lambda self, line: lines.append(line))
    trace = tmp_path / "trace.jsonl"
    config = ClusterConfig(**FAST, **DEFAULT_MODES, spot_checks=SpotCheckConfig(every=0))
    with SplitChoice(workers.addresses, config=config) as cluster:
        train_strong_lrn(tmp_path, "skipped", cluster, trace=str(trace), steps=OPENED + 3)
    assert set(_splits(trace)) == {"kernels"}
    assert _records(trace)[0]["split_choice"]["trial"]["split"] == "images"  # planned
    steps = [r for r in _records(trace) if "step" in r]
    check = steps[OPENED]["alone_check"]
    assert "trial" not in check and not check["released"]
    assert check["trial_skipped"] == {"split": "images", "exchange": "ring", "predicted_s": 1.1}
    assert check["cluster_s"] < 1.1
    assert all("split_trial" not in r for r in steps)
    said = "\n".join(lines)
    assert "no slower than the split by images (ring among the workers) is predicted" in said
    assert "it is not tried" in said and "the cluster stays" in said


def test_the_runner_up_and_the_decision():
    kernels = {
        "split": "kernels",
        "exchange": None,
        "predicted_s": {"kernels": 1.6, "images (master)": 2.3, "images (ring)": 1.4},
    }
    images = {**kernels, "split": "images", "exchange": "ring"}
    # chosen by images (ring): the split by kernels 14 % slower is tried
    assert splittrial.runner_up(images, ["master", "ring"]) == {
        "split": "kernels",
        "exchange": None,
        "predicted_s": 1.6,
    }
    # chosen by kernels: the best allowed exchange of the split by images
    assert splittrial.runner_up(kernels, ["master", "ring"])["exchange"] == "ring"
    assert splittrial.runner_up(kernels, ["master"]) is None  # 2.3 s: over the range
    far = {**images, "predicted_s": {"kernels": 1.4 * 1.26, "images (ring)": 1.4}}
    assert splittrial.runner_up(far, ["ring"]) is None
    worth = splittrial.worth_trying
    assert worth(1.0, {"predicted_s": 0.9}) and not worth(1.0, {"predicted_s": 0.99})
    assert not worth(1.0, {"predicted_s": 1.2})  # ran faster than the runner-up's prediction
    decide = splittrial.decide
    assert decide(1.0, 0.9, 2.0) == splittrial.TRIED
    assert decide(1.0, 0.99, 2.0) == splittrial.FIRST  # within the margin: the prediction
    assert decide(1.0, 1.2, 2.0) == splittrial.FIRST
    assert decide(1.0, 0.9, 0.8) == splittrial.ALONE  # both slower than the master alone
    assert decide(1.0, 0.84, 0.8) == splittrial.TRIED  # within the alone check's margin


@pytest.mark.parametrize(
    "first,kept",
    [("kernels", splittrial.FIRST), ("kernels", splittrial.TRIED), ("images", splittrial.ALONE)],
)
def test_batch_norm_changes_hands_with_the_split(tmp_path, workers, monkeypatch, first, kept):
    """A network with batch norm, one split first and the other tried, the ring's spot checks
    every step (they recompute a worker's range on the master's model): the running statistics
    and every parameter's momentum move with each change of split, the master's model sums
    nothing once the ring is gone, and the run equals local training (the weight file holds the
    statistics)."""
    from test_image_syncbn import CONV_BN

    from hetconv.conv import LocalConv

    spec = tmp_path / "conv-bn.json"
    spec.write_text(json.dumps(CONV_BN))
    local = train_strong_lrn(tmp_path, "local", LocalConv(), preset=str(spec))
    _close(monkeypatch, first, kept)
    trace = tmp_path / "trace.jsonl"
    config = ClusterConfig(**FAST, deterministic=True, spot_checks=SpotCheckConfig(every=1))
    with SplitChoice(workers.addresses, config=config) as cluster:
        got = train_strong_lrn(tmp_path, kept, cluster, trace=str(trace), preset=str(spec))
    same_as_local(got, local)
    second = "images" if first == "kernels" else "kernels"
    after = {splittrial.FIRST: first, splittrial.TRIED: second, splittrial.ALONE: "alone"}[kept]
    assert _splits(trace)[OPENED:] == [first] + [second] * (DECIDED - OPENED) + [after] * (
        len(_splits(trace)) - DECIDED - 1
    )
    checked = [r for r in _records(trace) if r.get("split") == "images" and "spot_checks" in r]
    assert checked  # the ring's steps were checked


def test_a_worker_killed_during_the_trial_costs_no_step(tmp_path, local, monkeypatch):
    """A worker SIGKILLed as the runner-up's steps run (the ring, step OPENED + 3): the ring's
    fault cover computes its range that step, the trial still decides, the split by kernels
    opens again over the survivor (the dead worker refused at connect), and the run is local
    training's."""
    from hetconv.master.launch import LocalWorkers

    _close(monkeypatch, "kernels", splittrial.FIRST)
    at = OPENED + 3
    real_begin = SplitChoice.begin_step

    def begin_step(self, step):
        if step == at:
            victim.kill()
            victim.wait()
        return real_begin(self, step)

    monkeypatch.setattr(SplitChoice, "begin_step", begin_step)
    trace = tmp_path / "trace.jsonl"
    config = ClusterConfig(**FAST, **DEFAULT_MODES, spot_checks=SpotCheckConfig(every=0))
    with LocalWorkers(2) as workers:
        victim = workers.processes[1]
        with SplitChoice(workers.addresses, config=config) as cluster:
            got = train_strong_lrn(tmp_path, "killed", cluster, trace=str(trace))
    same_as_local(got, local)
    steps = [r for r in _records(trace) if "step" in r]
    assert _splits(trace)[DECIDED + 1 :] == ["kernels"] * (len(steps) - DECIDED - 1)
    assert steps[DECIDED]["split_trial"]["kept"] == splittrial.FIRST
    dead = workers.addresses[1]
    assert steps[at]["nodes"][dead].get("covered_by") == "master", steps[at]["nodes"][dead]
    for r in steps[DECIDED + 1 :]:  # the survivor computes; the dead one has no share
        assert not any(dead in str(k) and v.get("kernels") for k, v in r["nodes"].items()
                       if isinstance(v, dict))  # fmt: skip


@pytest.mark.parametrize("kept", [splittrial.FIRST, splittrial.ALONE])
def test_a_runner_up_that_would_train_alone_is_timed_alone_and_the_first_reopens(
    tmp_path, local, workers, monkeypatch, kept
):
    """Images first; the split by kernels, opened for the trial, keeps every kernel on the
    master (its plan at that moment), so the trial times the master alone; the first split is
    kept and opens again from there, or the master stays alone. The run is local training's."""
    _close(monkeypatch, "images", kept)
    real, calls = splitchoice.keeps_every_kernel, []

    def keeps(cluster):
        calls.append(type(cluster).__name__)
        return len(calls) > 1 or real(cluster)  # at start as planned; reopened: all kept

    monkeypatch.setattr(splitchoice, "keeps_every_kernel", keeps)
    trace = tmp_path / "trace.jsonl"
    config = ClusterConfig(**FAST, deterministic=True, spot_checks=SpotCheckConfig(every=0))
    with SplitChoice(workers.addresses, config=config) as cluster:
        got = train_strong_lrn(tmp_path, "alone-trial", cluster, trace=str(trace))
    same_as_local(got, local)
    splits = _splits(trace)
    assert splits[OPENED + 1 : DECIDED + 1] == ["alone"] * (DECIDED - OPENED)
    after = "images" if kept == splittrial.FIRST else "alone"
    assert splits[DECIDED + 1 :] == [after] * (len(splits) - DECIDED - 1)
