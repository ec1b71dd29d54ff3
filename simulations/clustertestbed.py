"""The scaled cluster testbed of ``benchmarks/testbed.py``: the master and every worker in a
network namespace and CPU cgroup of its own, joined by a bridge in a switch namespace, the links
shaped per node (``switched``) or through one token bucket every packet passes (``shared``). See
:mod:`hetconv.simulations.testbed`.
"""

from __future__ import annotations

import collections
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from hetconv.simulations.cpucap import (
    CPU_CGROUP_ROOT,
    CpuCap,
    cpu_seconds,
    ensure_cpu_controller,
)
from hetconv.simulations.netns import (
    CHECK_PORT,
    PREFIX,
    WORKER_PORT,
    Link,
    WorkerProcess,
    _drain,
    _run,
    _signals_deferred,
    _stop_all,
    _tbf,
    _wait_ready,
    die_with_parent,
    finished_output,
    testbed_unavailable,
    with_blas_threads,
)

SWITCHED_LINK, SHARED_LINK = "switched", "shared"
LINK_KINDS = (SWITCHED_LINK, SHARED_LINK)
#: Every node's address is SUBNET.(2 + its index), the master's SUBNET.1: the addresses live in
#: the testbed's own namespaces only, so no two testbeds (or the host) can clash.
SUBNET = "10.214.0"
#: Where `ip netns add` keeps a named network namespace's handle (for `nsenter --net`).
NETNS_DIR = Path("/run/netns")


def cluster_testbed_unavailable(link: str = SWITCHED_LINK) -> str | None:
    """Why :class:`ClusterTestbed` cannot run here, or None when it can (short of the cgroup
    controller, which :func:`ensure_cpu_controller` mounts if it can)."""
    why = testbed_unavailable()
    if why is not None:
        return why
    if shutil.which("mount") is None and not (CPU_CGROUP_ROOT / "cpu.cfs_quota_us").exists():
        return "needs the cgroup v1 cpu controller (or `mount` to mount it)"
    if shutil.which("nsenter") is None:
        return "needs `nsenter` (util-linux) to start processes in a node's network namespace"
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
        # Into the cgroup first, then into the namespace's network alone (`nsenter --net`,
        # not `ip netns exec`, which mounts a sysfs of the namespace's own over /sys and so
        # hides the cgroup folders: a process then could not read its own CPU quota, as one
        # in a container can, hetconv.cpushare.quota_share). Each step execs the next, so the
        # pid is the command's, and the cgroup and the parent-death signal carry over.
        cap = host.cap.prefix() if capped and host.cap is not None else []
        enter = ["nsenter", f"--net={NETNS_DIR / host.namespace}"]
        process = subprocess.Popen(
            [*die_with_parent(), *cap, *enter, *command],
            stdin=stdin,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=dict(env),
            text=True,
        )
        self.processes.append(process)
        return process

    def start_workers(
        self, timeout: float = 180.0, extra: Sequence[str] = (), backend: str = "cpu"
    ) -> list[str]:
        """``hetconv worker`` (``backend``: cpu, or onednn; one BLAS thread) in every worker's
        namespace and cap; returns their addresses once all serve."""
        from hetconv.calls import READY

        env = with_blas_threads(dict(os.environ, PYTHONUNBUFFERED="1", HETCONV_TOKEN=self.token), 1)
        for host in self.worker_hosts:
            address = f"{host.ip}:{WORKER_PORT}"
            command = [sys.executable, "-I", "-m", "hetconv", "worker", "--listen", address,
                       "--backend", backend, "--no-startup-probe", *extra]  # fmt: skip
            process = self.spawn(command, env, host)
            link = Link(host.namespace, host.port_if, host.interface, self.master.ip, host.ip)
            worker = WorkerProcess(
                link, process, collections.deque(maxlen=40), threading.Event(), address
            )
            threading.Thread(target=_drain, args=(worker, READY), daemon=True).start()
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
