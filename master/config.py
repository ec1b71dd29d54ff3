"""The master's settings: how it splits and dispatches every layer (:class:`ClusterConfig`,
what ``hetconv train``'s cluster flags fill in)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hetconv.formats import FLOAT32, TensorFormat
from hetconv.head import HEAD_MODES
from hetconv.head import MASTER as HEAD_MASTER
from hetconv.overlap import OFF as OVERLAP_OFF
from hetconv.overlap import OVERLAP_MODES
from hetconv.replica import MASTER_BLOCK_SHARE, MASTER_BLOCKS, REPLICATE_MODES
from hetconv.replica import OFF as REPLICATE_OFF
from hetconv.replica import SPLITS as REPLICATE_SPLITS
from hetconv.resident import KERNEL_MODES, SENT
from hetconv.stages import STAGE_MODES, UNFUSED

from .planning import AUTO_NETWORK, COMPUTE_POLICY, LINK_POLICY, NETWORKS, SHARE_POLICIES
from .resident import DEFAULT_SYNC_EVERY
from .spotcheck import SpotCheckConfig


@dataclass(frozen=True)
class ClusterConfig:
    """How the master splits and dispatches.

    Args:
        master_compute: whether the master computes a share of every layer itself (it always
            computes the slices of workers that fail).
        probe_repeats: timed probe runs per node and layer (the best counts).
        probe_together: every node probes a layer at the same time, as they compute it in
            training (:func:`~hetconv.master.probing.probe_every`); False: one at a time.
        deadline_floor: seconds every call may take at least.
        deadline_factor: a call's deadline is the floor plus this many times what the probe and
            the measured link predict for it.
        connect_timeout: seconds to wait for the workers to answer at start (all at once;
            those that do not start lost and are retried while training).
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
            port per machine, full duplex; the master's as fast as its fastest worker link),
            ``"wifi"`` (one medium that every transfer, both ways, shares), or ``"auto"``:
            measured at connect (:func:`~.probing.measure_medium`: whether a request and an
            answer in flight at once slow each other, and what every worker at once can
            carry); ``"switched"`` for the ``"compute"`` policy, which reads no links.
        rebalance_every: every this many steps, nodes whose measured compute has drifted from
            their own at the same share earlier get their figures scaled and the kernels are
            split again (0: the split stays as planned, as in the paper, except when workers
            come or go; ignored when ``deterministic``). See :mod:`hetconv.master.rebalancing`.
        rebalance_change: the relative drift that counts: a node's factor (its median compute
            in the last period over its baseline, geometric mean over its layers) at least
            this far from 1.
        settle_steps: after this many steps on the planned shares, move kernels between the
            nodes (the master too) once by their measured finish times, where the probe's
            noise or work the plan does not see split them unequally (0: never; refused with
            ``deterministic``). See :mod:`hetconv.master.settling`.
        token, tls_ca: credentials for the workers (see
            :class:`~hetconv.master.client.WorkerClient`).
        wire_format: the format of activations and their gradients on the wire
            (:mod:`hetconv.formats`): float32 (exact), or float16 / bfloat16 (half the bytes,
            rounded); kernels and their gradients always travel as float32.
        deterministic: no timing decides the split, so runs with the same settings over the
            same workers are bitwise identical: each layer is split equally over the usable
            nodes in node order (or by ``shares`` while they apply), and ``rebalance_every``
            is ignored (never rebalanced). Needs the ``"compute"`` policy.
        stages: ``"fused"``: each node also runs the channel-local layers after a convolution
            on its kernel slice (:mod:`hetconv.stages`) and answers the stage's output;
            ``"unfused"``: only convolutions are distributed (the paper's); ``"auto"``: per
            layer, fused where the cost model counts fewer bytes on the master's link
            (:func:`hetconv.costmodel.stage_mode`). Layers with no channel-local layers after
            them are always unfused.
        kernels: ``"sent"``: every step each node gets its kernel slice and answers its
            gradients; ``"resident"``: workers keep their slices of fused layers and update
            them themselves (:mod:`.resident`); ``"auto"``: per fused layer by the cost model
            (:func:`hetconv.costmodel.kernel_mode`). Unfused layers always send.
        resident_sync_every: steps between syncs of resident slices (the replay log that keeps
            a lost worker's updates is as long as this); 0: only when the log grows too big.
        spot_checks: how often and how much of the workers' answers the master recomputes to
            catch finite but wrong values (:mod:`hetconv.master.spotcheck`); a worker caught
            is lost and never re-admitted in this run.
        replicate: ``"first"``: every node computes the first convolution's block from the
            images itself, so the next layer's input and input gradient do not travel
            (:mod:`hetconv.replica`; where the network allows it); ``"off"``: never;
            ``"auto"``: where the cost model predicts the step faster
            (:func:`hetconv.modetable.replica`); ``"split"``: as first, each worker
            computing the block on its share of the images only, the workers exchanging the
            parts node to node (:mod:`hetconv.split`; not with ``tls_ca``).
        overlap: ``"on"``: every fused layer whose stage holds no batch norm runs its worker
            calls in image groups, each group's output sent while the next computes and each
            group's backward started as soon as its gradient is in (:mod:`hetconv.overlap`);
            ``"off"``: whole batches; ``"auto"``: where a worker's answer is over one
            message (:func:`hetconv.costmodel.overlap_images`).
        head: ``"split"``: where the last fused stage with resident kernels feeds the final
            fully connected layer directly, each node also computes its channels' part of the
            fc's output from the fc's columns it keeps beside its kernels, and answers logits
            instead of the stage's output (:mod:`hetconv.head`; that layer then runs whole
            batches, no overlap); ``"master"``: the fc runs on the master; ``"auto"``: split
            wherever it can be.
        start_ahead: where a replicated block feeds a layer with resident kernels, start
            that layer's stage forward on the workers with the block's ReplicaForward, so they
            go on from the block to the stage while the master computes its own copy and the
            layers after it (``hetconv train --start-ahead``).
        master_block: with ``replicate="split_all"``: ``"share"``, the master computes the
            block on its share of the images (by its speed, as a worker); ``"none"``, on none:
            it fetches every worker's output and sends its input-gradient rows, and computes
            none of the block (``hetconv train --master-block``).
    """

    master_compute: bool = True
    probe_repeats: int = 2
    probe_together: bool = True
    deadline_floor: float = 5.0
    deadline_factor: float = 10.0
    connect_timeout: float = 20.0
    shares: dict[str, tuple[int, ...]] | None = None
    retry_min: float = 0.5
    retry_max: float = 30.0
    workers_file: str | None = None
    share_policy: str = COMPUTE_POLICY
    network: str = AUTO_NETWORK
    rebalance_every: int = 20
    rebalance_change: float = 0.3
    settle_steps: int = 0
    token: str | None = field(default=None, repr=False)  # never in a logged config
    tls_ca: str | None = None
    wire_format: TensorFormat = FLOAT32
    deterministic: bool = False
    stages: str = UNFUSED
    kernels: str = SENT
    resident_sync_every: int = DEFAULT_SYNC_EVERY
    spot_checks: SpotCheckConfig = field(default_factory=SpotCheckConfig)
    replicate: str = REPLICATE_OFF
    overlap: str = OVERLAP_OFF
    head: str = HEAD_MASTER
    start_ahead: bool = True
    master_block: str = MASTER_BLOCK_SHARE

    def transfer_deadline(self, node, nbytes: int) -> float:
        """Seconds a call moving ``nbytes`` over ``node``'s measured link may take."""
        transfer = nbytes / node.link_bytes_per_second + node.link_latency
        return self.deadline_floor + self.deadline_factor * transfer

    def __post_init__(self):
        self._check_modes()
        self._check_ranges()
        self._check_policy()

    def _check_modes(self) -> None:
        if self.master_block not in MASTER_BLOCKS:
            raise ValueError(
                f"master_block {self.master_block!r}; expected one of {', '.join(MASTER_BLOCKS)}"
            )
        if self.head not in HEAD_MODES:
            raise ValueError(f"head {self.head!r}; expected one of {', '.join(HEAD_MODES)}")
        if self.overlap not in OVERLAP_MODES:
            raise ValueError(
                f"overlap {self.overlap!r}; expected one of {', '.join(OVERLAP_MODES)}"
            )
        if self.replicate not in REPLICATE_MODES:
            raise ValueError(
                f"replicate {self.replicate!r}; expected one of {', '.join(REPLICATE_MODES)}"
            )
        if self.replicate in REPLICATE_SPLITS and self.tls_ca is not None:
            raise ValueError(
                f"replicate {self.replicate}: the workers exchange the block's parts over plain "
                "gRPC, which TLS (--tls-ca) would not cover; replicate first instead"
            )
        if self.stages not in STAGE_MODES:
            raise ValueError(f"stages {self.stages!r}; expected one of {', '.join(STAGE_MODES)}")
        if self.kernels not in KERNEL_MODES:
            raise ValueError(f"kernels {self.kernels!r}; expected one of {', '.join(KERNEL_MODES)}")

    def _check_ranges(self) -> None:
        """What the command line's flag types refuse, refused here too."""
        if self.resident_sync_every < 0:
            raise ValueError(
                f"resident sync interval must be >= 0 steps, got {self.resident_sync_every}"
            )
        positive = {
            "probe_repeats": self.probe_repeats,
            "connect_timeout": self.connect_timeout,
            "deadline_floor": self.deadline_floor,
            "deadline_factor": self.deadline_factor,
            "retry_min": self.retry_min,
            "rebalance_change": self.rebalance_change,
        }
        for name, value in positive.items():
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if self.retry_max < self.retry_min:
            raise ValueError(
                f"retry_max ({self.retry_max}) must be at least retry_min ({self.retry_min})"
            )
        for name, value in (("rebalance_every", self.rebalance_every),
                            ("settle_steps", self.settle_steps)):  # fmt: skip
            if value < 0:
                raise ValueError(f"{name} must be >= 0 steps, got {value}")

    def _check_policy(self) -> None:
        if self.share_policy not in SHARE_POLICIES:
            raise ValueError(
                f"share policy {self.share_policy!r} is not one of {', '.join(SHARE_POLICIES)}"
            )
        if self.network not in (AUTO_NETWORK, *NETWORKS):
            raise ValueError(
                f"network {self.network!r} is not one of {', '.join(NETWORKS)} (or {AUTO_NETWORK})"
            )
        if self.deterministic and self.share_policy == LINK_POLICY:
            raise ValueError(
                "--deterministic splits kernels equally, --shares link by measured links: "
                "drop one of them"
            )
        if self.deterministic and self.settle_steps:
            raise ValueError(
                "--deterministic never settles (shares must not follow measured speed): "
                "drop --settle-steps"
            )


__all__ = ["ClusterConfig"]
