"""The training loop and the ``hetconv train`` command, end to end on small runs."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys

import numpy as np
import pytest

from hetconv.cli import main
from hetconv.conv import ConvExecutor, LocalConv
from hetconv.model import PRESETS, Model
from hetconv.training import TrainConfig, train

SMALL_RUN = [
    "--steps",
    "2",
    "--batch",
    "4",
    "--train-size",
    "16",
    "--eval-size",
    "8",
    "--no-progress",
]


def write_cifar(folder, images_per_file: int = 40, seed: int = 0) -> None:
    """Small files in the official CIFAR-10 python format, with learnable labels."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        labels = rng.integers(0, 10, images_per_file)
        data = rng.integers(0, 256, (images_per_file, 3072)).astype(np.uint8)
        data[:, :1024] = (labels[:, None] * 25).astype(np.uint8)  # red plane encodes the class
        batch = {
            b"batch_label": name.encode(),
            b"labels": labels.tolist(),
            b"data": data,
            b"filenames": [f"{name}_{i}.png".encode() for i in range(images_per_file)],
        }
        with open(folder / name, "wb") as f:
            pickle.dump(batch, f, protocol=2)


@pytest.mark.slow  # 150 steps; the CI script's `hetconv train` checks learning on every run
def test_tiny_preset_learns_synthetic_data_far_above_chance():
    config = TrainConfig(steps=150, batch=32, train_size=4000, eval_size=500, progress=False)
    result = train(config)
    assert result.eval_accuracy is not None and result.eval_accuracy > 0.6  # chance: 0.1
    assert np.mean(result.losses[-20:]) < np.mean(result.losses[:20])


def test_training_is_deterministic_by_seed():
    config = TrainConfig(steps=4, batch=8, train_size=64, eval_size=16, progress=False)
    first, second = train(config), train(config)
    assert first.losses == second.losses
    other = train(
        TrainConfig(steps=4, batch=8, train_size=64, eval_size=16, seed=1, progress=False)
    )
    assert other.losses != first.losses


def test_trace_has_one_object_per_step(tmp_path):
    trace = tmp_path / "steps.jsonl"
    train(
        TrainConfig(steps=3, batch=4, train_size=32, eval_size=8, trace=str(trace), progress=False)
    )
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    records = [r for r in records if "step" in r]  # a plan record, if any, has no step
    assert [r["step"] for r in records] == [0, 1, 2]
    for r in records:
        assert r["batch"] == 4 and np.isfinite(r["loss"])
        assert 0 < r["conv_seconds"] <= r["seconds"]
        assert r["comm_seconds"] == 0.0
        assert r["comp_seconds"] == pytest.approx(r["seconds"] - r["conv_seconds"])


class Unplanned(ConvExecutor):
    """An executor that overrides none of the optional hooks (``plan_record`` included): the
    contract's do-nothing defaults serve it."""

    def __init__(self):
        self.local = LocalConv()
        self.forward, self.backward = self.local.forward, self.local.backward
        self.begin_step, self.end_step = self.local.begin_step, self.local.end_step
        self.prepared: list = []

    def prepare(self, layers, batch, log):
        self.prepared = list(layers)

    def close(self):
        pass


def test_an_executor_without_a_plan_traces_only_steps(tmp_path):
    trace = tmp_path / "steps.jsonl"
    executor = Unplanned()
    train(
        TrainConfig(steps=2, batch=4, train_size=16, eval_size=0, trace=str(trace), progress=False),
        executor,
    )
    assert [json.loads(line)["step"] for line in trace.read_text().splitlines()] == [0, 1]
    assert executor.prepared == Model(PRESETS["tiny"]).conv_specs()


def test_a_plan_may_not_hold_a_step(tmp_path):
    class StepInPlan(LocalConv):
        def plan_record(self):
            return {"step": 0, "shares": {}}

    config = TrainConfig(steps=1, batch=4, train_size=16, eval_size=0, progress=False)
    with pytest.raises(ValueError, match="'step'"):
        train(config, StepInPlan())


def test_save_then_load_continues_from_the_saved_weights(tmp_path):
    weights = tmp_path / "w.npz"
    train(
        TrainConfig(steps=3, batch=4, train_size=32, eval_size=8, save=str(weights), progress=False)
    )
    saved = dict(np.load(weights))
    assert set(saved) == {
        "conv1.weight",
        "conv1.bias",
        "conv2.weight",
        "conv2.bias",
        "fc.weight",
        "fc.bias",
    }
    assert saved["conv1.weight"].shape == (8, 3, 5, 5) and saved["fc.weight"].shape == (10, 1024)
    fresh = Model(PRESETS["tiny"], seed=0)
    assert not np.array_equal(fresh.parameters()["conv1.weight"], saved["conv1.weight"])
    fresh.load(weights)
    for name, value in fresh.parameters().items():
        np.testing.assert_array_equal(value, saved[name])


def test_cifar10_files_train_and_evaluate(tmp_path):
    write_cifar(tmp_path / "cifar-10-batches-py")
    result = train(
        TrainConfig(
            dataset="cifar10",
            data_dir=str(tmp_path),
            epochs=1,
            batch=20,
            eval_size=40,
            progress=False,
        )
    )
    assert result.steps == 200 // 20
    assert result.eval_accuracy is not None


def test_cli_trains_and_prints_held_out_accuracy(capsys):
    assert main(["train", "--local", *SMALL_RUN]) == 0
    assert "held-out accuracy" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--preset", "paper-1-2"], "unknown preset"),
        (["--dataset", "cifar10"], "--data-dir"),
        (["--dataset", "cifar10", "--data-dir", "/nonexistent/cifar"], "/nonexistent/cifar"),
        (["--load", "/nonexistent/w.npz"], "/nonexistent/w.npz"),
        (["--batch", "64", "--train-size", "10"], "larger than the training set"),
    ],
)
def test_cli_bad_input_is_one_line_naming_the_problem(capsys, argv, message):
    assert main(["train", "--no-progress", "--steps", "1", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err
    assert len(err.splitlines()) == 1 and "Traceback" not in err


def test_cli_rejects_bad_numbers_with_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--steps", "0"])
    assert exit_info.value.code == 2
    assert "--steps" in capsys.readouterr().err


def test_console_script_runs_as_a_process(tmp_path):
    weights = tmp_path / "w.npz"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "hetconv.cli",
            "train",
            *SMALL_RUN,
            "--save",
            str(weights),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert weights.exists()
