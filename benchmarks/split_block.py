"""What splitting the replicated first block by images would give on the testbed: the nodes'
compute and their node-to-node exchange, measured together (needs root).

Today every node computes the whole first block (:mod:`hetconv.replica`), 24-39 % of a node's
work at paper-150-800. Split by images, each node would compute the block for its own images
only and the nodes would exchange what the others need: forward, every node sends its images'
block outputs to every other node (an all-gather); backward, every node sends each other node
that node's images' part of its input gradient and sums the parts it receives for its own
images (a reduce-scatter), then takes the sum back through the block for its own images. On
switched links none of it crosses the master's port more than its own part does.

This builds that on a :class:`~hetconv.simulations.testbed.ClusterTestbed` (a namespace per
node, tc-shaped links, every node in a CPU cgroup at ``--cap`` with one BLAS thread, the rate
scaled as ``benchmarks/testbed.py`` scales it) and times, side by side in one run, one process
per node:

* ``alone``: the master alone's training step (as ``benchmarks/split_bound.py`` times it), in
  the master's namespace and cap, the other nodes idle;
* ``replicated``: every node's step as today: the whole block forward, its equal share of the
  second layer's fused stage forward and backward, its input gradient back through the whole
  block;
* ``split``: the block forward on the node's own images, the all-gather, the same stage, the
  reduce-scatter, the block backward on its own images (bulk TCP, a thread per peer; no
  overlap of exchange and compute);
* ``split_overlap``: ``split`` with the exchange beside compute: the stage forward of the
  node's own images runs while the others' block outputs arrive; then the others' images'
  forward and backward; their input-gradient parts go out while the own images' backward runs
  (two stage calls instead of one, on fewer images each). ``exchange s`` is then the time spent
  waiting for the exchange;
* ``split_workers``: the master computes the whole block as today and exchanges nothing; the
  workers split the block's images among themselves as ``split`` does. The master then gets
  fewer kernels: the shares are balanced from one warm-up step of this mode and of
  ``replicated`` with equal shares (:func:`balanced_shares`). This keeps the master's side as
  it is today: it still holds the whole block's output, so it could stand in for any worker.

A step is the slowest node's, from the common go to its last byte; ``speedup = alone / (step +
rest)``, where ``rest`` is what the master alone does beyond its block and its whole stage (the
fc, the loss, the update), timed in the master's process. Only the nodes' compute and the
exchange count: no gRPC, no kernels or head on the master's link, no hand-over. So these are
what the split could reach at best, and ``replicated`` is the same bound for today's mode (the
testbed's real steps ran 8-20 % above it). A step of each mode after the warm-up checks the
splits: the block's kernel gradients summed over the nodes must equal the replicated mode's to
float32 round-off (the block's backward is linear in the incoming gradient), or the run fails.

    sudo .venv/bin/python benchmarks/split_block.py [--network paper-150-800] [--batch 16]
        [--workers 4] [--link switched] [--cap F] [--rate-mbit R] [--steps 5] [--rounds 2]
        [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from split_bound import Parts  # noqa: E402
from testbed import (  # noqa: E402
    LAPTOP_GFLOPS,
    LAPTOP_LINK_MBIT,
    MAX_TOTAL_CAP,
    Scale,
    measure_core_gflops,
)
from threadpoolctl import threadpool_limits  # noqa: E402

from hetconv.model import PRESETS  # noqa: E402
from hetconv.simulations.testbed import (  # noqa: E402
    CHECK_PORT,
    LINK_KINDS,
    ClusterTestbed,
    cluster_testbed_unavailable,
    with_blas_threads,
)
from hetconv.stages import stage_backward, stage_forward  # noqa: E402

ALONE, REPLICATED, SPLIT, SPLIT_WORKERS = "alone", "replicated", "split", "split_workers"
SPLIT_OVERLAP = "split_overlap"
MODES = (REPLICATED, SPLIT, SPLIT_OVERLAP, SPLIT_WORKERS)
SPLITS = (SPLIT, SPLIT_OVERLAP, SPLIT_WORKERS)


def image_ranges(batch: int, nodes: int) -> list[slice]:
    """Node ``i``'s images: consecutive, sizes differing by at most one, the larger first."""
    sizes = [batch // nodes + (i < batch % nodes) for i in range(nodes)]
    out, start = [], 0
    for size in sizes:
        out.append(slice(start, start + size))
        start += size
    return out


def kernel_ranges(kernels: int, nodes: int) -> list[slice]:
    """Node ``i``'s equal share of the second layer's kernels (the last may be smaller)."""
    share = -(-kernels // nodes)
    return [slice(min(i * share, kernels), min((i + 1) * share, kernels)) for i in range(nodes)]


class Node:
    """One node's process: its parts of the work and a TCP socket to and from every peer."""

    def __init__(self, args: argparse.Namespace):
        self.index, self.hosts = args.node, args.hosts
        nodes = len(self.hosts)
        self.parts = Parts(args.network, args.batch, nodes)
        self.nodes = nodes
        self.images = image_ranges(args.batch, nodes)
        self.own = kernel_ranges(self.parts.kernels, nodes)[self.index]
        self.peers = [i for i in range(nodes) if i != self.index]
        # split_workers: the master keeps the whole block, the workers split its images
        self.worker_images = [slice(0, 0), *image_ranges(args.batch, nodes - 1)]
        self.worker_peers = [i for i in range(1, nodes) if i != self.index]
        self.workers_own = self.own  # its kernels in split_workers (set by ``shares``)
        self.pool = ThreadPoolExecutor(2 * len(self.peers))
        self.out: dict[int, socket.socket] = {}
        self.inc: dict[int, socket.socket] = {}

    def connect(self, port: int) -> None:
        server = socket.create_server((self.hosts[self.index], port), backlog=len(self.peers))
        print("listening", flush=True)
        sys.stdin.readline()
        for i in self.peers:
            s = socket.create_connection((self.hosts[i], port), timeout=600)
            s.sendall(bytes([self.index]))
            self.out[i] = s
        for _ in self.peers:
            s, _ = server.accept()
            self.inc[s.recv(1)[0]] = s
        for s in (*self.out.values(), *self.inc.values()):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.settimeout(600)
        server.close()

    @staticmethod
    def _receive(s: socket.socket, into: np.ndarray) -> None:
        view, got = memoryview(into).cast("B"), 0
        while got < len(view):
            n = s.recv_into(view[got:])
            if not n:
                raise RuntimeError("a peer closed its socket mid-exchange")
            got += n

    def exchange(self, sends: dict[int, np.ndarray], receives: dict[int, np.ndarray]) -> float:
        """Send each peer its array and fill each receive buffer from its peer, all at once."""
        return self.wait(self.start_exchange(sends, receives))

    def start_exchange(self, sends: dict[int, np.ndarray], receives: dict[int, np.ndarray]):
        """:meth:`exchange` started in the background: its jobs, for :meth:`wait`."""
        jobs = [self.pool.submit(self.out[i].sendall, memoryview(a).cast("B"))
                for i, a in sends.items()]  # fmt: skip
        return jobs + [self.pool.submit(self._receive, self.inc[i], a) for i, a in receives.items()]

    @staticmethod
    def wait(jobs) -> float:
        """Seconds spent waiting for ``jobs`` to finish (raising what one raised)."""
        start = time.perf_counter()
        for job in jobs:
            job.result()
        return time.perf_counter() - start

    def _stage(self, y: np.ndarray, own: slice) -> tuple[np.ndarray, float]:
        """The node's ``own`` kernels of the second layer's stage, forward then backward with
        the input gradient (of ones at the stage's output): (dx, seconds)."""
        return self.parts.stage_run(y, own)

    def _block_forward(self, images: slice):
        p = self.parts
        k = slice(0, p.w1.shape[0])
        return stage_forward(p.backend, p.x[images], p.w1, p.b1, p.padding1, p.block, k)

    def _block_backward(self, run, g: np.ndarray):
        p = self.parts
        _, rw, rb = stage_backward(p.backend, run, g, slice(0, p.w1.shape[0]), False)
        return rw, rb

    def replicated(self, own: slice | None = None) -> dict:
        start = time.perf_counter()
        y, run = self._block_forward(slice(None))
        own = self.own if own is None else own
        dx, stage = self._stage(y, own)
        rw, _ = self._block_backward(run, dx)
        took = time.perf_counter() - start
        kernels = own.stop - own.start
        return {"step_s": took, "stage_s": stage, "exchange_s": 0.0, "kernels": kernels}, rw

    def split(self) -> dict:
        return self._split(self.images, self.peers, self.own)

    def split_workers(self) -> dict:
        """The master computes the whole block (as today) and exchanges nothing; the workers
        split the block's images among themselves."""
        if self.index == 0:
            return self.replicated(self.workers_own)
        return self._split(self.worker_images, self.worker_peers, self.workers_own)

    def shares(self, counts: str) -> dict:
        """Set every node's kernel count in split_workers (``counts``: comma-separated)."""
        counts = [int(c) for c in counts.split(",")]
        if len(counts) != self.nodes or sum(counts) != self.parts.kernels or min(counts) < 1:
            raise ValueError(f"shares {counts} do not split {self.parts.kernels} kernels")
        start = sum(counts[: self.index])
        self.workers_own = slice(start, start + counts[self.index])
        return {"kernels": counts[self.index]}, None

    def _split(self, images: list[slice], peers: list[int], own: slice) -> dict:
        start = time.perf_counter()
        mine = images[self.index]
        y_own, run = self._block_forward(mine)
        y_own = np.ascontiguousarray(y_own)
        y = np.empty((self.parts.x.shape[0], *y_own.shape[1:]), np.float32)
        y[mine] = y_own
        forward = self.exchange({i: y_own for i in peers}, {i: y[images[i]] for i in peers})
        dx, stage = self._stage(y, own)
        parts = {i: np.empty_like(dx[mine]) for i in peers}
        backward = self.exchange({i: np.ascontiguousarray(dx[images[i]]) for i in peers}, parts)
        row = {"stage_s": stage, "exchange_s": forward + backward, "exchange_forward_s": forward}
        return self._finish(start, run, dx[mine].copy(), parts, own, row)

    def _finish(self, start: float, run, g: np.ndarray, parts: dict, own: slice, row: dict):
        """A split step's end: the peers' ``parts`` added to the own images' input gradient
        ``g``, the block backward on them; the step's row (``row`` and its seconds) and the
        block's kernel gradient."""
        for part in parts.values():
            g += part
        rw, _ = self._block_backward(run, g)
        row.update(step_s=time.perf_counter() - start, kernels=own.stop - own.start)
        return row, rw

    def split_overlap(self) -> dict:
        """``split`` with the exchange beside compute: the stage forward of the node's own
        images runs while the others' block outputs arrive, then the others' images' forward
        and backward; their input-gradient parts go out while the own images' backward runs."""
        p, peers, own = self.parts, self.peers, self.own
        start = time.perf_counter()
        mine = self.images[self.index]
        y_own, run = self._block_forward(mine)
        y_own = np.ascontiguousarray(y_own)
        at, offset = {}, 0  # where each peer's images sit among the others'
        for i in peers:
            size = self.images[i].stop - self.images[i].start
            at[i], offset = slice(offset, offset + size), offset + size
        y_rest = np.empty((offset, *y_own.shape[1:]), np.float32)
        jobs = self.start_exchange({i: y_own for i in peers}, {i: y_rest[at[i]] for i in peers})
        began = time.perf_counter()
        own_pass = p.stage_forward(y_own, own)
        stage = time.perf_counter() - began
        waited = self.wait(jobs)
        began = time.perf_counter()
        dx_rest = p.stage_backward(*p.stage_forward(y_rest, own))
        stage += time.perf_counter() - began
        parts = {i: np.empty_like(y_own) for i in peers}
        jobs = self.start_exchange({i: dx_rest[at[i]] for i in peers}, parts)
        began = time.perf_counter()
        g = p.stage_backward(*own_pass)
        stage += time.perf_counter() - began
        waited += self.wait(jobs)
        return self._finish(start, run, g, parts, own, {"stage_s": stage, "exchange_s": waited})

    def alone(self) -> dict:
        return {"step_s": self.parts.alone()}, None

    def rest(self) -> dict:
        """The master alone's block and whole stage, to take from its step (``rest``)."""
        p = self.parts
        block, y = p.block_pass()
        full = p.stage_pass(y, slice(0, p.kernels))
        return {"block_s": block, "full_stage_s": full}, None


def node_main(args: argparse.Namespace) -> None:
    """A node's process: connect, then run each command read from stdin and print its JSON:
    a mode, ``MODE DIR`` (also save the block's kernel gradient in DIR), ``shares COUNTS``,
    ``quit``."""
    with threadpool_limits(1):
        node = Node(args)
        node.connect(args.port)
        print("connected", flush=True)
        for line in sys.stdin:
            what, *more = line.split()
            if what == "quit":
                break
            if what == "shares":
                row, _ = node.shares(more[0])
            else:
                row, rw = getattr(node, what)()
                if more and rw is not None:
                    np.save(Path(more[0]) / f"{what}-{node.index}.npy", rw)
            print(json.dumps(row), flush=True)


class Cluster:
    """The node processes on a testbed, driven step by step from here."""

    def __init__(self, bed: ClusterTestbed, args: argparse.Namespace):
        self.bed = bed
        ips = [h.ip for h in bed.hosts]
        env = with_blas_threads(dict(os.environ, PYTHONUNBUFFERED="1"), 1)
        self.nodes = []
        for i, host in enumerate(bed.hosts):
            command = [sys.executable, os.path.abspath(__file__), "--network", args.network,
                       "--batch", str(args.batch), "--node", str(i), "--port", str(CHECK_PORT),
                       "--hosts", *ips]  # fmt: skip
            self.nodes.append(bed.spawn(command, env, host, True, subprocess.PIPE))
        for said, then in (("listening", "connect"), ("connected", None)):
            for node in self.nodes:
                line = node.stdout.readline().strip()
                if line != said:
                    raise RuntimeError(f"a node said {line!r}, not {said!r}: {self._tail(node)}")
            if then:
                self._say(self.nodes, then)

    @staticmethod
    def _tail(node: subprocess.Popen) -> str:
        if node.poll() is None:
            node.kill()
        return node.stdout.read()[-2000:]

    @staticmethod
    def _say(nodes, line: str) -> None:
        for node in nodes:
            node.stdin.write(line + "\n")
            node.stdin.flush()

    def run(self, what: str, check: str | None = None) -> list[dict]:
        """One step of ``what`` on every node (``alone`` and ``rest``: the master only)."""
        nodes = self.nodes[:1] if what in (ALONE, "rest") else self.nodes
        self._say(nodes, what + (f" {check}" if check else ""))
        rows = []
        for node in nodes:
            line = node.stdout.readline()
            if not line:
                raise RuntimeError(f"a node stopped during {what}: {self._tail(node)}")
            rows.append(json.loads(line))
        return rows

    def close(self) -> None:
        self._say([n for n in self.nodes if n.poll() is None], "quit")
        for node in self.nodes:
            node.wait(timeout=60)


def check_split(folder: Path, nodes: int, rtol: float = 1e-4) -> float:
    """The largest difference between the block's kernel gradients summed over the nodes in
    each split and in the replicated mode, over the largest gradient; raises past ``rtol``."""

    def summed(mode: str) -> np.ndarray:
        return sum(np.load(folder / f"{mode}-{i}.npy").astype(np.float64) for i in range(nodes))

    want = summed(REPLICATED)
    scale = float(np.abs(want).max()) or 1.0
    worst = 0.0
    for mode in SPLITS:
        error = float(np.abs(summed(mode) - want).max()) / scale
        if not error <= rtol:
            raise RuntimeError(f"{mode}: the block's kernel gradient is off by {error:.2e}")
        worst = max(worst, error)
    return worst


def balanced_shares(kernels: int, replicated: list[dict], workers_split: list[dict]) -> list[int]:
    """Kernel counts for split_workers that finish every node together, from one step of
    each with equal shares: a kernel costs the replicated stage's seconds per kernel; beside
    its kernels the master computes the whole block (its replicated step less its stage) and
    a worker its block part and the exchange (its split_workers step less its stage)."""
    nodes = len(replicated)
    per_kernel = statistics.median(r["stage_s"] / r["kernels"] for r in replicated)
    master = replicated[0]["step_s"] - replicated[0]["stage_s"]
    worker = statistics.median(r["step_s"] - r["stage_s"] for r in workers_split[1:])
    step = (kernels * per_kernel + master + (nodes - 1) * worker) / nodes
    first = min(max(round((step - master) / per_kernel), 1), kernels - (nodes - 1))
    rest, extra = divmod(kernels - first, nodes - 1)
    return [first] + [rest + (i < extra) for i in range(nodes - 1)]


def measure(bed: ClusterTestbed, args: argparse.Namespace, log=sys.stderr) -> dict:
    cluster = Cluster(bed, args)
    steps: dict[str, list[float]] = {m: [] for m in (ALONE, *MODES)}
    nodes: dict[str, list[list[dict]]] = {m: [] for m in MODES}
    rests: list[dict] = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            # warm up; balance split_workers; check each split against the replicated block
            warm = {mode: cluster.run(mode) for mode in MODES}
            shares = balanced_shares(
                sum(r["kernels"] for r in warm[REPLICATED]), warm[REPLICATED], warm[SPLIT_WORKERS]
            )
            cluster.run("shares", ",".join(map(str, shares)))
            for mode in MODES:
                cluster.run(mode, tmp)
            error = check_split(Path(tmp), len(bed.hosts))
        print(f"split_workers shares: {shares}", file=log, flush=True)
        for what in (ALONE, "rest"):
            cluster.run(what)
        for round_ in range(args.rounds):
            order = [ALONE, *MODES] if round_ % 2 == 0 else [ALONE, *reversed(MODES)]
            for what in order:
                for _ in range(args.steps):
                    rows = cluster.run(what)
                    steps[what].append(max(r["step_s"] for r in rows))
                    if what != ALONE:
                        nodes[what].append(rows)
                took = statistics.median(steps[what][-args.steps :])
                print(f"round {round_ + 1}: {what} {took:.3f} s", file=log, flush=True)
            rests.append(cluster.run("rest")[0])
    finally:
        cluster.close()
    alone = statistics.median(steps[ALONE])
    rest = max(alone - statistics.median(r["block_s"] + r["full_stage_s"] for r in rests), 0.0)
    row = {
        "network": args.network,
        "batch": args.batch,
        "workers": len(bed.hosts) - 1,
        "link": bed.link,
        "rate_mbit": bed.rate_mbps,
        "cap": bed.cap,
        "alone_s": alone,
        "rest_s": rest,
        "split_check": error,
        "split_workers_shares": shares,
    }
    for mode in MODES:
        step = statistics.median(steps[mode])
        row[f"{mode}_s"] = step
        row[f"{mode}_speedup"] = alone / (step + rest)
        row[f"{mode}_exchange_s"] = statistics.median(
            max(r["exchange_s"] for r in rows) for rows in nodes[mode]
        )
    return row


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--network", default="paper-150-800", help="a preset (paper-150-800)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--workers", type=int, default=4, help="workers beside the master (4)")
    p.add_argument("--link", choices=LINK_KINDS, default="switched")
    p.add_argument("--cap", type=float, help="every node's CPU cap, of a core (1.8 / nodes)")
    p.add_argument(
        "--rate-mbit", type=float,
        help="every link's rate, Mbit/s (default: scaled as benchmarks/testbed.py scales it)",
    )  # fmt: skip
    p.add_argument("--steps", type=int, default=5, help="timed steps of each, per round (5)")
    p.add_argument("--rounds", type=int, default=2, help="rounds, the modes alternated (2)")
    p.add_argument("--json", metavar="PATH", help="write the row as a JSON list of one")
    p.add_argument("--node", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--hosts", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.node is not None:
        node_main(args)
        return
    if args.network not in PRESETS:
        p.error(f"unknown network {args.network!r}; choose from {', '.join(PRESETS)}")
    if min(args.workers, args.batch, args.steps, args.rounds) < 1:
        p.error("--workers, --batch, --steps and --rounds must be positive")
    if args.batch < args.workers + 1:
        p.error(f"--batch {args.batch} gives some of the {args.workers + 1} nodes no image")
    if args.rate_mbit is not None and not args.rate_mbit > 0:
        p.error("--rate-mbit must be positive")
    cap = args.cap or MAX_TOTAL_CAP / (args.workers + 1)
    if not 0 < cap <= 1:
        p.error(f"--cap must be in (0, 1] of a core, got {cap:g}")
    if os.geteuid() != 0:
        p.error("needs root (network namespaces, tc and CPU cgroups)")
    why = cluster_testbed_unavailable(args.link)
    if why is not None:
        p.error(f"the testbed cannot run here: {why}")
    try:
        Parts(args.network, args.workers + 1, args.workers + 1)
    except ValueError as e:
        p.error(str(e))
    core = measure_core_gflops(args.network, args.batch)
    rate = args.rate_mbit or Scale(cap, core, LAPTOP_GFLOPS, LAPTOP_LINK_MBIT[args.link]).rate_mbit
    print(f"{args.network} batch {args.batch}, {args.workers} workers + the master, {args.link} "
          f"links at {rate:.0f} Mbit/s, cap {cap:.3f} core per node (this core "
          f"{core:.0f} GFLOPS)", flush=True)  # fmt: skip
    with ClusterTestbed(args.workers, args.link, rate, cap) as bed:
        row = measure(bed, args)
    print(f"master alone {row['alone_s']:.3f} s, rest {row['rest_s']:.3f} s; one step, the "
          "slowest node's:")  # fmt: skip
    print(f"{'mode':14} {'step s':>8} {'speedup':>8} {'exchange s':>10}")
    for mode in MODES:
        print(f"{mode:14} {row[mode + '_s']:8.3f} {row[mode + '_speedup']:7.2f}x "
              f"{row[mode + '_exchange_s']:10.3f}", flush=True)  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps([row], indent=1) + "\n")


if __name__ == "__main__":
    main()
