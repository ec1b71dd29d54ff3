"""The input gradient of :mod:`hetconv.backends.xpconv`, two ways, against PyTorch's on a CPU.

Times, with numpy on the host (best of ``--repeats``, interleaved so all see the same load):

* ``col2im``: :func:`hetconv.backends.xpconv.grad_input` -- the kernels' GEMM with the
  output gradient, then kh*kw tap-wise slice-adds onto the padded input gradient (what the
  cuda backend runs with cupy);
* ``full``: the "full" correlation of the zero-padded output gradient with the flipped,
  channel-swapped kernels, through :func:`hetconv.backends.xpconv.forward` (im2col of dy into
  K*kh*kw rows, one GEMM);
* ``torch``: ``torch.nn.grad.conv2d_input`` (oneDNN on a CPU),

for C1 and C2 of the reference networks, and prints each formulation's time over torch's.

    python benchmarks/input_grad_formulations.py [--networks 50-500 150-800] [--batch 16]
                                                 [--repeats 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

try:
    import torch
except ImportError:  # pragma: no cover - the benchmark needs the reference
    sys.exit("this benchmark compares against PyTorch: pip install -e '.[dev]'")

from backends import NETWORKS, layer_shapes

from hetconv.backends import ConvShape, conv_shape, xpconv


def full_correlation(dy: np.ndarray, w: np.ndarray, shape: ConvShape) -> np.ndarray:
    """The input gradient as a forward convolution of dy with the flipped, channel-swapped
    kernels, padded by kernel size - 1 - padding on each side."""
    p = shape.padding
    flipped = np.ascontiguousarray(w.transpose(1, 0, 2, 3)[:, :, ::-1, ::-1])
    pad = (shape.kh - 1 - p.top, shape.kh - 1 - p.bottom, shape.kw - 1 - p.left)
    full = conv_shape(dy.shape, flipped.shape, (*pad, shape.kw - 1 - p.right))
    return xpconv.forward(np, dy, flipped, None, full)


def time_formulations(shape: ConvShape, repeats: int) -> dict[str, float]:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((shape.k, shape.c, shape.kh, shape.kw), dtype=np.float32)
    dy = rng.standard_normal((shape.n, shape.k, *shape.out_hw), dtype=np.float32)
    w_t, dy_t = torch.from_numpy(w), torch.from_numpy(dy)
    size = (shape.n, shape.c, shape.h, shape.w)
    p = shape.padding
    pad = (p.top, p.left)
    assert (p.bottom, p.right) == pad, "torch pads symmetrically"
    calls = {
        "col2im": lambda: xpconv.grad_input(np, dy, w, shape),
        "full": lambda: full_correlation(dy, w, shape),
        "torch": lambda: torch.nn.grad.conv2d_input(size, w_t, dy_t, padding=pad),
    }
    reference = calls["torch"]().numpy()
    for name in ("col2im", "full"):
        error = float(np.abs(calls[name]() - reference).max())
        assert error <= 1e-3 * float(np.abs(reference).max()), (name, error)
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--networks", nargs="+", default=["50-500", "150-800"], choices=NETWORKS)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", metavar="PATH", help="write the rows as a JSON list")
    args = parser.parse_args()
    rows = []
    print(f"{'network':<9} {'layer':<5} {'col2im ms':>10} {'full ms':>10} {'torch ms':>10} "
          f"{'col2im/torch':>12} {'full/torch':>10}")  # fmt: skip
    for network in args.networks:
        for layer, shape in layer_shapes(*NETWORKS[network], args.batch).items():
            seconds = time_formulations(shape, args.repeats)
            row = {"network": network, "layer": layer, "batch": args.batch}
            row.update({f"{name}_seconds": s for name, s in seconds.items()})
            rows.append(row)
            print(
                f"{network:<9} {layer:<5} {1e3 * seconds['col2im']:>10.1f} "
                f"{1e3 * seconds['full']:>10.1f} {1e3 * seconds['torch']:>10.1f} "
                f"{seconds['col2im'] / seconds['torch']:>12.2f} "
                f"{seconds['full'] / seconds['torch']:>10.2f}",
                flush=True,
            )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
