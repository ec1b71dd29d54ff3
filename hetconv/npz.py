"""An ``.npz`` file of image and label arrays, read without unpickling anything."""

from __future__ import annotations

import math
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
    byte_size,
    memory_budget,
)

_NPZ_SPLIT_KEYS = ("x_train", "y_train", "x_test", "y_test")

#: The most labels may ask for: a label past it is a damaged file, not a class.
MAX_CLASSES = 100_000
#: A member over BOMB_MIN_BYTES that deflates more than BOMB_RATIO to 1 is a zip bomb: image
#: data never compresses so far (deflate's best is about 1030 to 1, on constant bytes).
BOMB_RATIO, BOMB_MIN_BYTES = 200, 64 << 20


def _member_header(archive: zipfile.ZipFile, info: zipfile.ZipInfo, key: str) -> int:
    """The bytes member ``key`` declares, checked against the zip's size of it, without
    reading its data."""
    with archive.open(info) as f:
        version = np.lib.format.read_magic(f)
        header = np.lib.format.read_array_header_1_0 if version == (1, 0) else None
        shape, _, dtype = (header or np.lib.format.read_array_header_2_0)(f)
        data = info.file_size - f.tell()
    if dtype.hasobject:
        raise ValueError(f"{key} holds Python objects: cannot read it without unpickling")
    declared = math.prod(shape) * dtype.itemsize
    if info.file_size > max(BOMB_MIN_BYTES, BOMB_RATIO * info.compress_size):
        raise ValueError(
            f"{key} declares {byte_size(info.file_size)} compressed "
            f"{info.file_size // max(info.compress_size, 1)} to 1: a zip bomb, not data"
        )
    if declared != data:
        raise ValueError(
            f"{key} declares {dtype} {shape} ({byte_size(declared)}) but holds {byte_size(data)}: "
            "a damaged or forged file"
        )
    return declared


def read_arrays(
    path: str | os.PathLike, keys: set[str] | None = None, budget: int | None = None
) -> dict[str, np.ndarray]:
    """The arrays of an ``.npz`` (those in ``keys``, or all), read without unpickling and with
    bounded memory: every member's declared size (its ``.npy`` header and the zip's size of
    it) is checked before anything is decompressed, and their sum against ``budget`` bytes
    (:func:`memory_budget` by default).

    Raises:
        ValueError: the file is no ``.npz``, damaged, or declares more than the budget (the
            message names what; the caller names the file).
    """
    budget = memory_budget() if budget is None else budget
    try:
        with zipfile.ZipFile(path) as archive:
            members = {
                info.filename[: -len(".npy")]: info
                for info in archive.infolist()
                if info.filename.endswith(".npy") and (keys is None or info.filename[:-4] in keys)
            }
            sizes = {key: _member_header(archive, info, key) for key, info in members.items()}
            if sum(sizes.values()) > budget:
                largest = max(sizes, key=sizes.get)
                raise ValueError(
                    f"its arrays declare {byte_size(sum(sizes.values()))} ({largest}: "
                    f"{byte_size(sizes[largest])}), more than the {byte_size(budget)} of memory "
                    "available"
                )
            arrays = {}
            for key, info in members.items():
                with archive.open(info) as f:
                    arrays[key] = np.lib.format.read_array(f, allow_pickle=False)
            return arrays
    except zipfile.BadZipFile as e:
        raise ValueError(f"not an .npz archive ({e})") from None
    except (EOFError, zipfile.LargeZipFile, NotImplementedError, RuntimeError) as e:
        raise ValueError(f"damaged ({e})") from None


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
        with zipfile.ZipFile(path) as archive:
            keys = {n[: -len(".npy")] for n in archive.namelist() if n.endswith(".npy")}
        if set(_NPZ_SPLIT_KEYS) <= keys:
            if holdout_fraction is not None:
                raise DatasetError(f"{path} has its own x_test and y_test: drop --holdout-fraction")
            wanted = set(_NPZ_SPLIT_KEYS)
        elif {"x", "y"} <= keys:
            wanted = {"x", "y"}
        else:
            raise DatasetError(
                f"{path} holds arrays {', '.join(sorted(keys)) or '(none)'}; expected "
                f"x_train, y_train, x_test and y_test, or x and y"
            )
        arrays = read_arrays(path, wanted | ({"class_names"} & keys))
        names = _npz_class_names(arrays.pop("class_names"), path) if "class_names" in keys else None
    except DatasetError:
        raise
    except ValueError as e:
        raise DatasetError(f"{path}: {e}") from None
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
    if y.size and y.min() < 0:  # min and max in the labels' own type: uint64's are exact
        raise DatasetError(f"{path}: {key} holds label {y.min()}; labels must be >= 0")
    if y.size and y.max() >= MAX_CLASSES:
        raise DatasetError(
            f"{path}: {key} holds label {y.max()} (at index {int(y.argmax())}); labels are "
            f"classes 0..N-1, and at most {MAX_CLASSES} classes are supported"
        )
    return y.astype(np.int64)


def _npz_class_names(names: np.ndarray, path: Path) -> tuple[str, ...]:
    if names.ndim != 1 or names.dtype.kind != "U" or not names.size:
        raise DatasetError(
            f"{path}: class_names is {names.dtype} of shape {names.shape}; expected a 1-D array "
            "of strings, class i's name at i"
        )
    if names.size > MAX_CLASSES:
        raise DatasetError(f"{path}: {names.size} class_names; at most {MAX_CLASSES} are supported")
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
