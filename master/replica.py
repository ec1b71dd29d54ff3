"""The master's side of a replicated first block (:mod:`hetconv.replica`): the block computed
here on every kernel, what each step sends the workers, and their gradient parts summed.

The cluster computes the block's convolution itself (:meth:`ReplicatedBlocks.forward`), keeps
the step's images and weights as the :class:`~hetconv.replica.ReplicaBlock` the next layer's
stage calls send, and gives that layer's backward a :class:`BlockGradients` the workers' parts
are added into, in node order. The model back-propagates the master's own input-gradient part
through the block's layers as it always does; :meth:`ReplicatedBlocks.backward` then adds the
workers' parts to the kernel gradient of that part.
"""

from __future__ import annotations

import math
import threading
import time

import numpy as np

from hetconv import modetable
from hetconv.backends import Backend
from hetconv.replica import REPLICATED, ReplicaBlock
from hetconv.stages import stage_backward, stage_forward

from .split_step import SplitStep


class BlockGradients:
    """The workers' parts of a replicated block's kernel and bias gradients in one backward:
    each piece answers into buffers of its own, added up in the order the pieces are taken.

    With ``chain`` (the model's own back-propagation through the block's layers after its
    convolution, :meth:`ReplicatedBlocks.hold_chain`), the master back-propagates its own
    input-gradient part through the whole block while the workers still compute
    (:meth:`back_through`, called by the layer's backward job between its own piece and the
    workers' answers), instead of after them: its part of the block's gradients is then
    :attr:`master`."""

    def __init__(self, block: ReplicaBlock, chain=None, backend: Backend | None = None):
        self.block = block
        self.dw = np.zeros_like(block.w)
        self.db = np.zeros_like(block.b)
        self._parts: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.parts = 0  # pieces taken
        self._chain, self._backend = chain, backend
        self.master: tuple[np.ndarray, np.ndarray] | None = None  # (dw, db) of the master's part
        self.seconds = 0.0  # the master's block backward, in the phase (its convolution's part)
        self.answered: list[str] = []  # the workers whose parts were taken, in order

    @property
    def split(self) -> SplitStep | None:
        """The block split by images this step (:class:`SplitStep`), or None."""
        return self.block.split

    def rows_first(self, piece_index: int) -> list:
        """``rows_first`` for the stage backward of piece ``piece_index`` computed here: with
        the master a peer of the split, its own piece's (0) rows of the workers' images go to
        them first (:meth:`SplitStep.rows_first`); else none."""
        split = self.split
        if piece_index or split is None or not split.with_master or self.master is not None:
            return []
        return split.rows_first()

    def lost(self, address: str, dx: np.ndarray) -> bool:
        """A worker of the split lost: its slice's input gradient ``dx`` (computed here) goes
        to the others as it (:meth:`SplitStep.lost_backward`); False (nothing done) when the
        block is not split or ``address`` computed none of it."""
        split = self.split
        if split is None or not split.covers(address):
            return False
        split.lost_backward(address, dx)
        return True

    def later(self, dx: np.ndarray | None) -> np.ndarray | None:
        """What the master back-propagates through its block after its own part: ``dx`` (the
        pieces it covered outside a split), plus a split's rows of lost workers' images."""
        split = self.split
        rows = split.rows(self.answered) if split is not None and not split.with_master else None
        if rows is None:
            return dx
        return rows if dx is None else dx + rows

    def back_through(self, dx: np.ndarray | None) -> bool:
        """Back-propagate the master's input-gradient part ``dx`` through the block now (its
        layers, then its convolution's kernel gradients); False (nothing done) without a
        chain, without ``dx``, or when done already this step. With the master a peer of a
        split block (:meth:`SplitStep.backward_all`) it needs neither: it exchanges rows with
        the workers (zeros for ``dx`` None) and takes its own images through the block."""
        if self.master is not None:
            return False
        split = self.split
        if split is not None and split.with_master:
            start = time.perf_counter()
            self.master = split.backward_all(self._backend, dx)
            self.seconds = time.perf_counter() - start
            return True
        if self._chain is None or dx is None:
            return False
        g = self._chain(dx)
        start = time.perf_counter()
        block = self.block
        self.master = self._backend.conv_grad_kernels(block.x, g, block.w.shape[2:], block.sides)
        self.seconds = time.perf_counter() - start
        return True

    @property
    def nbytes(self) -> int:
        """Bytes one worker answers for it (rw, rb)."""
        return self.block.gradient_bytes

    def request(self, index: int) -> tuple[str, np.ndarray, np.ndarray]:
        """What a worker call for piece ``index`` passes: (block, rw_out, rb_out)."""
        rw, rb = np.empty_like(self.block.w), np.empty_like(self.block.b)
        self._parts[index] = (rw, rb)
        return self.block.layer, rw, rb

    def part(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        return self._parts[index]

    def take(self, index: int, address: str = "") -> None:
        rw, rb = self._parts.pop(index)
        self.dw += rw
        self.db += rb
        self.parts += 1
        self.answered.append(address)


class BlockOutput:
    """A replicated block's output on every image that the master computes only when something
    needs it: the block is left to the workers (:meth:`ReplicatedBlocks.leave`) where the
    master holds no kernel of the layer it feeds, so no piece of the master's reads it. The
    model passes it on as that layer's input; what reads it (a lost worker's piece covered
    here, a spot check, the resident replay log at a sync or recovery) gets the array
    (:meth:`array`, or numpy's conversion), computed then from the step's images and block
    weights, once. ``shape``, ``dtype`` and ``nbytes`` are those of the output."""

    def __init__(self, backend: Backend, block: ReplicaBlock, shape: tuple[int, ...]):
        self.backend, self.block = backend, block
        self.shape, self.dtype = tuple(shape), np.dtype(np.float32)
        self.ndim = len(self.shape)
        self.nbytes = math.prod(self.shape) * self.dtype.itemsize
        self.run = None  # the master's StageRun of it, for this step's backward (computed)
        self._keep_run = True  # until the step's backward is done (:meth:`release`)
        self._y: np.ndarray | None = None
        self._lock = threading.Lock()

    @property
    def computed(self) -> bool:
        return self._y is not None

    def array(self) -> np.ndarray:
        """The block's output, computed here the first time (stage_forward on every kernel,
        as the workers compute it from the same images and weights)."""
        with self._lock:
            if self._y is None:
                block = self.block
                every = slice(0, block.w.shape[0])
                self._y, run = stage_forward(
                    self.backend, block.x, block.w, block.b, block.sides, block.stage, every
                )
                self.run = run if self._keep_run else None  # (a replay needs the output only)
            return self._y

    def release(self) -> None:
        """Drop the StageRun, and keep none computed later (the step's backward is done); the
        output stays for the log."""
        with self._lock:
            self.run, self._keep_run = None, False

    def __array__(self, dtype=None, copy=None):
        y = self.array()
        return y if dtype is None else y.astype(dtype, copy=False)

    def __getitem__(self, index):
        return self.array()[index]


def arrived(x):
    """``x`` as an array: a :class:`BlockOutput`'s output computed (now, if not yet)."""
    return x.array() if isinstance(x, BlockOutput) else x


def input_bytes(x: np.ndarray, replica: ReplicaBlock | None) -> int:
    """Bytes a stage call's input costs a worker: ``x``, or the replicated block's request."""
    return x.nbytes if replica is None else replica.nbytes


def replica_input_grad(dx, x: np.ndarray, replica: BlockGradients | None):
    """A backward's input gradient: with a replicated block, the master's part, zeros when the
    master computed no piece (the model still runs the block's layers back on it); when the
    master's part went back through the block already (:meth:`BlockGradients.back_through`),
    only what came after it (pieces it covered for lost workers), None when nothing did."""
    if replica is not None and dx is None and replica.master is None:
        if isinstance(x, BlockOutput):  # left to the workers: the block's backward adds theirs
            return None
        return np.zeros_like(x)
    return dx


class ReplicatedBlocks:
    """Which block feeds which layer, and the block's current step.

    Args:
        feeds: block layer -> the layer whose input its output is.
        stages: block layer -> its :class:`~hetconv.stages.StageSpec`.
        split: the workers split each block by images (:mod:`hetconv.split`).
    """

    def __init__(
        self,
        feeds: dict[str, str],
        stages: dict[str, object],
        split: bool = False,
        split_all: bool = False,
    ):
        self.feeds = dict(feeds)
        self.stages = dict(stages)
        self.split = split or split_all
        # the master one of the split's peers: the block runs fused here (stage_forward)
        self.split_all = split_all
        self.master_images = True  # split_all: the master computes the block on its share
        self._runs: dict[str, object] = {}  # block -> the master's StageRun on every image
        self.split_refused: str | None = None  # why a split asked for is not made
        # workers left out of the split's exchange at the reach check -> why (they compute
        # the block whole, as with first)
        self.left_out: dict[str, str] = {}
        self.block_of = {consumer: block for block, consumer in self.feeds.items()}
        self._current: dict[str, ReplicaBlock] = {}
        self._gradients: dict[str, BlockGradients] = {}
        self._chains: dict[str, object] = {}
        self._late: dict[str, BlockOutput] = {}  # blocks left to the workers this step

    def hold_chain(self, layer: str, chain) -> None:
        """The model's back-propagation through ``layer``'s block layers after its convolution
        for this step (a callable: stage-output gradient -> convolution-output gradient), so
        that the next layer's backward can run the master's part through the block while the
        workers compute (:class:`BlockGradients`)."""
        if layer in self.feeds:
            self._chains[layer] = chain

    def early_seconds(self, layer: str) -> float:
        """Seconds the master's part of ``layer``'s block convolution took inside the next
        layer's backward this step (0: not taken early)."""
        grads = self._gradients.get(layer)
        return grads.seconds if grads is not None else 0.0

    def taken_early(self, layer: str) -> bool:
        """Whether this step's backward already ran the master's part through ``layer``'s
        block layers (the model then runs them only on what came after)."""
        grads = self._gradients.get(layer)
        return (grads is not None and grads.master is not None) or layer in self._late

    def __contains__(self, layer: str) -> bool:
        return layer in self.feeds

    def begin(self, layer: str, x, w, b, sides, split: SplitStep | None = None) -> ReplicaBlock:
        """The step's block, kept for the next layer's calls (and for starting the workers'
        ReplicaForward ahead of them); ``split``: split by images among the workers."""
        block = ReplicaBlock(layer, x, w.copy(), b.copy(), sides, self.stages[layer], split=split)
        self._current[layer] = block
        self._gradients.pop(layer, None)
        self._chains.pop(layer, None)
        self._late.pop(layer, None)
        return block

    def leave(self, backend: Backend, block: ReplicaBlock, shape) -> BlockOutput:
        """Leave this step's ``block`` to the workers: its output (of ``shape``) is computed
        here only if something reads it (:class:`BlockOutput`), and its backward is the
        workers' parts alone unless the master covered a piece."""
        late = self._late[block.layer] = BlockOutput(backend, block, shape)
        return late

    def late_output(self, layer: str) -> BlockOutput | None:
        """Block ``layer``'s output this step where it is left to the workers, else None."""
        return self._late.get(layer)

    def left(self) -> dict[str, bool]:
        """Block -> whether the master computed its output after all this step, for the blocks
        left to the workers (the trace's ``blocks_left``)."""
        return {layer: late.computed for layer, late in self._late.items()}

    def forward(self, backend: Backend, layer: str, x, w, b, padding, sides) -> np.ndarray:
        """The block's convolution on every kernel, here; the step's block is kept for the
        next layer's calls (:meth:`begin`, unless it was already)."""
        current = self._current.get(layer)
        if current is None or current.x is not x:
            self.begin(layer, x, w, b, sides)
        return backend.conv_forward(x, w, b, padding)

    def stage_forward(self, backend: Backend, block: ReplicaBlock, started: dict, timeout: float):
        """``split_all``: the block's output on every image, the block run here as one fused
        stage (so the model runs none of its layers): split, on the master's own images and
        assembled with the workers' (:meth:`SplitStep.forward_all`); not split this step, on
        every image."""
        if block.split is not None:
            return block.split.forward_all(backend, block, started, timeout)
        k = block.w.shape[0]
        y, self._runs[block.layer] = stage_forward(
            backend, block.x, block.w, block.b, block.sides, block.stage, slice(0, k)
        )
        return y

    def split_of(self, layer: str) -> SplitStep | None:
        """Block ``layer``'s split this step (None: not split, or no step yet)."""
        block = self._current.get(layer)
        return block.split if block is not None else None

    def stage_backward(self, backend: Backend, layer: str, dy: np.ndarray | None):
        """``split_all``: (None, dw, db), the block's kernel and bias gradients: split, the
        master's part (taken in the next layer's backward, :meth:`BlockGradients.back_through`)
        plus what lost workers owe (:meth:`SplitStep.finish_all`); not split, the master's part
        ``dy`` through the block on every image; then the workers' parts."""
        grads = self._gradients.pop(layer, None)
        block = self._current[layer]
        k = block.w.shape[0]
        if block.split is not None:
            if grads is None or grads.master is None:
                raise RuntimeError(f"{layer}: the split block's own part was not taken")
            if dy is not None:
                raise RuntimeError(f"{layer}: a split block got a gradient outside its split")
            dw, db = (np.array(a) for a in grads.master)
            owed = block.split.finish_all(backend, grads.answered)
            if owed is not None:
                dw += owed[0]
                db += owed[1]
        elif layer in self._late:  # left to the workers: theirs, and pieces covered here
            late = self._late[layer]
            if dy is None:
                dw, db = np.zeros_like(block.w), np.zeros_like(block.b)
            else:
                late.array()
                _, dw, db = stage_backward(backend, late.run, dy, slice(0, k), False)
            late.release()
        else:
            run = self._runs.pop(layer, None)
            if run is None or dy is None:
                raise RuntimeError(f"{layer}: the block's backward has no forward or gradient")
            _, dw, db = stage_backward(backend, run, dy, slice(0, k), False)
        if grads is not None:
            dw += grads.dw
            db += grads.db
        return None, dw, db

    def record(self) -> dict:
        """For the plan record: the workers left out of the split's exchange at its reach
        check -> why (``replica_left_out``), where any were."""
        return {"replica_left_out": dict(self.left_out)} if self.left_out else {}

    def images_formats(self) -> dict[str, str]:
        """Block name -> the format its images travel in this step (``palette8``, ``float32``),
        for the trace."""
        return {layer: block.x_format.label for layer, block in self._current.items()}

    def splits(self) -> dict[str, dict]:
        """Block name -> how this step split it by images (:mod:`hetconv.split`): each
        node's images in plan order, and the bytes the master put into workers for ones it
        lost (``covered_bytes``); with the master a peer (``split_all``), its index among them
        (``master``) and the bytes it put and fetched as one (``exchanged_bytes``); the
        seconds its part and rows checks took (``check_seconds``). For the trace."""
        splits = {}
        for layer, block in self._current.items():
            split = block.split
            if split is None:
                continue
            splits[layer] = {
                "images": [count for _, _, count in split.plan.peers],
                "round": split.plan.round,
                "covered_bytes": split.sent_bytes,
                "check_seconds": split.parts_seconds,  # its part and rows checks' (spot checks)
            }
            if split.with_master:  # the master's index in images; what it exchanged as a peer
                splits[layer]["master"] = split.plan.master
                splits[layer]["exchanged_bytes"] = split.exchanged_bytes
        return splits

    def input_of(self, consumer: str) -> ReplicaBlock | None:
        """The replicated block whose output is ``consumer``'s input this step (None: none)."""
        block = self.block_of.get(consumer)
        return None if block is None else self._current.get(block)

    def gradients_for(self, consumer: str, backend: Backend | None = None) -> BlockGradients | None:
        """A fresh sum of the workers' block gradient parts for ``consumer``'s backward; with
        ``backend`` and the model's chain held (:meth:`hold_chain`), one that can take the
        master's part through the block early (:meth:`BlockGradients.back_through`)."""
        block = self.input_of(consumer)
        if block is None:
            return None
        chain = self._chains.get(block.layer) if backend is not None else None
        grads = self._gradients[block.layer] = BlockGradients(block, chain, backend)
        return grads

    def backward(self, backend: Backend, layer: str, x, w, dy, padding, need_input_grad):
        """The block's gradients: the master's part (``dy``, back through the block's layers by
        the model; or taken early, :class:`BlockGradients`, and ``dy`` then what came after it
        or None) plus the workers' parts."""
        if need_input_grad:  # the input gradient would be the master's part only
            raise RuntimeError(f"{layer}: a replicated block must be the network's first layer")
        grads = self._gradients.pop(layer, None)
        early = grads.master if grads is not None else None
        if dy is None and early is None:
            raise RuntimeError(f"{layer}: a replicated block's backward got no gradient")
        if early is None:
            dw, db = backend.conv_grad_kernels(x, dy, w.shape[2:], padding)
        else:
            dw, db = early
            if dy is not None:  # pieces the master covered after its own part went back
                later = backend.conv_grad_kernels(x, dy, w.shape[2:], padding)
                dw += later[0]
                db += later[1]
        if grads is not None:
            dw += grads.dw
            db += grads.db
        return None, dw, db


def block_cost_factor(backend: Backend, first, batch: int, probe_seconds: float) -> float:
    """How many times the replicated block's whole work costs its convolution alone: the block
    (``first``, a :class:`~hetconv.conv.ConvSpec` with its stage) forward and backward to its
    kernel gradients on every kernel, timed here on ``backend`` with random data of ``batch``
    images (best of two), over ``probe_seconds`` (the convolution's probe on this node). Every
    node computes the block whole, its ReLU, LRN and pooling at full resolution included,
    which a probe of the convolution does not time (on the reference networks they cost 2-3x
    the convolution). At least 1; 1 when nothing was probed."""
    if probe_seconds <= 0 or first.stage is None:
        return 1.0
    rng = np.random.default_rng(0)
    c, h, w = first.input_shape
    x = rng.standard_normal((batch, c, h, w), dtype=np.float32)
    kernels = rng.standard_normal(first.weight_shape, dtype=np.float32) * np.float32(0.1)
    bias = np.zeros(first.kernels, np.float32)
    everything = slice(0, first.kernels)
    best = math.inf
    for _ in range(2):
        start = time.perf_counter()
        y, run = stage_forward(backend, x, kernels, bias, first.padding, first.stage, everything)
        stage_backward(backend, run, np.ones_like(y), everything, False)
        best = min(best, time.perf_counter() - start)
    return max(1.0, best / probe_seconds)


def block_seconds(master, node, block: str, consumer: str, factor: float) -> float:
    """``node``'s whole replicated block, forward and backward, in seconds, by the mode
    table's rule (:func:`hetconv.modetable.block_seconds`) on planning nodes' probes:
    the master's probe of the block's convolution times ``factor``
    (:func:`block_cost_factor`: the whole block as timed here at prepare) times how much slower
    ``node`` is than the master on the probe of the layer the block feeds. That long probe,
    not the block convolution's own: a short probe with a large output varies 2x from one run
    to the next with where its memory comes from (paper-500-1500 at batch 64 and a 0.36 cap:
    0.8 s or 1.6 s on equal nodes), the next layer's by a few per cent."""
    probes = (master.probe_seconds, node.probe_seconds)
    return modetable.block_seconds(*probes, block, consumer, factor)


def timed(fn, *args):
    """``fn(*args)`` and the seconds it took."""
    start = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - start


__all__ = [
    "REPLICATED",
    "BlockGradients",
    "BlockOutput",
    "SplitStep",
    "arrived",
    "block_cost_factor",
    "block_seconds",
    "ReplicatedBlocks",
    "input_bytes",
    "replica_input_grad",
    "timed",
]
