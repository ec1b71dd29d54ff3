"""Checkpoints: atomic writes, every field round-trips, and a resumed run equals an unbroken one.

Bitwise equality holds because the engine is deterministic for a fixed BLAS thread count (every
run here, in-process or as a subprocess, inherits the same environment).
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from hetconv.cli import main
from hetconv.conv import LocalConv
from hetconv.data import epoch_order
from hetconv.description import Description
from hetconv.training import TrainConfig, train
from hetconv.training import checkpoint as checkpoint_module
from hetconv.training.checkpoint import (
    CheckpointDir,
    CheckpointError,
    TrainingState,
    read_checkpoint,
)
from hetconv.training.fingerprint import fingerprint_differences
from hetconv.training.trace import _cut_trace

# 48 images at batch 8: 6 steps per epoch, so 10 steps cross an epoch boundary.
RUN = dict(batch=8, train_size=48, eval_size=8, progress=False)
DESCRIPTION = Description(
    network="net.json",
    spec=({"type": "conv", "name": "conv1", "out": 4, "kernel": 5}, {"type": "fc", "out": 2}),
    input_shape=(3, 8, 8),
    classes=2,
    mean=(0.1, 0.2, 1 / 3),
    std=(0.5, 0.25, 1 / 7),
    scale=1 / 255,
    raw="uint8 0..255",
    class_names=("cat", "dog"),
)


def make_state(step: int, rng: np.random.Generator | None = None) -> TrainingState:
    rng = rng if rng is not None else np.random.default_rng(step)
    return TrainingState(
        step=step,
        epoch=step // 6,
        position=step % 6,
        seed=3,
        steps_per_epoch=6,
        order_sha256="ab" * 32,
        model={
            "conv1.weight": rng.standard_normal((4, 3, 5, 5)).astype(np.float32),
            "conv1.bias": rng.standard_normal(4).astype(np.float32),
        },
        momentum={"conv1.weight": rng.standard_normal((4, 3, 5, 5)).astype(np.float32)},
        losses=rng.standard_normal(step),
        recent_hits=rng.random(min(step, 5)),
        breakdown=rng.random(3),
        conv_seconds=0.1 + step / 3,  # not exactly representable: JSON must round-trip it
        train_seconds=1 / 7,
        fingerprint={"batch": 8, "lr": 0.01, "spec": [{"type": "relu"}]},
        environment={"cpu_count": 2, "OMP_NUM_THREADS": None},
        description=DESCRIPTION,
    )


def assert_states_equal(a: TrainingState, b: TrainingState) -> None:
    for f in dataclasses.fields(TrainingState):
        left, right = getattr(a, f.name), getattr(b, f.name)
        if isinstance(left, dict) and left and isinstance(next(iter(left.values())), np.ndarray):
            assert left.keys() == right.keys(), f.name
            for key in left:
                assert left[key].dtype == right[key].dtype, (f.name, key)
                np.testing.assert_array_equal(left[key], right[key], err_msg=f"{f.name}.{key}")
        elif isinstance(left, np.ndarray):
            assert left.dtype == right.dtype == np.float64, f.name
            np.testing.assert_array_equal(left, right, err_msg=f.name)
        else:
            assert left == right, f.name


def saved_weights(path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as archive:
        return {k: archive[k] for k in archive.files}


def assert_weights_identical(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].tobytes() == b[name].tobytes(), name


# -- the format -----------------------------------------------------------------------------


def test_epoch_order_is_a_pure_function_of_seed_and_epoch():
    first = epoch_order(48, 3, 2)
    np.testing.assert_array_equal(first, epoch_order(48, 3, 2))
    assert sorted(first) == list(range(48))
    assert not np.array_equal(first, epoch_order(48, 3, 1))
    assert not np.array_equal(first, epoch_order(48, 4, 2))


def test_every_state_field_round_trips(tmp_path):
    state = make_state(7)
    path = CheckpointDir(tmp_path).write(state)
    assert path.name == "ckpt-00000007.npz"
    assert (tmp_path / "latest").read_text() == "ckpt-00000007.npz\n"
    assert_states_equal(read_checkpoint(path), state)
    with np.load(path, allow_pickle=False) as archive:  # plain arrays and JSON, no pickle
        meta = json.loads(archive["meta"].tobytes())
    assert meta["format"] == "hetconv-checkpoint" and meta["step"] == 7
    assert meta["description"]["spec"][0]["name"] == "conv1"  # the network, in plain JSON


def test_a_checkpoint_without_a_description_reads_as_unknown(tmp_path):
    """As written before checkpoints recorded their network: no key in meta, None read."""
    state = dataclasses.replace(make_state(2), description=None)
    path = CheckpointDir(tmp_path).write(state)
    with np.load(path, allow_pickle=False) as archive:
        assert "description" not in json.loads(archive["meta"].tobytes())
    assert read_checkpoint(path).description is None


def test_state_before_the_first_momentum_buffer_round_trips(tmp_path):
    state = dataclasses.replace(make_state(2), momentum={})
    assert_states_equal(read_checkpoint(CheckpointDir(tmp_path).write(state)), state)


def test_only_the_newest_checkpoints_are_kept(tmp_path):
    folder = CheckpointDir(tmp_path, keep=3)
    for step in (2, 4, 6, 8, 10):
        folder.write(make_state(step))
    assert [s for s, _ in folder.files()] == [10, 8, 6]


# -- atomicity ------------------------------------------------------------------------------


def test_crash_while_writing_leaves_the_previous_checkpoint_latest(tmp_path, monkeypatch):
    folder = CheckpointDir(tmp_path)
    folder.write(make_state(2))

    def write_half_then_die(file, arrays):
        buffer = io.BytesIO()
        np.savez(buffer, **arrays)
        file.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
        file.flush()
        raise OSError("disk on fire")

    monkeypatch.setattr(checkpoint_module, "_write_npz", write_half_then_die)
    with pytest.raises(OSError, match="disk on fire"):
        folder.write(make_state(4))
    assert (tmp_path / "latest").read_text().strip() == "ckpt-00000002.npz"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-00000002.npz", "latest"]
    state, path = folder.load_latest()
    assert path.name == "ckpt-00000002.npz"
    assert_states_equal(state, make_state(2))


def test_a_killed_writers_leftovers_are_ignored_then_removed(tmp_path):
    folder = CheckpointDir(tmp_path)
    folder.write(make_state(2))
    good = (tmp_path / "ckpt-00000002.npz").read_bytes()
    # SIGKILL mid-write: a partial temporary file, never renamed.
    (tmp_path / "ckpt-00000004.npz.tmp-4242").write_bytes(good[:100])
    # SIGKILL between the two renames: a complete file that `latest` does not name yet.
    folder_file = folder.file_for(4)
    CheckpointDir(tmp_path / "other").write(make_state(4))
    os.replace(tmp_path / "other" / "ckpt-00000004.npz", folder_file)
    state, path = folder.load_latest()
    assert path.name == "ckpt-00000002.npz" and state.step == 2
    folder.remove_temporaries()
    assert not (tmp_path / "ckpt-00000004.npz.tmp-4242").exists()


def test_a_damaged_latest_checkpoint_is_named_and_the_previous_one_used(tmp_path):
    folder = CheckpointDir(tmp_path)
    for step in (2, 4, 6):
        folder.write(make_state(step))
    newest = tmp_path / "ckpt-00000006.npz"
    damaged = bytearray(newest.read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF  # inside the array data: the zip CRC catches it
    newest.write_bytes(bytes(damaged))
    messages: list[str] = []
    state, path = folder.load_latest(messages.append)
    assert path.name == "ckpt-00000004.npz"
    assert_states_equal(state, make_state(4))
    assert len(messages) == 1 and str(newest) in messages[0] and "unreadable" in messages[0]

    (tmp_path / "ckpt-00000004.npz").write_bytes(b"")  # truncated to nothing
    (tmp_path / "latest").write_text("garbage\n")
    messages.clear()
    state, path = folder.load_latest(messages.append)
    assert path.name == "ckpt-00000002.npz"
    assert any("latest" in m for m in messages)

    (tmp_path / "ckpt-00000002.npz").write_bytes(b"PK\x03\x04junk")
    with pytest.raises(CheckpointError, match="no readable checkpoint"):
        folder.load_latest()


# -- resuming -------------------------------------------------------------------------------


class CrashAt(LocalConv):
    """A local executor that dies when asked to begin ``step`` (the process 'crashes')."""

    def __init__(self, step: int):
        super().__init__()
        self.crash_step = step

    def begin_step(self, step: int) -> None:
        if step == self.crash_step:
            raise KeyboardInterrupt(f"crash at step {step}")
        super().begin_step(step)


def trace_lines(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def trace_records(path) -> list[dict]:
    """The step records of a trace (a plan record has no step)."""
    return [r for r in trace_lines(path) if "step" in r]


def test_resumed_run_equals_the_uninterrupted_run_bit_for_bit(tmp_path):
    whole = train(TrainConfig(steps=10, save=str(tmp_path / "whole.npz"), **RUN))

    # A shorter run of the same configuration, then resumed to the full length.
    short = dict(RUN, checkpoint_dir=str(tmp_path / "a"), checkpoint_every=3)
    train(TrainConfig(steps=5, trace=str(tmp_path / "a.jsonl"), **short))
    log = io.StringIO()
    resumed = train(
        TrainConfig(
            steps=10,
            resume=True,
            save=str(tmp_path / "a.npz"),
            trace=str(tmp_path / "a.jsonl"),
            **short,
        ),
        log=log,
    )
    assert f"resumed from step 5 (checkpoint {tmp_path / 'a' / 'ckpt-00000005.npz'})" in (
        log.getvalue()
    )
    assert resumed.losses == whole.losses  # Python floats: exact equality
    assert_weights_identical(
        saved_weights(tmp_path / "a.npz"), saved_weights(tmp_path / "whole.npz")
    )
    records = trace_records(tmp_path / "a.jsonl")
    assert [r["step"] for r in records] == list(range(10))
    assert [r["loss"] for r in records] == whole.losses
    assert [r["step"] for r in records if r.get("event") == "checkpoint"] == [2, 4, 5, 8, 9]


def test_resume_after_a_crash_cuts_the_trace_back_to_the_checkpoint(tmp_path):
    whole = train(TrainConfig(steps=10, save=str(tmp_path / "whole.npz"), **RUN))
    config = TrainConfig(
        steps=10,
        checkpoint_dir=str(tmp_path / "ck"),
        checkpoint_every=4,
        trace=str(tmp_path / "t.jsonl"),
        save=str(tmp_path / "r.npz"),
        **RUN,
    )
    with pytest.raises(KeyboardInterrupt):
        train(config, CrashAt(7))  # checkpoint after step 4; records up to step 6
    assert [r["step"] for r in trace_records(tmp_path / "t.jsonl")] == list(range(7))
    with open(tmp_path / "t.jsonl", "a") as f:
        f.write('{"step": 7, "lo')  # a torn last line
    log = io.StringIO()
    resumed = train(dataclasses.replace(config, resume=True), log=log)
    # Steps 4 to 6, the evaluation at the epoch's end (after step 6 of 6) and the torn line.
    assert "cut 5 written after the checkpoint" in log.getvalue()
    assert resumed.losses == whole.losses
    assert [r["step"] for r in trace_records(tmp_path / "t.jsonl")] == list(range(10))
    assert_weights_identical(
        saved_weights(tmp_path / "r.npz"), saved_weights(tmp_path / "whole.npz")
    )


PLAN = {
    "nodes": [
        {
            "name": "master",
            "description": "this process",
            "probe_seconds": {"conv1": 0.01, "conv2": 0.02},
            "link_bytes_per_second": None,
            "link_latency_seconds": None,
        }
    ],
    "shares": {"conv1": [8], "conv2": [16]},
}


class Planned(CrashAt):
    """A local executor with a plan, as the cluster has one (and a crash, as CrashAt)."""

    def __init__(self, crash_step: int = -1):
        super().__init__(crash_step)

    def plan_record(self) -> dict:
        return json.loads(json.dumps(PLAN))


def _without_model(record: dict) -> dict:
    """A plan record less the model it records (checked here: the run's network and batch)."""
    record = dict(record)
    model = record.pop("model")
    assert (model["name"], model["batch"]) == ("tiny", RUN["batch"])
    return record


def test_every_run_starts_its_trace_with_the_plan(tmp_path):
    whole = train(TrainConfig(steps=10, **RUN))
    trace = tmp_path / "t.jsonl"
    config = TrainConfig(
        steps=10,
        checkpoint_dir=str(tmp_path / "ck"),
        checkpoint_every=4,
        trace=str(trace),
        **RUN,
    )
    with pytest.raises(KeyboardInterrupt):
        train(config, Planned(crash_step=7))  # checkpoint after step 4; records up to step 6
    lines = [r for r in trace_lines(trace) if r.get("event") != "eval"]  # one, after an epoch
    assert _without_model(lines[0]) == {"event": "plan", "start_step": 0, **PLAN}
    assert [r["step"] for r in lines[1:]] == list(range(7))

    log = io.StringIO()
    resumed = train(dataclasses.replace(config, resume=True), Planned(), log=log)
    assert "kept 5 records, cut 4 written after the checkpoint" in log.getvalue()
    assert resumed.losses == whole.losses
    lines = [r for r in trace_lines(trace) if r.get("event") != "eval"]
    assert [i for i, r in enumerate(lines) if "step" not in r] == [0, 5]
    assert _without_model(lines[0]) == {"event": "plan", "start_step": 0, **PLAN}
    assert _without_model(lines[5]) == {"event": "plan", "start_step": 4, **PLAN}
    assert [r["step"] for r in trace_records(trace)] == list(range(10))


def test_cutting_a_trace_keeps_the_plans_of_the_steps_it_keeps(tmp_path):
    def plan(start: int) -> dict:
        return {"event": "plan", "start_step": start, **PLAN}

    def step(n: int) -> dict:
        return {"step": n, "loss": 1.0}

    path = tmp_path / "t.jsonl"
    records = [plan(0), step(0), step(1), plan(2), step(2), {"event": "other"}, step(3), step(4)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert _cut_trace(path, 3) == (6, 2)
    assert trace_lines(path) == records[:6]
    # A run that started at step 2 and wrote only its plan before dying is redone: cut its plan.
    path.write_text("".join(json.dumps(r) + "\n" for r in [plan(0), step(0), step(1), plan(2)]))
    assert _cut_trace(path, 2) == (3, 1)
    assert trace_lines(path) == [plan(0), step(0), step(1)]


def test_resume_from_a_damaged_latest_uses_the_previous_checkpoint(tmp_path):
    whole = train(TrainConfig(steps=10, **RUN))
    config = TrainConfig(steps=10, checkpoint_dir=str(tmp_path), checkpoint_every=2, **RUN)
    with pytest.raises(KeyboardInterrupt):
        train(config, CrashAt(7))
    (tmp_path / "ckpt-00000006.npz").write_bytes(b"not a zip")
    log = io.StringIO()
    resumed = train(dataclasses.replace(config, resume=True), log=log)
    assert f"checkpoint {tmp_path / 'ckpt-00000006.npz'} is unreadable" in log.getvalue()
    assert "resumed from step 4" in log.getvalue()
    assert resumed.losses == whole.losses


def test_resume_in_an_empty_folder_starts_from_scratch(tmp_path):
    log = io.StringIO()
    config = TrainConfig(steps=3, checkpoint_dir=str(tmp_path / "new"), resume=True, **RUN)
    result = train(config, log=log)
    assert "no checkpoint in" in log.getvalue() and "starting from scratch" in log.getvalue()
    assert result.losses == train(TrainConfig(steps=3, **RUN)).losses
    assert CheckpointDir(tmp_path / "new").pointer().name == "ckpt-00000003.npz"


def test_checkpoint_failure_is_reported_and_training_goes_on(tmp_path, monkeypatch):
    def full_disk(file, arrays):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint_module, "_write_npz", full_disk)
    log = io.StringIO()
    config = TrainConfig(
        steps=3,
        checkpoint_dir=str(tmp_path / "ck"),
        checkpoint_every=2,
        trace=str(tmp_path / "t.jsonl"),
        **RUN,
    )
    assert len(train(config, log=log).losses) == 3
    assert "checkpoint at step 2 failed" in log.getvalue()
    records = trace_records(tmp_path / "t.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    assert records[1]["event"] == "checkpoint_failed"
    assert "No space left" in records[1]["checkpoint_error"]


# -- refusals, through the command line ------------------------------------------------------

CLI_RUN = ["train", "--local", "--no-progress", "--batch", "8", "--train-size", "48"]
CLI_RUN += ["--eval-size", "8"]


def test_resume_with_an_incompatible_configuration_is_refused(tmp_path, capsys):
    folder = str(tmp_path / "ck")
    assert main([*CLI_RUN, "--steps", "2", "--checkpoint-dir", folder]) == 0
    capsys.readouterr()
    resume = [*CLI_RUN, "--steps", "4", "--checkpoint-dir", folder, "--resume"]
    assert main([*resume, "--lr", "0.02"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "different run" in err and "lr 0.01 there, 0.02 here" in err
    assert main([*resume, "--seed", "5"]) == 2
    err = capsys.readouterr().err.strip()
    assert "seed 0 there, 5 here" in err and "digest" not in err
    assert main([*resume, "--preset", "paper-50-500"]) == 2
    assert "network differs" in capsys.readouterr().err
    assert main([*resume, "--steps", "1"]) == 2
    assert "past this run's 1 steps" in capsys.readouterr().err


def test_a_fresh_run_does_not_overwrite_another_runs_checkpoints(tmp_path, capsys):
    folder = str(tmp_path)
    assert main([*CLI_RUN, "--steps", "2", "--checkpoint-dir", folder]) == 0
    assert main([*CLI_RUN, "--steps", "2", "--checkpoint-dir", folder]) == 2
    assert "pass --resume" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--resume"], "--resume needs --checkpoint-dir"),
        (["--checkpoint-every", "5"], "--checkpoint-every needs --checkpoint-dir"),
    ],
)
def test_checkpoint_flags_need_a_folder(capsys, argv, message):
    assert main([*CLI_RUN, "--steps", "1", "--no-run-dir", *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_digest_difference_is_named_only_when_no_setting_explains_it():
    saved = {"batch": 8, "seed": 0, "train_data_sha256": "a", "initial_weights_sha256": "b"}
    assert fingerprint_differences(saved, saved) == []
    assert fingerprint_differences(saved, dict(saved, initial_weights_sha256="c")) == [
        "initial weights (--load) differ"
    ]
    assert fingerprint_differences(saved, dict(saved, seed=1, train_data_sha256="d")) == [
        "seed 0 there, 1 here"
    ]


def test_a_resume_may_not_switch_the_wire_format():
    """A 16-bit wire rounds every activation: not round-off, so a resume keeps the format.
    A checkpoint written before the format was recorded counts as float32."""
    saved = {"batch": 8, "seed": 0, "train_data_sha256": "a", "initial_weights_sha256": "b"}
    assert fingerprint_differences(saved, dict(saved, wire_format="float32")) == []
    assert fingerprint_differences(dict(saved, wire_format="bfloat16"), saved) == [
        "--wire-format bfloat16 there, float32 here"
    ]


def test_the_fingerprint_records_the_executors_wire_format(tmp_path):
    class Bfloat16Local(LocalConv):
        wire_format = "bfloat16"

    first = tmp_path / "a"
    train(
        TrainConfig(**{**RUN, "steps": 2}, checkpoint_dir=str(first)),
        Bfloat16Local(),
        log=io.StringIO(),
    )
    state = read_checkpoint(CheckpointDir(first).pointer())
    assert state.fingerprint["wire_format"] == "bfloat16"
    with pytest.raises(CheckpointError, match="--wire-format bfloat16 there, float32 here"):
        train(
            TrainConfig(**{**RUN, "steps": 3}, checkpoint_dir=str(first), resume=True),
            LocalConv(),
            log=io.StringIO(),
        )


# -- a real process, killed ------------------------------------------------------------------

# 10 steps per epoch: the kill (soon after step 4) lands mid-epoch, so the data position matters.
PROCESS_RUN = [sys.executable, "-m", "hetconv", *CLI_RUN, "--train-size", "80", "--steps", "120"]


def test_a_killed_process_resumes_to_the_uninterrupted_weights(tmp_path):
    whole = tmp_path / "whole.npz"
    subprocess.run([*PROCESS_RUN, "--save", str(whole)], check=True, timeout=120)

    folder = CheckpointDir(tmp_path / "ck")
    run = [*PROCESS_RUN, "--checkpoint-dir", str(folder.path), "--checkpoint-every", "2"]
    process = subprocess.Popen(run, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            pointer = folder.pointer()
            if pointer is not None and int(pointer.stem.split("-")[1]) > 4:
                break
            assert process.poll() is None, "the run ended before it could be killed"
            time.sleep(0.01)
        else:
            pytest.fail("no checkpoint past step 4 within 60 s")
        assert process.poll() is None, "the run finished before it could be killed"
        process.kill()  # SIGKILL: no cleanup, no final checkpoint
    finally:
        process.kill()
        process.wait(timeout=30)
    killed_at = int(folder.pointer().stem.split("-")[1])
    assert 4 < killed_at < 120

    resumed = tmp_path / "resumed.npz"
    done = subprocess.run(
        [*run, "--resume", "--save", str(resumed)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "resumed from step" in done.stderr
    resumed_from = int(done.stderr.split("resumed from step ")[1].split()[0])
    assert resumed_from >= killed_at
    assert_weights_identical(saved_weights(resumed), saved_weights(whole))


# -- a real process, stopped by a signal -----------------------------------------------------


@pytest.mark.skipif(os.name != "posix", reason="sends POSIX signals")
@pytest.mark.parametrize(
    "signum",
    [signal.SIGINT, pytest.param(signal.SIGTERM, marks=pytest.mark.slow)],
    ids=["SIGINT", "SIGTERM"],
)
def test_a_signal_checkpoints_the_current_step_and_resume_matches(tmp_path, signum):
    # --checkpoint-every is past the end: the only checkpoint is the one the signal asks for.
    whole = tmp_path / "whole.npz"
    subprocess.run([*PROCESS_RUN, "--save", str(whole)], check=True, timeout=120)

    folder = CheckpointDir(tmp_path / "ck")
    trace = tmp_path / "trace.jsonl"
    run = [*PROCESS_RUN, "--checkpoint-dir", str(folder.path), "--checkpoint-every", "1000"]
    process = subprocess.Popen([*run, "--trace", str(trace)], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (trace.exists() and trace.read_text().count('"step": ') >= 5):
            assert process.poll() is None, "the run ended before the signal"
            assert time.monotonic() < deadline, "no 5 steps within 60 s"
            time.sleep(0.01)
        process.send_signal(signum)
        stderr = process.communicate(timeout=60)[1]
    finally:
        process.kill()
        process.wait(timeout=30)
    assert process.returncode == 128 + signum, stderr
    assert "Traceback" not in stderr
    step = int(stderr.split("hetconv: stopped after step ")[1].split()[0])
    assert 5 <= step < 120, stderr
    assert folder.files() == [(step, folder.file_for(step))]
    records = trace_records(trace)
    assert [r["step"] for r in records] == list(range(step))
    assert records[-1]["event"] == "checkpoint"

    resumed = tmp_path / "resumed.npz"
    done = subprocess.run(
        [*run, "--resume", "--save", str(resumed)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert f"resumed from step {step}" in done.stderr
    assert_weights_identical(saved_weights(resumed), saved_weights(whole))
