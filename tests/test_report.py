"""`hetconv report`: the figures of a run, drawn from its metrics.csv."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hetconv.cli import main
from hetconv.training.metrics import read_metrics
from hetconv.training.report import (
    DPI,
    FIGSIZE,
    _binned,
    _moving_average,
    draw_report,
    lost_steps,
    node_notes,
)
from hetconv.training.rundir import MetricsCsv

pytest.importorskip("matplotlib")
Image = pytest.importorskip("PIL.Image")

WIDTH, HEIGHT = int(FIGSIZE[0] * DPI), int(FIGSIZE[1] * DPI)


def assert_png(path: Path, width: int = WIDTH, height: int | None = HEIGHT) -> None:
    """A real PNG of report size with something drawn on it."""
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(path) as image:
        image.verify()
    with Image.open(path) as image:
        assert image.width == width
        assert height is None or image.height == height
        pixels = np.asarray(image.convert("L"), dtype=np.float64)
    assert (pixels < 128).mean() > 0.005  # lines and text, not a blank page
    assert (pixels > 200).mean() > 0.3  # on a white background


def test_a_local_run_gets_loss_accuracy_and_step_time(tmp_path, capsys):
    args = ["train", "--local", "--steps", "12", "--batch", "8", "--train-size", "32"]
    args += ["--eval-size", "8", "--no-progress", "--run-dir", str(tmp_path), "--name", "r"]
    assert main(args) == 0
    capsys.readouterr()
    assert main(["report", str(tmp_path / "r")]) == 0
    out, err = capsys.readouterr()
    figures = tmp_path / "r" / "figures"
    assert out.split() == [str(figures / f"{n}.png") for n in ("loss", "accuracy", "step_time")]
    assert "nodes: none, a run without workers" in err and "bytes: none" in err
    for name in ("loss", "accuracy", "step_time"):
        assert_png(figures / f"{name}.png")


def test_a_run_of_one_step_without_evaluation_is_drawn(tmp_path):
    args = ["train", "--local", "--steps", "1", "--batch", "8", "--train-size", "8"]
    args += ["--eval-size", "0", "--no-progress", "--run-dir", str(tmp_path), "--name", "one"]
    assert main(args) == 0
    figures = draw_report(tmp_path / "one", tmp_path / "elsewhere")
    drawn = [f.path for f in figures if f.path is not None]
    assert [p.name for p in drawn] == ["loss.png", "accuracy.png", "step_time.png"]
    for path in drawn:
        assert path.parent == tmp_path / "elsewhere"
        assert_png(path)


def _record(step: int, rng: np.random.Generator, nodes: list[str]) -> dict:
    kernels = {"master": 4, "10.0.0.2:50051": 8, "10.0.0.3:50051": 4}
    figures = {}
    for node in nodes:
        sent = 0 if node == "master" else int(1e6 * (1 + rng.random()))
        phase = {"bytes_sent": sent, "bytes_received": sent // 2,
                 "compute_seconds": 0.01 * kernels[node] * (1 + 0.1 * rng.random())}  # fmt: skip
        figures[node] = {"conv1": {"kernels": kernels[node], "forward": phase, "backward": phase}}
    loss = 2.3 * np.exp(-step / 300) + 0.1 * rng.random()
    return {"step": step, "epoch": step // 100, "loss": loss,
            "accuracy": min(1.0, step / 800 + 0.1 * rng.random()), "batch": 16,
            "seconds": 0.2 + 0.01 * rng.random(), "comm_seconds": 0.08, "conv_seconds": 0.1,
            "comp_seconds": 0.02, "nodes": figures}  # fmt: skip


def test_a_long_cluster_run_with_a_node_joining_is_drawn(tmp_path, rng):
    # 1000 steps (drawn as means over bins of 5), a third node from step 400, an evaluation
    # every 100 steps: the shape of a real run's table, written by the run's own writer.
    table = MetricsCsv(tmp_path / "metrics.csv")
    for step in range(1000):
        nodes = ["master", "10.0.0.2:50051"] + (["10.0.0.3:50051"] if step >= 400 else [])
        table.step(_record(step, rng, nodes))
        if (step + 1) % 100 == 0:
            table.evaluation(step + 1, 1.0 - step / 2000, step / 1200)
    table.close()
    figures = draw_report(tmp_path)
    assert [f.name for f in figures] == ["loss", "accuracy", "step_time", "nodes", "bytes"]
    for figure in figures:
        tall = figure.name == "nodes"  # two panels
        assert_png(figure.path, height=None if tall else HEIGHT)
    with Image.open(tmp_path / "figures" / "nodes.png") as image:
        assert image.height > HEIGHT


def test_bins_and_moving_averages_are_means():
    x, y = np.arange(1.0, 12.0), np.arange(11.0) ** 2
    bx, by = _binned(x, y, 5)
    np.testing.assert_allclose(bx, [3.0, 8.0, 11.0])
    np.testing.assert_allclose(by, [np.mean(y[:5]), np.mean(y[5:10]), y[10]])
    means = _moving_average(y, 3)
    np.testing.assert_allclose(means, [np.mean(y[max(0, i - 2) : i + 1]) for i in range(11)])


def test_what_cannot_be_drawn_is_refused_by_name(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert f"{tmp_path} holds no metrics.csv" in capsys.readouterr().err
    MetricsCsv(tmp_path / "metrics.csv").close()  # a run stopped before its first step
    assert main(["report", str(tmp_path)]) == 2
    assert "holds no step yet" in capsys.readouterr().err
    path = tmp_path / "metrics.csv"
    path.write_text(path.read_text() + "0,0,oops" + ",1" * 9 + "\n")
    assert main(["report", str(path)]) == 2
    assert f"{path}:2: loss is 'oops', not a number" in capsys.readouterr().err
    path.write_text("step,loss\n0,1.0\n")
    assert main(["report", str(path)]) == 2
    assert "lacks the columns epoch, accuracy" in capsys.readouterr().err
    assert not (tmp_path / "figures").exists()


def test_a_worker_with_no_share_is_told_apart_from_a_lost_one(tmp_path, rng):
    # 10.0.0.3 answers with no kernel at steps 100-199 (the trace's "idle"), computes again
    # from 200, and is lost at step 240 (no cells at all from there).
    table = MetricsCsv(tmp_path / "metrics.csv")
    for step in range(300):
        nodes = ["master", "10.0.0.2:50051"] + (["10.0.0.3:50051"] if step < 240 else [])
        idle = 100 <= step < 200
        record = _record(step, rng, [n for n in nodes if not (idle and n == "10.0.0.3:50051")])
        if idle:
            record["idle"] = ["10.0.0.3:50051"]
        table.step(record)
    table.close()
    metrics = read_metrics(tmp_path / "metrics.csv")
    share = metrics.node("share", "10.0.0.3:50051")
    assert share[99] > 0 and share[150] == 0 and share[200] > 0 and np.isnan(share[250])
    assert metrics.node("bytes", "10.0.0.3:50051")[150] == 0
    assert lost_steps(metrics, "10.0.0.3:50051") == [240]
    assert node_notes(metrics) == {
        "10.0.0.3:50051": "idle: no share at steps 100-199; lost at step 240"
    }
    figures = draw_report(tmp_path)
    assert [f.name for f in figures if f.path] == [
        "loss", "accuracy", "step_time", "nodes", "bytes"
    ]  # fmt: skip
    assert_png(tmp_path / "figures" / "bytes.png")


def test_a_step_split_by_images_gives_its_metrics_row():
    # --split images traces each node's images, seconds and bytes (not per-layer kernels).
    from hetconv.training.metrics import step_row

    record = {
        "step": 3, "epoch": 0, "loss": 2.0, "accuracy": 0.5, "batch": 16, "seconds": 0.5,
        "comm_seconds": 0.1, "conv_seconds": 0.3, "comp_seconds": 0.1, "split": "images",
        "bytes_sent": 300, "bytes_received": 200,
        "nodes": {
            "master": {"images": 4, "seconds": 0.2},
            "w1": {"images": 12, "seconds": 0.3, "bytes_sent": 300, "bytes_received": 200},
        },
    }  # fmt: skip
    row = step_row(record)
    assert row["share:master"] == 0.25 and row["share:w1"] == 0.75
    assert row["compute_seconds:w1"] == 0.3 and row["bytes:w1"] == 500 and row["bytes"] == 500
    assert row["images_per_second"] == 32
