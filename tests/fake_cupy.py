"""A numpy-backed fake of the parts of CuPy the cuda backend uses (see test_backend_cuda.py).

Arrays are host arrays. Streams *defer* device->host copies until the host waits on the
stream (and poison the pinned target meanwhile), and check at that wait that a pinned input
was not overwritten while its upload could still be running: so the cuda backend's pipeline
bookkeeping is tested against host/device races on machines without a GPU. Each stream also
keeps a fake device clock (each copy takes :data:`TRANSFER_MS`) that events read, so the
probe's CUDA-event timing is tested too. :func:`fake_to_device` and :func:`fake_to_host`
replace the backend's two one-line transfer calls.
"""

from __future__ import annotations

import numpy as np

#: Fake device time each host<->device copy takes on its stream (kernels take none).
TRANSFER_MS = 1.0


class _FakeEvent:
    def __init__(self, stream: _FakeStream, mark: int, time_ms: float):
        self.stream, self.mark, self.time_ms = stream, mark, time_ms

    def synchronize(self) -> None:
        self.stream.run_until(self.mark)
        self.stream.cuda.observed(self.time_ms)

    @property
    def done(self) -> bool:
        return not any(mark < self.mark for mark, _ in self.stream.pending)


class _FakeStream:
    """Queues the deferred parts of copies; runs them only when someone waits.

    Also keeps the stream's fake device clock: each copy takes :data:`TRANSFER_MS`, and no
    work starts before what the host has already waited for (the device's clock runs on
    while it idles) nor before an event the stream was told to wait on.
    """

    def __init__(self, device: _FakeCuda, non_blocking: bool = False):
        self.cuda = device
        self.pending: list[tuple[int, object]] = []
        self.queued = 0
        self.time_ms = 0.0
        device.streams.append(self)

    def __enter__(self) -> _FakeStream:
        return self

    def __exit__(self, *exc) -> None:
        pass

    def queue(self, work) -> None:
        self.time_ms = max(self.time_ms, self.cuda.floor_ms) + TRANSFER_MS
        self.pending.append((self.queued, work))
        self.queued += 1

    def run_until(self, mark: int) -> None:
        while self.pending and self.pending[0][0] < mark:
            self.pending.pop(0)[1]()

    def synchronize(self) -> None:
        self.run_until(self.queued)
        self.cuda.observed(self.time_ms)

    def record(self, event=None) -> _FakeEvent:
        self.time_ms = max(self.time_ms, self.cuda.floor_ms)
        return _FakeEvent(self, self.queued, self.time_ms)

    def wait_event(self, event: _FakeEvent) -> None:
        # Computation is eager here; cross-stream order is the gpu run's to prove. The clock
        # follows it: this stream's later work starts after the event.
        self.time_ms = max(self.time_ms, event.time_ms)


class _FakeDevice:
    def __init__(self, cuda: _FakeCuda, number: int):
        self.cuda = cuda
        assert 0 <= number < cuda.count, f"fake device {number} used"

    def __enter__(self) -> _FakeDevice:
        return self

    def __exit__(self, *exc) -> None:
        pass

    def synchronize(self) -> None:
        for stream in self.cuda.streams:
            stream.synchronize()


class _FakeRuntime:
    def __init__(self, cuda: _FakeCuda):
        self.cuda = cuda

    def getDeviceCount(self) -> int:  # noqa: N802 - cupy's name
        return self.cuda.count

    def getDeviceProperties(self, number: int) -> dict:  # noqa: N802 - cupy's name
        assert 0 <= number < self.cuda.count
        return {
            "name": f"Fake GPU {number}".encode(),
            "totalGlobalMem": 8 * 2**30,
            "multiProcessorCount": 40 + number,
        }

    def memGetInfo(self) -> tuple[int, int]:  # noqa: N802 - cupy's name
        return 6 * 2**30, 8 * 2**30


class _FakeCuda:
    def __init__(self, count: int = 2):
        self.count = count
        self.streams: list[_FakeStream] = []
        self.runtime = _FakeRuntime(self)
        self.pinned_allocations = 0
        self.floor_ms = 0.0  # the latest device time the host has waited for
        self.elapsed_reads = 0

    def observed(self, time_ms: float) -> None:
        self.floor_ms = max(self.floor_ms, time_ms)

    def get_elapsed_time(self, start: _FakeEvent, end: _FakeEvent) -> float:
        """Milliseconds between two events, which (as in CUDA) must both have completed."""
        assert start.done and end.done, "elapsed time read before the events completed"
        self.elapsed_reads += 1
        return end.time_ms - start.time_ms

    def is_available(self) -> bool:
        return self.count > 0

    def Device(self, number: int = 0) -> _FakeDevice:  # noqa: N802 - cupy's name
        return _FakeDevice(self, number)

    def Stream(self, non_blocking: bool = False) -> _FakeStream:  # noqa: N802 - cupy's name
        return _FakeStream(self, non_blocking)

    def alloc_pinned_memory(self, nbytes: int) -> bytearray:
        self.pinned_allocations += 1
        return bytearray(nbytes)


class _FakePool:
    def free_bytes(self) -> int:
        return 0


class FakeCupy:
    """numpy as "cupy": arrays are host arrays; ``asarray`` copies as an upload would."""

    __version__ = "0.0-fake"

    def __init__(self, count: int = 2):
        self.cuda = _FakeCuda(count)

    def __getattr__(self, name: str):
        return getattr(np, name)

    def asarray(self, a, dtype=None):
        return np.array(a, dtype=dtype, copy=True)

    def get_default_memory_pool(self) -> _FakePool:
        return _FakePool()


def fake_to_device(device_array: np.ndarray, host: np.ndarray, stream: _FakeStream) -> None:
    np.copyto(device_array, host)  # the data the kernels see: what the host staged by now
    staged = host.copy()

    def still_staged() -> None:
        assert np.array_equal(host, staged, equal_nan=True), (
            "a pinned input buffer was overwritten before the stream that uploads it was waited on"
        )

    stream.queue(still_staged)


def fake_to_host(device_array: np.ndarray, host: np.ndarray, stream: _FakeStream) -> None:
    value = np.array(device_array, copy=True)  # the value at this point of the stream
    host.fill(np.nan)  # reading before the wait must show

    stream.queue(lambda: np.copyto(host, value))
