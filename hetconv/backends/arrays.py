"""Which array module an array belongs to: numpy for host arrays, a device backend's for its own.

The layers of a stage (:mod:`hetconv.layers`, :mod:`hetconv.batchnorm`, :mod:`hetconv.head`)
are written once for any NumPy-compatible module: each takes the module of the array it is
given (:func:`array_module`), so the same code runs on the host with numpy and on a GPU with
cupy. A device backend registers its array type when it starts (:func:`register_array_module`);
nothing here imports a device library.

numpy stays the answer for every host array and anything unregistered, at the cost of one
type check per layer call.
"""

from __future__ import annotations

from typing import Any

import numpy as np

#: array type -> its module, for device arrays (numpy's own is not listed: the fast path).
_MODULES: dict[type, Any] = {}


def register_array_module(array_type: type, module: Any) -> None:
    """Arrays of ``array_type`` belong to ``module`` (cupy's ``ndarray`` to cupy)."""
    _MODULES[array_type] = module


def _module_of(t: type) -> Any:
    """The registered module of array type ``t`` or of a registered type it derives from
    (remembered); None for anything else."""
    module = _MODULES.get(t)
    if module is None:
        for array_type, candidate in list(_MODULES.items()):
            if issubclass(t, array_type):
                _MODULES[t] = module = candidate
                break
    return module


def array_module(a: Any) -> Any:
    """The module ``a``'s arithmetic runs in: numpy for numpy arrays and scalars, the
    registered module of a device array."""
    if type(a) is np.ndarray or not _MODULES:
        return np
    module = _module_of(type(a))
    return np if module is None else module


def is_array(a: Any) -> bool:
    """Whether ``a`` is a numpy array or a registered device array."""
    return isinstance(a, np.ndarray) or (bool(_MODULES) and _module_of(type(a)) is not None)


def on_host(a: Any) -> bool:
    """Whether ``a`` is a host (numpy) array or not an array at all."""
    return not _MODULES or type(a) is np.ndarray or _module_of(type(a)) is None


def to_host(a: Any) -> np.ndarray:
    """``a`` as a numpy array: itself when it is one, else copied from its device (the
    device module's ``ndarray.get()``)."""
    if on_host(a):
        return a
    return a.get()


__all__ = ["array_module", "is_array", "on_host", "register_array_module", "to_host"]
