"""Synthetic CIFAR-shaped data: learnable, offline, the same for every run of one seed."""

from __future__ import annotations

import numpy as np

from hetconv.dataset import ImageDataset

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
