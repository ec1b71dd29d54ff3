"""One cuda worker against PyTorch on the same GPU, and hetconv alone on the host's cores.

Per network and batch, three engines train the same network (``benchmarks/ddp_rank.py``'s
torch twin of the spec: its LRN as shifted slice-adds) on random CIFAR-shaped images held on
the host, fp32 (TF32 off in torch, and CuPy's GEMMs are fp32):

1. **torch**: one torch process on the GPU; each step copies the batch from the host
   (``torch_device_data_s``: the same with the batch already on the GPU).
2. **hetconv-cuda-worker**: one ``hetconv worker --backend cuda`` on the GPU and a master with
   ``--no-master-compute`` (every convolution and its stage on the worker; the master keeps
   the rest, with ``--threads`` BLAS threads), over loopback, the default modes (``--flags``
   adds more).
3. **hetconv-local**: ``hetconv train --local`` on the host's cores (``--threads`` BLAS threads).

A row: ``step_s`` (median of the steps after ``--warmup``; hetconv's from its trace),
``steps_per_s``, and ``x_torch`` = step / torch's step. Example (a GPU machine, a few
minutes)::

    python benchmarks/gpu_vs_torch.py --network paper-500-1500 resnet20 --batch 64 \\
        --json gpu_vs_torch.json

Without a GPU it stops with one line saying why. ``--dry-run`` runs the argument checks and
the table on the CPU with the tiny network: torch on the CPU, hetconv ``--local``, no worker.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hetconv.argtypes import positive  # noqa: E402
from hetconv.calls import READY  # noqa: E402
from hetconv.simulations.trace import read_steps  # noqa: E402
from hetconv.spec import PRESETS  # noqa: E402

TORCH, WORKER, LOCAL = "torch", "hetconv-cuda-worker", "hetconv-local"
#: The worker's backend (the tests run the same code with "cpu").
WORKER_BACKEND = "cuda"
#: The cuda worker's runs ``--modes`` names: `hetconv train` flags beside --no-master-compute.
MODES = {
    "default": [],
    "replicate": ["--replicate", "first"],  # conv2's input computed on the worker itself
    "images": ["--split", "images"],  # the whole network on the worker, gradients to the master
    "images_ring": ["--split", "images", "--exchange", "ring", "--spot-check-every", "0"],
}


@dataclass
class Row:
    network: str
    batch: int
    engine: str
    device: str
    step_s: float | None
    steps_per_s: float | None
    x_torch: float | None
    note: str = ""


def gpu_missing() -> str | None:
    """Why this machine cannot run the comparison (None: it can)."""
    from hetconv.backends.cuda import CudaBackend

    ok, why = CudaBackend.is_available()
    if not ok:
        return f"no GPU for hetconv's cuda backend: {why}"
    try:
        import torch
    except ImportError as e:
        return f"torch is not installed ({e})"
    if not torch.cuda.is_available():
        return "torch sees no CUDA GPU (torch.cuda.is_available() is False)"
    return None


def torch_steps(network: str, batch: int, steps: int, device: str) -> tuple[float, float, str]:
    """(median step with host data, median step with device data, the device's name) of
    ``steps`` torch steps after two warm-up steps of each."""
    import torch
    from ddp_rank import global_batch, torch_model, weighted_step

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    gpu = device.startswith("cuda")
    torch.backends.cudnn.benchmark = gpu
    model = torch_model(network).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
    x, y = global_batch(batch, 0)
    on_device = (x.to(device), y.to(device))

    def sync():
        if gpu:
            torch.cuda.synchronize()

    def timed(host: bool) -> float:
        seconds = []
        for _ in range(steps + 2):
            sync()
            start = time.perf_counter()
            xs, ys = (x.to(device), y.to(device)) if host else on_device
            weighted_step(model, optimizer, xs, ys, 1.0)
            sync()
            seconds.append(time.perf_counter() - start)
        return statistics.median(seconds[2:])

    name = torch.cuda.get_device_name(device) if gpu else "cpu"
    return timed(True), timed(False), name


def _hetconv(argv: list[str], env: dict[str, str], timeout: float) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "hetconv", *argv],
        env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    if done.returncode != 0:
        last = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise RuntimeError(f"hetconv {argv[0]} exited with {done.returncode}: {last[0]}")


def hetconv_step(
    args, network: str, batch: int, where: list[str], threads: int, label: str
) -> float:
    """Median step seconds of ``hetconv train`` on ``network`` (``where``: --local or the
    worker and --no-master-compute), from its trace (kept in ``--trace-dir`` if given, as
    ``<label>-<network>-b<batch>.jsonl``)."""
    env = dict(os.environ, OPENBLAS_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads))
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(args.trace_dir) if args.trace_dir else Path(scratch)
        trace = str(folder / f"{label}-{network}-b{batch}.jsonl")
        argv = [
            "train", "--model", network, "--batch", str(batch),
            "--steps", str(args.warmup + args.steps), "--eval-size", str(batch),
            "--train-size", str(batch * (args.warmup + args.steps + 1)),
            "--trace", trace, "--no-progress", "--no-run-dir", *where,
        ]  # fmt: skip
        _hetconv(argv, env, args.timeout)
        steps = read_steps(trace)[args.warmup :]
    if not steps:
        raise RuntimeError(f"the trace of {network} has no step after {args.warmup} warmup")
    return statistics.median(r["seconds"] for r in steps)


class CudaWorker:
    """A ``hetconv worker --backend cuda`` process on loopback while in use."""

    def __init__(self, device: int, timeout: float = 120.0):
        command = [
            sys.executable, "-m", "hetconv", "worker", "--listen", "127.0.0.1:0",
            "--backend", WORKER_BACKEND, "--no-startup-probe", "--exit-on-stdin-close",
        ]  # fmt: skip
        if WORKER_BACKEND != "cpu":
            command += ["--device", str(device)]
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        self.lines: list[str] = []
        ready = threading.Event()

        def drain():
            for line in self.process.stdout:
                self.lines.append(line.rstrip("\n"))
                if line.startswith(READY):
                    ready.set()

        threading.Thread(target=drain, daemon=True).start()
        if not ready.wait(timeout):
            self.close()
            raise RuntimeError("the cuda worker did not start: " + " | ".join(self.lines[-3:]))
        self.address = self.lines[-1][len(READY) :].strip()

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()


def worker_row(args, network: str, batch: int, mode: str, name: str) -> Row:
    """One cuda worker's run in ``mode`` (:data:`MODES`), the master computing nothing; a run
    that fails gives a row without a step, saying why."""
    label = WORKER if mode == "default" else f"{WORKER}-{mode}"
    flags = [*MODES[mode], *args.flags]
    worker = CudaWorker(args.device)
    try:
        where = ["--worker", worker.address, "--no-master-compute", *flags]
        step = hetconv_step(args, network, batch, where, args.threads, f"worker-{mode}")
    except (RuntimeError, subprocess.SubprocessError) as e:
        return Row(network, batch, label, name, None, None, None, f"failed: {e}")
    finally:
        worker.close()
        if args.trace_dir:
            log = Path(args.trace_dir) / f"worker-{mode}-{network}-b{batch}.log"
            log.write_text("\n".join(worker.lines) + "\n")
    return Row(network, batch, label, name, step, None, None, " ".join(flags))


def measure(args, network: str, batch: int) -> list[Row]:
    """The rows of one network and batch."""
    device = "cpu" if args.dry_run else f"cuda:{args.device}"
    torch_s, resident_s, name = torch_steps(network, batch, args.steps, device)
    rows = [Row(network, batch, TORCH, name, torch_s, None, None,
                f"batch on the {'host' if not args.dry_run else 'cpu'}; "
                f"already on the device: {resident_s:.4f} s")]  # fmt: skip
    if args.dry_run:
        rows.append(Row(network, batch, WORKER, "-", None, None, None, "dry run: no GPU"))
    else:
        for mode in args.modes:
            rows.append(worker_row(args, network, batch, mode, name))
    if not args.no_local:
        step = hetconv_step(args, network, batch, ["--local"], args.threads, "local")
        rows.append(Row(network, batch, LOCAL, f"{args.threads} cores", step, None, None))
    for row in rows:
        if row.step_s is not None:
            row.steps_per_s = 1.0 / row.step_s
            row.x_torch = row.step_s / torch_s
        print(format_table([row]).splitlines()[1], file=sys.stderr, flush=True)
    return rows


def format_table(rows: list[Row]) -> str:
    """The rows as a fixed-width table."""
    head = (
        f"{'network':<16} {'batch':>5} {'engine':<30} {'step_s':>8} {'steps/s':>8} {'x torch':>8}"
    )
    lines = [head]
    for r in rows:
        cells = [f"{v:>8.4f}" if v is not None else f"{'-':>8}" for v in (r.step_s,)]
        cells += [
            f"{v:>8.2f}" if v is not None else f"{'-':>8}" for v in (r.steps_per_s, r.x_torch)
        ]
        lines.append(f"{r.network:<16} {r.batch:>5} {r.engine:<30} {' '.join(cells)}  {r.note}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="One hetconv cuda worker against PyTorch on the same GPU, and hetconv "
        "--local on the host's cores: steps per second of each (fp32, TF32 off, host data)."
    )
    p.add_argument("--network", nargs="+", default=["paper-500-1500", "resnet20"],
                   help="presets (default: paper-500-1500 resnet20)")  # fmt: skip
    p.add_argument("--batch", nargs="+", type=positive(int), default=[64],
                   help="images per step (default: 64)")  # fmt: skip
    p.add_argument("--steps", type=positive(int), default=5, help="measured steps (5)")
    p.add_argument("--warmup", type=int, default=2, help="steps left out at each start (2)")
    p.add_argument("--device", type=int, default=0, help="the GPU's number (0)")
    p.add_argument("--threads", type=positive(int), default=os.cpu_count() or 1,
                   help="BLAS threads of hetconv --local (default: every core)")  # fmt: skip
    p.add_argument("--modes", nargs="+", default=["default"], choices=list(MODES),
                   help="the cuda worker's runs, a row each: default (no mode flag), "
                   "replicate (--replicate first), images (--split images), images_ring "
                   "(with --exchange ring --spot-check-every 0); default: default")  # fmt: skip
    p.add_argument("--no-local", action="store_true", help="skip hetconv --local")
    p.add_argument("--flags", nargs=argparse.REMAINDER, default=[],
                   help="more `hetconv train` flags for the worker's run (last)")  # fmt: skip
    p.add_argument("--timeout", type=positive(float), default=1800.0,
                   help="seconds each hetconv run may take (1800)")  # fmt: skip
    p.add_argument("--json", metavar="PATH", help="also write the rows here")
    p.add_argument("--trace-dir", metavar="DIR",
                   help="keep each hetconv run's trace and the worker's output here")  # fmt: skip
    p.add_argument("--dry-run", action="store_true",
                   help="no GPU: torch on the CPU, hetconv --local, tiny")  # fmt: skip
    return p


def check_arguments(args: argparse.Namespace) -> str | None:
    """Why the arguments cannot run (None: they can)."""
    unknown = [n for n in args.network if n not in PRESETS and not n.endswith(".json")]
    if unknown:
        return f"--network {unknown[0]!r} is not a preset ({', '.join(PRESETS)}) or a .json"
    if args.warmup < 0:
        return f"--warmup must be >= 0, got {args.warmup}"
    if args.device < 0:
        return f"--device must be >= 0, got {args.device}"
    if args.trace_dir and not Path(args.trace_dir).is_dir():
        return f"--trace-dir {args.trace_dir!r} is not a folder"
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    wrong = check_arguments(args)
    if wrong is not None:
        print(f"gpu_vs_torch.py: {wrong}", file=sys.stderr)
        return 2
    if args.dry_run:
        import torch

        torch.set_num_threads(1)
        args.network = ["tiny"]
        args.batch, args.steps, args.warmup = [4], 2, 1
        args.threads = 1
    else:
        missing = gpu_missing()
        if missing is not None:
            print(f"gpu_vs_torch.py: {missing} (--dry-run runs it on the CPU)", file=sys.stderr)
            return 2
    rows: list[Row] = []
    try:
        for network in args.network:
            for batch in args.batch:
                rows += measure(args, network, batch)
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        print(f"gpu_vs_torch.py: {e}", file=sys.stderr)
        return 1
    print(format_table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
