"""One process of the data-parallel peer: PyTorch DDP over gloo, batch slices weighted exactly.

Run by ``benchmarks/vs_ddp.py`` (one per node of its testbed) and by the tests (on loopback);
PyTorch is a benchmark and test dependency only. The model is built from a hetconv model spec
(:func:`torch_model`), layer for layer, with hetconv's parameter names, so the same weights load
into both.

Modes (each prints one JSON line on stdout at the end):

* ``--alone``: a single-process training step on the whole ``--batch``, ``--steps`` times.
* ``--world W --rank R``: a rank of a DDP run. It joins the group (gloo, ``--master-addr``,
  ``--port``), times ``--probe-steps`` local steps on ``batch // W`` images (all ranks at once,
  as they will train), gathers every rank's images per second, splits the global batch in
  proportion to them (largest remainder, :func:`hetconv.dataparallel.proportional_batches`),
  then trains its slice with DDP. ``--batches`` fixes the slices instead.
* ``--check PATH`` (with ``--world``/``--rank`` and ``--batches``, or ``--alone``): one SGD
  step on the same global batch (seed ``--seed``), rank 0 (or the single process) writing the
  parameters after it to ``PATH`` (``.npz``): the data-parallel step must equal the
  single-process one.

``--synced-batchnorm``: batch norm layers normalise by the whole batch's statistics, summed
over the ranks (two float64 all-reduces per layer a step, as hetconv's split by images sums
them), so DDP trains the same model as one process on the whole batch; without it each rank
normalises its own slice (torch's SyncBatchNorm refuses CPU tensors), a different model.

**Exact weighting.** Rank ``i`` with ``b_i`` of the ``B`` images scales its mean loss by
``W x b_i / B``; DDP averages the ranks' gradients (sums and divides by ``W``), which leaves
``sum_i (b_i / B) x mean gradient of slice i`` = the mean gradient of the global batch.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hetconv.backends import Padding
from hetconv.dataparallel import proportional_batches
from hetconv.model import CIFAR_INPUT, load_spec, walk_spec


class LRN(nn.Module):
    """Local response normalisation across channels, as ``nn.LocalResponseNorm`` computes it
    (``x / (k + alpha / size x sum of squares over the window) ** beta``), as ``size``
    shifted slice-adds: the same maths, 2-3x faster on a CPU than torch's (avg_pool3d) one."""

    def __init__(self, size: int, alpha: float, beta: float, k: float):
        super().__init__()
        self.size, self.alpha, self.beta, self.k = size, alpha, beta, k

    def forward(self, x):
        channels = x.shape[1]
        squares = F.pad(x * x, (0, 0, 0, 0, self.size // 2, (self.size - 1) // 2))
        window = squares[:, 0:channels]
        for i in range(1, self.size):
            window = window + squares[:, i : i + channels]
        return x / (self.k + self.alpha / self.size * window) ** self.beta


class SpecNet(nn.Module):
    """A hetconv model spec as a torch module: its layers in order, named as hetconv names
    them (so ``conv1.weight`` is hetconv's ``conv1.weight``), each reading the layers the
    spec names as its inputs (``add`` sums them in order, ``concat`` joins their channels)."""

    def __init__(self, spec: Sequence[Mapping], input_shape=CIFAR_INPUT, synced: bool = False):
        super().__init__()
        self.order: list[str] = []
        self.inputs: list[tuple[str, ...]] = []  # per layer, what it reads ("": the input)
        for item in walk_spec(spec, input_shape):
            options, kind = item.options, item.kind
            if item.conv is not None:
                c = item.conv  # the layer's own padding (not its stride phases')
                sides = Padding.resolve(c.padding, c.kernel_size).sides
                module = _Conv(c.input_shape[0], c.kernels, c.kernel_size, c.stride,
                               sides, options["bias"])  # fmt: skip
            elif kind == "relu":
                module = nn.ReLU()
            elif kind == "lrn":
                module = LRN(options["size"], options["alpha"], options["beta"], options["k"])
            elif kind in ("maxpool", "avgpool"):
                stride = options["stride"] or options["kernel"]
                pool = nn.MaxPool2d if kind == "maxpool" else nn.AvgPool2d
                module = pool(options["kernel"], stride)
            elif kind == "gap":
                module = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten())
            elif kind == "dropout":
                module = nn.Dropout(options["p"])
            elif kind == "batchnorm":
                # Each rank normalises its own images (torch's SyncBatchNorm runs on GPUs only,
                # so on CPUs DDP trains a different model from one process on the whole
                # batch), or, ``synced``, the whole batch's (:class:`SyncedBatchNorm`).
                norm = SyncedBatchNorm if synced else nn.BatchNorm2d
                module = norm(item.input_shape[0], eps=options["eps"], momentum=options["momentum"])
            elif kind == "fc":
                fc = nn.Linear(int(np.prod(item.input_shape)), item.output_shape[0])
                module = fc if len(item.input_shape) == 1 else _FlattenLinear(fc)
            elif kind in ("add", "concat"):
                module = _Join(kind)
            else:
                raise ValueError(f"layer {item.name}: type {kind!r} has no torch twin here")
            self.add_module(item.name, module)
            self.order.append(item.name)
            self.inputs.append(item.inputs or ("",))

    def forward(self, x):
        values = {"": x}
        for name, sources in zip(self.order, self.inputs, strict=True):
            x = values[name] = getattr(self, name)(*(values[s] for s in sources))
        return x


class _Join(nn.Module):
    """``add`` (the sum of the inputs, in order) or ``concat`` (along channels)."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def forward(self, *xs):
        if self.kind == "concat":
            return torch.cat(xs, 1)
        y = xs[0] + xs[1]
        for x in xs[2:]:
            y = y + x
        return y


class _Conv(nn.Module):
    """A convolution with hetconv's padding (top, bottom, left, right: asymmetric where
    ``"same"`` has an even kernel) and its parameter names."""

    def __init__(self, channels, kernels, kernel_size, stride, sides, bias=True):
        super().__init__()
        conv = nn.Conv2d(channels, kernels, kernel_size, stride=stride, bias=bias)
        self.weight, self.bias, self.stride = conv.weight, conv.bias, stride
        top, bottom, left, right = sides
        self.symmetric = (top, left) == (bottom, right)
        self.padding = (top, left) if self.symmetric else (left, right, top, bottom)

    def forward(self, x):
        if self.symmetric:
            return F.conv2d(x, self.weight, self.bias, self.stride, self.padding)
        return F.conv2d(F.pad(x, self.padding), self.weight, self.bias, self.stride)


class _SyncedNorm(torch.autograd.Function):
    """Batch norm over every rank's images: the per-channel sums of x and x^2 (forward) and
    of dy and dy x xhat (backward) all-reduced in float64, one call each, as hetconv's split
    by images sums them; the weight's and bias's gradients stay this rank's own (DDP sums
    them)."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps: float):
        channels = x.shape[1]
        count = torch.tensor([x.numel() // channels], dtype=torch.float64)
        sums = torch.cat([x.sum((0, 2, 3)).double(), (x * x).sum((0, 2, 3)).double(), count])
        dist.all_reduce(sums)
        n = float(sums[-1])
        mean = sums[:channels] / n
        var = sums[channels : 2 * channels] / n - mean * mean
        invstd = torch.rsqrt(var + eps).float()
        xhat = (x - mean.float()[None, :, None, None]) * invstd[None, :, None, None]
        ctx.save_for_backward(xhat, weight, invstd)
        ctx.n = n
        y = xhat * weight[None, :, None, None] + bias[None, :, None, None]
        return y, mean.float(), (var * n / max(n - 1, 1)).float()

    @staticmethod
    def backward(ctx, dy, _mean, _var):
        xhat, weight, invstd = ctx.saved_tensors
        channels, n = dy.shape[1], ctx.n
        own = torch.cat([dy.sum((0, 2, 3)).double(), (dy * xhat).sum((0, 2, 3)).double()])
        summed = own.clone()
        dist.all_reduce(summed)
        sum_dy, sum_dy_xhat = (summed[:channels] / n).float(), (summed[channels:] / n).float()
        scale = (weight * invstd)[None, :, None, None]
        dx = scale * (dy - sum_dy[None, :, None, None] - xhat * sum_dy_xhat[None, :, None, None])
        return dx, own[channels:].float(), own[:channels].float(), None


class SyncedBatchNorm(nn.BatchNorm2d):
    """``nn.BatchNorm2d`` that, training under a process group of more than one rank,
    normalises by the whole batch's statistics (:class:`_SyncedNorm`): DDP then trains the
    same model as one process on the whole batch, as hetconv does (torch's SyncBatchNorm
    refuses CPU tensors). Alone or evaluating, torch's own."""

    def forward(self, x):
        if not (self.training and dist.is_initialized() and dist.get_world_size() > 1):
            return super().forward(x)
        y, mean, var = _SyncedNorm.apply(x, self.weight, self.bias, self.eps)
        with torch.no_grad():
            self.running_mean.mul_(1 - self.momentum).add_(self.momentum * mean)
            self.running_var.mul_(1 - self.momentum).add_(self.momentum * var)
            self.num_batches_tracked.add_(1)
        return y


class _FlattenLinear(nn.Module):
    """Flatten, then a fully connected layer whose parameters keep the layer's own names."""

    def __init__(self, fc: nn.Linear):
        super().__init__()
        self.weight, self.bias = fc.weight, fc.bias

    def forward(self, x):
        return F.linear(torch.flatten(x, 1), self.weight, self.bias)


def torch_model(network: str | Sequence[Mapping], seed: int = 0, synced: bool = False) -> SpecNet:
    """:class:`SpecNet` of a preset name, ``.json`` spec file or spec, torch's initialisation
    from ``seed``; ``synced``: batch norm over every rank's images (:class:`SyncedBatchNorm`)."""
    spec = load_spec(network) if isinstance(network, str) else list(network)
    torch.manual_seed(seed)
    return SpecNet(spec, synced=synced)


def global_batch(batch: int, seed: int, classes: int = 10):
    """The same ``batch`` CIFAR-shaped images and labels in every process (from ``seed``)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, *CIFAR_INPUT), dtype=np.float32)
    y = rng.integers(0, classes, size=batch)
    return torch.from_numpy(x), torch.from_numpy(y)


def weighted_step(model, optimizer, x, y, weight: float) -> float:
    """One step: mean cross entropy on (x, y) scaled by ``weight`` (``W x b_i / B`` under DDP,
    1 alone), backward, the optimizer's update. Returns the unscaled loss."""
    optimizer.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    (loss * weight).backward()
    optimizer.step()
    return float(loss.detach())


def peak_rss_mb() -> float:
    """This process's peak resident memory (``VmHWM``), MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    import resource  # (no /proc: ru_maxrss, kB on Linux)

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _timed_steps(model, optimizer, x, y, weight: float, steps: int) -> list[float]:
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        weighted_step(model, optimizer, x, y, weight)
        seconds.append(time.perf_counter() - start)
    return seconds


def _save(model, path: str) -> None:
    module = model.module if hasattr(model, "module") else model
    np.savez(path, **{k: v.detach().numpy() for k, v in module.state_dict().items()})


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    model = torch_model(args.network, args.seed, args.synced_batchnorm)
    x_all, y_all = global_batch(args.batch, args.seed + 1)
    momentum = 0.0 if args.check else 0.9
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=momentum)
    if args.alone:
        if args.check:
            weighted_step(model, optimizer, x_all, y_all, 1.0)
            _save(model, args.check)
            return {"peak_rss_mb": peak_rss_mb()}
        seconds = _timed_steps(model, optimizer, x_all, y_all, 1.0, args.steps)
        return {"step_s": seconds, "peak_rss_mb": peak_rss_mb()}

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{args.master_addr}:{args.port}",
        rank=args.rank,
        world_size=args.world,
        timeout=timedelta(seconds=args.timeout),
    )
    try:
        speeds: list[float] = []
        if args.batches:
            batches = args.batches
        else:
            probe = max(1, args.batch // args.world)
            x, y = x_all[:probe], y_all[:probe]
            dist.barrier()  # every rank probes at once, as they will train
            seconds = _timed_steps(model, optimizer, x, y, 1.0, args.probe_steps + 1)[1:]
            gathered: list = [None] * args.world
            dist.all_gather_object(gathered, probe / statistics.median(seconds))
            speeds = [float(s) for s in gathered]
            batches = proportional_batches(args.batch, [1 / s for s in speeds])
            if min(batches) < 1:
                raise ValueError(
                    f"batch {args.batch} split by speed {speeds} leaves a rank no image: "
                    f"{batches}; use a larger batch"
                )
        start = sum(batches[: args.rank])
        mine = batches[args.rank]
        x, y = x_all[start : start + mine], y_all[start : start + mine]
        ddp = nn.parallel.DistributedDataParallel(model)  # (broadcasts rank 0's weights)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=momentum)
        weight = args.world * mine / args.batch
        out: dict = {"rank": args.rank, "batches": list(batches), "speeds": speeds}
        if args.check:
            weighted_step(ddp, optimizer, x, y, weight)
            if args.rank == 0:
                _save(ddp, args.check)
        else:
            dist.barrier()
            ends = []
            for _ in range(args.steps):
                weighted_step(ddp, optimizer, x, y, weight)
                ends.append(time.perf_counter())
            starts = [ends[0] - (ends[1] - ends[0]) if len(ends) > 1 else ends[0]] + ends[:-1]
            out["step_s"] = [e - s for s, e in zip(starts, ends, strict=True)]
        dist.barrier()
        out["peak_rss_mb"] = peak_rss_mb()
        return out
    except BaseException:
        dist.destroy_process_group()
        raise
    # No destroy_process_group after the last barrier: a rank whose peer had already gone
    # was seen to hang in it (or in the interpreter's exit after it) past --timeout; main
    # ends a distributed rank with os._exit once its line is out.


def _batches(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every rank needs at least one image")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python benchmarks/ddp_rank.py",
        description="One process of the data-parallel peer (PyTorch DDP over gloo, per-rank "
        "batches proportional to speed, gradients weighted by batch share): see the module "
        "docstring. Prints one JSON line.",
    )
    p.add_argument("--network", default="paper-50-500", help="hetconv preset or .json spec")
    p.add_argument("--batch", type=int, default=16, help="global batch (16)")
    p.add_argument("--steps", type=int, default=4, help="timed steps (4)")
    p.add_argument("--probe-steps", type=int, default=2, help="timed probe steps (2)")
    p.add_argument("--alone", action="store_true", help="one process, the whole batch")
    p.add_argument("--world", type=int, default=1, help="ranks in all")
    p.add_argument("--rank", type=int, default=0, help="this rank")
    p.add_argument("--master-addr", default="127.0.0.1", help="rank 0's address")
    p.add_argument("--port", type=int, default=29500, help="rank 0's rendezvous port")
    p.add_argument("--ifname", help="the network interface gloo uses (GLOO_SOCKET_IFNAME)")
    p.add_argument("--batches", type=_batches, help="per-rank slices, B0,B1,... (no probe)")
    p.add_argument("--lr", type=float, default=0.01, help="SGD learning rate")
    p.add_argument("--seed", type=int, default=0, help="weights and data")
    p.add_argument("--timeout", type=float, default=1800, help="collective timeout, seconds")
    p.add_argument("--check", metavar="PATH", help="one step, parameters to PATH (.npz)")
    p.add_argument(
        "--synced-batchnorm", action="store_true",
        help="batch norm over the whole batch, every rank's images (two float64 all-reduces "
        "per layer a step, as hetconv's split by images): the same model as one process; "
        "without it each rank normalises its own slice",
    )  # fmt: skip
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    wrong = None
    if args.batch < 1 or args.steps < 1 or args.probe_steps < 1:
        wrong = "--batch, --steps and --probe-steps must be >= 1"
    elif not args.alone and not 0 <= args.rank < args.world:
        wrong = f"--rank {args.rank} is not in 0..{args.world - 1}"
    elif args.batches and (len(args.batches) != args.world or sum(args.batches) != args.batch):
        wrong = f"--batches {args.batches} must be {args.world} slices summing to {args.batch}"
    elif not args.alone and args.world < 2:
        wrong = "--world must be >= 2 (or --alone)"
    if wrong:
        print(f"ddp_rank: {wrong}", file=sys.stderr)
        return 2
    if args.ifname:
        os.environ["GLOO_SOCKET_IFNAME"] = args.ifname
    print(json.dumps(run(args)), flush=True)
    if not args.alone:  # see run: nothing of gloo's to wait for once every rank is past the barrier
        sys.stderr.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
