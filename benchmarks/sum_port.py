"""Batch norm's small sums among a ring's workers: frames on the workers' sum ports
(:mod:`hetconv.worker.summesh`) against ``RingPart`` gRPC calls, side by side in one run.

Starts ``--ranks`` worker services in this process, each with its gRPC server and its sum
port on loopback, and runs ``--sums`` float64 sums of ``--values`` values
(:meth:`hetconv.worker.ring.RingCalls.sum64`, the call batch norm makes mid-pass) on every
rank at once, each rank on a thread: once with the request's ``sum_ports`` (frames), once
without (``RingPart`` calls), in turn, ``--rounds`` times. A row per way: the wall time per sum
(the slowest rank's) and the CPU time of the whole process per sum and rank (every rank's
software: the sum's own, its parts out and in, the wake-ups), and how many times the frames
beat the calls. The ranks share this machine's cores and one interpreter, so the absolute
figures are a loaded machine's; the ratio is the point.

Measured (2 cores, 64 values, 300 sums, 2026-11-28): 4 ranks, 0.62 ms a sum (0.19 ms of CPU
per rank) on the sum ports against 5.31 ms (1.75 ms) as RingPart calls, 8.5x; 2 ranks, 0.12
against 1.21 ms, 9.9x.

    python benchmarks/sum_port.py [--ranks 4] [--values 64] [--sums 300] [--rounds 2]
        [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import threading
import time

import numpy as np

from hetconv.backends import get_backend
from hetconv.proto import worker_pb2 as pb
from hetconv.ring import ROUNDS_PER_SUM
from hetconv.worker import service as service_module

WAYS = ("sum port", "RingPart calls")


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _run(services, addresses, ports, sums: int, values: int, session: int) -> tuple[float, float]:
    """(wall seconds per sum, CPU seconds per sum and rank) of ``sums`` sums on every rank."""
    ranks = len(services)
    walls = [0.0] * ranks
    errors: list[BaseException] = []
    vector = np.random.default_rng(0).random(values)
    start = threading.Barrier(ranks)

    def rank(r: int) -> None:
        calls = services[r].context.ring
        calls.begin(session, 1)
        ring = pb.ImagesRing(peers=addresses, rank=r, wait_seconds=30, sum_ports=ports)
        request = pb.ConvRequest(session=session, step=1, images=pb.ImagesStep(ring=ring))
        try:
            start.wait()
            began = time.perf_counter()
            for k in range(1, sums + 1):
                calls.sum64(request, vector, k * ROUNDS_PER_SUM)
            walls[r] = time.perf_counter() - began
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    cpu = _cpu()
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return max(walls) / sums, (_cpu() - cpu) / sums / ranks


def measure(ranks: int, values: int, sums: int, rounds: int) -> list[dict]:
    services, servers, addresses = [], [], []
    try:
        for _ in range(ranks):
            service = service_module.ConvWorkerService(get_backend("cpu"))
            server, address = service_module.start_server(service, "127.0.0.1:0")
            services.append(service)
            servers.append(server)
            addresses.append(address)
        ports = [s.sum_port for s in services]
        got: dict[str, list[tuple[float, float]]] = {way: [] for way in WAYS}
        session = 1
        for _ in range(rounds):
            for way, given in zip(WAYS, (ports, []), strict=True):
                session += 1  # each run a session of its own (its parts apart)
                got[way].append(_run(services, addresses, given, sums, values, session))
    finally:
        for server in servers:
            server.stop(0)
        for service in services:
            service.close()
    wall = {w: statistics.median(x[0] for x in got[w]) for w in WAYS}
    cpu = {w: statistics.median(x[1] for x in got[w]) for w in WAYS}
    return [
        {
            "way": way,
            "ranks": ranks,
            "values": values,
            "sums": sums,
            "rounds": rounds,
            "wall_ms_per_sum": 1e3 * wall[way],
            "cpu_ms_per_sum_rank": 1e3 * cpu[way],
            "wall_x": wall[WAYS[1]] / wall[way],
            "cpu_x": cpu[WAYS[1]] / cpu[way],
        }  # fmt: skip
        for way in WAYS
    ]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python benchmarks/sum_port.py",
        description="Batch norm's small sums among worker services in this process: frames on "
        "their sum ports against RingPart gRPC calls, side by side (see the module docstring).",
    )
    p.add_argument("--ranks", type=int, default=4, help="worker services, the ring's ranks (4)")
    p.add_argument("--values", type=int, default=64, help="float64 values a sum adds (64)")
    p.add_argument("--sums", type=int, default=300, help="sums per run (300)")
    p.add_argument("--rounds", type=int, default=2, help="runs of each way, alternating (2)")
    p.add_argument("--json", help="also write the rows to this file")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.ranks < 2 or args.values < 1 or args.sums < 1 or args.rounds < 1:
        build_parser().error("--ranks must be >= 2; --values, --sums and --rounds >= 1")
    rows = measure(args.ranks, args.values, args.sums, args.rounds)
    print(f"{args.ranks} ranks, {args.values} values a sum, {args.sums} sums, median of "
          f"{args.rounds} run(s) each")  # fmt: skip
    print(f"{'way':16} {'wall ms/sum':>12} {'cpu ms/sum/rank':>16} {'x calls (wall, cpu)':>20}")
    for row in rows:
        print(f"{row['way']:16} {row['wall_ms_per_sum']:12.3f} "
              f"{row['cpu_ms_per_sum_rank']:16.3f} "
              f"{row['wall_x']:9.2f} {row['cpu_x']:9.2f}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
