"""Soak one real worker process: thousands of mixed requests, their rate, and its memory;
or (``--crowd``) several masters beside hostile clients, for a bounded time.

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

With ``--crowd`` the worker is started with a memory budget, an idle timeout and a session
count (``--memory-mib``, ``--idle-timeout``, ``--sessions``) and serves, for ``--seconds``:

* ``--masters`` well-behaved masters (threads here, one session each), each step a Forward and
  Backward (with dx) of tiny conv2 (bundled) and of a streamed layer x (8, 16, 48, 48); every
  answer is compared with the cpu backend's result computed here;
* hostile clients in a process of their own, each on a connection of its own: ``--stallers``
  streams that send a header and then nothing (reopened when the worker ends them, on a new
  connection when the old one is refused), 2 clients
  that send a Forward with a 16 MiB answer and never read it, 1 that declares a request larger
  than the budget, ten times a second, and 1 that saves a 1 MiB forward state under a new layer
  name of one session, twenty times a second.

Before and after that the masters run alone for ``--baseline-seconds`` each (undisturbed): the
ratio of their median step time with the hostile clients to without is the starvation figure
(target <= 1.5). The worker's RSS, and what its memory budget says it holds (Describe's
``hetconv-memory`` metadata: calls in flight, saved states, kept scratch), are sampled every
second throughout.

    python benchmarks/soak.py --crowd [--seconds 90] [--masters 3] [--stallers 8]
                              [--memory-mib 512] [--idle-timeout 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from soak_crowd import crowd_soak
from soak_mix import BIG_X, ROUND, KindStats, Mix, format_mib, rss_mib

from hetconv.master.client import WorkerClient, WorkerUnavailable
from hetconv.master.launch import LocalWorkers


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
            print(f"warm-up: {args.warmup} requests; worker RSS {format_mib(rss_before)} MiB")
            print(f"{'requests':>9} {'seconds':>8} {'req/s':>8} {'RSS MiB':>8} {'growth':>7}")
            kinds, done, elapsed, gone = _run_mix(args, mix, pid, rss_before, rows)
            if gone is not None:
                print(f"the worker went away after {done} requests: {gone}", file=sys.stderr)
            else:
                mix.check()
            rss_after = rss_mib(pid)
        finally:
            client.close()
    rows.append(_summary(args, kinds, done, elapsed, gone, rss_before, rss_after))
    return rows


def _run_mix(
    args: argparse.Namespace, mix: Mix, pid: int, rss_before: float | None, rows: list[dict]
) -> tuple[dict[str, KindStats], int, float, str | None]:
    """The soak proper: the mix's requests in their round until ``--requests`` or
    ``--seconds``, the worker's RSS read into ``rows`` every ``--interval``; returns the calls
    by kind, how many were made, in how many seconds, and why the worker went away (None)."""
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
            f"{done:>9} {now - start:>8.2f} {rate:>8.0f} {format_mib(rss):>8} "
            f"{format_mib(growth, sign=True):>7}",
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
    return kinds, done, elapsed, gone


def _summary(
    args: argparse.Namespace,
    kinds: dict[str, KindStats],
    done: int,
    elapsed: float,
    gone: str | None,
    rss_before: float | None,
    rss_after: float | None,
) -> dict:
    """The soak's summary row, printed: the rate overall and by kind, and the RSS growth."""
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
    return summary


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
    crowd = parser.add_argument_group("--crowd: masters beside hostile clients")
    crowd.add_argument(
        "--crowd", action="store_true", help="masters and hostile clients for --seconds"
    )
    crowd.add_argument("--masters", type=int, default=3, help="well-behaved masters")
    crowd.add_argument("--stallers", type=int, default=8, help="streams that stall")
    crowd.add_argument("--memory-mib", type=int, default=512, help="the worker's budget")
    crowd.add_argument(
        "--idle-timeout", type=float, default=5.0, help="the worker's idle timeout, seconds"
    )
    crowd.add_argument(
        "--baseline-seconds",
        type=float,
        help="masters alone before and after, each (default: a quarter of --seconds)",
    )
    args = parser.parse_args()
    if args.crowd:
        args.seconds = 90.0 if args.seconds is None else args.seconds
        if args.seconds <= 0 or args.masters < 1 or args.stallers < 0:
            parser.error("--seconds and --masters must be positive, --stallers not negative")
        if args.baseline_seconds is None:
            args.baseline_seconds = args.seconds / 4
        rows = crowd_soak(args)
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(rows, f, indent=1)
        return
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
