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

:class:`ClusterTestbed` is the scaled cluster of ``benchmarks/testbed.py``: the master too in a
namespace of its own, every node joined to a bridge in a *switch* namespace, each node's
processes capped by a CPU cgroup (:class:`CpuCap`) to the same fraction of a core, and the links
shaped either per node (``switched``: a token bucket on both ends of every node's cable, each
direction at the rate) or through one token bucket that every packet passes once, between any
two nodes (``shared``: a Wi-Fi-like medium; an ``ifb`` device in the switch namespace takes
what every port brings into the bridge). Nothing of it is in the root namespace.

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
* :class:`ClusterTestbed` (a context manager) with its :class:`Host` records; :class:`CpuCap`,
  :func:`ensure_cpu_controller`, :func:`cluster_testbed_unavailable`, :func:`cpu_seconds`.

Everything a testbed creates (namespaces, veth pairs, CPU cgroups, processes) is removed when it
is left, also on Ctrl-C or SIGTERM. Killed outright (SIGKILL), it leaves no process behind (they
are started with a parent-death signal) and :func:`remove_stale` removes the namespaces, pairs
and cgroups it left.
"""

from __future__ import annotations

import collections
import contextlib
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


def _tbf(rate_mbps: float) -> tuple[str, ...]:
    """A token bucket qdisc's arguments for a link of ``rate_mbps``."""
    rate = rate_mbps * 1e6 / 8
    # A bucket of two frames (1 ms of the rate when that is more, for the timer's sake):
    # a deep one would pass the start of every transfer at the veth's own speed.
    burst = max(2 * (MTU + ETHERNET_HEADER), int(rate * 1e-3))
    limit = max(64 * 1024, int(rate * QUEUE_SECONDS))
    return ("tbf", "rate", f"{rate_mbps:g}mbit", "burst", str(burst), "limit", str(limit))


@contextlib.contextmanager
def _signals_deferred():
    """Ctrl-C and SIGTERM ignored inside (in the main thread): a second one does not cut a
    teardown short."""
    deferred = {}
    if threading.current_thread() is threading.main_thread():
        deferred = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in deferred.items():
            signal.signal(s, handler)


def _stop_all(processes: Sequence[subprocess.Popen]) -> None:
    """Terminate every process still running, then wait (10 s in all) and kill what is left."""
    for process in processes:
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + 10
    for process in processes:
        try:
            process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _wait_ready(workers: Sequence[WorkerProcess], timeout: float) -> None:
    """Wait until every worker printed its ready line; RuntimeError with its output when one
    exits first or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    for worker in workers:
        while not worker.ready.wait(0.1):
            if worker.process.poll() is not None or time.monotonic() > deadline:
                output = "\n".join(worker.lines) or "(no output)"
                raise RuntimeError(f"worker in {worker.link.namespace} did not start:\n{output}")


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
        self.ifbs: list[str] = []  # half-duplex media made (half_duplex)

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
        tbf = _tbf(rate_mbps)
        _run("tc", "qdisc", "replace", "dev", link.host_if, "root", *tbf)
        _run("ip", "netns", "exec", link.namespace, "tc", "qdisc", "replace", "dev", link.ns_if,
             "root", *tbf)  # fmt: skip

    def half_duplex(self, link: Link, rate_mbps: float) -> str:
        """Both directions of ``link`` through one token bucket at ``rate_mbps``, on an ifb
        device: a half-duplex medium, as one Wi-Fi channel is (the link's own buckets go).
        Returns the device's name; teardown removes it."""
        ifb = f"{self.tag}i{self.links.index(link)}"
        _run("ip", "link", "add", ifb, "type", "ifb")
        self.ifbs.append(ifb)
        _run("ip", "link", "set", ifb, "up")
        _run("tc", "qdisc", "replace", "dev", ifb, "root", *_tbf(rate_mbps))
        _run("tc", "qdisc", "del", "dev", link.host_if, "root")
        _run("tc", "qdisc", "add", "dev", link.host_if, "clsact")
        everything = ("protocol", "all", "u32", "match", "u32", "0", "0")
        redirect = ("action", "mirred", "egress", "redirect", "dev", ifb)
        for direction in ("egress", "ingress"):
            _run("tc", "filter", "add", "dev", link.host_if, direction, *everything, *redirect)
        _run("ip", "netns", "exec", link.namespace, "tc", "qdisc", "del", "dev", link.ns_if,
             "root")  # fmt: skip
        return ifb

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
        _wait_ready(self.workers, timeout)
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
        with _signals_deferred():
            self._teardown()

    def _teardown(self) -> None:
        _stop_all(self.processes)
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
        for ifb in self.ifbs:
            _run("ip", "link", "del", ifb, check=False)
        self.ifbs = []

    def leftovers(self) -> list[str]:
        """Namespaces and interfaces with this testbed's tag still present (for the tests)."""
        names = _run("ip", "netns", "list", check=False).stdout.split()
        names += re.findall(r"^\d+: ([^:@]+)", _run("ip", "-o", "link", check=False).stdout, re.M)
        return sorted({n for n in names if n.startswith(self.tag)})


# -- CPU caps ------------------------------------------------------------------------------------

#: Where the cgroup v1 ``cpu`` controller is (mounted there when missing, see
#: :func:`ensure_cpu_controller`).
CPU_CGROUP_ROOT = Path("/sys/fs/cgroup/cpu")
#: The CFS period of every cap: the quota is a fraction of it. Short, so that a capped process
#: runs in slices of a few milliseconds, as a slower core would, not in lumps of tens of
#: milliseconds with pauses in between that would delay every answer it must read or send.
CFS_PERIOD_US = 10_000


def ensure_cpu_controller(root: Path = CPU_CGROUP_ROOT) -> str | None:
    """Make sure the cgroup v1 ``cpu`` controller is mounted at ``root``: mounts it there when
    it is not (``mount -t cgroup -o cpu cpu ROOT``). Returns a line saying it was mounted, or
    None when it already was.

    Raises:
        RuntimeError: it is missing and cannot be mounted (no v1 controller in this kernel, or
            it is bound to a v2 hierarchy); the message says why.
    """
    if (root / "cpu.cfs_quota_us").exists():
        return None
    root.mkdir(parents=True, exist_ok=True)
    done = _run("mount", "-t", "cgroup", "-o", "cpu", "cpu", str(root), check=False)
    if done.returncode != 0 or not (root / "cpu.cfs_quota_us").exists():
        raise RuntimeError(
            f"no cgroup v1 cpu controller at {root}, and `mount -t cgroup -o cpu cpu {root}` "
            f"failed: {(done.stderr or done.stdout).strip() or 'no cpu.cfs_quota_us after it'}"
        )
    return f"mounted the cgroup v1 cpu controller at {root}"


class CpuCap:
    """A cgroup v1 ``cpu`` group that caps the processes in it, together, at ``fraction`` of one
    core (CFS bandwidth: ``cpu.cfs_quota_us`` = fraction x ``cpu.cfs_period_us``).

    A cap is a ceiling, not a reservation: on a machine that others load too, a capped process
    can get less.
    """

    def __init__(self, name: str, fraction: float, root: Path = CPU_CGROUP_ROOT):
        if not 0 < fraction <= 64:
            raise ValueError(f"CPU cap must be a positive fraction of a core, got {fraction}")
        if fraction * CFS_PERIOD_US < 1000:
            raise ValueError(
                f"CPU cap {fraction:g} is below the kernel's least quota, 1 ms of every "
                f"{CFS_PERIOD_US / 1000:g} ms period: at least {1000 / CFS_PERIOD_US:g}"
            )
        self.name, self.fraction, self.path = name, fraction, root / name
        self.created = False

    def create(self) -> None:
        self.path.mkdir()
        self.created = True
        (self.path / "cpu.cfs_period_us").write_text(f"{CFS_PERIOD_US}\n")
        quota = round(self.fraction * CFS_PERIOD_US)
        (self.path / "cpu.cfs_quota_us").write_text(f"{quota}\n")

    def prefix(self) -> list[str]:
        """A command prefix that moves the process into this group, then execs the command
        (so it is capped from its first instruction, and so is everything it starts)."""
        return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.path / "cgroup.procs")]

    def quota(self) -> tuple[int, int]:
        """(quota, period) in microseconds, as the kernel holds them."""
        quota, period = (
            int((self.path / name).read_text().split()[0])
            for name in ("cpu.cfs_quota_us", "cpu.cfs_period_us")
        )
        return quota, period

    def stat(self) -> dict[str, int]:
        """The group's ``cpu.stat``: ``nr_periods``, ``nr_throttled``, ``throttled_time`` (ns)."""
        text = (self.path / "cpu.stat").read_text()
        return {key: int(value) for key, value in (line.split() for line in text.splitlines())}

    def remove(self) -> None:
        """Delete the group; a process still in it goes back to the root group first."""
        if not self.created:
            return
        procs = self.path / "cgroup.procs"
        try:
            for pid in procs.read_text().split():
                try:
                    (self.path.parent / "cgroup.procs").write_text(f"{pid}\n")
                except OSError:
                    pass  # (it exited meanwhile)
            self.path.rmdir()
        except OSError:
            pass
        self.created = self.path.exists()


def cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used so far (``/proc/PID/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# -- the scaled cluster testbed ------------------------------------------------------------------

SWITCHED_LINK, SHARED_LINK = "switched", "shared"
LINK_KINDS = (SWITCHED_LINK, SHARED_LINK)
#: Every node's address is SUBNET.(2 + its index), the master's SUBNET.1: the addresses live in
#: the testbed's own namespaces only, so no two testbeds (or the host) can clash.
SUBNET = "10.214.0"


def cluster_testbed_unavailable(link: str = SWITCHED_LINK) -> str | None:
    """Why :class:`ClusterTestbed` cannot run here, or None when it can (short of the cgroup
    controller, which :func:`ensure_cpu_controller` mounts if it can)."""
    why = testbed_unavailable()
    if why is not None:
        return why
    if shutil.which("mount") is None and not (CPU_CGROUP_ROOT / "cpu.cfs_quota_us").exists():
        return "needs the cgroup v1 cpu controller (or `mount` to mount it)"
    if link == SHARED_LINK:
        probe = f"{PREFIX}{os.getpid() % 10**7}x"
        done = _run("ip", "link", "add", probe, "type", "ifb", check=False)
        if done.returncode != 0:
            return f"the shared link needs an ifb device: {done.stderr.strip()}"
        _run("ip", "link", "del", probe, check=False)
    return None


@dataclass
class Host:
    """One node of a :class:`ClusterTestbed`: its namespace, address and CPU cap."""

    name: str  # "master", "w0", "w1", ...
    namespace: str
    ip: str
    port_if: str  # the switch's end of its cable (in the switch namespace)
    cap: CpuCap | None
    interface: str = "eth0"  # its own end, in its namespace


class ClusterTestbed:
    """A master and ``workers`` workers, each in its own network namespace and CPU cgroup, joined
    by a bridge in a switch namespace, the links shaped as ``link`` says. A context manager:
    leaving it removes everything it made.

    Args:
        workers: worker namespaces.
        link: ``"switched"``: a token bucket at ``rate_mbps`` on both ends of every worker's
            cable, so each direction of each worker's link carries ``rate_mbps``, and the
            master's the same unless ``master_port_shaped`` is False (then only the workers'
            links limit); ``"shared"``: one token bucket at ``rate_mbps`` that every packet
            passes once, whichever two nodes it goes between (a half-duplex shared medium, as
            Wi-Fi), the cables otherwise unshaped.
        rate_mbps: the token buckets' rate (Ethernet frames, Mbit/s).
        cap: every process started through :meth:`spawn` on a node is capped, together with the
            node's other processes, at this fraction of a core (None: no caps).
        token: the shared secret workers are started with (``HETCONV_TOKEN``).
    """

    def __init__(
        self,
        workers: int,
        link: str,
        rate_mbps: float,
        cap: float | None,
        master_port_shaped: bool = True,
        token: str | None = None,
    ):
        if workers < 1:
            raise ValueError(f"worker count must be >= 1, got {workers}")
        if workers > 200:
            raise ValueError(f"at most 200 workers on one subnet, got {workers}")
        if link not in LINK_KINDS:
            raise ValueError(f"link {link!r} is not one of {', '.join(LINK_KINDS)}")
        if not rate_mbps > 0:
            raise ValueError(f"rate must be positive, got {rate_mbps}")
        if cap is not None and not 0 < cap <= 1:
            raise ValueError(f"CPU cap must be in (0, 1] of a core, got {cap}")
        self.worker_count, self.link, self.rate_mbps, self.cap = workers, link, rate_mbps, cap
        self.master_port_shaped = master_port_shaped
        self.token = token if token is not None else secrets.token_urlsafe(24)
        self.tag = f"{PREFIX}{os.getpid() % 10**7}"
        self.switch = f"{self.tag}-s"
        self.hosts: list[Host] = []
        self.namespaces: list[str] = []  # created, for the teardown
        self.workers: list[WorkerProcess] = []
        self.processes: list[subprocess.Popen] = []
        self.notes: list[str] = []  # what setting up did beyond the obvious (a mount)

    @property
    def master(self) -> Host:
        return self.hosts[0]

    @property
    def worker_hosts(self) -> list[Host]:
        return self.hosts[1:]

    # setting up

    def __enter__(self) -> ClusterTestbed:
        try:
            self.setup()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.teardown()

    def _add_namespace(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self.namespaces.append(name)
        _run("ip", "-n", name, "link", "set", "lo", "up")

    def setup(self) -> None:
        if self.cap is not None:
            mounted = ensure_cpu_controller()
            if mounted:
                self.notes.append(mounted)
        self._add_namespace(self.switch)
        sw = ("ip", "-n", self.switch)
        _run(*sw, "link", "add", "br0", "type", "bridge")
        _run(*sw, "link", "set", "br0", "up")
        names = ["master"] + [f"w{i}" for i in range(self.worker_count)]
        for index, name in enumerate(names):
            host = Host(
                name=name,
                namespace=f"{self.tag}-{'m' if index == 0 else name}",
                ip=f"{SUBNET}.{index + 1}",
                port_if=f"p{name}",
                cap=CpuCap(f"{self.tag}-{'m' if index == 0 else name}", self.cap)
                if self.cap is not None
                else None,
            )
            self.hosts.append(host)
            self._add_namespace(host.namespace)
            _run(*sw, "link", "add", host.port_if, "type", "veth", "peer", "name",
                 host.interface, "netns", host.namespace)  # fmt: skip
            _run(*sw, "link", "set", host.port_if, "master", "br0")
            _run(*sw, "link", "set", host.port_if, "up")
            inside = ("ip", "-n", host.namespace)
            _run(*inside, "addr", "add", f"{host.ip}/24", "dev", host.interface)
            _run(*inside, "link", "set", host.interface, "up")
            if host.cap is not None:
                host.cap.create()
        if self.link == SWITCHED_LINK:
            for host in self.hosts:
                if host is self.master and not self.master_port_shaped:
                    continue
                self._shape_cable(host, self.rate_mbps)
        else:
            self._shape_medium(self.rate_mbps)

    def _shape_cable(self, host: Host, rate_mbps: float) -> None:
        """A token bucket on both ends of ``host``'s cable: each direction at ``rate_mbps``."""
        tbf = _tbf(rate_mbps)
        _run("tc", "-n", self.switch, "qdisc", "replace", "dev", host.port_if, "root", *tbf)
        _run("tc", "-n", host.namespace, "qdisc", "replace", "dev", host.interface, "root", *tbf)

    def _shape_medium(self, rate_mbps: float) -> None:
        """One token bucket, on an ifb device, that every packet entering the bridge passes
        once: every transfer, between any two nodes and either way, shares ``rate_mbps``
        (traffic to and from the master, as hetconv's, and between workers, as a ring
        all-reduce's)."""
        tc = ("tc", "-n", self.switch)
        _run("ip", "-n", self.switch, "link", "add", "medium", "type", "ifb")
        _run("ip", "-n", self.switch, "link", "set", "medium", "up")
        _run(*tc, "qdisc", "add", "dev", "medium", "root", *_tbf(rate_mbps))
        every_packet = ("protocol", "all", "u32", "match", "u32", "0", "0")
        to_medium = ("action", "mirred", "egress", "redirect", "dev", "medium")
        for host in self.hosts:  # what a node sends enters the bridge through its port
            _run(*tc, "qdisc", "add", "dev", host.port_if, "clsact")
            _run(*tc, "filter", "add", "dev", host.port_if, "ingress", *every_packet, *to_medium)

    def qdisc_drops(self) -> int:
        """Packets the token buckets dropped so far."""
        total = 0
        for namespace in [self.switch] + [h.namespace for h in self.hosts]:
            text = _run("tc", "-n", namespace, "-s", "qdisc", "show", check=False).stdout
            total += sum(int(n) for n in re.findall(r"dropped (\d+)", text))
        return total

    # running things

    def spawn(
        self,
        command: Sequence[str],
        env: Mapping[str, str],
        host: Host,
        capped: bool = True,
        stdin: int | None = subprocess.DEVNULL,
    ) -> subprocess.Popen:
        """Start ``command`` in ``host``'s namespace, in its CPU cap unless ``capped`` is False,
        with a parent-death signal; stdout and stderr come merged as text from the returned
        process's ``stdout``. Teardown stops it if it still runs."""
        # Into the cgroup first: `ip netns exec` mounts a sysfs of the namespace's own over
        # /sys, which hides the cgroup folders. Each step execs the next, so the pid is the
        # command's, and the cgroup and the parent-death signal carry over.
        cap = host.cap.prefix() if capped and host.cap is not None else []
        process = subprocess.Popen(
            [*die_with_parent(), *cap, "ip", "netns", "exec", host.namespace, *command],
            stdin=stdin,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=dict(env),
            text=True,
        )
        self.processes.append(process)
        return process

    def start_workers(self, timeout: float = 180.0, extra: Sequence[str] = ()) -> list[str]:
        """``hetconv worker`` (cpu backend, one BLAS thread) in every worker's namespace and
        cap; returns their addresses once all serve."""
        from hetconv.calls import READY

        env = with_blas_threads(dict(os.environ, PYTHONUNBUFFERED="1", HETCONV_TOKEN=self.token), 1)
        for host in self.worker_hosts:
            address = f"{host.ip}:{WORKER_PORT}"
            command = [sys.executable, "-I", "-m", "hetconv", "worker", "--listen", address,
                       "--backend", "cpu", "--no-startup-probe", *extra]  # fmt: skip
            process = self.spawn(command, env, host)
            link = Link(host.namespace, host.port_if, host.interface, self.master.ip, host.ip)
            worker = WorkerProcess(
                link, process, collections.deque(maxlen=40), threading.Event(), address
            )
            threading.Thread(target=Testbed._drain, args=(worker, READY), daemon=True).start()
            self.workers.append(worker)
        _wait_ready(self.workers, timeout)
        return [w.address for w in self.workers]

    def run_master(self, arguments: Sequence[str], timeout: float, blas_threads: int = 1) -> str:
        """``hetconv train ARGUMENTS`` in the master's namespace and cap; returns its output.

        Raises:
            RuntimeError: it failed or ran past ``timeout`` seconds (the message holds the
                tail of its output).
        """
        env = with_blas_threads(dict(os.environ, HETCONV_TOKEN=self.token), blas_threads)
        command = [sys.executable, "-I", "-m", "hetconv", "train", *arguments]
        return finished_output(self.spawn(command, env, self.master), timeout, "`hetconv train`")

    def cap_shares(self, seconds: float = 1.0) -> list[float]:
        """The share of a core a busy loop gets on every host at once, in its cap, over
        ``seconds`` (master first): each near its cap where the machine has the cores to spare,
        less where other work competes."""
        code = "while True:\n    pass\n"
        loops = [self.spawn([sys.executable, "-I", "-c", code], os.environ, h) for h in self.hosts]
        try:
            time.sleep(0.3)  # (started)
            before, start = [cpu_seconds(p.pid) for p in loops], time.monotonic()
            time.sleep(seconds)
            after, elapsed = [cpu_seconds(p.pid) for p in loops], time.monotonic() - start
        finally:
            for loop in loops:
                loop.kill()
                loop.wait()
        return [(b - a) / elapsed for a, b in zip(before, after, strict=True)]

    # measuring the idle links

    def ping(self, host: Host, count: int = 10) -> float:
        """Median idle round trip master -> ``host``, seconds (ICMP echo from the master's
        namespace, uncapped)."""
        code = (
            "from hetconv.simulations.testbed import icmp_rtt\n"
            f"print(icmp_rtt({host.ip!r}, {count}))\n"
        )
        probe = self.spawn([sys.executable, "-I", "-c", code], os.environ, self.master, False)
        output, _ = probe.communicate(timeout=60)
        if probe.returncode != 0:
            raise RuntimeError(f"ping from the master to {host.name} failed:\n{output}")
        return float(output.split()[-1])

    def transfer_mbps(
        self, pairs: Sequence[tuple[Host, Host]], megabytes: float, timeout: float = 120
    ) -> list[float]:
        """Payload rates of bulk TCP transfers, all at once, ``megabytes`` each from the first
        host of every pair to the second, Mbit/s (uncapped processes: the links are measured,
        not the caps)."""
        sinks, senders = [], []
        size = max(64 * 1024, int(megabytes * 1e6))
        try:
            for index, (_, receiver) in enumerate(pairs):
                code = (
                    "import socket\n"
                    f"s=socket.create_server(({receiver.ip!r},{CHECK_PORT + index}))\n"
                    "print('listening',flush=True)\n"
                    "c,_=s.accept()\n"
                    "while c.recv(1<<20):\n    pass\n"
                    "c.sendall(b'x')\n"
                )
                sink = self.spawn([sys.executable, "-I", "-c", code], os.environ, receiver, False)
                if sink.stdout.readline().strip() != "listening":
                    raise RuntimeError(f"TCP sink on {receiver.name} did not start")
                sinks.append(sink)
            for index, (sender, receiver) in enumerate(pairs):
                code = (
                    "import socket,sys,time\n"
                    f"c=socket.create_connection(({receiver.ip!r},{CHECK_PORT + index}),"
                    "timeout=600)\n"
                    f"data=bytes({size})\n"
                    "print('connected',flush=True)\n"
                    "sys.stdin.readline()\n"
                    "t=time.perf_counter()\n"
                    "c.sendall(data)\n"
                    "c.shutdown(socket.SHUT_WR)\n"
                    "assert c.recv(1)==b'x'\n"
                    "print(time.perf_counter()-t,flush=True)\n"
                )
                process = self.spawn(
                    [sys.executable, "-I", "-c", code], os.environ, sender, False, subprocess.PIPE
                )
                if process.stdout.readline().strip() != "connected":
                    raise RuntimeError(f"TCP sender on {sender.name} did not connect")
                senders.append(process)
            for process in senders:  # all go at once
                process.stdin.write("go\n")
                process.stdin.flush()
            rates = []
            for process in senders:
                output, _ = process.communicate(timeout=timeout)
                if process.returncode != 0:
                    raise RuntimeError(f"TCP transfer failed:\n{output}")
                rates.append(8 * size / float(output.split()[-1]) / 1e6)
            return rates
        finally:
            for process in sinks + senders:
                try:
                    process.wait(10)
                except subprocess.TimeoutExpired:
                    process.kill()

    # tearing down

    def teardown(self) -> None:
        """Stop every process started here, delete the namespaces (their veth pairs, bridge and
        ifb go with them) and the CPU cgroups. Each part is tried even when an earlier one
        fails; a second Ctrl-C does not cut it short."""
        with _signals_deferred():
            self._teardown()

    def _teardown(self) -> None:
        _stop_all(self.processes)
        self.processes, self.workers = [], []
        for namespace in reversed(self.namespaces):
            for pid in _run("ip", "netns", "pids", namespace, check=False).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)  # only what this testbed started
                except (ProcessLookupError, ValueError):
                    pass
            _run("ip", "netns", "del", namespace, check=False)
        self.namespaces = []
        for host in self.hosts:
            if host.cap is not None:
                host.cap.remove()

    def leftovers(self) -> list[str]:
        """Namespaces and CPU cgroups with this testbed's tag still present (for the tests)."""
        names = _run("ip", "netns", "list", check=False).stdout.split()
        names = [n for n in names if n.startswith(self.tag)]
        if CPU_CGROUP_ROOT.is_dir():
            names += [str(p) for p in CPU_CGROUP_ROOT.glob(f"{self.tag}-*")]
        return sorted(set(names))


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
        # Testbed: hcvPID-wI (namespace), hcvPIDmI (root end of its pair); ClusterTestbed:
        # hcvPID-m (master), hcvPID-s (switch), hcvPID-wI, nothing in the root namespace.
        found = re.fullmatch(rf"({PREFIX}(\d+))(?:-w(\d+)|-([ms])|m(\d+))", name)
        if found is None or int(found.group(2)) == os.getpid() % 10**7:
            continue
        if _alive(int(found.group(2))):
            continue  # its run may still be going (or the pid was reused: leave it)
        index = found.group(3) or found.group(4) or found.group(5)
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
    if CPU_CGROUP_ROOT.is_dir():
        for group in CPU_CGROUP_ROOT.glob(f"{PREFIX}*-*"):
            found = re.fullmatch(rf"{PREFIX}(\d+)-(?:m|w\d+)", group.name)
            if found is None or int(found.group(1)) == os.getpid() % 10**7:
                continue
            if _alive(int(found.group(1))):
                continue
            try:
                group.rmdir()  # refused while a process is in it: then it stays
            except OSError:
                continue
            removed.append(str(group))
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


def finished_output(
    process: subprocess.Popen, timeout: float, what: str, tail_lines: int = 30
) -> str:
    """The output of ``process`` (text, stderr merged) once it has ended.

    Raises:
        RuntimeError: it ran past ``timeout`` seconds (it is killed) or failed; the message
            names ``what`` and holds the last ``tail_lines`` lines of its output.
    """
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        raise RuntimeError(f"{what} did not finish within {timeout:.0f} s") from None
    if process.returncode != 0:
        tail = "\n".join(output.splitlines()[-tail_lines:])
        raise RuntimeError(f"{what} failed ({process.returncode}):\n{tail}")
    return output


__all__ = [
    "BLAS_THREAD_VARIABLES",
    "CFS_PERIOD_US",
    "CHECK_PORT",
    "CPU_CGROUP_ROOT",
    "LINK_KINDS",
    "SHARED_LINK",
    "SUBNET",
    "SWITCHED_LINK",
    "ClusterTestbed",
    "CpuCap",
    "Host",
    "cluster_testbed_unavailable",
    "cpu_seconds",
    "ensure_cpu_controller",
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
    "finished_output",
    "icmp_rtt",
    "remove_stale",
    "tcp_goodput_mbps",
    "testbed_unavailable",
    "with_blas_threads",
]
