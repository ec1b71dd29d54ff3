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
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TextIO

import numpy as np

from hetconv.backends import Backend, ConvShape, Padding, PaddingSpec, get_backend
from hetconv.balance import kernel_shares, offsets
from hetconv.master.client import CallStats, WorkerClient, WorkerError

MASTER = "master"


@dataclass(frozen=True)
class ClusterConfig:
    """How the master splits and dispatches.

    Args:
        master_compute: whether the master computes a share of every layer itself.
        probe_repeats: timed probe runs per node and layer (the best counts).
        deadline_floor: seconds every call may take at least.
        deadline_factor: a call's deadline is the floor plus this many times what the probe and
            the measured link predict for it.
        connect_timeout: seconds to wait for each worker to answer at start.
        shares: layer name -> kernels per node (master first), overriding what the probe gives;
            for experiments and tests.
    """

    master_compute: bool = True
    probe_repeats: int = 2
    deadline_floor: float = 30.0
    deadline_factor: float = 10.0
    connect_timeout: float = 20.0
    shares: dict[str, tuple[int, ...]] | None = None


@dataclass
class Node:
    """The master or one worker, as the cluster sees it."""

    name: str
    client: WorkerClient | None  # None for the master itself
    description: str = ""
    link_bytes_per_second: float = float("inf")  # measured round trip, both directions
    link_latency: float = 0.0
    probe_seconds: dict[str, float] = field(default_factory=dict)  # per layer


@dataclass(frozen=True)
class LayerPlan:
    """How one layer's kernels are split: ``shares[i]`` kernels from ``starts[i]`` on node i."""

    shape: ConvShape
    shares: tuple[int, ...]
    starts: tuple[int, ...]


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
        if not addresses and not self.config.master_compute:
            raise ValueError("no workers and --no-master-compute: nothing would compute")
        self.backend = get_backend(backend) if isinstance(backend, str) else backend
        self.nodes = [Node(MASTER, None)] + [
            Node(a, WorkerClient(a, self.config.connect_timeout)) for a in addresses
        ]
        self.session = secrets.randbits(64)
        self.plans: dict[str, LayerPlan] = {}
        self.step = 0
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(addresses)))
        self._records: dict[str, dict] = {}
        self._comm = self._conv = self._wall = 0.0

    # -- setting up ------------------------------------------------------------------------

    def connect(self) -> None:
        """Ask every worker what it runs on and measure its link; raises WorkerError if one
        cannot be reached."""
        self.nodes[0].description = f"{self.backend.describe().name} ({self.backend.name})"
        link_probe = np.zeros(1 << 18, np.float32)  # 1 MiB
        tiny = np.zeros(1, np.float32)
        for node in self.nodes[1:]:
            d = node.client.describe()
            node.description = f"{d.name} ({d.backend}, {d.cores} cores)"
            node.link_latency = min(
                node.client.echo([("t", tiny)])[1].wall_seconds for _ in range(3)
            )
            seconds = min(node.client.echo([("l", link_probe)])[1].wall_seconds for _ in range(3))
            node.link_bytes_per_second = (
                2 * link_probe.nbytes / max(seconds - node.link_latency, 1e-9)
            )

    def prepare(self, layers, batch: int, log: TextIO | None = None) -> None:
        """Connect, probe every node on every layer's real shape, and set the shares.

        Args:
            layers: the model's :class:`~hetconv.layers.Conv2d` layers, each with ``input_shape``
                (C, H, W) known.
            batch: images per step.
            log: where to print the probe table (None: nowhere).
        """
        self.connect()
        for layer in layers:
            c, h, w = layer.input_shape
            k, _, kh, kw = layer.params["weight"].shape
            shape = ConvShape(batch, c, h, w, k, kh, kw, Padding.resolve(layer.padding, (kh, kw)))
            seconds = []
            for node in self.nodes:
                # One node at a time, so nodes on one machine do not slow each other's probe.
                # The probe does what training does: no input gradient for a first layer.
                if node.client is None:
                    t = (
                        self.backend.time_step(
                            shape, self.config.probe_repeats, layer.need_input_grad
                        )
                        if self.config.master_compute
                        else float("inf")
                    )
                else:
                    t = node.client.probe(shape, self.config.probe_repeats, layer.need_input_grad)
                node.probe_seconds[layer.name] = t
                seconds.append(t)
            shares = kernel_shares(k, seconds)
            if self.config.shares and layer.name in self.config.shares:
                shares = self._check_shares(layer.name, k, self.config.shares[layer.name])
            self.plans[layer.name] = LayerPlan(shape, tuple(shares), tuple(offsets(shares)))
        if log is not None:
            print(self.describe_shares(), file=log)

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
            parts = []
            for name in names:
                plan = self.plans[name]
                t = node.probe_seconds.get(name, float("inf"))
                probe = "off" if t == float("inf") else f"{1e3 * t:.1f} ms"
                parts.append(f"{name} {plan.shares[i]}/{plan.shape.k} (probe {probe})")
            lines.append(f"  {node.name:<21} {node.description}{link}")
            lines.append(f"  {'':<21} " + ", ".join(parts))
        return "\n".join(lines)

    def close(self) -> None:
        """Close every channel (cancelling calls in flight, e.g. after Ctrl-C) and the pool."""
        for node in self.nodes:
            if node.client is not None:
                node.client.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- per step --------------------------------------------------------------------------

    def begin_step(self, step: int) -> None:
        """Start a training step: calls until the next one belong to ``step``."""
        self.step = step
        self._records = {}
        self._comm = self._conv = self._wall = 0.0

    def end_step(self) -> dict:
        """This step's trace fields: per node and layer what moved and took how long, and the
        totals of the distributed calls (``cluster_wall_seconds`` = comm + conv)."""
        return {
            "comm_seconds": self._comm,
            "conv_seconds": self._conv,
            "cluster_wall_seconds": self._wall,
            "nodes": self._records,
        }

    def _deadline(self, node: Node, layer: str, share: int, nbytes: int) -> float:
        """Seconds a call may take: a floor plus a multiple of what probe and link predict."""
        plan = self.plans[layer]
        t = node.probe_seconds.get(layer, 0.0)
        compute = t * share / max(plan.shape.k, 1)
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
                times = [t for t in node.probe_seconds.values()]
                usable = node.client is not None or self.config.master_compute
                speeds.append(float(np.mean(times)) if times and usable else 1.0)
            if not self.config.master_compute:
                speeds[0] = float("inf")
            shares = kernel_shares(k, speeds)
            n, c, h, w = x_shape
            shape = ConvShape(
                n, c, h, w, k, w_shape[2], w_shape[3], Padding.resolve(padding, w_shape[2:])
            )
            plan = LayerPlan(shape, tuple(shares), tuple(offsets(shares)))
            self.plans[layer] = plan
        return plan

    def _finish(self, futures: list[tuple[Node, int, Future]], layer: str, phase: str):
        """Wait for every worker call; raise the first failure after all have ended."""
        results, failure = [], None
        for node, share, future in futures:
            try:
                results.append((node, share, future.result()))
            except WorkerError as e:
                failure = failure or e
        if failure is not None:
            raise failure
        return results

    def _account(self, wall: float, computes: list[float]) -> None:
        conv = max(computes, default=0.0)
        self._conv += conv
        self._comm += max(wall - conv, 0.0)
        self._wall += wall

    def _worker_slices(self, plan: LayerPlan):
        """(node, kernels, first kernel, kernel slice) of every worker with a share."""
        for i, node in enumerate(self.nodes[1:], start=1):
            share, first = plan.shares[i], plan.starts[i]
            if share:
                yield node, share, first, slice(first, first + share)

    def forward(self, layer, x, w, b, padding):
        start = time.perf_counter()
        plan = self._plan(layer, x.shape, w.shape, padding)
        pad = Padding.resolve(padding, w.shape[2:])
        sides = (pad.top, pad.bottom, pad.left, pad.right)
        ho = x.shape[2] + pad.top + pad.bottom - w.shape[2] + 1
        wo = x.shape[3] + pad.left + pad.right - w.shape[3] + 1
        y = np.empty((x.shape[0], w.shape[0], ho, wo), np.float32)
        futures = []
        for node, share, first, sl in self._worker_slices(plan):
            w_part, b_part = w[sl], b[sl]
            nbytes = x.nbytes + w_part.nbytes + y[:, sl].nbytes
            futures.append(
                (
                    node,
                    share,
                    self._pool.submit(
                        node.client.forward,
                        self.session, self.step, layer, x, w_part, b_part, sides,
                        out=y[:, sl], timeout=self._deadline(node, layer, share, nbytes),
                        kernel_offset=first,
                    ),
                )
            )  # fmt: skip
        computes = []
        share = plan.shares[0]
        if share:
            t0 = time.perf_counter()
            y[:, :share] = self.backend.conv_forward(x, w[:share], b[:share], sides)
            seconds = time.perf_counter() - t0
            computes.append(seconds)
            self._record(self.nodes[0], layer, "forward", share, CallStats(compute_seconds=seconds))
        for node, share, (_, stats) in self._finish(futures, layer, "forward"):
            computes.append(stats.compute_seconds)
            self._record(node, layer, "forward", share, stats)
        self._account(time.perf_counter() - start, computes)
        return y

    def backward(self, layer, x, w, dy, padding, need_input_grad):
        start = time.perf_counter()
        plan = self._plan(layer, x.shape, w.shape, padding)
        pad = Padding.resolve(padding, w.shape[2:])
        sides = (pad.top, pad.bottom, pad.left, pad.right)
        dw = np.empty_like(w)
        db = np.empty(w.shape[0], np.float32)
        futures = []
        for node, share, first, sl in self._worker_slices(plan):
            nbytes = dy[:, sl].nbytes + dw[sl].nbytes + (x.nbytes if need_input_grad else 0)
            futures.append(
                (
                    node,
                    share,
                    self._pool.submit(
                        node.client.backward,
                        self.session, self.step, layer, dy[:, sl], need_input_grad,
                        dw_out=dw[sl], db_out=db[sl],
                        timeout=self._deadline(node, layer, share, nbytes), kernel_offset=first,
                        answer_bytes=dw[sl].nbytes + db[sl].nbytes
                        + (x.nbytes if need_input_grad else 0),
                    ),
                )
            )  # fmt: skip
        computes = []
        dx = None
        share = plan.shares[0]
        if share:
            t0 = time.perf_counter()
            dy_part = np.ascontiguousarray(dy[:, :share])
            dw[:share], db[:share] = self.backend.conv_grad_kernels(x, dy_part, w.shape[2:], sides)
            if need_input_grad:
                dx = self.backend.conv_grad_input(dy_part, w[:share], x.shape[2:], sides)
            seconds = time.perf_counter() - t0
            computes.append(seconds)
            self._record(
                self.nodes[0], layer, "backward", share, CallStats(compute_seconds=seconds)
            )
        for node, share, (dx_part, _, _, stats) in self._finish(futures, layer, "backward"):
            computes.append(stats.compute_seconds)
            self._record(node, layer, "backward", share, stats)
            if need_input_grad:
                if dx is None:
                    dx = dx_part
                else:
                    dx += dx_part
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
