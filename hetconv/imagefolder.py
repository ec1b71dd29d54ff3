"""A folder of images with one subfolder per class (torchvision's ImageFolder layout), each
image decoded once with Pillow."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from hetconv.dataset import (
    DatasetError,
    ImageDataset,
    LoadedData,
    _holdout,
    _normalised,
    _placeholder_stats,
)

# torchvision's ImageFolder extensions (IMG_EXTENSIONS), matched case-insensitively.
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
HELD_OUT_FOLDERS = ("val", "test")


def load_image_folder(root: str | os.PathLike, holdout_fraction: float | None = None) -> LoadedData:
    """Read ``root/train/<class>/<image>`` and ``root/val/<class>/<image>`` (or ``test/``).

    Classes are the subfolders of ``train/`` sorted by name, numbered from 0 (torchvision's
    ImageFolder convention); images are files with one of :data:`IMAGE_SUFFIXES`, found at any
    depth below their class folder. Every image is decoded once (Pillow), converted to RGB and
    must have the size of the others. The held-out set is ``val/`` (or, without one, ``test/``);
    without either, ``holdout_fraction`` of ``train/`` is held out.
    """
    root = Path(root)
    if not root.is_dir():
        raise DatasetError(f"image folder {root} does not exist or is not a directory")
    train_dir = root / "train"
    if not train_dir.is_dir():
        raise DatasetError(
            f"{root} has no train/ folder; expected train/<class>/<image> and "
            "val/<class>/<image> (or test/)"
        )
    # With both, val/ is evaluated on while training and test/ is left alone for later.
    held_out_dirs = [root / h for h in HELD_OUT_FOLDERS if (root / h).is_dir()][:1]
    if not held_out_dirs and holdout_fraction is None:
        raise DatasetError(
            f"{root} has train/ but no val/ or test/ folder; add one, or give "
            "--holdout-fraction to hold out part of train/"
        )
    if held_out_dirs and holdout_fraction is not None:
        raise DatasetError(
            f"{root} has its own {held_out_dirs[0].name}/ folder: drop --holdout-fraction"
        )
    classes = _class_names(train_dir)
    if not classes:
        raise DatasetError(f"{train_dir} holds no class folders; expected train/<class>/<image>")
    train_files = _class_files(train_dir, classes, classes)
    if held_out_dirs:
        held_dir = held_out_dirs[0]
        held_classes = _class_names(held_dir)
        unknown = [c for c in held_classes if c not in classes]
        if unknown:
            raise DatasetError(
                f"{held_dir} has class folder(s) {', '.join(unknown)} that train/ lacks; "
                f"the classes are train/'s: {', '.join(classes)}"
            )
        held_files = _class_files(held_dir, held_classes, classes)
    else:
        held_files = []
    images = _decode_images([f for f, _ in train_files + held_files])
    labels = np.asarray([label for _, label in train_files + held_files], np.int64)
    n = len(train_files)
    whole = ImageDataset(
        images, labels, len(classes), f"{root.name}/train", *_placeholder_stats(images)
    )
    if held_out_dirs:
        train = whole.subset(np.arange(n), f"{root.name}/train")
        held_out = whole.subset(np.arange(n, len(whole)), f"{root.name}/{held_out_dirs[0].name}")
        source = f"{held_out_dirs[0].name}/"
    else:
        train, held_out = _holdout(whole, holdout_fraction, root)
        source = f"{holdout_fraction:.0%} of train/ (a fixed random choice; --holdout-fraction)"
    train, held_out = _normalised(train, held_out)
    return LoadedData("folder", train, held_out, source)


def _class_names(folder: Path) -> list[str]:
    """The class folders in ``folder``, sorted by name; hidden ones (``.ipynb_checkpoints``)
    are not classes."""
    return sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))


def _class_files(
    folder: Path, present: Sequence[str], classes: Sequence[str]
) -> list[tuple[Path, int]]:
    """(image file, class index) for every image below ``folder/<class>``, sorted."""
    files: list[tuple[Path, int]] = []
    for name in present:
        found = sorted(
            p
            for p in (folder / name).rglob("*")
            if p.suffix.lower() in IMAGE_SUFFIXES and not p.name.startswith(".") and p.is_file()
        )
        if not found:
            raise DatasetError(
                f"class folder {folder / name} holds no images "
                f"(expected files ending in {', '.join(IMAGE_SUFFIXES)})"
            )
        index = classes.index(name)
        files += [(p, index) for p in found]
    return files


def _decode_images(files: Sequence[Path]) -> np.ndarray:
    """Decode ``files`` to one uint8 (N, 3, H, W) array; every image must have one size."""
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError as e:  # Pillow is a dependency; a broken install still gets a message
        raise DatasetError("reading an image folder needs Pillow: pip install pillow") from e
    out: np.ndarray | None = None
    first: tuple[Path, tuple[int, int]] | None = None
    for i, path in enumerate(files):
        try:
            with Image.open(path) as img:
                rgb = np.asarray(img.convert("RGB"))
        except (UnidentifiedImageError, Image.DecompressionBombError, OSError, ValueError) as e:
            raise DatasetError(f"{path}: cannot decode the image ({e})") from e
        if first is None:
            first = (path, rgb.shape[:2])
            out = np.empty((len(files), 3, *rgb.shape[:2]), np.uint8)
        elif rgb.shape[:2] != first[1]:
            (h0, w0), (h, w) = first[1], rgb.shape[:2]
            raise DatasetError(
                f"images differ in size: {first[0]} is {w0}x{h0} but {path} is {w}x{h} "
                "(width x height); every image must have one size: resize them first"
            )
        out[i] = rgb.transpose(2, 0, 1)
    assert out is not None  # _class_files found at least one image
    return out
