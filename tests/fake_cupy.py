"""A numpy-backed fake of the parts of CuPy the cuda backend uses (see test_backend_cuda.py).

Device arrays are :class:`FakeArray`: numpy arrays behind a wall, as strict as CuPy's. Numpy
refuses them (no implicit conversion: a numpy function, ``np.asarray`` or arithmetic with a
numpy array raises TypeError), the fake module's functions refuse numpy arrays, and the
module offers only names CuPy has (:data:`CUPY_NAMES`): code that works on the fake does not
call a numpy-only function on a device array, nor mix host and device arrays. Each crossing
is counted (:attr:`FakeCupy.uploads`, :attr:`FakeCupy.downloads`: ``asarray``/``array`` of a
host array and ``ndarray.set`` up, ``ndarray.get``/``asnumpy`` down), so a test can assert
how often a call's tensors cross.

Streams *defer* device->host copies until the host waits on the stream (and poison the pinned
target meanwhile), and check at that wait that a pinned input was not overwritten while its
upload could still be running: so the cuda backend's pipeline bookkeeping is tested against
host/device races on machines without a GPU. Each stream also keeps a fake device clock (each
copy takes :data:`TRANSFER_MS`) that events read, so the probe's CUDA-event timing is tested
too. :func:`fake_to_device` and :func:`fake_to_host` replace the backend's two one-line
transfer calls; :func:`install` puts the whole fake in place of CuPy for the cuda backend
(``python tests/fake_cupy.py worker ...`` runs a cuda worker process on it).
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


#: The module-level names the fake offers: functions and types CuPy has with numpy's meaning
#: (a name numpy has and CuPy lacks is deliberately absent, so code using it fails here).
CUPY_FUNCTIONS = frozenset(
    """empty zeros ones full empty_like zeros_like ones_like arange ascontiguousarray copyto
    concatenate stack add subtract multiply divide true_divide maximum minimum sqrt square
    reciprocal power exp log equal not_equal greater less logical_not logical_and where matmul
    dot broadcast_to sum mean isfinite abs negative""".split()
)
CUPY_TYPES = frozenset("float16 float32 float64 int8 int16 int32 int64 uint8 bool_".split())
CUPY_NAMES = CUPY_FUNCTIONS | CUPY_TYPES | {
    "asarray", "array", "asnumpy", "get_array_module", "ndarray", "lib", "cuda", "newaxis",
    "get_default_memory_pool",
}  # fmt: skip


def _refuse_host(where: str, value) -> None:
    if isinstance(value, np.ndarray):
        raise TypeError(
            f"{where} got a numpy array {value.shape}: upload it first (cupy refuses host arrays)"
        )


class FakeArray:
    """A device array: a numpy array only the fake module's functions and the methods below
    reach. Numpy refuses it, as it refuses a CuPy array."""

    __array_ufunc__ = None  # numpy ufuncs and numpy-array operators refuse it
    __array_priority__ = 100

    def __init__(self, data: np.ndarray, cupy: FakeCupy):
        self._a, self._cp = data, cupy

    def __array__(self, *args, **kwargs):
        raise TypeError(
            "Implicit conversion to a NumPy array is not allowed. Please use `.get()` to "
            "construct a NumPy array explicitly."
        )

    def _wrap(self, value):
        return _wrap(value, self._cp)

    # -- what an array is ------------------------------------------------------------------
    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    ndim = property(lambda self: self._a.ndim)
    size = property(lambda self: self._a.size)
    nbytes = property(lambda self: self._a.nbytes)
    itemsize = property(lambda self: self._a.itemsize)
    strides = property(lambda self: self._a.strides)
    flags = property(lambda self: self._a.flags)
    T = property(lambda self: self._wrap(self._a.T))
    device = property(lambda self: _FakeDevice(self._cp.cuda, 0))

    def __len__(self) -> int:
        return len(self._a)

    def __repr__(self) -> str:
        return f"FakeArray({self._a!r})"

    def __float__(self) -> float:  # cupy: a size-1 array's value, read from the device
        return float(self._a)

    def __int__(self) -> int:
        return int(self._a)

    def __bool__(self) -> bool:
        return bool(self._a)

    def item(self):
        return self._a.item()

    # -- crossing ----------------------------------------------------------------------------

    def get(self, stream=None, out: np.ndarray | None = None, blocking: bool = True):
        self._cp.downloads.append(self._a.nbytes)
        if out is None:
            return self._a.copy()
        np.copyto(out, self._a)
        return out

    def set(self, arr: np.ndarray, stream=None) -> None:
        if not isinstance(arr, np.ndarray):
            raise TypeError(f"set takes a numpy array, got {type(arr).__name__}")
        self._cp.uploads.append(arr.nbytes)
        np.copyto(self._a, arr)

    # -- methods (numpy's, on the device) ----------------------------------------------------

    def _method(name):  # noqa: N805 - a helper run at class creation
        def method(self, *args, **kwargs):
            args, kwargs = _unwrap_all(f"ndarray.{name}", args, kwargs)
            return self._wrap(getattr(self._a, name)(*args, **kwargs))

        method.__name__ = name
        return method

    for _name in (
        "reshape transpose sum mean max min argmax copy astype fill ravel squeeze any all "
        "__neg__ __pos__ __abs__ __invert__ "
        "__add__ __radd__ __sub__ __rsub__ __mul__ __rmul__ __truediv__ __rtruediv__ "
        "__matmul__ __rmatmul__ __pow__ __rpow__ __and__ __rand__ __or__ __ror__ "
        "__gt__ __ge__ __lt__ __le__ __eq__ __ne__ "
        "__iadd__ __isub__ __imul__ __itruediv__ __iand__ __ior__ __getitem__ __setitem__"
    ).split():
        locals()[_name] = _method(_name)
    del _name, _method

    def __hash__(self):
        return id(self)

    def __setitem__(self, key, value):  # in place: the wrapper stays itself
        key, value = _unwrap_all("ndarray.__setitem__", (key, value), {})[0]
        self._a[key] = value

    def __iadd__(self, other):
        self._a += _unwrap_all("+=", (other,), {})[0][0]
        return self

    def __isub__(self, other):
        self._a -= _unwrap_all("-=", (other,), {})[0][0]
        return self

    def __imul__(self, other):
        self._a *= _unwrap_all("*=", (other,), {})[0][0]
        return self

    def __itruediv__(self, other):
        self._a /= _unwrap_all("/=", (other,), {})[0][0]
        return self


def _unwrap(where: str, value):
    if isinstance(value, FakeArray):
        return value._a
    if isinstance(value, (list, tuple)):
        return type(value)(_unwrap(where, v) for v in value)
    _refuse_host(where, value)
    return value


def _unwrap_all(where: str, args, kwargs):
    return (
        tuple(_unwrap(where, a) for a in args),
        {k: _unwrap(where, v) for k, v in kwargs.items()},
    )


def _wrap(value, cupy: FakeCupy):
    if isinstance(value, np.ndarray):
        return FakeArray(value, cupy)
    if isinstance(value, tuple):
        return tuple(_wrap(v, cupy) for v in value)
    return value  # a numpy scalar (a reduction to one value): cupy gives a 0-d array


class _StrideTricks:
    def __init__(self, cupy: FakeCupy):
        self._cp = cupy

    def as_strided(self, x, shape=None, strides=None):
        _refuse_host("as_strided", x)
        view = np.lib.stride_tricks.as_strided(x._a, shape=shape, strides=strides)
        return FakeArray(view, self._cp)


class _Lib:
    def __init__(self, cupy: FakeCupy):
        self.stride_tricks = _StrideTricks(cupy)


class FakeCupy:
    """numpy behind :class:`FakeArray`: ``asarray`` uploads (a counted copy), every function
    of :data:`CUPY_FUNCTIONS` takes and answers device arrays only."""

    __version__ = "0.0-fake"
    ndarray = FakeArray
    newaxis = None

    def __init__(self, count: int = 2):
        self.cuda = _FakeCuda(count)
        self.lib = _Lib(self)
        self.uploads: list[int] = []  # bytes of each host->device copy
        self.downloads: list[int] = []  # bytes of each device->host copy

    def __getattr__(self, name: str):
        if name in CUPY_TYPES:
            return getattr(np, name)
        if name not in CUPY_FUNCTIONS:
            raise AttributeError(f"the fake cupy has no {name!r} (cupy may lack it)")
        function = getattr(np, name)

        def on_device(*args, **kwargs):
            args, kwargs = _unwrap_all(f"cupy.{name}", args, kwargs)
            return _wrap(function(*args, **kwargs), self)

        return on_device

    def asarray(self, a, dtype=None):
        if isinstance(a, FakeArray):
            return a if dtype is None or a.dtype == dtype else a.astype(dtype)
        host = np.asarray(a, dtype=dtype)
        self.uploads.append(host.nbytes)
        return FakeArray(np.array(host, copy=True), self)

    def array(self, a, dtype=None, copy=True):
        if isinstance(a, FakeArray):
            return FakeArray(np.array(a._a, dtype=dtype, copy=copy), self)
        return self.asarray(np.array(a, dtype=dtype, copy=True))

    def asnumpy(self, a, stream=None):
        if isinstance(a, FakeArray):
            return a.get()
        return np.asarray(a)

    def get_array_module(self, *arrays):
        return self if any(isinstance(a, FakeArray) for a in arrays) else np

    def get_default_memory_pool(self) -> _FakePool:
        return _FakePool()

    def crossings(self) -> tuple[int, int]:
        """(uploads, downloads) so far."""
        return len(self.uploads), len(self.downloads)


def fake_to_device(device_array: FakeArray, host: np.ndarray, stream: _FakeStream) -> None:
    device_array._cp.uploads.append(host.nbytes)
    np.copyto(device_array._a, host)  # the data the kernels see: what the host staged by now
    staged = host.copy()

    def still_staged() -> None:
        assert np.array_equal(host, staged, equal_nan=True), (
            "a pinned input buffer was overwritten before the stream that uploads it was waited on"
        )

    stream.queue(still_staged)


def fake_to_host(device_array: FakeArray, host: np.ndarray, stream: _FakeStream) -> None:
    device_array._cp.downloads.append(host.nbytes)
    value = np.array(device_array._a, copy=True)  # the value at this point of the stream
    host.fill(np.nan)  # reading before the wait must show

    stream.queue(lambda: np.copyto(host, value))


def install(monkeypatch=None, count: int = 2) -> FakeCupy:
    """Put a :class:`FakeCupy` in place of CuPy for the cuda backend (with ``monkeypatch``,
    for one test; without, for the process) and return it."""
    from hetconv.backends import cuda as cuda_module

    fake = FakeCupy(count)
    replacements = {
        "_import_cupy": lambda: fake,
        "_to_device": fake_to_device,
        "_to_host": fake_to_host,
    }
    for name, value in replacements.items():
        if monkeypatch is not None:
            monkeypatch.setattr(cuda_module, name, value)
        else:
            setattr(cuda_module, name, value)
    cuda_module._availability.cache_clear()
    return fake


def _worker_main(argv: list[str]) -> int:
    """``python tests/fake_cupy.py worker [hetconv worker options]``: a cuda worker process
    whose CuPy is this fake."""
    fake = install()
    from hetconv.cli.main import main

    try:
        return main(["worker", *argv])
    finally:
        uploads, downloads = fake.crossings()
        print(f"fake cupy: {uploads} uploads, {downloads} downloads", flush=True)


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] != ["worker"]:
        raise SystemExit("usage: python tests/fake_cupy.py worker [hetconv worker options]")
    raise SystemExit(_worker_main(sys.argv[2:]))
