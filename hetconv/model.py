"""Networks built from a small declarative spec, the named presets, and weight files.

A spec is a list of layer dicts, in order::

    {"type": "conv", "name": "conv1", "out": 50, "kernel": 5, "padding": "same"}
    {"type": "relu"}
    {"type": "lrn", "size": 5}               # optional alpha, beta, k
    {"type": "maxpool", "kernel": 2, "stride": 2}
    {"type": "fc", "name": "fc", "out": 10}

followed, implicitly, by softmax cross-entropy. Parameter names are PyTorch's
(``conv1.weight`` as K x C x kh x kw, ``fc.weight`` as out x in), so a weight file loads into
the equivalent ``nn.Module`` with ``load_state_dict``.
"""

from __future__ import annotations

import json
import os
import zipfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .conv import ConvExecutor, ConvSpec, LocalConv, kernel_pair
from .layers import (
    Conv2d,
    Layer,
    Linear,
    LocalResponseNorm,
    MaxPool2d,
    ReLU,
    pool_geometry,
    pool_output_shape,
)
from .stages import FUSED, StageSpec, stage_of

CIFAR_INPUT = (3, 32, 32)
LAYER_TYPES = ("conv", "relu", "lrn", "maxpool", "fc")


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


def load_spec(preset_or_path: str) -> list[dict]:
    """A preset by name, or a spec from a JSON file (a list of layer dicts)."""
    if preset_or_path in PRESETS:
        return PRESETS[preset_or_path]
    path = Path(preset_or_path)
    if path.suffix == ".json" and path.is_file():
        try:
            spec = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot read model spec {path}: {e}") from None
        if not isinstance(spec, list):
            raise ValueError(f"model spec {path} must be a JSON list of layer objects")
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
    """

    index: int
    kind: str
    name: str
    entry: Mapping
    input_shape: tuple[int, ...]
    output_shape: tuple[int, ...]
    conv: ConvSpec | None = None


def walk_spec(
    spec: Sequence[Mapping], input_shape: tuple[int, ...] = CIFAR_INPUT
) -> Iterator[SpecLayer]:
    """Each layer of a model spec with its input and output shape, in order, allocating no
    weights: the one set of shape rules that :class:`Model` builds with and the cost model
    reads convolutions from. A network's first layer, if a convolution, needs no input
    gradient.

    Checks types, shapes and the options that decide them; the layers check the rest of
    their options (an LRN's size) when the model builds them.

    Raises:
        ValueError: naming the layer's index, and its entry or name.
    """
    shape = tuple(input_shape)
    counts: dict[str, int] = {}
    for index, entry in enumerate(spec):
        kind = entry.get("type")
        counts[kind] = counts.get(kind, 0) + 1
        name = entry.get("name", f"{kind}{counts[kind]}")
        if kind not in LAYER_TYPES:
            raise ValueError(
                f"layer {index} has type {kind!r}; expected conv, relu, lrn, maxpool or fc"
            )
        conv, out = None, shape
        try:  # the options that decide the shapes
            if kind == "conv":
                if len(shape) != 3:
                    raise ValueError(f"needs a C x H x W input, gets {shape}")
                kernel = kernel_pair(entry.get("kernel", 3))
                padding = entry.get("padding", 0)
                conv = ConvSpec(
                    name, shape, int(entry["out"]), kernel, padding, index > 0,
                    _stage_after(spec, index),
                )  # fmt: skip
            elif kind == "maxpool":
                pool = pool_geometry(entry.get("kernel", 2), entry.get("stride"))
            elif kind == "fc":
                out = (int(entry["out"]),)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"layer {index} ({entry}): {e}") from None
        try:  # the shapes
            if conv is not None:
                out = conv.output_shape
            elif kind == "maxpool":
                out = pool_output_shape(shape, *pool)
        except ValueError as e:
            raise ValueError(f"layer {index} ({name}): {e}") from None
        yield SpecLayer(index, kind, name, entry, shape, out, conv)
        shape = out


def _stage_after(spec: Sequence[Mapping], index: int) -> StageSpec | None:
    """The stage after the conv at ``index``; None when none, or when its options are bad
    (the layers refuse those, naming them, when the model builds them)."""
    try:
        return stage_of(spec[index + 1 :])
    except (TypeError, ValueError):
        return None


class ConvStage:
    """A convolution and the channel-local layers after it, as one step of the model's passes
    when its executor supports fused stages (:mod:`hetconv.stages`).

    It holds the model's own layer objects: unfused (the executor's choice per layer), it runs
    them one after another exactly as a model without stages does; fused, the executor runs
    them on every node's kernel slice and only the stage's output comes back.
    """

    def __init__(self, conv: Conv2d, chain: Sequence[Layer], stage: StageSpec):
        self.conv, self.chain, self.stage = conv, list(chain), stage
        self.name = conv.name
        self._fused: bool | None = None

    def forward(self, x: np.ndarray) -> np.ndarray:
        conv = self.conv
        self._fused = conv.executor.stage_mode(conv.name) == FUSED
        if not self._fused:
            for layer in (conv, *self.chain):
                x = layer.forward(x)
            return x
        conv._x = x
        p = conv.params
        return conv.executor.stage_forward(
            conv.name, x, p["weight"], p["bias"], conv.padding, self.stage
        )

    def backward(self, dy: np.ndarray) -> np.ndarray | None:
        conv = self.conv
        if self._fused is None:
            raise RuntimeError(f"{conv.name}: backward before forward")
        if not self._fused:
            for layer in (*reversed(self.chain), conv):
                dy = layer.backward(dy)
            return dy
        p = conv.params
        dx, dw, db = conv.executor.stage_backward(
            conv.name, conv._x, p["weight"], p["bias"], dy, conv.padding,
            conv.need_input_grad, self.stage,
        )  # fmt: skip
        conv.grads = {"weight": dw, "bias": db}
        return dx

    def __repr__(self) -> str:
        return f"ConvStage({self.conv!r}, {self.chain!r})"


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
        self.spec = [dict(layer) for layer in spec]
        self.input_shape = tuple(input_shape)
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
                stages[item.index] = item.conv.stage
        # What the passes run: the layers, or with an executor that supports fused stages,
        # each convolution with its channel-local chain as one ConvStage.
        self.blocks: list[Layer | ConvStage] = list(self.layers)
        if getattr(self.executor, "supports_stages", False):
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
        self.init_weights(seed)

    def _build(self, item: SpecLayer) -> Layer:
        entry, name = item.entry, item.name
        try:
            if item.conv is not None:
                conv = item.conv
                layer = Conv2d(
                    name,
                    conv.input_shape[0],
                    conv.kernels,
                    conv.kernel_size,
                    conv.padding,
                    self.executor,
                )
                layer.need_input_grad = conv.need_input_grad
                return layer
            if item.kind == "relu":
                return ReLU(name)
            if item.kind == "lrn":
                options = {k: entry[k] for k in ("size", "alpha", "beta", "k") if k in entry}
                return LocalResponseNorm(name, **options)
            if item.kind == "maxpool":
                return MaxPool2d(name, entry.get("kernel", 2), entry.get("stride"))
            return Linear(name, int(np.prod(item.input_shape)), int(entry["out"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"layer {item.index} ({entry}): {e}") from None

    # -- parameters --------------------------------------------------------------------------

    def parameters(self) -> dict[str, np.ndarray]:
        """Name -> parameter array (the live arrays, PyTorch names)."""
        return {f"{layer.name}.{k}": v for layer in self.layers for k, v in layer.params.items()}

    def gradients(self) -> dict[str, np.ndarray]:
        """Name -> gradient of the last backward pass."""
        return {f"{layer.name}.{k}": v for layer in self.layers for k, v in layer.grads.items()}

    def conv_layers(self) -> list[Conv2d]:
        return [layer for layer in self.layers if isinstance(layer, Conv2d)]

    def conv_specs(self) -> list[ConvSpec]:
        """The convolution layers as executors see them (what ``executor.prepare`` takes)."""
        return [layer.spec for layer in self.conv_layers()]

    def init_weights(self, seed: int) -> None:
        """PyTorch's default initialisation: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for all."""
        rng = np.random.default_rng(seed)
        for layer in self.layers:
            if not layer.params:
                continue
            weight = layer.params["weight"]
            bound = 1.0 / np.sqrt(np.prod(weight.shape[1:]))
            for key in ("weight", "bias"):
                p = layer.params[key]
                p[...] = rng.uniform(-bound, bound, size=p.shape).astype(np.float32)

    def load_state(self, state: dict[str, np.ndarray]) -> None:
        """Copy parameters in, checking names, shapes and that values are finite."""
        params = self.parameters()
        missing = sorted(set(params) - set(state))
        unexpected = sorted(set(state) - set(params))
        if missing or unexpected:
            raise ValueError(
                f"weights do not match the model: missing {missing}, unexpected {unexpected}"
            )
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
        """Write the parameters as an .npz file (written to a temporary name, then renamed)."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            np.savez(f, **self.parameters())
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

    def forward(self, x: np.ndarray) -> np.ndarray:
        """Logits float32 (N, classes) for float32 (N, C, H, W) inputs."""
        if x.dtype != np.float32 or x.shape[1:] != self.input_shape:
            raise ValueError(
                f"input has shape {x.shape} and dtype {x.dtype}; expected float32 "
                f"(N, {', '.join(map(str, self.input_shape))})"
            )
        for block in self.blocks:
            x = block.forward(x)
        return x

    def backward(self, grad: np.ndarray) -> None:
        """Back-propagate the loss gradient w.r.t. the logits; fills every layer's ``grads``."""
        for block in reversed(self.blocks):
            grad = block.backward(grad)
            if grad is None:
                break
