"""Run folders: what `hetconv train` leaves in runs/NAME, rerunning from its config.toml,
Ctrl-C, --load and `hetconv evaluate` of models and checkpoints, TensorBoard files."""

from __future__ import annotations

import csv
import json
import os
import shlex
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from hetconv.cli import main
from hetconv.simulations.trace import read_records, step_bytes
from hetconv.training.metrics import FIXED_COLUMNS, read_metrics
from hetconv.training.rundir import (
    MetricsCsv,
    RunDir,
    read_config,
    toml_value,
    write_config,
)

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

SMALL = ["--steps", "4", "--batch", "8", "--train-size", "32", "--eval-size", "8"]
SMALL += ["--eval-every", "2", "--no-progress"]


def _train(tmp_path: Path, name: str, *args: str) -> Path:
    assert main(["train", *args, "--run-dir", str(tmp_path), "--name", name]) == 0
    return tmp_path / name


def _rows(run: Path) -> list[dict]:
    with open(run / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def _weights(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as archive:
        return {k: archive[k] for k in archive.files}


@pytest.fixture(scope="module")
def local_run(tmp_path_factory) -> Path:
    return _train(tmp_path_factory.mktemp("runs"), "first", "--local", *SMALL)


def test_a_run_folder_holds_config_metrics_trace_checkpoints_and_model(local_run):
    names = {p.name for p in local_run.iterdir()}
    assert names == {"config.toml", "metrics.csv", "trace.jsonl", "checkpoints", "model.npz"}
    assert (local_run / "checkpoints" / "ckpt-00000004.npz").is_file()
    final = _weights(local_run / "model.npz")
    assert set(final) == {"conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias",
                          "fc.weight", "fc.bias"}  # fmt: skip


def test_metrics_csv_matches_the_trace_cell_for_cell(local_run):
    records = read_records(str(local_run / "trace.jsonl"))
    steps = [r for r in records if "step" in r]
    evals = {r["trained_steps"]: r for r in records if r.get("event") == "eval"}
    rows = _rows(local_run)
    assert list(rows[0]) == list(FIXED_COLUMNS)  # a local run has no per-node columns
    assert [int(r["step"]) for r in rows] == [s["step"] for s in steps] == [0, 1, 2, 3]
    for row, step in zip(rows, steps, strict=True):
        assert float(row["loss"]) == step["loss"]  # written exactly, not rounded
        assert float(row["accuracy"]) == step["accuracy"]
        assert float(row["seconds"]) == step["seconds"]
        assert float(row["images_per_second"]) == pytest.approx(8 / step["seconds"])
        assert float(row["comm_seconds"]) == step["comm_seconds"] == 0.0
        assert float(row["conv_seconds"]) == step["conv_seconds"]
        assert float(row["other_seconds"]) == step["comp_seconds"]
        assert int(row["bytes"]) == 0
        held = evals.get(step["step"] + 1)
        if held is None:
            assert row["held_out_loss"] == row["held_out_accuracy"] == ""
        else:
            assert float(row["held_out_loss"]) == held["loss"]
            assert float(row["held_out_accuracy"]) == held["accuracy"]
    assert sorted(evals) == [2, 4]  # every 2 steps and the final one


def test_config_toml_reruns_the_run_bitwise(local_run, tmp_path):
    config = tomllib.loads((local_run / "config.toml").read_text())
    assert config["cluster"] == {"local": True}
    assert config["training"]["steps"] == 4 and config["data"]["dataset"] == "synthetic"
    again = _train(tmp_path, "again", "--config", str(local_run / "config.toml"), "--no-progress")
    assert [r["loss"] for r in _rows(again)] == [r["loss"] for r in _rows(local_run)]
    first, second = _weights(local_run / "model.npz"), _weights(again / "model.npz")
    assert all(np.array_equal(first[k], second[k]) for k in first)
    assert tomllib.loads((again / "config.toml").read_text()) == config


def test_command_line_flags_override_the_config(local_run, tmp_path):
    config = str(local_run / "config.toml")
    assert len(_rows(_train(tmp_path, "one", "--config", config, "--steps", "1"))) == 1
    # --epochs on the command line replaces the file's --steps (one of them only).
    run = _train(tmp_path, "half", "--config", config, "--epochs", "0.5")
    assert len(_rows(run)) == 2  # 32 images / batch 8 = 4 steps an epoch
    assert "steps" not in tomllib.loads((run / "config.toml").read_text())["training"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[data]\nbogus = 1\n", "unknown key 'bogus'"),
        ("[training]\nsteps = 'many'\n", "steps = 'many': 'many' is not an integer"),
        ("[training]\nsteps = -3\n", "steps = -3"),
        ("[cluster]\nlocal = 'yes'\n", "local = 'yes': expected true or false"),
        ("[cluster]\nwire-format = 'float8'\n", "expected one of float32, float16, bfloat16"),
        ("[cluster]\nworker = '1.2.3.4:5'\n", "expected a list of strings"),
        ("[model]\npreset = 3\n", "preset = 3: expected a string"),
        ("[cluster]\ntoken = 'x'\n", "token cannot be set in a config file"),
        ("[outputs]\nsave = 'x.npz'\n", "save cannot be set in a config file"),
        ("steps = 3\n", "stands outside a table"),
        ("[training]\nsteps = 3\n[data]\nsteps = 4\n", "steps is given twice"),
        ("[training\n", "is not TOML"),
        ("[training]\nsteps = '2'\n", "steps = '2': expected a number, not a string"),
        ("[training]\nsteps = 2\n[extras]\nx = 1\n", "unknown table [extras]"),
        ("[data]\nsteps = 2\n", "[data] steps: steps belongs in [training]"),
        ("[training]\nwire-format = 'float16'\n", "wire-format belongs in [cluster]"),
    ],
)
def test_a_bad_config_is_refused_naming_the_key(tmp_path, capsys, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    assert main(["train", "--local", "--config", str(path), "--run-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert message in err and str(path) in err
    assert not any(p.is_dir() for p in tmp_path.iterdir())  # no run folder was made


def test_the_token_never_reaches_the_config(tmp_path):
    run = _train(tmp_path, "secret", "--local", *SMALL, "--token", "s3cret-t0ken")
    assert "s3cret-t0ken" not in (run / "config.toml").read_text()


def test_an_existing_name_is_refused_unless_resumed(local_run, capsys):
    args = ["train", "--local", *SMALL, "--run-dir", str(local_run.parent), "--name", "first"]
    assert main(args) == 2
    assert "already exists" in capsys.readouterr().err
    assert main([*args, "--resume"]) == 0  # all 4 steps are checkpointed: nothing left to do
    assert "resumed from step 4" in capsys.readouterr().err
    # A resume refused for other settings leaves the run's config.toml as it was.
    config = (local_run / "config.toml").read_text()
    assert main([*args, "--resume", "--lr", "0.02"]) == 2
    assert "lr 0.01 there, 0.02 here" in capsys.readouterr().err
    assert (local_run / "config.toml").read_text() == config
    assert main(["train", "--local", "--resume", "--run-dir", str(local_run.parent)]) == 2
    assert "--resume needs --checkpoint-dir or --name" in capsys.readouterr().err


def test_a_run_that_fails_before_its_first_step_leaves_no_folder(tmp_path, capsys):
    args = ["train", "--local", *SMALL, "--run-dir", str(tmp_path), "--name", "broken"]
    assert main([*args, "--load", str(tmp_path / "missing.npz")]) == 2
    assert "missing.npz" in capsys.readouterr().err
    assert not (tmp_path / "broken").exists()


@pytest.mark.parametrize("steps", [0, 1])
def test_a_folder_is_discarded_only_while_its_trace_holds_no_step(tmp_path, steps):
    """A run that failed after its plan record but before its first step leaves nothing."""
    run = RunDir(tmp_path, "r")
    assert run.make()
    run.config.write_text('[run]\nname = "r"\n')
    run.metrics.write_text("step,loss\n")
    records = [{"event": "plan", "start_step": 0}] + [{"step": i} for i in range(steps)]
    run.trace.write_text("".join(json.dumps(r) + "\n" for r in records))
    run.checkpoints.mkdir()
    run.discard_if_empty()
    assert run.path.exists() == bool(steps)


def test_load_and_evaluate_take_a_model_a_checkpoint_or_a_run(local_run, tmp_path, capsys):
    final_eval = [r for r in read_records(str(local_run / "trace.jsonl")) if r.get("final")]
    checkpoint = local_run / "checkpoints" / "ckpt-00000004.npz"
    lines = []
    for path in (local_run / "model.npz", checkpoint, checkpoint.parent, local_run):
        capsys.readouterr()
        assert main(["evaluate", str(path), "--eval-size", "8"]) == 0
        out = capsys.readouterr().out
        assert "held-out loss" in out and "on 8 images of synthetic" in out
        lines.append(out.split(": held-out ", 1)[1])
    assert len(set(lines)) == 1  # the same weights, whichever way they were named
    assert f"loss {final_eval[-1]['loss']:.4f}" in lines[0]
    # --load of the final checkpoint starts where --load of the model does (the same weights).
    from_checkpoint = _train(tmp_path, "ckpt", "--local", *SMALL, "--load", str(checkpoint))
    assert "starting from the weights of checkpoint" in capsys.readouterr().err
    from_model = _train(tmp_path, "model", "--local", *SMALL, "--load", str(local_run))
    losses = [r["loss"] for r in _rows(from_checkpoint)]
    assert losses == [r["loss"] for r in _rows(from_model)]
    assert losses != [r["loss"] for r in _rows(local_run)]


def test_evaluate_refuses_what_it_cannot_use(local_run, tmp_path, capsys):
    assert main(["evaluate", str(tmp_path / "nothing.npz")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["evaluate", str(local_run / "model.npz"), "--preset", "paper-50-500"]) == 2
    err = capsys.readouterr().err
    assert "does not fit network paper-50-500" in err and "conv1.weight" in err
    (tmp_path / "empty").mkdir()
    assert main(["evaluate", str(tmp_path / "empty")]) == 2
    assert "holds no model.npz and no checkpoint" in capsys.readouterr().err


@pytest.mark.skipif(os.name != "posix", reason="sends SIGINT, a POSIX signal")
def test_ctrl_c_saves_model_and_checkpoint_and_says_how_to_resume(tmp_path):
    env = dict(os.environ, HETCONV_RUN_DIR=str(tmp_path))
    process = subprocess.Popen(
        [sys.executable, "-m", "hetconv", "train", "--local", "--steps", "100000", "--batch",
         "8", "--train-size", "64", "--eval-size", "8", "--no-progress", "--name", "stopped"],
        stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    run = tmp_path / "stopped"
    try:
        deadline = time.monotonic() + 60
        while not ((run / "metrics.csv").exists() and len(_rows(run)) >= 5):
            assert process.poll() is None, "the run ended before the signal"
            assert time.monotonic() < deadline, "no 5 steps within 60 s"
            time.sleep(0.05)
        process.send_signal(signal.SIGINT)
        stderr = process.communicate(timeout=60)[1]
    finally:
        process.kill()
        process.wait(timeout=30)
    assert process.returncode == 130, stderr
    step = int(stderr.split("hetconv: stopped after step ")[1].split()[0])
    checkpoint = run / "checkpoints" / f"ckpt-{step:08d}.npz"
    assert checkpoint.is_file() and (run / "model.npz").is_file()
    assert f"model {run / 'model.npz'}" in stderr and f"checkpoint {checkpoint}" in stderr
    command = stderr.split("to continue from the latest checkpoint: ")[1].splitlines()[0]
    assert command.startswith("hetconv train --config ") and command.endswith("--resume")
    # The model saved at the stop is the checkpoint's.
    with np.load(checkpoint) as saved:
        model = _weights(run / "model.npz")
        assert all(np.array_equal(saved[f"model/{k}"], v) for k, v in model.items())
    # The command it printed continues the run (here for two more steps).
    argv = shlex.split(command)[1:] + ["--steps", str(step + 2)]
    done = subprocess.run(
        [sys.executable, "-m", "hetconv", *argv], capture_output=True, text=True, env=env,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert f"resumed from step {step}" in done.stderr
    assert [int(r["step"]) for r in _rows(run)] == list(range(step + 2))


def test_metrics_csv_adds_a_node_that_joins_and_keeps_earlier_rows_on_resume(tmp_path):
    def record(step: int, nodes: dict) -> dict:
        return {"step": step, "epoch": 0, "loss": 1.0 / (step + 1), "accuracy": 0.5,
                "batch": 4, "seconds": 0.5, "comm_seconds": 0.1, "conv_seconds": 0.3,
                "comp_seconds": 0.1, "nodes": nodes}  # fmt: skip

    def node(kernels: int, sent: int) -> dict:
        phase = {"bytes_sent": sent, "bytes_received": 2 * sent, "compute_seconds": 0.25}
        return {"conv1": {"kernels": kernels, "forward": phase, "backward": phase}}

    path = tmp_path / "metrics.csv"
    table = MetricsCsv(path)
    table.step(record(0, {"master": node(6, 0), "w1:1": node(2, 100)}))
    table.step(record(1, {"master": node(4, 0), "w1:1": node(2, 100), "w2:2": node(2, 50)}))
    table.evaluation(2, 0.75, 0.625)
    table.close()
    metrics = read_metrics(path)
    assert metrics.nodes == ["master", "w1:1", "w2:2"]
    np.testing.assert_array_equal(metrics.node("share", "master"), [0.75, 0.5])
    assert np.isnan(metrics.node("share", "w2:2")[0])  # it had not joined yet
    np.testing.assert_array_equal(metrics["bytes"], [600, 900])
    np.testing.assert_array_equal(metrics.node("compute_seconds", "w1:1"), [0.5, 0.5])
    assert metrics.held_out()[0].tolist() == [2] and metrics.held_out()[2].tolist() == [0.625]
    resumed = MetricsCsv(path, resume_step=1)  # a checkpoint after step 0 is resumed
    resumed.close()
    assert read_metrics(path)["step"].tolist() == [0.0]
    assert read_metrics(path).nodes == ["master", "w1:1"]


@pytest.mark.parametrize(
    "value",
    ["plain", 'quote " and \\ backslash', "new\nline\ttab", "\x7f\x01 controls", "ünïcødé 😀",
     3, 0.1, 1e-05, True, ["a:1", "b:2"], []],
)  # fmt: skip
def test_the_config_writer_writes_toml_that_reads_back_exactly(tmp_path, value):
    path = tmp_path / "c.toml"
    write_config(path, {"table": {"key": value}}, "a comment\nof two lines")
    assert tomllib.loads(path.read_text(encoding="utf-8")) == {"table": {"key": value}}
    assert read_config(path) == {"key": value}
    with pytest.raises(ValueError, match="no place"):
        toml_value(float("nan"))


# -- a run with workers ----------------------------------------------------------------------


def _tfrecords(path: Path):
    """The records of a TFRecord file (an event file), checking lengths and CRCs."""
    from tensorboardX.crc32c import crc32c

    def masked(data: bytes) -> int:
        crc = crc32c(data)
        return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF

    data = path.read_bytes()
    offset = 0
    while offset < len(data):
        header = data[offset : offset + 8]
        (length,) = struct.unpack("<Q", header)
        assert struct.unpack("<I", data[offset + 8 : offset + 12])[0] == masked(header)
        body = data[offset + 12 : offset + 12 + length]
        assert struct.unpack("<I", data[offset + 12 + length : offset + 16 + length])[0] == (
            masked(body)
        )
        yield body
        offset += 16 + length


def _scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboardX.proto import event_pb2

    scalars: dict[str, list[tuple[int, float]]] = {}
    for file in sorted(folder.iterdir()):
        for body in _tfrecords(file):
            event = event_pb2.Event.FromString(body)
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


def test_a_cluster_run_has_per_node_columns_and_tensorboard_scalars(tmp_path):
    pytest.importorskip("tensorboardX")
    run = _train(tmp_path, "cluster", "--local-workers", "1", *SMALL, "--tensorboard")
    records = [r for r in read_records(str(run / "trace.jsonl")) if "step" in r]
    metrics = read_metrics(run / "metrics.csv")
    worker = [n for n in records[0]["nodes"] if n != "master"]
    assert metrics.nodes == ["master", *worker] and len(worker) == 1
    for index, record in enumerate(records):
        shares = [metrics.node("share", n)[index] for n in metrics.nodes]
        assert sum(shares) == pytest.approx(1.0) and all(0 <= s <= 1 for s in shares)
        assert metrics["bytes"][index] == step_bytes(record) > 0
        kernels = {n: sum(f["kernels"] for f in layers.values())
                   for n, layers in record["nodes"].items()}  # fmt: skip
        assert shares[1] == pytest.approx(kernels[worker[0]] / sum(kernels.values()))
    scalars = _scalars(run / "tensorboard")
    losses = scalars["train/loss"]
    assert [step for step, _ in losses] == [1, 2, 3, 4]  # at steps trained
    np.testing.assert_allclose([v for _, v in losses], metrics["loss"], rtol=1e-6)  # float32
    assert [step for step, _ in scalars["held_out/accuracy"]] == [2, 4]
    tag = worker[0].replace(":", "_")  # TensorBoard tags hold no ':'
    assert f"share/{tag}" in scalars and f"bytes/{tag}" in scalars
    assert "time/comm_seconds" in scalars
    assert "link/bytes" in scalars
    config = tomllib.loads((run / "config.toml").read_text())
    assert config["cluster"]["local-workers"] == 1 and config["cluster"]["shares"] == "compute"
    assert config["outputs"]["tensorboard"] is True
    json.dumps(config)  # plain values only
