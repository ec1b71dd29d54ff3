"""A cuda worker's layers against PyTorch's on the same GPU, one layer at a time.

Where :mod:`gpu_vs_torch` times whole steps, this says where a cuda worker's step goes: every
distinct layer of a network at its real shape (as ``benchmarks/conv_vs_torch.py`` walks them),
its tensors already on the GPU, ours (the cuda backend's convolutions, the model's own layer
objects on CuPy arrays) against torch's (cuDNN, TF32 off; the data-parallel peer's twin,
``benchmarks/ddp_rank.py``), each timed with the device synchronised before and after,
alternated, minimum of ``--repeats``. A convolution gives three rows (forward, input gradient,
kernel gradient) and each carries ``gemm_s``: the one cuBLAS GEMM of that operation's size
alone (the im2col method's floor: what it costs beyond that is its copies). A row: network,
layer, kind, batch, device, ours_s, torch_s, ratio = ours_s / torch_s, gemm_s.

    python benchmarks/gpu_layers.py --network paper-500-1500 resnet20 --batch 64 \\
        --json gpu_layers.json

Without a GPU it stops with one line saying why; ``--dry-run`` runs the same code on the CPU
(numpy arrays, the cpu backend, torch on the CPU) with the tiny network, to check it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

try:
    import torch
    import torch.nn.functional as F
except ImportError:  # pragma: no cover - benchmark needs the reference
    sys.exit("this benchmark compares against PyTorch: pip install torch")

from conv_vs_torch import KINDS, layer_pair  # noqa: E402
from ddp_rank import torch_model  # noqa: E402

from hetconv.argtypes import positive  # noqa: E402
from hetconv.model import PRESETS, Model, load_spec, walk_spec  # noqa: E402


def _gemm_dims(layer, x_shape) -> dict[str, tuple[int, int, int]]:
    """(M, K, N) of the im2col GEMM of each operation on input ``x_shape``."""
    n, c, h, w = x_shape
    k, _, kh, kw = layer.params["weight"].shape
    taps = c * kh * kw
    return {
        "conv forward": (k, taps, n * h * w),
        "conv input gradient": (taps, k, n * h * w),
        "conv kernel gradient": (k, n * h * w, taps),
    }


class Timer:
    """Seconds of a call with the device synchronised before and after."""

    def __init__(self, sync):
        self.sync = sync

    def __call__(self, fn) -> float:
        self.sync()
        start = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - start


def alternated(timer: Timer, fns: list, repeats: int) -> list[float]:
    """Minimum seconds of each of ``fns``, alternated after one warm-up each."""
    for fn in fns:
        timer(fn)
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            best[i] = min(best[i], timer(fn))
    return best


def conv_rows(layer, module, x, dy, backend, xp, dev):
    """(kind, ours, torch's, the bare GEMM) of a stride-1 convolution's three operations."""
    w = xp.asarray(layer.params["weight"])
    b = None if layer.bias is None else xp.asarray(layer.bias)
    padding = layer.padding
    xt = torch.as_tensor(np.asarray(_host(x)), device=dev)
    dyt = torch.as_tensor(np.asarray(_host(dy)), device=dev)
    wt = module.weight.detach().to(dev)
    bt = None if module.bias is None else module.bias.detach().to(dev)
    padded = xt if module.symmetric else F.pad(xt, module.padding)
    pad = module.padding if module.symmetric else (0, 0)
    backward = torch.ops.aten.convolution_backward

    def theirs(mask):
        return lambda: backward(
            dyt, padded, wt, None if bt is None else [wt.shape[0]], module.stride, pad,
            (1, 1), False, (0, 0), 1, mask,
        )  # fmt: skip

    dims = _gemm_dims(layer, x.shape)

    def gemm(kind):
        m, k, n = dims[kind]
        a, bb = xp.ones((m, k), np.float32), xp.ones((k, n), np.float32)
        return lambda: xp.matmul(a, bb)

    yield (
        "conv forward",
        lambda: backend.conv_forward(x, w, b, padding),
        lambda: F.conv2d(padded, wt, bt, module.stride, pad),
        gemm("conv forward"),
    )
    if layer.need_input_grad:
        yield (
            "conv input gradient",
            lambda: backend.conv_grad_input(dy, w, x.shape[2:], padding),
            theirs([True, False, False]),
            gemm("conv input gradient"),
        )
    yield (
        "conv kernel gradient",
        lambda: backend.conv_grad_kernels(x, dy, w.shape[2:], padding),
        theirs([False, True, bt is not None]),
        gemm("conv kernel gradient"),
    )


def _host(a):
    return a.get() if hasattr(a, "get") else a


def network_rows(network: str, batch: int, args, backend, xp, dev, timer) -> list[dict]:
    spec = load_spec(network)
    model = Model(spec, seed=0)
    twin = torch_model(spec).to(dev)
    rng = np.random.default_rng(0)
    seen, rows = set(), []
    for item, layer in zip(walk_spec(spec), model.layers, strict=True):
        key = (item.kind, item.input_shapes, item.output_shape, repr(sorted(item.options.items())))
        if key in seen:
            continue
        seen.add(key)
        module = getattr(twin, item.name)
        layer.params = {k: xp.asarray(v) for k, v in layer.params.items()}
        layer.buffers = {k: xp.asarray(v) for k, v in layer.buffers.items()}  # batch norm's
        xs = [xp.asarray(rng.standard_normal((batch, *s), np.float32)) for s in item.input_shapes]
        dy = xp.asarray(rng.standard_normal((batch, *item.output_shape), np.float32))
        if item.kind == "conv":
            if getattr(layer, "stride", (1, 1)) != (1, 1):
                continue  # run as stride phases by the worker: conv_vs_torch.py times those
            triples = conv_rows(layer, module, xs[0], dy, backend, xp, dev)
        else:
            layer.training = module.training = True
            to_torch = lambda a: torch.as_tensor(np.asarray(_host(a)), device=dev)  # noqa: E731
            pair = layer_pair(layer, module, xs, dy, to_torch)
            triples = [(KINDS.get(item.kind, item.kind), *pair)]
        for kind, *fns in triples:
            try:
                seconds = alternated(timer, fns, args.repeats)
            except Exception as e:  # noqa: BLE001 - a row that cannot run says why, others go on
                print(f"{network} {item.name} {kind}: {type(e).__name__}: {e}", file=sys.stderr)
                continue
            row = {
                "network": network, "layer": item.name, "kind": kind, "batch": batch,
                "device": args.device_name, "ours_s": seconds[0], "torch_s": seconds[1],
                "ratio": seconds[0] / seconds[1],
                "gemm_s": seconds[2] if len(seconds) > 2 else None,
            }  # fmt: skip
            print(line_of(row), flush=True)
            rows.append(row)
    return rows


def line_of(row: dict) -> str:
    gemm = f"{row['gemm_s'] * 1e3:9.3f}" if row["gemm_s"] is not None else f"{'-':>9}"
    return (
        f"{row['network']:<15} {row['batch']:>4} {row['layer']:<12} {row['kind']:<21} "
        f"{row['ours_s'] * 1e3:9.3f} {row['torch_s'] * 1e3:9.3f} {row['ratio']:6.2f} {gemm}"
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="A cuda worker's layers (the cuda backend's convolutions, the model's "
        "layers on CuPy arrays) against PyTorch's on the same GPU (fp32, TF32 off), one "
        "layer at a time, with each convolution's bare GEMM."
    )
    p.add_argument("--network", nargs="+", default=["paper-500-1500", "resnet20"],
                   choices=list(PRESETS),
                   help="presets (default: paper-500-1500 resnet20)")  # fmt: skip
    p.add_argument("--batch", nargs="+", type=positive(int), default=[64],
                   help="images per step (default: 64)")  # fmt: skip
    p.add_argument("--repeats", type=positive(int), default=5, help="timed runs (minimum; 5)")
    p.add_argument("--device", type=int, default=0, help="the GPU's number (0)")
    p.add_argument("--json", metavar="PATH", help="also write the rows here")
    p.add_argument("--dry-run", action="store_true",
                   help="no GPU: numpy, the cpu backend and torch on the CPU, tiny")  # fmt: skip
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.dry_run:
        from hetconv.backends import CpuBackend

        backend, xp, dev = CpuBackend(), np, "cpu"
        args.network, args.batch, args.repeats = ["tiny"], [4], 1
        args.device_name = "cpu"

        def sync():
            pass
    else:
        from hetconv.backends.cuda import CudaBackend

        ok, why = CudaBackend.is_available()
        if not ok or not torch.cuda.is_available():
            reason = why or "torch.cuda.is_available() is False"
            print(f"gpu_layers.py: no GPU here ({reason}); --dry-run runs it on the CPU",
                  file=sys.stderr)  # fmt: skip
            return 2
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cudnn.benchmark = True
        backend = CudaBackend(device=args.device)
        xp, dev = backend.xp, f"cuda:{args.device}"
        args.device_name = torch.cuda.get_device_name(args.device)

        def sync():
            xp.cuda.Device(args.device).synchronize()
            torch.cuda.synchronize(args.device)

    print(f"{'network':<15} {'batch':>4} {'layer':<12} {'kind':<21} {'ours_ms':>9} "
          f"{'torch_ms':>9} {'ratio':>6} {'gemm_ms':>9}")  # fmt: skip
    rows: list[dict] = []
    with backend.scope():
        for network in args.network:
            for batch in args.batch:
                rows += network_rows(network, batch, args, backend, xp, dev, Timer(sync))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
