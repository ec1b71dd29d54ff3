"""Datasets: CIFAR-10 and CIFAR-100 (the official python-version tarball or its folder), a folder
of images with one subfolder per class, arrays in an ``.npz`` file, and an offline synthetic
stand-in.

Images are stored as arrays of shape (N, C, H, W) in NCHW layout, uint8 pixels (or float32 values
from an ``.npz`` of floats); labels as int64 arrays of shape (N,). :meth:`ImageDataset.batch`
turns a set of indices into a normalised float32 batch ready for the network.
:func:`load_dataset` reads any of the file formats (:func:`infer_dataset` tells which one a path
holds) and returns the training set and the held-out set.
"""

from __future__ import annotations

import math
import os
import pickle
import tarfile
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import BinaryIO

import numpy as np

__all__ = [
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

CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)

IMAGE_SHAPE = (3, 32, 32)  # CIFAR's, and the synthetic set's
_PIXELS = 3 * 32 * 32  # 3072 values per CIFAR image

# What `hetconv train --dataset` names; the first reads no files.
DATASETS = ("synthetic", "cifar10", "cifar100", "folder", "npz")
# The held-out part of a dataset that has none of its own (an .npz of x and y).
DEFAULT_HOLDOUT_FRACTION = 0.1
_HOLDOUT_SEED = 0x401D_0A7  # fixed: the held-out images do not change with --seed
# torchvision's ImageFolder extensions (IMG_EXTENSIONS), matched case-insensitively.
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
HELD_OUT_FOLDERS = ("val", "test")


class DatasetError(ValueError):
    """A dataset file is missing or malformed; the message names the file and the problem."""


@dataclass(frozen=True)
class ImageDataset:
    """An in-memory image classification dataset.

    Attributes:
        images: uint8 pixels or float32 values, shape (N, C, H, W), NCHW, C-contiguous.
        labels: int64, shape (N,), values in ``0..num_classes-1``.
        num_classes: number of classes.
        name: free-form description, used in messages.
        mean, std: per channel, what :meth:`batch` subtracts and divides by, in the units it
            sees (pixel / 255 for uint8 images, the values themselves for float32). None: the
            published CIFAR constants (3-channel images only).
    """

    images: np.ndarray
    labels: np.ndarray
    num_classes: int = 10
    name: str = ""
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        images, labels = self.images, self.labels
        if not isinstance(images, np.ndarray) or images.dtype not in (np.uint8, np.float32):
            raise ValueError(f"images must be a uint8 or float32 ndarray, got {_describe(images)}")
        if images.ndim != 4 or min(images.shape[1:]) < 1:
            raise ValueError(f"images must have shape (N, C, H, W), got {images.shape}")
        if images.dtype == np.float32 and not np.isfinite(images).all():
            raise ValueError("float32 images must be finite (they hold NaN or infinity)")
        if not isinstance(labels, np.ndarray) or labels.dtype != np.int64:
            raise ValueError(f"labels must be an int64 ndarray, got {_describe(labels)}")
        if labels.shape != (images.shape[0],):
            raise ValueError(
                f"labels must have shape ({images.shape[0]},) to match images, got {labels.shape}"
            )
        if isinstance(self.num_classes, bool) or not isinstance(self.num_classes, int):
            raise ValueError(f"num_classes must be an int, got {self.num_classes!r}")
        if self.num_classes < 1:
            raise ValueError(f"num_classes must be >= 1, got {self.num_classes}")
        if labels.size and (labels.min() < 0 or labels.max() >= self.num_classes):
            raise ValueError(
                f"labels must lie in 0..{self.num_classes - 1}, "
                f"got range {labels.min()}..{labels.max()}"
            )
        channels = images.shape[1]
        mean = CIFAR_MEAN if self.mean is None else tuple(map(float, self.mean))
        std = CIFAR_STD if self.std is None else tuple(map(float, self.std))
        if (self.mean is None or self.std is None) and channels != 3:
            raise ValueError(
                f"images of {channels} channels need their own mean and std "
                "(CIFAR's constants are for 3 channels)"
            )
        if len(mean) != channels or len(std) != channels:
            raise ValueError(
                f"mean and std need one value per channel ({channels}), "
                f"got {len(mean)} and {len(std)}"
            )
        if not all(math.isfinite(m) for m in mean) or not all(
            math.isfinite(s) and s > 0 for s in std
        ):
            raise ValueError(f"mean must be finite and std finite and > 0, got {mean}, {std}")
        # Frozen dataclass: bypass __setattr__ to store contiguous copies if needed.
        object.__setattr__(self, "images", np.ascontiguousarray(images))
        object.__setattr__(self, "labels", np.ascontiguousarray(labels))
        object.__setattr__(self, "mean", mean)
        object.__setattr__(self, "std", std)
        # float32 (1, C, 1, 1) constants so normalisation broadcasts over NCHW batches.
        object.__setattr__(self, "_mean32", np.asarray(mean, np.float32).reshape(1, -1, 1, 1))
        object.__setattr__(self, "_std32", np.asarray(std, np.float32).reshape(1, -1, 1, 1))

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """(C, H, W) of one image: the network's input shape."""
        return tuple(int(n) for n in self.images.shape[1:])  # type: ignore[return-value]

    def palette_fit(self) -> bool:
        """Whether every batch of this dataset fits the palette8 image format (at most 256
        distinct values in each channel), which a replicated first block's images travel in:
        always for uint8 pixels; float32 values only when each channel of the whole dataset
        holds at most 256 (normalising maps equal values to equal values)."""
        if self.images.dtype == np.uint8:
            return True
        bits = self.images.view(np.uint32)
        for c in range(bits.shape[1]):
            # a few images first: most float datasets fail there, without sorting them all
            if np.unique(bits[:16, c]).size > 256 or np.unique(bits[:, c]).size > 256:
                return False
        return True

    def batch(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Return normalised images and labels for ``indices``.

        Args:
            indices: integer array of shape (B,) indexing into the dataset.

        Returns:
            ``(x, y)``: x is float32, shape (B, C, H, W), C-contiguous, with channel c equal to
            ``(pixel / 255 - mean[c]) / std[c]`` (uint8 images; ``(value - mean[c]) / std[c]``
            for float32 ones) computed in float32; y is int64, shape (B,).
        """
        idx = np.asarray(indices)
        if idx.size == 0:
            idx = idx.astype(np.int64)
        if idx.ndim != 1 or idx.dtype.kind not in "iu":
            raise ValueError(
                f"indices must be a 1-D integer array, got dtype {idx.dtype} shape {idx.shape}"
            )
        n = len(self)
        if idx.size and (idx.min() < -n or idx.max() >= n):
            raise IndexError(
                f"indices must lie in -{n}..{n - 1} for dataset of size {n}, "
                f"got range {idx.min()}..{idx.max()}"
            )
        x = self.images[idx].astype(np.float32)
        if self.images.dtype == np.uint8:
            x /= np.float32(255.0)
        x -= self._mean32
        x /= self._std32
        return np.ascontiguousarray(x), self.labels[idx].copy()

    def split(self, n_first: int) -> tuple[ImageDataset, ImageDataset]:
        """Split into the first ``n_first`` items and the rest (copies, same ``num_classes``,
        mean and std)."""
        n = len(self)
        if isinstance(n_first, bool) or not isinstance(n_first, int | np.integer):
            raise ValueError(f"n_first must be an int, got {n_first!r}")
        if not 0 <= n_first <= n:
            raise ValueError(f"n_first must lie in 0..{n} for dataset of size {n}, got {n_first}")
        k = int(n_first)
        return self.subset(np.arange(k), f"{self.name}[:{k}]"), self.subset(
            np.arange(k, n), f"{self.name}[{k}:]"
        )

    def subset(self, indices: np.ndarray, name: str) -> ImageDataset:
        """The items at ``indices`` (copies; same ``num_classes``, mean and std)."""
        return replace(self, images=self.images[indices], labels=self.labels[indices], name=name)


def _describe(value: object) -> str:
    if isinstance(value, np.ndarray):
        return f"ndarray of dtype {value.dtype} and shape {value.shape}"
    return type(value).__name__


def channel_stats(images: np.ndarray) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel (mean, std) of NCHW ``images`` in the units :meth:`ImageDataset.batch`
    normalises (pixel / 255 for uint8). A constant channel gets std 1 (it is only shifted)."""
    if images.ndim != 4 or not len(images):
        raise ValueError(f"need a non-empty (N, C, H, W) array, got shape {images.shape}")
    channels = images.shape[1]
    total = np.zeros(channels)
    squares = np.zeros(channels)
    for start in range(0, len(images), 1024):  # float64 in chunks: bounded memory, exact sums
        chunk = images[start : start + 1024].astype(np.float64)
        total += chunk.sum(axis=(0, 2, 3))
        squares += np.square(chunk).sum(axis=(0, 2, 3))
    count = images.size // channels
    mean = total / count
    std = np.sqrt(np.maximum(squares / count - mean * mean, 0.0))
    if images.dtype == np.uint8:
        mean, std = mean / 255.0, std / 255.0
    std = np.where(std > 1e-6 * np.maximum(np.abs(mean), 1.0), std, 1.0)
    return tuple(map(float, mean)), tuple(map(float, std))


# --------------------------------------------------------------------------------------------
# Any dataset: what a path holds, and its training and held-out sets
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoadedData:
    """A dataset read from files: its kind (one of :data:`DATASETS`), the training set, the
    held-out set, and where the held-out set came from (for messages)."""

    kind: str
    train: ImageDataset
    held_out: ImageDataset
    held_out_from: str


def infer_dataset(path: str | os.PathLike) -> str:
    """Which dataset ``path`` holds: ``cifar10``, ``cifar100``, ``npz`` or ``folder``.

    Looks for, in order: an ``.npz`` file, a CIFAR tarball (its first member's folder tells
    CIFAR-10 from CIFAR-100), a folder holding ``cifar-10-batches-py/`` or
    ``data_batch_1`` (CIFAR-10), ``cifar-100-python/`` or a ``train`` file (CIFAR-100), and a
    folder with ``train/`` and ``val/`` (or ``test/``) subfolders (an image folder).

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
    if (path / "train").is_dir() and any((path / h).is_dir() for h in HELD_OUT_FOLDERS):
        return "folder"
    entries = sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir())
    shown = ", ".join(entries[:8]) + (f" and {len(entries) - 8} more" if len(entries) > 8 else "")
    raise DatasetError(
        f"cannot tell which dataset {path} holds (it holds {shown or 'nothing'}); {_LOOKED_FOR}"
    )


_LOOKED_FOR = (
    "--data-dir takes the CIFAR-10 or CIFAR-100 python-version tarball "
    "(cifar-10-python.tar.gz, cifar-100-python.tar.gz) or the folder it extracts to, an .npz "
    "file (x_train, y_train, x_test, y_test; or x, y), or a folder with train/ and val/ (or "
    "test/) holding one subfolder of images per class; --dataset names the kind outright"
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
            :data:`DEFAULT_HOLDOUT_FRACTION` for an ``.npz``. Refused for datasets that have one.

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
        return LoadedData(kind, sets["train"], sets["test"], f"the official {test_files}")
    if kind == "npz":
        return load_npz(path, holdout_fraction)
    if kind == "folder":
        return load_image_folder(path, holdout_fraction)
    raise ValueError(f"dataset {kind!r} is not one of {', '.join((*DATASETS[1:], 'auto'))}")


def _holdout(
    train: ImageDataset, fraction: float, where: object
) -> tuple[ImageDataset, ImageDataset]:
    """Hold out ``fraction`` of ``train`` (a fixed-seed random choice; each part keeps its
    order)."""
    if not 0 < fraction < 1:
        raise DatasetError(f"--holdout-fraction must lie between 0 and 1, got {fraction}")
    n = len(train)
    k = math.ceil(fraction * n)
    if k >= n:
        raise DatasetError(
            f"{where}: holding out {fraction:g} of {n} images leaves none to train on"
        )
    chosen = np.zeros(n, bool)
    chosen[np.random.default_rng(_HOLDOUT_SEED).permutation(n)[:k]] = True
    return (
        train.subset(np.flatnonzero(~chosen), train.name),
        train.subset(np.flatnonzero(chosen), f"{train.name} (held out)"),
    )


def _normalised(train: ImageDataset, held_out: ImageDataset) -> tuple[ImageDataset, ImageDataset]:
    """Both sets normalised by the training set's per-channel mean and std."""
    mean, std = channel_stats(train.images)
    return replace(train, mean=mean, std=std), replace(held_out, mean=mean, std=std)


# --------------------------------------------------------------------------------------------
# An .npz of arrays
# --------------------------------------------------------------------------------------------

_NPZ_SPLIT_KEYS = ("x_train", "y_train", "x_test", "y_test")


def load_npz(path: str | os.PathLike, holdout_fraction: float | None = None) -> LoadedData:
    """Read an ``.npz`` of images and labels (never unpickling anything).

    The file holds ``x_train, y_train, x_test, y_test`` (training and held-out sets), or
    ``x, y`` (``holdout_fraction`` of it is held out, :data:`DEFAULT_HOLDOUT_FRACTION` by
    default). Images are (N, C, H, W) or (N, H, W, C) (the channel axis is the one of size 1
    to 4), or (N, H, W) for one channel; uint8 pixels, or floats (kept as float32). Labels are
    (N,) non-negative integers; the classes are ``0..max label``.
    """
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"npz file {path} does not exist or is not a file")
    try:
        with np.load(path, allow_pickle=False) as archive:
            keys = set(archive.files)
            if set(_NPZ_SPLIT_KEYS) <= keys:
                if holdout_fraction is not None:
                    raise DatasetError(
                        f"{path} has its own x_test and y_test: drop --holdout-fraction"
                    )
                arrays = {key: archive[key] for key in _NPZ_SPLIT_KEYS}
            elif {"x", "y"} <= keys:
                arrays = {"x": archive["x"], "y": archive["y"]}
            else:
                raise DatasetError(
                    f"{path} holds arrays {', '.join(sorted(keys)) or '(none)'}; expected "
                    f"x_train, y_train, x_test and y_test, or x and y"
                )
    except DatasetError:
        raise
    except ValueError as e:  # an object array: numpy would have to unpickle it
        raise DatasetError(f"{path}: cannot read its arrays without unpickling ({e})") from e
    except (OSError, zipfile.BadZipFile, EOFError) as e:
        raise DatasetError(f"{path}: not a readable .npz archive ({e})") from e
    if "x" in arrays:
        x, y = _npz_images(arrays["x"], path, "x"), _npz_labels(arrays["y"], path, "y")
        _same_count(x, y, path, "x", "y")
        classes = int(y.max()) + 1 if y.size else 1
        whole = ImageDataset(x, y, classes, path.name, *_placeholder_stats(x))
        fraction = DEFAULT_HOLDOUT_FRACTION if holdout_fraction is None else holdout_fraction
        train, held_out = _holdout(whole, fraction, path)
        source = f"{fraction:.0%} of x, y (a fixed random choice; --holdout-fraction)"
    else:
        x, y = (
            _npz_images(arrays["x_train"], path, "x_train"),
            _npz_labels(arrays["y_train"], path, "y_train"),
        )
        xt, yt = (
            _npz_images(arrays["x_test"], path, "x_test"),
            _npz_labels(arrays["y_test"], path, "y_test"),
        )
        _same_count(x, y, path, "x_train", "y_train")
        _same_count(xt, yt, path, "x_test", "y_test")
        if xt.shape[1:] != x.shape[1:] or xt.dtype != x.dtype:
            raise DatasetError(
                f"{path}: x_test images are {xt.dtype} {xt.shape[1:]} but x_train's are "
                f"{x.dtype} {x.shape[1:]}; expected the same shape and type"
            )
        classes = int(max(y.max(initial=0), yt.max(initial=0))) + 1
        train = ImageDataset(x, y, classes, path.name, *_placeholder_stats(x))
        held_out = ImageDataset(xt, yt, classes, f"{path.name} test", *_placeholder_stats(x))
        source = "x_test, y_test"
    if not len(train):
        raise DatasetError(f"{path}: the training set is empty")
    train, held_out = _normalised(train, held_out)
    return LoadedData("npz", train, held_out, source)


def _placeholder_stats(x: np.ndarray) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Mean 0, std 1 per channel, until the training set's own are computed."""
    return (0.0,) * x.shape[1], (1.0,) * x.shape[1]


def _npz_images(x: np.ndarray, path: Path, key: str) -> np.ndarray:
    """``x`` as NCHW uint8 or float32."""
    if x.dtype.kind == "f":
        if not np.isfinite(x).all():
            raise DatasetError(f"{path}: {key} holds NaN or infinite values")
        x = x.astype(np.float32)
    elif x.dtype.kind in "iu":
        if x.size and (x.min() < 0 or x.max() > 255):
            raise DatasetError(
                f"{path}: {key} is {x.dtype} with values {x.min()}..{x.max()}; integer images "
                "must be pixels in 0..255 (or store floats)"
            )
        x = x.astype(np.uint8)
    else:
        raise DatasetError(f"{path}: {key} is {x.dtype}; expected uint8 pixels or floats")
    if x.ndim == 3:
        x = x[:, None]
    elif x.ndim == 4:
        first, last = 1 <= x.shape[1] <= 4, 1 <= x.shape[3] <= 4
        if last and not first:
            x = x.transpose(0, 3, 1, 2)
        elif first == last:
            raise DatasetError(
                f"{path}: cannot tell the channel axis of {key} of shape {x.shape}; expected "
                "(N, C, H, W) or (N, H, W, C) with 1 to 4 channels, and images larger than 4x4"
            )
    else:
        raise DatasetError(
            f"{path}: {key} has shape {x.shape}; expected (N, C, H, W), (N, H, W, C) or (N, H, W)"
        )
    return np.ascontiguousarray(x)


def _npz_labels(y: np.ndarray, path: Path, key: str) -> np.ndarray:
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if y.ndim != 1 or (y.size and y.dtype.kind not in "iu"):
        raise DatasetError(
            f"{path}: {key} is {y.dtype} of shape {y.shape}; expected (N,) integer class labels"
        )
    if y.size and y.min() < 0:
        raise DatasetError(f"{path}: {key} holds label {y.min()}; labels must be >= 0")
    return y.astype(np.int64)


def _same_count(x: np.ndarray, y: np.ndarray, path: Path, xkey: str, ykey: str) -> None:
    if len(x) != len(y):
        raise DatasetError(
            f"{path}: {len(x)} images in {xkey} but {len(y)} labels in {ykey}; "
            "expected equal counts"
        )


# --------------------------------------------------------------------------------------------
# A folder of images, one subfolder per class
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# CIFAR-10 and CIFAR-100
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _CifarLayout:
    """What the official python-version files of one CIFAR dataset are called and hold."""

    kind: str
    title: str
    tarball: str
    folder: str  # what the tarball extracts to
    splits: dict[str, tuple[str, ...]]
    label_key: bytes
    classes: int


_CIFAR10 = _CifarLayout(
    "cifar10",
    "CIFAR-10",
    "cifar-10-python.tar.gz",
    "cifar-10-batches-py",
    {"train": tuple(f"data_batch_{i}" for i in range(1, 6)), "test": ("test_batch",)},
    b"labels",
    10,
)
_CIFAR100 = _CifarLayout(
    "cifar100",
    "CIFAR-100",
    "cifar-100-python.tar.gz",
    "cifar-100-python",
    {"train": ("train",), "test": ("test",)},
    b"fine_labels",  # the 100 classes; b"coarse_labels" holds the 20 superclasses
    100,
)


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
    if path.is_file():
        batches = _read_cifar_tar(layout, path, wanted)
    elif path.is_dir():
        folder = _resolve_cifar_dir(layout, path, tuple(wanted))
        missing = [f for f in wanted if not (folder / f).is_file()]
        if missing:
            raise DatasetError(
                f"{layout.title} files missing from {folder}: {', '.join(missing)} "
                f"(expected the official python-version files)"
            )
        batches = {}
        for f in wanted:
            with (folder / f).open("rb") as file:
                batches[f] = _read_cifar_batch(file, folder / f, layout)
    else:
        raise DatasetError(
            f"{layout.title} data {path} does not exist (expected the official tarball "
            f"{layout.tarball}, the {layout.folder} folder it extracts to, or that folder's "
            "parent)"
        )
    sets = {}
    for split in splits:
        parts = [batches[f] for f in layout.splits[split]]
        images = np.concatenate([p[0] for p in parts])
        labels = np.concatenate([p[1] for p in parts])
        sets[split] = ImageDataset(
            images, labels, layout.classes, f"{layout.kind}-{split}", CIFAR_MEAN, CIFAR_STD
        )
    return sets


def _resolve_cifar_dir(layout: _CifarLayout, data_dir: Path, files: tuple[str, ...]) -> Path:
    """Return the folder holding the batch files: ``data_dir`` or its extracted folder."""
    nested = data_dir / layout.folder
    if not any((data_dir / f).is_file() for f in files) and nested.is_dir():
        return nested
    return data_dir


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


def _read_cifar_tar(layout: _CifarLayout, path: Path, wanted: Sequence[str]) -> dict:
    """{file: (images, labels)} of ``layout.folder/<file>`` members, read straight from the
    tarball in one pass (nothing is extracted to disk)."""
    try:
        tar = tarfile.open(path, "r:*")
    except (tarfile.TarError, OSError, EOFError) as e:
        raise DatasetError(
            f"{path}: not a readable tar archive ({e}); expected the official {layout.tarball}"
        ) from e
    found: dict = {}
    seen: list[str] = []
    try:
        with tar:
            for member in tar:
                name = member.name.removeprefix("./")
                seen.append(name)
                folder, _, base = name.rpartition("/")
                if folder != layout.folder or base not in wanted or base in found:
                    continue
                where = f"{path} (member {name})"
                if not member.isfile():
                    raise DatasetError(f"{where}: not a regular file")
                with tar.extractfile(member) as file:
                    found[base] = _read_cifar_batch(file, where, layout)
                if len(found) == len(wanted):
                    break
    except (tarfile.TarError, OSError, EOFError) as e:
        raise DatasetError(f"{path}: the tar archive is damaged ({e})") from e
    missing = [f"{layout.folder}/{f}" for f in wanted if f not in found]
    if missing:
        shown = ", ".join(seen[:6]) + (" ..." if len(seen) > 6 else "")
        raise DatasetError(
            f"{path}: no member {', '.join(missing)} (it holds {shown or 'nothing'}); expected "
            f"the official {layout.tarball}"
        )
    return found


def _read_cifar_batch(
    file: BinaryIO, where: object, layout: _CifarLayout
) -> tuple[np.ndarray, np.ndarray]:
    """Read one batch file: uint8 images (n, 3, 32, 32) and int64 labels (n,)."""
    label_key = layout.label_key
    try:
        # Security: a pickle can name any callable and have it run. _CifarUnpickler admits
        # only the few globals genuine CIFAR files name, and builds arrays itself.
        batch = _CifarUnpickler(file, where, layout.title).load()
    except DatasetError:
        raise
    except Exception as exc:
        raise DatasetError(f"{where}: cannot unpickle {layout.title} batch ({exc!r})") from exc
    if not isinstance(batch, dict):
        raise DatasetError(f"{where}: expected a pickled dict, got {type(batch).__name__}")
    absent = [k for k in (b"data", label_key) if k not in batch]
    if absent:
        raise DatasetError(
            f"{where}: missing key(s) {absent} (has {sorted(map(repr, batch))}), "
            f"expected b'data' and {label_key!r}"
        )
    data, raw_labels = batch[b"data"], batch[label_key]
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8:
        raise DatasetError(f"{where}: b'data' must be a uint8 ndarray, got {_describe(data)}")
    if data.ndim != 2 or data.shape[1] != _PIXELS:
        raise DatasetError(f"{where}: b'data' must have shape (N, {_PIXELS}), got {data.shape}")
    try:
        labels = np.asarray(raw_labels)
    except Exception as exc:
        raise DatasetError(f"{where}: {label_key!r} is not a list of ints ({exc!r})") from exc
    if labels.ndim != 1 or (labels.size and labels.dtype.kind not in "iu"):
        raise DatasetError(
            f"{where}: {label_key!r} must be a flat list of ints, "
            f"got dtype {labels.dtype} shape {labels.shape}"
        )
    if labels.shape[0] != data.shape[0]:
        raise DatasetError(
            f"{where}: {labels.shape[0]} labels for {data.shape[0]} images, expected equal counts"
        )
    labels = labels.astype(np.int64)
    if labels.size and (labels.min() < 0 or labels.max() >= layout.classes):
        raise DatasetError(
            f"{where}: labels must lie in 0..{layout.classes - 1}, "
            f"got range {labels.min()}..{labels.max()}"
        )
    # Each row is 1024 R, 1024 G, 1024 B values, each plane 32x32 row-major: a plain reshape.
    images = np.ascontiguousarray(data.reshape(-1, *IMAGE_SHAPE))
    return images, labels


# -- reading the pickles safely -----------------------------------------------------------
#
# The official files are pickles, and unpickling can run any callable a file names. What a
# genuine file names (found by recording find_class while loading files made as the official
# ones were: Python 2's cPickle at protocol 2 with numpy 1.x, and Python 3 with numpy 2 at
# protocols 2 to 5) is: numpy's array reconstructor (``numpy.core.multiarray._reconstruct``,
# ``numpy._core.multiarray._reconstruct`` since numpy 2, or ``_frombuffer`` in ``numeric`` at
# protocol 5), ``numpy.ndarray``, ``numpy.dtype``, and ``_codecs.encode`` (Python 3 writes bytes
# that way at protocol 2). Everything else is refused when it is named, before it can run.
#
# Even the admitted names never reach numpy's own __setstate__ (which trusts its input: a
# doctored dtype state can flag a uint8 dtype as holding object pointers): they map to the
# stand-ins below, which check the state and build plain numeric arrays with np.frombuffer.

_PLAIN_DTYPE_KINDS = "biuf"  # bool, signed and unsigned ints, floats: no pointers, no fields


class _DtypeStandIn:
    """What ``numpy.dtype(code, align, copy)`` plus its pickled state describe, checked."""

    def __init__(self, code: object, align: object = False, copy: object = True):
        if isinstance(code, bytes):
            code = code.decode("ascii", "replace")
        if not isinstance(code, str) or len(code) > 8:
            raise ValueError(f"dtype code {code!r} is not a plain numeric type")
        try:
            dtype = np.dtype(code)
        except TypeError as exc:
            raise ValueError(f"dtype code {code!r} is not a numpy type") from exc
        if dtype.kind not in _PLAIN_DTYPE_KINDS or dtype.fields is not None or dtype.subdtype:
            raise ValueError(f"dtype {code!r} is not a plain numeric type")
        self.dtype = dtype

    def __setstate__(self, state: object) -> None:
        # (version, byteorder, subarray, names, fields, elsize, alignment, flags[, metadata])
        if not isinstance(state, tuple) or len(state) not in (8, 9) or state[0] not in (3, 4):
            raise ValueError(f"dtype state {state!r} is not a plain numeric dtype's")
        byteorder = state[1].decode("ascii") if isinstance(state[1], bytes) else state[1]
        if byteorder not in ("<", ">", "|", "=") or state[2:5] != (None, None, None):
            raise ValueError("dtype state has a byte order, subarray or fields of its own")
        if state[7] != 0 or (len(state) == 9 and state[8] is not None):
            raise ValueError(f"dtype state has flags {state[7]!r} (a plain dtype has none)")
        if byteorder in "<>":
            self.dtype = self.dtype.newbyteorder(byteorder)


class _ArrayStandIn:
    """What ``_reconstruct(ndarray, (0,), b'b')`` plus its pickled state describe."""

    array: np.ndarray | None = None

    def __setstate__(self, state: object) -> None:
        # (version, shape, dtype, is_fortran, raw bytes)
        if not isinstance(state, tuple) or len(state) != 5:
            raise ValueError("array state is not (version, shape, dtype, order, data)")
        _, shape, dtype, fortran, raw = state
        self.array = _plain_array(raw, dtype, shape, "F" if fortran else "C")


def _plain_array(raw: object, dtype: object, shape: object, order: object) -> np.ndarray:
    if not isinstance(dtype, _DtypeStandIn):
        raise ValueError(f"array dtype is {type(dtype).__name__}, not a pickled numpy dtype")
    if not isinstance(raw, bytes | bytearray):
        raise ValueError(f"array data is {type(raw).__name__}, not bytes")
    if not isinstance(shape, tuple) or not all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape
    ):
        raise ValueError(f"array shape {shape!r} is not a tuple of sizes")
    if int(np.prod(shape, dtype=object)) * dtype.dtype.itemsize != len(raw):
        raise ValueError(f"array of shape {shape} {dtype.dtype} does not fit {len(raw)} bytes")
    if order not in ("C", "F"):
        raise ValueError(f"array order {order!r} is not 'C' or 'F'")
    return np.frombuffer(raw, dtype.dtype).reshape(shape, order=order).copy()


def _reconstruct(subtype: object, shape: object, typecode: object) -> _ArrayStandIn:
    if subtype is not _NDARRAY or shape != (0,) or typecode not in (b"b", "b"):
        raise ValueError("array reconstruction is not numpy's ndarray pickle")
    return _ArrayStandIn()


def _frombuffer(buffer: object, dtype: object, shape: object, order: object) -> np.ndarray:
    return _plain_array(buffer, dtype, shape, order)


def _latin1(text: object, encoding: object = "utf-8") -> bytes:
    # Python 3 pickles bytes at protocol 2 as _codecs.encode('\x..', 'latin1').
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise ValueError(f"_codecs.encode is admitted for latin1 text only, not {encoding!r}")
    return text.encode("latin1")


_NDARRAY = object()  # numpy.ndarray: only ever passed to _reconstruct, never called

_ADMITTED: dict[tuple[str, str], object] = {
    ("numpy.core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy._core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy.core.numeric", "_frombuffer"): _frombuffer,
    ("numpy._core.numeric", "_frombuffer"): _frombuffer,
    ("numpy", "ndarray"): _NDARRAY,
    ("numpy", "dtype"): _DtypeStandIn,
    ("_codecs", "encode"): _latin1,
}


class _CifarUnpickler(pickle.Unpickler):
    """Unpickles a CIFAR batch file: dicts, lists, tuples, ints, strings, bytes and plain
    numeric arrays. Any other global a file names is refused (DatasetError) before it runs."""

    def __init__(self, file: BinaryIO, where: object, title: str = "CIFAR-10"):
        super().__init__(file, encoding="bytes")
        self._path, self._title = where, title

    def find_class(self, module: str, name: str) -> object:
        admitted = _ADMITTED.get((module, name))
        if admitted is None:
            raise DatasetError(
                f"{self._path}: refusing to load {f'{module}.{name}'!r} "
                f"({self._title} files hold only arrays, lists and strings)"
            )
        return admitted

    def persistent_load(self, pid: object) -> object:
        raise DatasetError(f"{self._path}: refusing a persistent reference {pid!r}")

    def load(self) -> object:
        loaded = super().load()
        # An array pickled as _reconstruct + state is one of our stand-ins until here.
        if isinstance(loaded, dict):
            for key, value in loaded.items():
                if isinstance(value, _ArrayStandIn):
                    if value.array is None:
                        raise ValueError(f"array {key!r} has no state")
                    loaded[key] = value.array
        return loaded


# --------------------------------------------------------------------------------------------
# Synthetic CIFAR-shaped data
# --------------------------------------------------------------------------------------------

_CLASS_SEED = 0x5EED_C1F4  # fixed: class prototypes are identical for every sample seed
_MAX_SHIFT = 4  # samples are the prototype shifted by up to this many pixels each way


def _class_prototypes(num_classes: int) -> np.ndarray:
    """Fixed class prototypes: float32 (K, 3, 32 + 2*_MAX_SHIFT, same), roughly in 0..255.

    Each prototype is a grey level plus a colour tint, two oriented colour sinusoidal gratings
    and one coloured Gaussian blob; the parameters come from an RNG seeded per class index, so
    class k looks the same whatever ``num_classes`` is.
    """
    size = 32 + 2 * _MAX_SHIFT
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32)
    protos = np.empty((num_classes, 3, size, size), dtype=np.float32)
    for k in range(num_classes):  # loop over classes only; each image is vectorised
        rng = np.random.default_rng([_CLASS_SEED, k])
        img = np.full((3, size, size), 128.0, dtype=np.float32)
        img += rng.uniform(-25.0, 25.0, size=(3, 1, 1)).astype(np.float32)  # colour tint
        for _ in range(2):  # oriented gratings
            theta = rng.uniform(0.0, np.pi)
            period = rng.uniform(5.0, 14.0)
            phase = rng.uniform(0.0, 2 * np.pi)
            wave = np.sin(
                2 * np.pi * (xx * np.cos(theta) + yy * np.sin(theta)) / period + phase
            ).astype(np.float32)
            colour = rng.uniform(-1.0, 1.0, size=(3, 1, 1)).astype(np.float32)
            img += 30.0 * colour * wave
        cy, cx = rng.uniform(10.0, size - 10.0, size=2)
        radius = rng.uniform(3.0, 7.0)
        blob = np.exp(-((yy - cy) ** 2 + (xx - cx) ** 2) / (2 * radius**2)).astype(np.float32)
        img += rng.uniform(-60.0, 60.0, size=(3, 1, 1)).astype(np.float32) * blob
        protos[k] = img
    return protos


def synthetic_cifar(
    n: int, seed: int = 0, num_classes: int = 10, noise: float = 0.25
) -> ImageDataset:
    """Make a learnable, CIFAR-shaped synthetic dataset without any download.

    Each class has a fixed prototype image (gratings, a blob and a colour tint; the same for
    every ``seed``). A sample is its class prototype shifted by up to 4 pixels each way,
    scaled in contrast, offset in brightness, plus per-pixel Gaussian noise, clipped to uint8.
    Datasets made with different seeds therefore come from the same class distributions.

    Args:
        n: number of images (> 0).
        seed: controls the samples (labels, shifts, contrast, noise); same (n, seed) gives
            identical arrays.
        num_classes: number of classes (>= 2); labels are balanced (counts differ by <= 1)
            and shuffled.
        noise: standard deviation of the per-pixel noise as a fraction of 255 (>= 0).

    Returns:
        ImageDataset: uint8 images (n, 3, 32, 32), int64 labels (n,).
    """
    if isinstance(n, bool) or not isinstance(n, int | np.integer) or n <= 0:
        raise ValueError(f"n must be a positive int, got {n!r}")
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
        raise ValueError(f"num_classes must be an int >= 2, got {num_classes!r}")
    if not noise >= 0:
        raise ValueError(f"noise must be >= 0, got {noise!r}")
    n = int(n)
    rng = np.random.default_rng(seed)
    labels = rng.permutation(np.arange(n, dtype=np.int64) % num_classes)
    protos = _class_prototypes(num_classes)

    # Random crop of the padded prototype == shift by (dy, dx) in -_MAX_SHIFT.._MAX_SHIFT.
    dy = rng.integers(0, 2 * _MAX_SHIFT + 1, size=n)
    dx = rng.integers(0, 2 * _MAX_SHIFT + 1, size=n)
    ar = np.arange(32)
    rows = (dy[:, None] + ar)[:, None, :, None]  # (n, 1, 32, 1)
    cols = (dx[:, None] + ar)[:, None, None, :]  # (n, 1, 1, 32)
    chans = np.arange(3)[None, :, None, None]  # (1, 3, 1, 1)
    x = protos[labels[:, None, None, None], chans, rows, cols]  # (n, 3, 32, 32) float32

    contrast = rng.uniform(0.6, 1.4, size=(n, 1, 1, 1)).astype(np.float32)
    brightness = rng.uniform(-30.0, 30.0, size=(n, 1, 1, 1)).astype(np.float32)
    x -= 128.0
    x *= contrast
    x += 128.0 + brightness
    noise_px = rng.standard_normal(x.shape, dtype=np.float32)
    noise_px *= np.float32(noise * 255.0)
    x += noise_px
    np.rint(x, out=x)
    np.clip(x, 0.0, 255.0, out=x)
    images = x.astype(np.uint8)
    return ImageDataset(images, labels, num_classes, f"synthetic-{n}-seed{seed}")


def epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
    """Permutation of ``range(n)`` for one epoch: int64, shape (n,), a function of (seed, epoch).

    ``seed`` and ``epoch`` must be non-negative ints; ``n`` must be >= 0.
    """
    for name, value in (("n", n), ("seed", seed), ("epoch", epoch)):
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    rng = np.random.default_rng([int(seed), int(epoch)])
    return rng.permutation(int(n)).astype(np.int64)
