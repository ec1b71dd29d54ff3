"""The worker process: serve convolutions until SIGINT/SIGTERM, then stop gracefully.

Stopping is bounded whatever the worker waits on: the calls in flight get
:data:`SHUTDOWN_GRACE` seconds to end, then are cancelled (a call waiting on a peer's part ends
with its call); a thread still busy after that (a device job, a send to a peer that never
answers) does not hold the process: :func:`exit_within` ends it :data:`EXIT_WITHIN` seconds
later.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

from hetconv.backends import AUTO_PROBE, Backend, get_backend
from hetconv.calls import READY
from hetconv.worker.advertise import (
    Advertisement,
    addresses_line,
    reachable_addresses,
    txt_properties,
)
from hetconv.worker.auth import WorkerSecurity, open_worker_warning
from hetconv.worker.service import ConvWorkerService, WorkerConfig, start_server

#: The startup probe: C2 of the paper's 50:500 network on 8 images (16x16, 5x5 'same').
STARTUP_PROBE = AUTO_PROBE

#: The most one request may hold by default, whatever the memory: 2 GiB.
MAX_REQUEST_CAP = 2 << 30

#: Seconds the calls in flight get to end once a worker is told to stop; then they are cancelled.
SHUTDOWN_GRACE = 3.0
#: Seconds a stopped worker's process may take to exit (:func:`exit_within`).
EXIT_WITHIN = 2.0


def available_memory_bytes(meminfo: str | os.PathLike = "/proc/meminfo") -> int | None:
    """Memory the system can give a process now without swapping, or None if unknown.

    Linux: ``MemAvailable`` of ``/proc/meminfo``; other POSIX systems: free physical pages
    (``SC_AVPHYS_PAGES``, an underestimate: caches count as used); Windows: the available
    physical memory of ``GlobalMemoryStatusEx``.
    """
    try:
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # the figure is in kB
    except (OSError, ValueError, IndexError):
        pass
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))
    except (AttributeError, ValueError, OSError):  # Windows has no sysconf; macOS no AVPHYS
        pass
    if sys.platform == "win32":
        import ctypes

        class MemoryStatus(ctypes.Structure):
            _fields_ = [
                ("dwLength", ctypes.c_ulong),
                ("dwMemoryLoad", ctypes.c_ulong),
                ("ullTotalPhys", ctypes.c_ulonglong),
                ("ullAvailPhys", ctypes.c_ulonglong),
                ("ullTotalPageFile", ctypes.c_ulonglong),
                ("ullAvailPageFile", ctypes.c_ulonglong),
                ("ullTotalVirtual", ctypes.c_ulonglong),
                ("ullAvailVirtual", ctypes.c_ulonglong),
                ("ullAvailExtendedVirtual", ctypes.c_ulonglong),
            ]

        status = MemoryStatus(dwLength=ctypes.sizeof(MemoryStatus))
        if ctypes.windll.kernel32.GlobalMemoryStatusEx(ctypes.byref(status)):
            return int(status.ullAvailPhys)
    return None


def default_max_request_bytes(available: int | None = None) -> int:
    """A worker's default request limit: the smaller of 2 GiB and half of ``available``
    (default: :func:`available_memory_bytes` now), so one request (kept until its Backward,
    next to its answer) cannot push the machine into swap; 2 GiB when memory is unknown."""
    available = available_memory_bytes() if available is None else available
    if available is None:
        return MAX_REQUEST_CAP
    return max(1 << 20, min(MAX_REQUEST_CAP, available // 2))


#: The memory budget when the memory available is unknown: 4 GiB.
UNKNOWN_MEMORY_BUDGET = 4 << 30


def default_memory_bytes(available: int | None = None) -> int:
    """A worker's default memory budget (``--memory-mib``): half of ``available`` (default:
    :func:`available_memory_bytes` now), at least 64 MiB; 4 GiB when memory is unknown."""
    available = available_memory_bytes() if available is None else available
    if available is None:
        return UNKNOWN_MEMORY_BUDGET
    return max(64 << 20, available // 2)


#: What BLAS and OpenMP libraries read for their thread count when they load.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")

_thread_limit = None  # threadpoolctl's limiter, held for the process's life


def limit_threads(threads: int | None) -> str:
    """Give the BLAS and OpenMP libraries loaded in this process ``threads`` threads (None:
    leave their default, one per core) and return the line the worker prints about it, read
    back from the libraries themselves.

    The environment variables are read only when a library loads (numpy's BLAS is loaded
    long before the command line is parsed), so the limit is set in the loaded libraries
    through ``threadpoolctl``; the variables are set too, for anything loaded later.
    """
    global _thread_limit
    from threadpoolctl import threadpool_info, threadpool_limits

    if threads is not None:
        if threads < 1:
            raise ValueError(f"--threads {threads}: expected 1 or more")
        _thread_limit = threadpool_limits(limits=threads)
        os.environ.update(dict.fromkeys(THREAD_VARIABLES, str(threads)))
    pools = threadpool_info()
    # numpy and scipy may each bundle their own copy of one library: name each count once
    found = dict.fromkeys(f"{p['internal_api']} {p['num_threads']}" for p in pools)
    counts = ", ".join(found) or "none found"
    why = f"--threads {threads}" if threads is not None else "the default; --threads N to change"
    return f"threads: {counts} ({why})"


def _set_at_end_of_input(stop: threading.Event) -> None:
    """Read standard input to its end (whatever it holds is ignored), then set ``stop``.

    It reads the file descriptor itself, not ``sys.stdin``'s buffered reader: this daemon
    thread, blocked in a read at interpreter shutdown, would hold that reader's lock, and the
    shutdown's flush of it then ends the process with "Fatal Python error:
    _enter_buffered_busy" (seen when a launcher stopped a worker with SIGTERM)."""
    try:
        fd = sys.stdin.fileno()
        while os.read(fd, 1 << 16):
            pass
    except (OSError, ValueError, AttributeError):  # closed, or not a real file: stop too
        pass
    stop.set()


def _with_limits(
    config: WorkerConfig | None,
    sessions: int | None = None,
    memory_bytes: int | None = None,
    **limits,
) -> tuple[WorkerConfig, str, str]:
    """The worker's config: ``config`` (default: the request limit from
    :func:`default_max_request_bytes`, at most the memory budget), with ``sessions``,
    ``memory_bytes`` (default: :func:`default_memory_bytes`, at least the request limit) and
    ``limits`` (other :class:`WorkerConfig` fields; an ``idle_timeout`` of 0: never) where
    given; and the request limit and the
    memory budget as the worker prints them.

    Raises:
        ValueError: a request limit over the memory budget, both given.
    """
    given = config is not None and memory_bytes is not None
    available = None if given else available_memory_bytes()
    half = (
        f"half the {available / 2**30:.1f} GiB available at start"
        if available is not None
        else "available memory unknown"
    )
    memory_why = ""
    if memory_bytes is None:
        memory_bytes = default_memory_bytes(available)
        if config is not None:  # a request limit given: the budget holds at least one request
            memory_bytes = max(memory_bytes, config.max_request_bytes)
        memory_why = f" ({half}; --memory-mib sets it)"
    changes = {k: v for k, v in limits.items() if v is not None}
    if changes.get("idle_timeout") == 0:  # 0: never
        changes["idle_timeout"] = None
    if sessions is not None:
        changes["sessions"] = sessions
    changes["memory_bytes"] = memory_bytes
    if config is not None:
        config = dataclasses.replace(config, **changes)
        limit = f"{config.max_request_bytes >> 20} MiB"
    else:
        request = min(default_max_request_bytes(available), memory_bytes)
        config = WorkerConfig(max_request_bytes=request, **changes)
        limit = (
            f"{config.max_request_bytes >> 20} MiB (the smaller of 2048 MiB, {half} and the "
            "memory budget; --max-request-mib sets it)"
        )
    memory = (
        f"{config.memory_bytes >> 20} MiB{memory_why} for requests in flight, their answers, "
        "saved forward states, resident slices, parts from peers and device scratch; at most "
        f"{config.max_calls} calls at once "
        "(--max-calls), "
        + (
            f"each ended after {config.idle_timeout:g} s idle on its client (--idle-timeout)"
            if config.idle_timeout
            else "never ended for idling (--idle-timeout 0)"
        )
    )
    return config, limit, memory


def _print_device(backend: Backend, startup_probe: bool, out: TextIO) -> None:
    """The device line and, with ``startup_probe``, the probe's figure."""
    info = backend.describe()
    print(
        f"device: {info.name} ({info.backend} backend, {info.kind}, {info.cores} cores, "
        f"{info.memory_bytes / 2**30:.1f} GiB)",
        file=out,
    )
    if startup_probe:
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
        seconds = backend.time_step(STARTUP_PROBE, repeats=2)
        gflops = 3 * STARTUP_PROBE.flops_forward / seconds / 1e9
        # The same probe as `hetconv devices` (and what `hetconv plan --worker` takes), but
        # timed now, with this worker's threads, beside whatever else this machine runs.
        busy = (
            f"; this one is busy now (load {load:.1f} on {os.cpu_count()} cores), so it reads low"
            if load >= 0.5 * (os.cpu_count() or 1)
            else ""
        )
        print(
            f"probe: {1e3 * seconds:.1f} ms for forward + backward of paper-50-500 C2 at batch "
            f"{STARTUP_PROBE.n} ({gflops:.0f} GFLOPS with the threads above, best of 2: the "
            "probe `hetconv devices` times, whose figure on an idle machine `hetconv plan "
            f"--worker` takes{busy})",
            file=out,
        )


def _announce(
    address: str,
    backend: Backend,
    security: WorkerSecurity,
    service: ConvWorkerService,
    advertise: bool,
    out: TextIO,
    err: TextIO,
) -> Advertisement | None:
    """Print the addresses masters should use and, with ``advertise``, register the worker
    for discovery; the advertisement (None: not advertised, and a line says why)."""
    host, _, port = address.rpartition(":")
    reachable = reachable_addresses(host)
    print(addresses_line(host, int(port), reachable), file=out)
    beyond = [a for a in reachable if not a.loopback]
    if not advertise:
        print("not advertised on the LAN (--no-advertise)", file=out)
        return None
    if not beyond:
        print("not advertised on the LAN: it listens on loopback only", file=out)
        return None
    info = backend.describe()
    properties = txt_properties(
        info.backend, info.name, security.token is not None, service.instance_id
    )
    try:
        advertisement = Advertisement(int(port), beyond, properties, service.instance_id)
    except Exception as e:  # discovery is a convenience: the worker serves without it
        print(
            f"not advertised on the LAN: multicast DNS failed ({type(e).__name__}: {e}); "
            "masters can still name it with --worker",
            file=err,
        )
        return None
    print(
        f"advertised on the LAN as {advertisement.name!r} on "
        f"{', '.join(advertisement.addresses)} (`hetconv train --discover` finds it; "
        "--no-advertise to stop that)",
        file=out,
    )
    return advertisement


def _serve_until(
    stop: threading.Event, service: ConvWorkerService, report_every: float, out: TextIO
) -> None:
    """Wait for ``stop``, printing what was served every ``report_every`` seconds (0: never)
    in which anything was."""
    last = time.monotonic()
    while not stop.wait(0.5):
        now = time.monotonic()
        if report_every and now - last >= report_every:
            summary = service.activity.take(now - last)
            last = now
            if summary.requests:
                print(summary.describe(), file=out, flush=True)


def _print_limits(
    config: WorkerConfig, limit: str, memory: str, security: WorkerSecurity, out: TextIO
) -> None:
    """The request limit, the memory budget, the sessions kept and the security in force."""
    print(f"max request: {limit}", file=out)
    print(f"memory: {memory}", file=out)
    print(f"sessions: {config.sessions} masters at once (--sessions sets it)", file=out)
    print(security.describe(), file=out)


def _print_stopped(line: str, out: TextIO) -> None:
    """The last line, to a launcher that may be gone already."""
    try:
        print(line, file=out)
        out.flush()
    except (BrokenPipeError, ValueError):
        # The launcher that read our output is gone (the usual way --exit-on-stdin-close
        # fires); the Python docs' recipe keeps the exit-time flush from failing too.
        if out is sys.stdout:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


@contextmanager
def _stop_on_signals(exit_on_stdin_close: bool) -> Iterator[threading.Event]:
    """An event that SIGINT and SIGTERM set (and, with ``exit_on_stdin_close``, the end of
    standard input); the signals' previous handlers come back after."""
    stop = threading.Event()

    def on_signal(signum, frame):
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    if exit_on_stdin_close:
        threading.Thread(target=_set_at_end_of_input, args=(stop,), daemon=True).start()
    try:
        yield stop
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def exit_within(status: int, seconds: float = EXIT_WITHIN) -> None:
    """End this process with ``status`` ``seconds`` from now unless it has exited by then.

    A stopped worker's process exits once its threads have: the server's handler threads
    (joined at exit) and the peer senders. One still waiting -- on a device job, on a peer
    that never answers -- would hold the exit for as long; this bounds it. For the process that
    runs the worker only (``hetconv worker``), after :func:`run_worker` has returned.
    """

    def end() -> None:
        time.sleep(seconds)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(status)

    threading.Thread(target=end, name="hetconv-exit", daemon=True).start()


def run_worker(
    listen: str,
    backend: Backend | str = "cpu",
    config: WorkerConfig | None = None,
    out: TextIO | None = None,
    startup_probe: bool = True,
    security: WorkerSecurity | None = None,
    err: TextIO | None = None,
    exit_on_stdin_close: bool = False,
    sessions: int | None = None,
    memory_bytes: int | None = None,
    idle_timeout: float | None = None,
    max_calls: int | None = None,
    advertise: bool = True,
    report_every: float = 30.0,
    sum_port: int = 0,
) -> int:
    """Serve on ``listen`` until SIGINT or SIGTERM; returns the process exit status.

    Prints, in this order: the device, the startup probe figure, the request limit, the
    memory budget, the sessions kept, the security in force, the addresses masters should use
    (``masters use: ...``), whether it is advertised on the LAN, its sum port, and ``READY
    HOST:PORT`` (the line a launcher waits for); then, every ``report_every`` seconds in
    which it served anything, one line of what it served. A worker that the network can
    reach without a token also warns on ``err`` (default: stderr).

    Args:
        config: limits; None: the defaults, with the request limit from
            :func:`default_max_request_bytes`.
        security: token and TLS; None: neither.
        sessions: masters whose forward inputs it keeps at once (None: ``config``'s).
        memory_bytes: the memory budget (None: :func:`default_memory_bytes`).
        idle_timeout: seconds a call may wait on its client (None: ``config``'s; 0: never).
        max_calls: calls in flight at once (None: ``config``'s).
        exit_on_stdin_close: also stop when standard input reaches end of file. A launcher
            that keeps a pipe to it open takes the worker down when it ends by any means,
            SIGKILL included (the kernel closes the pipe).
        advertise: register the worker for DNS-SD/mDNS discovery (``hetconv train
            --discover``) when it listens beyond loopback (:mod:`.advertise`).
        report_every: seconds between activity lines (requests, MB in and out, masters);
            0: none.
        sum_port: the TCP port of the ring's parts (:mod:`.summesh`); 0: a free one.
    """
    out = out if out is not None else sys.stdout
    err = err if err is not None else sys.stderr
    security = security or WorkerSecurity()
    if isinstance(backend, str):
        backend = get_backend(backend)
    config, limit, memory = _with_limits(
        config, sessions, memory_bytes, idle_timeout=idle_timeout, max_calls=max_calls
    )
    service = ConvWorkerService(backend, config)
    _print_device(backend, startup_probe, out)
    _print_limits(config, limit, memory, security, out)
    # Handlers first: a launcher may signal the moment it reads the ready line.
    with _stop_on_signals(exit_on_stdin_close) as stop:
        advertisement = None
        server, address = start_server(service, listen, security, sum_port)
        try:
            warning = open_worker_warning(address, security)  # names the port bound, not 0
            if warning is not None:
                print(warning, file=err, flush=True)
            advertisement = _announce(address, backend, security, service, advertise, out, err)
            if service.sum_port:
                print(f"ring sums: TCP port {service.sum_port} (--sum-port)", file=out,
                      flush=True)  # fmt: skip
            print(f"{READY} {address}", file=out, flush=True)
            _serve_until(stop, service, report_every, out)
        finally:
            if advertisement is not None:
                advertisement.close()
            service.health.enter_graceful_shutdown()
            server.stop(grace=SHUTDOWN_GRACE).wait()
            service.close()
    _print_stopped(f"hetconv worker on {address} stopped after {service.requests} requests", out)
    return 0
