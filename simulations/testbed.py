"""A testbed of shaped network links on this machine: one network namespace per worker.

Each worker gets a network namespace joined to the root namespace (the master's) by its own veth
pair on a private /30 subnet (10.213.x.0/30). Both ends of every pair are shaped with a token
bucket (``tc qdisc ... tbf``) at the link's rate: the root end's egress is the master's upload to
that worker, the namespace end's egress the worker's answers. The bucket holds two frames (or
1 ms of the rate when that is more): a real link has no burst allowance, and a deep bucket would
let the start of every transfer pass at the veth's own speed. Its queue holds half a second
(:data:`QUEUE_SECONDS`), so TCP never loses a packet to it. Every worker has its own link and the
master one per worker: a *switched* network, a port per worker, the master's side unlimited.

Used by :mod:`.validate` (the simulator against real runs) and ``benchmarks/share_policies.py``.
Needs root, ``ip`` and ``tc`` (:func:`testbed_unavailable` says why not, where it cannot run).

Public API:

* :class:`Testbed` (a context manager): ``setup``/``teardown``, :meth:`Testbed.shape` (re-shape
  one link), :meth:`Testbed.start_workers` (``hetconv worker`` in every namespace),
  :meth:`Testbed.spawn` (any command, in a namespace or the root one, stopped at teardown),
  :meth:`Testbed.ping`, :meth:`Testbed.goodput_mbps`, :meth:`Testbed.tbf_drops`,
  :meth:`Testbed.leftovers`; its :class:`Link` and :class:`WorkerProcess` records.
* :func:`remove_stale`: what a killed run left behind.
* :func:`icmp_rtt`, :func:`tcp_goodput_mbps`: measuring an idle link, and what TCP can carry on
  one.
* :func:`die_with_parent`, :func:`with_blas_threads`: how processes are started here.

Everything a testbed creates (namespaces, veth pairs, processes) is removed when it is left, also
on Ctrl-C or SIGTERM. Killed outright (SIGKILL), it leaves no process behind (they are started
with a parent-death signal) and :func:`remove_stale` removes the namespaces and pairs it left.
"""

from __future__ import annotations

import collections
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
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

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
#: The environment variables that set a BLAS library's thread count.
BLAS_THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")

PREFIX = "hcv"  # every namespace and interface a testbed creates starts with it


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


def with_blas_threads(env: Mapping[str, str], threads: int) -> dict[str, str]:
    """A copy of ``env`` that gives a process's BLAS library ``threads`` threads (0: ``env``
    unchanged, so the environment's or the library's default)."""
    out = dict(env)
    if threads:
        out.update(dict.fromkeys(BLAS_THREAD_VARIABLES, str(threads)))
    return out


# -- running commands ----------------------------------------------------------------------------


def _run(*command: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(command, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if check and done.returncode != 0:
        raise RuntimeError(
            f"`{' '.join(command)}` failed ({done.returncode}): "
            f"{(done.stderr or done.stdout).strip()}"
        )
    return done


def die_with_parent() -> list[str]:
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
        self.tag = f"{PREFIX}{os.getpid() % 10**7}"  # interface names: at most 15 characters
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

    def spawn(
        self, command: Sequence[str], env: Mapping[str, str], link: Link | None = None
    ) -> subprocess.Popen:
        """Start ``command`` in ``link``'s namespace (None: the root namespace, the master's),
        with a parent-death signal; its stdout and stderr come merged as text from the
        returned process's ``stdout``. Teardown stops it if it still runs."""
        # `ip netns exec` execs the command itself: the pid is the command's.
        inside = ["ip", "netns", "exec", link.namespace] if link is not None else []
        process = subprocess.Popen(
            [*inside, *die_with_parent(), *command],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=dict(env),
            text=True,
        )
        self.processes.append(process)
        return process

    def start_workers(self, timeout: float = 120.0) -> list[str]:
        """``hetconv worker`` in every namespace; returns their addresses once all serve."""
        from hetconv.calls import READY

        # One BLAS thread, as LocalWorkers: the workers share the cores with the master.
        env = with_blas_threads(dict(os.environ, PYTHONUNBUFFERED="1", HETCONV_TOKEN=self.token), 1)
        for link in self.links:
            address = f"{link.ns_ip}:{WORKER_PORT}"
            command = [sys.executable, "-I", "-m", "hetconv", "worker", "--listen", address,
                       "--backend", "cpu", "--no-startup-probe"]  # fmt: skip
            process = self.spawn(command, env, link)
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
        sink = self.spawn([sys.executable, "-I", "-c", code], os.environ, link)
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
    """Remove namespaces and veth pairs that a testbed left behind when its process was killed
    (SIGKILL gives no chance to clean up): those whose creating process no longer runs. A
    namespace with processes still inside is left alone, and so is its veth pair. Returns what
    was removed."""
    removed, kept = [], set()
    namespaces = _run("ip", "netns", "list", check=False).stdout.split()
    links = re.findall(r"^\d+: ([^:@]+)", _run("ip", "-o", "link", check=False).stdout, re.M)
    for name in namespaces + links:  # namespaces first: a kept one keeps its link
        found = re.fullmatch(rf"({PREFIX}(\d+))(?:-w(\d+)|m(\d+))", name)
        if found is None or int(found.group(2)) == os.getpid() % 10**7:
            continue
        if _alive(int(found.group(2))):
            continue  # its run may still be going (or the pid was reused: leave it)
        index = found.group(3) or found.group(4)
        if name in namespaces:
            if _run("ip", "netns", "pids", name, check=False).stdout.split():
                kept.add((found.group(1), index))
                if log is not None:
                    print(f"testbed: stale namespace {name} still has processes; left", file=log)
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


__all__ = [
    "BLAS_THREAD_VARIABLES",
    "CHECK_PORT",
    "ETHERNET_HEADER",
    "MTU",
    "PREFIX",
    "QUEUE_SECONDS",
    "TCP_IP_HEADERS",
    "WORKER_PORT",
    "Link",
    "Testbed",
    "WorkerProcess",
    "die_with_parent",
    "icmp_rtt",
    "remove_stale",
    "tcp_goodput_mbps",
    "testbed_unavailable",
    "with_blas_threads",
]
