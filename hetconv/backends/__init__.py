"""Convolution backends behind one small contract (:class:`Backend`).

``cpu`` is always present; device backends register here as they land.
"""

from __future__ import annotations

from .base import Backend, ConvShape, DeviceInfo, Padding, PaddingSpec, conv_shape
from .cpu import CpuBackend

__all__ = [
    "Backend",
    "ConvShape",
    "CpuBackend",
    "DeviceInfo",
    "Padding",
    "PaddingSpec",
    "available_backends",
    "conv_shape",
    "get_backend",
]

_FACTORIES = {"cpu": CpuBackend}


def available_backends() -> list[str]:
    """Names of the backends that can run on this machine."""
    return list(_FACTORIES)


def get_backend(name: str = "cpu", **options) -> Backend:
    """Create the backend called ``name`` (``"cpu"``; ``"auto"`` picks the best present)."""
    if name == "auto":
        name = "cpu"
    try:
        factory = _FACTORIES[name]
    except KeyError:
        raise ValueError(
            f"unknown backend {name!r}; available here: {', '.join(available_backends())}"
        ) from None
    return factory(**options)
