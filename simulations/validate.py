"""Check the simulator against real training runs over shaped network links.

For every link rate (and worker count) this builds a small real cluster on this machine and
compares the simulator's step time with the measured one:

* **The network.** One network namespace per worker, joined to the root namespace by its own veth
  pair on a private /30 subnet. Both ends of every pair are shaped with a token bucket
  (``tc qdisc ... tbf``) at the rate: the root end's egress is the master's upload to that worker,
  the namespace end's egress the worker's answers. The bucket holds two frames (or 1 ms of the
  rate when that is more): a real link has no burst allowance, and a deep bucket would let the
  start of every transfer pass at the veth's own speed. Its queue holds half a second, so TCP
  never loses a packet to it. Every worker has its own link and the master one per worker, so
  the simulator sees a *switched* network: a port per worker, the master's side unlimited.
* **The run.** ``hetconv worker --backend cpu`` inside each namespace (one BLAS thread, as
  :class:`~hetconv.master.launch.LocalWorkers` starts them) and the real master,
  ``hetconv train --worker ... --trace``, in the root namespace, also with one BLAS thread
  unless ``--master-blas-threads`` says otherwise (see below).
* **The prediction**, made without fitting anything to the run's network timings:

  - link: the tc rate as TCP goodput (:func:`tcp_goodput_mbps`: 1448 payload bytes in every
    1514-byte frame, 0.956 of the rate; a bulk TCP transfer over the shaped link before the run
    checks it), and the idle round trip, ICMP echo before the run;
  - bytes: the cost model's own (:func:`~hetconv.costmodel.call_bytes`), which
    equal what the trace records (checked when the trace is read);
  - per-call software costs: the loopback figures of the shipped ``this-machine`` scenario
    (benchmarks/transport.py), not this run's;
  - kernel shares: what the master chose (from the trace: configuration, not timing);
  - convolution speed of every node: from the trace's ``compute_seconds`` (``--speeds trace``,
    the default: medians per layer and phase, as :mod:`.calibrate` takes them) or from the probe
    the master printed before training (``--speeds probe``); compute is not what is being
    validated. The master's other work ("comp") is the trace's mean.

* **What the simulator does not model here**: every process shares this machine's 2 cores. The
  trace's compute figures include that contention; the probe's (one node at a time) do not (the
  "other speeds" column shows what it costs), and neither knows the CPU that gRPC and the
  kernel's network stack take, which begins to matter at 1000 Mbit/s.

What the first runs showed, and what came of it:

* With the master's OpenBLAS on 2 threads (its default here), its own small GEMMs now and then
  took 100-300 ms instead of 2-10 ms: in about a third of the steps of the first runs (-18 %
  at 20 Mbit/s), in none of a later run; a loop of such GEMMs alone showed it too, at times.
  The simulator cannot know that, so the master runs with 1 thread here, as the workers do.
* A streamed call (over 1 MiB) waited while the master computed its own share: the cpu
  backend's GEMMs went through ``scipy.linalg.blas.sgemm`` (f2py), which holds the GIL that the
  call's Python needs to start and for every chunk. That cost 0.33-0.57 of the master's compute
  time per call, at every rate, and the cost model got a term for it
  (:attr:`~hetconv.costmodel.WireCosts.compute_stall`). The backend now calls the
  same sgemm through ctypes, which releases the GIL: the stall is gone (paper-50-500 at batch
  32 over 1000 Mbit/s: 0.58 s per step instead of 0.72 s) and the term defaults to 0.

Measured and predicted step times are means over the run's steps after the first (which opens
connections and warms caches). Needs root, ``ip`` and ``tc``::

    python -m hetconv.simulations.validate [--rates 5 20 100] [--workers 1 2]
        [--preset tiny|paper-50-500] [--batch 16] [--steps N] [--json PATH]

Everything it creates (namespaces, veth pairs, processes) is removed on the way out, also on
Ctrl-C or SIGTERM. Killed outright (SIGKILL), it leaves no process behind (they are started
with a parent-death signal) and the next run removes the namespaces and pairs it left.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import secrets
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hetconv.argtypes import positive

DEFAULT_RATES = (5.0, 20.0, 100.0)
DEFAULT_WORKERS = (1, 2)
TARGET_ERROR = 0.15  # the issue's: within 15 % per case

#: Ethernet MTU of the veth pairs; tbf counts each packet with its 14-byte Ethernet header.
MTU = 1500
ETHERNET_HEADER = 14
#: IPv4 (20) + TCP with the timestamp option Linux sets (32) per segment.
TCP_IP_HEADERS = 52
WORKER_PORT = 50051
CHECK_PORT = 50052
#: The token bucket's queue in seconds of the rate: long enough that TCP never loses a packet
#: to it (a drop at a message's tail would cost a retransmission timeout, which no link model
#: predicts). BBR, this machine's congestion control, keeps it nearly empty; a loss-based one
#: would fill it, which costs latency, not throughput.
QUEUE_SECONDS = 0.5

_PREFIX = "hcv"  # every namespace and interface this module creates starts with it


def tcp_goodput_mbps(line_mbps: float, mtu: int = MTU) -> float:
    """Payload rate of a bulk TCP transfer over a link that carries ``line_mbps`` of Ethernet
    frames: each full segment carries ``mtu - 52`` bytes in ``mtu + 14`` (0.956 at 1500)."""
    return line_mbps * (mtu - TCP_IP_HEADERS) / (mtu + ETHERNET_HEADER)


def testbed_unavailable() -> str | None:
    """Why the shaped-link testbed cannot run here, or None when it can."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "needs root (network namespaces, veth pairs and tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs the {tool!r} command (iproute2)"
    return None


# -- running commands ----------------------------------------------------------------------------


def _run(*command: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(command, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if check and done.returncode != 0:
        raise RuntimeError(
            f"`{' '.join(command)}` failed ({done.returncode}): "
            f"{(done.stderr or done.stdout).strip()}"
        )
    return done


def _die_with_parent() -> list[str]:
    """A command prefix that has the kernel send SIGTERM to the process when this one dies, even
    by SIGKILL (util-linux ``setpriv``; nothing where it is missing)."""
    return ["setpriv", "--pdeathsig", "TERM", "--"] if shutil.which("setpriv") else []


def _used_subnets() -> set[str]:
    """The third octets of 10.213.x.y addresses and routes already on this machine."""
    text = _run("ip", "-4", "route", "show", "table", "all", check=False).stdout
    text += _run("ip", "-4", "addr", "show", check=False).stdout
    return set(re.findall(r"10\.213\.(\d+)\.", text))


# -- the testbed ---------------------------------------------------------------------------------


@dataclass
class Link:
    """One worker's namespace and the veth pair joining it to the master (root namespace)."""

    namespace: str
    host_if: str  # root namespace end: its egress is the master's upload
    ns_if: str  # worker's end: its egress is the worker's answers
    host_ip: str
    ns_ip: str
    created: list[str] = field(default_factory=list)  # what exists, for the teardown


@dataclass
class WorkerProcess:
    link: Link
    process: subprocess.Popen
    lines: collections.deque
    ready: threading.Event
    address: str


class Testbed:
    """``count`` namespaces, each with a veth pair shaped at ``rate_mbps`` both ways, and the
    processes started in them. A context manager: leaving it removes everything it made.

    Args:
        count: worker namespaces.
        rate_mbps: tbf rate of both ends of every pair (Ethernet frames, Mbit/s).
        token: the shared secret workers are started with (``HETCONV_TOKEN``).
    """

    def __init__(self, count: int, rate_mbps: float, token: str | None = None):
        if count < 1:
            raise ValueError(f"worker count must be >= 1, got {count}")
        if not rate_mbps > 0:
            raise ValueError(f"rate must be positive, got {rate_mbps}")
        self.count, self.rate_mbps = count, rate_mbps
        self.token = token if token is not None else secrets.token_urlsafe(24)
        self.tag = f"{_PREFIX}{os.getpid() % 10**7}"  # interface names: at most 15 characters
        self.links: list[Link] = []
        self.workers: list[WorkerProcess] = []
        self.processes: list[subprocess.Popen] = []  # everything started, workers included

    # setting up

    def __enter__(self) -> Testbed:
        try:
            self.setup()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.teardown()

    def setup(self) -> None:
        used = _used_subnets()
        free = (str(x) for x in range(1, 255) if str(x) not in used)
        for i in range(self.count):
            octet = next(free, None)
            if octet is None:
                raise RuntimeError("no free 10.213.x.0/30 subnet for a test link")
            link = Link(
                namespace=f"{self.tag}-w{i}",
                host_if=f"{self.tag}m{i}",
                ns_if=f"{self.tag}w{i}",
                host_ip=f"10.213.{octet}.1",
                ns_ip=f"10.213.{octet}.2",
            )
            self.links.append(link)
            _run("ip", "netns", "add", link.namespace)
            link.created.append("netns")
            _run("ip", "link", "add", link.host_if, "type", "veth", "peer", "name", link.ns_if)
            link.created.append("veth")
            _run("ip", "link", "set", link.ns_if, "netns", link.namespace)
            _run("ip", "addr", "add", f"{link.host_ip}/30", "dev", link.host_if)
            _run("ip", "link", "set", link.host_if, "up")
            inside = ("ip", "netns", "exec", link.namespace)
            _run(*inside, "ip", "addr", "add", f"{link.ns_ip}/30", "dev", link.ns_if)
            _run(*inside, "ip", "link", "set", link.ns_if, "up")
            _run(*inside, "ip", "link", "set", "lo", "up")
            self.shape(link, self.rate_mbps)

    @staticmethod
    def shape(link: Link, rate_mbps: float) -> None:
        """A token bucket at ``rate_mbps`` on the egress of both ends of ``link``."""
        rate = rate_mbps * 1e6 / 8
        # A bucket of two frames (1 ms of the rate when that is more, for the timer's sake):
        # a deep one would pass the start of every transfer at the veth's own speed.
        burst = max(2 * (MTU + ETHERNET_HEADER), int(rate * 1e-3))
        limit = max(64 * 1024, int(rate * QUEUE_SECONDS))
        tbf = ("tbf", "rate", f"{rate_mbps:g}mbit", "burst", str(burst), "limit", str(limit))
        _run("tc", "qdisc", "replace", "dev", link.host_if, "root", *tbf)
        _run("ip", "netns", "exec", link.namespace, "tc", "qdisc", "replace", "dev", link.ns_if,
             "root", *tbf)  # fmt: skip

    def tbf_drops(self) -> int:
        """Packets the token buckets dropped so far (both ends of every link)."""
        total = 0
        for link in self.links:
            for prefix in ((), ("ip", "netns", "exec", link.namespace)):
                dev = link.ns_if if prefix else link.host_if
                text = _run(*prefix, "tc", "-s", "qdisc", "show", "dev", dev, check=False).stdout
                total += sum(int(n) for n in re.findall(r"dropped (\d+)", text))
        return total

    def _spawn(self, link: Link, command: Sequence[str], env: dict) -> subprocess.Popen:
        # `ip netns exec` execs the command itself: the pid is the command's.
        process = subprocess.Popen(
            ["ip", "netns", "exec", link.namespace, *_die_with_parent(), *command],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            text=True,
        )
        self.processes.append(process)
        return process

    def start_workers(self, timeout: float = 120.0) -> list[str]:
        """``hetconv worker`` in every namespace; returns their addresses once all serve."""
        from hetconv.worker.main import READY

        env = dict(os.environ, PYTHONUNBUFFERED="1", HETCONV_TOKEN=self.token)
        for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            env[name] = "1"  # as LocalWorkers: the workers share the cores with the master
        for link in self.links:
            address = f"{link.ns_ip}:{WORKER_PORT}"
            command = [sys.executable, "-I", "-m", "hetconv", "worker", "--listen", address,
                       "--backend", "cpu", "--no-startup-probe"]  # fmt: skip
            process = self._spawn(link, command, env)
            worker = WorkerProcess(
                link, process, collections.deque(maxlen=40), threading.Event(), address
            )
            threading.Thread(target=self._drain, args=(worker, READY), daemon=True).start()
            self.workers.append(worker)
        deadline = time.monotonic() + timeout
        for worker in self.workers:
            while not worker.ready.wait(0.1):
                if worker.process.poll() is not None or time.monotonic() > deadline:
                    output = "\n".join(worker.lines) or "(no output)"
                    raise RuntimeError(
                        f"worker in {worker.link.namespace} did not start:\n{output}"
                    )
        return [w.address for w in self.workers]

    @staticmethod
    def _drain(worker: WorkerProcess, ready: str) -> None:
        for line in worker.process.stdout:
            worker.lines.append(line.rstrip("\n"))
            if line.startswith(ready):
                worker.ready.set()

    # measuring the idle link

    def ping(self, link: Link, count: int = 10) -> float:
        """Median idle round trip to the worker's end, seconds (ICMP echo, 56-byte payload)."""
        return icmp_rtt(link.ns_ip, count)

    def goodput_mbps(self, link: Link, seconds: float = 0.6) -> float:
        """Payload rate of one bulk TCP transfer master -> worker, Mbit/s (a sink process in
        the namespace reads it); ``seconds`` is about how long it takes at the assumed rate."""
        code = (
            "import socket,sys\n"
            f"s=socket.create_server(({link.ns_ip!r},{CHECK_PORT}))\n"
            "print('listening',flush=True)\n"
            "c,_=s.accept()\n"
            "while c.recv(1<<20):\n    pass\n"
            "c.sendall(b'x')\n"
        )
        sink = self._spawn(link, [sys.executable, "-I", "-c", code], dict(os.environ))
        try:
            if sink.stdout.readline().strip() != "listening":
                raise RuntimeError(f"TCP sink in {link.namespace} did not start")
            size = max(64 * 1024, int(tcp_goodput_mbps(self.rate_mbps) * 1e6 / 8 * seconds))
            payload = bytes(size)
            with socket.create_connection((link.ns_ip, CHECK_PORT), timeout=30) as conn:
                start = time.perf_counter()
                conn.sendall(payload)
                conn.shutdown(socket.SHUT_WR)
                if conn.recv(1) != b"x":
                    raise RuntimeError("TCP sink closed early")
                elapsed = time.perf_counter() - start
            return 8 * size / elapsed / 1e6
        finally:
            sink.wait(10)

    # tearing down

    def teardown(self) -> None:
        """Stop every process started here, then delete the namespaces and veth pairs. Each part
        is tried even when an earlier one fails; a second Ctrl-C does not cut it short."""
        deferred = {}
        if threading.current_thread() is threading.main_thread():
            deferred = {
                s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)
            }
        try:
            self._teardown()
        finally:
            for s, handler in deferred.items():
                signal.signal(s, handler)

    def _teardown(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
        deadline = time.monotonic() + 10
        for process in self.processes:
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.processes, self.workers = [], []
        for link in reversed(self.links):
            if "netns" in link.created:
                # Anything still inside (only what this testbed started can be there).
                pids = _run("ip", "netns", "pids", link.namespace, check=False).stdout.split()
                for pid in pids:
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except (ProcessLookupError, ValueError):
                        pass
            if "veth" in link.created:
                _run("ip", "link", "del", link.host_if, check=False)  # takes its peer along
            if "netns" in link.created:
                _run("ip", "netns", "del", link.namespace, check=False)
            link.created.clear()
        self.links = []

    def leftovers(self) -> list[str]:
        """Namespaces and interfaces with this testbed's tag still present (for the tests)."""
        names = _run("ip", "netns", "list", check=False).stdout.split()
        names += re.findall(r"^\d+: ([^:@]+)", _run("ip", "-o", "link", check=False).stdout, re.M)
        return sorted({n for n in names if n.startswith(self.tag)})


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[:1] != ["Z"]


def remove_stale(log=None) -> list[str]:
    """Remove namespaces and veth pairs that a run of this module left behind when it was killed
    (SIGKILL gives no chance to clean up): those whose creating process no longer runs. A
    namespace with processes still inside is left alone, and so is its veth pair. Returns what
    was removed."""
    removed, kept = [], set()
    namespaces = _run("ip", "netns", "list", check=False).stdout.split()
    links = re.findall(r"^\d+: ([^:@]+)", _run("ip", "-o", "link", check=False).stdout, re.M)
    for name in namespaces + links:  # namespaces first: a kept one keeps its link
        found = re.fullmatch(rf"({_PREFIX}(\d+))(?:-w(\d+)|m(\d+))", name)
        if found is None or int(found.group(2)) == os.getpid() % 10**7:
            continue
        if _alive(int(found.group(2))):
            continue  # its run may still be going (or the pid was reused: leave it)
        index = found.group(3) or found.group(4)
        if name in namespaces:
            if _run("ip", "netns", "pids", name, check=False).stdout.split():
                kept.add((found.group(1), index))
                if log is not None:
                    print(f"validate: stale namespace {name} still has processes; left", file=log)
                continue
            done = _run("ip", "netns", "del", name, check=False)
        elif (found.group(1), index) in kept:
            continue
        else:  # (gone already when its namespace took the pair along)
            done = _run("ip", "link", "del", name, check=False)
        if done.returncode == 0:
            removed.append(name)
    return removed


def _checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    total = (total >> 16) + (total & 0xFFFF)
    total += total >> 16
    return ~total & 0xFFFF


def icmp_rtt(address: str, count: int = 10, timeout: float = 1.0) -> float:
    """Median round trip of ``count`` ICMP echo requests to ``address``, seconds (root: a raw
    socket; no ``ping`` binary needed)."""
    ident = (os.getpid() ^ secrets.randbits(16)) & 0xFFFF
    payload = bytes(56)
    times = []
    with socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP) as sock:
        sock.settimeout(timeout)
        for seq in range(count):
            header = struct.pack("!BBHHH", 8, 0, 0, ident, seq)
            packet = struct.pack("!BBHHH", 8, 0, _checksum(header + payload), ident, seq)
            start = time.perf_counter()
            sock.sendto(packet + payload, (address, 0))
            while True:
                try:
                    data, _ = sock.recvfrom(2048)
                except TimeoutError:
                    break
                ihl = 4 * (data[0] & 0x0F)
                kind, _, _, got_id, got_seq = struct.unpack("!BBHHH", data[ihl : ihl + 8])
                if kind == 0 and got_id == ident and got_seq == seq:
                    times.append(time.perf_counter() - start)
                    break
            time.sleep(0.01)
    if not times:
        raise RuntimeError(f"no answer to ICMP echo from {address}")
    return statistics.median(times)


# -- the prediction ------------------------------------------------------------------------------

_PROBE_LAYER = re.compile(r"(\w+) (\d+)/(\d+) \(probe (off|[\d.]+ ms)\)")


def probe_seconds_from_log(text: str) -> list[dict[str, float]]:
    """Per node (master first) and layer the probe seconds the master printed before training
    (:meth:`hetconv.master.cluster.Cluster.describe_shares`); a master that computes no share
    has no figures (an empty dict)."""
    lines = text.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.startswith("kernel shares"))
    except StopIteration:
        return []
    nodes: list[dict[str, float]] = []
    for line in lines[start + 1 :]:
        if not line.startswith("  "):
            break
        probes = _PROBE_LAYER.findall(line)
        if probes:
            nodes.append({name: 1e-3 * float(ms[:-3]) for name, _, _, ms in probes if ms != "off"})
    return nodes


@dataclass
class Case:
    """One validated configuration: its inputs, what was measured and what was predicted."""

    preset: str
    batch: int
    workers: int
    rate_mbps: float
    goodput_mbps: float  # what the prediction assumes
    goodput_measured_mbps: float | None  # a bulk TCP transfer over the idle link
    rtt_ms: float
    steps: int  # measured (the first left out)
    shares: dict[str, list[int]]
    gflops: list[dict[str, float]]  # per node, master first, per layer (what was used)
    speeds: str  # "trace" or "probe"
    measured_s: float
    measured_comm_s: float
    measured_conv_s: float
    measured_comp_s: float
    predicted_s: float
    predicted_comm_s: float
    predicted_conv_s: float
    predicted_s_other_speeds: float | None  # with the other speed source, for contention
    tbf_drops: int
    master_blas_threads: int  # 0: the library's default
    calls: list[dict] = field(default_factory=list)  # per worker call: measured vs predicted

    @property
    def error(self) -> float:
        return self.predicted_s / self.measured_s - 1


def _gflops_from_probe(probes: dict[str, float], layers) -> dict[str, float]:
    return {
        layer.name: layer.shape.flops_forward * layer.step_passes / probes[layer.name] / 1e9
        for layer in layers
        if probes.get(layer.name)
    }


def predict(
    trace: str,
    rate_mbps: float,
    rtt_s: float,
    speeds: str = "trace",
    probe_log: str = "",
    wire=None,
):
    """The simulator's step for the run in ``trace`` on links of ``rate_mbps`` (tc rate) with
    round trip ``rtt_s``. Only the run's shares, compute figures and comp come from the trace.

    Returns (StepResult, per-node layer GFLOPS used, calibration of the trace).
    """
    from hetconv.costmodel import MBIT, SWITCHED, Cluster, Node, network_layers, simulate_step

    from .calibrate import calibrate
    from .scenario import load_scenario

    cal = calibrate(trace)
    layers = network_layers(cal.network, cal.batch)
    if speeds == "probe":
        probes = probe_seconds_from_log(probe_log)
        if len(probes) != len(cal.node_names):
            raise ValueError("the master's log holds no probe figure for every node")
        gflops = [_gflops_from_probe(p, layers) for p in probes]
        known = [g for per_layer in gflops for g in per_layer.values()]
        if not known:
            raise ValueError("the master's log holds no probe figure")
        # A master that computes nothing: any speed will do (it gets no kernels).
        gflops = [p or {layer.name: statistics.median(known) for layer in layers} for p in gflops]
    elif speeds == "trace":
        gflops = [dict(g) for g in cal.layer_gflops]
    else:
        raise ValueError(f"speeds {speeds!r} is not 'trace' or 'probe'")
    main = max(layers, key=lambda layer: layer.shape.flops_forward).name
    link = MBIT * tcp_goodput_mbps(rate_mbps)
    nodes = [
        Node(name, per_layer.get(main) or statistics.mean(per_layer.values()), per_layer)
        for name, per_layer in zip(cal.node_names, gflops, strict=True)
    ]
    # The master's side: one shaped veth per worker, so no capacity shared between workers
    # (an unlimited port; each flow is capped by its worker's link).
    workers = tuple(
        Node(n.name, n.gflops, n.layer_gflops, bytes_per_s=link, rtt_s=rtt_s) for n in nodes[1:]
    )
    wire = wire if wire is not None else load_scenario("this-machine").wire
    master_compute = any(split[0] for split in cal.shares.values())
    cluster = Cluster(nodes[0], workers, SWITCHED, master_compute=master_compute, wire=wire)
    result = simulate_step(cluster, layers, cal.shares, cal.comp_per_image_s * cal.batch)
    return result, gflops, cal


def _call_comparison(trace: str, result, cal) -> list[dict]:
    """Per worker call (layer, phase): mean measured wall seconds and the predicted ones."""
    from .calibrate import read_trace

    records = read_trace(trace)
    used = records[1:] if len(records) > 1 else records
    rows = []
    for phase in result.phases:
        workers = [
            name for i, name in enumerate(cal.node_names[1:], start=1) if cal.shares[phase.layer][i]
        ]
        for name, predicted in zip(workers, phase.worker_ends_s, strict=True):
            walls = [r["nodes"][name][phase.layer][phase.phase]["wall_seconds"] for r in used]
            rows.append(
                {
                    "worker": name,
                    "layer": phase.layer,
                    "phase": phase.phase,
                    "measured_s": statistics.mean(walls),
                    "predicted_s": predicted,
                }
            )
    return rows


# -- one case ------------------------------------------------------------------------------------


def run_case(
    preset: str,
    batch: int,
    steps: int,
    workers: int,
    rate_mbps: float,
    speeds: str = "trace",
    trace_dir: str | None = None,
    check_link: bool = True,
    master_blas_threads: int = 1,
    master_compute: bool = True,
) -> Case:
    """Build the testbed, train, predict, tear down. See the module docstring."""
    from hetconv.costmodel import PHASES, call_bytes, network_layers

    layers = network_layers(preset, batch)
    # A generous bound on the run's length, for the master's timeout: every call as if one
    # worker had every kernel.
    worst = sum(
        call_bytes(layer, phase, layer.kernels).total for layer in layers for phase in PHASES
    )
    goodput = tcp_goodput_mbps(rate_mbps)
    timeout = 180 + 4 * (steps + 2) * worst / (goodput * 1e6 / 8)
    with tempfile.TemporaryDirectory(prefix="hetconv-validate-") as scratch:
        folder = Path(trace_dir) if trace_dir else Path(scratch)
        folder.mkdir(parents=True, exist_ok=True)
        trace = folder / f"{preset}-b{batch}-w{workers}-{rate_mbps:g}mbit.jsonl"
        with Testbed(workers, rate_mbps) as bed:
            rtt = statistics.median(bed.ping(link) for link in bed.links)
            measured_goodput = (
                statistics.mean(bed.goodput_mbps(link) for link in bed.links)
                if check_link
                else None
            )
            addresses = bed.start_workers()
            command = [*_die_with_parent(), sys.executable, "-I", "-m", "hetconv", "train"]
            for address in addresses:
                command += ["--worker", address]
            command += [
                "--preset", preset, "--batch", str(batch), "--steps", str(steps),
                "--trace", str(trace), "--no-progress", "--eval-size", "0",
                "--train-size", str(max(batch * steps, 256)), "--connect-timeout", "60",
            ]  # fmt: skip
            if not master_compute:
                command.append("--no-master-compute")
            env = dict(os.environ, HETCONV_TOKEN=bed.token)
            if master_blas_threads:
                for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
                    env[name] = str(master_blas_threads)
            master = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env=env,
                text=True,
            )
            bed.processes.append(master)
            try:
                output, _ = master.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"the master did not finish within {timeout:.0f} s") from None
            if master.returncode != 0:
                raise RuntimeError(f"the master failed ({master.returncode}):\n{output}")
            drops = bed.tbf_drops()
        result, gflops, cal = predict(str(trace), rate_mbps, rtt, speeds, output)
        other = "probe" if speeds == "trace" else "trace"
        try:
            other_result, _, _ = predict(str(trace), rate_mbps, rtt, other, output)
            other_s = other_result.step_s
        except ValueError:
            other_s = None
        calls = _call_comparison(str(trace), result, cal)
    return Case(
        preset=preset,
        batch=batch,
        workers=workers,
        rate_mbps=rate_mbps,
        goodput_mbps=goodput,
        goodput_measured_mbps=measured_goodput,
        rtt_ms=1e3 * rtt,
        steps=cal.steps,
        shares={k: list(v) for k, v in cal.shares.items()},
        gflops=gflops,
        speeds=speeds,
        measured_s=cal.measured["step_s"],
        measured_comm_s=cal.measured["comm_s"],
        measured_conv_s=cal.measured["conv_s"],
        measured_comp_s=cal.measured["comp_s"],
        predicted_s=result.step_s,
        predicted_comm_s=result.comm_s,
        predicted_conv_s=result.conv_s,
        predicted_s_other_speeds=other_s,
        tbf_drops=drops,
        master_blas_threads=master_blas_threads,
        calls=calls,
    )


# -- the table -----------------------------------------------------------------------------------


def format_table(cases: Sequence[Case]) -> str:
    header = (
        f"{'workers':>7} {'Mbit/s':>7} {'goodput':>13} {'rtt ms':>6} | {'measured s':>10} "
        f"{'predicted s':>11} {'error %':>8} | {'comm meas/pred s':>17} {'conv meas/pred s':>17}"
        f" | {'other speeds':>12}"
    )
    lines = [header, "-" * len(header)]
    for c in cases:
        goodput = (
            f"{c.goodput_measured_mbps:.2f}/{c.goodput_mbps:.2f}"
            if c.goodput_measured_mbps is not None
            else f"-/{c.goodput_mbps:.2f}"
        )
        other = (
            f"{100 * (c.predicted_s_other_speeds / c.measured_s - 1):+.1f} %"
            if c.predicted_s_other_speeds
            else "-"
        )
        flag = "" if abs(c.error) <= TARGET_ERROR else " !"
        lines.append(
            f"{c.workers:>7} {c.rate_mbps:>7g} {goodput:>13} {c.rtt_ms:>6.2f} | "
            f"{c.measured_s:>10.3f} {c.predicted_s:>11.3f} {100 * c.error:>+7.1f}{flag:<2}| "
            f"{c.measured_comm_s:>8.3f}/{c.predicted_comm_s:<8.3f} "
            f"{c.measured_conv_s:>8.3f}/{c.predicted_conv_s:<8.3f} | {other:>12}"
        )
    return "\n".join(lines)


def format_calls(case: Case) -> str:
    lines = [f"  {case.workers} worker(s) at {case.rate_mbps:g} Mbit/s, per call (mean wall s):"]
    for row in case.calls:
        lines.append(
            f"    {row['worker']:<18} {row['layer']:<6} {row['phase']:<8} measured "
            f"{row['measured_s']:.4f}  predicted {row['predicted_s']:.4f}  "
            f"({100 * (row['predicted_s'] / row['measured_s'] - 1):+.1f} %)"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m hetconv.simulations.validate",
        description=(
            "Run real training over tc-shaped veth links (one network namespace per worker) and "
            "compare the simulator's step time with the measured one. Needs root, ip and tc."
        ),
    )
    p.add_argument(
        "--rates",
        type=positive(float),
        nargs="+",
        default=list(DEFAULT_RATES),
        metavar="MBIT",
        help="link rates (tc tbf, both directions), Mbit/s",
    )
    p.add_argument(
        "--workers",
        type=positive(int),
        nargs="+",
        default=list(DEFAULT_WORKERS),
        metavar="N",
        help="worker counts (one namespace and link each)",
    )
    p.add_argument("--preset", default="tiny", help="network (tiny, paper-50-500, ...)")
    p.add_argument(
        "--batch", type=positive(int), help="images per step (default: 16 for tiny, 8 otherwise)"
    )
    p.add_argument(
        "--steps",
        type=positive(int),
        default=8,
        help="training steps per case (the first is left out of the means)",
    )
    p.add_argument(
        "--speeds",
        choices=("trace", "probe"),
        default="trace",
        help="node convolution speeds from the trace's compute_seconds or the master's probe",
    )
    p.add_argument(
        "--master-blas-threads",
        type=int,
        default=1,
        metavar="N",
        help="BLAS threads of the master (0: the environment's or the library's default)",
    )
    p.add_argument(
        "--no-master-compute",
        action="store_true",
        help="the master computes no share (which also rules out its streamed calls' waits)",
    )
    p.add_argument(
        "--no-link-check",
        action="store_true",
        help="skip the bulk TCP transfer that checks the goodput assumption",
    )
    p.add_argument("--keep-traces", metavar="DIR", help="write the runs' traces here")
    p.add_argument("--calls", action="store_true", help="also print every worker call")
    p.add_argument("--json", metavar="PATH", help="write the cases as a JSON list")
    return p


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.steps < 2:
        print("validate: --steps must be at least 2 (the first is left out)", file=sys.stderr)
        return 2
    why = testbed_unavailable()
    if why is not None:
        print(f"validate: {why}", file=sys.stderr)
        return 2
    batch = args.batch or (16 if args.preset == "tiny" else 8)
    stale = remove_stale(sys.stderr)
    if stale:
        print(f"validate: removed what a killed run left: {', '.join(stale)}", file=sys.stderr)
    # Both end the run through KeyboardInterrupt, which tears the testbed down (SIGINT too: a
    # shell starts background jobs with it ignored, and Python would keep ignoring it).
    previous = {s: signal.signal(s, _interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
    cases: list[Case] = []
    try:
        for workers in args.workers:
            for rate in args.rates:
                what = f"{args.preset} batch {batch}, {workers} worker(s) at {rate:g} Mbit/s"
                print(f"running {what}, {args.steps} steps ...", file=sys.stderr, flush=True)
                case = run_case(
                    args.preset, batch, args.steps, workers, rate, args.speeds,
                    args.keep_traces, check_link=not args.no_link_check,
                    master_blas_threads=args.master_blas_threads,
                    master_compute=not args.no_master_compute,
                )  # fmt: skip
                cases.append(case)
                if args.calls:
                    print(format_calls(case), file=sys.stderr)
    except KeyboardInterrupt:
        print("validate: interrupted; everything it started is removed", file=sys.stderr)
        return 130
    except (RuntimeError, ValueError, OSError) as e:
        print(f"validate: error: {e}", file=sys.stderr)
        return 1
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    print(
        f"{args.preset}, batch {batch}, {args.steps} steps per case (first left out); node speeds "
        f"from the {args.speeds}; goodput = measured bulk TCP / assumed (Mbit/s); "
        "'other speeds' = the error with the other speed source"
    )
    print(format_table(cases))
    worst = max(abs(c.error) for c in cases)
    print(f"largest error {100 * worst:.1f} % (target {100 * TARGET_ERROR:.0f} %)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        rows = [{**asdict(c), "error": c.error} for c in cases]
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    return 0


__all__ = [
    "Case",
    "Testbed",
    "icmp_rtt",
    "main",
    "predict",
    "probe_seconds_from_log",
    "remove_stale",
    "run_case",
    "tcp_goodput_mbps",
    "testbed_unavailable",
]


if __name__ == "__main__":
    sys.exit(main())
