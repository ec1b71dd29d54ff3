"""Datasets: CIFAR-10 from the official python-version files, and an offline synthetic stand-in.

Images are stored as uint8 arrays of shape (N, 3, 32, 32) in NCHW layout; labels as int64
arrays of shape (N,). :meth:`ImageDataset.batch` turns a set of indices into a normalised
float32 batch ready for the network.
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

__all__ = [
    "CIFAR_MEAN",
    "CIFAR_STD",
    "DatasetError",
    "ImageDataset",
    "epoch_order",
    "load_cifar10",
    "synthetic_cifar",
]

CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)

IMAGE_SHAPE = (3, 32, 32)
_PIXELS = 3 * 32 * 32  # 3072 values per image
_CIFAR_CLASSES = 10
_CIFAR_FOLDER = "cifar-10-batches-py"
_SPLIT_FILES = {
    "train": tuple(f"data_batch_{i}" for i in range(1, 6)),
    "test": ("test_batch",),
}

# float32 (1, 3, 1, 1) constants so normalisation broadcasts over NCHW batches.
_MEAN32 = np.asarray(CIFAR_MEAN, dtype=np.float32).reshape(1, 3, 1, 1)
_STD32 = np.asarray(CIFAR_STD, dtype=np.float32).reshape(1, 3, 1, 1)


class DatasetError(ValueError):
    """A dataset file is missing or malformed; the message names the file and the problem."""


@dataclass(frozen=True)
class ImageDataset:
    """An in-memory image classification dataset.

    Attributes:
        images: uint8, shape (N, 3, 32, 32), NCHW, C-contiguous.
        labels: int64, shape (N,), values in ``0..num_classes-1``.
        num_classes: number of classes.
        name: free-form description, used in messages.
    """

    images: np.ndarray
    labels: np.ndarray
    num_classes: int = 10
    name: str = ""

    def __post_init__(self) -> None:
        images, labels = self.images, self.labels
        if not isinstance(images, np.ndarray) or images.dtype != np.uint8:
            raise ValueError(f"images must be a uint8 ndarray, got {_describe(images)}")
        if images.ndim != 4 or images.shape[1:] != IMAGE_SHAPE:
            raise ValueError(f"images must have shape (N, 3, 32, 32), got {images.shape}")
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
        # Frozen dataclass: bypass __setattr__ to store contiguous copies if needed.
        object.__setattr__(self, "images", np.ascontiguousarray(images))
        object.__setattr__(self, "labels", np.ascontiguousarray(labels))

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def batch(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Return normalised images and labels for ``indices``.

        Args:
            indices: integer array of shape (B,) indexing into the dataset.

        Returns:
            ``(x, y)``: x is float32, shape (B, 3, 32, 32), C-contiguous, with channel c equal to
            ``(pixel / 255 - CIFAR_MEAN[c]) / CIFAR_STD[c]`` computed in float32; y is int64,
            shape (B,).
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
        x /= np.float32(255.0)
        x -= _MEAN32
        x /= _STD32
        return np.ascontiguousarray(x), self.labels[idx].copy()

    def split(self, n_first: int) -> tuple[ImageDataset, ImageDataset]:
        """Split into the first ``n_first`` items and the rest (copies, same ``num_classes``)."""
        n = len(self)
        if isinstance(n_first, bool) or not isinstance(n_first, int | np.integer):
            raise ValueError(f"n_first must be an int, got {n_first!r}")
        if not 0 <= n_first <= n:
            raise ValueError(f"n_first must lie in 0..{n} for dataset of size {n}, got {n_first}")
        k = int(n_first)
        first = ImageDataset(
            self.images[:k].copy(), self.labels[:k].copy(), self.num_classes, f"{self.name}[:{k}]"
        )
        rest = ImageDataset(
            self.images[k:].copy(), self.labels[k:].copy(), self.num_classes, f"{self.name}[{k}:]"
        )
        return first, rest


def _describe(value: object) -> str:
    if isinstance(value, np.ndarray):
        return f"ndarray of dtype {value.dtype} and shape {value.shape}"
    return type(value).__name__


# --------------------------------------------------------------------------------------------
# CIFAR-10
# --------------------------------------------------------------------------------------------


def load_cifar10(data_dir: str | os.PathLike, split: str = "train") -> ImageDataset:
    """Load CIFAR-10 from the official "python version" batch files.

    Args:
        data_dir: folder holding ``data_batch_1``..``data_batch_5`` and ``test_batch``, or the
            parent of the ``cifar-10-batches-py`` folder the official tarball extracts to.
        split: ``"train"`` (50 000 images from the five data batches) or ``"test"``
            (10 000 images from ``test_batch``).

    Returns:
        ImageDataset with uint8 images (N, 3, 32, 32) and int64 labels (N,), 10 classes.

    Raises:
        ValueError: ``split`` is not ``"train"`` or ``"test"``.
        DatasetError: the folder or a file is missing, or a file is not a valid CIFAR batch.
    """
    if split not in _SPLIT_FILES:
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    folder = _resolve_cifar_dir(Path(data_dir), _SPLIT_FILES[split])
    missing = [f for f in _SPLIT_FILES[split] if not (folder / f).is_file()]
    if missing:
        raise DatasetError(
            f"CIFAR-10 {split} files missing from {folder}: {', '.join(missing)} "
            f"(expected the official python-version batches)"
        )
    parts = [_read_cifar_batch(folder / f) for f in _SPLIT_FILES[split]]
    images = np.concatenate([p[0] for p in parts])
    labels = np.concatenate([p[1] for p in parts])
    return ImageDataset(images, labels, _CIFAR_CLASSES, f"cifar10-{split}")


def _resolve_cifar_dir(data_dir: Path, files: tuple[str, ...]) -> Path:
    """Return the folder holding the batch files: ``data_dir`` or its cifar-10-batches-py."""
    if not data_dir.is_dir():
        raise DatasetError(f"CIFAR-10 directory {data_dir} does not exist or is not a directory")
    nested = data_dir / _CIFAR_FOLDER
    if not any((data_dir / f).is_file() for f in files) and nested.is_dir():
        return nested
    return data_dir


def _read_cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Read one batch file: uint8 images (n, 3, 32, 32) and int64 labels (n,)."""
    try:
        with path.open("rb") as f:
            # Security: a pickle can name any callable and have it run. _CifarUnpickler admits
            # only the few globals genuine CIFAR-10 files name, and builds arrays itself.
            batch = _CifarUnpickler(f, path).load()
    except DatasetError:
        raise
    except Exception as exc:
        raise DatasetError(f"{path}: cannot unpickle CIFAR batch ({exc!r})") from exc
    if not isinstance(batch, dict):
        raise DatasetError(f"{path}: expected a pickled dict, got {type(batch).__name__}")
    absent = [k for k in (b"data", b"labels") if k not in batch]
    if absent:
        raise DatasetError(
            f"{path}: missing key(s) {absent} (has {sorted(map(repr, batch))}), "
            f"expected b'data' and b'labels'"
        )
    data, raw_labels = batch[b"data"], batch[b"labels"]
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8:
        raise DatasetError(f"{path}: b'data' must be a uint8 ndarray, got {_describe(data)}")
    if data.ndim != 2 or data.shape[1] != _PIXELS:
        raise DatasetError(f"{path}: b'data' must have shape (N, {_PIXELS}), got {data.shape}")
    try:
        labels = np.asarray(raw_labels)
    except Exception as exc:
        raise DatasetError(f"{path}: b'labels' is not a list of ints ({exc!r})") from exc
    if labels.ndim != 1 or (labels.size and labels.dtype.kind not in "iu"):
        raise DatasetError(
            f"{path}: b'labels' must be a flat list of ints, "
            f"got dtype {labels.dtype} shape {labels.shape}"
        )
    if labels.shape[0] != data.shape[0]:
        raise DatasetError(
            f"{path}: {labels.shape[0]} labels for {data.shape[0]} images, expected equal counts"
        )
    labels = labels.astype(np.int64)
    if labels.size and (labels.min() < 0 or labels.max() >= _CIFAR_CLASSES):
        raise DatasetError(
            f"{path}: labels must lie in 0..{_CIFAR_CLASSES - 1}, "
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
    """Unpickles a CIFAR-10 batch file: dicts, lists, tuples, ints, strings, bytes and plain
    numeric arrays. Any other global a file names is refused (DatasetError) before it runs."""

    def __init__(self, file: BinaryIO, path: Path):
        super().__init__(file, encoding="bytes")
        self._path = path

    def find_class(self, module: str, name: str) -> object:
        admitted = _ADMITTED.get((module, name))
        if admitted is None:
            raise DatasetError(
                f"{self._path}: refusing to load {f'{module}.{name}'!r} "
                "(CIFAR-10 files hold only arrays, lists and strings)"
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
