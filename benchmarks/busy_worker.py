"""A worker that gets busy mid-training: shares re-planned from measured speed vs a fixed split.

Two local workers and the master train the same steps twice, alternating: once with
``rebalance_every`` (shares follow measured speed) and once with 0 (the split stays as probed,
as in the paper). Worker A has CPU 0 to itself. At ``--busy-at`` it gets busy, as a laptop whose
owner started something heavy: a CPU cgroup caps it at ``--throttle`` of a CPU (root; Linux
cgroup v1 or v2), or where that cannot be had, ``--hogs`` processes spin on CPU 0 (weaker: Linux
favours a mostly idle process over spinning ones). The master (one BLAS thread, no share of the
convolutions) and worker B are on CPU 1. Figures are mean step times before A got busy and after
(once the rebalanced run has had time to notice: from ``--busy-at`` plus two periods on), and
their ratio. Linux only (CPU affinity), at least 2 CPUs.

    python benchmarks/busy_worker.py [--preset tiny] [--batch 32] [--steps 100] [--busy-at 30]
        [--every 10] [--throttle 0.25] [--hogs 3] [--rounds 2] [--json PATH]
"""

from __future__ import annotations

import argparse
import io
import json
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits

from hetconv.master.cluster import Cluster, ClusterConfig
from hetconv.master.launch import LocalWorkers
from hetconv.simulations.trace import read_steps
from hetconv.training import TrainConfig, train


def _pin(pid: int, cpus: set[int]) -> None:
    """Every thread of process ``pid`` (sched_setaffinity on a pid moves one thread only; the
    threads started later inherit from these)."""
    for task in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(task), cpus)


def _spin() -> None:
    os.sched_setaffinity(0, {0})
    while True:
        pass


class _CpuCap:
    """A CPU cgroup capping its processes at ``fraction`` of one CPU, or None if none can be
    made here (cgroup v1 ``cpu`` controller or v2, writable: root)."""

    PERIOD_US = 10_000  # short periods: the cap acts within each call, not in 100 ms lumps

    def __init__(self, fraction: float):
        self.path: Path | None = None
        quota = max(1000, int(self.PERIOD_US * fraction))
        name = f"hetconv-busy-{os.getpid()}"
        for root, files in (
            (Path("/sys/fs/cgroup/cpu"), {"cpu.cfs_period_us": self.PERIOD_US,
                                           "cpu.cfs_quota_us": quota}),
            (Path("/sys/fs/cgroup"), {"cpu.max": f"{quota} {self.PERIOD_US}"}),
        ):  # fmt: skip
            path = root / name
            try:
                path.mkdir()
            except OSError:
                continue
            try:
                for file, value in files.items():
                    (path / file).write_text(f"{value}\n")
            except OSError:
                path.rmdir()
                continue
            self.path = path
            return

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(f"{pid}\n")

    def remove(self) -> None:
        if self.path is not None:
            for _ in range(50):  # empty once its processes have exited
                try:
                    self.path.rmdir()
                    return
                except OSError:
                    time.sleep(0.1)


class _GetsBusy(Cluster):
    """A cluster whose first worker's CPU gets a competing process at step ``busy_at``."""

    def __init__(self, addresses, config, busy_at: int, hogs: int, cap, worker_pid: int):
        super().__init__(addresses, config=config)
        self.busy_at, self.hogs, self.cap, self.worker_pid = busy_at, hogs, cap, worker_pid
        self.started: list[multiprocessing.Process] = []

    def begin_step(self, step: int) -> None:
        if step == self.busy_at and self.cap is not None:
            self.cap.add(self.worker_pid)
        elif step == self.busy_at:
            for _ in range(self.hogs):
                hog = multiprocessing.Process(target=_spin, daemon=True)
                hog.start()
                self.started.append(hog)
        super().begin_step(step)

    def close(self) -> None:
        for hog in self.started:
            hog.terminate()
            hog.join()
        super().close()


def _run(args, every: int, scratch: Path, label: str) -> dict:
    cap = _CpuCap(args.throttle) if args.throttle else None
    if cap is not None and cap.path is None:
        cap = None
    try:
        return _run_capped(args, every, scratch, label, cap)
    finally:
        if cap is not None:
            cap.remove()


def _run_capped(args, every: int, scratch: Path, label: str, cap) -> dict:
    with LocalWorkers(2) as workers:
        a, b = workers.processes
        _pin(a.pid, {0})
        _pin(b.pid, {1})
        trace = scratch / f"{label}.jsonl"
        config = TrainConfig(
            preset=args.preset, batch=args.batch, steps=args.steps, train_size=args.batch * 20,
            eval_size=0, progress=False, trace=str(trace),
        )  # fmt: skip
        # The master computes no share: its convolutions would share CPU 1 with worker B and
        # make the two of them the bottleneck before A is busy at all.
        cluster_config = ClusterConfig(rebalance_every=every, master_compute=False)
        with _GetsBusy(
            workers.addresses, cluster_config, args.busy_at, args.hogs, cap, a.pid
        ) as cluster:
            train(config, cluster, log=io.StringIO())
            changes = [e for e in cluster.events if e["event"] == "shares_changed"]
    records = read_steps(str(trace))
    settled = args.busy_at + 2 * max(args.every, 1)
    before = [r["seconds"] for r in records[1 : args.busy_at]]
    after = [r["seconds"] for r in records[settled:]]
    return {
        "busy_by": f"cgroup cap {args.throttle:g} CPU" if cap else f"{args.hogs} hogs",
        "rebalance_every": every,
        "before_s": float(np.mean(before)),
        "after_s": float(np.mean(after)),
        "share_changes": [(e["step"], e.get("reason", "")) for e in changes],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--busy-at", type=int, default=30)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--throttle", type=float, default=0.25,
        help="the CPU fraction worker A is capped at (cgroup); 0: use --hogs instead",
    )  # fmt: skip
    parser.add_argument("--hogs", type=int, default=3, help="spinning processes on CPU 0")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    if not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2:
        print("busy_worker: needs Linux CPU affinity and at least 2 CPUs", file=sys.stderr)
        return 2
    if args.busy_at + 2 * args.every + 5 > args.steps:
        parser.error("--steps must leave at least 5 steps after --busy-at + 2 periods")
    saved = os.sched_getaffinity(0)
    _pin(os.getpid(), {1})  # the master; its workers are placed in _run
    # One BLAS thread in the master, as the embedded default: threads started before the
    # pinning would otherwise stay on CPU 0 and fight the hog.
    limit = threadpool_limits(limits=1, user_api="blas")
    rows = []
    try:
        with tempfile.TemporaryDirectory() as scratch:
            for round_ in range(args.rounds):
                for every in (args.every, 0):
                    row = _run(args, every, Path(scratch), f"{round_}-{every}")
                    row["round"] = round_
                    rows.append(row)
                    label = f"every {every}" if every else "fixed split"
                    print(
                        f"[{row['busy_by']}] round {round_} {label:<12} "
                        f"before {1e3 * row['before_s']:6.1f} ms/step"
                        f"  after {1e3 * row['after_s']:6.1f} ms/step  "
                        f"changes at steps {[s for s, _ in row['share_changes']]}",
                        flush=True,
                    )
    finally:
        limit.restore_original_limits()
        _pin(os.getpid(), saved)
    fixed = np.mean([r["after_s"] for r in rows if r["rebalance_every"] == 0])
    moving = np.mean([r["after_s"] for r in rows if r["rebalance_every"]])
    print(f"after the worker got busy: fixed / rebalanced step time = {fixed / moving:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
