"""The master's cluster: splits every convolution's kernels across workers and itself.

It implements :class:`~hetconv.conv.ConvExecutor`, so a model trains on it unchanged. This
module is a small facade over the rooms that do the work: :mod:`.config` (the settings),
:mod:`.membership` (nodes, states, the monitor thread, the workers file), :mod:`.probing`
(devices, links, probes), :mod:`.planning` (shares), :mod:`.modes` (how each layer runs),
:mod:`.rebalancing` (the drift monitor), :mod:`.dispatch` (one phase runner over a split
strategy) and :mod:`.events`.

Forward: every node gets the same inputs and its slice of the kernels (and biases); the feature
maps come back straight into their channel slice of the output. Backward: every node gets its
slice of the output gradient and returns its kernels' gradients (written into their slice) and,
except for a network's first layer, its part of the input gradient, which the master sums.
Workers keep the forward inputs and kernels for the backward call of the same step, so backward
sends only the gradient slice. Requests to all workers go out concurrently; the master computes
its own share meanwhile.

With fused stages (``ClusterConfig.stages``, ``hetconv train --stages``) a layer followed by
channel-local layers (ReLU, LRN, max-pool) runs them on the nodes too: each node computes its
kernels widened by the stage's halo, runs the layers and answers its owned kernels' pooled maps;
backward sends the pooled-map gradient of its owned and halo channels
(:class:`~.dispatch.FusedKernelSplit`, :mod:`hetconv.stages`). ``auto`` picks per layer by the
cost model's bytes; the plan record and every step record say how each layer ran.

With resident kernels (``ClusterConfig.kernels``, ``hetconv train --kernels``) a fused layer's
workers keep their kernel slices and momentum between steps and update them themselves; only
halo kernels go out and edge kernels come back, slices move when the shares change, and a lost
worker's slice is replayed on the master from its last sync (:mod:`.resident`). The plan and
step records say each layer's ``kernel_modes``; step records hold what placements and syncs
moved under ``resident``.

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
planned again. A worker left with no kernel of any layer is probed again now and then, so it
can earn work back (:class:`~.rebalancing.IdleProbes`).

A *deterministic* cluster (``deterministic=True``, ``hetconv train --deterministic``) makes two
runs with the same settings over the same workers bitwise identical: no timing decides a share
(each layer is split equally over the usable nodes in node order, or by the configured
``shares``), nothing is rebalanced on measured speed, and the input-gradient parts are summed
in a fixed order (the master's own part, the pieces it covers, then the workers' in node order,
whichever answers first; see :mod:`.dispatch`). Membership still changes the split: a worker
lost mid-run has its slice computed by the master and the next steps split without it.

A worker that cannot be reached when training starts does not stop it: it starts lost (event
``worker_lost``) and the monitor retries it like any lost worker, so it joins when it comes up;
only when nothing could compute (no worker reached and ``master_compute`` off) does the start
fail. A token the worker refuses or a failed TLS handshake still stops the start: no retry fixes
a configuration. One worker process named under two addresses (its Describe's ``instance_id``
twice) is refused at start, naming both: each address would get its own share of every layer,
so the user surely meant two machines, or made a typo; merging them silently would train on
fewer workers than the command line says.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Sequence
from typing import TextIO

from hetconv.backends import Backend, get_backend
from hetconv.conv import ConvExecutor
from hetconv.optim import SGDConfig
from hetconv.resident import RESIDENT
from hetconv.stages import FUSED, UNFUSED

from . import connecting, modes, probing, records, runs
from .client import WorkerClient
from .config import ClusterConfig
from .dispatch import KernelSplit as KernelSplitStrategy
from .dispatch import PhaseRunner, SplitStrategy
from .events import EventLog
from .membership import ACTIVE, ALIAS, LOST, MASTER, READY, Membership, Node, NodeState
from .planning import (
    AUTO_NETWORK,
    LINK_POLICY,
    NETWORKS,
    SHARE_POLICIES,
    LayerPlan,
    PlannedLayer,
    Planner,
    check_shares,
)
from .rebalancing import DriftMonitor, IdleProbes, replan_reason
from .replica import ReplicatedBlocks
from .resident import ResidentKernels
from .runs import RunContext
from .settling import SettleMonitor
from .spotcheck import SpotChecker


class Cluster(ConvExecutor):
    """A :class:`~hetconv.conv.ConvExecutor` over the master and its workers.

    Args:
        addresses: workers as ``HOST:PORT``.
        backend: the master's own backend (a name or instance).
        config: dispatch settings.
        strategy: how each layer is cut (:class:`~hetconv.master.dispatch.KernelSplit`).
    """

    def __init__(
        self,
        addresses: Sequence[str],
        backend: Backend | str = "cpu",
        config: ClusterConfig | None = None,
        strategy: SplitStrategy | None = None,
    ):
        if len(set(addresses)) != len(addresses):
            raise ValueError(f"a worker is named twice in {list(addresses)}")
        self.config = c = config or ClusterConfig()
        # Deterministic: measured speeds never move the split.
        self.drift = DriftMonitor(0 if c.deterministic else c.rebalance_every, c.rebalance_change)
        self.settling = SettleMonitor(0 if c.deterministic else c.settle_steps)
        network = "switched" if c.network == AUTO_NETWORK else c.network  # until measured
        planner = Planner(
            c.master_compute, c.share_policy, network, fixed=c.shares,
            deterministic=c.deterministic, stages=c.stages,
        )  # fmt: skip
        self.medium: probing.Medium | None = None
        if not addresses and not c.master_compute and not c.workers_file:
            raise ValueError("no workers and --no-master-compute: nothing would compute")
        self.backend = get_backend(backend) if isinstance(backend, str) else backend
        self._events = EventLog()
        self.membership = Membership(
            [Node(MASTER, None)] + [Node(a, self._client(a)) for a in addresses],
            fixed=set(addresses),
            events=self._events,
            make_client=self._client,
            reconnect=self._reconnect,
            retry_min=c.retry_min,
            retry_max=c.retry_max,
            workers_file=c.workers_file,
        )
        self.idle = IdleProbes(self.drift.every, self._reconnect, self.membership, self._events)
        self.spot_checks = SpotChecker(c.spot_checks) if c.spot_checks.every else None
        self.runner = PhaseRunner(
            self.membership, c.deadline_floor, c.deadline_factor, self.spot_checks
        )
        self.session = secrets.randbits(64)
        self.head_refused: str | None = None
        self.replica_refused: str | None = None
        self.resident = ResidentKernels(
            self.session, self.backend, self.membership, c.transfer_deadline,
            sync_every=c.resident_sync_every,
        )  # fmt: skip
        # What every layer's way of running shares (runs.RunContext), and each prepared
        # layer's way (runs.build_runs, at prepare); a layer not prepared runs by the default.
        self.ctx = RunContext(
            self.backend, self.runner, self.session, c, self.membership, self.resident,
            strategy or KernelSplitStrategy(), planner, ReplicatedBlocks({}, {}),
        )  # fmt: skip
        self.runs: dict[str, runs.KernelSplit] = {}
        self._unseen: dict[str, runs.KernelSplit] = {}
        self.step = 0
        self._layers: list[PlannedLayer] = []

    @property
    def nodes(self) -> list[Node]:
        """The master, then every worker in the cluster (active or lost)."""
        return self.membership.nodes

    @property
    def wire_format(self) -> str:
        """The format of activations and their gradients on the wire (its label)."""
        return self.config.wire_format.label

    @property
    def _pending(self) -> list[Node]:
        return self.membership.pending

    @property
    def planned_layers(self) -> list[PlannedLayer]:
        """The prepared convolutions, as probed and planned."""
        return self._layers

    @property
    def events(self) -> list[dict]:
        """Everything that happened to the membership and the shares, in order."""
        return self._events.events

    def _client(self, address: str) -> WorkerClient:
        credentials = {}
        if self.config.token:
            credentials["token"] = self.config.token
        if self.config.tls_ca:
            credentials["tls_ca"] = self.config.tls_ca
        return WorkerClient(
            address, self.config.connect_timeout, wire_format=self.config.wire_format, **credentials
        )

    # -- setting up ------------------------------------------------------------------------

    def _reconnect(self, node: Node) -> dict[str, float]:
        """A lost or joining worker: connect, probe every layer (the monitor thread). Raises
        :class:`~.membership.WorkerAlias` before probing a member's worker process again."""
        connecting.connect(node, self.config, timeout=min(2.0, self.config.connect_timeout))
        self.membership.check_alias(node)
        probes = probing.probe_all(node, self._layers, self.backend, self.config.probe_repeats)
        self.drift.forget_node(node.name)  # it may come back as another machine, or less busy
        return probes

    def connect(self) -> None:
        """Ask every worker what it runs on and measure its link (:mod:`.connecting`). A
        worker that does not answer in ``connect_timeout`` starts lost (event
        ``worker_lost``; the monitor retries it). With ``network`` auto and link shares, the
        planner then assumes the medium measured.

        Raises:
            WorkerAuthError, WorkerTLSError: a worker refused the token, or its TLS handshake
                failed (configuration, which no retry fixes).
            ValueError: two addresses reach one worker process.
            RuntimeError: no worker answered and the master does not compute.
        """
        c = self.config
        probing.describe_master(self.nodes[0], self.backend)
        workers = self.nodes[1:]
        unreachable = connecting.reach_workers(workers, c)
        if c.network == AUTO_NETWORK and c.share_policy == LINK_POLICY:
            reached = [n for n in workers if n.name not in unreachable]
            self.medium = connecting.measure_medium(reached, c, self._events.emit)
            if self.medium is not None:
                self.planner = dataclasses.replace(
                    self.planner,
                    network=self.medium.network,
                    capacity=self.medium.capacity_bytes_per_s,
                )
        if len(unreachable) == len(workers) and workers and not c.master_compute:
            reasons = "; ".join(str(e) for e in unreachable.values())
            raise RuntimeError(
                f"no worker could be reached and the master does not compute "
                f"(--no-master-compute): nothing would compute. {reasons}"
            )
        for node in workers:
            if node.name in unreachable:
                node.description = "not reached yet"
                self.membership.lose(node, unreachable[node.name], at_start=True)

    def prepare(self, layers, batch: int, log: TextIO | None = None) -> None:
        """Connect, probe every node on every layer's real shape, set the shares, and start
        watching for lost and new workers.

        Args:
            layers: the model's convolutions (:meth:`~hetconv.model.Model.conv_specs`).
            batch: images per step.
            log: where to print the probe table and membership events (None: nowhere).
        """
        self._events.console = log
        c = self.config
        if log is not None and len(self.nodes) > 1:
            count = len(self.nodes) - 1
            s = "s" if count != 1 else ""
            print(f"connecting to {count} worker{s} (device, link) ...", file=log, flush=True)
        self.connect()
        self._layers = probing.planned_layers(layers, batch)
        probing.probe_every(self.nodes, self._layers, self.backend, c.probe_repeats, log,
                            c.probe_together, self.known_probes)  # fmt: skip
        for name, shares in (self.config.shares or {}).items():
            layer = next((e for e in self._layers if e.name == name), None)
            if layer is not None:
                check_shares(
                    name, layer.shape.k, shares, len(self.nodes), self.config.master_compute
                )
        runs.plan_first(self, layers)
        self.runs = runs.choose_runs(self, layers, batch)
        self.membership.read_initial_workers_file()
        if log is not None:
            print(records.describe_plan(self), file=log)
        self.membership.start_monitor()

    supports_stages = True
    supports_head = True
    distributed = True
    known_probes: dict[str, dict[str, float]] = {}  # probes made already (probe_every's known)

    def run_of(self, layer: str) -> runs.KernelSplit:
        """``layer``'s way of running; a layer the cluster was not prepared for runs fused
        where the configuration says fused, else split by kernels (sent)."""
        run = self.runs.get(layer) or self._unseen.get(layer)
        if run is None:
            way = runs.FusedStage if self.config.stages == FUSED else runs.KernelSplit
            run = self._unseen[layer] = way(self.ctx, layer)
        return run

    # -- what the ways chose, by layer (views of self.runs) ----------------------------------

    @property
    def planner(self) -> Planner:
        return self.ctx.planner

    @planner.setter
    def planner(self, planner: Planner) -> None:
        self.ctx.planner = planner

    @property
    def plans(self) -> dict[str, LayerPlan]:
        """Layer -> its shares over the nodes."""
        return self.ctx.plans

    @property
    def replicas(self) -> ReplicatedBlocks:
        """The replicated first block, if any (:mod:`.replica`)."""
        return self.ctx.replicas

    @property
    def stage_modes(self) -> dict[str, str]:
        """Layer -> fused, unfused or replicated."""
        return {name: run.stage_mode for name, run in self.runs.items()}

    @property
    def kernel_modes(self) -> dict[str, str]:
        """Layer -> resident or sent."""
        return {name: run.kernels for name, run in self.runs.items()}

    @property
    def heads(self) -> dict[str, int]:
        """Layer -> classes of the final fc its stage computes on the nodes (hetconv.head)."""
        return {name: run.head[1] for name, run in self.runs.items() if run.head}

    @property
    def head_fcs(self) -> dict[str, str]:
        """Layer -> the name of the fc its stage computes on the nodes."""
        return {name: run.head[0] for name, run in self.runs.items() if run.head}

    @property
    def overlap_images(self) -> dict[str, int]:
        """Fused layer -> images per group of its worker calls (hetconv.overlap)."""
        return {name: run.overlap_images for name, run in self.runs.items() if run.overlap_images}

    @property
    def block_cost(self) -> dict[str, float]:
        """Replicated block -> its whole work over its convolution's probe."""
        return {
            name: run.block_cost
            for name, run in self.runs.items()
            if isinstance(run, runs.ReplicatedBlock)
        }

    def head_split(self, layer: str) -> bool:
        """Whether ``layer``'s stage computes the final fc's logits on the nodes."""
        return layer in self.runs and self.runs[layer].head is not None

    def hold_block_backward(self, layer: str, chain) -> None:
        """The model's back-propagation through ``layer``'s block layers after its convolution,
        this step: with ``layer`` replicated (:mod:`hetconv.replica`), the next layer's
        backward runs the master's part through the block while the workers compute."""
        self.replicas.hold_chain(layer, chain)

    def block_backward_taken(self, layer: str) -> bool:
        """Whether this step's master part already went back through ``layer``'s block layers
        (the model then runs them only on what came after, and calls the convolution's
        backward with that, or None)."""
        return self.replicas.taken_early(layer)

    def describe_head(self) -> str:
        """One line: which stage computes the fc on the nodes, or why none does."""
        return records.describe_head(self)

    def describe_overlap(self) -> str:
        """One line: which fused layers run their calls in image groups, of how many."""
        return modes.describe_overlap(self.overlap_images)

    def describe_replica(self) -> str:
        """One line: which block is replicated into which layer, or why none is."""
        return modes.describe_replica(self.replicas, self.block_cost, self.replica_refused)

    def resident_layers(self) -> list[str]:
        """The layers whose kernels live on the workers (the master's optimizer must skip
        their weights and biases: :meth:`attach_optimizer` updates them)."""
        return [name for name, mode in self.kernel_modes.items() if mode == RESIDENT]

    def resident_parameters(self) -> list[str]:
        """The parameters the workers keep and update (the master's optimizer skips them):
        the resident layers' weights and biases, and a split head's fc weight."""
        names = [f"{name}.{key}" for name in self.resident_layers() for key in ("weight", "bias")]
        return names + [f"{fc}.weight" for fc in self.head_fcs.values()]

    def attach_optimizer(self, sgd: SGDConfig) -> None:
        """The optimizer settings resident layers are updated with (before the first step)."""
        self.resident.sgd = sgd

    def gather_resident(self) -> dict:
        """Fetch every resident slice into the model's arrays (for a checkpoint or
        ``--save``); returns the resident layers' momentum buffers by parameter name."""
        return self.resident.gather()

    def load_resident_momentum(self, momentum: dict) -> None:
        """Momentum buffers of resident layers, from a checkpoint (by parameter name)."""
        self.resident.load_momentum(momentum)

    def stage_mode(self, layer: str) -> str:
        """``"fused"`` or ``"unfused"``: whether ``layer`` runs with its stage on the nodes."""
        run = self.runs.get(layer)
        if run is None:
            return FUSED if self.config.stages == FUSED else UNFUSED
        return run.model_mode

    def replan(self) -> None:
        """Shares of every layer over the active nodes (called between steps)."""
        everyone = self.membership.everyone_started_is_active()
        self.plans.update(self.planner.plan(self.nodes, self._layers, everyone))

    def describe_shares(self) -> str:
        """A table: per node, its device, link, and per layer its probe time and kernels."""
        return records.describe_shares(self)

    def predict_step(
        self, comp_alone_s: float, comp_s: float, spec=None, chains_s=None
    ) -> dict | None:
        """The cost model's step for the plan and modes chosen against the master alone's; under
        :data:`.records.KEEP_GAIN`, every kernel kept on the master (:mod:`.records`)."""
        return records.predict_or_keep(self, comp_alone_s, comp_s, spec, chains_s)

    def plan_record(self) -> dict:
        """The plan as data for the trace's first record (:func:`.records.plan_record`)."""
        return records.plan_record(self) | self.replicas.record()

    def close(self) -> None:
        """Stop the monitor and close every channel (cancelling calls in flight, e.g. after
        Ctrl-C)."""
        self.membership.close()

    # -- steps -----------------------------------------------------------------------------

    def begin_step(self, step: int) -> None:
        """Start a training step: admit workers that came (back), re-plan if the membership
        changed; calls until the next step belong to ``step``."""
        self.step = self.ctx.step = self._events.step = step
        self.runner.start_step()
        self.resident.start_step()
        if self.spot_checks is not None:
            self.spot_checks.start_step(step)
        came_or_went = self.membership.admit().changed
        monitors = (self.drift, self.settling)
        reason = replan_reason(came_or_went, *monitors, self.nodes, self.plans, step, self.idle)
        if reason is not None:
            before = {name: plan.shares for name, plan in self.plans.items()}
            self.replan()
            if before != {name: plan.shares for name, plan in self.plans.items()}:
                self.drift.forget()
                self.settling.forget()
                shares = {
                    name: {n.name: plan.shares[i] for i, n in enumerate(self.nodes)}
                    for name, plan in self.plans.items()
                }
                self._events.emit("shares_changed", reason=reason, shares=shares)

    def redo_step(self) -> bool:
        """Whether the step's forward and backward must be computed again: a spot check caught
        a worker in it since the last call. Its answers that passed their checks earlier in the
        step (whose wrong values were not sampled) are in what the step computed; the worker
        is out now, so a second pass computes the step without it."""
        redo = bool(self.spot_checks is not None and self.spot_checks.take_caught())
        if redo:  # the first pass updated resident kernels: back to where the step began
            self.resident.undo_step(self.step)
        return redo

    def end_step(self) -> dict:
        """This step's trace fields (:func:`.records.step_record`, and ``idle``: workers with
        no kernel, probed again when due); the drift and settling monitors observe its calls."""
        idle = self.idle.watch(self.step, self.plans)  # (its events belong to this step)
        record = {**records.step_record(self, self._events.take_step_events()), **idle}
        self.ctx.ran, self.ctx.started_ahead = {}, set()
        self.drift.observe(self.runner.records, bool(self.membership.failed))
        self.settling.observe(self.runner.records, bool(self.membership.failed))
        return record

    # -- the calls of a ConvExecutor: each goes to the layer's way of running (.runs) -----

    def forward(self, layer, x, w, b, padding):
        return self.run_of(layer).forward(x, w, b, padding)

    def backward(self, layer, x, w, dy, padding, need_input_grad):
        return self.run_of(layer).backward(x, w, dy, padding, need_input_grad)

    def stage_forward(self, layer, x, w, b, padding, stage, batchnorm=(), head=None):
        """A fused stage's forward over the nodes. ``batchnorm``: the model's batch norm
        layers of the stage, whose running statistics it moves (training). ``head``: the final
        fc's (name, weight) where :meth:`head_split` says so; the answer is then its output
        without the bias."""
        return self.run_of(layer).stage_forward(x, w, b, padding, stage, batchnorm, head)

    def stage_backward(
        self, layer, x, w, b, dy, padding, need_input_grad, stage, batchnorm=(), head=None
    ):
        """A fused stage's backward over the nodes; sets the batch norm layers' ``grads``.
        ``head``: as :meth:`stage_forward`'s (``dy`` is then the logits' gradient, and the
        answer holds a fourth array, the fc columns' gradient of the rows the master
        computed, (C, P, classes))."""
        run = self.run_of(layer)
        return run.stage_backward(x, w, b, dy, padding, need_input_grad, stage, batchnorm, head)


__all__ = [
    "ACTIVE",
    "ALIAS",
    "LINK_POLICY",
    "LOST",
    "MASTER",
    "NETWORKS",
    "READY",
    "SHARE_POLICIES",
    "Cluster",
    "ClusterConfig",
    "LayerPlan",
    "Node",
    "NodeState",
]
