"""Soak one real worker process: thousands of mixed requests, their rate, and its memory.

A ``hetconv worker`` process (started as the embedded cluster starts them: ``LocalWorkers``,
one BLAS thread) answers a fixed mix from one :class:`WorkerClient`, repeated in this order:

* 4 x a bundled Forward then Backward (with dx) of the tiny preset's conv2 at batch 8, one
  step after another of one session, as training sends them;
* 1 x a streamed Forward of a bigger layer, x (8, 16, 48, 48) = 1.2 MB (over the 1 MiB
  bundle limit, so header plus chunks each way);
* 1 x an Echo of 4 KiB (the master's link measurement).

    python benchmarks/soak.py [--requests 5000 | --seconds S] [--interval N] [--warmup 500]
                              [--max-growth-mib 20] [--json PATH]

The worker's resident memory (``VmRSS``, Linux) is read after a warm-up, every ``--interval``
requests and at the end. The warm-up is long (500 requests) because a fresh worker's memory
rises by some 35 MiB over its first few hundred requests of this mix and then stays flat (the
cpu backend's per-thread scratch buffers and gRPC's buffers reaching their high-water marks);
growth after that is what a leak would show. Growth beyond ``--max-growth-mib`` prints "RSS
growth exceeds bound" (the exit status stays 0: this measures, the tests judge). The tiny
layer's results are checked against the cpu backend here before and after the soak, so a fast
but wrong worker cannot pass.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hetconv.backends import Padding, get_backend
from hetconv.master.client import WorkerClient, WorkerUnavailable
from hetconv.master.launch import LocalWorkers
from hetconv.model import Model, load_spec

BATCH = 8
BIG_X = (8, 16, 48, 48)  # 1.18 MB of float32: a streamed call
BIG_K = 16
ECHO_FLOATS = 1024  # 4 KiB
#: Requests of one round of the mix, by kind, in order (see the module docstring).
ROUND = ["forward-bundle", "backward-bundle"] * 4 + ["forward-stream", "echo"]


def rss_mib(pid: int) -> float | None:
    """Resident memory of process ``pid`` in MiB (Linux ``/proc``); None elsewhere."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024  # the figure is in kB
    return None


@dataclass
class KindStats:
    """Calls of one kind: how many, their summed wall time, and how many failed."""

    count: int = 0
    seconds: float = 0.0
    errors: int = 0
    first_error: str = ""


@dataclass
class Mix:
    """The requests of the soak, with the state they carry (session, step)."""

    client: WorkerClient
    session: int = field(default_factory=lambda: random.getrandbits(64))
    step: int = 0

    def __post_init__(self) -> None:
        model = Model(load_spec("tiny"), seed=0)
        conv2 = next(layer for layer in model.layers if layer.name == "conv2")
        rng = np.random.default_rng(0)
        self.x = rng.standard_normal((BATCH, *conv2.input_shape), dtype=np.float32)
        self.w = conv2.params["weight"]
        self.b = conv2.params["bias"]
        pad = Padding.resolve(conv2.padding, conv2.kernel_size)
        self.padding = (pad.top, pad.bottom, pad.left, pad.right)
        ho = self.x.shape[2] + pad.top + pad.bottom - self.w.shape[2] + 1
        wo = self.x.shape[3] + pad.left + pad.right - self.w.shape[3] + 1
        self.dy = rng.standard_normal((BATCH, self.w.shape[0], ho, wo), dtype=np.float32)
        self.backward_bytes = 4 * (self.w.size + self.b.size + self.x.size)
        self.big_x = rng.standard_normal(BIG_X, dtype=np.float32)
        self.big_w = rng.standard_normal((BIG_K, BIG_X[1], 3, 3), dtype=np.float32)
        self.big_b = np.zeros(BIG_K, np.float32)
        self.echo_array = rng.standard_normal(ECHO_FLOATS, dtype=np.float32)
        self.calls: dict[str, Callable[[], object]] = {
            "forward-bundle": self.forward,
            "backward-bundle": self.backward,
            "forward-stream": self.forward_big,
            "echo": self.echo,
        }

    def forward(self):
        self.step += 1
        y, stats = self.client.forward(
            self.session, self.step, "conv2", self.x, self.w, self.b, self.padding
        )
        assert stats.bundled
        return y

    def backward(self):
        dx, dw, db, stats = self.client.backward(
            self.session, self.step, "conv2", self.dy, True, answer_bytes=self.backward_bytes
        )
        assert stats.bundled
        return dx, dw, db

    def forward_big(self):
        y, stats = self.client.forward(
            self.session, self.step, "big", self.big_x, self.big_w, self.big_b, (1, 1, 1, 1)
        )
        assert not stats.bundled
        return y

    def echo(self):
        (back,), _ = self.client.echo([("link", self.echo_array)])
        return back

    def check(self) -> None:
        """The tiny layer's forward and backward equal the cpu backend's here."""
        cpu = get_backend("cpu")
        y = self.forward()
        dx, dw, db = self.backward()
        expected_dw, expected_db = cpu.conv_grad_kernels(self.x, self.dy, (5, 5), self.padding)
        for name, got, expected in (
            ("y", y, cpu.conv_forward(self.x, self.w, self.b, self.padding)),
            ("dx", dx, cpu.conv_grad_input(self.dy, self.w, self.x.shape[2:], self.padding)),
            ("dw", dw, expected_dw),
            ("db", db, expected_db),
        ):
            if not np.allclose(got, expected, rtol=1e-4, atol=1e-4):
                raise RuntimeError(f"the worker's {name} differs from the cpu backend's")


def _format_mib(value: float | None, sign: bool = False) -> str:
    if value is None:
        return "n/a"
    return f"{value:+.1f}" if sign else f"{value:.1f}"


def soak(args: argparse.Namespace) -> list[dict]:
    rows: list[dict] = []
    with LocalWorkers(1) as workers:
        pid, address = workers.processes[0].pid, workers.addresses[0]
        client = WorkerClient(address)
        try:
            info = client.describe()
            mix = Mix(client)
            print(
                f"worker {address} (pid {pid}, {info.backend} backend, {info.name}); "
                f"each round of {len(ROUND)} requests: 4 x bundled forward+backward of tiny "
                f"conv2 x {mix.x.shape}, 1 x streamed forward x {BIG_X} "
                f"({mix.big_x.nbytes / 1e6:.1f} MB), 1 x echo {mix.echo_array.nbytes >> 10} KiB"
            )
            for index in range(args.warmup):
                mix.calls[ROUND[index % len(ROUND)]]()
            mix.check()
            rss_before = rss_mib(pid)
            print(f"warm-up: {args.warmup} requests; worker RSS {_format_mib(rss_before)} MiB")
            print(f"{'requests':>9} {'seconds':>8} {'req/s':>8} {'RSS MiB':>8} {'growth':>7}")

            kinds = {kind: KindStats() for kind in mix.calls}
            done, start = 0, time.perf_counter()
            mark_done, mark_time = 0, start

            def record(now: float) -> None:
                nonlocal mark_done, mark_time
                rss = rss_mib(pid)
                growth = None if rss is None or rss_before is None else rss - rss_before
                rate = (done - mark_done) / max(now - mark_time, 1e-9)
                row = {
                    "row": "interval", "requests": done, "seconds": now - start,
                    "requests_per_s": rate, "rss_mib": rss, "growth_mib": growth,
                }  # fmt: skip
                rows.append(row)
                print(
                    f"{done:>9} {now - start:>8.2f} {rate:>8.0f} {_format_mib(rss):>8} "
                    f"{_format_mib(growth, sign=True):>7}",
                    flush=True,
                )
                mark_done, mark_time = done, now

            gone = None
            while gone is None:
                now = time.perf_counter()
                if args.seconds is not None:
                    if now - start >= args.seconds:
                        break
                elif done >= args.requests:
                    break
                kind = ROUND[done % len(ROUND)]
                stats = kinds[kind]
                began = time.perf_counter()
                try:
                    mix.calls[kind]()
                except WorkerUnavailable as e:
                    gone = str(e)
                except Exception as e:  # counted and shown: a soak reports, it does not stop
                    stats.errors += 1
                    stats.first_error = stats.first_error or f"{type(e).__name__}: {e}"
                stats.count += 1
                stats.seconds += time.perf_counter() - began
                done += 1
                if done % args.interval == 0:
                    record(time.perf_counter())
            elapsed = time.perf_counter() - start
            if done % args.interval:
                record(start + elapsed)
            if gone is not None:
                print(f"the worker went away after {done} requests: {gone}", file=sys.stderr)
            else:
                mix.check()
            rss_after = rss_mib(pid)
        finally:
            client.close()

    growth = None if rss_after is None or rss_before is None else rss_after - rss_before
    summary = {
        "row": "summary",
        "requests": done,
        "seconds": elapsed,
        "requests_per_s": done / max(elapsed, 1e-9),
        "errors": sum(s.errors for s in kinds.values()),
        "worker_gone": gone,
        "rss_before_mib": rss_before,
        "rss_after_mib": rss_after,
        "growth_mib": growth,
        "growth_mib_per_1000": None if growth is None else growth / max(done, 1) * 1000,
        "max_growth_mib": args.max_growth_mib,
        "exceeds_bound": growth is not None and growth > args.max_growth_mib,
    }
    print(
        f"\n{done} requests in {elapsed:.1f} s: {summary['requests_per_s']:.0f} requests/s overall"
    )
    print(f"{'kind':<16} {'count':>6} {'req/s':>8} {'mean ms':>8} {'errors':>6}")
    for kind, stats in kinds.items():
        rate = stats.count / stats.seconds if stats.seconds else 0.0
        mean_ms = 1e3 * stats.seconds / stats.count if stats.count else 0.0
        summary[f"{kind}_count"] = stats.count
        summary[f"{kind}_per_s"] = rate
        summary[f"{kind}_mean_ms"] = mean_ms
        summary[f"{kind}_errors"] = stats.errors
        print(f"{kind:<16} {stats.count:>6} {rate:>8.0f} {mean_ms:>8.2f} {stats.errors:>6}")
        if stats.first_error:
            print(f"  first error: {stats.first_error}")
    rows.append(summary)
    if growth is None:
        print("worker RSS: not measurable here (reads /proc/PID/status, Linux only)")
    else:
        print(
            f"worker RSS: {rss_before:.1f} MiB before (after warm-up), {rss_after:.1f} MiB "
            f"after: {growth:+.1f} MiB ({summary['growth_mib_per_1000']:+.3f} MiB per 1000 "
            f"requests; bound {args.max_growth_mib:g} MiB)"
        )
        if summary["exceeds_bound"]:
            print("RSS growth exceeds bound")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    length = parser.add_mutually_exclusive_group()
    length.add_argument(
        "--requests", type=int, default=5000, help="requests to send after the warm-up"
    )
    length.add_argument(
        "--seconds", type=float, help="send requests for this long instead of --requests"
    )
    parser.add_argument(
        "--interval", type=int, help="requests between RSS readings (default: a tenth)"
    )
    parser.add_argument(
        "--warmup", type=int, default=50 * len(ROUND), help="requests before the first reading"
    )
    parser.add_argument(
        "--max-growth-mib", type=float, default=20.0, help="RSS growth to warn about"
    )
    parser.add_argument("--json", metavar="PATH", help="write the rows as a JSON list")
    args = parser.parse_args()
    if args.requests < 1 or (args.seconds is not None and args.seconds <= 0):
        parser.error("--requests and --seconds must be positive")
    if args.interval is None:
        args.interval = max(len(ROUND), args.requests // 10) if args.seconds is None else 500
    if args.interval < 1 or args.warmup < 0:
        parser.error("--interval must be positive and --warmup not negative")
    rows = soak(args)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
