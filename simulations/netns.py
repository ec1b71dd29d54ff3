"""What both testbeds of :mod:`hetconv.simulations.testbed` share: the link constants, running
commands (``ip``, ``tc``) and processes in network namespaces, a token bucket's arguments, a
worker's link and process records, and measuring an idle link (ICMP round trips, TCP goodput).
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
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

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


def _drain(worker: WorkerProcess, ready: str) -> None:
    """Keep the last lines of a worker's output; set its ``ready`` event at its ready line."""
    for line in worker.process.stdout:
        worker.lines.append(line.rstrip("\n"))
        if line.startswith(ready):
            worker.ready.set()


def _wait_ready(workers: Sequence[WorkerProcess], timeout: float) -> None:
    """Wait until every worker printed its ready line; RuntimeError with its output when one
    exits first or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    for worker in workers:
        while not worker.ready.wait(0.1):
            if worker.process.poll() is not None or time.monotonic() > deadline:
                output = "\n".join(worker.lines) or "(no output)"
                raise RuntimeError(f"worker in {worker.link.namespace} did not start:\n{output}")


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
