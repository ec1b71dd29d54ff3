"""What a replicated first block costs a worker against the same block computed in-process.

On the scaled testbed a worker's share of conv2 with the replicated block (``hetconv train
--replicate first``) takes about three times what its kernels alone explain: the block's
forward and backward (conv1, ReLU, LRN and pooling at full resolution) look far dearer on a
worker than on the master. This measures the block side by side, one BLAS thread each:

* in-process: ``stage_forward`` of the block, then ``stage_backward`` (kernel gradients only);
* on a real worker process (loopback): ``ReplicaForward``, then a stage call of a tiny next
  layer (2 kernels, ReLU) named as fed by the block and its backward, whose time beyond the
  tiny layer's is the block's backward; the worker's own ``compute_seconds``.

Each repeat alternates the two, so drift hits both alike; the first repeat (cold pages, empty
caches) is printed but left out of the medians.

    python benchmarks/replica_block.py [--batch 64] [--kernels 150] [--repeats 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits

from hetconv.backends import get_backend
from hetconv.master.client import WorkerClient
from hetconv.master.launch import LocalWorkers
from hetconv.replica import ReplicaBlock
from hetconv.stages import StageSpec, stage_backward, stage_forward

BLOCK = StageSpec.from_entries(
    [{"type": "relu"}, {"type": "lrn", "size": 5}, {"type": "maxpool", "kernel": 2, "stride": 2}]
)
NEXT = StageSpec.from_entries([{"type": "relu"}])
SIDES = (2, 2, 2, 2)


def problem(batch: int, kernels: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, 3, 32, 32)).astype(np.float32)
    w = (0.1 * rng.standard_normal((kernels, 3, 5, 5))).astype(np.float32)
    b = np.zeros(kernels, np.float32)
    w2 = (0.1 * rng.standard_normal((2, kernels, 3, 3))).astype(np.float32)
    b2 = np.zeros(2, np.float32)
    return x, w, b, w2, b2


def in_process(backend, x, w, b, w2, b2) -> tuple[float, float]:
    """(block forward, block backward) seconds, here."""
    k = w.shape[0]
    start = time.perf_counter()
    y, run = stage_forward(backend, x, w, b, SIDES, BLOCK, slice(0, k))
    forward = time.perf_counter() - start
    y2, run2 = stage_forward(backend, y, w2, b2, (1, 1, 1, 1), NEXT, slice(0, 2))
    dx, _, _ = stage_backward(backend, run2, np.ones_like(y2), slice(0, 2), True)
    start = time.perf_counter()
    stage_backward(backend, run, dx, slice(0, k), False)
    return forward, time.perf_counter() - start


def on_worker(client: WorkerClient, step: int, x, w, b, w2, b2) -> tuple[float, float]:
    """(block forward, block backward) seconds as the worker timed them."""
    block = ReplicaBlock("conv1", x, w, b, SIDES, BLOCK)
    forward = client.replica_forward(3, step, block).compute_seconds
    pooled = (x.shape[0], 2, 16, 16)
    shape_only = np.zeros((x.shape[0], w.shape[0], 16, 16), np.float32)  # not sent
    client.replica_forward = lambda *args, **kwargs: _Done()  # already sent for this step
    try:
        client.stage_forward(
            3, step, "conv2", shape_only, w2, b2, (1, 1, 1, 1), NEXT, slice(0, 2), replica=block
        )
    finally:
        del client.replica_forward
    rw, rb = np.empty_like(w), np.empty_like(b)
    *_, stats = client.stage_backward(
        3, step, "conv2", np.ones(pooled, np.float32), 0, False, replica=("conv1", rw, rb)
    )
    return forward, stats.compute_seconds


class _Done:
    """The figures of a ReplicaForward already made (its own were counted)."""

    bytes_sent = bytes_received = 0
    send_seconds = compute_seconds = wall_seconds = 0.0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=64, help="images (64)")
    p.add_argument("--kernels", type=int, default=150, help="the block's kernels (150)")
    p.add_argument("--repeats", type=int, default=5, help="alternating repeats (5)")
    p.add_argument("--json", metavar="PATH", help="write the rows as a JSON list")
    args = p.parse_args(argv)
    if args.batch < 1 or args.kernels < 1 or args.repeats < 2:
        p.error("--batch and --kernels must be >= 1, --repeats >= 2")
    x, w, b, w2, b2 = problem(args.batch, args.kernels)
    backend = get_backend("cpu")
    rows = {"in-process": [], "worker": []}
    with LocalWorkers(1) as workers, threadpool_limits(1):
        client = WorkerClient(workers.addresses[0])
        try:
            for step in range(args.repeats):
                rows["in-process"].append(in_process(backend, x, w, b, w2, b2))
                rows["worker"].append(on_worker(client, step, x, w, b, w2, b2))
                here, there = rows["in-process"][-1], rows["worker"][-1]
                print(
                    f"repeat {step}: in-process forward {here[0]:.3f} s backward {here[1]:.3f} s"
                    f" | worker forward {there[0]:.3f} s backward {there[1]:.3f} s"
                )
        finally:
            client.close()
    out = []
    for where, times in rows.items():
        warm = times[1:]
        out.append(
            {
                "where": where, "batch": args.batch, "kernels": args.kernels,
                "forward_s": statistics.median(t[0] for t in warm),
                "backward_s": statistics.median(t[1] for t in warm),
                "first_forward_s": times[0][0], "first_backward_s": times[0][1],
            }
        )  # fmt: skip
    here, there = out
    print(
        f"block of {args.kernels} kernels at batch {args.batch}, median of {args.repeats - 1} "
        f"warm repeats: forward {here['forward_s']:.3f} s here, {there['forward_s']:.3f} s on "
        f"the worker ({there['forward_s'] / here['forward_s']:.2f}x); backward "
        f"{here['backward_s']:.3f} s here, {there['backward_s']:.3f} s on the worker "
        f"({there['backward_s'] / here['backward_s']:.2f}x)"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
