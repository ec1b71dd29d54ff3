"""How long the ring's all-reduce takes among real worker processes: whole chunks (one
segment a chunk, as before) against the chunks in segments (:data:`hetconv.ring.SEGMENT_BYTES`
by default), side by side in one run.

Starts ``--workers`` real ``hetconv worker`` processes on loopback (with ``--cap F``, as root,
each in a cgroup v1 ``cpu`` group capped at F of a core, as ``benchmarks/testbed.py`` caps its
nodes: the scaled testbed's workers get 0.36), then, per network, trains it split by images
with the ring (``hetconv train --split images --exchange ring --spot-check-every 0``, run in
this process) once per segment size, in turn, ``--rounds`` times: the master computes no
images and the ring runs after backward (no buckets), so each step's ring is one all-reduce of
the whole gradient through the workers' RingPart calls. A worker's ring seconds in a step are
its call's wall time less its compute (its own figure); the step's are the least over the
workers (the one that finished computing last waited for no one): the all-reduce, then the
SGD update and the answer of its chunk of the sum (the same in every variant).

A row per (network, segment size): the median of the steps after ``--warmup``, the step's
median, and how many times faster than whole chunks. ``--json PATH`` writes the rows.

Loopback has no link to wait for: every second there is the ranks' CPU (gRPC, the parts'
encoding and decoding, the adds). With ``--testbed`` (root) the workers run on the scaled
testbed's :class:`~hetconv.simulations.testbed.ClusterTestbed` instead: a network namespace
each, switched links shaped at ``--rate-mbit`` (700: the testbed's paper-150-800 rate), each
capped at ``--cap``; the master (computing nothing) in its own namespace, neither capped nor
its port shaped (every rank's chunk of the sum crosses it at once after the ring: the same
in every variant). There the segments overlap the CPU with the links' transfers too.

Measured (4 workers at 0.36 of a core, paper-150-800's 14 MB, on a machine others loaded):
loopback, 0.267-0.378 s whole against 0.171-0.195 s in 1 MB segments (three runs); the
testbed at 700 Mbit/s, 0.431-0.602 s against 0.348-0.353 s (two runs; the links alone need
0.24 s, and the figures hold the update and the answer); 256 KB, 512 KB and 2 MB segments
did no better than 1 MB; a 1.2 MB gradient (one segment a chunk) as before.

    sudo .venv/bin/python benchmarks/ring_speed.py [--networks paper-150-800 ref-32-200]
        [--workers 4] [--cap 0.36] [--testbed] [--rate-mbit 700]
        [--segment-bytes 0 1048576] [--segments N ...] [--batch 8] [--steps 6] [--warmup 2]
        [--rounds 2] [--json PATH]

``ref-A-B`` is :func:`hetconv.spec.reference_spec` with A and B kernels (``ref-32-200``: a
gradient of 1.2 MB; paper-150-800's is 14 MB). ``--segments N`` sizes the segments so that a
chunk (the gradient over the workers) goes in N of them.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

from hetconv.dataparallel import parameter_bytes
from hetconv.master.config import ClusterConfig
from hetconv.master.launch import LocalWorkers
from hetconv.master.ring import RingImageSplit
from hetconv.master.spotcheck import SpotCheckConfig
from hetconv.ring import RING, SEGMENT_BYTES
from hetconv.spec import PRESETS, reference_spec
from hetconv.training import TrainConfig, train


class TimedRing(RingImageSplit):
    """The ring split with ``segment_bytes`` and no buckets, the master computing nothing,
    keeping each step's ring seconds (:func:`ring_seconds`) and wall time."""

    exchange = RING
    bucket_bytes = 0

    def __init__(self, addresses, segment_bytes: int):
        config = ClusterConfig(spot_checks=SpotCheckConfig(every=0), master_compute=False,
                               token=os.environ.get("HETCONV_TOKEN"))  # fmt: skip
        super().__init__(addresses, config=config)
        self.segment_bytes = segment_bytes
        self.rings: list[float] = []
        self.steps: list[float] = []
        self._began = time.perf_counter()

    def end_step(self):
        record = super().end_step()
        now = time.perf_counter()
        self.steps.append(now - self._began)
        self._began = now
        if record.get("exchange") != RING:
            raise RuntimeError(f"a step went through the master: {json.dumps(record)[:300]}")
        self.rings.append(ring_seconds(record))
        return record


def ring_seconds(record: dict) -> float:
    """A step's ring seconds: its workers' least call wall time less compute."""
    nodes = [n for n in record["nodes"].values() if "wall_seconds" in n]
    return min(n["wall_seconds"] - n["seconds"] for n in nodes)


def spec_path(network: str, folder: Path) -> tuple[str, list]:
    """(the preset or the path of a written spec, the spec) of ``network``."""
    if network in PRESETS:
        return network, PRESETS[network]
    found = re.fullmatch(r"ref-(\d+)-(\d+)", network)
    if not found:
        raise SystemExit(f"--networks: {network!r} is neither a preset nor ref-A-B")
    spec = reference_spec(int(found[1]), int(found[2]))
    path = folder / f"{network}.json"
    path.write_text(json.dumps(spec))
    return str(path), spec


def run_once(addresses, preset: str, segment_bytes: int, args) -> tuple[list, list]:
    """One training run of ``preset``: (its steps' ring seconds, wall seconds) after the
    warm-up."""
    steps = args.warmup + args.steps
    config = TrainConfig(preset=preset, steps=steps, batch=args.batch, train_size=args.batch * 2,
                         eval_size=0, progress=False)  # fmt: skip
    with TimedRing(addresses, segment_bytes) as cluster:
        train(config, cluster, log=io.StringIO())
    return cluster.rings[args.warmup :], cluster.steps[args.warmup :]


def capped(workers: LocalWorkers, cap: float) -> list:
    """Each worker process moved into a cgroup of its own capped at ``cap`` of a core."""
    from hetconv.simulations.cpucap import CpuCap, ensure_cpu_controller

    if os.geteuid() != 0:
        raise SystemExit("--cap needs root (a cgroup per worker); run without it unprivileged")
    ensure_cpu_controller()
    caps = []
    for i, process in enumerate(workers.processes):
        cap_ = CpuCap(f"hetconv-ring-speed-{os.getpid()}-{i}", cap)
        cap_.create()
        caps.append(cap_)
        (cap_.path / "cgroup.procs").write_text(f"{process.pid}\n")
    return caps


def sizes_for(spec, args) -> list[int]:
    """The segment sizes (bytes, 0: whole chunks) to compare for ``spec``."""
    sizes = list(args.segment_bytes)
    chunk = parameter_bytes(spec) / args.workers
    for count in args.segments or []:
        sizes.append(0 if count <= 1 else 4 * math.ceil(chunk / 4 / count))
    return list(dict.fromkeys(sizes))


def variants(addresses, args, log=sys.stderr) -> list[dict]:
    """Every network's segment sizes trained in turn, ``--rounds`` times, through the workers
    at ``addresses``: the rows."""
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for network in args.networks:
            preset, spec = spec_path(network, Path(folder))
            sizes = sizes_for(spec, args)
            rings = {s: [] for s in sizes}
            steps = {s: [] for s in sizes}
            for round_ in range(args.rounds):
                for size in sizes:
                    got, walls = run_once(addresses, preset, size, args)
                    rings[size] += got
                    steps[size] += walls
                    print(f"{network} round {round_ + 1} segment_bytes {size}: ring "
                          f"{statistics.median(got):.3f} s", file=log, flush=True)  # fmt: skip
            rows += _rows(network, spec, args, rings, steps)
    return rows


def measure(args, log=sys.stderr) -> list[dict]:
    if args.master_of:  # the testbed's master, in its namespace
        rows = variants(args.master_of.split(","), args, log)
        print(ROWS + json.dumps(rows), flush=True)
        return rows
    if args.testbed:
        return on_testbed(args, log)
    with LocalWorkers(args.workers) as workers:
        caps = capped(workers, args.cap) if args.cap else []
        try:
            return variants(workers.addresses, args, log)
        finally:
            for cap_ in caps:
                cap_.remove()


#: What the testbed's master prints before its rows.
ROWS = "rows: "


def on_testbed(args, log) -> list[dict]:
    """The workers on a :class:`~hetconv.simulations.testbed.ClusterTestbed` (switched links
    at ``--rate-mbit``, each worker capped at ``--cap``), the master (uncapped, its port not
    shaped: it computes nothing here) running :func:`variants` in its own namespace."""
    from hetconv.simulations.testbed import ClusterTestbed

    if os.geteuid() != 0:
        raise SystemExit("--testbed needs root (namespaces, tc, cgroups)")
    # the master's port unshaped: the chunks of the sum, which every rank answers at once,
    # would otherwise cross it in 14 MB / rate after the ring, in every variant alike
    bed = ClusterTestbed(args.workers, "switched", args.rate_mbit, args.cap or None, False)
    with bed:
        addresses = bed.start_workers()
        command = [sys.executable, "-I", __file__, "--master-of", ",".join(addresses),
                   *sys.argv[1:]]  # fmt: skip
        command = [c for c in command if c != "--testbed"]
        env = dict(os.environ, HETCONV_TOKEN=bed.token, OPENBLAS_NUM_THREADS="1")
        master = bed.spawn(command, env, bed.master, capped=False)
        lines = []
        for line in master.stdout:
            lines.append(line)
            if not line.startswith(ROWS):
                print(line, end="", file=log, flush=True)
        if master.wait() != 0:
            raise SystemExit(f"the master failed ({master.returncode}):\n{''.join(lines[-20:])}")
    got = [line for line in lines if line.startswith(ROWS)]
    if not got:
        raise SystemExit("the master printed no rows")
    rows = json.loads(got[-1][len(ROWS) :])
    for row in rows:
        row["link_mbit"] = args.rate_mbit
    return rows


def _rows(network, spec, args, rings, steps) -> list[dict]:
    nbytes = parameter_bytes(spec)
    whole = statistics.median(rings[0]) if 0 in rings else None
    chunk = nbytes / args.workers
    out = []
    for size, got in rings.items():
        ring_s = statistics.median(got)
        out.append({
            "network": network, "gradient_mb": round(nbytes / 1e6, 2), "workers": args.workers,
            "cap": args.cap or None, "segment_bytes": size,
            "segments_per_chunk": 1 if size == 0 else math.ceil(chunk / size),
            "ring_s": round(ring_s, 4), "step_s": round(statistics.median(steps[size]), 4),
            "faster_than_whole": round(whole / ring_s, 3) if whole else None,
            "steps": len(got),
        })  # fmt: skip
    return out


def table(rows: list[dict]) -> str:
    lines = [f"{'network':<16}{'MB':>7}{'segment B':>11}{'segs':>6}{'ring s':>9}{'step s':>9}"
             f"{'x whole':>9}"]  # fmt: skip
    for r in rows:
        faster = f"{r['faster_than_whole']:.2f}" if r["faster_than_whole"] else "-"
        lines.append(f"{r['network']:<16}{r['gradient_mb']:>7.2f}{r['segment_bytes']:>11}"
                     f"{r['segments_per_chunk']:>6}{r['ring_s']:>9.3f}{r['step_s']:>9.3f}"
                     f"{faster:>9}")  # fmt: skip
    return "\n".join(lines)


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--networks", nargs="+", default=["paper-150-800", "ref-32-200"])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument(
        "--cap",
        type=float,
        default=0.0,
        help="each worker's CPU cap, a fraction of a core (root; 0: none)",
    )
    p.add_argument(
        "--segment-bytes",
        type=int,
        nargs="+",
        default=[0, SEGMENT_BYTES],
        help="segment sizes to compare (0: whole chunks, as before)",
    )
    p.add_argument(
        "--segments",
        type=int,
        nargs="+",
        help="also: segments a chunk, each a size (1: whole chunks)",
    )
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", help="write the rows to this file")
    p.add_argument(
        "--testbed",
        action="store_true",
        help="the workers in network namespaces joined by links shaped at "
        "--rate-mbit (root; benchmarks/testbed.py's ClusterTestbed)",
    )
    p.add_argument("--rate-mbit", type=float, default=700.0)
    p.add_argument("--master-of", help=argparse.SUPPRESS)  # the testbed's master
    args = p.parse_args(argv)
    if args.workers < 2:
        p.error(f"--workers {args.workers}: a ring needs at least 2")
    if any(s < 0 or s % 4 for s in args.segment_bytes):
        p.error(f"--segment-bytes {args.segment_bytes}: whole float32 values, 0 or more")
    if any(n < 1 for n in args.segments or []):
        p.error(f"--segments {args.segments}: at least 1")
    if args.batch < args.workers:
        p.error(f"--batch {args.batch}: at least one image per worker ({args.workers})")
    if args.steps < 1 or args.warmup < 0 or args.rounds < 1:
        p.error("--steps and --rounds at least 1, --warmup at least 0")
    return args


def main(argv=None) -> None:
    args = parse(argv)
    rows = measure(args)
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
