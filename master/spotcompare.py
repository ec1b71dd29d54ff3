"""How a spot check compares a worker's values with the master's (:mod:`.spotcheck`): a
:class:`Comparison` per tensor, the error allowed (:func:`tolerance`: a relative tolerance,
widened by a 16-bit wire format's last place) and the error found (:func:`relative_error`:
the largest difference over the tensor's scale or, for a ``norm`` comparison, the 2-norm of
the difference over the 2-norm of the master's values)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hetconv.formats import FLOAT16, TensorFormat

#: One unit in the last place, relative to the value, of each 16-bit wire format (by label):
#: float16 keeps 11 significant bits, bfloat16 8.
FORMAT_ULP = {"float32": 0.0, "float16": 2.0**-10, "bfloat16": 2.0**-7}
#: The smallest step between float16 values (its subnormals): an absolute floor, since below
#: 2**-14 float16 keeps fewer significant bits.
FLOAT16_SUBNORMAL = 2.0**-24


@dataclass(frozen=True)
class Comparison:
    """One tensor of a sample: its short name (``y``, ``dw``, ``db``, ``dx``: the trace's) and
    what was sampled of it (for messages), the worker's values, the master's, their scale (the
    largest value the master computed for it and what shares its scale), whether it
    travelled in the wire format (then rounded to it on both sides), and its own ``rtol``
    (None: the configuration's); with ``norm``, the difference is measured as a whole, the
    2-norm of ``got - want``, and ``scale`` is the 2-norm of ``want`` (:func:`norm_scale`)."""

    tensor: str
    what: str
    got: np.ndarray
    want: np.ndarray
    scale: float
    wire_rounded: bool
    rtol: float | None = None
    norm: bool = False


def tolerance(rtol: float, fmt: TensorFormat, wire_rounded: bool) -> tuple[float, float]:
    """(relative, absolute) error allowed for a tensor: ``|got - want| <= relative * scale +
    absolute``. A tensor that travelled in ``fmt`` (``wire_rounded``) may differ by one unit in
    its last place more (and, for float16, by one subnormal step)."""
    if not wire_rounded:
        return rtol, 0.0
    absolute = FLOAT16_SUBNORMAL if fmt is FLOAT16 else 0.0
    return rtol + FORMAT_ULP.get(fmt.label, 0.0), absolute


def as_received(fmt: TensorFormat, array: np.ndarray) -> np.ndarray:
    """``array`` as the other side of the wire gets it in ``fmt`` (rounded; float32: itself)."""
    if fmt.exact:
        return np.ascontiguousarray(array)
    return fmt.to_host(fmt.to_wire(array))


def _as_answered(fmt: TensorFormat, values: np.ndarray) -> np.ndarray:
    """Float64 ``values`` as a worker's float32 answer reaches the master in ``fmt``. A finite
    answer cannot exceed the format's largest finite value, so the master's own values are
    clipped to it: where its float32 rounds just past float16's 65504 and the worker's just
    below, both are right (an infinite answer is refused before any spot check)."""
    rounded = as_received(fmt, values.astype(np.float32))
    if fmt is FLOAT16:
        largest = float(np.finfo(np.float16).max)
        np.clip(rounded, -largest, largest, out=rounded)
    return rounded


def norm_scale(want: np.ndarray) -> float:
    """The scale of a ``norm`` :class:`Comparison`: the 2-norm of ``want`` (float64)."""
    return float(np.linalg.norm(np.asarray(want, np.float64).reshape(-1)))


def relative_error(comparison: Comparison) -> tuple[float, float]:
    """(the largest ``|got - want|`` over the scale, the largest ``|got - want|``; with
    ``norm``, the 2-norm of ``got - want`` in place of the largest)."""
    got, want = comparison.got, comparison.want
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.abs(got.astype(np.float64) - want)
    diff[got == want] = 0.0  # equal infinities (a float16 overflow on both sides) agree
    if comparison.norm:
        worst = float(np.linalg.norm(diff.reshape(-1)))
    else:
        worst = float(diff.max(initial=0.0))
    return worst / comparison.scale if comparison.scale > 0 else (np.inf if worst else 0.0), worst


__all__ = [
    "FLOAT16_SUBNORMAL",
    "FORMAT_ULP",
    "Comparison",
    "as_received",
    "norm_scale",
    "relative_error",
    "tolerance",
]
