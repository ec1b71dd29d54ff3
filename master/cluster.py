"""The master's cluster: splits every convolution's kernels across workers and itself.

It implements :class:`~hetconv.conv.ConvExecutor`, so a model trains on it unchanged.

Forward: every node gets the same inputs and its slice of the kernels (and biases); the feature
maps come back straight into their channel slice of the output. Backward: every node gets its
slice of the output gradient and returns its kernels' gradients (written into their slice) and,
except for a network's first layer, its part of the input gradient, which the master sums.
Workers keep the forward inputs and kernels for the backward call of the same step, so backward
sends only the gradient slice. Requests to all workers go out concurrently; the master computes
its own share meanwhile.

Shares come from probes (:meth:`Cluster.prepare`): each node times a forward + backward pass of
the layer's real shape on random data, and :func:`~hetconv.balance.kernel_shares` gives kernels
in proportion to 1/time.

Nothing is lost when a worker fails. A call that errs, misses its deadline (derived from the
probe and the measured link) or returns a malformed answer costs time only: the master computes
that kernel slice itself, for the rest of the step too, and the step completes. The worker is
dropped; from the next step the shares are recomputed without it. A monitor thread retries it
with exponential backoff, probes it again when it answers, and it gets a share from the next
step on. New workers named in the workers file (re-read while training) join the same way;
workers whose line is removed from it leave at the next step boundary.

The split is not fixed once, as in the paper: every ``rebalance_every`` steps each node's
compute is compared with its own at the same share earlier, and a node that got markedly slower
(a laptop whose owner started something) or faster has its figure scaled and the shares are
planned again.
"""

from __future__ import annotations

import collections
import os
import secrets
import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TextIO

import numpy as np
from tqdm import tqdm

from hetconv.backends import Backend, ConvShape, Padding, PaddingSpec, get_backend
from hetconv.balance import kernel_shares, offsets
from hetconv.master.client import CallStats, WorkerClient

MASTER = "master"
COMPUTE_POLICY, LINK_POLICY = "compute", "link"
SHARE_POLICIES = (COMPUTE_POLICY, LINK_POLICY)
NETWORKS = ("switched", "wifi")  # the simulator's fabrics (hetconv.costmodel.FABRICS)

ACTIVE, LOST, READY = "active", "lost", "ready"


@dataclass(frozen=True)
class ClusterConfig:
    """How the master splits and dispatches.

    Args:
        master_compute: whether the master computes a share of every layer itself (it always
            computes the slices of workers that fail).
        probe_repeats: timed probe runs per node and layer (the best counts).
        deadline_floor: seconds every call may take at least.
        deadline_factor: a call's deadline is the floor plus this many times what the probe and
            the measured link predict for it.
        connect_timeout: seconds to wait for each worker to answer at start.
        shares: layer name -> kernels per node (master first), overriding what the probe gives
            while every starting worker is active; for experiments and tests.
        retry_min, retry_max: seconds between attempts to reach a lost worker: doubling from
            the first to the second.
        workers_file: a file naming workers, re-read during training: workers added to it join,
            workers removed from it leave (at the next step boundary).
        share_policy: ``"compute"``, the paper's rule (kernels in proportion to 1 / probe
            time), or ``"link"``: the simulator's link-aware rule
            (:func:`hetconv.balance.link_aware_shares`) fed with the probes and
            the links measured at connect, so a worker whose link makes it a net loss gets no
            kernels.
        network: what ``"link"`` shares assume of the network: ``"switched"`` (Ethernet: a
            port per machine, full duplex; the master's as fast as its fastest worker link)
            or ``"wifi"`` (one medium that every transfer, both ways, shares).
        rebalance_every: every this many steps, nodes whose measured compute has drifted from
            their own at the same share earlier get their figures scaled and the kernels are
            split again (0: the split stays as planned, as in the paper, except when workers
            come or go). See :meth:`Cluster._drifted`.
        rebalance_change: the relative drift that counts: a node's factor (its median compute
            in the last period over its baseline, geometric mean over its layers) at least
            this far from 1.
        token, tls_ca: credentials for the workers (see
            :class:`~hetconv.master.client.WorkerClient`).
    """

    master_compute: bool = True
    probe_repeats: int = 2
    deadline_floor: float = 5.0
    deadline_factor: float = 10.0
    connect_timeout: float = 20.0
    shares: dict[str, tuple[int, ...]] | None = None
    retry_min: float = 0.5
    retry_max: float = 30.0
    workers_file: str | None = None
    share_policy: str = "compute"
    network: str = "switched"
    rebalance_every: int = 20
    rebalance_change: float = 0.3
    token: str | None = field(default=None, repr=False)  # never in a logged config
    tls_ca: str | None = None


@dataclass
class Node:
    """The master or one worker, as the cluster sees it."""

    name: str
    client: WorkerClient | None  # None for the master itself
    description: str = ""
    link_bytes_per_second: float = float("inf")  # measured round trip, both directions
    link_latency: float = 0.0
    # per layer: the seconds forward + backward of the whole layer would take it: the probe's
    # figure, scaled by how much its speed has changed in training since (Cluster._drifted)
    probe_seconds: dict[str, float] = field(default_factory=dict)
    # per layer: recent training steps' compute seconds at the current share, and the median
    # of the first such period (see Cluster._drifted)
    measured: dict[str, collections.deque] = field(default_factory=dict)
    baseline: dict[str, float] = field(default_factory=dict)
    state: str = ACTIVE
    failures: int = 0  # consecutive failed attempts to reach it since it was lost
    losses: int = 0  # times it was lost: a worker that keeps failing is retried less often
    retry_at: float = 0.0
    joined: bool = False  # came from the workers file during training
    leaving: bool = False  # its line left the workers file: it goes at the next step boundary


@dataclass(frozen=True)
class LayerPlan:
    """How one layer's kernels are split: ``shares[i]`` kernels from ``starts[i]`` on node i."""

    shape: ConvShape
    shares: tuple[int, ...]
    starts: tuple[int, ...]


@dataclass(frozen=True)
class _Layer:
    name: str
    shape: ConvShape
    need_input_grad: bool


class _Call:
    """One worker call running on its own daemon thread.

    Not a thread pool: after Ctrl-C interrupts the main thread while it waits, a pool's
    non-daemon threads can be left blocked on a lock the interrupted wait still holds, and the
    interpreter joins them at exit forever (seen here). Daemon threads never keep it alive; a
    call costs a thread start (~0.1 ms) next to calls of milliseconds.
    """

    def __init__(self, fn, *args, **kwargs):
        self._done = threading.Event()
        self._value = self._error = None
        self._thread = threading.Thread(
            target=self._run, args=(fn, args, kwargs), name="hetconv-call", daemon=True
        )
        self._thread.start()

    def _run(self, fn, args, kwargs) -> None:
        try:
            self._value = fn(*args, **kwargs)
        except BaseException as e:  # handed to the waiting thread
            self._error = e
        finally:
            self._done.set()

    def result(self):
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._value


def _phase_record(stats: CallStats) -> dict:
    return {
        "bytes_sent": stats.bytes_sent,
        "bytes_received": stats.bytes_received,
        "send_seconds": stats.send_seconds,
        "compute_seconds": stats.compute_seconds,
        "receive_seconds": stats.receive_seconds,
        "wall_seconds": stats.wall_seconds,
        "bundled": stats.bundled,
    }


def _shares_text(shares: dict[str, dict[str, int]]) -> str:
    """``conv1 3/3/2, conv2 5/6/5 (master/127.0.0.1:5001/...)`` for the console."""
    layers = ", ".join(
        f"{layer} {'/'.join(map(str, by_node.values()))}" for layer, by_node in shares.items()
    )
    nodes = next(iter(shares.values()), {})
    return f"kernels {layers} ({'/'.join(nodes)})"


def _sides(padding: PaddingSpec, kernel_hw) -> tuple[int, int, int, int]:
    p = Padding.resolve(padding, kernel_hw)
    return p.top, p.bottom, p.left, p.right


class Cluster:
    """A :class:`~hetconv.conv.ConvExecutor` over the master and its workers.

    Args:
        addresses: workers as ``HOST:PORT``.
        backend: the master's own backend (a name or instance).
        config: dispatch settings.
    """

    def __init__(
        self,
        addresses: Sequence[str],
        backend: Backend | str = "cpu",
        config: ClusterConfig | None = None,
    ):
        if len(set(addresses)) != len(addresses):
            raise ValueError(f"a worker is named twice in {list(addresses)}")
        self.config = config or ClusterConfig()
        if self.config.rebalance_every < 0 or not 0 < self.config.rebalance_change:
            raise ValueError(
                f"rebalancing every {self.config.rebalance_every} steps on a change of "
                f"{self.config.rebalance_change}: need steps >= 0 and a change > 0"
            )
        if self.config.network not in NETWORKS:
            raise ValueError(f"network {self.config.network!r} is not one of {', '.join(NETWORKS)}")
        if self.config.share_policy not in SHARE_POLICIES:
            raise ValueError(
                f"share policy {self.config.share_policy!r} is not one of "
                f"{', '.join(SHARE_POLICIES)}"
            )
        if not addresses and not self.config.master_compute and not self.config.workers_file:
            raise ValueError("no workers and --no-master-compute: nothing would compute")
        self.backend = get_backend(backend) if isinstance(backend, str) else backend
        self.nodes = [Node(MASTER, None)] + [Node(a, self._client(a)) for a in addresses]
        self.session = secrets.randbits(64)
        self.plans: dict[str, LayerPlan] = {}
        self.step = 0
        self.events: list[dict] = []  # everything that happened to the membership, in order
        self._records: dict[str, dict] = {}
        self._comm = self._conv = self._wall = 0.0
        self._lock = threading.Lock()  # node states, pending joiners, events
        self._pending: list[Node] = []  # joiners being connected and probed
        self._step_events: list[dict] = []
        self._failed: set[str] = set()  # workers that failed during the current step
        self._layers: list[_Layer] = []
        self._log: TextIO | None = None
        self._closed = threading.Event()
        self._monitor: threading.Thread | None = None
        self._file_mtime = 0.0
        self._listed: set[str] = set()  # what the workers file named when last read
        self._fixed: set[str] = set(addresses)  # named outside the workers file (--worker)
        self._replan_needed = False
        self._warming = True  # the next step's measurements are left out (_measure)

    def _client(self, address: str) -> WorkerClient:
        credentials = {}
        if self.config.token:
            credentials["token"] = self.config.token
        if self.config.tls_ca:
            credentials["tls_ca"] = self.config.tls_ca
        return WorkerClient(address, self.config.connect_timeout, **credentials)

    # -- setting up ------------------------------------------------------------------------

    def _connect(self, node: Node, timeout: float | None = None) -> None:
        """Describe the worker and measure its link; raises WorkerError if it cannot."""
        link_probe = np.zeros(1 << 18, np.float32)  # 1 MiB
        tiny = np.zeros(1, np.float32)
        if timeout is not None:
            node.client.connect_timeout = timeout
        d = node.client.describe()
        node.client.connect_timeout = self.config.connect_timeout
        node.description = f"{d.name} ({d.backend}, {d.cores} cores)"
        deadline = max(self.config.deadline_floor, 10.0)
        node.link_latency = min(
            node.client.echo([("t", tiny)], timeout=deadline)[1].wall_seconds for _ in range(3)
        )
        seconds = min(
            node.client.echo([("l", link_probe)], timeout=deadline)[1].wall_seconds
            for _ in range(3)
        )
        node.link_bytes_per_second = 2 * link_probe.nbytes / max(seconds - node.link_latency, 1e-9)

    def connect(self) -> None:
        """Ask every worker what it runs on and measure its link; raises WorkerError if one
        cannot be reached."""
        self.nodes[0].description = f"{self.backend.describe().name} ({self.backend.name})"
        for node in self.nodes[1:]:
            self._connect(node)

    def _probe(self, node: Node, layer: _Layer) -> float:
        # The probe does what training does: no input gradient for a first layer.
        if node.client is None:
            return self.backend.time_step(
                layer.shape, self.config.probe_repeats, layer.need_input_grad
            )
        return node.client.probe(
            layer.shape, self.config.probe_repeats, layer.need_input_grad, timeout=300.0
        )

    def prepare(self, layers, batch: int, log: TextIO | None = None) -> None:
        """Connect, probe every node on every layer's real shape, set the shares, and start
        watching for lost and new workers.

        Args:
            layers: the model's :class:`~hetconv.layers.Conv2d` layers, each with ``input_shape``
                (C, H, W) known.
            batch: images per step.
            log: where to print the probe table and membership events (None: nowhere).
        """
        self._log = log
        self.connect()
        for layer in layers:
            c, h, w = layer.input_shape
            k, _, kh, kw = layer.params["weight"].shape
            shape = ConvShape(batch, c, h, w, k, kh, kw, Padding.resolve(layer.padding, (kh, kw)))
            self._layers.append(_Layer(layer.name, shape, layer.need_input_grad))
        for entry in self._layers:
            for node in self.nodes:  # one node at a time: nodes on one machine must not collide
                node.probe_seconds[entry.name] = self._probe(node, entry)
        if self.config.shares:
            for name, shares in self.config.shares.items():
                entry = next((e for e in self._layers if e.name == name), None)
                if entry is not None:
                    self._check_shares(name, entry.shape.k, shares)
        self._replan()
        if self.config.workers_file:
            self._file_mtime = self._workers_file_mtime()
            from hetconv.cli import read_workers_file

            try:
                self._listed = set(read_workers_file(self.config.workers_file))
            except (OSError, ValueError):  # read fine at start; the monitor reports changes
                self._listed = {n.name for n in self.nodes[1:]}
            self._fixed -= self._listed
        if log is not None:
            print(self.describe_shares(), file=log)
        self._monitor = threading.Thread(target=self._watch, name="hetconv-monitor", daemon=True)
        self._monitor.start()

    def _check_shares(self, layer: str, kernels: int, shares) -> list[int]:
        shares = [int(s) for s in shares]
        if len(shares) != len(self.nodes) or min(shares) < 0 or sum(shares) != kernels:
            raise ValueError(
                f"shares {shares} for {layer} must be {len(self.nodes)} non-negative counts "
                f"(master first) summing to its {kernels} kernels"
            )
        if shares[0] and not self.config.master_compute:
            raise ValueError(
                f"shares {shares} for {layer} give the master kernels, but master compute is off"
            )
        return shares

    def _replan(self) -> None:
        """Shares of every layer over the active nodes (called between steps)."""
        everyone_active = all(n.state == ACTIVE for n in self.nodes) and not any(
            n.joined for n in self.nodes
        )
        for entry in self._layers:
            override = (self.config.shares or {}).get(entry.name)
            if override is not None and everyone_active and len(override) == len(self.nodes):
                shares = list(override)
            else:
                seconds = []
                for node in self.nodes:
                    usable = node.state == ACTIVE and (
                        node.client is not None or self.config.master_compute
                    )
                    seconds.append(node.probe_seconds.get(entry.name, 1.0) if usable else np.inf)
                if all(np.isinf(seconds)):
                    # No worker left and the master was told not to compute: it must, or
                    # nothing would. (Said once in the events when it happens.)
                    seconds[0] = self.nodes[0].probe_seconds.get(entry.name, 1.0)
                shares = kernel_shares(entry.shape.k, seconds)
                if self.config.share_policy == LINK_POLICY:
                    shares = self._link_aware_shares(entry, seconds, shares)
            self.plans[entry.name] = LayerPlan(entry.shape, tuple(shares), tuple(offsets(shares)))

    def _link_aware_shares(self, entry: _Layer, seconds: list[float], fallback: list[int]):
        """The simulator's link-aware split of ``entry`` over the nodes whose ``seconds`` are
        finite (the usable ones), from their probes and measured links; ``fallback`` (the
        compute shares) when the master alone is usable."""
        from hetconv import costmodel
        from hetconv.balance import link_aware_shares

        usable = [i for i, t in enumerate(seconds) if np.isfinite(t)]
        workers = [i for i in usable if i > 0]
        if not workers:
            return fallback
        layer = costmodel.ConvLayer(entry.name, entry.shape, entry.need_input_grad)
        flops = layer.step_passes * entry.shape.flops_forward

        def model_node(i: int) -> costmodel.Node:
            node = self.nodes[i]
            gflops = flops / max(node.probe_seconds.get(entry.name, seconds[i]), 1e-9) / 1e9
            if node.client is None:  # the master: its port is at least as fast as any link
                link = max(self.nodes[j].link_bytes_per_second for j in workers)
                return costmodel.Node(node.name, gflops, bytes_per_s=link)
            return costmodel.Node(
                node.name, gflops, bytes_per_s=node.link_bytes_per_second, rtt_s=node.link_latency
            )

        fastest = max(self.nodes[j].link_bytes_per_second for j in workers)
        model = costmodel.Cluster(
            master=model_node(0),
            workers=tuple(model_node(i) for i in workers),
            # On Wi-Fi every transfer, both ways, shares one medium: as fast as the fastest
            # link measured alone.
            fabric=self.config.network,
            medium_bytes_per_s=fastest,
            master_compute=0 in usable,
        )
        split = link_aware_shares(model, layer)
        if split[0] and not model.master_compute:  # it found no worker worth its link
            return fallback
        shares = [0] * len(self.nodes)
        for i, kernels in zip([0, *workers], split, strict=True):
            shares[i] = kernels
        return shares

    def describe_shares(self) -> str:
        """A table: per node, its device, link, and per layer its probe time and kernels."""
        names = list(self.plans)
        lines = ["kernel shares (probe: forward + backward of the layer's real shape):"]
        for i, node in enumerate(self.nodes):
            link = (
                ""
                if node.client is None
                else f", link {node.link_bytes_per_second / 1e6:.0f} MB/s "
                f"rtt {1e3 * node.link_latency:.1f} ms"
            )
            state = "" if node.state == ACTIVE else f" [{node.state}]"
            parts = []
            for name in names:
                plan = self.plans[name]
                t = node.probe_seconds.get(name, float("inf"))
                off = node.client is None and not self.config.master_compute
                probe = "off" if off or t == float("inf") else f"{1e3 * t:.1f} ms"
                parts.append(f"{name} {plan.shares[i]}/{plan.shape.k} (probe {probe})")
            lines.append(f"  {node.name:<21} {node.description}{link}{state}")
            lines.append(f"  {'':<21} " + ", ".join(parts))
        return "\n".join(lines)

    def close(self) -> None:
        """Stop the monitor and close every channel (cancelling calls in flight, e.g. after
        Ctrl-C)."""
        self._closed.set()
        for node in self.nodes + self._pending:
            if node.client is not None:
                node.client.close()

    # -- membership ------------------------------------------------------------------------

    def _event(self, kind: str, worker: str | None = None, **details) -> None:
        record = {"event": kind, "step": self.step, "time": time.time(), **details}
        if worker is not None:
            record["worker"] = worker
        with self._lock:
            self.events.append(record)
            self._step_events.append(record)
        if self._log is not None:
            text = ", ".join(
                _shares_text(v) if k == "shares" else f"{k} {v}" for k, v in details.items()
            )
            who = f" {worker}" if worker else ""
            tqdm.write(f"[step {self.step}] {kind.replace('_', ' ')}{who}: {text}", file=self._log)

    def _lose(self, node: Node, error: Exception) -> None:
        with self._lock:
            if node.state != ACTIVE:
                return
            node.state = LOST
            node.failures = 0
            node.losses += 1
            node.retry_at = time.monotonic() + self._backoff(node)
            self._failed.add(node.name)
            self._replan_needed = True
        self._event("worker_lost", node.name, reason=str(error))

    def _backoff(self, node: Node) -> float:
        """Seconds until the next attempt: doubling with every failed attempt and every loss."""
        exponent = node.failures + max(node.losses - 1, 0)
        return min(self.config.retry_max, self.config.retry_min * 2.0 ** min(exponent, 30))

    def _watch(self) -> None:
        """Monitor thread: retry lost workers with backoff, connect joiners, re-read the file."""
        next_file_check = 0.0
        while not self._closed.wait(0.2):
            now = time.monotonic()
            if self.config.workers_file and now >= next_file_check:
                next_file_check = now + 1.0
                self._read_workers_file()
            with self._lock:
                due = [
                    n
                    for n in self.nodes[1:] + self._pending
                    if n.state == LOST and n.retry_at <= now
                ]
            for node in due:
                if self._closed.is_set():
                    return
                self._try_rejoin(node)

    def _try_rejoin(self, node: Node) -> None:
        try:
            self._connect(node, timeout=min(2.0, self.config.connect_timeout))
            probes = {entry.name: self._probe(node, entry) for entry in self._layers}
        except Exception as e:  # any failure: try again later, less often
            with self._lock:
                node.failures += 1
                delay = self._backoff(node)
                node.retry_at = time.monotonic() + delay
            if node.failures == 1 or node.failures % 5 == 0:
                self._event(
                    "worker_unreachable", node.name, attempts=node.failures,
                    retry_in=f"{delay:.1f} s", reason=str(e).splitlines()[0][:200],
                )  # fmt: skip
            return
        with self._lock:
            node.probe_seconds.update(probes)
            node.measured.clear()  # it may come back as another machine, or less busy
            node.baseline.clear()
            node.state = READY

    def _workers_file_mtime(self) -> float:
        try:
            return os.stat(self.config.workers_file).st_mtime
        except OSError:
            return 0.0

    def _read_workers_file(self) -> None:
        mtime = self._workers_file_mtime()
        if mtime == self._file_mtime:
            return
        self._file_mtime = mtime
        from hetconv.cli import read_workers_file

        try:
            addresses = read_workers_file(self.config.workers_file)
        except (OSError, ValueError) as e:
            self._event("workers_file_unreadable", reason=str(e))
            return
        listed = self._listed = set(addresses)
        dropped = []
        with self._lock:
            for node in list(self._pending):  # joiners not admitted yet simply go
                if node.name not in listed:
                    self._pending.remove(node)
                    dropped.append(node)
            for node in self.nodes[1:]:
                # Only workers the file named can leave through it: --worker ones stay. A
                # worker named again before its step boundary stays too.
                node.leaving = node.name not in listed and node.name not in self._fixed
            known = {n.name for n in self.nodes + self._pending}
            for address in addresses:
                if address not in known:
                    node = Node(address, self._client(address), state=LOST, joined=True)
                    node.retry_at = 0.0
                    self._pending.append(node)
                    known.add(address)
        for node in dropped:
            node.client.close()
            self._event("worker_removed", node.name, reason="removed from the workers file")

    def begin_step(self, step: int) -> None:
        """Start a training step: admit workers that came (back), re-plan if the membership
        changed; calls until the next step belong to ``step``."""
        self.step = step
        self._records = {}
        self._comm = self._conv = self._wall = 0.0
        self._failed = set()
        admitted = []
        with self._lock:
            leaving = [n for n in self.nodes[1:] if n.leaving]
            for node in leaving:
                self.nodes.remove(node)
                node.client.close()
            for node in self.nodes[1:]:
                if node.state == READY:
                    node.state = ACTIVE
                    admitted.append((node, "worker_rejoined"))
            for node in list(self._pending):
                if node.state == READY:
                    node.state = ACTIVE
                    self._pending.remove(node)
                    self.nodes.append(node)
                    admitted.append((node, "worker_joined"))
            changed = self._replan_needed or bool(admitted) or bool(leaving)
            self._replan_needed = False
        for node in leaving:
            self._event("worker_removed", node.name, reason="removed from the workers file")
        for node, kind in admitted:
            self._event(kind, node.name, device=node.description)
        reason = "membership"
        every = self.config.rebalance_every
        if not changed and every and step > 0 and step % every == 0:
            drifted = self._drifted()
            if drifted:
                changed, reason = True, f"measured speeds ({drifted})"
        if changed:
            before = {name: plan.shares for name, plan in self.plans.items()}
            self._replan()
            shares = {
                name: {n.name: plan.shares[i] for i, n in enumerate(self.nodes)}
                for name, plan in self.plans.items()
            }
            if before != {name: plan.shares for name, plan in self.plans.items()}:
                self._forget_speeds()
                self._event("shares_changed", shares=shares, reason=reason)

    def _measure(self) -> None:
        """Keep the compute seconds of this step's calls, per node and layer (forward +
        backward). Steps in which a node failed are left out: the master's figures then
        include recomputed slices."""
        if not self.config.rebalance_every or self._failed:
            return
        if self._warming:  # the first step on new shares: connections, caches, allocations
            self._warming = False
            return
        for node in self.nodes:
            for layer, figures in self._records.get(node.name, {}).items():
                if "forward" not in figures or "backward" not in figures:
                    continue
                seconds = figures["forward"]["compute_seconds"]
                seconds += figures["backward"]["compute_seconds"]
                window = node.measured.setdefault(
                    layer, collections.deque(maxlen=self.config.rebalance_every)
                )
                window.append(seconds)

    def _drifted(self) -> str:
        """Scale the figures of every active node whose speed has changed by
        ``rebalance_change`` or more; a short description of what changed ('' if nothing).

        A node's speed is compared with itself at the same share: the median compute of the
        first period after the shares were planned is its baseline per layer, and each later
        period's median is compared with that. (Comparing with the probe instead would not
        do: a smaller share costs more per kernel, since the input's lowering does not shrink
        with it, and the shares would feed on that.) A machine that gets busy slows down on
        every layer, so a node's factor is the geometric mean over its layers: one noisy
        layer does not move it.
        """
        least = max(3, self.config.rebalance_every // 2)
        drifted = []
        with self._lock:
            for node in self.nodes:
                if node.state != ACTIVE:
                    continue
                ratios = []
                for layer, window in node.measured.items():
                    if len(window) < least or layer not in node.probe_seconds:
                        continue
                    seen = statistics.median(window)
                    window.clear()
                    baseline = node.baseline.setdefault(layer, seen)
                    ratios.append(seen / max(baseline, 1e-12))
                if not ratios:
                    continue
                factor = float(np.exp(np.mean(np.log(np.maximum(ratios, 1e-12)))))
                if abs(factor - 1) >= self.config.rebalance_change:
                    for layer in node.probe_seconds:
                        node.probe_seconds[layer] *= factor
                    drifted.append(f"{node.name} x{factor:.2f}")
        return ", ".join(drifted)

    def _forget_speeds(self) -> None:
        """New shares: measurements so far were made at the old ones."""
        self._warming = True
        for node in self.nodes + self._pending:
            node.measured.clear()
            node.baseline.clear()

    def end_step(self) -> dict:
        """This step's trace fields: per node and layer what moved and took how long, the
        totals of the distributed calls (``cluster_wall_seconds`` = comm + conv), and the
        membership events since the last step."""
        with self._lock:
            events, self._step_events = self._step_events, []
        record = {
            "comm_seconds": self._comm,
            "conv_seconds": self._conv,
            "cluster_wall_seconds": self._wall,
            "nodes": self._records,
        }
        if events:
            record["events"] = events
        self._measure()
        return record

    # -- dispatch --------------------------------------------------------------------------

    def _deadline(self, node: Node, layer: str, share: int, nbytes: int, images: int) -> float:
        """Seconds a call may take: a floor plus a multiple of what probe and link predict."""
        plan = self.plans[layer]
        t = node.probe_seconds.get(layer, 0.0)
        compute = t * share / max(plan.shape.k, 1) * images / max(plan.shape.n, 1)
        transfer = nbytes / node.link_bytes_per_second + node.link_latency
        return self.config.deadline_floor + self.config.deadline_factor * (compute + transfer)

    def _record(self, node: Node, layer: str, phase: str, share: int, stats: CallStats) -> None:
        per_layer = self._records.setdefault(node.name, {}).setdefault(layer, {"kernels": share})
        per_layer[phase] = _phase_record(stats)

    def _plan(self, layer: str, x_shape, w_shape, padding: PaddingSpec) -> LayerPlan:
        plan = self.plans.get(layer)
        k = w_shape[0]
        if plan is None or plan.shape.k != k or plan.shape.c != x_shape[1]:
            # A layer the probe did not see: split by the nodes' mean speed on the others.
            speeds = []
            for node in self.nodes:
                times = list(node.probe_seconds.values())
                usable = node.state == ACTIVE and (
                    node.client is not None or self.config.master_compute
                )
                speeds.append(float(np.mean(times)) if times and usable else float("inf"))
            if all(np.isinf(speeds)):
                speeds[0] = 1.0
            shares = kernel_shares(k, speeds)
            n, c, h, w = x_shape
            shape = ConvShape(
                n, c, h, w, k, w_shape[2], w_shape[3], Padding.resolve(padding, w_shape[2:])
            )
            plan = LayerPlan(shape, tuple(shares), tuple(offsets(shares)))
            self.plans[layer] = plan
        return plan

    def _worker_slices(self, plan: LayerPlan):
        """(node, kernels, first kernel, kernel slice) of every worker with a share."""
        for i, node in enumerate(self.nodes[1:], start=1):
            share, first = plan.shares[i], plan.starts[i]
            if share:
                yield node, share, first, slice(first, first + share)

    def _gather(self, futures: list[tuple[Node, int, slice, _Call]]):
        """Wait for every worker call; (successes, failed slices). A failed worker is lost."""
        done, failed = [], []
        for node, share, sl, future in futures:
            try:
                done.append((node, share, future.result()))
            except Exception as e:  # WorkerError, or anything else a broken answer raises
                self._lose(node, e)
                failed.append(sl)
        return done, failed

    def _account(self, wall: float, computes: list[float]) -> None:
        conv = max(computes, default=0.0)
        self._conv += conv
        self._comm += max(wall - conv, 0.0)
        self._wall += wall

    def forward(self, layer, x, w, b, padding):
        start = time.perf_counter()
        plan = self._plan(layer, x.shape, w.shape, padding)
        sides = _sides(padding, w.shape[2:])
        ho = x.shape[2] + sides[0] + sides[1] - w.shape[2] + 1
        wo = x.shape[3] + sides[2] + sides[3] - w.shape[3] + 1
        y = np.empty((x.shape[0], w.shape[0], ho, wo), np.float32)
        futures, local = [], []
        for node, share, first, sl in self._worker_slices(plan):
            if node.state != ACTIVE or node.name in self._failed:
                local.append(sl)  # lost earlier in this step: the master covers it
                continue
            nbytes = x.nbytes + w[sl].nbytes + y[:, sl].nbytes
            future = _Call(
                node.client.forward,
                self.session, self.step, layer, x, w[sl], b[sl], sides, out=y[:, sl],
                timeout=self._deadline(node, layer, share, nbytes, x.shape[0]),
                kernel_offset=first,
            )  # fmt: skip
            futures.append((node, share, sl, future))
        t0 = time.perf_counter()
        if plan.shares[0]:
            mine = slice(0, plan.shares[0])
            y[:, mine] = self.backend.conv_forward(x, w[mine], b[mine], sides)
        master_seconds = time.perf_counter() - t0
        done, failed = self._gather(futures)
        t0 = time.perf_counter()
        for sl in local + failed:
            y[:, sl] = self.backend.conv_forward(x, w[sl], b[sl], sides)
        master_seconds += time.perf_counter() - t0
        computes = [master_seconds]
        if plan.shares[0] or local or failed:
            covered = plan.shares[0] + sum(s.stop - s.start for s in local + failed)
            stats = CallStats(compute_seconds=master_seconds)
            self._record(self.nodes[0], layer, "forward", covered, stats)
        for node, share, (_, stats) in done:
            computes.append(stats.compute_seconds)
            self._record(node, layer, "forward", share, stats)
        self._account(time.perf_counter() - start, computes)
        return y

    def _local_backward(self, x, w, dy, sides, sl, need_input_grad):
        dy_part = np.ascontiguousarray(dy[:, sl])
        dw, db = self.backend.conv_grad_kernels(x, dy_part, w.shape[2:], sides)
        dx = None
        if need_input_grad:
            dx = self.backend.conv_grad_input(dy_part, w[sl], x.shape[2:], sides)
        return dx, dw, db

    def backward(self, layer, x, w, dy, padding, need_input_grad):
        start = time.perf_counter()
        plan = self._plan(layer, x.shape, w.shape, padding)
        sides = _sides(padding, w.shape[2:])
        dw = np.empty_like(w)
        db = np.empty(w.shape[0], np.float32)
        dx_bytes = x.nbytes if need_input_grad else 0
        futures, local = [], []
        for node, share, first, sl in self._worker_slices(plan):
            if node.state != ACTIVE or node.name in self._failed:
                local.append(sl)
                continue
            future = _Call(
                node.client.backward,
                self.session, self.step, layer, dy[:, sl], need_input_grad,
                dw_out=dw[sl], db_out=db[sl],
                timeout=self._deadline(
                    node, layer, share, dy[:, sl].nbytes + dw[sl].nbytes + dx_bytes, x.shape[0]
                ),
                kernel_offset=first, answer_bytes=dw[sl].nbytes + db[sl].nbytes + dx_bytes,
            )  # fmt: skip
            futures.append((node, share, sl, future))
        dx = None
        t0 = time.perf_counter()
        if plan.shares[0]:
            mine = slice(0, plan.shares[0])
            dx, dw[mine], db[mine] = self._local_backward(x, w, dy, sides, mine, need_input_grad)
        master_seconds = time.perf_counter() - t0
        done, failed = self._gather(futures)
        t0 = time.perf_counter()
        for sl in local + failed:
            part, dw[sl], db[sl] = self._local_backward(x, w, dy, sides, sl, need_input_grad)
            if need_input_grad:
                dx = part if dx is None else dx + part
        master_seconds += time.perf_counter() - t0
        computes = [master_seconds]
        if plan.shares[0] or local or failed:
            covered = plan.shares[0] + sum(s.stop - s.start for s in local + failed)
            stats = CallStats(compute_seconds=master_seconds)
            self._record(self.nodes[0], layer, "backward", covered, stats)
        for node, share, (dx_part, _, _, stats) in done:
            computes.append(stats.compute_seconds)
            self._record(node, layer, "backward", share, stats)
            if need_input_grad:
                dx = dx_part if dx is None else dx + dx_part
        self._account(time.perf_counter() - start, computes)
        return dx, dw, db

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def shares_summary(cluster: Cluster) -> dict:
    """Per layer, the kernels of each node (for the trace's first record and the console)."""
    return {
        name: {node.name: plan.shares[i] for i, node in enumerate(cluster.nodes)}
        for name, plan in cluster.plans.items()
    }


__all__ = ["MASTER", "Cluster", "ClusterConfig", "LayerPlan", "Node", "shares_summary"]
