"""Networks built from a model spec, the named presets, and weight files.

The spec (a list of layer objects, each naming the layers it reads, the layer before it by
default) and its walk are :mod:`hetconv.spec`; the names are importable from here too.
Parameter names are PyTorch's (``conv1.weight`` as K x C x kh x kw, ``fc.weight`` as out x
in, ``bn1.running_mean``), so a weight file loads into the equivalent ``nn.Module`` with
``load_state_dict``; the layers are created and initialised in the spec's order.

:class:`Model` runs the spec's graph (:mod:`hetconv.graph`): its steps (:attr:`Model.blocks`:
layers, runs of image-local layers in chunks, and with an executor that supports them, fused
stages and the split head) in the spec's order, each on the outputs of the steps it reads;
the gradient of a tensor that feeds several steps is their sum, in a fixed order. A stage or a
chunked run is only ever a chain: each of its layers the only reader of the one before, and
reading nothing else.

Where a layer type of several inputs goes (``add`` and ``concat`` are two), each an
addition:

* :mod:`hetconv.spec`: the type's keys in :data:`~hetconv.spec.LAYER_OPTIONS`, its count of
  inputs in :data:`~hetconv.spec.LAYER_ARITY` (its entries must then name them), and its shape
  rule in ``_output_shape`` (which gets every input's shape);
* :mod:`hetconv.graph` (re-exported by :mod:`hetconv.layers`): a
  :class:`~hetconv.graph.Layer` subclass with ``arity`` set, whose ``forward`` takes the
  inputs in order and whose ``backward`` returns a tuple of their gradients
  (:class:`~hetconv.graph.Add`, :class:`~hetconv.graph.Concat`);
* here, its builder in :data:`BUILDERS`; in :mod:`hetconv.onnx_export`, its node builder in
  :data:`~hetconv.onnx_export.NODES` (``Add``, ``Concat``; it gets every input's tensor).

In the package, nothing else: :meth:`~hetconv.graph.LayerGraph.chain` never fuses a layer
that reads two tensors into a stage or a chunked run, and :func:`~hetconv.graph.graph_forward`
and :func:`~hetconv.graph.graph_backward` pass several inputs and sum the gradients where a
tensor feeds several layers; :meth:`Model.other_seconds` times each step on one random array
per input. Beyond the package, the PyTorch twins of a spec that check us (``torch_twin`` in
``tests/test_spec.py``, ``benchmarks/ddp_rank.py``'s ``SpecNet``) follow the inputs too.

A ``conv`` with ``"bias": false`` has no ``bias`` parameter (nor gradient, weight-file entry
or ONNX input); executors still get a bias, :attr:`~hetconv.layers.Conv2d.bias`, zeros.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import time
import zipfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np

from .conv import ConvExecutor, ConvSpec, LocalConv
from .cpushare import SHARE_FLOOR, cpu_share
from .description import Description, write_description
from .graph import LayerGraph, graph_backward, graph_forward
from .layers import (
    IMAGE_LOCAL,
    Add,
    BatchNorm2d,
    Concat,
    Conv2d,
    Dropout,
    GlobalAvgPool2d,
    ImageChunks,
    Layer,
    Linear,
    LocalResponseNorm,
    Pool2d,
    ReLU,
    chunked,
)
from .spec import (
    CIFAR_INPUT,
    LAYER_ARITY,
    LAYER_OPTIONS,
    LAYER_TYPES,
    PRESETS,
    Option,
    SpecLayer,
    accepted_keys,
    check_entry,
    check_spec,
    load_spec,
    reference_spec,
    spec_graph,
    stage_chain,
    walk_spec,
)
from .stageops import POOL_MODES
from .stages import FUSED, StageSpec


class ConvStage:
    """A convolution and the channel-local layers after it, as one step of the model's passes
    when its executor supports fused stages (:mod:`hetconv.stages`).

    It holds the model's own layer objects: unfused (the executor's choice per layer), it runs
    them one after another exactly as a model without stages does; fused, the executor runs
    them on every node's kernel slice and only the stage's output comes back.
    """

    arity = 1

    def __init__(self, conv: Conv2d, chain: Sequence[Layer], stage: StageSpec):
        self.conv, self.chain, self.stage = conv, list(chain), stage
        self._steps = chunked(self.chain)  # what runs the chain unfused (the same results)
        # the model's own: fused, the executor normalises with their parameters, moves their
        # running statistics and sets their gradients
        self.batchnorm = [layer for layer in self.chain if isinstance(layer, BatchNorm2d)]
        self.name = conv.name
        self._fused: bool | None = None

    def forward(self, x: np.ndarray, head: tuple[str, np.ndarray] | None = None) -> np.ndarray:
        """The stage's output; with ``head`` (the final fc's name and weight, a split head:
        :mod:`hetconv.head`), the fc's output without its bias, computed by the executor."""
        conv = self.conv
        self._fused = conv.executor.stage_mode(conv.name) == FUSED
        if not self._fused:
            for layer in (conv, *self._steps):
                x = layer.forward(x)
            # A replicated block's, which the executor may run early (the next layer's backward).
            conv.executor.hold_block_backward(conv.name, self._chain_backward)
            return x
        x, w, padding = conv.executed(x)
        conv._x, conv._w, conv._padding = x, w, padding
        extra = {"head": head} if head is not None else {}
        y = conv.executor.stage_forward(
            conv.name, x, w, conv.bias, padding, self.stage, self.batchnorm, **extra
        )
        for layer in self.batchnorm:  # the executor moved the running statistics
            if layer.training:
                layer.buffers["num_batches_tracked"] += 1
        return y

    def backward(
        self, dy: np.ndarray, head: tuple[str, np.ndarray] | None = None
    ) -> np.ndarray | None:
        """The input gradient; with ``head``, ``dy`` is the fc output's gradient and the
        fc's weight gradient (of the rows the master computed) is :attr:`head_grad`."""
        conv = self.conv
        if self._fused is None:
            raise RuntimeError(f"{conv.name}: backward before forward")
        if not self._fused:
            if self.backward_pending():  # the master's part went back through the chain
                if dy is not None:  # what came after it
                    dy = self._chain_backward(dy)
                return conv.backward(dy)
            for layer in (*reversed(self._steps), conv):
                dy = layer.backward(dy)
            return dy
        extra = {"head": head} if head is not None else {}
        out = conv.executor.stage_backward(
            conv.name, conv._x, conv._w, conv.bias, dy, conv._padding,
            conv.need_input_grad, self.stage, self.batchnorm, **extra,
        )  # fmt: skip
        dx, dw, db = out[:3]
        self.head_grad = out[3] if head is not None else None
        dx, dw = conv.restore(dx, dw)
        conv.set_grads(dw, db)
        return dx

    def _chain_backward(self, dy: np.ndarray) -> np.ndarray:
        """The gradient of the convolution's output from the stage output's gradient ``dy``."""
        for layer in reversed(self._steps):
            dy = layer.backward(dy)
        return dy

    def backward_pending(self) -> bool:
        """Whether the executor already ran the master's part of this step's gradient back
        through the chain, or fused, through the whole block (a replicated block's, during the
        next layer's backward; fused where the master is a peer of its split): the
        stage's backward then still has to finish, even with no gradient left to give it."""
        return self.conv.executor.block_backward_taken(self.conv.name)

    def __repr__(self) -> str:
        return f"ConvStage({self.conv!r}, {self.chain!r})"


class HeadStage:
    """The last conv stage and the network's final fully connected layer, as one step of the
    passes when the executor may split the fc over the stage's kernel slices
    (:mod:`hetconv.head`): each node then answers its channels' part of the logits, and the
    master adds the parts and the fc's bias. Otherwise (the executor's choice per layer) the
    stage and the fc run one after the other, as without it."""

    arity = 1

    def __init__(self, stage: ConvStage, fc: Linear):
        self.stage, self.fc = stage, fc
        self.name = stage.name
        self._split: bool | None = None

    def forward(self, x: np.ndarray) -> np.ndarray:
        conv = self.stage.conv
        self._split = bool(conv.executor.head_split(conv.name))
        if not self._split:
            return self.fc.forward(self.stage.forward(x))
        z = self.stage.forward(x, head=(self.fc.name, self.fc.params["weight"]))
        return z + self.fc.params["bias"]

    def backward(self, dz: np.ndarray) -> np.ndarray | None:
        if self._split is None:
            raise RuntimeError(f"{self.name}: backward before forward")
        if not self._split:
            return self.stage.backward(self.fc.backward(dz))
        dx = self.stage.backward(dz, head=(self.fc.name, self.fc.params["weight"]))
        df = self.stage.head_grad  # (C, P, classes): back to the fc weight's layout
        weight = self.fc.params["weight"]
        self.fc.grads = {
            "weight": np.ascontiguousarray(df.transpose(2, 0, 1)).reshape(weight.shape),
            "bias": dz.sum(axis=0, dtype=np.float32),
        }
        return dx

    def __repr__(self) -> str:
        return f"HeadStage({self.stage!r}, {self.fc!r})"


class Model:
    """A feed-forward network: the spec's layers as a graph (:attr:`graph`; each reads the
    layers its entry names, the one before it by default), softmax cross-entropy on top.

    Args:
        spec: list of layer dicts (:mod:`hetconv.spec`).
        input_shape: per-sample (C, H, W).
        seed: initialisation seed; the same seed always gives the same weights.
        executor: where the convolutions run (default: the cpu backend in this process).
    """

    def __init__(
        self,
        spec: Sequence[dict],
        input_shape: tuple[int, int, int] = CIFAR_INPUT,
        seed: int = 0,
        executor: ConvExecutor | None = None,
    ):
        self.spec = [dict(layer) if isinstance(layer, Mapping) else layer for layer in spec]
        self.input_shape = tuple(input_shape)
        self.seed = seed
        self.executor = executor if executor is not None else LocalConv()
        self.layers: list[Layer] = []
        self.output_shape: tuple[int, ...] = self.input_shape
        self.graph: LayerGraph = spec_graph(self.spec)
        self._kinds = [entry["type"] for entry in self.spec]
        for item in walk_spec(self.spec, self.input_shape):
            layer = BUILDERS[item.kind](self, item)
            layer.input_shape = item.input_shape
            layer.input_shapes = item.input_shapes
            self.layers.append(layer)
            self.output_shape = item.output_shape
            if item.conv is not None:
                layer.feeds = item.conv.feeds
                if item.conv.stage is not None:
                    layer.stage, layer.head = item.conv.stage, item.conv.head
        # What the passes run: the layers (runs of image-local ones in chunks), or with an
        # executor that supports fused stages, each convolution with its channel-local chain
        # as one ConvStage; and the steps each reads.
        groups = self._staged() if self.executor.supports_stages else self._chunked()
        self.blocks: list[Layer | ConvStage | HeadStage] = [self._step(g) for g in groups]
        self.block_inputs = self.graph.step_inputs(groups)
        self.init_weights(seed)

    def _groups(self, chain_of: Callable[[int], list[int]]) -> list[list[int]]:
        """The layers' positions grouped into steps, in the spec's order: each layer not yet
        in a step starts one, with the layers ``chain_of`` it gives (a chain after it)."""
        groups: list[list[int]] = []
        taken: set[int] = set()
        for i in range(len(self.layers)):
            if i not in taken:
                groups.append([i, *chain_of(i)])
                taken.update(groups[-1])
        return groups

    def _chunked(self) -> list[list[int]]:
        """Steps: each chain of image-local layers one (:class:`~hetconv.layers.ImageChunks`),
        every other layer alone."""

        def image_local(i: int) -> bool:
            return isinstance(self.layers[i], IMAGE_LOCAL)

        return self._groups(lambda i: self.graph.chain(i, image_local) if image_local(i) else [])

    def _staged(self) -> list[list[int]]:
        """Steps: each convolution with its stage's chain, every other layer alone; and the
        last stage with the final fc where the executor may split the fc too
        (:class:`HeadStage`: the fc is the output and reads the stage alone)."""

        def stage(i: int) -> list[int]:
            layer = self.layers[i]
            if isinstance(layer, Conv2d) and layer.stage is not None:
                return stage_chain(self.graph, self._kinds, i)
            return []

        groups = self._groups(stage)
        last = len(self.layers) - 1
        if self.executor.supports_head and len(groups) > 1 and groups[-1] == [last]:
            stage = groups[-2]
            if (
                isinstance(self.layers[last], Linear)
                and isinstance(self.layers[stage[0]], Conv2d)
                and len(stage) > 1
                and self.graph.follower(stage[-1]) == last
            ):
                groups[-2:] = [[*stage, last]]
        return groups

    def _step(self, group: Sequence[int]) -> Layer | ConvStage | HeadStage:
        """What runs the layers at ``group`` (positions along a chain) as one step."""
        layers = [self.layers[i] for i in group]
        first = layers[0]
        if isinstance(first, Conv2d) and len(layers) > 1 and first.stage is not None:
            chain = layers[1 : 1 + len(first.stage.ops)]
            stage = ConvStage(first, chain, first.stage)
            if len(layers) == 2 + len(chain):
                return HeadStage(stage, layers[-1])  # type: ignore[arg-type]
            return stage
        return ImageChunks(layers) if len(layers) > 1 else first

    # -- modes -------------------------------------------------------------------------------

    @property
    def training(self) -> bool:
        """True in training mode (the default), False in evaluation mode."""
        return all(layer.training for layer in self.layers)

    def train(self, mode: bool = True) -> Model:
        """Training mode (batch norm uses and updates batch statistics, dropout drops) or, with
        ``mode=False``, evaluation mode; as PyTorch's ``Module.train``."""
        for layer in self.layers:
            layer.training = bool(mode)
        return self

    def eval(self) -> Model:
        """Evaluation mode: batch norm uses its running statistics, dropout is the identity."""
        return self.train(False)

    @contextlib.contextmanager
    def evaluating(self) -> Iterator[Model]:
        """Evaluation mode inside the ``with`` block, the previous mode after it."""
        before = [layer.training for layer in self.layers]
        self.eval()
        try:
            yield self
        finally:
            for layer, mode in zip(self.layers, before, strict=True):
                layer.training = mode

    # -- parameters --------------------------------------------------------------------------

    def parameters(self) -> dict[str, np.ndarray]:
        """Name -> parameter array (the live arrays, PyTorch names)."""
        return {f"{layer.name}.{k}": v for layer in self.layers for k, v in layer.params.items()}

    def buffers(self) -> dict[str, np.ndarray]:
        """Name -> state that is saved but not trained (batch norm's running statistics)."""
        return {f"{layer.name}.{k}": v for layer in self.layers for k, v in layer.buffers.items()}

    def state(self) -> dict[str, np.ndarray]:
        """Parameters and buffers, layer by layer: what a weight file holds (PyTorch's
        ``state_dict``: its names, shapes and order)."""
        out: dict[str, np.ndarray] = {}
        for layer in self.layers:
            out.update({f"{layer.name}.{k}": v for k, v in layer.params.items()})
            out.update({f"{layer.name}.{k}": v for k, v in layer.buffers.items()})
        return out

    def gradients(self) -> dict[str, np.ndarray]:
        """Name -> gradient of the last backward pass."""
        return {f"{layer.name}.{k}": v for layer in self.layers for k, v in layer.grads.items()}

    def place(self, put: Callable[[np.ndarray], np.ndarray]) -> Model:
        """Every parameter and buffer (and a bias-less convolution's zero bias) replaced by
        ``put`` of it; returns the model.

        With a backend's ``to_device`` (:class:`~hetconv.backends.Backend`) the model lives on
        that device: given device inputs, with a :class:`~hetconv.conv.LocalConv` executor on
        that backend, its passes run there in the backend's array module (every layer takes
        it from its input) and its gradients are device arrays; ``to_host`` brings it back.
        The arrays are new objects: hold :meth:`parameters` only after placing.
        """
        for layer in self.layers:
            layer.params = {key: put(value) for key, value in layer.params.items()}
            layer.buffers = {key: put(value) for key, value in layer.buffers.items()}
            if isinstance(layer, Conv2d) and not layer.has_bias:
                layer._zero_bias = put(layer._zero_bias)
        return self

    def conv_layers(self) -> list[Conv2d]:
        return [layer for layer in self.layers if isinstance(layer, Conv2d)]

    def conv_specs(self) -> list[ConvSpec]:
        """The convolution layers as executors see them (what ``executor.prepare`` takes): a
        strided one as the stride-1 convolution of its phases (:attr:`ConvSpec.executed`);
        each one's stage, the convolution its stage feeds and the final fc it feeds as the
        spec's graph says (:func:`~hetconv.spec.walk_spec`)."""
        return [layer.spec.executed for layer in self.conv_layers()]

    def other_seconds(self, batch: int, repeats: int = 2) -> dict[str, float]:
        """Seconds of each non-convolutional layer's forward and backward on ``batch`` images'
        worth of random input, the best of ``repeats`` (the first also faults its arrays in),
        run as the passes run them: image-local layers in image chunks, a chunked run's time
        split evenly among its layers, a layer of several inputs on one array per input
        (copies of the layers: the model's state, batch norm's running statistics and
        dropout's masks, is left as it was).

        Where this process gets under :data:`SHARE_FLOOR` of a core sustained
        (:func:`cpu_share`: under a CPU quota, a cgroup's or a container's ``--cpus``, or on a
        busy machine), each figure is instead the layer's CPU time divided by that share: a
        call shorter than a quota's period may run at the whole core's speed, or wait out
        the period, where a step runs as the quota allows (resnet20 batch 64 at 0.36 of a
        core: the layers' wall times summed to 0.027-0.075 s, a step's other work took 0.086
        s)."""
        share = cpu_share()
        clock = time.thread_time if share < SHARE_FLOOR else time.perf_counter
        scale = 1.0 / share if share < SHARE_FLOOR else 1.0
        rng = np.random.default_rng(0)
        out = {}
        for step in map(self._step, self._chunked()):
            if isinstance(step, Conv2d):
                continue
            layers = step.layers if isinstance(step, ImageChunks) else [step]
            twin = copy.deepcopy(step)
            if isinstance(twin, Dropout):
                twin.step = 0
            xs = [
                rng.standard_normal((batch, *shape)).astype(np.float32)
                for shape in layers[0].input_shapes
            ]
            best = math.inf
            for _ in range(max(1, repeats)):
                start = clock()
                y = twin.forward(*xs)
                twin.backward(np.ones_like(y))
                best = min(best, clock() - start)
                del y
            for layer in layers:
                out[layer.name] = scale * best / len(layers)
        return out

    def init_weights(self, seed: int) -> None:
        """PyTorch's default initialisation: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for conv and
        fc weights and biases; batch norm starts at weight 1, bias 0 and fresh statistics."""
        rng = np.random.default_rng(seed)
        for layer in self.layers:
            if isinstance(layer, BatchNorm2d):
                layer.reset_parameters()
                continue
            if not layer.params:
                continue
            weight = layer.params["weight"]
            bound = 1.0 / np.sqrt(np.prod(weight.shape[1:]))
            for key in [key for key in ("weight", "bias") if key in layer.params]:
                p = layer.params[key]
                p[...] = rng.uniform(-bound, bound, size=p.shape).astype(np.float32)

    def load_state(self, state: dict[str, np.ndarray]) -> None:
        """Copy parameters and buffers (:meth:`state`) in, checking names, shapes and that
        values are finite."""
        params = self.state()
        missing = sorted(set(params) - set(state))
        unexpected = sorted(set(state) - set(params))
        if missing or unexpected:
            parts = [f"missing {missing}"] if missing else []
            parts += [f"unexpected {unexpected}"] if unexpected else []
            raise ValueError(f"weights do not match the model: {', '.join(parts)}")
        for name, value in state.items():
            value = np.asarray(value)
            if value.shape != params[name].shape:
                raise ValueError(
                    f"{name} has shape {value.shape}, the model expects {params[name].shape}"
                )
            if not np.all(np.isfinite(value)):
                raise ValueError(f"{name} holds non-finite values")
        for name, value in state.items():
            params[name][...] = value

    def save(self, path: str | os.PathLike, description: Description | None = None) -> None:
        """Write the parameters and buffers as an .npz file (written to a temporary name, then
        renamed), with ``description`` (the spec, input and normalisation) as its comment."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            np.savez(f, **self.state())
        if description is not None:
            write_description(tmp, description)
        os.replace(tmp, path)

    def load(self, path: str | os.PathLike) -> None:
        """Read parameters saved by :meth:`save` (or by ``np.savez`` of a PyTorch state dict)."""
        try:
            data = np.load(path, allow_pickle=False)
            if not isinstance(data, np.lib.npyio.NpzFile):
                raise ValueError("not an .npz archive of named arrays")
            with data:
                state = {k: data[k] for k in data.files}
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
            raise ValueError(f"cannot read weights from {path}: {e}") from None
        self.load_state(state)

    # -- passes ------------------------------------------------------------------------------

    def forward(self, x: np.ndarray, step: int | None = None) -> np.ndarray:
        """Logits float32 (N, classes) for float32 (N, C, H, W) inputs.

        ``step``, the training step, decides dropout's masks (with the model's seed), so
        that a run resumed at a step draws what an unbroken run does; None: each dropout
        layer counts its own training forwards.
        """
        if x.dtype != np.float32 or x.shape[1:] != self.input_shape:
            raise ValueError(
                f"input has shape {x.shape} and dtype {x.dtype}; expected float32 "
                f"(N, {', '.join(map(str, self.input_shape))})"
            )
        for layer in self.layers:
            if isinstance(layer, Dropout):
                layer.step = step
        return graph_forward(self.blocks, self.block_inputs, x)

    def backward(self, grad: np.ndarray) -> np.ndarray | None:
        """Back-propagate the loss gradient w.r.t. the logits; fills every layer's ``grads``
        (a tensor that feeds several steps gets the sum of their gradients). Returns the
        input's gradient where the layers reading it compute one (None otherwise)."""
        return graph_backward(self.blocks, self.block_inputs, grad, _backward_pending)


def _backward_pending(block: object) -> bool:
    """Whether ``block``'s backward has to run even with no gradient for it
    (:meth:`ConvStage.backward_pending`)."""
    return isinstance(block, ConvStage) and block.backward_pending()


def _conv(model: Model, item: SpecLayer) -> Conv2d:
    conv = item.conv
    assert conv is not None
    layer = Conv2d(
        item.name, conv.input_shape[0], conv.kernels, conv.kernel_size, conv.padding,
        model.executor, conv.stride, item.options["bias"],
    )  # fmt: skip
    layer.need_input_grad = conv.need_input_grad
    return layer


def _pool(model: Model, item: SpecLayer) -> Pool2d:
    options = item.options
    return Pool2d(item.name, options["kernel"], options["stride"], POOL_MODES[item.kind])


def _batchnorm(model: Model, item: SpecLayer) -> BatchNorm2d:
    options = item.options
    return BatchNorm2d(item.name, item.input_shape[0], options["eps"], options["momentum"])


def _dropout(model: Model, item: SpecLayer) -> Dropout:
    # Its own masks, the same for the same model seed (and not the weights' stream).
    return Dropout(item.name, item.options["p"], seed=(model.seed, item.index))


def _linear(model: Model, item: SpecLayer) -> Linear:
    return Linear(item.name, int(np.prod(item.input_shape)), item.options["out"])


#: Per layer type, what builds its layer object (its weights are set by ``init_weights``).
BUILDERS: dict[str, Callable[[Model, SpecLayer], Layer]] = {
    "conv": _conv,
    "relu": lambda model, item: ReLU(item.name),
    "lrn": lambda model, item: LocalResponseNorm(item.name, **item.options),
    "maxpool": _pool,
    "avgpool": _pool,
    "gap": lambda model, item: GlobalAvgPool2d(item.name),
    "batchnorm": _batchnorm,
    "dropout": _dropout,
    "fc": _linear,
    "add": lambda model, item: Add(item.name, len(item.input_shapes)),
    "concat": lambda model, item: Concat(item.name, len(item.input_shapes)),
}

__all__ = [
    "BUILDERS",
    "CIFAR_INPUT",
    "LAYER_ARITY",
    "LAYER_OPTIONS",
    "LAYER_TYPES",
    "PRESETS",
    "ConvStage",
    "HeadStage",
    "Model",
    "Option",
    "SpecLayer",
    "accepted_keys",
    "check_entry",
    "check_spec",
    "load_spec",
    "reference_spec",
    "spec_graph",
    "walk_spec",
]
