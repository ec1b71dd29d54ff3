"""How reliably the master tells a switched link from a shared medium (``--network auto``;
needs root).

:func:`hetconv.master.probing.measure_medium` times two echoes of one worker, the second
started half an echo after the first: they end at 1.5x one echo's time on a full-duplex link and
at 2x on a half-duplex medium, and the cut is 1.75x. On a busy machine the ratio scatters. This
starts a real worker in a network namespace behind a tc-shaped full-duplex link
(:class:`hetconv.simulations.testbed.Testbed`), measures the medium ``--trials`` times, then
sends both directions of the same link through one token bucket (a half-duplex medium, as one
Wi-Fi channel is) and measures it again; it prints the ratios' spread and how many trials each
link was misclassified in, and how many echoes the measurements took.

    sudo .venv/bin/python benchmarks/network_medium.py [--trials 20] [--rate-mbit 40] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from hetconv.master import probing
from hetconv.master.client import WorkerClient
from hetconv.master.membership import Node
from hetconv.simulations import testbed


def trials(node: Node, count: int, shared: bool, log=sys.stderr) -> dict:
    """``count`` measurements of the medium: their ratios, echoes and misclassifications."""
    ratios, echoes, wrong, seconds = [], [], 0, []
    for i in range(count):
        start = time.perf_counter()
        medium = probing.measure_medium([node], deadline=60.0)
        seconds.append(time.perf_counter() - start)
        ratios.append(medium.duplex_ratio)
        echoes.append(medium.echoes)
        wrong += medium.shared != shared
        print(f"  {i + 1}/{count}: {medium.describe()}", file=log, flush=True)
    return {
        "link": "half duplex" if shared else "full duplex",
        "trials": count,
        "misclassified": wrong,
        "ratio_min": min(ratios),
        "ratio_median": statistics.median(ratios),
        "ratio_max": max(ratios),
        "echoes_median": statistics.median(echoes),
        "echoes_max": max(echoes),
        "seconds_median": statistics.median(seconds),
        "ratios": ratios,
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=20, help="measurements per link (20)")
    p.add_argument("--rate-mbit", type=float, default=40.0, help="the link's rate (40)")
    p.add_argument("--json", metavar="PATH", help="write the two rows as a JSON list")
    args = p.parse_args(argv)
    if args.trials < 1 or not args.rate_mbit > 0:
        p.error("--trials and --rate-mbit must be positive")
    if os.geteuid() != 0:
        p.error("needs root (network namespaces and tc)")
    why = testbed.testbed_unavailable()
    if why is not None:
        p.error(f"the testbed cannot run here: {why}")
    rows = []
    with testbed.Testbed(1, args.rate_mbit) as bed:
        (address,) = bed.start_workers()
        node = Node(address, WorkerClient(address, 60.0, token=bed.token))
        probing.connect(node, connect_timeout=60.0, deadline=30.0)
        try:
            print(f"full duplex, {args.rate_mbit:g} Mbit/s each way:", file=sys.stderr)
            rows.append(trials(node, args.trials, shared=False))
            bed.half_duplex(bed.links[0], args.rate_mbit)
            print(f"half duplex, {args.rate_mbit:g} Mbit/s in all:", file=sys.stderr)
            rows.append(trials(node, args.trials, shared=True))
        finally:
            node.client.close()
    print(f"cut at {probing.HALF_DUPLEX_RATIO}x one echo; {args.trials} measurements per link")
    print(f"{'link':12} {'wrong':>5} | {'ratio min':>9} {'median':>7} {'max':>6} | "
          f"{'echoes':>6} {'most':>5} {'s each':>7}")  # fmt: skip
    for r in rows:
        print(f"{r['link']:12} {r['misclassified']:5d} | {r['ratio_min']:9.3f} "
              f"{r['ratio_median']:7.3f} {r['ratio_max']:6.3f} | {r['echoes_median']:6.0f} "
              f"{r['echoes_max']:5d} {r['seconds_median']:7.2f}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
