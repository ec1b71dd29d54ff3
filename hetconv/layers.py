"""Layers with forward and backward passes: float32, NCHW.

Semantics follow PyTorch's modules of the same name (``nn.Conv2d``, ``nn.ReLU``,
``nn.LocalResponseNorm``, ``nn.MaxPool2d`` and ``nn.AvgPool2d`` (one :class:`Pool2d` with a
``mode``), ``nn.AdaptiveAvgPool2d(1)``, ``nn.BatchNorm2d`` (:mod:`hetconv.batchnorm`),
``nn.Dropout``, ``nn.Linear``) so that weights move between the two unchanged. The base class,
:class:`~hetconv.graph.Layer`, is the graph's. Each layer keeps what its backward pass needs
from the last forward pass; ``backward`` stores parameter gradients in ``grads`` and returns
the input gradient.
``training`` (True by default, as in PyTorch) selects training or evaluation behaviour
(batch statistics or running statistics; dropout on or off); ``buffers`` holds state that
is saved with the weights but not trained (batch norm's running statistics).

Every layer computes in the array module of the array it is given (a worker's stage layers,
and a whole model placed on a device: :meth:`hetconv.model.Model.place`): numpy on the host,
cupy on a GPU (:func:`~hetconv.backends.arrays.array_module`), the same operations in order.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import numpy as np

from .backends import Padding, PaddingSpec, conv_shape, onednn_layers
from .backends.arrays import array_module, is_array
from .backends.hostthreads import blas_threads, groups, in_groups
from .batchnorm import BatchNorm2d, batch_statistics
from .conv import ConvExecutor, ConvSpec, LocalConv, StridePhases, kernel_pair
from .graph import Add, Concat, Layer
from .pooling import (
    POOL_MODES,
    AvgPool2d,
    GlobalAvgPool2d,
    MaxPool2d,
    Pool2d,
    pool_geometry,
    pool_output_shape,
)


class Conv2d(Layer):
    """Convolution, with a bias or without; the arithmetic runs on a :class:`ConvExecutor`.

    Parameters: ``weight`` float32 (K, C, kh, kw), ``bias`` float32 (K,) unless ``bias`` is
    False (PyTorch's ``bias=False``: no such parameter; executors get :attr:`bias`, zeros).
    ``need_input_grad`` is False for a network's first layer: nothing consumes that gradient.

    .. note:: A stride above 1 runs as the stride-1 convolution of the input's phases
       (:class:`~hetconv.conv.StridePhases`): the executor is called with the phased input
       and kernels, no padding, and the gradients are turned back. Exact, on every executor
       and backend, at 1-1.8x a strided kernel's arithmetic. Where the phases cost more
       arithmetic than the strided kernel (3x3 stride 2: 1.78x; not 1x1), an executor with
       :attr:`~hetconv.conv.ConvExecutor.native_stride` (:class:`~hetconv.conv.LocalConv` on
       the onednn backend) is called with the layer's own input, kernels, padding and stride.
       On resnet20's 3x3 stride-2 layers oneDNN's strided forward and kernel gradient take
       0.57-0.75x the phases' time, its input gradient 0.3-0.5x; its 1x1 strided ones 1.2-1.4x
       (one thread, batch 16 and 64, ``benchmarks/conv_vs_torch.py``).
    """

    def __init__(
        self,
        name: str,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int, int],
        padding: PaddingSpec = 0,
        executor: ConvExecutor | None = None,
        stride: int | tuple[int, int] = 1,
        bias: bool = True,
    ):
        super().__init__(name)
        kh, kw = kernel_pair(kernel_size)
        self.stride = kernel_pair(stride)
        if min(self.stride) < 1:
            raise ValueError(f"{name}: stride {stride} must be >= 1")
        self.in_channels, self.out_channels = in_channels, out_channels
        self.kernel_size = (kh, kw)
        self.padding = padding
        self.executor: ConvExecutor = executor if executor is not None else LocalConv()
        self.need_input_grad = True
        self.stage = None  # the channel-local layers after it (a StageSpec), set by the model
        self.head = None  # (name, classes) of the final fc its stage feeds, set by the model
        self.feeds = None  # the conv its stage's output feeds unchanged, set by the model
        self.params = {
            "weight": np.zeros((out_channels, in_channels, kh, kw), np.float32),
            "bias": np.zeros(out_channels, np.float32),
        }
        self.has_bias = bool(bias)
        self._zero_bias = None if self.has_bias else self.params.pop("bias")
        self._x: np.ndarray | None = None
        self._phases: StridePhases | None = None
        self._stride: dict = {}  # {"stride": ...} where the executor strides itself

    @property
    def bias(self) -> np.ndarray:
        """The bias executors add: the parameter, or zeros (never trained) without one."""
        return self.params["bias"] if self.has_bias else self._zero_bias

    def set_grads(self, dw: np.ndarray, db: np.ndarray) -> None:
        """``grads`` from the kernel and bias gradients (no bias entry without a bias)."""
        self.grads = {"weight": dw, "bias": db} if self.has_bias else {"weight": dw}

    @property
    def spec(self) -> ConvSpec:
        """This layer's geometry, stride included (needs ``input_shape``, which the model sets);
        executors see its :attr:`~hetconv.conv.ConvSpec.executed`."""
        if self.input_shape is None:
            raise RuntimeError(f"{self.name}: input shape unknown (the model sets it)")
        return ConvSpec(
            self.name,
            tuple(self.input_shape),
            self.out_channels,
            self.kernel_size,
            self.padding,
            self.need_input_grad,
            self.stage,
            self.stride,
            feeds=self.feeds,
            head=self.head,
            bias=self.has_bias,
        )

    def executed(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, PaddingSpec]:
        """(input, kernels, padding) of the executor call that computes this layer on ``x``:
        ``x`` and the kernels themselves at stride 1, their phases otherwise (kept for
        :meth:`restore`)."""
        if self.stride == (1, 1):
            self._phases = None
            return x, self.params["weight"], self.padding
        phases = StridePhases(
            tuple(x.shape[1:]), self.kernel_size,
            Padding.resolve(self.padding, self.kernel_size), self.stride,
        )  # fmt: skip
        self._phases = phases
        return phases.input(x), phases.kernels(self.params["weight"]), 0

    def restore(
        self, dx: np.ndarray | None, dw: np.ndarray
    ) -> tuple[np.ndarray | None, np.ndarray]:
        """The layer's input and kernel gradients from those of the last :meth:`executed`
        call's."""
        phases = self._phases
        if phases is None:
            return dx, dw
        return (None if dx is None else phases.input_grad(dx)), phases.kernel_grad(dw)

    def forward(self, x):
        self._stride = {}
        if self.executor.native_stride and self.runs_strided(x):
            self._phases, self._stride = None, {"stride": self.stride}
            w, padding = self.params["weight"], self.padding
        else:
            x, w, padding = self.executed(x)
        self._x, self._w, self._padding = x, w, padding
        return self.executor.forward(self.name, x, w, self.bias, padding, **self._stride)

    def runs_strided(self, x: np.ndarray) -> bool:
        """Whether an executor that takes strides (:attr:`~hetconv.conv.ConvExecutor.
        native_stride`) gets this layer's own stride on input ``x``: a stride above 1 whose
        phases cost more arithmetic than the strided kernel."""
        if self.stride == (1, 1):
            return False
        pads = Padding.resolve(self.padding, self.kernel_size)
        return StridePhases(tuple(x.shape[1:]), self.kernel_size, pads, self.stride).arithmetic > 1

    def backward(self, dy):
        if self._x is None:
            raise RuntimeError(f"{self.name}: backward before forward")
        dx, dw, db = self.executor.backward(
            self.name, self._x, self._w, dy, self._padding, self.need_input_grad, **self._stride
        )
        dx, dw = self.restore(dx, dw)
        self.set_grads(dw, db)
        return dx

    def backward_later(self, dy) -> tuple[np.ndarray | None, Callable[[], None]]:
        """:meth:`backward` with the kernel gradient left for later: (the input gradient, a
        function that sets :attr:`grads` when called; until then they are empty), the same
        values (:meth:`~hetconv.conv.ConvExecutor.backward_later`)."""
        if self._x is None:
            raise RuntimeError(f"{self.name}: backward before forward")
        dx, later = self.executor.backward_later(
            self.name, self._x, self._w, dy, self._padding, self.need_input_grad, **self._stride
        )
        phases = self._phases
        if phases is not None and dx is not None:
            dx = phases.input_grad(dx)
        self.grads = {}

        def finish() -> None:
            dw, db = later()
            self.set_grads(dw if phases is None else phases.kernel_grad(dw), db)

        return dx, finish

    def backward_kernels_first(self, dy, ready: Callable[[], None]) -> np.ndarray | None:
        """:meth:`backward` with the kernel gradient first: :attr:`grads` are set and
        ``ready()`` called before the input gradient is computed (a bucket ring then sums
        them meanwhile: :func:`hetconv.imagesplit.backward_hooks`); the same values
        (:meth:`~hetconv.conv.ConvExecutor.backward_kernels_first`). Returns the input
        gradient."""
        if self._x is None:
            raise RuntimeError(f"{self.name}: backward before forward")
        w = self._w
        if w is self.params["weight"] and self.need_input_grad:
            w = w.copy()  # ready() may update the weights in place (a bucket summed, applied)
        dw, db, input_grad = self.executor.backward_kernels_first(
            self.name, self._x, w, dy, self._padding, self.need_input_grad, **self._stride
        )
        phases = self._phases
        self.set_grads(dw if phases is None else phases.kernel_grad(dw), db)
        ready()
        dx = input_grad()
        return dx if phases is None or dx is None else phases.input_grad(dx)

    def output_shape(self, input_shape):
        if self.stride != (1, 1):
            spec = ConvSpec(
                self.name, tuple(input_shape), self.out_channels, self.kernel_size,
                self.padding, stride=self.stride,
            )  # fmt: skip
            return spec.output_shape
        shape = conv_shape((1, *input_shape), self.params["weight"].shape, self.padding)
        return (self.out_channels, *shape.out_hw)


#: A host ReLU runs on several threads (ranges of its images, one a BLAS thread) where each
#: range holds at least this many bytes. Forward and backward at two threads against one, on
#: this project's 2-core EPYC: 16 MB 3.0-3.4 ms -> 2.1-2.2 ms; 4 MB in two ranges no faster
#: (0.48-0.72 ms against 0.54-0.59: two cores share the memory such a pass waits on).
RELU_PART_BYTES = 4 * 2**20


def _image_ranges(a) -> list[slice]:
    """``a``'s images in ranges to run an element-wise pass on at once: one a BLAS thread, each
    at least :data:`RELU_PART_BYTES`; the whole batch in one (a device array: always)."""
    if type(a) is not np.ndarray or a.nbytes < 2 * RELU_PART_BYTES or a.shape[0] < 2:
        return [slice(None)]
    parts = min(blas_threads(), a.shape[0], a.nbytes // RELU_PART_BYTES)
    return [slice(i, j) for i, j in groups(a.shape[0], parts)] if parts > 1 else [slice(None)]


class ReLU(Layer):
    """max(x, 0); the gradient at 0 is 0 and passes where x is NaN (a NaN stays NaN), as in
    PyTorch. A large host tensor's pass runs on the BLAS threads, a range of images each (an
    element-wise pass: the same bits).

    .. note:: The zero is an array of one image's shape, broadcast along the batch: numpy's
       maximum with a scalar runs three times slower than with an array.
    """

    def forward(self, x):
        xp = array_module(x)
        zero = xp.zeros((1, *x.shape[1:]), np.float32)
        ranges = _image_ranges(x)
        if len(ranges) == 1:
            y = xp.maximum(x, zero, dtype=np.float32)
        else:
            y = np.empty(x.shape, np.float32)
            in_groups(lambda r: np.maximum(x[r], zero, out=y[r], dtype=np.float32), ranges,
                      len(ranges))  # fmt: skip
        if onednn_layers.serves_relu(y):  # the backward in one pass from y (host float32)
            self._mask, self._y = None, y
        else:
            self._mask, self._y = ~(x <= 0), None
        return y

    def backward(self, dy):
        if self._y is None:
            return dy * self._mask
        ranges = _image_ranges(self._y)
        if len(ranges) == 1 or dy.shape != self._y.shape:
            return onednn_layers.relu_backward(dy, self._y)
        dx = np.empty(self._y.shape, np.float32)
        in_groups(lambda r: onednn_layers.relu_backward(dy[r], self._y[r], out=dx[r]), ranges,
                  len(ranges))  # fmt: skip
        return dx


class LocalResponseNorm(Layer):
    """Normalisation across nearby channels, ``torch.nn.LocalResponseNorm`` semantics.

    ``y_c = x_c / (k + alpha / size * sum_{c' in window(c)} x_{c'}^2) ** beta`` where the window
    spans channels ``c - size // 2 .. c + (size - 1) // 2`` clipped to the tensor, and the sum is
    always divided by ``size`` (as PyTorch's average pooling with zero padding does).

    .. note:: The window sums are ``size`` shifted slice-adds, not a pooling call: the same
       maths as PyTorch's, several times cheaper on a CPU.
    """

    def __init__(
        self, name: str, size: int = 5, alpha: float = 1e-4, beta: float = 0.75, k: float = 1.0
    ):
        super().__init__(name)
        if size < 1:
            raise ValueError(f"LRN size must be >= 1, got {size}")
        self.size, self.alpha, self.beta, self.k = size, alpha, beta, k

    def _window_sum(self, a: np.ndarray, before: int, after: int) -> np.ndarray:
        """out[:, c] = sum of a[:, c - before .. c + after] (clipped to the channel range)."""
        out = a.copy()
        channels = a.shape[1]
        # Shifts of the whole channel range or more add nothing: a huge size (a worker's stage
        # request may say any) costs no more than the channels.
        for shift in range(1, min(before, channels - 1) + 1):
            out[:, shift:] += a[:, :-shift]
        for shift in range(1, min(after, channels - 1) + 1):
            out[:, :-shift] += a[:, shift:]
        return out

    def _inverse_power(self, scale: np.ndarray) -> np.ndarray:
        """scale ** -beta; two square roots instead of a pow for the usual beta = 0.75."""
        xp = array_module(scale)
        if self.beta == 0.75:
            root = xp.sqrt(scale)
            inv = xp.sqrt(root)
            inv *= root
            return xp.reciprocal(inv, out=inv)
        return xp.power(scale, np.float32(-self.beta), dtype=np.float32)

    def forward(self, x):
        before, after = self.size // 2, (self.size - 1) // 2
        scale = self._window_sum(x * x, before, after)
        scale *= np.float32(self.alpha / self.size)
        scale += np.float32(self.k)
        inv = self._inverse_power(scale)
        y = x * inv
        self._x, self._y, self._scale, self._inv = x, y, scale, inv
        return y

    def backward(self, dy):
        x, y, scale, inv = self._x, self._y, self._scale, self._inv
        # d y_c / d x_j = inv_c [c == j] - 2 alpha beta / size * x_j * y_c / scale_c
        # for every c whose window holds j; the transpose window swaps before and after.
        t = dy * y
        t /= scale
        before, after = self.size // 2, (self.size - 1) // 2
        back = self._window_sum(t, after, before)
        back *= x
        back *= np.float32(2.0 * self.alpha * self.beta / self.size)
        dx = dy * inv
        dx -= back
        return dx


# Image-local layers: each image's output depends on that image's input alone.
IMAGE_LOCAL = (ReLU, LocalResponseNorm, Pool2d, GlobalAvgPool2d)
# What one chunk of :class:`ImageChunks` takes in: a few L2-sized chunks beat whole batches.
CHUNK_BYTES = 2**20


class ImageChunks(Layer):
    """Image-local layers run a few images at a time, each chunk through all of them.

    Run whole, each layer of a ReLU-LRN-pool chain streams the batch through memory several
    times and its outputs and temporaries are fresh arrays larger than the allocator keeps
    (every page faults in, every step); chunk by chunk, a chunk's arrays stay in cache and
    its temporaries come back from the allocator. Every value is computed by the same
    operations in the same order, so the results are bit for bit the layers' own (forward and
    backward at paper-500-1500 batch 64, one thread: the first layer's chain 0.86 s whole and
    0.70 s in 1 MB chunks, the second's 1.2 s and 0.53 s; ``benchmarks/chain_chunks.py``).

    The layers keep nothing: each chunk runs on shallow copies, which keep what that chunk's
    backward needs (:meth:`saved_arrays`). On a device (arrays not numpy's) the whole batch is
    one chunk: a GPU's caches are not what chunks are for, and each chunk costs launches.

    With more than one BLAS thread (``--threads``; a worker's cores) the chunks run on that
    many threads at once, in contiguous groups (:func:`~hetconv.backends.hostthreads.in_groups`),
    each core on chunks in its own cache; a chunk computes what it computes alone, so the bits
    are the same at any thread count (``benchmarks/chain_chunks.py --threads 2``).
    """

    def __init__(self, layers: Sequence[Layer], chunk_bytes: int = CHUNK_BYTES):
        super().__init__("+".join(layer.name for layer in layers))
        if not layers or not all(isinstance(layer, IMAGE_LOCAL) for layer in layers):
            raise ValueError(f"ImageChunks runs image-local layers only, got {list(layers)}")
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        self.layers, self.chunk_bytes = list(layers), int(chunk_bytes)
        self._runs: list[tuple[slice, list[Layer]]] = []
        self._in_shape: tuple[int, ...] = ()

    def output_shape(self, input_shape):
        for layer in self.layers:
            input_shape = layer.output_shape(input_shape)
        return input_shape

    def forward(self, x):
        n = x.shape[0]
        xp = array_module(x)
        per = max(1, self.chunk_bytes // max(1, x[:1].nbytes)) if xp is np else n
        chunks = [slice(start, min(start + per, n)) for start in range(0, n, per)]
        y = xp.empty((n, *self.output_shape(x.shape[1:])), np.float32)
        self._in_shape = x.shape

        def chunk(rows: slice) -> list[Layer]:
            copies = [copy.copy(layer) for layer in self.layers]
            a = x[rows]
            for layer in copies:
                a = layer.forward(a)
            y[rows] = a
            return copies

        ran = in_groups(chunk, chunks, _threads(xp, len(chunks)))
        self._runs = list(zip(chunks, ran, strict=True))
        return y

    def backward(self, dy):
        if not self._runs:
            raise RuntimeError(f"{self.name}: backward before forward")
        xp = array_module(dy)
        dx = xp.empty(self._in_shape, np.float32)

        def chunk(run: tuple[slice, list[Layer]]) -> None:
            rows, copies = run
            g = dy[rows]
            for layer in reversed(copies):
                g = layer.backward(g)
            dx[rows] = g

        in_groups(chunk, self._runs, _threads(xp, len(self._runs)))
        return dx

    def saved_arrays(self) -> list[np.ndarray]:
        """Every array the chunks keep for the backward."""
        return [a for _, copies in self._runs for layer in copies for a in saved_arrays(layer)]


def _threads(xp, chunks: int) -> int:
    """Threads an :class:`ImageChunks` pass runs its chunks on: the BLAS thread count, as the
    engines take theirs (one on a device, whose batch is one chunk)."""
    return min(blas_threads(), chunks) if xp is np and chunks > 1 else 1


def saved_arrays(layer: Layer) -> list[np.ndarray]:
    """The arrays ``layer`` keeps from its last forward (for memory budgets; device arrays
    too)."""
    if isinstance(layer, ImageChunks):
        return layer.saved_arrays()
    return [v for v in vars(layer).values() if is_array(v)]


def chunked(layers: Sequence[Layer], chunk_bytes: int = CHUNK_BYTES) -> list[Layer]:
    """``layers`` with every run of two or more image-local layers as one
    :class:`ImageChunks` (the same results; see there). The layers are not copied: a run's
    layer objects stay unused, the chunks hold their state."""
    out: list[Layer] = []
    run: list[Layer] = []
    for layer in [*layers, None]:
        if layer is not None and isinstance(layer, IMAGE_LOCAL):
            run.append(layer)
            continue
        out += [ImageChunks(run, chunk_bytes)] if len(run) > 1 else run
        run = []
        if layer is not None:
            out.append(layer)
    return out


class Dropout(Layer):
    """Zeroes each value with probability ``p`` while training and scales the rest by
    ``1 / (1 - p)``, ``torch.nn.Dropout`` semantics; the identity in evaluation.

    A mask is a function of ``seed`` and the training step: ``step`` when set (the model sets
    it from the step it is told, so a resumed run draws the masks an unbroken one would),
    otherwise the count of training forwards so far. Not PyTorch's masks (its generator
    differs). Drawn on the host, on device arrays too (uploaded: the same masks).
    """

    def __init__(self, name: str, p: float = 0.5, seed: int | Sequence[int] = 0):
        super().__init__(name)
        if not 0.0 <= p < 1.0:
            raise ValueError(f"{name}: dropout p must be in [0, 1), got {p}")
        self.p = float(p)
        seeds = seed if isinstance(seed, Sequence) else (seed,)
        self.seed = tuple(int(v) % 2**64 for v in seeds)  # the generator takes no negatives
        self.step: int | None = None
        self._forwards = 0

    def forward(self, x):
        if not self.training or self.p == 0.0:
            self._scale = None
            return x
        step = self.step if self.step is not None else self._forwards
        self._forwards += 1
        rng = np.random.default_rng((*self.seed, step))
        return self._masked(x, rng.random(x.shape, dtype=np.float32) >= np.float32(self.p))

    def _masked(self, x, keep: np.ndarray):
        """``x`` with the host mask ``keep`` applied and scaled (the mask sent to ``x``'s
        device first: the same bits), the scaled mask kept for backward."""
        self._scale = array_module(x).asarray(keep) * np.float32(1.0 / (1.0 - self.p))
        return x * self._scale

    def backward(self, dy):
        return dy if self._scale is None else dy * self._scale


class Linear(Layer):
    """Fully connected layer on the flattened input: ``y = x @ weight.T + bias``.

    Parameters: ``weight`` float32 (out, in) as in PyTorch, ``bias`` float32 (out,).
    """

    def __init__(self, name: str, in_features: int, out_features: int):
        super().__init__(name)
        self.in_features, self.out_features = in_features, out_features
        self.params = {
            "weight": np.zeros((out_features, in_features), np.float32),
            "bias": np.zeros(out_features, np.float32),
        }

    def output_shape(self, input_shape):
        if int(np.prod(input_shape)) != self.in_features:
            raise ValueError(
                f"{self.name}: input {input_shape} has {int(np.prod(input_shape))} features, "
                f"expected {self.in_features}"
            )
        return (self.out_features,)

    def forward(self, x):
        self._input_shape = x.shape
        self._x = x.reshape(x.shape[0], -1)
        return self._x @ self.params["weight"].T + self.params["bias"]

    def backward(self, dy):
        self.grads = {"weight": dy.T @ self._x, "bias": dy.sum(axis=0, dtype=np.float32)}
        return (dy @ self.params["weight"]).reshape(self._input_shape)


def softmax_cross_entropy(
    logits: np.ndarray, labels: np.ndarray
) -> tuple[float, np.ndarray, np.ndarray]:
    """Mean softmax cross-entropy over the batch.

    Args:
        logits: float32 (N, classes).
        labels: int (N,) class indices.

    Returns:
        (loss, float32 (N, classes) gradient of the loss w.r.t. the logits,
        bool (N,) whether each sample's top logit is its label).
    """
    n = logits.shape[0]
    if labels.shape != (n,):
        raise ValueError(f"labels have shape {labels.shape}, expected ({n},)")
    shifted = logits - logits.max(axis=1, keepdims=True)
    exp = np.exp(shifted)
    total = exp.sum(axis=1, keepdims=True)
    log_prob = shifted - np.log(total)
    rows = np.arange(n)
    loss = float(-log_prob[rows, labels].mean())
    grad = exp / total
    grad[rows, labels] -= 1.0
    grad /= np.float32(n)
    return loss, grad.astype(np.float32, copy=False), logits.argmax(axis=1) == labels


__all__ = [
    "CHUNK_BYTES",
    "IMAGE_LOCAL",
    "POOL_MODES",
    "Add",
    "AvgPool2d",
    "BatchNorm2d",
    "Concat",
    "Conv2d",
    "Dropout",
    "GlobalAvgPool2d",
    "ImageChunks",
    "Layer",
    "Linear",
    "LocalResponseNorm",
    "MaxPool2d",
    "Pool2d",
    "ReLU",
    "batch_statistics",
    "chunked",
    "pool_geometry",
    "pool_output_shape",
    "saved_arrays",
    "softmax_cross_entropy",
]
