"""Strided layers run by oneDNN's strided convolutions against their phases, side by side.

``hetconv train --local`` on the onednn engine hands a 3x3 stride-2 layer's forward, input and
kernel gradient to oneDNN with the layer's own stride (``Conv2d.runs_strided``); every other
executor and backend runs it as the stride-1 convolution of its phases (``StridePhases``: 1.78x the
arithmetic). This times, in one process and interleaved, the same model's whole training step
(forward, backward, SGD) both ways -- ``LocalConv("onednn")`` as it is, and the same executor
with ``native_stride`` off -- and prints each network's and batch's step times and their ratio
(phases / strided: > 1, the strided way is faster).

    python benchmarks/native_stride.py [--network resnet20 resnet18] [--batch 16 64]
        [--threads 1] [--repeats 7] [--json PATH]

Each figure is the minimum over ``--repeats`` alternated steps, the least disturbed by other
processes on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
from threadpoolctl import threadpool_limits

from hetconv.conv import LocalConv
from hetconv.layers import softmax_cross_entropy
from hetconv.model import PRESETS, Model, load_spec
from hetconv.optim import SGD, SGDConfig


def _stepper(network: str, batch: int, native: bool):
    """One training step of ``network`` on LocalConv("onednn"), its strides native or not."""
    executor = LocalConv("onednn")
    executor.native_stride = native
    model = Model(load_spec(network), seed=0, executor=executor)
    optimizer = SGD(model.parameters(), SGDConfig())
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, *model.input_shape), dtype=np.float32)
    labels = rng.integers(0, 10, batch)

    def step() -> float:
        start = time.perf_counter()
        _, grad, _ = softmax_cross_entropy(model.forward(x), labels)
        model.backward(grad)
        optimizer.step(model.gradients())
        return time.perf_counter() - start

    return step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--network", nargs="+", default=["resnet20", "resnet18"], choices=PRESETS)
    p.add_argument("--batch", nargs="+", type=int, default=[16, 64])
    p.add_argument("--threads", nargs="+", type=int, default=[1])
    p.add_argument("--repeats", type=int, default=7, help="alternated steps per side (7)")
    p.add_argument("--json", help="also write the rows to this file")
    args = p.parse_args()
    rows = []
    print(f"{'network':10} {'batch':>5} {'threads':>7} {'strided s':>10} {'phases s':>10} ratio")
    for network in args.network:
        for batch in args.batch:
            for threads in args.threads:
                with threadpool_limits(threads):
                    native, phased = _stepper(network, batch, True), _stepper(network, batch, False)
                    native(), phased()  # warm-up: primitives made, buffers kept
                    times = {"strided": [], "phases": []}
                    for _ in range(args.repeats):
                        times["strided"].append(native())
                        times["phases"].append(phased())
                strided_s, phases_s = min(times["strided"]), min(times["phases"])
                row = dict(
                    network=network, batch=batch, threads=threads, strided_s=strided_s,
                    phases_s=phases_s, ratio=phases_s / strided_s,
                )  # fmt: skip
                rows.append(row)
                print(
                    f"{network:10} {batch:5d} {threads:7d} {strided_s:10.4f} {phases_s:10.4f} "
                    f"{row['ratio']:.3f}",
                    flush=True,
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
