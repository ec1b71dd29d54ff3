"""What spot checks cost and how fast they catch a lying worker (``hetconv train
--spot-check-every``).

Overhead: the same training (preset, batch, seed, synthetic data) through the same local worker
processes, with spot checks at each rate asked for and off, the runs interleaved (off, on, off,
on, ...) so that load from elsewhere on the machine falls on both alike. The kernels are split
evenly over the master and the workers in every run, so runs differ only by the checks. Per
run: the mean step time (step 0 left out: it warms caches) and the seconds the checks took per
step (from the trace's ``spot_checks`` records: master time the step waits for). Two figures of
the overhead: the step times' ratio (noisy on a shared machine) and the checks' own seconds
over the step time with checks off (what the checks add if nothing else changes).

Detection delay: one honest worker process and one that lies (``tests/lying_worker.py``) from
step ``--lie-from`` on, training until the liar is dropped (or ``--max-delay`` steps more);
delay = the step it is dropped at minus the step its lie began (0: caught in the very step).
Lies: ``scale`` (every value x1.5), ``kernel`` (one kernel of its slice x1.5: feature maps,
kernel and bias gradients; the input gradient right), ``noise`` (every value x(1 + 1e-3
N(0, 1))), ``every_other`` (every other forward answer x1.5), ``update`` (its SGD updates of
resident slices x1.01), ``head`` (a split head's logits x1.5); with the first block split by
images, ``parts`` (the block output it puts into its peers x1.5), ``rows`` (the input-gradient
rows it puts into them x1.5), ``withhold`` (it puts nothing).

Both per mode (``--modes``): ``unfused`` (the paper's: plain convolutions, kernels sent),
``fused`` (fused stages, kernels sent), ``resident`` (fused stages, resident kernels, a split
head: ``hetconv train``'s choice on the reference networks), whose answers between syncs are
checked by replaying a sample of each slice at its sync (``--sync-every``; a resident mode's
timed runs last at least one sync); ``split`` (fused stages, kernels sent, the first block
split by images: ``--replicate split``) and ``split_resident`` (the same with resident kernels
and a split head), whose checks on add the part checks: every step each receiver's sample of
the block outputs it got, on due steps of the gradient rows (with resident kernels the sender's
slice fetched for it). A last table puts the modes side by side: the step ratio, the checks'
share of the step, and each lie's median delay.

    python benchmarks/spot_checks.py [--preset paper-50-500] [--batch 16 64] [--every 1 4]
        [--modes unfused resident split split_resident] [--sync-every 20] [--steps 8] [--repeats 3]
        [--lies scale kernel noise every_other update head parts rows withhold] [--trials 3]
        [--wire-format float32] [--json PATH]

(about 10 minutes on 2 cores per mode with the defaults).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from threadpoolctl import threadpool_limits

from hetconv.balance import kernel_shares
from hetconv.calls import READY
from hetconv.formats import format_named
from hetconv.master.cluster import Cluster, ClusterConfig
from hetconv.master.launch import LocalWorkers, stop_processes
from hetconv.master.resident import DEFAULT_SYNC_EVERY
from hetconv.master.spotcheck import DEFAULT_EVERY, SpotCheckConfig
from hetconv.simulations.trace import read_steps
from hetconv.training import TrainConfig, train
from hetconv.workload import network_layers

LIAR = Path(__file__).resolve().parents[1] / "tests" / "lying_worker.py"
#: ``--modes``: each mode's ClusterConfig settings.
MODES = {
    "unfused": dict(stages="unfused"),
    "fused": dict(stages="fused"),
    "resident": dict(stages="fused", kernels="resident", head="split"),
    "split": dict(stages="fused", kernels="sent", replicate="split"),
    "split_resident": dict(stages="fused", kernels="resident", head="split", replicate="split"),
}
#: The modes whose kernels are resident (their timed runs last past a sync).
RESIDENT = ("resident", "split_resident")
#: The lies a mode's answers can carry (tests/lying_worker.py's kinds; with resident kernels
#: the kernel split's and fused stage's lies touch no call the mode makes).
LIES = {
    "unfused": ("scale", "kernel", "noise", "every_other"),
    "fused": ("scale", "kernel", "noise", "every_other"),
    "resident": ("every_other", "update", "head"),
    "split": ("parts", "rows", "withhold"),
    "split_resident": ("parts", "rows", "withhold"),
}


def _mode(args, mode: str) -> dict:
    settings = dict(MODES[mode], rebalance_every=0, wire_format=format_named(args.wire_format))
    if mode in RESIDENT:
        settings["resident_sync_every"] = args.sync_every
    return settings


def _steps(args, mode: str, steps: int) -> int:
    """A resident mode's runs last past a sync (its checks between syncs are made there)."""
    return max(steps, args.sync_every + 2) if mode in RESIDENT else steps


def _even_shares(preset: str, batch: int, nodes: int) -> dict[str, tuple[int, ...]]:
    return {
        layer.name: tuple(kernel_shares(layer.kernels, [1.0] * nodes))
        for layer in network_layers(preset, batch)
    }


def _config(args, batch: int, steps: int, trace: str | None, seed: int = 0) -> TrainConfig:
    return TrainConfig(
        preset=args.preset, steps=steps, batch=batch, seed=seed, train_size=max(512, batch * 8),
        eval_size=0, progress=False, trace=trace,
    )  # fmt: skip


def _timed_run(
    args, mode: str, addresses, batch: int, every: int, trace: str
) -> tuple[float, float, float]:
    """(mean step seconds, mean spot-check seconds per step), step 0 left out, and the worst
    error over scale any check saw (of honest workers: the margin below the tolerance)."""
    config = ClusterConfig(
        shares=_even_shares(args.preset, batch, len(addresses) + 1),
        spot_checks=SpotCheckConfig(every=every),
        **_mode(args, mode),
    )
    steps = _steps(args, mode, args.steps)
    with Cluster(addresses, config=config) as cluster:
        train(_config(args, batch, steps, trace), cluster, log=io.StringIO())
    records = read_steps(trace)[1:]
    steps = [r["seconds"] for r in records]
    checks = [_check_seconds(r) for r in records]
    worst = [
        entry["worst"]
        for r in read_steps(trace)
        for entry in r.get("spot_checks", {}).get("workers", {}).values()
    ]
    return statistics.mean(steps), statistics.mean(checks), max(worst, default=0.0)


def _check_seconds(record: dict) -> float:
    """A step's checks' seconds: its spot checks' record (the part checks' included), or on a
    step with none (nothing compared but a split block's parts) its split's part checks'."""
    if "spot_checks" in record:
        return record["spot_checks"]["seconds"]
    return sum(s.get("check_seconds", 0.0) for s in record.get("replica_split", {}).values())


def overhead(args, mode: str, tmp: Path) -> list[dict]:
    rows = []
    rates = [0] + [e for e in args.every if e > 0]
    print(
        f"\n{'mode':<9} {'preset':<14} {'batch':>5} {'every':>5} {'step ms':>8} {'checks ms':>9} "
        f"{'step ratio':>10} {'checks/step':>11} {'worst err':>9}"
    )
    with LocalWorkers(args.workers) as workers:
        for batch in args.batch:
            seconds: dict[int, list[float]] = {e: [] for e in rates}
            checks: dict[int, list[float]] = {e: [] for e in rates}
            worst: dict[int, float] = dict.fromkeys(rates, 0.0)
            for repeat in range(args.repeats):
                for every in rates if repeat % 2 == 0 else rates[::-1]:
                    trace = str(tmp / f"{mode}-b{batch}-e{every}-r{repeat}.jsonl")
                    step, check, error = _timed_run(
                        args, mode, workers.addresses, batch, every, trace
                    )
                    worst[every] = max(worst[every], error)
                    seconds[every].append(step)
                    checks[every].append(check)
            off = statistics.median(seconds[0])
            for every in rates:
                step = statistics.median(seconds[every])
                check = statistics.median(checks[every])
                row = {
                    "measure": "overhead",
                    "mode": mode,
                    "preset": args.preset,
                    "batch": batch,
                    "every": every,
                    "workers": args.workers,
                    "wire_format": args.wire_format,
                    "sync_every": args.sync_every if mode in RESIDENT else None,
                    "replicate": MODES[mode].get("replicate", "none"),
                    "steps": _steps(args, mode, args.steps),
                    "repeats": args.repeats,
                    "step_seconds": step,
                    "step_seconds_runs": seconds[every],
                    "check_seconds_per_step": check,
                    "step_ratio": step / off,
                    "checks_over_step_off": check / off,
                    "worst_error_over_scale": worst[every],
                }
                rows.append(row)
                print(
                    f"{mode:<9} {args.preset:<14} {batch:>5} {every or 'off':>5} "
                    f"{1e3 * step:>8.1f} {1e3 * check:>9.2f} {step / off:>10.3f} "
                    f"{100 * check / off:>10.2f}% {worst[every]:>9.2g}",
                    flush=True,
                )
    return rows


def _start_liar(kind: str, from_step: int, seed: int) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen(
        [sys.executable, "-I", str(LIAR), kind, str(from_step), str(seed)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=dict(os.environ, OPENBLAS_NUM_THREADS="1"),
    )  # fmt: skip
    for line in process.stdout:
        if line.startswith(READY):
            return process, line[len(READY) :].strip()
    raise RuntimeError(f"the lying worker did not start (status {process.wait()})")


class _Caught(Exception):
    pass


class _StopWhenCaught(Cluster):
    """Ends training at the step boundary after the liar was dropped."""

    liar = ""

    def begin_step(self, step):
        if any(e["event"] == "worker_lost" and e.get("worker") == self.liar for e in self.events):
            raise _Caught
        super().begin_step(step)


def _detect_once(args, mode: str, honest: str, kind: str, trial: int, every: int) -> dict:
    """One run with a liar from step ``--lie-from + trial``; its detection row."""
    batch, from_step = args.batch[0], args.lie_from + trial
    process, liar = _start_liar(kind, from_step, seed=trial)
    try:
        config = ClusterConfig(
            shares=_even_shares(args.preset, batch, 3),
            spot_checks=SpotCheckConfig(every=every, seed=trial),
            **_mode(args, mode),
        )
        run = _config(args, batch, from_step + args.max_delay + 1, None, seed=trial)
        with _StopWhenCaught([honest, liar], config=config) as cluster:
            cluster.liar = liar
            try:
                train(run, cluster, log=io.StringIO())
            except _Caught:
                pass
            lost = [
                e for e in cluster.events if e["event"] == "worker_lost" and e.get("worker") == liar
            ]
    finally:
        process.stdin.close()
        stop_processes([process])
    caught = lost[0]["step"] if lost else None
    return {
        "measure": "detection",
        "mode": mode,
        "preset": args.preset,
        "batch": batch,
        "every": every,
        "wire_format": args.wire_format,
        "lie": kind,
        "trial": trial,
        "lie_from_step": from_step,
        "caught_step": caught,
        "delay_steps": None if caught is None else caught - from_step,
        "where": lost[0]["reason"].split(": ", 2)[1] if lost else "",
        "max_delay": args.max_delay,
    }


def detection(args, mode: str) -> list[dict]:
    rows = []
    every = args.every[0]
    print(
        f"\n{'mode':<9} {'lie':<11} {'every':>5} {'trial':>5} {'lie from':>8} {'caught':>7} "
        f"{'delay':>6}"
    )
    with LocalWorkers(1) as honest:
        for kind in [k for k in args.lies if k in LIES[mode]]:
            for trial in range(args.trials):
                row = _detect_once(args, mode, honest.addresses[0], kind, trial, every)
                rows.append(row)
                caught, delay = row["caught_step"], row["delay_steps"]
                print(
                    f"{mode:<9} {kind:<11} {every:>5} {trial:>5} {row['lie_from_step']:>8} "
                    f"{'-' if caught is None else caught:>7} "
                    f"{f'>{args.max_delay}' if delay is None else delay:>6}  {row['where']}",
                    flush=True,
                )
    return rows


def _median_delay(rows: list[dict], mode: str, lie: str) -> str:
    found = [r for r in rows if r["measure"] == "detection" and r["mode"] == mode]
    delays = [r["delay_steps"] for r in found if r["lie"] == lie]
    if not delays:
        return "-"
    if None in delays:
        return f">{found[0]['max_delay']}"
    return f"{statistics.median(delays):g}"


def side_by_side(rows: list[dict], modes: list[str], lies: list[str]) -> None:
    """Per mode and rate: the step ratio and the checks' share (the first batch), and each
    lie's median delay (steps; > max: not caught)."""
    print(f"\n{'mode':<9} {'every':>5} {'step ratio':>10} {'checks/step':>11}", end="")
    print("".join(f" {lie:>11}" for lie in lies))
    for mode in modes:
        timed = [r for r in rows if r["measure"] == "overhead" and r["mode"] == mode]
        first = [r for r in timed if r["every"] and r["batch"] == timed[0]["batch"]]
        for r in first or [None]:
            line = f"{mode:<9} "
            if r is None:
                line += f"{'-':>5} {'-':>10} {'-':>11}"
            else:
                share = 100 * r["checks_over_step_off"]
                line += f"{r['every']:>5} {r['step_ratio']:>10.3f} {share:>10.2f}%"
            print(line + "".join(f" {_median_delay(rows, mode, lie):>11}" for lie in lies))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="paper-50-500")
    parser.add_argument("--batch", type=int, nargs="+", default=[16, 64])
    parser.add_argument(
        "--every", type=int, nargs="+", default=[DEFAULT_EVERY],
        help="spot-check rates to time against off (the first one for detection)",
    )  # fmt: skip
    parser.add_argument("--steps", type=int, default=8, help="steps per timed run")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per rate and batch")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--wire-format", default="float32")
    parser.add_argument(
        "--modes", nargs="+", default=["unfused", "resident"], choices=tuple(MODES),
        help="unfused: plain convolutions; fused: fused stages, kernels sent; resident: fused "
        "stages, resident kernels, a split head; split, split_resident: fused and resident with "
        "the first block split by images, its part checks on with the checks (each mode's "
        "lies, see the docstring)",
    )  # fmt: skip
    parser.add_argument(
        "--sync-every", type=int, default=DEFAULT_SYNC_EVERY,
        help="the resident mode's steps between syncs (hetconv train --resident-sync-every)",
    )  # fmt: skip
    parser.add_argument(
        "--lies", nargs="*",
        default=["scale", "kernel", "noise", "every_other", "update", "head", "parts", "rows"],
    )  # fmt: skip
    parser.add_argument("--trials", type=int, default=3, help="detection runs per lie")
    parser.add_argument("--lie-from", type=int, default=3, help="first lying step, trial 0")
    parser.add_argument("--max-delay", type=int, default=20)
    parser.add_argument("--skip-overhead", action="store_true")
    parser.add_argument("--json", metavar="PATH", help="write the rows as a JSON list")
    args = parser.parse_args()
    rows = []
    # The master keeps one BLAS thread: the workers take one each of this machine's cores.
    with threadpool_limits(limits=1, user_api="blas"), tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes:
            if not args.skip_overhead:
                rows += overhead(args, mode, Path(tmp))
            if args.lies:
                rows += detection(args, mode)
        if not args.skip_overhead:
            print(
                "step ms: median over the runs of the mean step time (step 0 left out); checks "
                "ms: the checks' own seconds per step; step ratio: step time over that with "
                "checks off; checks/step: checks ms over the step time with checks off; worst "
                "err: the largest error over scale any check of these honest workers saw "
                "(tolerance 1e-4 in float32)"
            )
        if args.lies:
            print(
                "delay: steps from the first lying step to the step the liar was dropped at "
                "(0: the same step); where: the call whose check caught it"
            )
        side_by_side(rows, args.modes, args.lies)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
