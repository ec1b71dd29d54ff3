"""The channel-local chain (ReLU, LRN, max-pool) run whole against image chunks.

``hetconv.layers.ImageChunks`` runs a chain of image-local layers a few images at a time
(``--chunk-mb`` of input per chunk) instead of each layer over the whole batch: the same
operations on every value, so the results are bit for bit equal (checked here on every row),
but a chunk's arrays stay in cache and its temporaries are reused by the allocator instead of
faulting fresh pages in every step. Every node runs these chains: the master alone on every
layer, each node on its kernel slice of a fused stage, and every node on the whole first
block when it is replicated (paper-500-1500 at batch 64: 500 channels at 32x32).

For each reference network, batch and layer (conv1's chain at 32x32, conv2's at 16x16), one
BLAS thread, it times forward + backward of the chain whole and chunked, alternating, and
prints the medians and their ratio (the first repeat, cold, is left out). With ``--threads N``
(N > 1) it also times the chunks at N BLAS threads, which run the chunks on N threads at once,
in the same alternation, and prints that median and its ratio to the chunks at one thread.

    python benchmarks/chain_chunks.py [--networks paper-150-800 paper-500-1500]
        [--batches 16 64] [--repeats 5] [--chunk-mb 1] [--threads 2] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits

from hetconv.layers import ImageChunks, LocalResponseNorm, MaxPool2d, ReLU
from hetconv.model import PRESETS


def chain():
    return [ReLU("relu"), LocalResponseNorm("lrn", 5), MaxPool2d("pool", 2, 2)]


def run(layers, x, dy):
    for layer in layers:
        x = layer.forward(x)
    for layer in reversed(layers):
        dy = layer.backward(dy)
    return x, dy


def measure(
    channels: int, hw: int, batch: int, repeats: int, chunk_bytes: int, threads: int = 1
) -> dict:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, channels, hw, hw), dtype=np.float32)
    dy = rng.standard_normal((batch, channels, hw // 2, hw // 2), dtype=np.float32)
    whole_s, chunks_s, threaded_s = [], [], []
    for i in range(repeats + 1):
        start = time.perf_counter()
        y_whole, dx_whole = run(chain(), x, dy)
        middle = time.perf_counter()
        y_chunks, dx_chunks = run([ImageChunks(chain(), chunk_bytes)], x, dy)
        end = time.perf_counter()
        got = [(y_chunks, dx_chunks)]
        if threads > 1:
            with threadpool_limits(threads):
                got.append(run([ImageChunks(chain(), chunk_bytes)], x, dy))
            if i:
                threaded_s.append(time.perf_counter() - end)
        for y, dx in got:
            if not (np.array_equal(y_whole, y) and np.array_equal(dx_whole, dx)):
                raise SystemExit(f"chunked results differ from whole at {channels}x{hw}x{hw}")
        if i:  # the first repeat is cold
            whole_s.append(middle - start)
            chunks_s.append(end - middle)
        del y_whole, dx_whole, y_chunks, dx_chunks, got
    whole, chunks = statistics.median(whole_s), statistics.median(chunks_s)
    row = {"whole_s": whole, "chunks_s": chunks, "ratio": whole / chunks}
    if threaded_s:
        row["threads"] = threads
        row["threaded_s"] = statistics.median(threaded_s)
        row["threaded_ratio"] = chunks / row["threaded_s"]
    return row


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--networks", nargs="+", default=["paper-150-800", "paper-500-1500"])
    p.add_argument("--batches", nargs="+", type=int, default=[16, 64])
    p.add_argument("--repeats", type=int, default=5, help="timed repeats after a cold one (5)")
    p.add_argument("--chunk-mb", type=float, default=1.0, help="input per chunk, MB (1)")
    p.add_argument("--threads", type=int, default=1,
                   help="also time the chunks at this many BLAS threads, which run the chunks "
                   "on as many threads at once (default 1: not)")  # fmt: skip
    p.add_argument("--json", metavar="PATH", help="write the rows as a JSON list")
    args = p.parse_args(argv)
    for name in args.networks:
        if name not in PRESETS:
            p.error(f"unknown network {name!r}; choose from {', '.join(PRESETS)}")
    if args.repeats < 1 or args.chunk_mb <= 0 or min(args.batches) < 1 or args.threads < 1:
        p.error("--repeats, --chunk-mb, --batches and --threads must be positive")
    chunk_bytes = int(args.chunk_mb * 2**20)
    rows = []
    print(
        f"chain ReLU-LRN(5)-maxpool(2), forward + backward, one thread, median of "
        f"{args.repeats}; chunks of {args.chunk_mb:g} MB of input"
    )
    threaded = args.threads > 1
    print(
        f"{'network':16} {'batch':>5} {'layer':6} {'shape':>12} | {'whole s':>8} "
        f"{'chunks s':>8} {'ratio':>6}"
        + (f" | {f'{args.threads} thr s':>8} {'ratio':>6}" if threaded else "")
    )
    with threadpool_limits(1):
        for name in args.networks:
            convs = [e for e in PRESETS[name] if e["type"] == "conv"]
            for batch in args.batches:
                for conv, hw in zip(convs, (32, 16), strict=False):
                    r = measure(conv["out"], hw, batch, args.repeats, chunk_bytes,
                                args.threads)  # fmt: skip
                    shape = f"{conv['out']}x{hw}x{hw}"
                    more = (f" | {r['threaded_s']:8.3f} {r['threaded_ratio']:6.2f}"
                            if threaded else "")  # fmt: skip
                    print(f"{name:16} {batch:5d} {conv['name']:6} {shape:>12} | "
                          f"{r['whole_s']:8.3f} {r['chunks_s']:8.3f} {r['ratio']:6.2f}{more}",
                          flush=True)  # fmt: skip
                    rows.append({"network": name, "batch": batch, "layer": conv["name"],
                                 "channels": conv["out"], "hw": hw,
                                 "chunk_mb": args.chunk_mb, **r})  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
