"""What running a worker's fused stage in image groups costs in compute (``--overlap``).

An overlapped stage call (:mod:`hetconv.overlap`) runs its stage on groups of a few images so
that each group's output travels while the next computes, and starts each group's backward as
soon as its rows of the gradient are in. The transfer it hides is what it gains; what it adds
is compute per group. This times, on one BLAS thread and the cpu backend, a worker's stage
(convolution, ReLU, LRN, max-pool) forward and backward (the input gradient too) over the
whole batch and through the worker's own group code (:func:`worker.overlap.forward_groups`
and :class:`worker.overlap.GroupedBackward`, on a device thread as the worker runs them),
alternating, and prints the medians and their ratio (grouped / whole; 1.00 = groups cost
nothing). Every row also checks that the grouped results equal the whole batch's to float32
round-off (it exits non-zero when they do not).

    python benchmarks/overlap_groups.py [--networks paper-150-800 paper-500-1500]
        [--batches 16 64] [--kernels 160 800] [--repeats 5] [--json PATH]

``--kernels`` is the slice a worker holds of the second convolution (paper-150-800's 800
kernels: a fifth of them is one of four workers and the master; all of them is one worker
that computes everything); the group size is what ``--overlap on`` uses for the batch
(:func:`hetconv.overlap.group_images`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hetconv.backends.cpu import CpuBackend  # noqa: E402
from hetconv.model import PRESETS  # noqa: E402
from hetconv.overlap import group_images  # noqa: E402
from hetconv.stages import StageSpec, stage_backward, stage_forward  # noqa: E402
from worker.overlap import GroupedBackward, forward_groups, image_groups  # noqa: E402

#: Grouped results against whole ones, relative to the largest whole value: the same sums in
#: other orders (a GEMM over fewer images may block differently; kernel gradients add up group
#: by group), float32 round-off.
TOLERANCE = 1e-4


class DeviceThread:
    """The part of a worker's service the group code uses: its backend, and one thread that
    runs the device work in order."""

    def __init__(self, backend):
        self.backend = backend
        self._pool = ThreadPoolExecutor(1)

    def submit(self, fn):
        return self._pool.submit(fn)

    def close(self):
        self._pool.shutdown()


class Arrived:
    """A gradient whose rows have all arrived (the receive loop's view of it)."""

    def __init__(self, dy):
        self.arrays = [dy]

    def rows_in(self, index):
        return self.arrays[index].shape[0]

    def decode_rows(self, index, rows):
        pass


def second_stage(network: str):
    """(input channels, kernels, input side, StageSpec) of the network's second convolution."""
    spec = PRESETS[network]
    convs = [i for i, e in enumerate(spec) if e["type"] == "conv"]
    first, second = convs[0], convs[1]
    chain = spec[second + 1 : second + 4]
    return spec[first]["out"], spec[second]["out"], StageSpec.from_entries(chain)


def measure(network: str, batch: int, kernels: int, repeats: int) -> dict:
    channels, _, spec = second_stage(network)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, channels, 16, 16), dtype=np.float32)
    w = rng.standard_normal((kernels, channels, 5, 5), dtype=np.float32) * np.float32(0.01)
    b = rng.standard_normal(kernels, dtype=np.float32)
    own, pad = slice(0, kernels), (2, 2, 2, 2)
    backend = CpuBackend()
    service = DeviceThread(backend)
    images = group_images(batch)
    groups = image_groups(batch, images)
    dy = rng.standard_normal((batch, kernels, 8, 8), dtype=np.float32)

    def whole():
        y, run = stage_forward(backend, x, w, b, pad, spec, own)
        return y, stage_backward(backend, run, dy, own, True)

    def grouped():
        kept = []
        outputs = forward_groups(service, x, w, b, pad, spec, own, groups, kept.append)
        y = np.concatenate(list(outputs))
        backward = GroupedBackward(service.submit, backend, kept[0], own, True)
        backward.progress(Arrived(dy))
        return y, backward.result()

    whole_s, grouped_s = [], []
    try:
        for i in range(repeats + 1):
            start = time.perf_counter()
            y_whole, (dx_whole, dw_whole, db_whole) = whole()
            middle = time.perf_counter()
            y_groups, (dx_groups, dw_groups, db_groups) = grouped()
            end = time.perf_counter()
            pairs = (
                ("output", y_whole, y_groups), ("input gradient", dx_whole, dx_groups),
                ("dw", dw_whole, dw_groups), ("db", db_whole, db_groups),
            )  # fmt: skip
            for name, a, c in pairs:
                if np.abs(a - c).max() > TOLERANCE * max(float(np.abs(a).max()), 1e-6):
                    raise SystemExit(f"{network} batch {batch}: grouped {name} differs from whole")
            if i:  # the first repeat is cold
                whole_s.append(middle - start)
                grouped_s.append(end - middle)
    finally:
        service.close()
    whole_med, grouped_med = statistics.median(whole_s), statistics.median(grouped_s)
    return {
        "network": network,
        "batch": batch,
        "kernels": kernels,
        "group_images": images,
        "groups": len(groups),
        "whole_s": round(whole_med, 5),
        "grouped_s": round(grouped_med, 5),
        "ratio": round(grouped_med / whole_med, 3),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--networks", nargs="+", default=["paper-150-800", "paper-500-1500"])
    parser.add_argument("--batches", nargs="+", type=int, default=[16, 64])
    parser.add_argument(
        "--kernels", nargs="+", type=int, default=[160, 800],
        help="second-convolution kernels the worker holds (capped at the layer's)",
    )  # fmt: skip
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if min(args.batches) < 2:
        parser.error("--batches must be >= 2 (a batch of one image makes one group)")
    if min(args.kernels) < 1:
        parser.error("--kernels must be >= 1")
    for network in args.networks:
        if network not in PRESETS:
            parser.error(f"--networks: unknown {network!r}; one of {', '.join(PRESETS)}")
    rows = []
    print(f"{'network':16s} {'batch':>5s} {'kernels':>7s} {'groups':>9s} | "
          f"{'whole s':>8s} {'grouped s':>9s} {'ratio':>6s}")  # fmt: skip
    with threadpool_limits(1):
        for network in args.networks:
            layer_kernels = second_stage(network)[1]
            for batch in args.batches:
                for kernels in sorted({min(k, layer_kernels) for k in args.kernels}):
                    row = measure(network, batch, kernels, args.repeats)
                    rows.append(row)
                    print(
                        f"{network:16s} {batch:5d} {kernels:7d} "
                        f"{row['groups']:3d} of {row['group_images']:2d} | "
                        f"{row['whole_s']:8.3f} {row['grouped_s']:9.3f} {row['ratio']:6.2f}",
                        flush=True,
                    )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
