"""What each node is and how fast: its device, its link, and a probe of every layer.

The probe does what training does: a forward and a backward pass of the layer's real shape on
random data (no input gradient for a network's first layer), best of a few runs. The link is
measured with echoes: the round trip of a tiny message (latency) and of 1 MiB each way.
"""

from __future__ import annotations

import functools
import ipaddress
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TextIO

import numpy as np

from hetconv.backends import Backend
from hetconv.conv import ConvSpec
from hetconv.split import left_out

from .dispatch import Call
from .membership import ACTIVE, Node
from .planning import PlannedLayer

LINK_PROBE_BYTES = 1 << 20
PROBE_TIMEOUT_S = 300.0  # a slow device's probe of a large layer may take minutes


def planned_layers(layers: Sequence[ConvSpec], batch: int) -> list[PlannedLayer]:
    """The shapes the cluster plans for: one :class:`PlannedLayer` per conv layer of the model
    at ``batch`` images per step."""
    return [
        PlannedLayer(
            spec.name,
            spec.shape(batch),
            spec.need_input_grad,
            spec.stage,
            spec.images_fit,
            layer_label(spec, batch),
        )
        for spec in layers
    ]


def layer_label(spec: ConvSpec, batch: int) -> str:
    """``spec``'s layer as the network's spec wrote it, for the console: ``conv3 (32->64
    channels, 3x3, stride 2, 8x8, batch 32)``; a strided layer's stride phases (what executors
    compute, :class:`hetconv.conv.StridePhases`) are not the user's business."""
    own = spec.written if spec.written is not None else spec
    (c, h, w), (kh, kw), (sh, sw) = own.input_shape, own.kernel_size, own.stride
    stride = "" if (sh, sw) == (1, 1) else f", stride {sh}" if sh == sw else f", stride {sh}x{sw}"
    return f"{own.name} ({c}->{own.kernels} channels, {kh}x{kw}{stride}, {h}x{w}, batch {batch})"


def host_of(address: str) -> str:
    """The host part of a worker's ``HOST:PORT`` (``[::1]:50051``: ``::1``)."""
    host = address.rsplit(":", 1)[0] if address.count(":") == 1 or "]" in address else address
    return host.strip("[]")


@functools.cache
def _own_addresses() -> frozenset[str]:
    """Every address of this machine's interfaces (``ifaddr``, zeroconf's dependency; without
    it, what the host name resolves to)."""
    found = set()
    try:
        import ifaddr

        for adapter in ifaddr.get_adapters():
            for ip in adapter.ips:
                found.add(ip.ip if isinstance(ip.ip, str) else ip.ip[0])  # IPv6: a tuple
    except ImportError:
        pass
    try:
        found.update(socket.gethostbyname_ex(socket.gethostname())[2])
    except OSError:
        pass
    return frozenset(found)


def on_this_machine(address: str) -> bool:
    """Whether the worker at ``address`` (``HOST:PORT``) runs on the master's machine: its
    host is loopback, or resolves to one of this machine's own addresses. Such a worker
    shares the master's cores, memory and power, and its link is a memory copy."""
    host = host_of(address)
    try:
        ips = {str(ipaddress.ip_address(host))}
    except ValueError:  # a name: what it resolves to (the master has connected to it)
        try:
            ips = {info[4][0] for info in socket.getaddrinfo(host, None)}
        except OSError:
            return False
    own = _own_addresses()
    return bool(ips) and all(
        ipaddress.ip_address(ip.split("%")[0]).is_loopback or ip in own for ip in ips
    )


def describe_master(node: Node, backend: Backend) -> None:
    node.description = f"{backend.describe().name} ({backend.name})"


def connect(node: Node, connect_timeout: float, deadline: float, timeout: float | None = None):
    """Ask a worker what it runs on and measure its link; raises WorkerError if it cannot.

    Args:
        node: a worker (``node.client`` set).
        connect_timeout: how long the client waits for a worker from now on.
        deadline: seconds each echo may take.
        timeout: how long to wait for this first answer (default: ``connect_timeout``).
    """
    if timeout is not None:
        node.client.connect_timeout = timeout
    d = node.client.describe()
    node.client.connect_timeout = connect_timeout
    node.description = f"{d.name} ({d.backend}, {d.cores} cores)"
    node.instance_id = d.instance_id  # the same on every address of one worker process
    node.sum_port = d.sum_port
    node.backend = d.backend
    tiny = np.zeros(1, np.float32)
    link_probe = np.zeros(LINK_PROBE_BYTES // 4, np.float32)
    node.link_latency = min(
        node.client.echo([("t", tiny)], timeout=deadline)[1].wall_seconds for _ in range(3)
    )
    seconds = min(
        node.client.echo([("l", link_probe)], timeout=deadline)[1].wall_seconds for _ in range(3)
    )
    node.link_bytes_per_second = 2 * link_probe.nbytes / max(seconds - node.link_latency, 1e-9)


def probe(node: Node, layer: PlannedLayer, backend: Backend, repeats: int) -> float:
    """Seconds a forward + backward pass of the whole layer takes ``node`` (best of
    ``repeats``): on the master's own ``backend``, or by the worker."""
    if node.client is None:
        return backend.time_step(layer.shape, repeats, layer.need_input_grad)
    return node.client.probe(layer.shape, repeats, layer.need_input_grad, timeout=PROBE_TIMEOUT_S)


def probe_every(
    nodes: Sequence[Node],
    layers: Sequence[PlannedLayer],
    backend: Backend,
    repeats: int,
    log: TextIO | None = None,
    together: bool = True,
    known: dict[str, dict[str, float]] | None = None,
) -> None:
    """Probe every active node on every layer into ``node.probe_seconds``; a line on ``log``
    as each probe ends, so that a large network's minute of probing is never a blank screen.

    With ``together`` (the default) every node probes a layer at the same time, as they all
    compute it in training: nodes that share a machine (its cores, caches, memory bandwidth or
    power budget) are then measured as they will run, not each with the machine to itself, and
    on separate machines probing takes one node's time per layer instead of the sum over nodes.
    Without it, one node at a time (the paper's way). On the testbed (``benchmarks/testbed.py
    --modes exact_head exact_head_serial_probe``: five identical capped nodes on one machine)
    the second layer's probes of the five differed by 8-21 % one at a time and by 1-5 % at once
    (once 15 %: the master, while its workers agreed within 1 %).

    Nodes not active (unreachable at start) are left for when they come. ``known`` (node name
    -> {layer: seconds}): figures measured already, taken as they are (``--split auto``'s trial
    opens the split by kernels again over the same nodes: not probed again). A probe that fails
    raises its error once every probe of that layer has ended.
    """
    for node in nodes:
        node.probe_seconds.update((known or {}).get(node.name, {}))
    active = [node for node in nodes if node.state == ACTIVE]
    todo = {layer.name: [n for n in active if layer.name not in n.probe_seconds]
            for layer in layers}  # fmt: skip
    total, done = sum(len(v) for v in todo.values()), 0
    if log is not None and total:
        print(
            f"probing {len(active)} node{'s' if len(active) != 1 else ''} on {len(layers)} "
            f"layer{'s' if len(layers) != 1 else ''} (forward + backward of each layer's real "
            f"shape, best of {repeats}), "
            f"{'all nodes at once' if together and len(active) > 1 else 'one at a time'}:",
            file=log,
            flush=True,
        )
    lock = threading.Lock()

    def one(node: Node, layer: PlannedLayer, start: float) -> None:
        nonlocal done
        seconds = probe(node, layer, backend, repeats)
        with lock:
            node.probe_seconds[layer.name] = seconds
            done += 1
            if log is not None:
                s, took = layer.shape, time.perf_counter() - start
                what = layer.label or (
                    f"{layer.name} ({s.c}->{s.k} channels, {s.kh}x{s.kw}, {s.h}x{s.w}, batch {s.n})"
                )
                slow = f" (probing took {took:.0f} s)" if took >= 1 else ""
                print(
                    f"  [{done}/{total}] {what} on {node.name}: {1e3 * seconds:.1f} ms{slow}",
                    file=log,
                    flush=True,
                )

    for layer in layers:
        nodes_left = todo[layer.name]
        if together and len(nodes_left) > 1:
            _at_once(one, layer, nodes_left)
        else:
            for node in nodes_left:
                one(node, layer, time.perf_counter())


def _at_once(one, layer: PlannedLayer, active: Sequence[Node]) -> None:
    """``one(node, layer, start)`` for every node of ``active`` at once: each worker's on a
    :class:`~.dispatch.Call` of its own, the master's in this thread; the first error (in node
    order, the master's first) is raised once every probe has ended."""
    start = time.perf_counter()
    calls = [Call(one, node, layer, start) for node in active if node.client is not None]
    errors: list[Exception] = []
    for node in active:
        if node.client is None:
            try:
                one(node, layer, start)
            except Exception as e:  # raised once the workers' probes have ended too
                errors.append(e)
    for call in calls:
        try:
            call.result()
        except Exception as e:
            errors.append(e)
    if errors:
        raise errors[0]


def probe_all(node: Node, layers: list[PlannedLayer], backend: Backend, repeats: int):
    """``{layer name: probe seconds}`` of ``node`` for every layer."""
    return {layer.name: probe(node, layer, backend, repeats) for layer in layers}


#: The link-test payload: about this many seconds of the link, between these bounds.
MEDIUM_PROBE_SECONDS = 0.05
MEDIUM_PROBE_BYTES = (1 << 20, 16 << 20)
#: Two overlapping echoes on one worker: a full-duplex link ends them at 1.5x one echo's time,
#: a half-duplex medium (Wi-Fi: one channel, one direction at a time) at 2x. The cut between.
HALF_DUPLEX_RATIO = 1.75
#: A ratio this close to the cut is timed again (up to :data:`MEDIUM_ROUNDS` rounds in all),
#: every round's echoes pooled: on a quiet or a busy machine the ratio keeps within 1.50-1.64
#: (full duplex) and 1.97-2.02 (half duplex), but a full-duplex link once measured 1.77.
#: ``benchmarks/network_medium.py`` measures the spread.
AMBIGUOUS_RATIO = 0.1
MEDIUM_ROUNDS = 3


#: Seconds each worker gives each peer in the split's reach check (:func:`split_reach`).
PEER_REACH_S = 2.0


def split_reach(workers: Sequence[Node], timeout: float = PEER_REACH_S) -> dict[str, str]:
    """Worker address -> why it is left out of a split block's exchange
    (:func:`hetconv.split.left_out`): each of ``workers`` is asked, all at once, whether it
    reaches every other at the address this master uses (a Describe from it within
    ``timeout`` seconds); a worker that does not answer the check is left out too."""
    addresses = [node.client.address for node in workers]
    calls = {
        address: Call(node.client.reach_peers, [a for a in addresses if a != address], timeout)
        for address, node in zip(addresses, workers, strict=True)
    }
    unreachable, failed = {}, {}
    for address, call in calls.items():
        try:
            unreachable[address] = call.result()
        except Exception as e:  # noqa: BLE001 - any failure leaves it out, named
            failed[address] = f"it did not answer the reach check: {e}"
    return left_out(addresses, unreachable, failed)


@dataclass(frozen=True)
class Medium:
    """What the master measured of the network between it and its workers.

    Attributes:
        shared: whether the workers' transfers share one half-duplex medium (Wi-Fi): a request
            going out and an answer coming back slow each other.
        duplex_ratio: two echoes of one worker, the second started half an echo later, took
            this many times one echo (1.5: full duplex; 2: half duplex); 0 on loopback (not
            timed).
        together_bytes_per_s: every worker's echo at once, bytes both ways over the wall time:
            what the master's port (switched) or the medium (Wi-Fi) carries in all.
        alone_bytes_per_s: the fastest worker's echo rate measured alone.
        echoes: how many echoes the duplex ratio was timed from (single and overlapping).
        loopback: every worker is on the master's machine (:func:`on_this_machine`): their
            transfers are memory copies that share its cores, no medium to detect (the two
            directions would compete for the CPUs and look like a shared medium at random).
    """

    shared: bool
    duplex_ratio: float
    together_bytes_per_s: float
    alone_bytes_per_s: float
    echoes: int = 0
    loopback: bool = False

    @property
    def network(self) -> str:
        """The cost model's fabric: ``"wifi"`` (one shared medium) or ``"switched"`` (also
        loopback's: each direction its own)."""
        return "wifi" if self.shared else "switched"

    @property
    def capacity_bytes_per_s(self) -> float:
        """What all workers' transfers together can use: the medium or the master's port."""
        return max(self.together_bytes_per_s, self.alone_bytes_per_s)

    def describe(self) -> str:
        rates = (
            f"all workers at once {self.together_bytes_per_s / 1e6:.0f} MB/s, the fastest "
            f"alone {self.alone_bytes_per_s / 1e6:.0f} MB/s"
        )
        if self.loopback:
            return (
                "network: loopback (this machine): every worker runs on the master's machine, "
                f"so no medium was measured (planned as switched); {rates}"
            )
        kind = "one shared medium (Wi-Fi-like)" if self.shared else "switched (full duplex)"
        return (
            f"network: {kind}: overlapping echoes took {self.duplex_ratio:.2f}x one echo "
            f"(1.5 full duplex, 2 half duplex); all workers at once "
            f"{self.together_bytes_per_s / 1e6:.0f} MB/s, the fastest alone "
            f"{self.alone_bytes_per_s / 1e6:.0f} MB/s"
        )

    def record(self) -> dict:
        return {
            "network": self.network,
            "loopback": self.loopback,
            "duplex_ratio": self.duplex_ratio if not self.loopback else None,
            "duplex_echoes": self.echoes,
            "together_bytes_per_second": self.together_bytes_per_s,
            "alone_bytes_per_second": self.alone_bytes_per_s,
        }


def _echo_seconds(node: Node, payload: np.ndarray, deadline: float) -> float:
    return node.client.echo([("m", payload)], timeout=deadline)[1].wall_seconds


def _together(nodes: Sequence[Node], payloads: Sequence[np.ndarray], deadline: float, delays):
    """Wall seconds from the first echo's start until every echo (``nodes[i]`` sends
    ``payloads[i]``, starting ``delays[i]`` seconds after the first) has its answer."""
    start = time.perf_counter()
    ends: list[float] = [0.0] * len(nodes)
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            pause = start + delays[i] - time.perf_counter()
            if pause > 0:
                time.sleep(pause)
            nodes[i].client.echo([("m", payloads[i])], timeout=deadline)
            ends[i] = time.perf_counter()
        except BaseException as e:  # handed to the caller
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(nodes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return max(ends) - start


def measure_medium(workers: Sequence[Node], deadline: float, repeats: int = 3) -> Medium:
    """Whether ``workers`` (connected, links measured) share one medium, and what all of them
    together can carry (best of ``repeats`` each). Raises WorkerError if an echo fails.

    Two echoes of the fastest worker, the second started half an echo after the first: on a
    full-duplex link the second's request goes out while the first's answer comes back, so
    both end at 1.5x one echo's time; on a half-duplex medium they take turns, 2x. A ratio
    within :data:`AMBIGUOUS_RATIO` of the cut is timed again, the echoes pooled (at most
    :data:`MEDIUM_ROUNDS` rounds). Then every worker's echo at once gives the rate the master's
    side carries in all.
    """
    if not workers:
        raise ValueError("no workers to measure the network with")
    fastest = max(workers, key=lambda n: n.link_bytes_per_second)
    payload = _medium_payload(fastest.link_bytes_per_second)
    ones: list[float] = []
    pairs: list[float] = []
    for _ in range(MEDIUM_ROUNDS):
        ones += [_echo_seconds(fastest, payload, deadline) for _ in range(repeats)]
        one = min(ones)
        pairs += [
            _together([fastest, fastest], [payload, payload], deadline, [0.0, one / 2])
            for _ in range(repeats)
        ]
        ratio = min(pairs) / one
        if abs(ratio - HALF_DUPLEX_RATIO) >= AMBIGUOUS_RATIO:
            break
    alone = 2 * payload.nbytes / max(one - fastest.link_latency, 1e-9)
    together = _together_rate(workers, payload, deadline, repeats)
    return Medium(ratio >= HALF_DUPLEX_RATIO, ratio, together, alone, len(ones) + 2 * len(pairs))


def loopback_medium(workers: Sequence[Node], deadline: float, repeats: int = 3) -> Medium:
    """The network of ``workers`` that all run on the master's machine: loopback, no medium
    to detect (the duplex ratio is not timed); what they carry together is measured as
    :func:`measure_medium` does. Raises WorkerError if an echo fails."""
    if not workers:
        raise ValueError("no workers to measure the network with")
    fastest = max(workers, key=lambda n: n.link_bytes_per_second)
    payload = _medium_payload(fastest.link_bytes_per_second)
    together = _together_rate(workers, payload, deadline, repeats)
    return Medium(False, 0.0, together, fastest.link_bytes_per_second, 0, loopback=True)


def _medium_payload(rate: float) -> np.ndarray:
    """About :data:`MEDIUM_PROBE_SECONDS` of a link of ``rate`` bytes per second."""
    low, high = MEDIUM_PROBE_BYTES
    size = int(min(max(rate * MEDIUM_PROBE_SECONDS / 2, low), high)) // 4 * 4
    return np.zeros(size // 4, np.float32)


def _together_rate(workers: Sequence[Node], payload, deadline: float, repeats: int) -> float:
    """Bytes per second both ways of every worker's echo of ``payload`` at once (best of
    ``repeats``)."""
    payloads = [payload] * len(workers)
    together_s = min(
        _together(workers, payloads, deadline, [0.0] * len(workers)) for _ in range(repeats)
    )
    latency = max(n.link_latency for n in workers)
    return 2 * payload.nbytes * len(workers) / max(together_s - latency, 1e-9)
