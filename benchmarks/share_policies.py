"""Compute-only vs link-aware kernel shares, measured over real shaped links (needs root).

Two workers, each in its own network namespace (:mod:`hetconv.simulations.testbed`, as
``python -m hetconv.simulations.validate`` uses it): one on a fast link (``--fast`` Mbit/s),
one on a slow one (``--slow``, e.g. 5 Mbit/s Wi-Fi). The same training then runs three ways in one
sitting, in alternating rounds so drift on a shared machine hits all alike:

* ``local``: the master alone (``hetconv train --local``);
* ``compute``: through both workers with the paper's shares (``--shares compute``: kernels in
  proportion to 1 / probe time; the links play no part);
* ``link``: through both workers with ``--shares link`` (the simulator's link-aware rule fed with
  the probes and the links the master measured at connect).

It prints per run the mean step time (steps after the first), the shares chosen, and the ratios
local/compute and local/link (> 1: the cluster is faster than the master alone). Every process
shares this machine's cores (one BLAS thread each), so the point is the links, not the compute.

    sudo python benchmarks/share_policies.py [--preset paper-50-500] [--batch 16] [--steps 6]
        [--fast 1000] [--slow 5] [--rounds 1] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from hetconv.simulations.testbed import (
    Testbed,
    die_with_parent,
    testbed_unavailable,
    with_blas_threads,
)
from hetconv.simulations.trace import read_steps

MODES = ("local", "compute", "link")


def _train(mode: str, addresses: list[str], args, trace: Path, token: str) -> dict:
    command = [*die_with_parent(), sys.executable, "-I", "-m", "hetconv", "train"]
    if mode == "local":
        command.append("--local")
    else:
        for address in addresses:
            command += ["--worker", address]
        command += ["--shares", mode, "--connect-timeout", "60"]
    command += [
        "--preset", args.preset, "--batch", str(args.batch), "--steps", str(args.steps),
        "--trace", str(trace), "--no-progress", "--eval-size", "0",
        "--train-size", str(max(args.batch * args.steps, 256)),
    ]  # fmt: skip
    # One BLAS thread, as the workers: the comparison is about links, not threads.
    env = with_blas_threads(dict(os.environ, HETCONV_TOKEN=token), 1)
    done = subprocess.run(
        command, stdin=subprocess.DEVNULL, capture_output=True, text=True, env=env, timeout=3600
    )
    if done.returncode != 0:
        raise RuntimeError(f"{mode} run failed ({done.returncode}):\n{done.stderr}")
    records = read_steps(str(trace))[1:]  # step records only (no plan), the first left out
    shares = {}
    if records and records[-1].get("nodes"):
        for node, layers in records[-1]["nodes"].items():
            for layer, figures in layers.items():
                shares.setdefault(layer, {})[node] = figures.get("kernels", 0)
    return {
        "mode": mode,
        "step_s": float(np.mean([r["seconds"] for r in records])),
        "comm_s": float(np.mean([r["comm_seconds"] for r in records])),
        "conv_s": float(np.mean([r["conv_seconds"] for r in records])),
        "shares": shares,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="paper-50-500")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--fast", type=float, default=1000.0, help="fast link, Mbit/s")
    parser.add_argument("--slow", type=float, default=5.0, help="slow link, Mbit/s")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--json", metavar="PATH", help="write the rows as a JSON list")
    args = parser.parse_args()
    why = testbed_unavailable()
    if why:
        print(f"share_policies: {why}", file=sys.stderr)
        return 2

    rows: list[dict] = []
    with Testbed(2, args.fast) as bed, tempfile.TemporaryDirectory() as scratch:
        bed.shape(bed.links[1], args.slow)  # the second worker's link, both directions
        addresses = bed.start_workers()
        print(
            f"{args.preset}, batch {args.batch}, {args.steps} steps; workers "
            f"{addresses[0]} at {args.fast:g} Mbit/s and {addresses[1]} at {args.slow:g} Mbit/s",
            flush=True,
        )
        for round_ in range(args.rounds):
            for mode in MODES:
                trace = Path(scratch) / f"{mode}-{round_}.jsonl"
                row = _train(mode, addresses, args, trace, bed.token)
                row.update(round=round_, preset=args.preset, batch=args.batch,
                           fast_mbps=args.fast, slow_mbps=args.slow)  # fmt: skip
                rows.append(row)
                shares = "; ".join(
                    f"{layer} " + " ".join(f"{n.split(':')[0]}={k}" for n, k in nodes.items())
                    for layer, nodes in row["shares"].items()
                )
                print(
                    f"  round {round_} {mode:<8} {1e3 * row['step_s']:9.1f} ms/step "
                    f"(comm {1e3 * row['comm_s']:.1f}, conv {1e3 * row['conv_s']:.1f})  {shares}",
                    flush=True,
                )
    mean = {m: float(np.mean([r["step_s"] for r in rows if r["mode"] == m])) for m in MODES}
    print(
        f"local/compute {mean['local'] / mean['compute']:.2f}   "
        f"local/link {mean['local'] / mean['link']:.2f}   "
        f"compute/link {mean['compute'] / mean['link']:.2f}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
