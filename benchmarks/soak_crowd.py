"""``benchmarks/soak.py --crowd``: several well-behaved masters beside hostile clients, against
one worker with a memory budget, an idle timeout and a session count (see ``soak.py``'s
docstring)."""

from __future__ import annotations

import argparse
import collections
import multiprocessing
import os
import random
import statistics
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
from soak_mix import BIG_X, Mix, format_mib, rss_mib

from hetconv import wire
from hetconv.backends import get_backend
from hetconv.calls import FORWARD, READY
from hetconv.master.client import WorkerClient
from hetconv.master.launch import stop_processes
from hetconv.proto import worker_pb2 as pb

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


class _HostileClients:
    """The hostile clients of one process (see ``soak.py``'s docstring), each kind a loop run
    on threads of its own until :attr:`stop` is set; :attr:`counts`: (client, outcome) calls."""

    def __init__(self, address: str, idle_timeout: float):
        self.address, self.idle_timeout = address, idle_timeout
        self.counts: collections.Counter = collections.Counter()
        self.lock = threading.Lock()
        self.stop = threading.Event()

    def count(self, kind: str, outcome: str) -> None:
        with self.lock:
            self.counts[kind, outcome] += 1

    @staticmethod
    def outcome(error: grpc.RpcError) -> str:
        return error.code().name

    def stall(self) -> None:  # a header, then nothing; again when ended
        address, stop, count, outcome = self.address, self.stop, self.count, self.outcome
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

    def unread(self, channel: grpc.Channel) -> None:  # a 16 MiB answer nobody reads
        stop, count, outcome = self.stop, self.count, self.outcome
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
            if stop.wait(self.idle_timeout + 2):
                call.cancel()
            try:
                for _ in call:
                    pass
                count("unread answer", "OK")
            except grpc.RpcError as e:
                count("unread answer", outcome(e))

    def oversize(self, channel: grpc.Channel) -> None:  # declares more than the whole budget
        stop, count, outcome = self.stop, self.count, self.outcome
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

    def layers(self, channel: grpc.Channel) -> None:  # one session, a new layer name each time
        stop, count, outcome = self.stop, self.count, self.outcome
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


def _hostile(address: str, stallers: int, seconds: float, idle_timeout: float, results) -> None:
    """The hostile clients (see the module docstring), for ``seconds``; puts a Counter of
    (client, outcome) into ``results``."""
    clients = _HostileClients(address, idle_timeout)
    threads = [threading.Thread(target=clients.stall) for _ in range(stallers)]
    threads += [
        threading.Thread(target=clients.unread, args=(_own_channel(address),)) for _ in "ab"
    ]
    threads += [
        threading.Thread(target=clients.oversize, args=(_own_channel(address),)),
        threading.Thread(target=clients.layers, args=(_own_channel(address),)),
    ]
    for thread in threads:
        thread.daemon = True
        thread.start()
    time.sleep(seconds)
    clients.stop.set()
    results.put(dict(clients.counts))
    results.close()
    results.join_thread()  # sent before the exit below
    os._exit(0)  # the stalled streams' threads wait on the worker: do not wait for them


def crowd_soak(args: argparse.Namespace) -> list[dict]:
    flags = ["--memory-mib", str(args.memory_mib), "--idle-timeout", f"{args.idle_timeout:g}",
             "--sessions", str(args.masters + 2)]  # fmt: skip
    process, address = start_worker(flags)
    masters: list[Master] = []
    try:
        rss, phases, outcomes = _crowd_phases(args, process, address, flags, masters)
    finally:
        for master in masters:
            master.client.close()
        stop_processes([process])
    return _crowd_report(args, masters, rss, phases, outcomes)


def _crowd_phases(
    args: argparse.Namespace,
    process: subprocess.Popen,
    address: str,
    flags: list[str],
    masters: list[Master],
) -> tuple[list[tuple[float, str, float | None, dict]], tuple, dict]:
    """The masters (made into ``masters``) alone, beside the hostile clients, then alone again,
    the worker's RSS and books sampled every second; returns the samples (seconds, phase, RSS,
    books), the three phases' (start, end) times and the hostile clients' outcomes."""
    rss: list[tuple[float, str, float | None, dict]] = []  # (seconds, phase, RSS, books)
    masters[:] = [Master(address, seed) for seed in range(args.masters)]
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
    return rss, (before, during, after), outcomes


def _crowd_report(
    args: argparse.Namespace, masters: list[Master], rss: list, phases: tuple, outcomes: dict
) -> list[dict]:
    """The crowd soak's rows, printed: the worker's memory over time, each master's step time
    alone and beside the hostile clients, the hostile clients' outcomes, and a summary."""
    rows: list[dict] = []
    before, during, after = phases
    # held: what the worker's budget holds (calls in flight, saved states, kept scratch)
    print(f"\n{'seconds':>8} {'phase':<8} {'RSS MiB':>8} {'held MiB':>9} {'calls':>6}")
    for t, phase, value, held in rss:
        mib = (held["in_flight"] + held["saved"] + held["reserved"]) / 2**20
        rows.append({"row": "rss", "seconds": t, "phase": phase, "rss_mib": value,
                     "held_mib": mib, "calls": held["calls"]})  # fmt: skip
        if round(t) % 5 == 0:
            print(f"{t:>8.0f} {phase:<8} {format_mib(value):>8} {mib:>9.1f} {held['calls']:>6}")
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
        f"(target <= 1.5); worker RSS max {format_mib(summary['rss_max_mib'])} MiB of a "
        f"{args.memory_mib} MiB budget, last {format_mib(summary['rss_last_mib'])} MiB; "
        f"{summary['errors']} errors among the masters' calls"
    )
    return rows
