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
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .conv import ConvExecutor, LocalConv
from .layers import Conv2d, Layer, Linear, LocalResponseNorm, MaxPool2d, ReLU

CIFAR_INPUT = (3, 32, 32)


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
        shape: tuple[int, ...] = self.input_shape
        counts: dict[str, int] = {}
        for index, entry in enumerate(self.spec):
            layer = self._build(entry, shape, counts, index)
            layer.input_shape = shape
            try:
                shape = layer.output_shape(shape)
            except ValueError as e:
                raise ValueError(f"layer {index} ({layer.name}): {e}") from None
            self.layers.append(layer)
        first_conv = next((layer for layer in self.layers if isinstance(layer, Conv2d)), None)
        if first_conv is not None and first_conv is self.layers[0]:
            first_conv.need_input_grad = False
        self.output_shape = shape
        self.init_weights(seed)

    def _build(self, entry: dict, shape: tuple[int, ...], counts: dict[str, int], index: int):
        kind = entry.get("type")
        counts[kind] = counts.get(kind, 0) + 1
        name = entry.get("name", f"{kind}{counts[kind]}")
        try:
            if kind == "conv":
                if len(shape) != 3:
                    raise ValueError(f"needs a C x H x W input, gets {shape}")
                return Conv2d(
                    name,
                    shape[0],
                    int(entry["out"]),
                    entry.get("kernel", 3),
                    entry.get("padding", 0),
                    self.executor,
                )
            if kind == "relu":
                return ReLU(name)
            if kind == "lrn":
                options = {k: entry[k] for k in ("size", "alpha", "beta", "k") if k in entry}
                return LocalResponseNorm(name, **options)
            if kind == "maxpool":
                return MaxPool2d(name, entry.get("kernel", 2), entry.get("stride"))
            if kind == "fc":
                return Linear(name, int(np.prod(shape)), int(entry["out"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"layer {index} ({entry}): {e}") from None
        raise ValueError(
            f"layer {index} has type {kind!r}; expected conv, relu, lrn, maxpool or fc"
        )

    # -- parameters --------------------------------------------------------------------------

    def parameters(self) -> dict[str, np.ndarray]:
        """Name -> parameter array (the live arrays, PyTorch names)."""
        return {f"{layer.name}.{k}": v for layer in self.layers for k, v in layer.params.items()}

    def gradients(self) -> dict[str, np.ndarray]:
        """Name -> gradient of the last backward pass."""
        return {f"{layer.name}.{k}": v for layer in self.layers for k, v in layer.grads.items()}

    def conv_layers(self) -> list[Conv2d]:
        return [layer for layer in self.layers if isinstance(layer, Conv2d)]

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
        for layer in self.layers:
            x = layer.forward(x)
        return x

    def backward(self, grad: np.ndarray) -> None:
        """Back-propagate the loss gradient w.r.t. the logits; fills every layer's ``grads``."""
        for layer in reversed(self.layers):
            grad = layer.backward(grad)
            if grad is None:
                break
