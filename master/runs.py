"""One object per layer's way of running on the cluster, chosen once when the cluster prepares.

A model's convolution reaches the cluster as one of four calls (``forward``, ``backward``,
``stage_forward``, ``stage_backward``); :class:`~.cluster.Cluster` looks the layer's
:class:`LayerRun` up and hands the call on. Each way owns its forward and backward jobs and its
per-layer state:

- :class:`KernelSplit` -- the paper's way: the layer's kernels split across the nodes, inputs
  and kernel slices sent every step (:class:`~.dispatch.KernelSplit`).
- :class:`FusedStage` -- the convolution and the channel-local layers after it run on each node's
  kernel slice (:class:`~.dispatch.FusedKernelSplit`); its calls may stream in image groups
  (``overlap_images``: :mod:`hetconv.overlap`).
- :class:`ResidentStage` -- a fused stage whose workers keep their kernel slices between steps
  (:mod:`.resident`); it may compute the final fc too (a split head, :mod:`hetconv.head`) and
  start its forward with the replicated block feeding it (start ahead).
- :class:`ReplicatedBlock` -- the first convolution's block computed by every node (or split by
  images among them, :mod:`hetconv.split`), its output never sent (:mod:`.replica`).

:data:`WAYS` is the mode table: (stage mode, kernel mode) -> the class. A new way of running a
layer is one new class here plus one entry in it. :class:`RunContext` is what every way shares:
the backend, the phase runner, the plans, the step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from hetconv import modetable
from hetconv.backends import Backend, Padding, PaddingSpec, conv_shape
from hetconv.replica import MASTER_BLOCK_NONE
from hetconv.replica import OFF as REPLICATE_OFF
from hetconv.resident import RESIDENT, SENT
from hetconv.split import MASTER as MASTER_PEER
from hetconv.split import SplitPlan, split_images
from hetconv.stages import FUSED, UNFUSED
from hetconv.workload import ConvLayer

from . import modes, probing
from .call import Call
from .config import ClusterConfig
from .dispatch import CallContext, PhaseRunner, SplitStrategy
from .fused import FusedKernelSplit
from .membership import ACTIVE, Membership, Node
from .planning import LINK_POLICY, LayerPlan, Planner, image_fractions
from .replica import REPLICATED, ReplicatedBlocks, timed
from .resident import ResidentKernels
from .split_step import SplitStep


def sides(padding: PaddingSpec, kernel_hw) -> tuple[int, int, int, int]:
    """(top, bottom, left, right) of a layer's padding for its kernel size."""
    p = Padding.resolve(padding, kernel_hw)
    return p.top, p.bottom, p.left, p.right


@dataclass
class RunContext:
    """What every layer's way of running shares: the master's backend, the phase runner over
    the nodes, the share plans and the step. The cluster owns it and sets :attr:`step`,
    :attr:`planner` and :attr:`replicas` as they change; the ways only read them.

    Attributes:
        ran: layer -> the stage mode it ran in this step (the step record's ``stage_modes``).
        started_ahead: layers whose stage forward started with the block feeding them, this
            step (the step record's ``started_ahead``).
    """

    backend: Backend
    runner: PhaseRunner
    session: int
    config: ClusterConfig
    membership: Membership
    resident: ResidentKernels
    strategy: SplitStrategy
    planner: Planner
    replicas: ReplicatedBlocks
    plans: dict[str, LayerPlan] = field(default_factory=dict)
    fused: FusedKernelSplit = field(default_factory=FusedKernelSplit)
    step: int = 0
    ran: dict[str, str] = field(default_factory=dict)
    started_ahead: set[str] = field(default_factory=set)

    @property
    def nodes(self) -> list[Node]:
        return self.membership.nodes

    def plan(self, layer: str, x_shape, w_shape, padding: PaddingSpec) -> LayerPlan:
        """``layer``'s shares; a layer the cluster was not prepared for (or whose shape
        changed) is planned now."""
        plan = self.plans.get(layer)
        if plan is None or plan.shape.k != w_shape[0] or plan.shape.c != x_shape[1]:
            plan = self.planner.plan_unseen(self.nodes, x_shape, w_shape, padding)
            self.plans[layer] = plan
        return plan

    def deadline(self, work_seconds: float) -> float:
        """A call's deadline for ``work_seconds`` of predicted transfer and compute."""
        return self.config.deadline_floor + self.config.deadline_factor * work_seconds


class KernelSplit:
    """The paper's way: the kernels split across the nodes by the layer's shares; each node
    gets the same inputs and its kernel slice, every step.

    Attributes:
        name: the layer.
        stage_mode: how the model runs the layer (:meth:`~.cluster.Cluster.stage_mode`).
        kernels: where its kernels live between steps (``sent``: with the master).
    """

    stage_mode = UNFUSED
    kernels = SENT

    def __init__(self, ctx: RunContext, name: str):
        self.ctx, self.name = ctx, name

    #: images per group of its stage calls (0: one call each): see :class:`FusedStage`
    overlap_images = 0
    #: the final fc it computes on the nodes, (fc name, classes), or None
    head: tuple[str, int] | None = None

    @property
    def model_mode(self) -> str:
        """How the model runs the layer (:meth:`~.cluster.Cluster.stage_mode`)."""
        return self.stage_mode

    def forward(self, x, w, b, padding):
        ctx = self.ctx
        plan = ctx.plan(self.name, x.shape, w.shape, padding)
        ctx.ran.setdefault(self.name, UNFUSED)
        call = CallContext(ctx.session, ctx.step, self.name)
        job = ctx.strategy.forward(call, ctx.backend, x, w, b, sides(padding, w.shape[2:]))
        return ctx.runner.run(ctx.strategy, job, self.name, plan)

    def backward(self, x, w, dy, padding, need_input_grad):
        ctx = self.ctx
        plan = ctx.plan(self.name, x.shape, w.shape, padding)
        call = CallContext(ctx.session, ctx.step, self.name)
        at = sides(padding, w.shape[2:])
        job = ctx.strategy.backward(call, ctx.backend, x, w, dy, at, need_input_grad)
        return ctx.runner.run(ctx.strategy, job, self.name, plan)

    def stage_forward(self, x, w, b, padding, stage, batchnorm=(), head=None):
        raise RuntimeError(f"{self.name} runs unfused: the cluster runs no stage of it")

    def stage_backward(self, x, w, b, dy, padding, need_input_grad, stage, batchnorm=(), head=None):
        raise RuntimeError(f"{self.name} runs unfused: the cluster runs no stage of it")

    def start_ahead(self, block) -> None:
        """Start this layer's stage forward with the replicated ``block`` feeding it (only a
        resident stage can: :class:`ResidentStage`)."""


class FusedStage(KernelSplit):
    """The convolution and the channel-local layers after it on each node's kernel slice,
    kernels sent each step; its calls stream in groups of :attr:`overlap_images` images where
    that is set."""

    stage_mode = FUSED

    def __init__(self, ctx: RunContext, name: str, overlap_images: int = 0):
        super().__init__(ctx, name)
        self.overlap_images = overlap_images

    def _call(self, x) -> CallContext:
        """A stage call's context: its image groups where the layer overlaps (both phases
        alike, so a grouped forward's backward streams too)."""
        images = self.overlap_images if x.shape[0] > 1 else 0
        return CallContext(self.ctx.session, self.ctx.step, self.name, images)

    def _check_head(self, head) -> None:
        if (head is not None) != (self.head is not None):
            planned = "with" if self.head is not None else "without"
            raise RuntimeError(
                f"{self.name}: called {'with' if head is not None else 'without'} a split head, "
                f"but the cluster planned it {planned}"
            )

    def stage_forward(self, x, w, b, padding, stage, batchnorm=(), head=None):
        ctx = self.ctx
        plan = ctx.plan(self.name, x.shape, w.shape, padding)
        ctx.ran[self.name] = FUSED
        self._check_head(head)
        replica = ctx.replicas.input_of(self.name)
        at = sides(padding, w.shape[2:])
        job = ctx.fused.forward(self._call(x), ctx.backend, x, w, b, at, stage, batchnorm, replica)
        return ctx.runner.run(ctx.fused, job, self.name, plan)

    def stage_backward(self, x, w, b, dy, padding, need_input_grad, stage, batchnorm=(), head=None):
        ctx = self.ctx
        plan = ctx.plan(self.name, x.shape, w.shape, padding)
        self._check_head(head)
        job = ctx.fused.backward(
            self._call(x), ctx.backend, x, w, dy, sides(padding, w.shape[2:]), need_input_grad,
            b=b, stage=stage, batchnorm=batchnorm,
            replica=ctx.replicas.gradients_for(self.name, ctx.backend),
        )  # fmt: skip
        return ctx.runner.run(ctx.fused, job, self.name, plan)


class ResidentStage(FusedStage):
    """A fused stage whose workers keep their kernel slices and momentum between steps and
    update them themselves (:mod:`.resident`); with :attr:`head` it computes the final fc on
    the nodes too."""

    kernels = RESIDENT

    def __init__(self, ctx: RunContext, name: str, overlap_images: int = 0, head=None):
        super().__init__(ctx, name, overlap_images)
        self.head = head
        ctx.resident.spot_checks = ctx.runner.spot_checks  # a sync replays a sample of a slice
        # its stage forward started with the block feeding it: (step, input placeholder, call)
        self._ahead: tuple | None = None

    def start_ahead(self, block) -> None:
        """Start this layer's stage forward on the workers now, with the replicated
        ``block``'s ReplicaForward, when its kernels are placed: a worker needs nothing of the
        master for it (its input is the block it computes, its kernels its own), so it goes on
        from the block to the stage while the master computes its own block and the layers
        after it. :meth:`stage_forward` finishes the phase."""
        ctx = self.ctx
        state = ctx.resident.layers.get(self.name)
        plan = ctx.plans.get(self.name)
        self._ahead = None
        if not ctx.config.start_ahead or state is None or plan is None:
            return
        x = ctx.replicas.late_output(block.layer)  # left to the workers: never filled here
        if x is None:
            conv = conv_shape(block.x.shape, block.w.shape, block.sides)
            x = np.empty((conv.n, conv.k, *block.stage.output_hw(conv.out_hw)), np.float32)
        split = ctx.resident.split
        synced = ctx.resident.arrange(state, split.pieces(plan, ctx.nodes), ctx.step)
        job = ctx.resident.forward_job(self._call(x), state, x, synced=synced, replica=block)
        self._ahead = (ctx.step, x, ctx.runner.start(split, job, self.name, plan))

    def stage_forward(self, x, w, b, padding, stage, batchnorm=(), head=None):
        ctx = self.ctx
        plan = ctx.plan(self.name, x.shape, w.shape, padding)
        ctx.ran[self.name] = FUSED
        self._check_head(head)
        at = sides(padding, w.shape[2:])
        state = ctx.resident.layer(self.name, w, b, stage, at, head, batchnorm)
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == ctx.step and ahead[1].shape == x.shape:
            _, placeholder, started = ahead
            if placeholder is not x:  # (the block left to the workers: its output is x)
                placeholder[...] = x
                started.job.input_arrived()
            ctx.started_ahead.add(self.name)
            return ctx.runner.finish(started)
        split = ctx.resident.split
        # Spot checks can sample this layer when every slice was just placed or synced.
        synced = ctx.resident.arrange(state, split.pieces(plan, ctx.nodes), ctx.step)
        replica = ctx.replicas.input_of(self.name)
        job = ctx.resident.forward_job(self._call(x), state, x, synced=synced, replica=replica)
        return ctx.runner.run(split, job, self.name, plan)

    def stage_backward(self, x, w, b, dy, padding, need_input_grad, stage, batchnorm=(), head=None):
        ctx = self.ctx
        plan = ctx.plan(self.name, x.shape, w.shape, padding)
        self._check_head(head)
        at = sides(padding, w.shape[2:])
        state = ctx.resident.layer(self.name, w, b, stage, at, head, batchnorm)
        replica = ctx.replicas.gradients_for(self.name, ctx.backend)
        job = ctx.resident.backward_job(self._call(x), state, x, dy, need_input_grad, replica)
        return ctx.runner.run(ctx.resident.split, job, self.name, plan)


class ReplicatedBlock(KernelSplit):
    """The first convolution's block computed on every node (:mod:`.replica`): the master
    computes it whole (or its share of the images, ``split_all``), the workers with a share of
    the layer it feeds compute it beside it from the images alone, so the next layer's input
    is never sent. Split by images among the workers where ``split`` is set
    (:mod:`hetconv.split`).

    Args:
        consumer: the way of running of the layer the block feeds.
        block_cost: what the whole block costs over its convolution's probe.
    """

    stage_mode = REPLICATED

    def __init__(self, ctx: RunContext, name: str, consumer: KernelSplit, block_cost: float):
        super().__init__(ctx, name)
        self.consumer, self.block_cost = consumer, block_cost
        self._rounds = 0  # split blocks so far (hetconv.split: SplitPlan.round)

    @property
    def model_mode(self) -> str:
        """How the model runs the block: fused where the master is a peer of its split (the
        block is then one stage here too) or leaves it to the workers (:meth:`leaves`), else
        as its layers."""
        return FUSED if self.ctx.replicas.split_all or self.leaves() else REPLICATED

    def leaves(self) -> bool:
        """Whether this step's block is left to the workers (:meth:`ReplicatedBlocks.leave`):
        the master holds no kernel of the layer it feeds, which keeps its kernels on the
        workers (resident), and some active worker does; not split by images, no batch norm
        in it. The master then computes the block only where something reads its output (a
        piece it covers, a check, a replay): with a GPU worker and a CPU master, its copy of
        a wide first block (ReLU, LRN, pooling at full resolution) was most of the step."""
        ctx = self.ctx
        if ctx.replicas.split or not isinstance(self.consumer, ResidentStage):
            return False
        stage = ctx.replicas.stages.get(self.name)
        if stage is None or any(op.kind == "batchnorm" for op in stage.ops):
            return False
        plan = ctx.plans.get(self.consumer.name)
        return plan is not None and not plan.shares[0] and bool(self._workers())

    def _workers(self) -> list[Node]:
        """The active workers with a share of the layer the block feeds: those that compute
        the block this step."""
        plan = self.ctx.plans.get(self.consumer.name)
        if plan is None:
            return []
        return [
            node for i, node in enumerate(self.ctx.nodes)
            if i and node.state == ACTIVE and plan.shares[i]
        ]  # fmt: skip

    def _split_step(self, images: int) -> SplitStep | None:
        """This step's split of the block by images among its workers (and the master, with
        ``split_all``), in proportion to their speed on the layer it feeds; None when not
        split, or fewer than two nodes (or images) share it."""
        ctx, replicas = self.ctx, self.ctx.replicas
        workers = self._workers() if replicas.split else []
        # a worker that failed the reach check computes the block whole (its call: no plan)
        workers = [n for n in workers if n.client.address not in replicas.left_out]
        addresses = [n.client.address for n in workers]
        if replicas.split_all and workers:
            workers, addresses = [ctx.nodes[0], *workers], [MASTER_PEER, *addresses]
        if len(workers) < 2 or images < len(workers) or len(set(addresses)) < len(addresses):
            return None
        consumer = self.consumer.name

        def fractions(nodes) -> list[float]:  # --deterministic: equal, no timing decides them
            if ctx.config.deterministic:
                return [1.0] * len(nodes)
            return image_fractions([n.probe_seconds.get(consumer, 0.0) for n in nodes])

        if replicas.split_all and ctx.config.master_block == MASTER_BLOCK_NONE:
            counts = [0, *split_images(images, fractions(workers[1:]))]  # the master: none
        else:
            counts = split_images(images, fractions(workers))
        self._rounds += 1
        plan = SplitPlan.of(addresses, counts, self._rounds)
        clients = {n.client.address: n.client for n in workers if n.client is not None}
        return SplitStep(plan, clients, ctx.session, ctx.step, self.name)

    def _start_replicas(self, block) -> None:
        """Start the step's ReplicaForward on every active worker with a share of the layer the
        block feeds, now, so the workers compute the block while the master computes its own
        copy and the layers after it; the stage calls wait for them (a failure is theirs)."""
        ctx = self.ctx
        plan = ctx.plans.get(self.consumer.name)
        if plan is None:
            return
        for i, node in enumerate(ctx.nodes):
            if not i or node.state != ACTIVE or not plan.shares[i]:
                continue
            transfer = block.nbytes / node.link_bytes_per_second + node.link_latency
            work = node.probe_seconds.get(self.name, 0.0)
            split = block.split.plan if block.split is not None else None
            if split is not None and node.client.address not in split.addresses:
                split = None  # left out of the exchange: the whole block, as with first
            block.started[node.client.address] = Call(
                node.client.replica_forward, ctx.session, ctx.step, block,
                ctx.deadline(transfer + work), split,
            )  # fmt: skip

    def _begin(self, x, w, b, padding, leave: bool = False):
        """The step's block (split by images where it is) and the workers' ReplicaForward
        calls started on it, the next layer's stage forward started ahead with them: (block,
        address -> its ReplicaForward call, taken before the stage calls take them).
        ``leave``: the block is left to the workers (:meth:`leaves`)."""
        self.ctx.ran[self.name] = REPLICATED
        at = sides(padding, w.shape[2:])
        block = self.ctx.replicas.begin(self.name, x, w, b, at, self._split_step(x.shape[0]))
        if leave:
            conv = conv_shape(x.shape, w.shape, at)
            shape = (conv.n, conv.k, *block.stage.output_hw(conv.out_hw))
            self.ctx.replicas.leave(self.ctx.backend, block, shape)
        self._start_replicas(block)  # the workers compute it beside the master
        started = dict(block.started)
        self.consumer.start_ahead(block)  # and go on to the next layer's stage
        return block, started

    def forward(self, x, w, b, padding):
        ctx = self.ctx
        block, _ = self._begin(x, w, b, padding)
        y, seconds = timed(
            ctx.replicas.forward, ctx.backend, self.name, x, w, b, padding, block.sides
        )
        ctx.runner.local(self.name, "forward", w.shape[0], seconds)
        return y

    def backward(self, x, w, dy, padding, need_input_grad):
        ctx = self.ctx
        earlier = ctx.replicas.early_seconds(self.name)  # in the next layer's phase
        args = (ctx.backend, self.name, x, w, dy, padding, need_input_grad)
        out, seconds = timed(ctx.replicas.backward, *args)
        ctx.runner.local(self.name, "backward", w.shape[0], seconds, earlier)
        return out

    def stage_forward(self, x, w, b, padding, stage, batchnorm=(), head=None):
        """The block split with the master a peer (``split_all``) as one fused stage: the
        workers start it on their images (and the next layer's stage ahead), the master
        computes its own images and exchanges parts with them."""
        ctx = self.ctx
        if not ctx.replicas.split_all:  # fused here only when left to the workers
            block, _ = self._begin(x, w, b, padding, leave=True)
            ctx.runner.local(self.name, "forward", w.shape[0], 0.0)
            return ctx.replicas.late_output(self.name)
        block, started = self._begin(x, w, b, padding)
        slowest = max((n.probe_seconds.get(self.name, 0.0) for n in ctx.nodes), default=0.0)
        timeout = ctx.deadline(slowest * self.block_cost)  # the whole block, on every image
        y, seconds = timed(ctx.replicas.stage_forward, ctx.backend, block, started, timeout)
        split = block.split
        compute = split.compute["forward"] if split is not None else None
        ctx.runner.local(self.name, "forward", w.shape[0], seconds, compute=compute)
        return y

    def stage_backward(self, x, w, b, dy, padding, need_input_grad, stage, batchnorm=(), head=None):
        ctx = self.ctx
        earlier = ctx.replicas.early_seconds(self.name)  # in the next layer's phase
        split = ctx.replicas.split_of(self.name)
        out, seconds = timed(ctx.replicas.stage_backward, ctx.backend, self.name, dy)
        compute = split.compute["backward"] if split is not None else None
        ctx.runner.local(self.name, "backward", w.shape[0], seconds, earlier, compute)
        return out


#: The mode table: (stage mode, kernel mode) -> how such a layer runs. A replicated block is
#: built apart (it needs the way of the layer it feeds).
WAYS: dict[tuple[str, str], type[KernelSplit]] = {
    (UNFUSED, SENT): KernelSplit,
    (FUSED, SENT): FusedStage,
    (FUSED, RESIDENT): ResidentStage,
}


def build_runs(
    ctx: RunContext,
    stage_modes: dict[str, str],
    kernel_modes: dict[str, str],
    overlap: dict[str, int],
    heads: dict[str, tuple[str, int]],
    block_cost: dict[str, float],
) -> dict[str, KernelSplit]:
    """Each prepared layer's way of running, from the modes the cluster chose: layer -> its
    stage mode (fused, unfused or replicated), its kernel mode, images per group of its stage
    calls, the fc it computes (name, classes), and a replicated block's cost factor."""
    runs: dict[str, KernelSplit] = {}
    for name, mode in stage_modes.items():
        if mode == REPLICATED:
            continue
        way = WAYS[(mode, kernel_modes.get(name, SENT) if mode == FUSED else SENT)]
        if way is ResidentStage:
            runs[name] = ResidentStage(ctx, name, overlap.get(name, 0), heads.get(name))
        elif way is FusedStage:
            runs[name] = FusedStage(ctx, name, overlap.get(name, 0))
        else:
            runs[name] = way(ctx, name)
    for block, consumer in ctx.replicas.feeds.items():
        runs[block] = ReplicatedBlock(ctx, block, runs[consumer], block_cost.get(block, 1.0))
    return {name: runs[name] for name in stage_modes}  # in the model's order


def check_reach(blocks: ReplicatedBlocks, workers: Sequence[Node]) -> None:
    """A split block's reach check at start (:func:`.probing.split_reach`): every worker is
    asked whether it reaches the others at the addresses this master uses; one that does not
    (or does not answer) is left out of the exchange (``blocks.left_out``) and computes the
    block whole, as with ``first``. With the master a peer (``split_all``) the split is then
    among the workers only (the master covers a lost whole-block worker from its whole block);
    with fewer than two workers left it is not split."""
    left = probing.split_reach(workers) if len(workers) >= 2 else {}
    blocks.left_out = left
    if not left:
        return
    if len(workers) - len(left) < 2:
        blocks.split = blocks.split_all = False
        blocks.split_refused = "not split: fewer than two workers reach each other"
    elif blocks.split_all:
        blocks.split_all = False
        blocks.split_refused = "split among the workers only: a worker is left out"


def kept_kernels_first(config, layers) -> frozenset[str]:
    """The layers the first plan of ``--shares link`` prices as keeping their kernels on the
    workers: every one that may (a stage after it, stride 1) where ``--kernels`` and
    ``--stages`` let the modes keep them, so a split is judged as the modes ``auto`` reaches
    would run it. Priced with kernels sent, paper-150-800 at batch 16 on the scaled
    testbed's shared medium was a near-tie: one run split conv2 (then fused, resident and
    replicated: 2.27x the master alone), the next, its master's probe 8 % faster, kept it
    whole (then unfused: 1.0x)."""
    if config.kernels == SENT or config.stages == UNFUSED or config.share_policy != LINK_POLICY:
        return frozenset()
    return frozenset(s.name for s in layers if s.stage is not None and tuple(s.stride) == (1, 1))


def plan_first(cluster, layers) -> None:
    """The cluster's first shares, kernels priced as kept where the modes may keep them
    (:func:`kept_kernels_first`); :func:`choose_runs` then plans again with its modes."""
    c, first = cluster.config, kept_kernels_first(cluster.config, layers)
    replicas = {}
    if first and layers and c.replicate != REPLICATE_OFF:  # a block auto may replicate
        block = ConvLayer.from_spec(layers[0], 1)  # (its bytes do not matter)
        if modetable.replica_refusal(block, FUSED) is None:
            replicas = {block.feeds: block.name}
    cluster.planner = dataclasses.replace(cluster.planner, resident=first, replicas=replicas)
    cluster.replan()


def choose_runs(cluster, layers, batch: int) -> dict[str, KernelSplit]:
    """Each layer's way of running, from the modes :mod:`.modes` chooses for the
    ``cluster`` at prepare, in turn: the stage modes, whether the first block replicates, the
    kernel modes, the split head; then the shares planned again knowing what each layer's
    calls move, overlap judged on those shares, and the shares planned again with its
    groups."""
    c, plans, nodes = cluster.config, cluster.plans, cluster.nodes
    stage_modes = modes.stage_modes(c, layers, batch, plans, nodes)
    wifi = cluster.planner.network == "wifi"
    choice = modes.replica(c, layers, batch, stage_modes, plans, nodes, cluster.backend, wifi)
    cluster.replica_refused = choice.refused
    if choice.blocks is not None:
        if choice.blocks.split:
            check_reach(choice.blocks, [n for n in nodes[1:] if n.state == ACTIVE])
        cluster.ctx.replicas = choice.blocks
        stage_modes[layers[0].name] = REPLICATED
    kernel_modes = modes.kernel_modes(c, layers, batch, stage_modes, plans, nodes)
    cluster.resident.no_bias = frozenset(spec.name for spec in layers if not spec.bias)
    head = modes.heads(c, layers, kernel_modes)
    cluster.head_refused = head.refused
    resident = frozenset(name for name, mode in kernel_modes.items() if mode == RESIDENT)
    consumers = {consumer: block for block, consumer in cluster.replicas.feeds.items()}
    if resident or consumers or cluster.planner.resident or cluster.planner.replicas:
        cluster.planner = dataclasses.replace(
            cluster.planner, resident=resident, replicas=consumers, heads=dict(head.heads),
            block_cost=dict(choice.block_cost), split_blocks=cluster.replicas.split,
            split_master=cluster.replicas.split_all,
            master_images=c.master_block != MASTER_BLOCK_NONE,
        )  # fmt: skip
        cluster.replan()
    overlap = modes.overlap_images(c, layers, batch, stage_modes, head.heads, plans, nodes)
    if overlap:
        cluster.planner = dataclasses.replace(cluster.planner, overlap=dict(overlap))
        cluster.replan()
    heads = {name: (head.fcs[name], classes) for name, classes in head.heads.items()}
    return build_runs(cluster.ctx, stage_modes, kernel_modes, overlap, heads, choice.block_cost)


__all__ = [
    "choose_runs",
    "kept_kernels_first",
    "plan_first",
    "WAYS",
    "FusedStage",
    "KernelSplit",
    "ReplicatedBlock",
    "ResidentStage",
    "RunContext",
    "build_runs",
    "sides",
]
