"""Round-trip throughput of hetconv's tensor path vs a raw TCP socket, on loopback.

Both servers run in their own process and echo what they receive: the raw one with
``recv_into`` a preallocated buffer and ``sendall`` from it (the fastest Python can move bytes),
ours as a real ``hetconv`` worker answering the Echo call with the same code path that carries
convolution inputs and feature maps (header, 1 MiB chunks, receive straight into preallocated
arrays). Rows interleave the two so drift on a shared machine hits both alike.

    python benchmarks/transport.py [--sizes 1 16 64 256] [--repeats 3] [--json PATH]

The throughput counts the bytes of both directions over the round trip's wall time. A first
line gives the per-call cost: the round trip of a 4-byte tensor through a raw socket, through
the one-message (bundle) call ours uses up to 1 MiB, and through the streaming call.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import struct
import time

import numpy as np

from hetconv.backends import get_backend
from hetconv.master.client import WorkerClient
from hetconv.worker.service import ConvWorkerService, start_server

_LENGTH = struct.Struct("<Q")


def _recv_exact(conn: socket.socket, view: memoryview) -> None:
    while view.nbytes:
        n = conn.recv_into(view)
        if n == 0:
            raise ConnectionError("peer closed")
        view = view[n:]


def _raw_server(ready) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    ready.put(listener.getsockname()[1])
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    header = bytearray(_LENGTH.size)
    buffer = bytearray(0)
    while True:
        try:
            _recv_exact(conn, memoryview(header))
        except ConnectionError:
            return
        (size,) = _LENGTH.unpack(header)
        if len(buffer) < size:
            buffer = bytearray(size)
        view = memoryview(buffer)[:size]
        _recv_exact(conn, view)
        conn.sendall(view)


def _grpc_server(ready) -> None:
    server, address = start_server(ConvWorkerService(get_backend("cpu")), "127.0.0.1:0")
    ready.put(address)
    server.wait_for_termination()


def raw_round_trip(conn: socket.socket, array: np.ndarray, back: np.ndarray) -> float:
    start = time.perf_counter()
    conn.sendall(_LENGTH.pack(array.nbytes))
    conn.sendall(memoryview(array).cast("B"))
    _recv_exact(conn, memoryview(back).cast("B"))
    return time.perf_counter() - start


def ours_round_trip(client: WorkerClient, array: np.ndarray) -> float:
    start = time.perf_counter()
    (back,), _ = client.echo([("a", array)])
    seconds = time.perf_counter() - start
    assert back.nbytes == array.nbytes
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 16, 64, 256], help="MiB")
    parser.add_argument("--repeats", type=int, default=3, help="best of this many, per size")
    parser.add_argument("--json", metavar="PATH", help="write the rows as a JSON list")
    args = parser.parse_args()

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    servers = [ctx.Process(target=f, args=(queue,), daemon=True) for f in (_raw_server,)]
    servers[0].start()
    raw_port = queue.get(timeout=60)
    servers.append(ctx.Process(target=_grpc_server, args=(queue,), daemon=True))
    servers[1].start()
    address = queue.get(timeout=60)

    conn = socket.create_connection(("127.0.0.1", raw_port))
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    client = WorkerClient(address)
    client.describe()

    # Call overhead: a 4-byte tensor's round trip, one message each way vs a stream vs raw.
    tiny, tiny_back = np.ones(1, np.float32), np.empty(1, np.float32)
    latency = {}
    for name, call in (
        ("raw", lambda: raw_round_trip(conn, tiny, tiny_back)),
        ("bundle", lambda: client.echo([("t", tiny)])),
        ("stream", lambda: client.echo([("t", tiny)], stream=True)),
    ):
        for _ in range(20):
            call()
        start = time.perf_counter()
        for _ in range(200):
            call()
        latency[name] = (time.perf_counter() - start) / 200
    print(
        "call round trip of 4 bytes: "
        + ", ".join(f"{name} {1e3 * s:.2f} ms" for name, s in latency.items())
    )

    rows = []
    print(f"{'MiB':>5} {'ours MB/s':>10} {'raw MB/s':>10} {'ours/raw':>9}")
    for mib in args.sizes:
        array = np.random.default_rng(0).standard_normal(mib << 18, dtype=np.float32)
        back = np.empty_like(array)
        raw_round_trip(conn, array, back)  # warm both paths once
        ours_round_trip(client, array)
        raw_best = ours_best = float("inf")
        for _ in range(args.repeats):
            raw_best = min(raw_best, raw_round_trip(conn, array, back))
            ours_best = min(ours_best, ours_round_trip(client, array))
        if not np.array_equal(back, array):
            raise RuntimeError("raw echo corrupted the data")
        moved = 2 * array.nbytes
        row = {
            "size_mib": mib,
            "ours_mbps": moved / ours_best / 1e6,
            "raw_mbps": moved / raw_best / 1e6,
            "ratio": raw_best / ours_best,
            "ours_seconds": ours_best,
            "raw_seconds": raw_best,
            # per-call cost (4-byte round trip), the same in every row
            **{f"{name}_call_ms": 1e3 * seconds for name, seconds in latency.items()},
        }
        rows.append(row)
        print(f"{mib:>5} {row['ours_mbps']:>10.0f} {row['raw_mbps']:>10.0f} {row['ratio']:>9.2f}")
    conn.close()
    client.close()
    for p in servers:
        p.terminate()
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
