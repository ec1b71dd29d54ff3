"""How fast a kernel split with a replicated first block can ever be: its compute alone.

The testbed's best exact mode (fused stages, a replicated first block, resident kernels, a
split head) leaves little on the links: what bounds it is the work each node does. This
measures that work in one process, one BLAS thread, nothing on any wire, so the bound holds for
any link and any cap (equal caps scale every figure alike):

* ``alone``: the master alone's training step (``Model`` forward, softmax cross-entropy,
  backward, SGD with momentum), as ``hetconv train --local`` runs it;
* ``block``: the replicated first block, forward and backward (kernel gradients only), which
  every node computes whole;
* ``stage``: one node's fused stage of the second convolution at an equal share of ``--nodes``
  (its slice widened by the stage's halo, as the nodes compute it), forward and backward with
  the input gradient;
* ``full stage``: the same stage with all the kernels, as the master alone computes it.

With perfect links and a perfect balance a step still takes one node's ``block + stage`` plus
what the master alone does beyond its convolutions and chains (``rest``: the fc, the loss and
the update; the split head moves most of the fc onto the nodes, so this overstates ``rest``
slightly). ``bound = alone / (block + stage + rest)`` is then the best speedup the split can
reach, and ``work = nodes x (block + stage) / (alone - rest)`` how much more compute the
cluster spends than the master alone on the same convolutions. The stage's excess over
``full stage x share / kernels`` is what does not shrink with a share (the lowering of the
whole input, the input gradient's fold, GEMMs with few kernels).

What a block split by images would reach: ``block_part`` times the block on a node's own
ceil(batch / nodes) images, and ``bound_split_block = alone / (block_part + stage + rest)`` is
the bound if every node computed the block for its own images only and the nodes exchanged the
outputs (and, backward, their parts of its input gradient) at no cost; ``exchange_mb`` is what
each node would receive forward and send backward per step for that (the other images' block
outputs, float32).

Each part repeats as its process would run it, step after step (the alone step; a node's
block then its stage; the block then the whole stage), medians after one cold run: interleaved
in one process, each part would fault in the pages the others freed (under a cap that made the
block at paper-500-1500 batch 64 take 5.5-6 s instead of 3.5). ``--cap F`` (root) runs the
measurement in a CPU cgroup capped at F of a core, as the testbed caps each of its processes
(the cap costs a little more than 1/F, and not equally for every part: the bound under a cap is
the one a testbed run can reach).

``--together`` also runs one node's work (its block, then its stage) in ``--nodes`` processes
at once, each in a CPU cgroup of its own at ``--cap`` (uncapped without it), started together
and repeated as above, as the testbed's master and workers compute at the same time on this
machine's cores: ``node_together_s`` is the median of their medians, ``node_together_max_s``
the slowest one's (a phase waits for its slowest node), and ``bound_together = alone /
(node_together + rest)`` the bound on a machine whose nodes share its cores and caches (the
master alone, the reference, runs by itself).

    python benchmarks/split_bound.py [--networks paper-150-800 paper-500-1500]
        [--batches 16 64] [--nodes 5] [--repeats 3] [--cap F] [--together] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits

from hetconv.backends import get_backend
from hetconv.layers import softmax_cross_entropy
from hetconv.model import PRESETS, Model
from hetconv.optim import SGD, SGDConfig
from hetconv.simulations.testbed import CpuCap, ensure_cpu_controller, with_blas_threads
from hetconv.stages import stage_backward, stage_forward, stage_of


def _convs(spec: list[dict]) -> list[tuple[dict, object]]:
    """(conv entry, its stage) of each convolution of ``spec``, in order."""
    return [
        (entry, stage_of(spec[i + 1 :])) for i, entry in enumerate(spec) if entry["type"] == "conv"
    ]


class Parts:
    """The timed parts of one network at one batch (module docstring)."""

    def __init__(self, network: str, batch: int, nodes: int, seed: int = 0):
        spec = PRESETS[network]
        (conv1, block), (conv2, stage) = _convs(spec)[:2]
        if block is None or stage is None:
            raise ValueError(f"{network}: its first two convolutions need channel-local chains")
        rng = np.random.default_rng(seed)
        self.backend = get_backend("cpu")
        self.model = Model(spec, seed=seed)
        self.optimizer = SGD(self.model.parameters(), SGDConfig(lr=0.01, momentum=0.9))
        self.x = rng.standard_normal((batch, 3, 32, 32)).astype(np.float32)
        self.labels = rng.integers(0, 10, batch)
        c1, c2 = conv1["out"], conv2["out"]
        self.w1 = (0.1 * rng.standard_normal((c1, 3, 5, 5))).astype(np.float32)
        self.b1 = np.zeros(c1, np.float32)
        self.w2 = (0.02 * rng.standard_normal((c2, c1, 5, 5))).astype(np.float32)
        self.b2 = np.zeros(c2, np.float32)
        self.block, self.stage = block, stage
        self.padding1, self.padding2 = conv1["padding"], conv2["padding"]
        # A middle node's share: its slice has a halo on both sides, as most nodes' do.
        self.share = math.ceil(c2 / nodes)
        start = min(self.share, c2 - self.share)
        self.own = slice(start, start + self.share)
        self.kernels = c2

    def alone(self) -> float:
        start = time.perf_counter()
        logits = self.model.forward(self.x)
        _, grad, _ = softmax_cross_entropy(logits, self.labels)
        self.model.backward(grad)
        self.optimizer.step(self.model.gradients())
        return time.perf_counter() - start

    def block_pass(self, images: int | None = None) -> tuple[float, np.ndarray]:
        """(block forward + backward seconds, its output), of the first ``images`` images
        (None: the whole batch)."""
        k = self.w1.shape[0]
        x = self.x if images is None else self.x[:images]
        start = time.perf_counter()
        y, run = stage_forward(
            self.backend, x, self.w1, self.b1, self.padding1, self.block, slice(0, k)
        )
        forward = time.perf_counter() - start
        dy = np.ones_like(y)
        start = time.perf_counter()
        stage_backward(self.backend, run, dy, slice(0, k), False)
        return forward + time.perf_counter() - start, y

    def stage_pass(self, x: np.ndarray, own: slice) -> float:
        """Forward + backward (input gradient too) of the stage for ``own`` of the kernels."""
        return self.stage_run(x, own)[1]

    def stage_run(self, x: np.ndarray, own: slice) -> tuple[np.ndarray, float]:
        """:meth:`stage_pass`'s input gradient (of ones at the stage's output) and seconds."""
        start = time.perf_counter()
        dx = self.stage_backward(*self.stage_forward(x, own))
        return dx, time.perf_counter() - start

    def stage_forward(self, x: np.ndarray, own: slice):
        """The stage's forward for ``own`` of the kernels (its slice widened by the halo):
        what :meth:`stage_backward` takes."""
        wide = self.stage.widened(own, self.kernels)
        relative = slice(own.start - wide.start, own.stop - wide.start)
        grad = self.stage.grad_range(own, self.kernels)
        grad = slice(grad.start - wide.start, grad.stop - wide.start)
        y, run = stage_forward(
            self.backend, x, self.w2[wide], self.b2[wide], self.padding2, self.stage, relative
        )
        return y, run, grad

    def stage_backward(self, y: np.ndarray, run, grad: slice) -> np.ndarray:
        """The input gradient of a :meth:`stage_forward`, from ones at its output."""
        dy = np.ones((y.shape[0], grad.stop - grad.start, *y.shape[2:]), np.float32)
        dx, _, _ = stage_backward(self.backend, run, dy, grad, True)
        return dx


def node_passes(parts: Parts, repeats: int) -> list[float]:
    """A node's work (its block, then its stage), ``repeats`` times after a cold run."""
    times = []
    for repeat in range(repeats + 1):
        block, y = parts.block_pass()
        stage = parts.stage_pass(y, parts.own)
        if repeat:
            times.append(block + stage)
    return times


def measure(network: str, batch: int, nodes: int, repeats: int) -> dict:
    parts = Parts(network, batch, nodes)
    times: dict[str, list[float]] = {
        "alone": [],
        "block": [],
        "stage": [],
        "full_stage": [],
        "block_part": [],
    }
    # Each program repeats as its process would, step after step (the first run faults its
    # arrays in and is left out): interleaved, each would fault in what the others freed.
    for repeat in range(repeats + 1):
        alone = parts.alone()
        if repeat:
            times["alone"].append(alone)
    for repeat in range(repeats + 1):  # a node: its block, then its share of the stage
        block, y = parts.block_pass()
        stage = parts.stage_pass(y, parts.own)
        if repeat:
            times["block"].append(block)
            times["stage"].append(stage)
    for repeat in range(repeats + 1):  # the whole stage, as the master alone runs it
        _, y = parts.block_pass()
        full = parts.stage_pass(y, slice(0, parts.kernels))
        if repeat:
            times["full_stage"].append(full)
    own_images = math.ceil(batch / nodes)
    for repeat in range(repeats + 1):  # the block of a node's own images only
        part, y = parts.block_pass(own_images)
        if repeat:
            times["block_part"].append(part)
    alone, block, stage, full, part = (statistics.median(v) for v in times.values())
    rest = max(alone - block - full, 0.0)
    node = block + stage
    ideal = full * parts.share / parts.kernels
    return {
        "network": network,
        "batch": batch,
        "nodes": nodes,
        "share": parts.share,
        "alone_s": alone,
        "block_s": block,
        "stage_s": stage,
        "full_stage_s": full,
        "rest_s": rest,
        "stage_excess_s": stage - ideal,
        "work": nodes * node / max(alone - rest, 1e-12),
        "bound": alone / (node + rest),
        "block_part_s": part,
        "bound_split_block": alone / (part + stage + rest),
        "exchange_mb": (batch - own_images) * y[:1].nbytes / 1e6,
    }


def show(r: dict) -> None:
    together = ""
    if "bound_together" in r:
        together = (f" | {r['node_together_s']:7.3f} {r['node_together_max_s']:7.3f} "
                    f"{r['bound_together']:5.2f}x")  # fmt: skip
    print(f"{r['network']:16} {r['batch']:5d} {r['share']:5d} | {r['alone_s']:7.3f} "
          f"{r['block_s']:7.3f} {r['stage_s']:7.3f} {r['full_stage_s']:7.3f} "
          f"{r['rest_s']:6.3f} {r['stage_excess_s']:7.3f} | {r['work']:5.2f} "
          f"{r['bound']:5.2f}x | {r['block_part_s']:7.3f} {r['exchange_mb']:6.1f} "
          f"{r['bound_split_block']:5.2f}x{together}", flush=True)  # fmt: skip


def _wait_for(condition, what: str, children: list[subprocess.Popen], limit: float) -> None:
    """Poll ``condition`` until it holds; a child that exits early, or ``limit`` seconds, is an
    error that names ``what`` was awaited."""
    deadline = time.monotonic() + limit
    while not condition():
        failed = [c for c in children if c.poll() not in (None, 0)]
        if failed:
            raise RuntimeError(f"a node process exited with {failed[0].returncode} ({what})")
        if time.monotonic() > deadline:
            raise RuntimeError(f"node processes not done after {limit:g} s ({what})")
        time.sleep(0.01)


def together(args: argparse.Namespace, network: str, batch: int) -> list[list[float]]:
    """Each of ``args.nodes`` processes' node-work times, the processes run at once (each in
    a cgroup capped at ``args.cap``, one BLAS thread) and released together once all are
    ready."""
    if args.cap:
        ensure_cpu_controller()
    caps = [
        CpuCap(f"hetconv-split-bound-{os.getpid()}-{i}", args.cap)
        for i in range(args.nodes if args.cap else 0)
    ]
    children: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory() as tmp:
        barrier = Path(tmp)
        try:
            for i in range(args.nodes):
                command = [sys.executable, os.path.abspath(__file__), "--networks", network,
                           "--batches", str(batch), "--nodes", str(args.nodes),
                           "--repeats", str(args.repeats),
                           "--node-only", str(barrier / str(i))]  # fmt: skip
                prefix = []
                if caps:
                    caps[i].create()
                    prefix = caps[i].prefix()
                env = with_blas_threads(os.environ, 1)
                children.append(subprocess.Popen(prefix + command, env=env))
            ready = [barrier / f"{i}.ready" for i in range(args.nodes)]
            _wait_for(lambda: all(r.exists() for r in ready), "getting ready", children, 600)
            (barrier / "go").touch()
            for child in children:
                if child.wait() != 0:
                    raise RuntimeError(f"a node process exited with {child.returncode}")
            return [json.loads((barrier / f"{i}.json").read_text()) for i in range(args.nodes)]
        finally:
            for child in children:
                if child.poll() is None:
                    child.kill()
                    child.wait()
            for cap in caps:
                if cap.created:
                    cap.remove()


def node_only(args: argparse.Namespace) -> None:
    """One of :func:`together`'s processes: set up, say ready, wait for the go, time, write."""
    base = Path(args.node_only)
    with threadpool_limits(1):
        parts = Parts(args.networks[0], args.batches[0], args.nodes)
        node_passes(parts, 0)  # fault the arrays in before the others start timing
        Path(f"{base}.ready").touch()
        go = base.parent / "go"
        while not go.exists():
            time.sleep(0.005)
        times = node_passes(parts, args.repeats)
    Path(f"{base}.json").write_text(json.dumps(times))


def add_together(row: dict, runs: list[list[float]]) -> None:
    """``row`` with what the node processes measured at once (module docstring)."""
    medians = [statistics.median(times) for times in runs]
    row["node_together_s"] = statistics.median(medians)
    row["node_together_max_s"] = max(medians)
    row["bound_together"] = row["alone_s"] / (row["node_together_s"] + row["rest_s"])


def capped(args: argparse.Namespace) -> list[dict]:
    """The rows of the same measurement run in a child process capped at ``args.cap`` of a
    core (cgroup v1 ``cpu``, one BLAS thread)."""
    ensure_cpu_controller()
    cap = CpuCap(f"hetconv-split-bound-{os.getpid()}", args.cap)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        command = [sys.executable, os.path.abspath(__file__), "--networks", *args.networks,
                   "--batches", *map(str, args.batches), "--nodes", str(args.nodes),
                   "--repeats", str(args.repeats), "--json", str(out), "--quiet"]  # fmt: skip
        try:
            cap.create()
            subprocess.run(cap.prefix() + command, env=with_blas_threads(os.environ, 1), check=True)
        finally:
            cap.remove()
        return json.loads(out.read_text())


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--networks", nargs="+", default=["paper-150-800", "paper-500-1500"])
    p.add_argument("--batches", nargs="+", type=int, default=[16, 64])
    p.add_argument("--nodes", type=int, default=5, help="master + workers sharing conv2 (5)")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats after a cold one (3)")
    p.add_argument(
        "--cap", type=float, metavar="F",
        help="run capped at F of a core in a CPU cgroup, as the testbed does (root; e.g. 0.36)",
    )  # fmt: skip
    p.add_argument(
        "--together", action="store_true",
        help="also time one node's work in --nodes processes at once (each capped at --cap), "
        "as the testbed's nodes compute on this machine's shared cores",
    )  # fmt: skip
    p.add_argument("--json", metavar="PATH", help="write the rows as a JSON list")
    p.add_argument("--quiet", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--node-only", metavar="BARRIER", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.node_only:
        node_only(args)
        return
    for name in args.networks:
        if name not in PRESETS:
            p.error(f"unknown network {name!r}; choose from {', '.join(PRESETS)}")
    if args.repeats < 1 or args.nodes < 1 or min(args.batches) < 1:
        p.error("--repeats, --nodes and --batches must be positive")
    if args.cap is not None:
        try:
            CpuCap("check", args.cap)
        except ValueError as e:
            p.error(str(e))
        if os.geteuid() != 0:
            p.error("--cap needs root (it creates a CPU cgroup)")
    where = f"capped at {args.cap:g} core" if args.cap else "uncapped"
    together_head = f" | {'node x' + str(args.nodes):>7} {'slowest':>7} {'bound':>6}"
    if not args.quiet:
        print(
            f"kernel split with a replicated first block, compute only: one BLAS thread, {where}, "
            f"{args.nodes} nodes, median of {args.repeats} (seconds)"
        )
        print(
            f"{'network':16} {'batch':>5} {'share':>5} | {'alone':>7} {'block':>7} "
            f"{'stage':>7} {'full':>7} {'rest':>6} {'excess':>7} | {'work':>5} {'bound':>6}"
            f" | {'b.part':>7} {'MB':>6} {'split':>6}" + (together_head if args.together else "")
        )
    if args.cap:
        rows = capped(args)
        for r in rows:
            r["cap"] = args.cap
            if args.together:
                add_together(r, together(args, r["network"], r["batch"]))
            show(r)
    else:
        rows = []
        for name in args.networks:
            for batch in args.batches:
                with threadpool_limits(1):
                    r = measure(name, batch, args.nodes, args.repeats)
                r["cap"] = None
                if args.together:
                    add_together(r, together(args, name, batch))
                if not args.quiet:
                    show(r)
                rows.append(r)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
