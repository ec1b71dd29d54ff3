"""Weights that describe themselves: what `hetconv train` writes (model.npz, checkpoints) records
the network's spec, its input shape, classes and the input's normalisation, so `hetconv export`
and `hetconv evaluate` need nothing but the file, and the ONNX graph states (or performs) the
normalisation; older files keep working with flags."""

from __future__ import annotations

import json
import re
import zipfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from hetconv.cli import main
from hetconv.data import DEFAULT_HOLDOUT_FRACTION, ImageDataset, channel_stats
from hetconv.description import FLOAT32, UINT8, Description, read_description
from hetconv.model import Model, load_spec
from hetconv.training.checkpoint import read_model
from hetconv.training.config import TrainConfig
from hetconv.training.datasets import load_datasets

onnx = pytest.importorskip("onnx", reason="the onnx extra builds the graph; install the dev extra")
ort = pytest.importorskip("onnxruntime", reason="onnxruntime runs the graph; install the dev extra")

#: A network of the user's own, as a .json file that is deleted once trained: what is needed
#: afterwards must come from the weights.
SPEC = [
    {"type": "conv", "name": "conv1", "out": 6, "kernel": 3, "padding": 1},
    {"type": "batchnorm", "name": "bn1"},
    {"type": "relu"},
    {"type": "maxpool", "kernel": 2, "stride": 2},
    {"type": "fc", "name": "fc", "out": 3},
]
SHAPE = (3, 10, 12)


def _images(n: int = 80) -> tuple[np.ndarray, np.ndarray]:
    """uint8 pixels whose brightest channel is the class (learnable in a few steps), with
    per-channel means far from CIFAR's, so a wrong normalisation shows."""
    rng = np.random.default_rng(7)
    y = np.arange(n, dtype=np.int64) % 3
    x = rng.integers(0, 90, (n, *SHAPE)).astype(np.uint8)
    x[np.arange(n), y] += 160
    return x, y


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> SimpleNamespace:
    """A --local run on an .npz of x and y (10 % held out), its .json spec deleted after."""
    where = tmp_path_factory.mktemp("describing")
    x, y = _images()
    np.savez(where / "data.npz", x=x, y=y)
    (where / "net.json").write_text(json.dumps(SPEC))
    argv = ["train", "--local", "--model", str(where / "net.json"), "--data-dir"]
    argv += [str(where / "data.npz"), "--steps", "3", "--batch", "8", "--no-progress"]
    assert main([*argv, "--run-dir", str(where / "runs"), "--name", "r"]) == 0
    (where / "net.json").unlink()
    return SimpleNamespace(folder=where / "runs" / "r", where=where, data=where / "data.npz")


def _held_out(data_path: Path) -> ImageDataset:
    config = TrainConfig(dataset="npz", data_dir=str(data_path), progress=False)
    return load_datasets(config).held_out


def _session(path: Path):
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def _logits(path: Path, x: np.ndarray) -> np.ndarray:
    return _session(path).run(["logits"], {"input": np.asarray(x, np.float32)})[0]


def test_model_npz_and_checkpoints_record_spec_input_classes_and_normalisation(run):
    described = read_description(run.folder / "model.npz")
    assert described is not None
    assert list(described.spec) == SPEC and described.network.endswith("net.json")
    assert described.input_shape == SHAPE and described.classes == 3
    assert described.raw == UINT8 and described.scale == 1 / 255
    x, _ = _images()
    n_held = int(np.ceil(DEFAULT_HOLDOUT_FRACTION * len(x)))
    held = _held_out(run.data)
    assert len(held) == n_held and described.mean == held.mean and described.std == held.std
    assert described.mean != pytest.approx(channel_stats(x)[0])  # the training part's, not all
    # np.load lists only the weights (they load into PyTorch as they are), without pickle
    with np.load(run.folder / "model.npz", allow_pickle=False) as archive:
        assert sorted(archive.files) == sorted(Model(SPEC, SHAPE).state())
    document = json.loads(zipfile.ZipFile(run.folder / "model.npz").comment)
    assert document["spec"] == SPEC and document["normalisation"]["raw"] == "uint8 0..255"
    _, in_checkpoint, what = read_model(run.folder / "checkpoints")
    assert in_checkpoint == described and "step 3" in what


def test_the_description_takes_the_datas_class_names_and_float_values():
    values = np.random.default_rng(3).standard_normal((4, 1, 2, 2)).astype(np.float32)
    train = ImageDataset(values, np.zeros(4, np.int64), 2, mean=(0.5,), std=(2.0,))
    data = SimpleNamespace(train=train, class_names=("cat", "dog"))
    described = Description.of("tiny", [{"type": "fc", "out": 2}], data)
    assert described.class_names == ("cat", "dog") and described.raw == FLOAT32
    assert described.scale == 1.0 and described.formula() == "(value - mean[c]) / std[c]"
    assert Description.from_json(json.loads(json.dumps(described.as_json()))) == described
    np.testing.assert_array_equal(described.normalise(values), train.batch(np.arange(4))[0])
    # numpy numbers and tuples in a spec (an imported graph's) are written as JSON values
    spec = [{"type": "conv", "out": np.int64(3), "padding": (1, np.int32(1))}]
    described = Description.of("net.onnx", spec, data)
    assert described.spec == ({"type": "conv", "out": 3, "padding": [1, 1]},)


@pytest.mark.parametrize("which", ["", "model.npz", "checkpoints", "checkpoints/ckpt-00000003.npz"])
def test_export_needs_nothing_but_the_run_folder_or_a_file_in_it(run, tmp_path, capsys, which):
    out = tmp_path / "m.onnx"
    assert main(["export", str(run.folder / which), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out}" in printed and "(pixel / 255 - mean[c]) / std[c]" in printed
    proto = onnx.load(str(out))
    props = {p.key: p.value for p in proto.metadata_props}
    described = read_description(run.folder / "model.npz")
    assert json.loads(props["mean"]) == list(described.mean)
    assert json.loads(props["std"]) == list(described.std)
    assert float(props["pixel_scale"]) == 1 / 255 and props["raw"] == UINT8
    assert json.loads(props["input_shape"]) == list(SHAPE) and props["classes"] == "3"
    assert props["input"] == "normalised" and "pixel / 255" in props["normalisation"]
    x = np.random.default_rng(2).standard_normal((2, *SHAPE), dtype=np.float32)
    model = Model(SPEC, SHAPE)
    model.load(run.folder / "model.npz")
    with model.evaluating():
        np.testing.assert_allclose(_logits(out, x), model.forward(x), rtol=1e-4, atol=1e-5)


def test_the_normalising_graph_takes_raw_pixels_and_gives_the_plain_graphs_logits(run, tmp_path):
    plain, raw = tmp_path / "plain.onnx", tmp_path / "raw.onnx"
    assert main(["export", str(run.folder), "-o", str(plain)]) == 0
    argv = ["export", str(run.folder), "--include-normalisation", "-o", str(raw)]
    assert main(argv) == 0
    proto = onnx.load(str(raw))
    assert [n.op_type for n in proto.graph.node][:3] == ["Div", "Sub", "Div"]
    assert {p.key: p.value for p in proto.metadata_props}["input"].startswith("raw: pixels 0..255")
    held = _held_out(run.data)
    normalised, _ = held.batch(np.arange(len(held)))
    pixels = held.images.astype(np.float32)
    np.testing.assert_allclose(_logits(raw, pixels), _logits(plain, normalised), rtol=1e-5,
                               atol=1e-5)  # fmt: skip


def test_the_exported_graphs_accuracy_on_raw_pixels_is_evaluates(run, tmp_path, capsys):
    assert main(["evaluate", str(run.folder)]) == 0
    printed = capsys.readouterr().out
    accuracy = re.search(r"accuracy ([\d.]+)% on (\d+) images", printed)
    assert accuracy, printed
    out = tmp_path / "raw.onnx"
    assert main(["export", str(run.folder / "model.npz"), "--include-normalisation", "-o",
                 str(out)]) == 0  # fmt: skip
    held = _held_out(run.data)
    assert int(accuracy.group(2)) == len(held)
    predicted = _logits(out, held.images.astype(np.float32)).argmax(axis=1)
    assert f"{100 * np.mean(predicted == held.labels):.2f}" == accuracy.group(1)


def test_evaluate_and_export_of_a_saved_file_need_no_model_flag(run, tmp_path, capsys):
    """Outside its run folder, with its .json spec gone: the file alone says the network."""
    alone = tmp_path / "weights.npz"
    alone.write_bytes((run.folder / "model.npz").read_bytes())
    assert main(["evaluate", str(alone), "--data-dir", str(run.data)]) == 0
    assert re.search(
        r"model .*weights.npz: held-out loss [\d.]+, accuracy", capsys.readouterr().out
    )
    assert main(["export", str(alone), "-o", str(tmp_path / "m.onnx")]) == 0


def _old_weights(tmp_path: Path) -> Path:
    """Weights as written before they described themselves (Model.save without one)."""
    path = tmp_path / "old.npz"
    Model(load_spec("tiny", classes=4), (3, 16, 16), seed=1).save(path)
    assert read_description(path) is None
    return path


@pytest.mark.parametrize(
    "extra, message",
    [
        ([], "does not record its network (written before weight files described themselves): "
             "give --model NETWORK"),
        (["--model", "tiny", "--classes", "4"], "--input-shape C,H,W is required"),
        (["--model", "tiny", "--classes", "4", "--input-shape", "3,16,16",
          "--include-normalisation"], "--include-normalisation: model"),
    ],
)  # fmt: skip
def test_older_weights_need_the_flags_and_name_the_missing_one(tmp_path, capsys, extra, message):
    old = _old_weights(tmp_path)
    assert main(["export", str(old), *extra, "-o", str(tmp_path / "x.onnx")]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "x.onnx").exists()


def test_older_weights_export_with_the_flags(tmp_path, capsys):
    old = _old_weights(tmp_path)
    argv = ["export", str(old), "--preset", "tiny", "--classes", "4", "--input-shape", "3,16,16"]
    assert main([*argv, "-o", str(tmp_path / "x.onnx")]) == 0
    assert "the weights do not record how" in capsys.readouterr().out
    assert not onnx.load(str(tmp_path / "x.onnx")).metadata_props


def test_a_damaged_description_is_named(tmp_path, capsys):
    path = _old_weights(tmp_path)
    with zipfile.ZipFile(path, "a") as archive:
        archive.comment = json.dumps({"format": "hetconv-model", "version": 1}).encode()
    assert main(["export", str(path), "-o", str(tmp_path / "x.onnx")]) == 2
    err = capsys.readouterr().err
    assert f"{path} holds a damaged description" in err and len(err.strip().splitlines()) == 1
