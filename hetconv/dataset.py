"""The dataset type: images and labels in memory, normalised into batches for the network;
what a reader returns (the training and held-out sets), and the holding out and normalising every
reader of files shares."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace

import numpy as np

from hetconv.cifar import DatasetError, _describe

CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)

# The held-out part of a dataset that has none of its own (an .npz of x and y).
DEFAULT_HOLDOUT_FRACTION = 0.1
_HOLDOUT_SEED = 0x401D_0A7  # fixed: the held-out images do not change with --seed


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


@dataclass(frozen=True)
class LoadedData:
    """A dataset read from files: its kind (one of :data:`DATASETS`), the training set, the
    held-out set, where the held-out set came from (for messages), and the classes' names:
    ``class_names[i]`` is class ``i``'s (an image folder's class folders, CIFAR's published
    names, an ``.npz``'s ``class_names`` array), or None when the data names none."""

    kind: str
    train: ImageDataset
    held_out: ImageDataset
    held_out_from: str
    class_names: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        names = self.class_names
        if names is None:
            return
        if isinstance(names, str) or not all(isinstance(n, str) for n in names):
            raise ValueError(f"class_names must be a sequence of str, got {names!r}")
        object.__setattr__(self, "class_names", tuple(names))
        if len(self.class_names) != self.train.num_classes:
            raise ValueError(
                f"{len(self.class_names)} class names for {self.train.num_classes} classes"
            )


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


def _placeholder_stats(x: np.ndarray) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Mean 0, std 1 per channel, until the training set's own are computed."""
    return (0.0,) * x.shape[1], (1.0,) * x.shape[1]


def memory_budget() -> int:
    """Bytes an archive's arrays may take in all: the memory the system can give now (Linux's
    ``MemAvailable``), else half the physical memory, else 4 GiB."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) // 2
    except (AttributeError, ValueError, OSError):
        return 4 << 30


def byte_size(n: int) -> str:
    """``n`` bytes in GiB, MiB or bytes."""
    if n >= 1 << 30:
        return f"{n / (1 << 30):.1f} GiB"
    return f"{n / (1 << 20):.1f} MiB" if n >= 1 << 20 else f"{n} bytes"
