"""Networks built from a small declarative spec, the named presets, and weight files.

A spec is a list of layer objects, in order, followed implicitly by softmax cross-entropy::

    {"type": "conv", "name": "conv1", "out": 50, "kernel": 5, "padding": "same", "stride": 1}
    {"type": "batchnorm", "eps": 1e-5, "momentum": 0.1}
    {"type": "relu"}
    {"type": "lrn", "size": 5}               # optional alpha, beta, k
    {"type": "maxpool", "kernel": 2, "stride": 2}
    {"type": "avgpool", "kernel": 2}
    {"type": "gap"}
    {"type": "dropout", "p": 0.5}
    {"type": "fc", "name": "fc", "out": 10}

The spec is strict: :data:`LAYER_OPTIONS` lists, per layer type, every key it accepts with its
type, range and default; an unknown type, an unknown key, a value of the wrong type or out of
range and a missing required key are errors naming the layer, the key and what is accepted.
Parameter names are PyTorch's (``conv1.weight`` as K x C x kh x kw, ``fc.weight`` as out x in,
``bn1.running_mean``), so a weight file loads into the equivalent ``nn.Module`` with
``load_state_dict``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import math
import os
import time
import zipfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .conv import ConvExecutor, ConvSpec, LocalConv, kernel_pair
from .layers import (
    AvgPool2d,
    BatchNorm2d,
    Conv2d,
    Dropout,
    GlobalAvgPool2d,
    ImageChunks,
    Layer,
    Linear,
    LocalResponseNorm,
    MaxPool2d,
    ReLU,
    chunked,
    pool_output_shape,
)
from .stages import FUSED, StageSpec, stage_of

CIFAR_INPUT = (3, 32, 32)

_REQUIRED = object()


@dataclass(frozen=True)
class Option:
    """One key a layer type accepts: what it takes (for messages), how a value is checked
    (``check`` returns the value to use or raises ValueError), and its default."""

    accepts: str
    check: Callable[[object], object]
    default: object = _REQUIRED

    def describe(self, key: str) -> str:
        if self.default is _REQUIRED:
            return f"{key} ({self.accepts}, required)"
        default = "none" if self.default is None else json.dumps(self.default)
        return f"{key} ({self.accepts}, default {default})"


def _is_int(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, np.integer))


def _int(low: int) -> Callable[[object], int]:
    def check(value: object) -> int:
        if not _is_int(value) or value < low:  # type: ignore[operator]
            raise ValueError
        return int(value)  # type: ignore[arg-type]

    return check


def _int_or_pair(low: int) -> Callable[[object], int | tuple[int, int]]:
    def check(value: object) -> int | tuple[int, int]:
        if isinstance(value, (list, tuple)):
            if len(value) != 2 or not all(_is_int(v) and v >= low for v in value):
                raise ValueError
            return (int(value[0]), int(value[1]))
        return _int(low)(value)

    return check


def _number(low: float, high: float, low_open: bool = False, high_open: bool = False):
    def check(value: object) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
            raise ValueError
        v = float(value)  # type: ignore[arg-type]
        if not math.isfinite(v) or v < low or v > high:
            raise ValueError
        if (low_open and v == low) or (high_open and v == high):
            raise ValueError
        return v

    return check


def _padding(value: object):
    if value in ("same", "valid"):
        return value
    if isinstance(value, (list, tuple)):
        if len(value) not in (2, 4) or not all(_is_int(v) and v >= 0 for v in value):
            raise ValueError
        return tuple(int(v) for v in value)
    return _int(0)(value)


def _name(value: object) -> str:
    if not isinstance(value, str) or not value or "." in value:
        raise ValueError
    return value


_POOL = {
    "kernel": Option("int >= 1", _int(1), 2),
    "stride": Option("int >= 1; the kernel when absent", _int(1), None),
}
#: Per layer type, every key it accepts besides ``type`` and ``name`` (a non-empty string
#: without dots, unique in the model; default: the type numbered among its kind, ``relu2``).
LAYER_OPTIONS: dict[str, dict[str, Option]] = {
    "conv": {
        "out": Option("int >= 1: output channels", _int(1)),
        "kernel": Option("int >= 1 or [kh, kw]", _int_or_pair(1), 3),
        "padding": Option(
            '"same", "valid", int >= 0, [ph, pw] or [top, bottom, left, right]', _padding, 0
        ),
        "stride": Option("int >= 1 or [sh, sw]", _int_or_pair(1), 1),
    },
    "relu": {},
    "lrn": {
        "size": Option("int >= 1: channels in the window", _int(1), 5),
        "alpha": Option("finite number", _number(-math.inf, math.inf), 1e-4),
        "beta": Option("finite number", _number(-math.inf, math.inf), 0.75),
        "k": Option("finite number", _number(-math.inf, math.inf), 1.0),
    },
    "maxpool": dict(_POOL),
    "avgpool": dict(_POOL),
    "gap": {},
    "batchnorm": {
        "eps": Option("number > 0", _number(0.0, math.inf, low_open=True), 1e-5),
        "momentum": Option("number in [0, 1]", _number(0.0, 1.0), 0.1),
    },
    "dropout": {"p": Option("number in [0, 1)", _number(0.0, 1.0, high_open=True), 0.5)},
    "fc": {"out": Option("int >= 1: outputs", _int(1))},
}
LAYER_TYPES = tuple(LAYER_OPTIONS)
#: Layer types that need a C x H x W input (every one but relu, dropout and fc).
_NEEDS_MAPS = ("conv", "lrn", "maxpool", "avgpool", "gap", "batchnorm")


def accepted_keys(kind: str) -> str:
    """What a layer type accepts, for messages: ``"name (string), out (int >= 1, ...), ..."``."""
    keys = ["type", "name (string)"]
    keys += [option.describe(key) for key, option in LAYER_OPTIONS[kind].items()]
    return ", ".join(keys)


def check_entry(index: int, entry: object) -> tuple[str, str | None, dict]:
    """(type, name or None, options with defaults filled in) of one spec entry.

    Raises:
        ValueError: the entry is not an object, or has an unknown type, an unknown key, a
            missing required key or a value of the wrong type or range; the message names
            the layer's index, the key and what the type accepts.
    """
    if not isinstance(entry, Mapping):
        raise ValueError(f'layer {index} is {entry!r}, not an object with a "type"')
    kind = entry.get("type")
    if not isinstance(kind, str) or kind not in LAYER_OPTIONS:
        raise ValueError(
            f"layer {index} has type {kind!r}; accepted types: {', '.join(LAYER_TYPES)}"
        )
    label = f"layer {index} ({kind})"
    name = None
    if "name" in entry:
        try:
            name = _name(entry["name"])
        except ValueError:
            raise ValueError(
                f"{label}: name {entry['name']!r} must be a non-empty string without dots"
            ) from None
        label = f"layer {index} ({kind} {name!r})"
    schema = LAYER_OPTIONS[kind]
    unknown = [key for key in entry if key not in schema and key not in ("type", "name")]
    if unknown:
        keys = ", ".join(map(repr, unknown))
        raise ValueError(
            f"{label}: unknown key{'s' if len(unknown) > 1 else ''} {keys}; "
            f"{kind} accepts {accepted_keys(kind)}"
        )
    options = {}
    for key, option in schema.items():
        if key not in entry:
            if option.default is _REQUIRED:
                raise ValueError(
                    f"{label}: missing key {key!r}; {kind} accepts {accepted_keys(kind)}"
                )
            options[key] = option.default
            continue
        try:
            options[key] = option.check(entry[key])
        except (ValueError, TypeError):
            raise ValueError(
                f"{label}: {key} is {entry[key]!r}; expected {option.accepts}"
            ) from None
    if kind in ("maxpool", "avgpool") and options["stride"] is None:
        options["stride"] = options["kernel"]
    return kind, name, options


def check_spec(spec: Sequence[Mapping]) -> None:
    """Check every entry (:func:`check_entry`) and that names are unique: all of a spec that
    does not depend on the input's shape (:func:`walk_spec` checks the shapes too).

    Raises:
        ValueError: naming the layer's index, and its type, name or key.
    """
    if isinstance(spec, (str, bytes, Mapping)) or not isinstance(spec, Sequence):
        raise ValueError(f"a model spec is a list of layer objects, got {type(spec).__name__}")
    counts: dict[str, int] = {}
    names: dict[str, int] = {}
    for index, entry in enumerate(spec):
        kind, given, _ = check_entry(index, entry)
        counts[kind] = counts.get(kind, 0) + 1
        name = given if given is not None else f"{kind}{counts[kind]}"
        if name in names:
            raise ValueError(
                f"layer {index} ({kind}) is named {name!r}, as layer {names[name]} is: "
                "names must be unique"
            )
        names[name] = index


def reference_spec(c1: int, c2: int, classes: int = 10) -> list[dict]:
    """The reference paper's network: two 5x5 convolutions with LRN and pooling, then FC."""
    return [
        {"type": "conv", "name": "conv1", "out": c1, "kernel": 5, "padding": "same"},
        {"type": "relu"},
        {"type": "lrn", "size": 5},
        {"type": "maxpool", "kernel": 2, "stride": 2},
        {"type": "conv", "name": "conv2", "out": c2, "kernel": 5, "padding": "same"},
        {"type": "relu"},
        {"type": "lrn", "size": 5},
        {"type": "maxpool", "kernel": 2, "stride": 2},
        {"type": "fc", "name": "fc", "out": classes},
    ]


PRESETS: dict[str, list[dict]] = {
    "tiny": reference_spec(8, 16),
    "paper-50-500": reference_spec(50, 500),
    "paper-150-800": reference_spec(150, 800),
    "paper-300-1000": reference_spec(300, 1000),
    "paper-500-1500": reference_spec(500, 1500),
}


def load_spec(preset_or_path: str, classes: int | None = None) -> list[dict]:
    """A preset by name, or a spec from a JSON file (a list of layer objects).

    Args:
        preset_or_path: a name in :data:`PRESETS` or the path of a ``.json`` file.
        classes: a preset's last ``fc`` gets this many outputs (a dataset's class count;
            None: the preset's 10). A file's spec is returned as written: its last ``fc``
            says its outputs.

    Raises:
        ValueError: an unknown preset, a file that cannot be read, is not a JSON list or has
            an entry :func:`check_spec` refuses (before any shape is known).
    """
    if preset_or_path in PRESETS:
        spec = copy.deepcopy(PRESETS[preset_or_path])
        if classes is not None:
            last_fc = max(i for i, entry in enumerate(spec) if entry["type"] == "fc")
            if not _is_int(classes) or classes < 1:
                raise ValueError(f"classes must be an int >= 1, got {classes!r}")
            spec[last_fc]["out"] = int(classes)
        return spec
    path = Path(preset_or_path)
    if path.suffix == ".json" and path.is_file():
        try:
            spec = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot read model spec {path}: {e}") from None
        if not isinstance(spec, list):
            raise ValueError(f"model spec {path} must be a JSON list of layer objects")
        try:
            check_spec(spec)
        except ValueError as e:
            raise ValueError(f"model spec {path}: {e}") from None
        return spec
    raise ValueError(
        f"unknown preset {preset_or_path!r}; choose one of {', '.join(PRESETS)} "
        "or give a .json spec file"
    )


@dataclass(frozen=True)
class SpecLayer:
    """One entry of a model spec, with the shapes it maps between (per sample, no batch axis).

    Attributes:
        index: its position in the spec.
        kind: ``entry["type"]``.
        name: ``entry["name"]``, or the type numbered among its kind (``relu2``).
        entry: the spec's dict.
        input_shape, output_shape: what flows in and out.
        conv: the convolution's geometry, for a ``conv`` entry; None otherwise.
        options: every key of the type (:data:`LAYER_OPTIONS`), checked, defaults filled in.
    """

    index: int
    kind: str
    name: str
    entry: Mapping
    input_shape: tuple[int, ...]
    output_shape: tuple[int, ...]
    conv: ConvSpec | None = None
    options: Mapping = field(default_factory=dict)


def walk_spec(
    spec: Sequence[Mapping], input_shape: tuple[int, ...] = CIFAR_INPUT
) -> Iterator[SpecLayer]:
    """Each layer of a model spec with its input and output shape, in order, allocating no
    weights: the one set of shape rules that :class:`Model` builds with and the cost model
    reads convolutions from. A network's first layer, if a convolution, needs no input
    gradient.

    Checks the spec (:func:`check_spec`: every entry against :data:`LAYER_OPTIONS`, unique
    names), then that each layer fits the shape that reaches it.

    Raises:
        ValueError: naming the layer's index, and its type, name or key.
    """
    check_spec(spec)
    shape = tuple(input_shape)
    counts: dict[str, int] = {}
    for index, entry in enumerate(spec):
        kind, given, options = check_entry(index, entry)
        counts[kind] = counts.get(kind, 0) + 1
        name = given if given is not None else f"{kind}{counts[kind]}"
        conv, out = None, shape
        try:
            if kind in _NEEDS_MAPS and len(shape) != 3:
                raise ValueError(f"needs a C x H x W input, gets {shape}")
            if kind == "conv":
                stride = kernel_pair(options["stride"])
                conv = ConvSpec(
                    name, shape, options["out"], kernel_pair(options["kernel"]),
                    options["padding"], index > 0,
                    _stage_after(spec, index), stride, head=_head_after(spec, index),
                )  # fmt: skip
                out = conv.output_shape
            elif kind in ("maxpool", "avgpool"):
                out = pool_output_shape(shape, options["kernel"], options["stride"])
            elif kind == "gap":
                out = (shape[0], 1, 1)
            elif kind == "fc":
                out = (options["out"],)
        except ValueError as e:
            raise ValueError(f"layer {index} ({name}): {e}") from None
        yield SpecLayer(index, kind, name, entry, shape, out, conv, options)
        shape = out


def _stage_after(spec: Sequence[Mapping], index: int) -> StageSpec | None:
    """The stage after the conv at ``index``; None when none (entries already checked)."""
    return stage_of(spec[index + 1 :])


def _head_after(spec: Sequence[Mapping], index: int) -> tuple[str, int] | None:
    """(name, classes) of the network's final fc when the stage of the conv at ``index``
    feeds it directly (:mod:`hetconv.head`); None otherwise (entries already checked)."""
    stage = _stage_after(spec, index)
    last = spec[-1]
    if stage is None or last.get("type") != "fc" or index + len(stage.ops) + 2 != len(spec):
        return None
    count = sum(entry.get("type") == "fc" for entry in spec)
    return last.get("name") or f"fc{count}", int(last["out"])


class ConvStage:
    """A convolution and the channel-local layers after it, as one step of the model's passes
    when its executor supports fused stages (:mod:`hetconv.stages`).

    It holds the model's own layer objects: unfused (the executor's choice per layer), it runs
    them one after another exactly as a model without stages does; fused, the executor runs
    them on every node's kernel slice and only the stage's output comes back.
    """

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
            conv.name, x, w, conv.params["bias"], padding, self.stage, self.batchnorm, **extra
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
            conv.name, conv._x, conv._w, conv.params["bias"], dy, conv._padding,
            conv.need_input_grad, self.stage, self.batchnorm, **extra,
        )  # fmt: skip
        dx, dw, db = out[:3]
        self.head_grad = out[3] if head is not None else None
        dx, dw = conv.restore(dx, dw)
        conv.grads = {"weight": dw, "bias": db}
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
    """A feed-forward network: layers in order, softmax cross-entropy on top.

    Args:
        spec: list of layer dicts (see the module docstring).
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
        stages: dict[int, StageSpec] = {}
        for item in walk_spec(self.spec, self.input_shape):
            layer = self._build(item)
            layer.input_shape = item.input_shape
            self.layers.append(layer)
            self.output_shape = item.output_shape
            if item.conv is not None and item.conv.stage is not None:
                layer.stage = item.conv.stage
                layer.head = item.conv.head
                stages[item.index] = item.conv.stage
        # What the passes run: the layers, or with an executor that supports fused stages,
        # each convolution with its channel-local chain as one ConvStage.
        self.blocks: list[Layer | ConvStage] = chunked(self.layers)
        if self.executor.supports_stages:
            self.blocks = []
            i = 0
            while i < len(self.layers):
                stage = stages.get(i)
                if stage is None:
                    self.blocks.append(self.layers[i])
                    i += 1
                    continue
                chain = self.layers[i + 1 : i + 1 + len(stage.ops)]
                self.blocks.append(ConvStage(self.layers[i], chain, stage))  # type: ignore[arg-type]
                i += 1 + len(stage.ops)
            # The last stage feeding the final fc directly: the executor may split the fc too.
            last = self.blocks[-2:]
            if (
                self.executor.supports_head
                and len(last) == 2
                and isinstance(last[0], ConvStage)
                and isinstance(last[1], Linear)
            ):
                self.blocks[-2:] = [HeadStage(last[0], last[1])]
        self.init_weights(seed)

    def _build(self, item: SpecLayer) -> Layer:
        name, options, kind = item.name, item.options, item.kind
        if item.conv is not None:
            conv = item.conv
            layer = Conv2d(
                name,
                conv.input_shape[0],
                conv.kernels,
                conv.kernel_size,
                conv.padding,
                self.executor,
                conv.stride,
            )
            layer.need_input_grad = conv.need_input_grad
            return layer
        if kind == "relu":
            return ReLU(name)
        if kind == "lrn":
            return LocalResponseNorm(name, **options)
        if kind == "maxpool":
            return MaxPool2d(name, options["kernel"], options["stride"])
        if kind == "avgpool":
            return AvgPool2d(name, options["kernel"], options["stride"])
        if kind == "gap":
            return GlobalAvgPool2d(name)
        if kind == "batchnorm":
            return BatchNorm2d(name, item.input_shape[0], options["eps"], options["momentum"])
        if kind == "dropout":
            # Its own masks, the same for the same model seed (and not the weights' stream).
            return Dropout(name, options["p"], seed=(self.seed, item.index))
        return Linear(name, int(np.prod(item.input_shape)), options["out"])

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

    def conv_layers(self) -> list[Conv2d]:
        return [layer for layer in self.layers if isinstance(layer, Conv2d)]

    def conv_specs(self) -> list[ConvSpec]:
        """The convolution layers as executors see them (what ``executor.prepare`` takes): a
        strided one as the stride-1 convolution of its phases (:attr:`ConvSpec.executed`)."""
        specs = []
        for i, layer in enumerate(self.layers):
            if not isinstance(layer, Conv2d):
                continue
            spec = layer.spec.executed
            after = i + 1 + (len(spec.stage.ops) if spec.stage is not None else 0)
            if after < len(self.layers) and isinstance(self.layers[after], Conv2d):
                spec = dataclasses.replace(spec, feeds=self.layers[after].name)
            specs.append(spec)
        return specs

    def other_seconds(self, batch: int, repeats: int = 2) -> dict[str, float]:
        """Seconds of each non-convolutional layer's forward and backward on ``batch`` images'
        worth of random input, the best of ``repeats`` (the first also faults its arrays in),
        run as the passes run them: image-local layers in image chunks, a chunked run's time
        split evenly among its layers (copies of the layers: the model's state, batch norm's
        running statistics and dropout's masks, is left as it was)."""
        rng = np.random.default_rng(0)
        out = {}
        for step in chunked(self.layers):
            if isinstance(step, Conv2d):
                continue
            layers = step.layers if isinstance(step, ImageChunks) else [step]
            twin = copy.deepcopy(step)
            if isinstance(twin, Dropout):
                twin.step = 0
            x = rng.standard_normal((batch, *layers[0].input_shape)).astype(np.float32)
            best = math.inf
            for _ in range(max(1, repeats)):
                start = time.perf_counter()
                y = twin.forward(x)
                twin.backward(np.ones_like(y))
                best = min(best, time.perf_counter() - start)
                del y
            for layer in layers:
                out[layer.name] = best / len(layers)
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
            for key in ("weight", "bias"):
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

    def save(self, path: str | os.PathLike) -> None:
        """Write the parameters and buffers as an .npz file (written to a temporary name, then
        renamed)."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            np.savez(f, **self.state())
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
        for block in self.blocks:
            x = block.forward(x)
        return x

    def backward(self, grad: np.ndarray) -> None:
        """Back-propagate the loss gradient w.r.t. the logits; fills every layer's ``grads``."""
        for block in reversed(self.blocks):
            if grad is None and not (isinstance(block, ConvStage) and block.backward_pending()):
                break
            grad = block.backward(grad)
