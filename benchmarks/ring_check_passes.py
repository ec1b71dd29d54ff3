"""What the ring's spot checks cost every step, in passes over the gradient
(``hetconv.ringcheck.CHECK_BYTES_PER_S``, the simulator's figure): the master's check of the
sum (its digest, the sketches' seed, taken once, and the sketch of the sum against every
contribution's) and a worker's sketch answer of its own gradient (the sum's digest and the
sketches of its own), timed on random gradients of each network's size, one thread, in this
process.

    python benchmarks/ring_check_passes.py [--network paper-150-800 paper-500-1500 resnet20
        vgg11] [--workers 4] [--repeats 7] [--json PATH]

A row per network and side: the gradient's MB, the least of the repeats' milliseconds, the
bytes per second of a whole core, and that over ``CHECK_BYTES_PER_S`` (above 1: faster than
the simulator counts). Under the testbed's cap (a fraction of a core) each takes its time
divided by the cap.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import numpy as np
from threadpoolctl import threadpool_limits

from hetconv.imagesplit import parameter_shapes
from hetconv.model import CIFAR_INPUT
from hetconv.onnx_import import load_network
from hetconv.ringcheck import CHECK_BYTES_PER_S, sketch_answer, sketch_seed, sum_differs


def gradient_values(network: str) -> int:
    named = load_network(network)
    shapes, _ = parameter_shapes(named.spec, named.input_shape or CIFAR_INPUT)
    return sum(math.prod(s) for s in shapes.values())


def least_seconds(work, repeats: int) -> float:
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - start)
    return best


def rows_for(network: str, workers: int, repeats: int) -> list[dict]:
    rng = np.random.default_rng(0)
    size = gradient_values(network)
    parts = [rng.standard_normal(size).astype(np.float32) for _ in range(workers)]
    summed = np.sum(parts, axis=0, dtype=np.float32)
    answers = [sketch_answer(p, summed) for p in parts]

    def master() -> None:
        sum_differs(summed, answers, sketch_seed(summed))

    def worker() -> None:
        sketch_answer(parts[0], summed)

    out = []
    for side, work in (("master", master), ("worker", worker)):
        seconds = least_seconds(work, repeats)
        rate = 4 * size / seconds
        out.append({
            "network": network, "side": side, "values": size, "mb": 4 * size / 1e6,
            "ms": 1e3 * seconds, "bytes_per_s": rate, "over_model": rate / CHECK_BYTES_PER_S,
        })  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    networks = ["paper-150-800", "paper-500-1500", "resnet20", "vgg11"]
    parser.add_argument("--network", nargs="+", default=networks, help="presets (these four)")
    parser.add_argument("--workers", type=int, default=4, help="contributions to the sum (4)")
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per side (7)")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as a JSON list")
    args = parser.parse_args()
    rows = []
    print(f"{'network':16} {'side':7} {'MB':>7} {'ms':>8} {'MB/s a core':>12} {'/ model':>8}")
    with threadpool_limits(1):
        for network in args.network:
            for row in rows_for(network, args.workers, args.repeats):
                rows.append(row)
                print(f"{network:16} {row['side']:7} {row['mb']:7.1f} {row['ms']:8.1f} "
                      f"{row['bytes_per_s'] / 1e6:12.0f} {row['over_model']:8.2f}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
