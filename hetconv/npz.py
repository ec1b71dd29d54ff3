"""An ``.npz`` file of image and label arrays, read without unpickling anything."""

from __future__ import annotations

import os
import zipfile
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
)

_NPZ_SPLIT_KEYS = ("x_train", "y_train", "x_test", "y_test")


def load_npz(path: str | os.PathLike, holdout_fraction: float | None = None) -> LoadedData:
    """Read an ``.npz`` of images and labels (never unpickling anything).

    The file holds ``x_train, y_train, x_test, y_test`` (training and held-out sets), or
    ``x, y`` (``holdout_fraction`` of it is held out, :data:`DEFAULT_HOLDOUT_FRACTION` by
    default). Images are (N, C, H, W) or (N, H, W, C) (the channel axis is the one of size 1
    to 4), or (N, H, W) for one channel; uint8 pixels, or floats (kept as float32). Labels are
    (N,) non-negative integers; the classes are ``0..max label``, or, when the file also holds
    ``class_names`` (a 1-D array of strings, class ``i``'s name at ``i``), one per name.
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
            names = _npz_class_names(archive, path) if "class_names" in keys else None
    except DatasetError:
        raise
    except ValueError as e:  # an object array: numpy would have to unpickle it
        raise DatasetError(f"{path}: cannot read its arrays without unpickling ({e})") from e
    except (OSError, zipfile.BadZipFile, EOFError) as e:
        raise DatasetError(f"{path}: not a readable .npz archive ({e})") from e
    if "x" in arrays:
        x, y = _npz_images(arrays["x"], path, "x"), _npz_labels(arrays["y"], path, "y")
        _same_count(x, y, path, "x", "y")
        classes = _class_count(names, path, y)
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
        classes = _class_count(names, path, y, yt)
        train = ImageDataset(x, y, classes, path.name, *_placeholder_stats(x))
        held_out = ImageDataset(xt, yt, classes, f"{path.name} test", *_placeholder_stats(x))
        source = "x_test, y_test"
    if not len(train):
        raise DatasetError(f"{path}: the training set is empty")
    train, held_out = _normalised(train, held_out)
    return LoadedData("npz", train, held_out, source, names)


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


def _npz_class_names(archive, path: Path) -> tuple[str, ...]:
    names = archive["class_names"]
    if names.ndim != 1 or names.dtype.kind != "U" or not names.size:
        raise DatasetError(
            f"{path}: class_names is {names.dtype} of shape {names.shape}; expected a 1-D array "
            "of strings, class i's name at i"
        )
    return tuple(str(n) for n in names)


def _class_count(names: tuple[str, ...] | None, path: Path, *labels: np.ndarray) -> int:
    """The number of classes: one per name, else ``0..max label``."""
    top = max(int(y.max(initial=0)) for y in labels)
    if names is None:
        return top + 1
    if top >= len(names):
        raise DatasetError(
            f"{path}: label {top} but {len(names)} class_names; expected one name per class"
        )
    return len(names)


def _same_count(x: np.ndarray, y: np.ndarray, path: Path, xkey: str, ykey: str) -> None:
    if len(x) != len(y):
        raise DatasetError(
            f"{path}: {len(x)} images in {xkey} but {len(y)} labels in {ykey}; "
            "expected equal counts"
        )
