"""Our cpu backend and training step against PyTorch's, side by side in one run.

For C1 and C2 of every reference network at batch 16 and 64, times forward + both backward
convolutions (input gradient and kernel/bias gradient) of ours and of torch, interleaved so
both see the same machine load, and prints the ratio ours/torch (< 1: ours is faster). Then
times one whole training step (forward, backward, SGD) of each network at batch 16 against
the same network in torch (rows with layer "step").

    python benchmarks/conv_vs_torch.py [--quick] [--threads N] [--repeats R] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

try:
    import torch
    import torch.nn.functional as F
except ImportError:  # pragma: no cover - benchmark needs the reference
    sys.exit("this benchmark compares against PyTorch: pip install -e '.[dev]'")
from threadpoolctl import threadpool_info, threadpool_limits

from hetconv.backends import CpuBackend
from hetconv.layers import softmax_cross_entropy
from hetconv.model import PRESETS, Model
from hetconv.optim import SGD, SGDConfig

NETWORKS = ["paper-50-500", "paper-150-800", "paper-300-1000", "paper-500-1500"]


def conv_layers(network: str) -> list[tuple[str, int, int, int]]:
    """(layer, in channels, out channels, input size) of the network's convolutions."""
    spec = [entry for entry in PRESETS[network] if entry["type"] == "conv"]
    c1, c2 = spec[0]["out"], spec[1]["out"]
    return [("C1", 3, c1, 32), ("C2", c1, c2, 16)]


def torch_module(spec: list[dict], input_shape=(3, 32, 32)) -> torch.nn.Module:
    """The PyTorch equivalent of a hetconv spec, with the same parameter names."""

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.steps: list = []
            c, h, w = input_shape
            for entry in spec:
                kind = entry["type"]
                if kind == "conv":
                    conv = torch.nn.Conv2d(c, entry["out"], entry["kernel"], padding="same")
                    self.add_module(entry["name"], conv)
                    self.steps.append(conv)
                    c = entry["out"]
                elif kind == "relu":
                    self.steps.append(torch.relu)
                elif kind == "lrn":
                    self.steps.append(torch.nn.LocalResponseNorm(entry["size"]))
                elif kind == "maxpool":
                    k = entry["kernel"]
                    self.steps.append(lambda x, k=k: F.max_pool2d(x, k))
                    h, w = h // k, w // k
                elif kind == "fc":
                    fc = torch.nn.Linear(c * h * w, entry["out"])
                    self.add_module(entry["name"], fc)
                    self.steps.append(lambda x, fc=fc: fc(x.flatten(1)))

        def forward(self, x):
            for step in self.steps:
                x = step(x)
            return x

    return Net()


def interleaved(ours, theirs, repeats: int) -> tuple[float, float]:
    """Median seconds of ``ours()`` and ``theirs()``, alternated after one warm-up each."""
    ours()
    theirs()
    times_ours, times_theirs = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        ours()
        times_ours.append(time.perf_counter() - start)
        start = time.perf_counter()
        theirs()
        times_theirs.append(time.perf_counter() - start)
    return statistics.median(times_ours), statistics.median(times_theirs)


def bench_conv(backend, c: int, k: int, size: int, batch: int, repeats: int) -> tuple[float, float]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, c, size, size), dtype=np.float32)
    w = (rng.standard_normal((k, c, 5, 5), dtype=np.float32) / np.sqrt(25 * c)).astype(np.float32)
    b = rng.standard_normal(k, dtype=np.float32)
    dy = rng.standard_normal((batch, k, size, size), dtype=np.float32)

    def ours():
        backend.conv_forward(x, w, b, "same")
        backend.conv_grad_input(dy, w, (size, size), "same")
        backend.conv_grad_kernels(x, dy, (5, 5), "same")

    xt = torch.from_numpy(x).requires_grad_()
    wt = torch.from_numpy(w).requires_grad_()
    bt = torch.from_numpy(b).requires_grad_()
    dyt = torch.from_numpy(dy)

    def theirs():
        xt.grad = wt.grad = bt.grad = None
        F.conv2d(xt, wt, bt, padding=2).backward(dyt)

    return interleaved(ours, theirs, repeats)


def bench_step(network: str, batch: int, repeats: int) -> tuple[float, float]:
    spec = PRESETS[network]
    model = Model(spec, seed=0)
    optimizer = SGD(model.parameters(), SGDConfig())
    net = torch_module(spec)
    net.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in model.parameters().items()})
    torch_optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, 3, 32, 32), dtype=np.float32)
    labels = rng.integers(0, 10, batch)
    xt, lt = torch.from_numpy(x), torch.from_numpy(labels)

    def ours():
        _, grad, _ = softmax_cross_entropy(model.forward(x), labels)
        model.backward(grad)
        optimizer.step(model.gradients())

    def theirs():
        torch_optimizer.zero_grad()
        F.cross_entropy(net(xt), lt).backward()
        torch_optimizer.step()

    return interleaved(ours, theirs, repeats)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="two networks, batch 16 (~1 min)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per side (median)")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as a JSON list")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    networks = NETWORKS[:2] if args.quick else NETWORKS
    batches = [16] if args.quick else [16, 64]
    backend = CpuBackend()
    blas = [
        f"{i['internal_api']} {i.get('architecture', '?')} ({i['num_threads']} threads)"
        for i in threadpool_info()
        if i["user_api"] == "blas"
    ]
    print(f"threads {args.threads}; BLAS: {'; '.join(blas)}; torch {torch.__version__}")
    print(f"{'network':<16}{'layer':<7}{'batch':>6}{'ours s':>10}{'torch s':>10}{'ratio':>8}")
    rows = []

    def report(network, layer, batch, ours_s, torch_s):
        row = {
            "network": network,
            "layer": layer,
            "batch": batch,
            "ours_s": ours_s,
            "torch_s": torch_s,
            "ratio": ours_s / torch_s,
        }
        rows.append(row)
        print(
            f"{network:<16}{layer:<7}{batch:>6}{ours_s:>10.4f}{torch_s:>10.4f}{row['ratio']:>8.2f}",
            flush=True,
        )

    with threadpool_limits(limits=args.threads, user_api="blas"):
        for network in networks:
            for batch in batches:
                for layer, c, k, size in conv_layers(network):
                    report(
                        network, layer, batch, *bench_conv(backend, c, k, size, batch, args.repeats)
                    )
        for network in networks:
            report(network, "step", 16, *bench_step(network, 16, args.repeats))

    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
