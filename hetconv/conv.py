"""Where a model's convolutions run: one seam between the layers and the hardware.

A model's :class:`~hetconv.layers.Conv2d` layers never call a backend directly; they call a
:class:`ConvExecutor`. :class:`LocalConv` runs everything on one backend in this process; the
master's cluster implements the same calls by splitting the kernels across workers. Executors
learn the model's convolutions as :class:`ConvSpec` values (name and geometry, no weights), so
this module needs nothing from the layers.
"""

from __future__ import annotations

import operator
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

import numpy as np

from .backends import Backend, ConvShape, Padding, PaddingSpec, conv_shape, get_backend
from .backends.arrays import array_module


def kernel_pair(kernel_size: int | Sequence[int]) -> tuple[int, int]:
    """(kh, kw) of a kernel size given as one int or two; floats are refused."""
    kh, kw = (kernel_size, kernel_size) if isinstance(kernel_size, int) else kernel_size
    return operator.index(kh), operator.index(kw)


@dataclass(frozen=True)
class StridePhases:
    """A strided convolution as a stride-1 one, so that every executor and backend runs it at
    about a native strided kernel's cost (space-to-depth).

    With stride (sh, sw), kernel tap ``(i, j) = (a * sh + p, b * sw + q)`` of output ``(o, r)``
    reads padded input ``((o + a) * sh + p, (r + b) * sw + q)``. Splitting the padded input
    into its phases ``(p, q)`` -- every sh-th row from row p, every sw-th column from column q
    -- as channels, and the kernels likewise, the strided convolution is the stride-1, unpadded
    convolution of C * ph * pw channels (``ph = min(sh, kh)``: phases no tap reads are left
    out) with kernels of ``ceil(kh / sh) x ceil(kw / sw)`` taps (the taps past the kernel's edge
    zero). Channel ``(c * ph + p) * pw + q``; kernels keep their order, so a kernel split
    splits the phased kernels alike.

    Cost: ``ph * pw * ceil(kh/sh) * ceil(kw/sw)`` multiply-adds per output and input channel
    where a strided kernel has ``kh * kw``: 1.78x for 3x3 stride 2, 1.44x for 5x5, 1.31x for
    7x7, 1x for 1x1 (against 4x for computing every stride-1 output and subsampling).

    Each rearrangement computes in the array module of the array it is given (numpy, or cupy
    on a GPU: :func:`~hetconv.backends.arrays.array_module`), with the same operations.

    Attributes:
        input_shape: the layer's per-sample (C, H, W).
        kernel_size: (kh, kw).
        padding: the layer's padding, resolved.
        stride: (sh, sw).
    """

    input_shape: tuple[int, int, int]
    kernel_size: tuple[int, int]
    padding: Padding
    stride: tuple[int, int]

    @property
    def phases(self) -> tuple[int, int]:
        """(ph, pw): the row and column phases some tap reads."""
        return min(self.stride[0], self.kernel_size[0]), min(self.stride[1], self.kernel_size[1])

    @property
    def taps(self) -> tuple[int, int]:
        """The phased kernels' (kh', kw')."""
        (kh, kw), (sh, sw) = self.kernel_size, self.stride
        return -(-kh // sh), -(-kw // sw)

    @property
    def arithmetic(self) -> float:
        """The phases' multiply-adds over a strided kernel's: 1.78 for 3x3 stride 2, 1 for 1x1."""
        (ph, pw), (th, tw), (kh, kw) = self.phases, self.taps, self.kernel_size
        return ph * pw * th * tw / (kh * kw)

    @property
    def output_hw(self) -> tuple[int, int]:
        """(Ho, Wo): ``floor((H + pads - kh) / s) + 1``, PyTorch's size.

        Raises:
            ValueError: the kernel does not fit the padded input.
        """
        _, h, w = self.input_shape
        p, (kh, kw), (sh, sw) = self.padding, self.kernel_size, self.stride
        hp, wp = h + p.top + p.bottom, w + p.left + p.right
        if hp < kh or wp < kw:
            raise ValueError(f"kernel {kh}x{kw} does not fit input {h}x{w} with padding {p}")
        return (hp - kh) // sh + 1, (wp - kw) // sw + 1

    @property
    def phased_hw(self) -> tuple[int, int]:
        """(Hq, Wq) of each phase: the rows and columns the stride-1 convolution reads."""
        (ho, wo), (th, tw) = self.output_hw, self.taps
        return ho + th - 1, wo + tw - 1

    @property
    def phased_input_shape(self) -> tuple[int, int, int]:
        ph, pw = self.phases
        return (self.input_shape[0] * ph * pw, *self.phased_hw)

    def _blocks(self, a_shape: tuple[int, int], rows: int, cols: int) -> tuple[int, ...]:
        (sh, sw) = self.stride
        return (*a_shape, rows, sh, cols, sw)

    def input(self, x: np.ndarray) -> np.ndarray:
        """float32 (N, C * ph * pw, Hq, Wq) phases of the padded (N, C, H, W) input."""
        n, c, h, w = x.shape
        (hq, wq), (sh, sw), (ph, pw), p = self.phased_hw, self.stride, self.phases, self.padding
        xp = array_module(x)
        padded = xp.zeros((n, c, hq * sh, wq * sw), np.float32)
        rows, cols = min(h, hq * sh - p.top), min(w, wq * sw - p.left)
        padded[:, :, p.top : p.top + rows, p.left : p.left + cols] = x[:, :, :rows, :cols]
        blocks = padded.reshape(n, c, hq, sh, wq, sw)[:, :, :, :ph, :, :pw]
        return xp.ascontiguousarray(blocks.transpose(0, 1, 3, 5, 2, 4)).reshape(
            n, c * ph * pw, hq, wq
        )

    def input_grad(self, dxq: np.ndarray) -> np.ndarray:
        """The (N, C, H, W) input gradient of the phased input's gradient (:meth:`input`'s
        transpose)."""
        n = dxq.shape[0]
        c, h, w = self.input_shape
        (hq, wq), (sh, sw), (ph, pw), p = self.phased_hw, self.stride, self.phases, self.padding
        xp = array_module(dxq)
        padded = xp.zeros((n, c, hq, sh, wq, sw), np.float32)
        padded[:, :, :, :ph, :, :pw] = dxq.reshape(n, c, ph, pw, hq, wq).transpose(0, 1, 4, 2, 5, 3)
        padded = padded.reshape(n, c, hq * sh, wq * sw)
        dx = xp.zeros((n, c, h, w), np.float32)
        rows, cols = min(h, hq * sh - p.top), min(w, wq * sw - p.left)
        dx[:, :, :rows, :cols] = padded[:, :, p.top : p.top + rows, p.left : p.left + cols]
        return dx

    def kernels(self, w: np.ndarray) -> np.ndarray:
        """float32 (K, C * ph * pw, kh', kw') phased kernels of (K, C, kh, kw)."""
        k, c, kh, kw = w.shape
        (th, tw), (sh, sw), (ph, pw) = self.taps, self.stride, self.phases
        xp = array_module(w)
        padded = xp.zeros((k, c, th * sh, tw * sw), np.float32)
        padded[:, :, :kh, :kw] = w
        blocks = padded.reshape(k, c, th, sh, tw, sw)[:, :, :, :ph, :, :pw]
        return xp.ascontiguousarray(blocks.transpose(0, 1, 3, 5, 2, 4)).reshape(
            k, c * ph * pw, th, tw
        )

    def kernel_grad(self, dwq: np.ndarray) -> np.ndarray:
        """The (K, C, kh, kw) kernel gradient of the phased kernels' gradient (the taps past
        the kernel's edge dropped)."""
        k = dwq.shape[0]
        c = self.input_shape[0]
        (kh, kw), (th, tw), (sh, sw), (ph, pw) = (
            self.kernel_size, self.taps, self.stride, self.phases
        )  # fmt: skip
        xp = array_module(dwq)
        padded = xp.zeros((k, c, th, sh, tw, sw), np.float32)
        padded[:, :, :, :ph, :, :pw] = dwq.reshape(k, c, ph, pw, th, tw).transpose(0, 1, 4, 2, 5, 3)
        return xp.ascontiguousarray(padded.reshape(k, c, th * sh, tw * sw)[:, :, :kh, :kw])


@dataclass(frozen=True)
class ConvSpec:
    """One convolution layer as an executor sees it: its name and geometry, no weights.

    Attributes:
        name: the layer's name (the ``layer`` argument of every executor call).
        input_shape: per-sample input (C, H, W).
        kernels: output channels K.
        kernel_size: (kh, kw).
        padding: as the layer passes it to the executor (see :class:`~hetconv.backends.Padding`).
        need_input_grad: False for a layer that reads the network's input (its first):
            nothing consumes that gradient.
        stage: the channel-local layers that follow it along the model's graph, each the only
            reader of the one before and reading nothing else (a
            :class:`hetconv.stages.StageSpec`), which an executor that supports stages may run
            with it on each kernel slice; None when none does. Not compared: it describes what
            follows the convolution, not the convolution.
        stride: (sh, sw). Executors see a strided convolution as :attr:`executed`, the
            stride-1 convolution of its phases (:class:`StridePhases`).
        phased_from: on an :attr:`executed` spec, the stride of the convolution it stands for
            (None: it is the layer's own): its kernels are then a rearranged copy of the
            layer's each step, which an executor must not keep and update in place.
        written: on an :attr:`executed` spec of a strided layer, the layer as the spec wrote it
            (what the console names); None: it is the layer's own. Not compared.
        feeds: the convolution whose input is this layer's stage output, unchanged (no other
            layer between them, and no other layer reading it); None otherwise. Not compared.
        head: (name, classes) of the network's final fully connected layer (its output)
            when this layer's stage output is its input, unchanged, and nothing else's (a
            split head may run it on the stage's kernel slices: :mod:`hetconv.head`); None
            otherwise. Not compared.
        bias: whether the layer has a bias parameter (``"bias": false``: the executor gets a
            zero bias it must never update; kernels kept on the workers keep it fixed at zero:
            :mod:`hetconv.master.resident`). Not compared.
        images_fit: for a network's first layer, whether the images it takes fit the palette8
            format (:meth:`hetconv.data.ImageDataset.palette_fit`, which training sets), which
            they travel in to a replicated first block; the cost model counts float32 bytes
            when they do not. Not compared.
    """

    name: str
    input_shape: tuple[int, int, int]
    kernels: int
    kernel_size: tuple[int, int]
    padding: PaddingSpec = 0
    need_input_grad: bool = True
    stage: Any = field(default=None, compare=False)
    stride: tuple[int, int] = (1, 1)
    phased_from: tuple[int, int] | None = field(default=None, compare=False)
    feeds: str | None = field(default=None, compare=False)
    head: tuple[str, int] | None = field(default=None, compare=False)
    images_fit: bool = field(default=True, compare=False)
    bias: bool = field(default=True, compare=False)
    written: ConvSpec | None = field(default=None, compare=False, repr=False)

    @property
    def weight_shape(self) -> tuple[int, int, int, int]:
        """The kernels' array shape (K, C, kh, kw)."""
        return (self.kernels, self.input_shape[0], *self.kernel_size)

    @property
    def phases(self) -> StridePhases | None:
        """How a strided convolution runs as a stride-1 one; None at stride 1."""
        if self.stride == (1, 1):
            return None
        padding = Padding.resolve(self.padding, self.kernel_size)
        return StridePhases(self.input_shape, self.kernel_size, padding, self.stride)

    @property
    def executed(self) -> ConvSpec:
        """The convolution executors compute: this one at stride 1; a strided one as the
        stride-1, unpadded convolution of its phases (:class:`StridePhases`), same kernels
        count, name and stage."""
        phases = self.phases
        if phases is None:
            return self
        return ConvSpec(
            self.name, phases.phased_input_shape, self.kernels, phases.taps, 0,
            self.need_input_grad, self.stage, phased_from=self.stride, feeds=self.feeds,
            bias=self.bias,
            head=self.head, written=self,
        )  # fmt: skip

    def shape(self, batch: int) -> ConvShape:
        """The geometry of one executor call on ``batch`` images (of :attr:`executed`).

        Raises:
            ValueError: the kernels do not fit the input (or a size is not positive).
        """
        spec = self.executed
        return conv_shape((batch, *spec.input_shape), spec.weight_shape, spec.padding)

    @property
    def output_shape(self) -> tuple[int, int, int]:
        """Per-sample output (K, Ho, Wo); raises ValueError as :meth:`shape` does."""
        return (self.kernels, *self.shape(1).out_hw)


class ConvExecutor:
    """Computes the convolutions of named layers, forward and backward.

    The whole contract a model and a training run use, every hook declared here with what an
    executor that has no such feature does: a subclass overrides the calls it supports, and
    callers call them without probing. :class:`LocalConv` runs everything in this process; the
    master's cluster overrides every hook.
    """

    #: Whether :meth:`stage_forward` and :meth:`stage_backward` run *fused stages*
    #: (:mod:`hetconv.stages`): a convolution and the channel-local layers after it on each
    #: node's kernel slice. A model groups a convolution with its stage only where this is
    #: True, and asks :meth:`stage_mode` per layer whether to run them fused.
    supports_stages: bool = False
    #: Whether a fused stage may also compute the network's final fully connected layer on
    #: its slices (:mod:`hetconv.head`); the model asks :meth:`head_split` per layer.
    supports_head: bool = False
    #: The format of activations and their gradients on the wire (its label).
    wire_format: str = "float32"
    #: Whether the work goes to other processes (a cluster): only then does a training run
    #: time the master's other work to ask :meth:`predict_step`.
    distributed: bool = False
    #: Whether :meth:`forward` and :meth:`backward` take a layer's ``stride`` (keyword, above
    #: 1) and compute the strided convolution itself; where False a strided layer calls them
    #: with its phases at stride 1 (:class:`StridePhases`).
    native_stride: bool = False

    def forward(
        self, layer: str, x: np.ndarray, w: np.ndarray, b: np.ndarray, padding: PaddingSpec
    ) -> np.ndarray:
        """float32 (N, K, Ho, Wo) feature maps of ``x`` (N, C, H, W) with kernels ``w``."""
        raise NotImplementedError

    def backward(
        self,
        layer: str,
        x: np.ndarray,
        w: np.ndarray,
        dy: np.ndarray,
        padding: PaddingSpec,
        need_input_grad: bool,
    ) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
        """(input gradient or None, kernel gradient, bias gradient) for output gradient ``dy``."""
        raise NotImplementedError

    def backward_later(self, layer, x, w, dy, padding, need_input_grad, stride=(1, 1)):
        """:meth:`backward` in two: (the input gradient now, a function giving the kernel and
        bias gradients when called), for a caller with something to wait for meanwhile (a
        batch norm sum among the nodes: :mod:`hetconv.imagesplit`). Here both at once; an
        executor that can computes the kernel gradient when asked, by the same operations."""
        extra = {"stride": stride} if tuple(stride) != (1, 1) else {}
        dx, dw, db = self.backward(layer, x, w, dy, padding, need_input_grad, **extra)
        return dx, lambda: (dw, db)

    def backward_kernels_first(self, layer, x, w, dy, padding, need_input_grad, stride=(1, 1)):
        """:meth:`backward` in two the other way: (the kernel and bias gradients now, a
        function giving the input gradient when called), for a caller with something to start
        on the kernel gradient meanwhile (its sum among the nodes: :mod:`hetconv.imagesplit`).
        Here all at once; an executor that can computes the input gradient when asked, by the
        same operations."""
        extra = {"stride": stride} if tuple(stride) != (1, 1) else {}
        dx, dw, db = self.backward(layer, x, w, dy, padding, need_input_grad, **extra)
        return dw, db, lambda: dx

    def prepare(self, layers: Sequence[ConvSpec], batch: int, log: TextIO | None) -> None:
        """Called once before training with the model's conv layers (e.g. to probe devices)."""

    def plan_record(self) -> dict | None:
        """How the work is split, for the first record a training run writes to its trace (after
        :meth:`prepare`, at every start, fresh or resumed), or None for nothing to record.

        The dict must be JSON-ready and must not hold ``step`` (the trace's step records are the
        ones with a step); training writes ``{"event": "plan", "start_step": ..., **plan}``. The
        master's cluster gives its nodes (name, description, probe seconds per layer, measured
        link) and each layer's kernel shares, node by node.
        """
        return None

    def predict_step(
        self, comp_alone_s: float, comp_s: float, spec=None, chains_s=None
    ) -> dict | None:
        """The step predicted for this executor against the master alone's (``step_s``,
        ``alone_s``, ``speedup``; ``data_parallel_s`` given the model's ``spec``), from the
        master's other work per step alone (``comp_alone_s``), between the calls
        (``comp_s``) and inside them (``chains_s``: convolution name -> seconds of the layers
        after it that its fused stage runs on the nodes, or a replicated block's on the master
        beside the workers); None: nothing to predict (one process)."""
        return None

    def begin_step(self, step: int) -> None:
        """Calls until the next ``begin_step`` belong to training step ``step``."""

    def end_step(self) -> dict:
        """Trace fields for the step just done: at least ``comm_seconds`` and
        ``conv_seconds`` (seconds spent moving data, and computing on the slowest node)."""
        return {"comm_seconds": 0.0, "conv_seconds": 0.0}

    def train_batch(self, model, x: np.ndarray, labels: np.ndarray, step: int):
        """The training step's passes run by the executor itself (the whole network split by
        images, :mod:`hetconv.imagesplit`): (the batch's mean loss, bool (N,) hits), with
        every parameter's gradient left in ``model``'s layers; None (the default): the
        training loop runs the model's passes itself."""
        return None

    def redo_step(self) -> bool:
        """Whether the step's passes must run again before its update (a node caught
        answering wrong values was taken out mid-step); the training loop asks after each."""
        return False

    def complete(self) -> None:
        """Finish what the executor deferred past its steps (the ring's spot check of a step
        with batch norm, run while the next step computes): the model then holds weights every
        check passed. The training loop calls it before an evaluation, a checkpoint and its
        end."""

    def close(self) -> None:
        """Release connections and threads."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- fused stages (supports_stages) ----------------------------------------------------

    def stage_mode(self, layer: str) -> str:
        """``"fused"`` or ``"unfused"`` for the named layer."""
        return "unfused"

    def stage_forward(
        self,
        layer: str,
        x: np.ndarray,
        w: np.ndarray,
        b: np.ndarray,
        padding: PaddingSpec,
        stage,
        batchnorm=(),
        head=None,
    ) -> np.ndarray:
        """float32 (N, K, Ho', Wo'): the stage's output (after its last layer, e.g. pooled).

        ``batchnorm``: the model's :class:`~hetconv.layers.BatchNorm2d` layers of the stage,
        in order; training, the executor moves their running statistics by the batch's (not
        ``num_batches_tracked``: the caller counts the batch). ``head``: the final fc's
        (name, weight) where :meth:`head_split` says so; the answer is then the fc's output
        without its bias (N, classes)."""
        raise NotImplementedError(f"{type(self).__name__} runs no fused stages")

    def stage_backward(
        self,
        layer: str,
        x: np.ndarray,
        w: np.ndarray,
        b: np.ndarray,
        dy: np.ndarray,
        padding: PaddingSpec,
        need_input_grad: bool,
        stage,
        batchnorm=(),
        head=None,
    ) -> tuple:
        """(input gradient or None, kernel gradient, bias gradient) for the gradient ``dy`` of
        the stage's output; sets the ``grads`` of the ``batchnorm`` layers (as forward's).
        With ``head``, ``dy`` is the logits' gradient and a fourth array answers the gradient
        of the fc columns (C, P, classes) of the rows the executor does not update itself."""
        raise NotImplementedError(f"{type(self).__name__} runs no fused stages")

    def head_split(self, layer: str) -> bool:
        """Whether the named layer's stage computes the final fc."""
        return False

    def hold_block_backward(self, layer: str, chain) -> None:
        """The model's back-propagation through ``layer``'s block layers after its
        convolution, this step (``chain``: a callable from the block's output gradient to its
        convolution's); an executor that replicates the block may run it early."""

    def block_backward_taken(self, layer: str) -> bool:
        """Whether this step's gradient already went back through ``layer``'s block layers
        (the model then runs them only on what came after)."""
        return False

    # -- kernels kept by the executor (resident) -------------------------------------------

    def resident_parameters(self) -> list[str]:
        """Parameter names (``layer.weight``) the executor keeps and updates itself: the
        model's optimizer skips them."""
        return []

    def attach_optimizer(self, sgd) -> None:
        """The optimizer settings resident parameters are updated with (before the first
        step)."""

    def gather_resident(self) -> dict:
        """Fetch every resident parameter into the model's arrays (for a checkpoint or a
        save); returns their momentum buffers by parameter name."""
        return {}

    def load_resident_momentum(self, momentum: dict) -> None:
        """Momentum buffers of resident parameters, from a checkpoint (by parameter name)."""


#: Kept names: an executor of fused stages and of a split head is a :class:`ConvExecutor`
#: with :attr:`~ConvExecutor.supports_stages` / :attr:`~ConvExecutor.supports_head` set.
StageExecutor = HeadExecutor = ConvExecutor


class LocalConv(ConvExecutor):
    """Runs every convolution on one backend in this process.

    Args:
        backend: a :class:`~hetconv.backends.Backend`, or a backend name.
    """

    def __init__(self, backend: Backend | str = "cpu"):
        self.backend = get_backend(backend) if isinstance(backend, str) else backend
        self.native_stride = self.backend.native_stride  # the onednn backend's strides
        self._seconds = 0.0

    def forward(self, layer, x, w, b, padding, stride=(1, 1)):
        start = time.perf_counter()
        y = self.backend.conv_forward(x, w, b, padding, stride)
        self._seconds += time.perf_counter() - start
        return y

    def backward(self, layer, x, w, dy, padding, need_input_grad, stride=(1, 1)):
        dw, db, input_grad = self.backward_kernels_first(
            layer, x, w, dy, padding, need_input_grad, stride
        )
        return input_grad(), dw, db

    def backward_later(self, layer, x, w, dy, padding, need_input_grad, stride=(1, 1)):
        start = time.perf_counter()
        dx = self._input_grad(x, w, dy, padding, need_input_grad, stride)
        self._seconds += time.perf_counter() - start

        def kernels():
            start = time.perf_counter()
            dw, db = self.backend.conv_grad_kernels(x, dy, w.shape[2:], padding, stride)
            self._seconds += time.perf_counter() - start
            return dw, db

        return dx, kernels

    def backward_kernels_first(self, layer, x, w, dy, padding, need_input_grad, stride=(1, 1)):
        start = time.perf_counter()
        dw, db = self.backend.conv_grad_kernels(x, dy, w.shape[2:], padding, stride)
        self._seconds += time.perf_counter() - start

        def input_grad():
            start = time.perf_counter()
            dx = self._input_grad(x, w, dy, padding, need_input_grad, stride)
            self._seconds += time.perf_counter() - start
            return dx

        return dw, db, input_grad

    def _input_grad(self, x, w, dy, padding, need_input_grad, stride):
        if not need_input_grad:
            return None
        # a stride reaches here only where the layer runs strided (Conv2d.runs_strided), on a
        # backend that takes strides: oneDNN's strided input gradient is 2-3x its phases'
        return self.backend.conv_grad_input(dy, w, x.shape[2:], padding, stride)

    def begin_step(self, step):
        self._seconds = 0.0

    def end_step(self):
        return {"comm_seconds": 0.0, "conv_seconds": self._seconds}
