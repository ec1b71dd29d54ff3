"""Your own data: image folders, .npz arrays, what a --data-dir holds, and training on them.

Every format is written as a real file in a temporary folder: PNG and JPEG images with Pillow,
.npz archives with numpy. CIFAR's official files are tested in test_data.py.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from hetconv.cli import main
from hetconv.conv import LocalConv
from hetconv.data import (
    DatasetError,
    ImageDataset,
    channel_stats,
    infer_dataset,
    load_dataset,
    load_image_folder,
    load_npz,
)
from hetconv.training import TrainConfig, train

# A network for 3x20x24 images and 4 classes (a spec file's last fc says its outputs; a
# preset's follows the dataset).
SMALL_NET = [
    {"type": "conv", "name": "conv1", "out": 4, "kernel": 3, "padding": "same"},
    {"type": "relu"},
    {"type": "maxpool", "kernel": 2, "stride": 2},
    {"type": "conv", "name": "conv2", "out": 6, "kernel": 3, "padding": 1},
    {"type": "relu"},
    {"type": "maxpool", "kernel": 2, "stride": 2},
    {"type": "fc", "name": "fc", "out": 4},
]
CLASSES = ["ant", "bee", "cat", "dog"]  # written out of order below: sorted by name on reading
H, W = 20, 24


def _pixels(label: int, seed: int, size: tuple[int, int] = (H, W)) -> np.ndarray:
    """uint8 (h, w, 3): noise whose red plane tells the class."""
    rng = np.random.default_rng(seed)
    rgb = rng.integers(0, 256, (*size, 3), dtype=np.uint8)
    rgb[..., 0] = 40 + 60 * label
    return rgb


def write_folder(root: Path, per_class: int = 3, held: str = "val") -> dict[str, list]:
    """root/train/<class>/*.png and root/<held>/<class>/*.png; returns {split: [(hwc, label)]}."""
    written: dict[str, list] = {"train": [], held: []}
    for split, count in (("train", per_class), (held, 2)):
        for label, name in reversed(list(enumerate(CLASSES))):
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in range(count):
                rgb = _pixels(label, hash((split, name, i)) % 2**32)
                Image.fromarray(rgb).save(folder / f"{i:03d}.png")
                written[split].append((rgb, label))
    return written


def write_net(tmp_path: Path, spec: list[dict] = SMALL_NET) -> Path:
    path = tmp_path / "net.json"
    path.write_text(json.dumps(spec))
    return path


# ---------------------------------------------------------------------------- image folders


def test_image_folder_classes_sorted_pixels_exact_normalised_by_train(tmp_path: Path) -> None:
    written = write_folder(tmp_path / "pets")
    loaded = load_dataset("auto", tmp_path / "pets")
    train, held = loaded.train, loaded.held_out
    assert loaded.kind == "folder" and loaded.held_out_from == "val/"
    assert (len(train), len(held), train.num_classes) == (12, 8, 4)
    assert train.image_shape == held.image_shape == (3, H, W)
    assert train.images.dtype == np.uint8
    # Classes numbered by sorted name, files sorted within a class: ant 0..2, bee 0..2, ...
    np.testing.assert_array_equal(train.labels, np.repeat(np.arange(4), 3))
    expected = sorted(written["train"], key=lambda pair: pair[1])
    for image, (rgb, _) in zip(train.images, expected, strict=True):
        np.testing.assert_array_equal(image, rgb.transpose(2, 0, 1))  # PNG is lossless
    # Normalised by the training set's per-channel statistics, computed here independently.
    pixels = train.images.astype(np.float64) / 255
    mean, std = pixels.mean(axis=(0, 2, 3)), pixels.std(axis=(0, 2, 3))
    np.testing.assert_allclose(train.mean, mean, rtol=1e-12)
    np.testing.assert_allclose(train.std, std, rtol=1e-9)
    assert held.mean == train.mean and held.std == train.std
    x, _ = held.batch(np.arange(len(held)))
    expected_x = (held.images / 255 - mean[None, :, None, None]) / std[None, :, None, None]
    np.testing.assert_allclose(x, expected_x, atol=1e-5)


def test_image_folder_converts_grey_palette_and_jpeg_to_rgb(tmp_path: Path) -> None:
    root = tmp_path / "mixed"
    for folder in ("train/a", "train/b", "test/b"):  # test/ lacks class a
        (root / folder).mkdir(parents=True)
    grey = np.arange(H * W, dtype=np.uint8).reshape(H, W)
    Image.fromarray(grey, "L").save(root / "train" / "a" / "grey.png")
    Image.fromarray(_pixels(0, 1)).convert("P").save(root / "train" / "a" / "palette.PNG")
    Image.fromarray(_pixels(1, 2)).save(root / "train" / "b" / "photo.jpg", quality=95)
    Image.fromarray(_pixels(1, 3)).save(root / "test" / "b" / "x.png")
    (root / "train" / "b" / "notes.txt").write_text("not an image: skipped")
    (root / "train" / ".ipynb_checkpoints").mkdir()  # hidden: not a class
    loaded = load_image_folder(root)
    assert loaded.held_out_from == "test/"
    assert loaded.train.images.shape == (3, 3, H, W)
    for c in range(3):  # grey becomes R = G = B
        np.testing.assert_array_equal(loaded.train.images[0, c], grey)
    assert loaded.held_out.labels.tolist() == [1]  # test/ lacks class a: indices are train's
    assert loaded.train.num_classes == 2


def test_val_is_held_out_and_test_left_alone_when_both_are_there(tmp_path: Path) -> None:
    write_folder(tmp_path / "d", held="val")
    (tmp_path / "d" / "test" / "emu").mkdir(parents=True)  # not read: it would be refused
    loaded = load_image_folder(tmp_path / "d")
    assert loaded.held_out_from == "val/" and len(loaded.held_out) == 8


def test_images_of_two_sizes_are_refused_naming_both(tmp_path: Path) -> None:
    write_folder(tmp_path / "d")
    odd = tmp_path / "d" / "val" / "cat" / "odd.png"
    Image.fromarray(_pixels(2, 9, size=(H, W + 1))).save(odd)
    with pytest.raises(DatasetError) as info:
        load_image_folder(tmp_path / "d")
    message = str(info.value)
    assert f"{tmp_path / 'd' / 'train' / 'ant' / '000.png'} is {W}x{H}" in message
    assert f"{odd} is {W + 1}x{H}" in message and "resize" in message


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda r: [p.unlink() for p in (r / "train" / "bee").iterdir()], "train/bee holds no"),
        (lambda r: (r / "val" / "emu").mkdir(), "val has class folder(s) emu that train/ lacks"),
        (lambda r: (r / "train" / "cat" / "000.png").write_bytes(b"nope"), "000.png: cannot"),
        (
            lambda r: (r / "train").rename(r / "training"),
            "has val/ but no train/ folder (beside other/, training/); expected one folder",
        ),
    ],
    ids=["empty-class", "unknown-class", "not-an-image", "no-train"],
)
def test_a_bad_image_folder_is_refused_naming_the_problem(tmp_path: Path, damage, message):
    root = tmp_path / "d"
    write_folder(root)
    (root / "other").mkdir()
    damage(root)
    with pytest.raises(DatasetError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_image_folder(root)


def test_a_folder_without_held_out_images_splits_train_with_holdout_fraction(tmp_path):
    root = tmp_path / "d"
    write_folder(root, per_class=5)
    for p in (root / "val").rglob("*.png"):
        p.unlink()
    for p in sorted((root / "val").iterdir()):
        p.rmdir()
    (root / "val").rmdir()
    loaded = load_image_folder(root, holdout_fraction=0.25)
    assert (len(loaded.train), len(loaded.held_out)) == (15, 5)
    assert "25% of train/" in loaded.held_out_from
    both = np.concatenate([loaded.train.images, loaded.held_out.images])
    assert len({image.tobytes() for image in both}) == 20  # disjoint, nothing lost


# ---------------------------------------------------------------------------- .npz


def test_npz_with_its_own_test_set_channels_last(tmp_path: Path, rng) -> None:
    x = rng.integers(0, 256, (10, H, W, 3), dtype=np.uint8)
    xt = rng.integers(0, 256, (4, H, W, 3), dtype=np.uint8)
    np.savez(tmp_path / "d.npz", x_train=x, y_train=np.arange(10) % 3, x_test=xt, y_test=[2] * 4)
    loaded = load_dataset("auto", tmp_path / "d.npz")
    assert loaded.kind == "npz" and loaded.held_out_from == "x_test, y_test"
    np.testing.assert_array_equal(loaded.train.images, x.transpose(0, 3, 1, 2))
    np.testing.assert_array_equal(loaded.held_out.images, xt.transpose(0, 3, 1, 2))
    assert loaded.train.image_shape == (3, H, W) and loaded.train.num_classes == 3
    assert loaded.held_out.mean == channel_stats(loaded.train.images)[0]


def test_npz_of_x_and_y_holds_out_a_fixed_tenth_by_default(tmp_path: Path, rng) -> None:
    x = rng.normal(5.0, 3.0, (100, 2, 9, 7))  # float64 channels first: kept as float32
    y = np.arange(100) % 5
    x[:, 0, 0, 0] = np.arange(100)  # tells the images apart
    np.savez(tmp_path / "d.npz", x=x, y=y)
    loaded = load_npz(tmp_path / "d.npz")
    train, held = loaded.train, loaded.held_out
    assert (len(train), len(held)) == (90, 10) and "10% of x, y" in loaded.held_out_from
    assert train.images.dtype == np.float32 and train.image_shape == (2, 9, 7)
    ids = np.concatenate([train.images[:, 0, 0, 0], held.images[:, 0, 0, 0]]).astype(int)
    assert sorted(ids) == list(range(100))
    assert np.all(np.diff(train.images[:, 0, 0, 0]) > 0)  # each part keeps the file's order
    np.testing.assert_array_equal(train.labels, train.images[:, 0, 0, 0].astype(int) % 5)
    again = load_npz(tmp_path / "d.npz")  # the same images held out every time
    np.testing.assert_array_equal(again.held_out.images, held.images)
    other = load_npz(tmp_path / "d.npz", holdout_fraction=0.3)
    assert (len(other.train), len(other.held_out)) == (70, 30)
    # Floats are normalised by the training set's statistics, in their own units.
    xb, _ = train.batch(np.arange(len(train)))
    np.testing.assert_allclose(xb.mean(axis=(0, 2, 3)), 0, atol=1e-4)
    np.testing.assert_allclose(xb.std(axis=(0, 2, 3)), 1, atol=1e-4)


def test_npz_grey_images_without_a_channel_axis(tmp_path: Path) -> None:
    np.savez(tmp_path / "g.npz", x=np.zeros((20, 12, 12), np.uint8), y=np.zeros(20, int))
    loaded = load_npz(tmp_path / "g.npz", holdout_fraction=0.5)
    assert loaded.train.image_shape == (1, 12, 12) and loaded.train.std == (1.0,)


@pytest.mark.parametrize(
    ("arrays", "message"),
    [
        (dict(images=np.zeros((4, 3, 8, 8)), labels=np.zeros(4)), "holds arrays images, labels"),
        (dict(x=np.zeros((4, 3, 8, 8)), y=[0, 1, -1, 2]), "holds label -1"),
        (dict(x=np.zeros((4, 3, 8, 8)), y=[0.5, 1, 1, 2]), "expected \\(N,\\) integer"),
        (dict(x=np.zeros((4, 3, 8, 8)), y=[0, 1, 1]), "4 images in x but 3 labels in y"),
        (dict(x=np.full((4, 3, 8, 8), 300), y=[0] * 4), "values 300..300"),
        (dict(x=np.zeros((4, 3, 8, 3)), y=[0] * 4), "cannot tell the channel axis"),
        (dict(x=np.zeros((4, 8)), y=[0] * 4), "has shape \\(4, 8\\)"),
        (dict(x=np.array([[[[np.nan]]]] * 4), y=[0] * 4), "NaN or infinite"),
        (dict(x=np.array([None] * 4), y=[0] * 4), "without unpickling"),
        (
            dict(
                x_train=np.zeros((4, 3, 8, 8)),
                y_train=[0] * 4,
                x_test=np.zeros((2, 3, 9, 8)),
                y_test=[0] * 2,
            ),
            "x_test images are float32 \\(3, 9, 8\\) but x_train's are float32 \\(3, 8, 8\\)",
        ),
    ],
    ids=[
        "keys",
        "negative",
        "float-labels",
        "counts",
        "range",
        "axis",
        "shape",
        "nan",
        "object",
        "test-shape",
    ],
)
def test_a_bad_npz_is_refused_naming_the_problem(tmp_path: Path, arrays, message) -> None:
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays)  # an object array is pickled into the file: never loaded back
    with pytest.raises(DatasetError, match=message) as info:
        load_npz(path)
    assert str(path) in str(info.value)


def test_holdout_fraction_is_refused_where_the_data_has_its_own(tmp_path: Path) -> None:
    z = np.zeros((4, 3, 8, 8), np.uint8)
    np.savez(tmp_path / "d.npz", x_train=z, y_train=[0] * 4, x_test=z, y_test=[0] * 4)
    with pytest.raises(DatasetError, match="own x_test and y_test: drop --holdout-fraction"):
        load_npz(tmp_path / "d.npz", holdout_fraction=0.2)
    write_folder(tmp_path / "f")
    with pytest.raises(DatasetError, match="own val/ folder: drop --holdout-fraction"):
        load_image_folder(tmp_path / "f", holdout_fraction=0.2)


# ---------------------------------------------------------------------------- what a path holds


def test_inference_refuses_what_it_does_not_know_naming_what_it_looked_for(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    Image.fromarray(_pixels(0, 0)).save(tmp_path / "one.png")
    with open(tmp_path / "arrays.zip", "wb") as f:  # an .npz archive by another name
        np.savez(f, x=np.zeros(3))
    (tmp_path / "nested").mkdir()
    for path, found in [
        (tmp_path / "notes.txt", "is a file but neither"),
        (tmp_path / "one.png", "is a file but neither"),
        (tmp_path / "arrays.zip", "is a file but neither"),
        (tmp_path / "missing", "does not exist"),
        (tmp_path / "nested", "holds nothing"),
        (tmp_path, "holds arrays.zip, nested/, notes.txt, one.png"),
    ]:
        with pytest.raises(DatasetError) as info:
            infer_dataset(path)
        message = str(info.value)
        assert str(path) in message and found in message
        assert "cifar-10-python.tar.gz" in message and "ROOT/<class>/<image>" in message


def test_a_tar_of_something_else_is_refused(tmp_path: Path) -> None:
    import tarfile

    (tmp_path / "photos").mkdir()
    (tmp_path / "photos" / "a.txt").write_text("x")
    with tarfile.open(tmp_path / "photos.tar.gz", "w:gz") as tar:
        tar.add(tmp_path / "photos", arcname="photos")
    with pytest.raises(DatasetError, match="first member is 'photos', not cifar-10-batches-py/"):
        infer_dataset(tmp_path / "photos.tar.gz")
    with pytest.raises(DatasetError, match="no member cifar-10-batches-py/data_batch_1"):
        load_dataset("cifar10", tmp_path / "photos.tar.gz")


def test_a_dataset_named_outright_must_match_the_path(tmp_path: Path) -> None:
    write_folder(tmp_path / "f")
    with pytest.raises(DatasetError, match="npz file .* is not a file"):
        load_dataset("npz", tmp_path / "f")
    with pytest.raises(DatasetError, match="CIFAR-10 files missing from .*data_batch_1"):
        load_dataset("cifar10", tmp_path / "f")
    with pytest.raises(DatasetError, match="image folder .* is not a directory"):
        load_dataset("folder", tmp_path / "f" / "train" / "ant" / "000.png")


def test_float_images_and_channel_stats() -> None:
    images = np.stack([np.full((1, 2, 2), v, np.float32) for v in (1.0, 3.0)])
    mean, std = channel_stats(images)
    assert mean == (2.0,) and std == (1.0,)
    ds = ImageDataset(images, np.array([0, 1]), 2, "f", mean, std)
    x, _ = ds.batch(np.array([0, 1]))
    np.testing.assert_array_equal(x[:, 0, 0, 0], [-1.0, 1.0])
    flat = channel_stats(np.full((3, 2, 4, 4), 7, np.uint8))  # constant: shifted, not scaled
    assert flat == ((7 / 255, 7 / 255), (1.0, 1.0))


# ---------------------------------------------------------------------------- training on it


def _trace(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("kind", ["folder", "npz"])
def test_hetconv_train_on_your_own_data_of_another_size(tmp_path: Path, kind: str, capsys):
    if kind == "folder":
        write_folder(tmp_path / "data", per_class=4)
        data = tmp_path / "data"
    else:
        rng = np.random.default_rng(1)
        labels = np.arange(40) % 4
        images = np.stack(
            [_pixels(int(k), int(s)) for k, s in zip(labels, rng.integers(0, 99, 40), strict=True)]
        )
        data = tmp_path / "d.npz"
        np.savez(data, x=images, y=labels)
    trace = tmp_path / "t.jsonl"
    argv = ["train", "--local", "--no-progress", "--data-dir", str(data), "--steps", "5"]
    argv += ["--batch", "4", "--eval-every", "2", "--preset", str(write_net(tmp_path))]
    assert main([*argv, "--trace", str(trace)]) == 0
    err = capsys.readouterr().err
    assert f"on {data} (" in err and f"of 3x{H}x{W}, 4 classes" in err
    assert f"{kind} inferred from the path" in err
    records = _trace(trace)
    assert [r["step"] for r in records if "step" in r] == [0, 1, 2, 3, 4]
    evals = [r for r in records if r.get("event") == "eval"]
    held = 8 if kind == "folder" else 4
    # Every 2 steps, at each epoch's end (16 or 36 training images: 4 or 9 steps), at the end.
    assert [r["trained_steps"] for r in evals] == [2, 4, 5]
    assert [r["final"] for r in evals] == [False, False, True]
    assert all(r["images"] == held and 0 <= r["accuracy"] <= 1 for r in evals)
    assert err.count("eval after step") == 2
    assert f"held-out accuracy {100 * evals[-1]['accuracy']:.1f}% on {held} images" in err


def test_evaluating_changes_nothing_trained_and_covers_every_epoch(tmp_path: Path) -> None:
    run = dict(steps=9, batch=8, train_size=32, eval_size=24, progress=False)  # 4 steps/epoch
    plain = train(TrainConfig(**run), log=io.StringIO())
    trace = tmp_path / "t.jsonl"
    log = io.StringIO()
    evaluated = train(TrainConfig(**run, eval_every=3, trace=str(trace)), log=log)
    assert evaluated.losses == plain.losses
    assert evaluated.eval_accuracy == plain.eval_accuracy
    evals = [r for r in _trace(trace) if r.get("event") == "eval"]
    assert [r["trained_steps"] for r in evals] == [3, 4, 6, 8, 9]
    assert [r["epoch"] for r in evals] == [0.75, 1.0, 1.5, 2.0, 2.25]
    assert evals[-1]["accuracy"] == evaluated.eval_accuracy
    assert evals[-1]["loss"] == evaluated.eval_loss
    assert "eval after step 4 (epoch 1.00): held-out loss" in log.getvalue()
    # No evaluation at all with eval_size 0.
    train(TrainConfig(**dict(run, eval_size=0), eval_every=3, trace=str(trace)), log=log)
    assert not [r for r in _trace(trace) if r.get("event") == "eval"]


def test_the_whole_held_out_set_is_evaluated_by_default(tmp_path: Path) -> None:
    write_folder(tmp_path / "d", per_class=2)
    config = TrainConfig(
        preset=str(write_net(tmp_path)),
        dataset="folder",
        data_dir=str(tmp_path / "d"),
        steps=1,
        batch=4,
        progress=False,
    )
    log = io.StringIO()
    train(config, log=log)
    assert "on 8 images (chance 25%)" in log.getvalue()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--dataset", "synthetic", "--data-dir", "{d}"], "synthetic dataset reads no files"),
        (["--dataset", "npz"], "the npz dataset needs --data-dir"),
        (["--data-dir", "{d}/train/ant/000.png"], "000.png is a file but neither"),
        (["--data-dir", "{d}/train/ant"], "cannot tell which dataset"),  # no class folders
        (
            ["--data-dir", "{d}", "--preset", "{d}-10.json"],
            "-10.json gives 10 outputs from its last layer (fc), but "
            'the dataset has 4 classes: give a .json spec whose last fc has "out": 4',
        ),
        (["--holdout-fraction", "0.2"], "--holdout-fraction needs --data-dir"),
        (["--data-dir", "{d}", "--holdout-fraction", "1.5"], "between 0 and 1, got 1.5"),
        (["--data-dir", "{d}", "--train-size", "3"], "--train-size sizes the synthetic set"),
    ],
    ids=[
        "synthetic-dir",
        "no-dir",
        "png-file",
        "image-dir",
        "classes",
        "no-data",
        "fraction",
        "train-size",
    ],
)
def test_cli_data_mistakes_are_one_line(tmp_path: Path, capsys, argv, message) -> None:
    write_folder(tmp_path / "d", per_class=1)
    (tmp_path / "d-10.json").write_text(
        json.dumps(SMALL_NET[:-1] + [{"type": "fc", "name": "fc", "out": 10}])
    )
    argv = [a.replace("{d}", str(tmp_path / "d")) for a in argv]
    assert main(["train", "--local", "--no-progress", "--steps", "1", "--batch", "2", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err
    assert len(err.splitlines()) == 1 and "Traceback" not in err


def test_a_network_too_deep_for_the_images_is_refused_naming_their_shape(tmp_path, capsys):
    np.savez(tmp_path / "d.npz", x=np.zeros((20, 3, 3, 5), np.uint8), y=np.arange(20) % 10)
    argv = ["train", "--local", "--no-progress", "--steps", "1", "--batch", "2"]
    assert main([*argv, "--data-dir", str(tmp_path / "d.npz"), "--preset", "tiny"]) == 2
    err = capsys.readouterr().err
    assert "network tiny cannot take the dataset's 3x3x5 images: layer" in err


def test_hetconv_train_reads_the_cifar_tarball_it_is_pointed_at(tmp_path: Path) -> None:
    import pickle
    import tarfile

    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {
            b"batch_label": name.encode(),
            b"labels": rng.integers(0, 10, 8).tolist(),
            b"data": rng.integers(0, 256, (8, 3072), dtype=np.uint8),
            b"filenames": [f"{i}.png".encode() for i in range(8)],
        }
        (folder / name).write_bytes(pickle.dumps(batch, protocol=2))
    tarball = tmp_path / "cifar-10-python.tar.gz"
    with tarfile.open(tarball, "w:gz") as tar:
        tar.add(folder, arcname=folder.name)
    done = subprocess.run(
        [sys.executable, "-m", "hetconv", "train", "--local", "--no-progress", "--steps", "2"]
        + ["--batch", "4", "--data-dir", str(tarball)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert f"training tiny on {tarball} (40 images of 3x32x32, 10 classes; 8 held out" in (
        done.stderr
    )
    assert "cifar10 inferred from the path" in done.stderr
    assert "held-out accuracy" in done.stderr and "on 8 images" in done.stderr


def test_a_data_dir_of_no_known_kind_is_refused_before_workers_start(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("not data")
    assert main(["train", "--no-progress", "--data-dir", str(tmp_path / "notes.txt")]) == 2
    out, err = capsys.readouterr()
    assert "notes.txt is a file but neither" in err
    assert "local worker" not in out + err


def test_palette_fit_says_whether_every_channel_holds_at_most_256_values():
    rng = np.random.default_rng(0)
    labels = np.zeros(40, np.int64)
    pixels = rng.integers(0, 256, (40, 3, 8, 8)).astype(np.uint8)
    assert ImageDataset(pixels, labels).palette_fit()  # 8-bit pixels always fit
    levels = rng.standard_normal(256).astype(np.float32)
    few = levels[rng.integers(0, 256, (40, 2, 8, 8))]
    stats = dict(mean=(0.0, 0.0), std=(1.0, 1.0))
    assert ImageDataset(few, labels, **stats).palette_fit()  # 256 values in each channel
    many = few.copy()
    many[-1, 1, 0, 0] = 1e6  # a 257th value in one channel of the last image only
    assert not ImageDataset(many, labels, **stats).palette_fit()
    noise = rng.standard_normal((40, 2, 8, 8)).astype(np.float32)
    assert not ImageDataset(noise, labels, **stats).palette_fit()


@pytest.mark.parametrize("dtype, fit", [(np.uint8, True), (np.float32, False)])
def test_training_tells_the_executor_whether_its_images_fit_palette8(tmp_path, dtype, fit):
    rng = np.random.default_rng(1)
    x = rng.integers(0, 256, (24, 3, 32, 32)).astype(dtype)
    if dtype == np.float32:
        x += rng.uniform(0, 1, x.shape).astype(np.float32)  # floats of any value
    np.savez(tmp_path / "d.npz", x=x, y=np.arange(24) % 10)
    prepared = []

    class Recording(LocalConv):
        def prepare(self, layers, batch, log):
            prepared.extend(layers)

    config = TrainConfig(
        steps=1, batch=4, dataset="npz", data_dir=str(tmp_path / "d.npz"),
        holdout_fraction=0.25, eval_size=0, progress=False,
    )  # fmt: skip
    train(config, Recording())
    assert [spec.images_fit for spec in prepared] == [fit, fit]
