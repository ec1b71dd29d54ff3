"""A folder of images with one subfolder per class (torchvision's ImageFolder layout), each
image decoded once with Pillow.

Two layouts: an ImageFolder root, ``ROOT/<class>/<image>`` (what
``torchvision.datasets.ImageFolder(ROOT)`` reads), and one split into ``ROOT/train/<class>/...``
and ``ROOT/val/<class>/...`` (or ``test/``; ``val/`` or ``test/`` may be missing). Data without a
held-out folder of its own has a fixed random fraction of its images held out."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from hetconv.dataset import (
    DEFAULT_HOLDOUT_FRACTION,
    DatasetError,
    ImageDataset,
    LoadedData,
    _holdout,
    _normalised,
    _placeholder_stats,
    byte_size,
    memory_budget,
)

# torchvision's ImageFolder extensions (IMG_EXTENSIONS), matched case-insensitively.
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
HELD_OUT_FOLDERS = ("val", "test")
EXPECTED_LAYOUT = (
    "one folder of images per class, ROOT/<class>/<image> (torchvision's ImageFolder), or "
    "ROOT/train/<class>/<image> with val/ (or test/) beside it or not"
)


def is_image_folder(root: str | os.PathLike) -> bool:
    """Whether ``root`` is laid out as an image folder: it holds ``train/``, or no ``val/`` or
    ``test/`` but class folders of which at least one holds an image (at any depth)."""
    root = Path(root)
    if not root.is_dir():
        return False
    if (root / "train").is_dir():
        return True
    if any((root / h).is_dir() for h in HELD_OUT_FOLDERS):
        return False
    return any(_holds_an_image(folder) for folder in _subfolders(root))


def load_image_folder(root: str | os.PathLike, holdout_fraction: float | None = None) -> LoadedData:
    """Read an image folder: ``root/<class>/<image>``, or ``root/train/<class>/<image>`` and
    ``root/val/<class>/<image>`` (or ``test/``).

    Classes are the class folders (of ``train/``, when there is one) sorted by name, numbered
    from 0 (torchvision's ImageFolder convention); images are files with one of
    :data:`IMAGE_SUFFIXES`, found at any depth below their class folder. Every image is decoded
    once (Pillow), converted to RGB and must have the size of the others. The held-out set is
    ``val/`` (or, without one, ``test/``); without either, ``holdout_fraction`` of the images
    (:data:`DEFAULT_HOLDOUT_FRACTION` by default: a fixed random choice) is held out.
    """
    root = Path(root)
    if not root.is_dir():
        raise DatasetError(f"image folder {root} does not exist or is not a directory")
    train_dir, held_dir = _layout(root)
    if held_dir is not None and holdout_fraction is not None:
        raise DatasetError(f"{root} has its own {held_dir.name}/ folder: drop --holdout-fraction")
    classes = _class_names(train_dir)
    if not classes:
        where = "ROOT/train/<class>/<image>" if train_dir != root else EXPECTED_LAYOUT
        raise DatasetError(f"{train_dir} holds no class folders; expected {where}")
    train_files = _class_files(train_dir, classes, classes)
    if held_dir is not None:
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
    train_name = f"{root.name}/train" if train_dir != root else root.name
    whole = ImageDataset(images, labels, len(classes), train_name, *_placeholder_stats(images))
    if held_dir is not None:
        train = whole.subset(np.arange(n), train_name)
        held_out = whole.subset(np.arange(n, len(whole)), f"{root.name}/{held_dir.name}")
        source = f"{held_dir.name}/"
    else:
        fraction = DEFAULT_HOLDOUT_FRACTION if holdout_fraction is None else holdout_fraction
        train, held_out = _holdout(whole, fraction, root)
        of = "train/" if train_dir != root else f"{root.name}/"
        source = f"{fraction:.0%} of {of} (a fixed random choice; --holdout-fraction)"
    train, held_out = _normalised(train, held_out)
    return LoadedData("folder", train, held_out, source, tuple(classes))


def _layout(root: Path) -> tuple[Path, Path | None]:
    """(the folder of the training classes, the held-out folder or None) of an image folder;
    refuses a held-out folder without ``train/``."""
    if (root / "train").is_dir():
        # With both, val/ is evaluated on while training and test/ is left alone for later.
        held = [root / h for h in HELD_OUT_FOLDERS if (root / h).is_dir()]
        return root / "train", (held[0] if held else None)
    held = [h for h in HELD_OUT_FOLDERS if (root / h).is_dir()]
    if held:
        others = [p.name + "/" for p in _subfolders(root) if p.name not in held]
        besides = f" (beside {', '.join(others[:8])})" if others else ""
        raise DatasetError(
            f"{root} has {' and '.join(h + '/' for h in held)} but no train/ folder{besides}; "
            f"expected {EXPECTED_LAYOUT}"
        )
    return root, None


def _subfolders(folder: Path) -> list[Path]:
    """The folders in ``folder``, sorted by name; hidden ones (``.ipynb_checkpoints``) are
    not classes."""
    return sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))


def _holds_an_image(folder: Path) -> bool:
    return any(_is_image(p) and p.is_file() for p in folder.rglob("*"))


def _is_image(path: Path) -> bool:
    return path.suffix.lower() in IMAGE_SUFFIXES and not path.name.startswith(".")


def _class_names(folder: Path) -> list[str]:
    """The class folders in ``folder``, sorted by name."""
    return [p.name for p in _subfolders(folder)]


def _class_files(
    folder: Path, present: Sequence[str], classes: Sequence[str]
) -> list[tuple[Path, int]]:
    """(image file, class index) for every image below ``folder/<class>``, sorted."""
    files: list[tuple[Path, int]] = []
    for name in present:
        found = sorted(p for p in (folder / name).rglob("*") if _is_image(p) and p.is_file())
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
            with Image.open(path) as img:  # reads the header: the size, before decoding
                size = img.size[::-1]
                if first is None:
                    _check_decoded_size(path, size, len(files))
                    first = (path, size)
                    out = np.empty((len(files), 3, *size), np.uint8)
                elif size != first[1]:
                    _differ(first, path, size)
                rgb = np.asarray(img.convert("RGB"))
        except DatasetError:
            raise
        except (UnidentifiedImageError, Image.DecompressionBombError, OSError, ValueError) as e:
            raise DatasetError(f"{path}: cannot decode the image ({e})") from e
        if rgb.shape[:2] != first[1]:
            _differ(first, path, rgb.shape[:2])
        out[i] = rgb.transpose(2, 0, 1)
    assert out is not None  # _class_files found at least one image
    return out


def _check_decoded_size(path: Path, size: tuple[int, int], count: int) -> None:
    """Refuse images whose decoded pixels (``count`` of ``size``, RGB) would not fit in memory."""
    need, budget = count * 3 * size[0] * size[1], memory_budget()
    if need > budget:
        raise DatasetError(
            f"{path} is {size[1]}x{size[0]}: {count} images of that size take "
            f"{byte_size(need)} decoded, more than the {byte_size(budget)} of memory available; "
            "resize them first"
        )


def _differ(first: tuple[Path, tuple[int, int]], path: Path, size: tuple[int, int]) -> None:
    (h0, w0), (h, w) = first[1], size
    raise DatasetError(
        f"images differ in size: {first[0]} is {w0}x{h0} but {path} is {w}x{h} "
        "(width x height); every image must have one size: resize them first"
    )
