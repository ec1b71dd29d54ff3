"""The argument checks every backend shares: an array's dtype, layout and shape, and a device
number (:func:`device_number`)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .arrays import is_array


def check_float32(name: str, a) -> None:
    """TypeError unless ``a`` (a numpy or cupy array) holds float32."""
    if a.dtype != np.float32:
        raise TypeError(f"{name} has dtype {a.dtype}, expected float32")


def check_contiguous(name: str, a) -> None:
    """ValueError unless ``a`` is C-contiguous."""
    if not a.flags.c_contiguous:
        raise ValueError(f"{name} is not C-contiguous")


def check_shape(name: str, a, expected: tuple[int, ...]) -> None:
    """ValueError unless ``a`` has shape ``expected``."""
    if tuple(a.shape) != expected:
        raise ValueError(f"{name} has shape {tuple(a.shape)}, expected {expected}")


def _check_array(name: str, a: np.ndarray, ndim: int) -> None:
    """What every public call checks of each array argument: a float32, C-contiguous array
    (numpy, or a device backend's own: :meth:`Backend.to_device`) of ``ndim`` dimensions."""
    if not is_array(a):
        raise TypeError(f"{name} must be a numpy array, got {type(a).__name__}")
    check_float32(name, a)
    if a.ndim != ndim:
        raise ValueError(f"{name} has shape {a.shape}, expected {ndim} dimensions")
    check_contiguous(name, a)


def device_number(label: str, device: object, count: int, name_of: Callable[[int], str]) -> int:
    """``device`` checked as a number of one of ``count`` devices (numbered from 0).

    Args:
        label: what the message calls the devices (``"CUDA"``, ``"OpenCL"``).
        device: what the user passed.
        count: how many devices there are.
        name_of: a device number's name, for the message that lists the valid devices.

    Raises:
        ValueError: ``device`` is not an integer (a bool is not one) or not in 0..count-1;
            the message lists the devices there are.
    """
    if isinstance(device, bool) or not isinstance(device, (int, np.integer)):
        raise ValueError(f"{label} device must be an integer, got {device!r}")
    if not 0 <= device < count:
        listing = "; ".join(f"{i}: {name_of(i)}" for i in range(count))
        raise ValueError(
            f"{label} device {device} does not exist: this machine has {count} "
            f"(numbers 0..{count - 1}; {listing})"
        )
    return int(device)
