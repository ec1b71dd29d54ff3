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

This module holds :class:`Testbed` and :func:`remove_stale`, and every name above is importable
from it; the rest is in :mod:`.netns` (what both testbeds share: commands, token buckets, worker
records, ICMP), :mod:`.cpucap` (the CPU caps) and :mod:`.clustertestbed`.
"""

from __future__ import annotations

import collections
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from hetconv.simulations.clustertestbed import (
    LINK_KINDS,
    SHARED_LINK,
    SUBNET,
    SWITCHED_LINK,
    ClusterTestbed,
    Host,
    cluster_testbed_unavailable,
)
from hetconv.simulations.cpucap import (
    CFS_PERIOD_US,
    CPU_CGROUP_ROOT,
    CpuCap,
    cpu_seconds,
    ensure_cpu_controller,
)
from hetconv.simulations.netns import (
    BLAS_THREAD_VARIABLES,
    CHECK_PORT,
    ETHERNET_HEADER,
    MTU,
    PREFIX,
    QUEUE_SECONDS,
    TCP_IP_HEADERS,
    WORKER_PORT,
    Link,
    WorkerProcess,
    _drain,
    _run,
    _signals_deferred,
    _stop_all,
    _tbf,
    _used_subnets,
    _wait_ready,
    die_with_parent,
    finished_output,
    icmp_rtt,
    tcp_goodput_mbps,
    testbed_unavailable,
    with_blas_threads,
)


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
            threading.Thread(target=_drain, args=(worker, READY), daemon=True).start()
            self.workers.append(worker)
        _wait_ready(self.workers, timeout)
        return [w.address for w in self.workers]

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
