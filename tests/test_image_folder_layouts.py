"""Image folders as torchvision users lay them out: an ImageFolder root (ROOT/<class>/<image>)
and a folder with train/ alone train with --data-dir alone, a fixed 10 % held out; what is
neither is refused naming what was found; a run refused before its first step leaves no run
folder, so the same --name can be tried again."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from hetconv.cli import main
from hetconv.data import DEFAULT_HOLDOUT_FRACTION, DatasetError, infer_dataset, load_dataset

CLASSES = ("circle", "square", "triangle")  # written out of order below: sorted on reading
PER_CLASS = 10
SIZE = 8


def write_classes(folder: Path, per_class: int = PER_CLASS) -> None:
    """folder/<class>/<i>.png; pixel (0, 0) tells the image apart (its green value is the
    image's number, its red value its class)."""
    for label, name in reversed(list(enumerate(CLASSES))):
        (folder / name).mkdir(parents=True)
        for i in range(per_class):
            rgb = np.random.default_rng([label, i]).integers(0, 256, (SIZE, SIZE, 3), np.uint8)
            rgb[0, 0, :2] = (label, label * per_class + i)
            Image.fromarray(rgb).save(folder / name / f"{i}.png")


def _ids(images: np.ndarray) -> list[int]:
    return images[:, 1, 0, 0].astype(int).tolist()


@pytest.mark.parametrize("layout", ["root", "train-only"])
@pytest.mark.parametrize("kind", ["auto", "folder"])
def test_an_image_folder_without_held_out_images_holds_out_a_fixed_tenth(tmp_path, layout, kind):
    root = tmp_path / "shapes"
    write_classes(root if layout == "root" else root / "train")
    assert infer_dataset(root) == "folder"
    loaded = load_dataset(kind, root)
    train, held = loaded.train, loaded.held_out
    assert loaded.kind == "folder" and loaded.class_names == CLASSES
    assert (len(train), len(held), train.num_classes) == (27, 3, 3)
    assert DEFAULT_HOLDOUT_FRACTION == 0.1
    where = "shapes/" if layout == "root" else "train/"
    assert loaded.held_out_from == f"10% of {where} (a fixed random choice; --holdout-fraction)"
    # Disjoint, nothing lost; each label is the class its folder names.
    assert sorted(_ids(train.images) + _ids(held.images)) == list(range(30))
    for part in (train, held):
        np.testing.assert_array_equal(part.labels, part.images[:, 0, 0, 0])
    # The same images are held out every time; --holdout-fraction changes how many.
    assert _ids(load_dataset(kind, root).held_out.images) == _ids(held.images)
    other = load_dataset(kind, root, holdout_fraction=0.2)
    assert (len(other.train), len(other.held_out)) == (24, 6)
    assert other.held_out_from.startswith(f"20% of {where}")


def test_the_same_images_are_held_out_in_either_layout(tmp_path):
    write_classes(tmp_path / "root")
    write_classes(tmp_path / "split" / "train")
    (tmp_path / "root" / ".ipynb_checkpoints").mkdir()  # hidden: not a class
    (tmp_path / "root" / "README.txt").write_text("a file beside the classes: ignored")
    a, b = load_dataset("auto", tmp_path / "root"), load_dataset("auto", tmp_path / "split")
    assert _ids(a.held_out.images) == _ids(b.held_out.images)
    assert a.class_names == b.class_names == CLASSES


def test_a_folder_with_its_own_held_out_images_keeps_them_and_names_the_classes(tmp_path):
    write_classes(tmp_path / "d" / "train")
    write_classes(tmp_path / "d" / "val", per_class=2)
    loaded = load_dataset("auto", tmp_path / "d")
    assert loaded.held_out_from == "val/" and loaded.class_names == CLASSES
    assert (len(loaded.train), len(loaded.held_out)) == (30, 6)
    with pytest.raises(DatasetError, match="own val/ folder: drop --holdout-fraction"):
        load_dataset("folder", tmp_path / "d", holdout_fraction=0.2)


def _empty(root: Path) -> None:
    root.mkdir()


def _held_out_only(root: Path) -> None:
    write_classes(root / "val")


def _loose_images(root: Path) -> None:
    root.mkdir()
    Image.fromarray(np.zeros((SIZE, SIZE, 3), np.uint8)).save(root / "1.png")


def _no_images(root: Path) -> None:
    for name in CLASSES:
        (root / name).mkdir(parents=True)
        (root / name / "notes.txt").write_text("not an image")


@pytest.mark.parametrize(
    ("make", "kind", "message"),
    [
        (_empty, "auto", "cannot tell which dataset {root} holds (it holds nothing)"),
        (_empty, "folder", "{root} holds no class folders; expected one folder of images per"),
        (_held_out_only, "auto", "{root} has val/ but no train/ folder; --data-dir takes"),
        (_held_out_only, "folder", "{root} has val/ but no train/ folder; expected one folder"),
        (_loose_images, "auto", "cannot tell which dataset {root} holds (it holds 1.png)"),
        (_loose_images, "folder", "{root} holds no class folders; expected one folder"),
        (_no_images, "auto", "(it holds circle/, square/, triangle/)"),
        (_no_images, "folder", "class folder {root}/circle holds no images (expected files"),
    ],
)
def test_what_is_no_image_folder_is_refused_naming_what_was_found(tmp_path, make, kind, message):
    root = tmp_path / "d"
    make(root)
    with pytest.raises(DatasetError) as info:
        load_dataset(kind, root)
    assert message.format(root=root) in str(info.value)
    assert "\n" not in str(info.value)
    if kind == "auto":  # and says what it looked for
        assert "ROOT/<class>/<image> (torchvision's ImageFolder)" in str(info.value)


def test_an_npz_may_name_its_classes(tmp_path):
    x = np.zeros((10, 3, 6, 6), np.uint8)
    np.savez(tmp_path / "d.npz", x=x, y=np.arange(10) % 2, class_names=["cat", "dog", "emu"])
    loaded = load_dataset("auto", tmp_path / "d.npz")
    assert loaded.class_names == ("cat", "dog", "emu") and loaded.train.num_classes == 3
    np.savez(tmp_path / "e.npz", x=x, y=np.arange(10) % 4, class_names=["cat", "dog"])
    with pytest.raises(DatasetError, match="label 3 but 2 class_names; expected one name per"):
        load_dataset("auto", tmp_path / "e.npz")
    np.savez(tmp_path / "f.npz", x=x, y=np.arange(10) % 2)
    assert load_dataset("auto", tmp_path / "f.npz").class_names is None


# ---------------------------------------------------------------------------- hetconv train

TRAIN = ["train", "--local", "--no-progress", "--steps", "2", "--batch", "4"]


@pytest.mark.parametrize("dataset", [[], ["--dataset", "folder"]], ids=["inferred", "named"])
def test_hetconv_train_takes_an_image_folder_root_alone(tmp_path, capsys, dataset):
    write_classes(tmp_path / "shapes")
    argv = [*TRAIN, "--data-dir", str(tmp_path / "shapes"), *dataset, "--no-run-dir"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert f"of 3x{SIZE}x{SIZE}, 3 classes; 3 held out: 10% of shapes/ (a fixed" in err
    assert ("folder inferred from the path" in err) == (not dataset)
    assert "held-out accuracy" in err and "on 3 images" in err


def test_a_run_refused_before_its_first_step_leaves_no_folder_and_its_name_is_free(
    tmp_path, capsys
):
    data, runs = tmp_path / "shapes", tmp_path / "runs"
    data.mkdir()  # nothing in it yet
    bad_net = tmp_path / "bad.json"
    bad_net.write_text(json.dumps([{"type": "conv", "out": 4, "kernel": 3}, {"type": "bogus"}]))
    argv = [*TRAIN, "--data-dir", str(data), "--run-dir", str(runs), "--name", "shapes1"]
    for extra, message in [
        ([], "cannot tell which dataset"),  # refused while writing the run's config
        (["--dataset", "folder"], "holds no class folders"),  # refused while loading the data
    ]:
        assert main([*argv, *extra]) == 2
        assert message in capsys.readouterr().err
        assert not (runs / "shapes1").exists()
    write_classes(data / "train")
    assert main([*argv, "--preset", str(bad_net)]) == 2
    assert "layer 1 has type 'bogus'" in capsys.readouterr().err
    assert not (runs / "shapes1").exists()
    assert main(argv) == 0  # the same --name, once the data is right
    assert "10% of train/" in capsys.readouterr().err
    assert (runs / "shapes1" / "model.npz").is_file()


def test_a_refusal_with_local_worker_processes_leaves_no_folder_either(tmp_path, capsys):
    """The embedded default (local worker processes) refuses the data as --local does."""
    (tmp_path / "d" / "val" / "a").mkdir(parents=True)
    argv = ["train", "--no-progress", "--steps", "1", "--batch", "2", "--local-workers", "1"]
    argv += ["--data-dir", str(tmp_path / "d"), "--dataset", "folder"]
    argv += ["--run-dir", str(tmp_path / "runs"), "--name", "r"]
    assert main(argv) == 2
    assert "has val/ but no train/ folder" in capsys.readouterr().err
    assert not (tmp_path / "runs" / "r").exists()
