"""Convolution speed of every backend present, against its own device's GEMM peak.

For each backend that can run here (its default device, or ``--device``), and for the C1 and
C2 layers of the four reference networks, times forward, input-gradient and kernel-gradient
convolutions on random data (best of ``--repeats``) and prints GFLOPS and the fraction of
the device's measured float32 GEMM speed (``Backend.gemm_gflops``: the speed a convolution
lowered to GEMM could at best reach on that device).

``--share N`` also times C2 with a worker's equal share of N nodes, ceil(kernels / N) of its
kernels (layer ``C2/N``): a slice has as many positions per kernel as the whole layer, which
changes how fast BLAS runs it.

    python benchmarks/backends.py [--backends cpu opencl] [--batch 16] [--networks ...]
                                  [--share N] [--repeats 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from hetconv.backends import KNOWN_BACKENDS, BackendUnavailable, ConvShape, Padding, get_backend

NETWORKS = {"50-500": (50, 500), "150-800": (150, 800), "300-1000": (300, 1000),
            "500-1500": (500, 1500)}  # fmt: skip


def layer_shapes(c1: int, c2: int, batch: int, share: int = 0) -> dict[str, ConvShape]:
    """C1 (3 -> c1 on 32x32) and C2 (c1 -> c2 on 16x16), 5x5 'same', as in the paper; with
    ``share`` N also C2 with ceil(c2 / N) kernels (``C2/N``)."""
    same = Padding(2, 2, 2, 2)
    shapes = {
        "C1": ConvShape(batch, 3, 32, 32, c1, 5, 5, same),
        "C2": ConvShape(batch, c1, 16, 16, c2, 5, 5, same),
    }
    if share:
        shapes[f"C2/{share}"] = ConvShape(batch, c1, 16, 16, -(-c2 // share), 5, 5, same)
    return shapes


def _best(call, repeats: int, sync) -> float:
    call()
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def time_operations(backend, shape: ConvShape, repeats: int) -> dict[str, float]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((shape.n, shape.c, shape.h, shape.w), dtype=np.float32)
    w = rng.standard_normal((shape.k, shape.c, shape.kh, shape.kw), dtype=np.float32)
    b = rng.standard_normal(shape.k, dtype=np.float32)
    dy = rng.standard_normal((shape.n, shape.k, *shape.out_hw), dtype=np.float32)
    pad = shape.padding.sides
    sync = backend.synchronize
    return {
        "forward": _best(lambda: backend.conv_forward(x, w, b, pad), repeats, sync),
        "grad_input": _best(
            lambda: backend.conv_grad_input(dy, w, (shape.h, shape.w), pad), repeats, sync
        ),
        "grad_kernels": _best(
            lambda: backend.conv_grad_kernels(x, dy, (shape.kh, shape.kw), pad), repeats, sync
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", nargs="+", default=list(KNOWN_BACKENDS))
    parser.add_argument("--device", type=int, help="device number (non-cpu backends)")
    parser.add_argument("--networks", nargs="+", default=list(NETWORKS), choices=list(NETWORKS))
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument(
        "--share", type=int, default=0, metavar="N",
        help="also time C2 with a worker's equal share of N nodes (layer C2/N)",
    )  # fmt: skip
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", metavar="PATH", help="write the rows as a JSON list")
    args = parser.parse_args()
    if args.share < 0 or args.batch < 1 or args.repeats < 1:
        parser.error("--share must be >= 0, --batch and --repeats >= 1")

    rows = []
    print(
        f"{'backend':<8} {'network':<9} {'layer':<5} {'fwd GF':>7} {'dX GF':>7} {'dW GF':>7} "
        f"{'fwd/peak':>8} {'dX/peak':>8} {'dW/peak':>8}"
    )
    for name in args.backends:
        try:
            device = None if name == "cpu" else args.device
            backend = get_backend(name, device=device)
        except BackendUnavailable as e:
            print(f"{name}: skipped: {e}")
            continue
        info = backend.describe()
        try:
            peak = backend.gemm_gflops()
        except NotImplementedError:
            peak = float("nan")
        print(f"{name}: {info.name}; GEMM peak {peak:.1f} GFLOPS", flush=True)
        for network in args.networks:
            for layer, shape in layer_shapes(*NETWORKS[network], args.batch, args.share).items():
                seconds = time_operations(backend, shape, args.repeats)
                gflops = {op: shape.flops_forward / s / 1e9 for op, s in seconds.items()}
                row = {
                    "backend": name,
                    "device": info.name,
                    "network": network,
                    "layer": layer,
                    "batch": args.batch,
                    "gemm_peak_gflops": peak,
                    **{f"{op}_gflops": g for op, g in gflops.items()},
                    **{f"{op}_of_peak": g / peak for op, g in gflops.items()},
                    **{f"{op}_seconds": s for op, s in seconds.items()},
                }
                rows.append(row)
                print(
                    f"{name:<8} {network:<9} {layer:<5} {gflops['forward']:>7.1f} "
                    f"{gflops['grad_input']:>7.1f} {gflops['grad_kernels']:>7.1f} "
                    f"{row['forward_of_peak']:>8.2f} {row['grad_input_of_peak']:>8.2f} "
                    f"{row['grad_kernels_of_peak']:>8.2f}",
                    flush=True,
                )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
