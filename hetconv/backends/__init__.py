"""Convolution backends behind one small contract (:class:`Backend`).

``cpu`` is always present. ``onednn`` (oneDNN's convolutions; its library comes with hetconv
on Linux x86-64) is the CPU engine ``auto`` picks where that library loads (:func:`cpu_engine`).
``opencl`` (PyOpenCL, ``hetconv[opencl]``) and ``cuda`` (CuPy, ``hetconv[cuda]``) are imported
only when asked for, and say why when they cannot run.
"""

from __future__ import annotations

import importlib

from .base import Backend, ConvShape, DeviceInfo, Padding, PaddingSpec, conv_shape
from .cpu import CpuBackend

__all__ = [
    "Backend",
    "BackendUnavailable",
    "ConvShape",
    "CpuBackend",
    "DeviceInfo",
    "Padding",
    "PaddingSpec",
    "available_backends",
    "backend_class",
    "conv_shape",
    "cpu_engine",
    "get_backend",
    "resolve_engine",
    "KNOWN_BACKENDS",
]

#: name -> "module:class", imported on first use.
KNOWN_BACKENDS = {
    "cpu": "hetconv.backends.cpu:CpuBackend",
    "opencl": "hetconv.backends.opencl:OpenCLBackend",
    "cuda": "hetconv.backends.cuda:CudaBackend",
    "onednn": "hetconv.backends.onednn:OneDnnBackend",
}

#: The shape ``auto`` times each backend on: C2 of the paper's 50:500 network, batch 8.
AUTO_PROBE = ConvShape(8, 50, 16, 16, 500, 5, 5, Padding(2, 2, 2, 2))


class BackendUnavailable(RuntimeError):
    """A known backend that cannot run on this machine (missing package, driver or device)."""


def backend_class(name: str) -> type[Backend]:
    """The class of backend ``name``; raises ValueError for an unknown name and
    BackendUnavailable when its package cannot be imported or it has no device here."""
    try:
        target = KNOWN_BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"unknown backend {name!r}; known: {', '.join(KNOWN_BACKENDS)} (or auto)"
        ) from None
    module_name, class_name = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        if e.name and e.name.split(".")[0] == "hetconv":
            raise  # our own module missing or broken: a bug, not an absent optional package
        extra = f" (pip install 'hetconv[{name}]')" if name != "cpu" else ""
        raise BackendUnavailable(f"backend {name} cannot be imported: {e}{extra}") from None
    cls = getattr(module, class_name)
    ok, why = cls.is_available()
    if not ok:
        raise BackendUnavailable(f"backend {name} is not available here: {why}")
    return cls


def available_backends() -> dict[str, str]:
    """Every known backend -> "" when it can run here, else the reason it cannot."""
    status = {}
    for name in KNOWN_BACKENDS:
        try:
            backend_class(name)
            status[name] = ""
        except BackendUnavailable as e:
            status[name] = str(e)
    return status


def cpu_engine() -> tuple[str, str]:
    """The CPU engine ``auto`` picks, and why: ``onednn`` where oneDNN's library loads (it
    comes with hetconv on Linux x86-64), else ``cpu`` (im2col + BLAS, everywhere)."""
    from .onednn import OneDnnBackend

    ok, why = OneDnnBackend.is_available()
    if not ok:
        return "cpu", why
    return "onednn", f"oneDNN {OneDnnBackend.library_version()} loads here"


def resolve_engine(name: str) -> tuple[str, str | None]:
    """``hetconv train --engine``'s choice as a backend name, with the line that says which
    ``auto`` chose and why (None for a named engine)."""
    if name != "auto":
        return name, None
    engine, why = cpu_engine()
    if engine == "onednn":
        return engine, f"engine onednn (auto: {why}; --engine cpu for the numpy engine)"
    return engine, f"engine cpu, the numpy engine (auto: {why})"


def get_backend(
    name: str = "cpu", device: int | None = None, memory_limit: int | None = None, **options
) -> Backend:
    """Create backend ``name`` on device number ``device`` (None: the backend's default).

    ``"auto"`` times every available GPU backend's default device and the CPU engine
    (:func:`cpu_engine`) on :data:`AUTO_PROBE` and returns the fastest. ``memory_limit`` caps
    the bytes one call may use on the device (larger calls run in chunks of images).
    """
    if name == "auto":
        if device is not None:
            raise ValueError("--device needs an explicit backend, not auto")
        backend = fastest_backend(memory_limit=memory_limit)
        return backend
    cls = backend_class(name)
    if device is not None:
        options["device"] = device
    backend = cls(**options)
    if memory_limit is not None:
        if memory_limit < 1:
            raise ValueError(f"memory limit must be positive, got {memory_limit}")
        backend.memory_limit = int(memory_limit)
    return backend


def fastest_backend(memory_limit: int | None = None, repeats: int = 2) -> Backend:
    """The available backend whose default device runs :data:`AUTO_PROBE` fastest.

    The CPU takes part as its engine (:func:`cpu_engine`: onednn where its library loads, else
    cpu). OpenCL devices that are CPUs (PoCL and the like) are not candidates: they run on the
    cores the CPU engine already uses, slower. With no other candidate the CPU engine is
    returned without a probe.
    """
    candidates = []
    for name, why in available_backends().items():
        if why or name in ("cpu", "onednn"):
            continue
        try:
            backend = get_backend(name, memory_limit=memory_limit)
        except Exception:  # a device that cannot even start is not a candidate
            continue
        if backend.describe().kind != "cpu":
            candidates.append(backend)
    cpu = get_backend(cpu_engine()[0], memory_limit=memory_limit)
    if not candidates:
        return cpu
    best, best_seconds = cpu, cpu.time_step(AUTO_PROBE, repeats)
    for backend in candidates:
        try:
            seconds = backend.time_step(AUTO_PROBE, repeats)
        except Exception:  # a device that fails its probe is not a candidate
            continue
        if seconds < best_seconds:
            best, best_seconds = backend, seconds
    return best
