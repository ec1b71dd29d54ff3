"""The worker process: serve convolutions until SIGINT/SIGTERM, then stop gracefully."""

from __future__ import annotations

import signal
import sys
import threading
from typing import TextIO

from hetconv.backends import AUTO_PROBE, Backend, get_backend
from hetconv.worker.service import ConvWorkerService, WorkerConfig, start_server

#: The startup probe: C2 of the paper's 50:500 network on 8 images (16x16, 5x5 'same').
STARTUP_PROBE = AUTO_PROBE

READY = "hetconv worker ready on"


def run_worker(
    listen: str,
    backend: Backend | str = "cpu",
    config: WorkerConfig | None = None,
    out: TextIO | None = None,
    startup_probe: bool = True,
) -> int:
    """Serve on ``listen`` until SIGINT or SIGTERM; returns the process exit status.

    Prints, in this order: the device, the startup probe figure, and ``READY HOST:PORT``
    (the line a launcher waits for).
    """
    out = out if out is not None else sys.stdout
    if isinstance(backend, str):
        backend = get_backend(backend)
    service = ConvWorkerService(backend, config)
    info = backend.describe()
    print(
        f"device: {info.name} ({info.backend} backend, {info.kind}, {info.cores} cores, "
        f"{info.memory_bytes / 2**30:.1f} GiB)",
        file=out,
    )
    if startup_probe:
        seconds = backend.time_step(STARTUP_PROBE, repeats=2)
        gflops = 3 * STARTUP_PROBE.flops_forward / seconds / 1e9
        print(
            f"probe: {1e3 * seconds:.1f} ms for forward + backward of paper-50-500 C2 at batch "
            f"{STARTUP_PROBE.n} ({gflops:.0f} GFLOPS)",
            file=out,
        )
    # Handlers first: a launcher may signal the moment it reads the ready line.
    stop = threading.Event()

    def on_signal(signum, frame):
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        server, address = start_server(service, listen)
        try:
            print(f"{READY} {address}", file=out, flush=True)
            while not stop.wait(0.5):
                pass
        finally:
            service.health.enter_graceful_shutdown()
            server.stop(grace=5).wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    print(f"hetconv worker on {address} stopped after {service.requests} requests", file=out)
    return 0
