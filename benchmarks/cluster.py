"""Step time of the master with K local workers vs local training, on the same machine.

For each preset and worker count, the same training (same seed, data and batch) runs locally
and through the cluster in alternating rounds, so drift on a shared machine hits both alike.
Workers are real ``hetconv worker`` processes on loopback with one BLAS thread each; the master
computes a share too unless ``--no-master-compute``. Figures are means over the steps after
each run's first, with the cluster step split in the paper's terms: communication, convolution
on the slowest node, and the rest ("comp").

On one machine the workers share its cores with the master, so this measures what the
distribution costs (bytes, calls, contention), not what separate machines would gain; the
simulator answers that from these figures and measured links.

With ``--stages unfused fused`` each worker count runs once per stage mode (``hetconv train
--stages``) in the same rounds, so fused and unfused are measured side by side; ``comp`` is the
master's work outside the distributed calls (in fused mode the fully connected part and the
loss; the master's own stage piece counts as its convolution). ``--kernels sent resident``
measures fused layers with their kernels sent every step and kept on the workers
(``hetconv train --kernels``) side by side too (a mode ``fused+resident``); MB/step then
includes the placements and syncs.

    python benchmarks/cluster.py [--presets tiny paper-50-500] [--workers 1 2] [--batch 32]
                                 [--steps 8] [--rounds 2] [--stages unfused fused]
                                 [--kernels sent resident] [--json PATH]
"""

from __future__ import annotations

import argparse
import io
import json
import tempfile
from pathlib import Path

import numpy as np

from hetconv.conv import LocalConv
from hetconv.master.cluster import Cluster, ClusterConfig
from hetconv.master.launch import LocalWorkers
from hetconv.simulations.trace import read_steps, step_bytes
from hetconv.training import TrainConfig, train


def _run(config: TrainConfig, executor) -> list[dict]:
    train(config, executor, log=io.StringIO())
    return read_steps(config.trace)[1:]  # the first step warms caches and connections


def _mean(records: list[dict], key: str) -> float:
    return float(np.mean([r[key] for r in records]))


def _bytes(records: list[dict]) -> float:
    return float(np.mean([step_bytes(r) for r in records]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", nargs="+", default=["tiny", "paper-50-500"])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=8, help="steps per run (first not counted)")
    parser.add_argument("--rounds", type=int, default=2, help="local/cluster alternations")
    parser.add_argument("--no-master-compute", action="store_true")
    parser.add_argument(
        "--equal-shares",
        action="store_true",
        help="split every layer equally over the nodes (hetconv train --deterministic), so the "
        "modes compared run the same shares whatever the probes measured on a busy machine",
    )
    parser.add_argument(
        "--stages",
        nargs="+",
        choices=("unfused", "fused", "auto"),
        default=["unfused"],
        help="stage modes to measure side by side (hetconv train --stages)",
    )
    parser.add_argument(
        "--kernels",
        nargs="+",
        choices=("sent", "resident"),
        default=["sent"],
        help="kernel modes to measure side by side for fused layers (hetconv train --kernels)",
    )
    parser.add_argument("--json", metavar="PATH", help="write the rows as a JSON list")
    args = parser.parse_args()
    modes = [
        (stage, kernels)
        for stage in args.stages
        for kernels in args.kernels
        if kernels == "sent" or stage != "unfused"
    ]

    rows = []
    header = (
        f"{'preset':<14} {'K':>2} {'stages':<15} {'local ms':>9} {'cluster ms':>10} {'ratio':>6} "
        f"{'comm ms':>8} {'conv ms':>8} {'comp ms':>8} {'MB/step':>8}  shares"
    )
    print(header)
    with LocalWorkers(max(args.workers)) as workers, tempfile.TemporaryDirectory() as tmp:
        for preset in args.presets:
            for k in args.workers:
                config = TrainConfig(
                    preset=preset,
                    steps=args.steps,
                    batch=args.batch,
                    train_size=max(256, args.batch * args.steps),
                    eval_size=0,
                    progress=False,
                    trace=str(Path(tmp) / "trace.jsonl"),
                )
                local: list[dict] = []
                remote: dict[tuple, list[dict]] = {mode: [] for mode in modes}
                shares: dict[str, dict] = {}
                for round_number in range(args.rounds):
                    local += _run(config, LocalConv())
                    # Every other round in reverse, so a machine getting busier over the rounds
                    # does not always hit the same mode last.
                    for mode in modes if round_number % 2 == 0 else modes[::-1]:
                        cluster_config = ClusterConfig(
                            master_compute=not args.no_master_compute,
                            stages=mode[0],
                            kernels=mode[1],
                            deterministic=args.equal_shares,
                        )
                        with Cluster(workers.addresses[:k], config=cluster_config) as cluster:
                            remote[mode] += _run(config, cluster)
                            shares[mode] = {n: list(p.shares) for n, p in cluster.plans.items()}
                for mode in modes:
                    rows.append(_row(args, preset, k, mode, local, remote[mode], shares[mode]))
    print("ratio = local step time / cluster step time (above 1: the cluster is faster)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)


def _row(args, preset, k, mode, local, remote, shares) -> dict:
    """One measured configuration: its figures, printed as a table row too."""
    stages, kernels = mode
    label = stages if kernels == "sent" else f"{stages}+{kernels}"
    row = {
        "preset": preset,
        "batch": args.batch,
        "workers": k,
        "stages": stages,
        "kernels": kernels,
        "master_compute": not args.no_master_compute,
        "local_step_s": _mean(local, "seconds"),
        "cluster_step_s": _mean(remote, "seconds"),
        "comm_s": _mean(remote, "comm_seconds"),
        "conv_s": _mean(remote, "conv_seconds"),
        "comp_s": _mean(remote, "comp_seconds"),
        "local_conv_s": _mean(local, "conv_seconds"),
        "bytes_per_step": _bytes(remote),
        "shares": shares,
    }
    row["ratio"] = row["local_step_s"] / row["cluster_step_s"]
    print(
        f"{preset:<14} {k:>2} {label:<15} {1e3 * row['local_step_s']:>9.1f} "
        f"{1e3 * row['cluster_step_s']:>10.1f} {row['ratio']:>6.2f} "
        f"{1e3 * row['comm_s']:>8.1f} {1e3 * row['conv_s']:>8.1f} "
        f"{1e3 * row['comp_s']:>8.1f} {row['bytes_per_step'] / 1e6:>8.1f}  "
        + " ".join(f"{n}={s}" for n, s in shares.items()),
        flush=True,
    )
    return row


if __name__ == "__main__":
    main()
