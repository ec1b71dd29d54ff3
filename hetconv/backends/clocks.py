"""The clocks a probe (:meth:`Backend.time_step <hetconv.backends.Backend.time_step>`) reads.

:class:`WallClock` reads the host's clock; :class:`DeviceClock` adds up what a backend's device
measured of its own work (OpenCL profiling events, CUDA events), which the backend reports for
each call through ``Backend._charge_device_time``. Which one a backend's probe uses is its
``probe_clock()``.
"""

from __future__ import annotations

import threading
import time


class WallClock:
    """A probe clock that reads the host's clock (``time.perf_counter``) around its block; the
    block ends with :meth:`Backend.synchronize` so that queued device work is included."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def __enter__(self) -> WallClock:
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self._start


_open = threading.local()


def clocks_open_here() -> list[DeviceClock]:
    """The device clocks open in the calling thread, innermost last."""
    clocks = getattr(_open, "clocks", None)
    if clocks is None:
        clocks = _open.clocks = []
    return clocks


class DeviceClock:
    """A probe clock that never reads the host's clock: ``seconds`` is the sum of the device
    time ``backend`` reports (:meth:`Backend._charge_device_time`) for the calls made on it
    by this thread while the block is open. Calls from other threads are not counted."""

    def __init__(self, backend: object) -> None:  # a Backend (base.py imports this module)
        self.backend = backend
        self.seconds = 0.0

    def __enter__(self) -> DeviceClock:
        clocks_open_here().append(self)
        return self

    def __exit__(self, *exc) -> None:
        clocks_open_here().remove(self)
