"""Datasets: CIFAR-10 and CIFAR-100 (the official python-version tarball or its folder), a folder
of images with one subfolder per class, arrays in an ``.npz`` file, and an offline synthetic
stand-in.

Images are stored as arrays of shape (N, C, H, W) in NCHW layout, uint8 pixels (or float32 values
from an ``.npz`` of floats); labels as int64 arrays of shape (N,). :meth:`ImageDataset.batch`
turns a set of indices into a normalised float32 batch ready for the network.
:func:`load_dataset` reads any of the file formats (:func:`infer_dataset` tells which one a path
holds) and returns the training set and the held-out set.

This module is the front: every name above is importable from here. Each reader lives in its own
module: :mod:`hetconv.dataset` (the dataset type, holding out, normalising),
:mod:`hetconv.cifar` (the official CIFAR files, unpickled safely), :mod:`hetconv.imagefolder`,
:mod:`hetconv.npz` and :mod:`hetconv.synthetic`.
"""

from __future__ import annotations

import os
import tarfile
import zipfile
from pathlib import Path

import numpy as np

from hetconv.cifar import _CIFAR10, _CIFAR100, DatasetError, _CifarLayout, _read_cifar_files
from hetconv.dataset import (
    CIFAR_MEAN,
    CIFAR_STD,
    DEFAULT_HOLDOUT_FRACTION,
    ImageDataset,
    LoadedData,
    channel_stats,
)
from hetconv.imagefolder import (
    EXPECTED_LAYOUT,
    HELD_OUT_FOLDERS,
    IMAGE_SUFFIXES,
    is_image_folder,
    load_image_folder,
)
from hetconv.npz import load_npz
from hetconv.synthetic import synthetic_cifar

__all__ = [
    "CIFAR_CLASSES",
    "CIFAR_MEAN",
    "CIFAR_STD",
    "DATASETS",
    "DEFAULT_HOLDOUT_FRACTION",
    "IMAGE_SUFFIXES",
    "DatasetError",
    "ImageDataset",
    "LoadedData",
    "channel_stats",
    "epoch_order",
    "infer_dataset",
    "load_cifar10",
    "load_cifar100",
    "load_dataset",
    "load_image_folder",
    "load_npz",
    "synthetic_cifar",
]

# What `hetconv train --dataset` names; the first reads no files.
DATASETS = ("synthetic", "cifar10", "cifar100", "folder", "npz")

# The class names the official files' metadata (batches.meta, meta) gives, in label order.
CIFAR_CLASSES = {
    "cifar10": tuple("airplane automobile bird cat deer dog frog horse ship truck".split()),
    "cifar100": tuple(
        """apple aquarium_fish baby bear beaver bed bee beetle bicycle bottle bowl boy bridge bus
        butterfly camel can castle caterpillar cattle chair chimpanzee clock cloud cockroach couch
        crab crocodile cup dinosaur dolphin elephant flatfish forest fox girl hamster house
        kangaroo keyboard lamp lawn_mower leopard lion lizard lobster man maple_tree motorcycle
        mountain mouse mushroom oak_tree orange orchid otter palm_tree pear pickup_truck pine_tree
        plain plate poppy porcupine possum rabbit raccoon ray road rocket rose sea seal shark
        shrew skunk skyscraper snail snake spider squirrel streetcar sunflower sweet_pepper table
        tank telephone television tiger tractor train trout tulip turtle wardrobe whale
        willow_tree wolf woman worm""".split()
    ),
}


# --------------------------------------------------------------------------------------------
# Any dataset: what a path holds, and its training and held-out sets
# --------------------------------------------------------------------------------------------


def infer_dataset(path: str | os.PathLike) -> str:
    """Which dataset ``path`` holds: ``cifar10``, ``cifar100``, ``npz`` or ``folder``.

    Looks for, in order: an ``.npz`` file, a CIFAR tarball (its first member's folder tells
    CIFAR-10 from CIFAR-100), a folder holding ``cifar-10-batches-py/`` or
    ``data_batch_1`` (CIFAR-10), ``cifar-100-python/`` or a ``train`` file (CIFAR-100), and an
    image folder: one with a ``train/`` subfolder, or (without ``val/`` or ``test/``) class
    folders holding images (:func:`~hetconv.imagefolder.is_image_folder`).

    Raises:
        DatasetError: the path does not exist or holds none of these; the message says what was
            looked for and what was found.
    """
    path = Path(path)
    if path.is_file():
        if path.suffix.lower() == ".npz" and zipfile.is_zipfile(path):
            return "npz"
        if tarfile.is_tarfile(path):
            return _cifar_tar_kind(path)
        raise DatasetError(
            f"{path} is a file but neither a CIFAR python-version tarball "
            f"({_CIFAR10.tarball} or {_CIFAR100.tarball}) nor an .npz archive; {_LOOKED_FOR}"
        )
    if not path.is_dir():
        raise DatasetError(f"{path} does not exist; {_LOOKED_FOR}")
    for layout in (_CIFAR10, _CIFAR100):
        if (path / layout.folder).is_dir() or (path / layout.splits["train"][0]).is_file():
            return layout.kind
    if is_image_folder(path):
        return "folder"
    held = [f"{h}/" for h in HELD_OUT_FOLDERS if (path / h).is_dir()]
    if held:
        raise DatasetError(f"{path} has {' and '.join(held)} but no train/ folder; {_LOOKED_FOR}")
    entries = sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir())
    shown = ", ".join(entries[:8]) + (f" and {len(entries) - 8} more" if len(entries) > 8 else "")
    raise DatasetError(
        f"cannot tell which dataset {path} holds (it holds {shown or 'nothing'}); {_LOOKED_FOR}"
    )


_LOOKED_FOR = (
    "--data-dir takes the CIFAR-10 or CIFAR-100 python-version tarball "
    "(cifar-10-python.tar.gz, cifar-100-python.tar.gz) or the folder it extracts to, an .npz "
    f"file (x_train, y_train, x_test, y_test; or x, y), or an image folder: {EXPECTED_LAYOUT}; "
    "--dataset names the kind outright"
)


def load_dataset(
    kind: str, path: str | os.PathLike, *, holdout_fraction: float | None = None
) -> LoadedData:
    """The training and held-out sets of the dataset ``path`` holds.

    Args:
        kind: ``cifar10``, ``cifar100``, ``folder``, ``npz``, or ``auto`` (:func:`infer_dataset`).
        path: the tarball, folder or file.
        holdout_fraction: hold out this fraction of the training data (a fixed-seed random
            choice) when the dataset has no held-out part of its own (an ``.npz`` of ``x`` and
            ``y``; an image folder without ``val/`` or ``test/``); default
            :data:`DEFAULT_HOLDOUT_FRACTION`. Refused for datasets that have one.

    Non-CIFAR data is normalised by the per-channel mean and std of its training set; CIFAR
    keeps the published constants (:data:`CIFAR_MEAN`, :data:`CIFAR_STD`).
    """
    if kind == "auto":
        kind = infer_dataset(path)
    if kind in ("cifar10", "cifar100"):
        layout = _CIFAR10 if kind == "cifar10" else _CIFAR100
        if holdout_fraction is not None:
            raise DatasetError(f"{layout.title} has its own test set: drop --holdout-fraction")
        sets = _load_cifar(layout, Path(path), ("train", "test"))
        test_files = ", ".join(layout.splits["test"])
        return LoadedData(
            kind, sets["train"], sets["test"], f"the official {test_files}", CIFAR_CLASSES[kind]
        )
    if kind == "npz":
        return load_npz(path, holdout_fraction)
    if kind == "folder":
        return load_image_folder(path, holdout_fraction)
    raise ValueError(f"dataset {kind!r} is not one of {', '.join((*DATASETS[1:], 'auto'))}")


def load_cifar10(path: str | os.PathLike, split: str = "train") -> ImageDataset:
    """Load CIFAR-10 from the official "python version" files.

    Args:
        path: the official tarball ``cifar-10-python.tar.gz`` (read without extracting it), the
            folder holding ``data_batch_1``..``data_batch_5`` and ``test_batch``, or the parent
            of the ``cifar-10-batches-py`` folder the tarball extracts to.
        split: ``"train"`` (50 000 images from the five data batches) or ``"test"``
            (10 000 images from ``test_batch``).

    Returns:
        ImageDataset with uint8 images (N, 3, 32, 32) and int64 labels (N,), 10 classes.

    Raises:
        ValueError: ``split`` is not ``"train"`` or ``"test"``.
        DatasetError: the path or a file is missing, or a file is not a valid CIFAR batch.
    """
    return _load_cifar(_CIFAR10, Path(path), (split,))[split]


def load_cifar100(path: str | os.PathLike, split: str = "train") -> ImageDataset:
    """Load CIFAR-100 (its 100 fine labels) from the official "python version" files: the
    tarball ``cifar-100-python.tar.gz``, the ``cifar-100-python`` folder holding ``train`` and
    ``test``, or its parent. Otherwise as :func:`load_cifar10`."""
    return _load_cifar(_CIFAR100, Path(path), (split,))[split]


def _load_cifar(layout: _CifarLayout, path: Path, splits: tuple[str, ...]) -> dict:
    """{split: ImageDataset} read from a tarball (one pass over it) or a folder."""
    for split in splits:
        if split not in layout.splits:
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    wanted = [f for split in splits for f in layout.splits[split]]
    batches = _read_cifar_files(layout, path, wanted)
    sets = {}
    for split in splits:
        parts = [batches[f] for f in layout.splits[split]]
        images = np.concatenate([p[0] for p in parts])
        labels = np.concatenate([p[1] for p in parts])
        sets[split] = ImageDataset(
            images, labels, layout.classes, f"{layout.kind}-{split}", CIFAR_MEAN, CIFAR_STD
        )
    return sets


def _cifar_tar_kind(path: Path) -> str:
    """``cifar10`` or ``cifar100`` from a tarball's first member (read without the rest)."""
    try:
        with tarfile.open(path, "r:*") as tar:
            member = tar.next()
    except (tarfile.TarError, OSError, EOFError) as e:
        raise DatasetError(f"{path}: cannot read the tar archive ({e})") from e
    top = member.name.removeprefix("./").split("/")[0] if member is not None else ""
    for layout in (_CIFAR10, _CIFAR100):
        if top == layout.folder:
            return layout.kind
    raise DatasetError(
        f"{path} is a tar archive whose first member is {top or '(none)'!r}, not "
        f"{_CIFAR10.folder}/ ({_CIFAR10.tarball}) or {_CIFAR100.folder}/ ({_CIFAR100.tarball}); "
        f"{_LOOKED_FOR}"
    )


def epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
    """Permutation of ``range(n)`` for one epoch: int64, shape (n,), a function of (seed, epoch).

    ``seed`` and ``epoch`` must be non-negative ints; ``n`` must be >= 0.
    """
    for name, value in (("n", n), ("seed", seed), ("epoch", epoch)):
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    rng = np.random.default_rng([int(seed), int(epoch)])
    return rng.permutation(int(n)).astype(np.int64)
