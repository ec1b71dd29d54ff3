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
import collections
import json
import multiprocessing
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

from hetconv import wire
from hetconv.backends import Padding, get_backend
from hetconv.calls import FORWARD, READY
from hetconv.master.client import WorkerClient, WorkerUnavailable
from hetconv.master.launch import LocalWorkers, stop_processes
from hetconv.model import Model, load_spec
from hetconv.proto import worker_pb2 as pb

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


# -- many masters and hostile clients (--crowd) -----------------------------------------------

#: The streamed layer of a well-behaved master's step (x, kernels): 1.2 MB in, 1.2 MB out.
MASTER_BIG_K = 16
#: A hostile Forward whose answer nobody reads: x 2 MiB, y 16 MiB.
UNREAD_X, UNREAD_K = (8, 16, 64, 64), 128
#: A hostile saved state: x 1 MiB under a new layer name, one 1x1 kernel (little compute).
LAYERS_X = (8, 32, 32, 32)


def start_worker(flags: list[str]) -> tuple[subprocess.Popen, str]:
    """A ``hetconv worker`` process on loopback (one BLAS thread) with ``flags``; its address.
    It stops when this process ends (it watches the pipe to its standard input)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env[name] = "1"
    command = [
        sys.executable, "-I", "-m", "hetconv", "worker", "--listen", "127.0.0.1:0",
        "--backend", "cpu", "--no-startup-probe", "--exit-on-stdin-close", *flags,
    ]  # fmt: skip
    process = subprocess.Popen(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        env=env, text=True,
    )  # fmt: skip
    lines = []
    for line in process.stdout:
        lines.append(line.rstrip("\n"))
        if line.startswith(READY):
            threading.Thread(
                target=lambda: collections.deque(process.stdout, 0), daemon=True
            ).start()
            return process, line[len(READY) :].strip()
    raise RuntimeError("the worker did not start:\n" + "\n".join(lines))


class Master:
    """A well-behaved master: steps of Forward and Backward on two layers, in one session,
    every answer checked against the cpu backend's (computed once here: the inputs repeat)."""

    def __init__(self, address: str, seed: int):
        self.client = WorkerClient(address)
        self.mix = Mix(self.client)
        rng = np.random.default_rng(seed)
        self.big_dy = rng.standard_normal((BIG_X[0], MASTER_BIG_K, *BIG_X[2:]), np.float32)
        cpu, mix = get_backend("cpu"), self.mix
        self.expected = {
            "y": cpu.conv_forward(mix.x, mix.w, mix.b, mix.padding),
            "dx": cpu.conv_grad_input(mix.dy, mix.w, mix.x.shape[2:], mix.padding),
            "dw": cpu.conv_grad_kernels(mix.x, mix.dy, (5, 5), mix.padding)[0],
            "big_y": cpu.conv_forward(mix.big_x, mix.big_w, mix.big_b, (1, 1, 1, 1)),
            "big_dx": cpu.conv_grad_input(self.big_dy, mix.big_w, BIG_X[2:], (1, 1, 1, 1)),
            "big_dw": cpu.conv_grad_kernels(mix.big_x, self.big_dy, (3, 3), (1, 1, 1, 1))[0],
        }
        self.steps: list[tuple[float, float]] = []  # (end time, seconds)
        self.checked = 0
        self.errors: list[str] = []

    def step(self) -> None:
        mix, started = self.mix, time.perf_counter()
        got = {"y": mix.forward()}
        got["dx"], got["dw"], _ = mix.backward()
        got["big_y"] = mix.forward_big()
        got["big_dx"], got["big_dw"], _, _ = self.client.backward(
            mix.session, mix.step, "big", self.big_dy, True
        )
        end = time.perf_counter()
        for name, value in got.items():
            if not np.allclose(value, self.expected[name], rtol=1e-4, atol=1e-3):
                raise RuntimeError(f"the worker's {name} differs from the cpu backend's")
        self.checked += len(got)
        self.steps.append((end, end - started))

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self.step()
            except Exception as e:  # counted and shown: a soak reports, it does not stop
                self.errors.append(f"{type(e).__name__}: {e}")

    def step_times(self, since: float, until: float) -> list[float]:
        return [seconds for end, seconds in self.steps if since <= end - seconds and end <= until]


def _own_channel(address: str) -> grpc.Channel:
    """A channel with a connection of its own, as another machine's would have."""
    options = [*wire.channel_options(), ("grpc.use_local_subchannel_pool", 1)]
    return grpc.insecure_channel(address, options=options)


def _worker_books(channel: grpc.Channel) -> dict[str, int]:
    """What the worker's memory budget holds: Describe's ``hetconv-memory`` metadata."""
    describe = channel.unary_unary(
        f"/{pb.DESCRIPTOR.package}.ConvWorker/Describe",
        request_serializer=pb.DescribeRequest.SerializeToString,
        response_deserializer=pb.DeviceDescription.FromString,
    )
    _, call = describe.with_call(pb.DescribeRequest(), timeout=30)
    (text,) = [value for key, value in call.trailing_metadata() if key == "hetconv-memory"]
    return {k: int(v) for k, v in (item.split("=") for item in text.split(","))}


def _forward_method(channel: grpc.Channel):
    return channel.stream_stream(
        f"/{pb.DESCRIPTOR.package}.ConvWorker/{FORWARD.stream.name}",
        request_serializer=wire.serialize_message,
        response_deserializer=wire.deserialize_message,
    )


def _forward_messages(session: int, layer: str, arrays, header_only: bool = False) -> list:
    x, w, _ = arrays
    request = pb.ConvRequest(
        phase=pb.FORWARD, session=session, step=1, layer=layer, padding=(1, 1, 1, 1),
        tensors=[wire.tensor_header(n, a) for n, a in zip("xwb", arrays, strict=True)],
    )  # fmt: skip
    if w.shape[2] == 1:
        request.padding[:] = [0, 0, 0, 0]
    head = pb.ConvMessage(header=request)
    return [head] if header_only else [head, *wire.data_chunks(arrays)]


def _hostile(address: str, stallers: int, seconds: float, idle_timeout: float, results) -> None:
    """The hostile clients (see the module docstring), for ``seconds``; puts a Counter of
    (client, outcome) into ``results``."""
    counts: collections.Counter = collections.Counter()
    lock = threading.Lock()
    stop = threading.Event()

    def count(kind: str, outcome: str) -> None:
        with lock:
            counts[kind, outcome] += 1

    def outcome(error: grpc.RpcError) -> str:
        return error.code().name

    def stall() -> None:  # a header, then nothing; again when ended
        channel = _own_channel(address)
        arrays = (np.zeros(BIG_X, np.float32), np.zeros((4, 16, 3, 3), np.float32),
                  np.zeros(4, np.float32))  # fmt: skip
        while not stop.is_set():
            release = threading.Event()
            head = _forward_messages(random.getrandbits(64), "stall", arrays, header_only=True)

            def messages(head=head, release=release):
                yield from head
                release.wait()

            call = _forward_method(channel)(messages())
            try:
                for _ in call:
                    pass
                count("staller", "OK")
            except grpc.RpcError as e:
                count("staller", outcome(e))
                if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    # REFUSED_STREAM (UNAVAILABLE): a connection whose streams the worker ended
                    # gets its slots back only when the client closes them; so, a new one
                    channel.close()
                    channel = _own_channel(address)
                    stop.wait(0.1)
            finally:
                release.set()

    def unread(channel: grpc.Channel) -> None:  # a 16 MiB answer nobody reads
        rng = np.random.default_rng(1)
        arrays = (rng.standard_normal(UNREAD_X, np.float32),
                  rng.standard_normal((UNREAD_K, UNREAD_X[1], 3, 3), np.float32),
                  np.zeros(UNREAD_K, np.float32))  # fmt: skip
        while not stop.is_set():
            call = _forward_method(channel)(
                iter(_forward_messages(random.getrandbits(64), "unread", arrays))
            )
            # The status comes only after the chunks are read: read them once the worker
            # should have ended the call (what it sent before then, and its status).
            if stop.wait(idle_timeout + 2):
                call.cancel()
            try:
                for _ in call:
                    pass
                count("unread answer", "OK")
            except grpc.RpcError as e:
                count("unread answer", outcome(e))

    def oversize(channel: grpc.Channel) -> None:  # declares more than the whole budget
        x = pb.TensorHeader(name="x", shape=[64, 64, 512, 512], dtype=pb.FLOAT32,
                            nbytes=4 * 64 * 64 * 512 * 512)  # fmt: skip
        w = wire.tensor_header("w", np.zeros((4, 64, 3, 3), np.float32))
        b = wire.tensor_header("b", np.zeros(4, np.float32))
        while not stop.wait(0.1):
            request = pb.ConvRequest(
                phase=pb.FORWARD, session=random.getrandbits(64), step=1, layer="huge",
                padding=(1, 1, 1, 1), tensors=[x, w, b],
            )  # fmt: skip
            try:
                list(_forward_method(channel)(iter([pb.ConvMessage(header=request)]), timeout=30))
                count("oversize", "OK")
            except grpc.RpcError as e:
                count("oversize", outcome(e))

    def layers(channel: grpc.Channel) -> None:  # one session, a new layer name each time
        arrays = (np.ones(LAYERS_X, np.float32), np.ones((1, LAYERS_X[1], 1, 1), np.float32),
                  np.zeros(1, np.float32))  # fmt: skip
        session, index = random.getrandbits(64), 0
        while not stop.wait(0.05):
            index += 1
            try:
                messages = _forward_messages(session, f"layer{index}", arrays)
                list(_forward_method(channel)(iter(messages), timeout=30))
                count("new layer names", "OK")
            except grpc.RpcError as e:
                count("new layer names", outcome(e))

    threads = [threading.Thread(target=stall) for _ in range(stallers)]
    threads += [threading.Thread(target=unread, args=(_own_channel(address),)) for _ in "ab"]
    threads += [
        threading.Thread(target=oversize, args=(_own_channel(address),)),
        threading.Thread(target=layers, args=(_own_channel(address),)),
    ]
    for thread in threads:
        thread.daemon = True
        thread.start()
    time.sleep(seconds)
    stop.set()
    results.put(dict(counts))
    results.close()
    results.join_thread()  # sent before the exit below
    os._exit(0)  # the stalled streams' threads wait on the worker: do not wait for them


def crowd_soak(args: argparse.Namespace) -> list[dict]:
    flags = ["--memory-mib", str(args.memory_mib), "--idle-timeout", f"{args.idle_timeout:g}",
             "--sessions", str(args.masters + 2)]  # fmt: skip
    process, address = start_worker(flags)
    rows: list[dict] = []
    rss: list[tuple[float, str, float | None, dict]] = []  # (seconds, phase, RSS, books)
    masters: list[Master] = []
    try:
        masters = [Master(address, seed) for seed in range(args.masters)]
        for master in masters:  # warm-up
            for _ in range(5):
                master.step()
        print(
            f"worker {address} (pid {process.pid}) {' '.join(flags)}; {args.masters} masters, "
            f"each step Forward+Backward of tiny conv2 x {masters[0].mix.x.shape} (bundled) "
            f"and of x {BIG_X} (streamed), every answer checked"
        )
        stop = threading.Event()
        threads = [threading.Thread(target=m.run, args=(stop,), daemon=True) for m in masters]
        begin = time.perf_counter()
        for thread in threads:
            thread.start()

        books = _own_channel(address)

        def sample(phase: str, seconds: float) -> tuple[float, float]:
            start = time.perf_counter()
            while time.perf_counter() - start < seconds:
                time.sleep(1.0)
                held = _worker_books(books)
                rss.append((time.perf_counter() - begin, phase, rss_mib(process.pid), held))
            return start, time.perf_counter()

        before = sample("alone", args.baseline_seconds)
        context = multiprocessing.get_context("spawn")
        results = context.Queue()
        hostile = context.Process(
            target=_hostile,
            args=(address, args.stallers, args.seconds, args.idle_timeout, results),
        )
        hostile.start()
        during = sample("hostile", args.seconds)
        outcomes = results.get(timeout=60)
        hostile.join(10)
        after = sample("alone", args.baseline_seconds)
        books.close()
        stop.set()
        for thread in threads:
            thread.join(60)
    finally:
        for master in masters:
            master.client.close()
        stop_processes([process])

    # held: what the worker's budget holds (calls in flight, saved states, kept scratch)
    print(f"\n{'seconds':>8} {'phase':<8} {'RSS MiB':>8} {'held MiB':>9} {'calls':>6}")
    for t, phase, value, held in rss:
        mib = (held["in_flight"] + held["saved"] + held["reserved"]) / 2**20
        rows.append({"row": "rss", "seconds": t, "phase": phase, "rss_mib": value,
                     "held_mib": mib, "calls": held["calls"]})  # fmt: skip
        if round(t) % 5 == 0:
            print(f"{t:>8.0f} {phase:<8} {_format_mib(value):>8} {mib:>9.1f} {held['calls']:>6}")
    print(f"\n{'master':>6} {'alone ms':>9} {'hostile ms':>10} {'ratio':>6} {'steps':>6} "
          f"{'checked':>8} {'errors':>6}")  # fmt: skip
    ratios = []
    for index, master in enumerate(masters):
        alone = master.step_times(*before) + master.step_times(*after)
        hostile_steps = master.step_times(*during)
        alone_ms = 1e3 * statistics.median(alone) if alone else float("nan")
        hostile_ms = 1e3 * statistics.median(hostile_steps) if hostile_steps else float("nan")
        ratio = hostile_ms / alone_ms
        ratios.append(ratio)
        row = {
            "row": "master", "master": index, "alone_median_ms": alone_ms,
            "hostile_median_ms": hostile_ms, "ratio": ratio, "alone_steps": len(alone),
            "hostile_steps": len(hostile_steps), "answers_checked": master.checked,
            "errors": len(master.errors), "first_error": master.errors[0] if master.errors else "",
        }  # fmt: skip
        rows.append(row)
        print(f"{index:>6} {alone_ms:>9.1f} {hostile_ms:>10.1f} {ratio:>6.2f} "
              f"{len(hostile_steps):>6} {master.checked:>8} {len(master.errors):>6}")  # fmt: skip
        if master.errors:
            print(f"  first error: {master.errors[0]}")
    print(f"\n{'hostile client':<16} {'outcome':<20} {'calls':>6}")
    for (kind, outcome), n in sorted(outcomes.items()):
        rows.append({"row": "hostile", "client": kind, "outcome": outcome, "calls": n})
        print(f"{kind:<16} {outcome:<20} {n:>6}")
    hostile_rss = [v for _, phase, v, _ in rss if phase == "hostile" and v is not None]
    summary = {
        "row": "summary", "seconds": args.seconds, "baseline_seconds": args.baseline_seconds,
        "masters": args.masters, "memory_mib": args.memory_mib,
        "max_ratio": max(ratios), "target_ratio": 1.5,
        "rss_first_hostile_mib": hostile_rss[0] if hostile_rss else None,
        "rss_max_mib": max((v for _, _, v, _ in rss if v is not None), default=None),
        "rss_last_mib": rss[-1][2] if rss else None,
        "errors": sum(len(m.errors) for m in masters),
    }  # fmt: skip
    rows.append(summary)
    print(
        f"\nstep time with hostile clients / alone: at most {summary['max_ratio']:.2f} "
        f"(target <= 1.5); worker RSS max {_format_mib(summary['rss_max_mib'])} MiB of a "
        f"{args.memory_mib} MiB budget, last {_format_mib(summary['rss_last_mib'])} MiB; "
        f"{summary['errors']} errors among the masters' calls"
    )
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
