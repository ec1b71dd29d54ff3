"""What a 16-bit wire format (``hetconv train --wire-format``) does to a whole training run.

For each preset the same training (same seed, synthetic data, batch and steps) runs locally,
then through the cluster with real local worker processes in float32 and in each 16-bit format,
with the kernels split the same way every time (evenly over the master and the workers, so
runs differ only by the wire format). Per run it prints the bytes per step on the master's link
(from the trace, both ways, all workers), the final loss (mean of the last 10 steps), the
held-out accuracy and loss, and the largest |loss difference| from the float32 cluster run at
any step of the curve (the float32 cluster run itself matches local training to float32
round-off: its row shows its difference from the local run).

    python benchmarks/wire_formats.py [--presets tiny paper-50-500] [--steps 250 120]
                                      [--batch 16] [--workers 2] [--json PATH]

(about 10 minutes on 2 cores). Over hundreds of steps any difference, float32 round-off
included, is amplified by training itself, so the curve's difference is shown twice: over the
first 20 steps (the rounding's own effect) and over the whole run, next to the float32 cluster
run's difference from local training (the scale of round-off amplified alike).
"""

from __future__ import annotations

import argparse
import io
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from hetconv.balance import kernel_shares
from hetconv.conv import LocalConv
from hetconv.formats import FLOAT32, FORMATS
from hetconv.master.cluster import Cluster, ClusterConfig
from hetconv.master.launch import LocalWorkers
from hetconv.simulations.trace import read_steps, step_bytes
from hetconv.training import TrainConfig, train
from hetconv.workload import network_layers


def _bytes_per_step(trace: str) -> float:
    return float(np.mean([step_bytes(r) for r in read_steps(trace)]))


def _even_shares(preset: str, batch: int, workers: int) -> dict[str, tuple[int, ...]]:
    return {
        layer.name: tuple(kernel_shares(layer.kernels, [1.0] * (workers + 1)))
        for layer in network_layers(preset, batch)
    }


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", nargs="+", default=["tiny", "paper-50-500"])
    parser.add_argument(
        "--steps", type=int, nargs="+", default=[250, 120], help="per preset (the last repeats)"
    )
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--train-size", type=int, default=2048)
    parser.add_argument("--eval-size", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", help="write the rows as a JSON list")
    return parser


def main() -> None:
    args = _parser().parse_args()
    rows = []
    print(
        f"{'preset':<14} {'run':<16} {'MB/step':>8} {'final loss':>10} {'eval acc':>8} "
        f"{'eval loss':>9} {'|dloss| 20':>10} {'max |dloss|':>11} {'s':>6}"
    )
    with LocalWorkers(args.workers) as workers, tempfile.TemporaryDirectory() as tmp:
        for i, preset in enumerate(args.presets):
            steps = args.steps[min(i, len(args.steps) - 1)]
            shares = _even_shares(preset, args.batch, args.workers)
            runs = [("local", None)] + [(f"cluster-{f.label}", f) for f in FORMATS.values()]
            losses: dict[str, np.ndarray] = {}
            for name, fmt in runs:
                trace = str(Path(tmp) / f"{preset}-{name}.jsonl")
                row = _run(args, workers, preset, steps, shares, name, fmt, trace, losses)
                rows.append(row)
                print(
                    f"{preset:<14} {name:<16} {row['bytes_per_step'] / 1e6:>8.2f} "
                    f"{row['final_loss']:>10.4f} {row['eval_accuracy']:>8.3f} "
                    f"{row['eval_loss']:>9.4f} {row['max_abs_loss_diff_first_20']:>10.2e} "
                    f"{row['max_abs_loss_diff']:>11.2e} {row['seconds']:>6.0f}",
                    flush=True,
                )
    print(
        "MB/step: the master's link, both ways, all workers (MB = 1e6); final loss: mean of the "
        "last 10 steps; |dloss| 20 / max |dloss|: the largest difference of a step's loss from the "
        "cluster-float32 run's, over the first 20 steps / all (for cluster-float32 itself: "
        "from the local run's)"
    )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")


def _run(
    args: argparse.Namespace,
    workers: LocalWorkers,
    preset: str,
    steps: int,
    shares: dict[str, tuple[int, ...]],
    name: str,
    fmt,
    trace: str,
    losses: dict[str, np.ndarray],
) -> dict:
    """One training run, local (``fmt`` None) or through the cluster in wire format ``fmt``;
    its loss curve goes into ``losses`` under ``name``; returns its row."""
    config = TrainConfig(
        preset=preset,
        steps=steps,
        batch=args.batch,
        seed=args.seed,
        train_size=args.train_size,
        eval_size=args.eval_size,
        progress=False,
        trace=trace,
    )
    start = time.perf_counter()
    if fmt is None:
        result = train(config, LocalConv(), log=io.StringIO())
    else:
        cluster_config = ClusterConfig(shares=shares, wire_format=fmt)
        with Cluster(workers.addresses, config=cluster_config) as cluster:
            result = train(config, cluster, log=io.StringIO())
    seconds = time.perf_counter() - start
    curve = np.array(result.losses)
    losses[name] = curve
    reference = losses["local"] if fmt is FLOAT32 else losses.get("cluster-float32")
    gap = np.abs(curve - reference) if reference is not None else np.zeros(1)
    diff, early = float(gap.max()), float(gap[:20].max())
    return {
        "preset": preset,
        "run": name,
        "wire_format": fmt.label if fmt is not None else None,
        "batch": args.batch,
        "steps": steps,
        "workers": 0 if fmt is None else args.workers,
        "bytes_per_step": 0.0 if fmt is None else _bytes_per_step(trace),
        "final_loss": float(curve[-10:].mean()),
        "eval_accuracy": result.eval_accuracy,
        "eval_loss": result.eval_loss,
        "max_abs_loss_diff": diff,
        "max_abs_loss_diff_first_20": early,
        "diff_against": "local" if fmt is FLOAT32 else (None if fmt is None else "cluster-float32"),
        "seconds": seconds,
    }


if __name__ == "__main__":
    main()
