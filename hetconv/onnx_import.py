"""A network brought from PyTorch: an ONNX graph as a model spec and its initial weights.

``torch.onnx.export`` of a torchvision-style CNN gives a graph of a few operators; each becomes
one layer of the spec (:mod:`hetconv.spec`), in the graph's order, reading the layers that
produce its inputs, and the graph's initializers become its weights under the names
:class:`~hetconv.model.Model` gives them (``{layer}.weight``, ``{layer}.running_mean``):

========================  ======================================================================
ONNX                      spec
========================  ======================================================================
Conv                      ``conv`` (pads, strides; ``"bias": false`` without a bias input)
BatchNormalization        ``batchnorm`` (epsilon; ONNX's momentum m is PyTorch's 1 - m), with
                          the running statistics
Relu                      ``relu``
MaxPool, AveragePool      ``maxpool``, ``avgpool`` (square, no padding, floor mode)
GlobalAveragePool         ``gap``
Add, Concat               ``add``, ``concat`` (along channels)
Gemm                      ``fc`` (``transB`` either way; no bias input: a zero bias)
Dropout                   ``dropout`` with its ratio
LRN                       ``lrn`` (odd sizes, where ONNX's window is PyTorch's)
Flatten, Reshape          nothing: ``fc`` flattens its input (axis 1, or a reshape to batch x
                          the rest)
Identity, Constant        nothing: another name for a tensor or a value
Shape, Gather, Unsqueeze  nothing: arithmetic on shapes (a view's with a dynamic batch), on
                          constants only
========================  ======================================================================

Anything else is refused, naming the node and its operator, or the attribute the spec cannot
express (dilations, groups, ceil_mode, pooling pads, ...). Layers are named after their weights
(``layer1.0.conv1.weight`` gives layer ``layer1_0_conv1``: a layer name has no dots) or, without
weights, after their node.

Export the model with ``training=torch.onnx.TrainingMode.PRESERVE`` (or ``TRAINING``): the
default, evaluation mode, folds batch norm into the convolution before it, which gives the same
logits but a network without batch norm to train.

:func:`load_network` names a network alike for every command: a preset, a ``.json`` spec or an
``.onnx`` graph (with its initial weights). The ``onnx`` package (the ``onnx`` extra) is
imported only when a graph is read.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .model import Model, load_spec, walk_spec


def _onnx():
    try:
        import onnx
    except ImportError:
        raise ValueError(
            "reading an ONNX graph needs the onnx package: pip install 'hetconv[onnx]'"
        ) from None
    return onnx


@dataclass
class Network:
    """A network as a command names it (:func:`load_network`), or an ONNX graph's
    (:func:`import_onnx`).

    Attributes:
        spec: its model spec (a graph's: one layer per operator that computes).
        weights: a graph's initial weights (every parameter and running statistic of ``spec``
            as :class:`~hetconv.model.Model` names them), or None: the seed's.
        input_shape: the per-sample (C, H, W) a graph takes; None for a preset or a spec.
    """

    spec: list[dict]
    weights: dict[str, np.ndarray] | None = None
    input_shape: tuple[int, int, int] | None = None


def is_onnx(name: str) -> bool:
    """Whether ``name`` (a preset, a spec's path or a graph's) names an ONNX graph."""
    return str(name).lower().endswith(".onnx")


def load_network(name: str, classes: int | None = None) -> Network:
    """A network named as the commands' ``--model`` takes it: a preset, a ``.json`` spec or
    an ``.onnx`` graph (:func:`import_onnx`: its spec and initial weights).

    Args:
        name: the preset's name or the file's path.
        classes: a preset's outputs (:func:`~hetconv.spec.load_spec`); a file says its own.

    Raises:
        ValueError: what :func:`~hetconv.spec.load_spec` or :func:`import_onnx` refuses.
    """
    if is_onnx(name):
        if not Path(name).is_file():
            raise ValueError(f"ONNX graph {name} does not exist")
        return import_onnx(name)
    return Network(load_spec(name, classes=classes))


class _Refused(ValueError):
    """What the spec cannot express, naming the node (the caller names the graph)."""


def _label(node) -> str:
    return f"node {node.name or node.output[0]!r} ({node.op_type})"


def _layer_name(text: str) -> str:
    """A layer name from a tensor's or node's (no dots; letters, digits, ``_`` and ``-``)."""
    name = re.sub(r"[^A-Za-z0-9_-]+", "_", text).strip("_")
    return name or "layer"


class _Importer:
    """The graph being read: its constants, what layer (or the input) each tensor is, the
    spec and weights built so far."""

    def __init__(self, onnx, proto):
        self.onnx, self.proto = onnx, proto
        graph = proto.graph
        self.constants: dict[str, np.ndarray] = {
            t.name: onnx.numpy_helper.to_array(t) for t in graph.initializer
        }
        inputs = [i for i in graph.input if i.name not in self.constants]
        if len(inputs) != 1:
            names = ", ".join(repr(i.name) for i in inputs)
            raise _Refused(f"the graph takes {len(inputs)} inputs ({names}); a CNN takes one")
        if len(graph.output) != 1:
            raise _Refused(f"the graph gives {len(graph.output)} outputs; a CNN gives one")
        self.input = inputs[0].name
        self.input_shape = self._static_shape(inputs[0])
        self.output = graph.output[0].name
        self.shapes = self._inferred_shapes()
        self.layer_of: dict[str, str | None] = {self.input: None}  # tensor -> layer (None: input)
        self.spec: list[dict] = []
        self.weights: dict[str, np.ndarray] = {}
        self.names: set[str] = set()

    def _static_shape(self, value) -> tuple[int, int, int]:
        dims = value.type.tensor_type.shape.dim
        shape = [d.dim_value if d.HasField("dim_value") else None for d in dims]
        if len(shape) != 4 or any(d is None or d < 1 for d in shape[1:]):
            raise _Refused(
                f"the graph's input {value.name!r} has shape "
                f"{['N' if d is None else d for d in shape]}; expected N x C x H x W with C, H "
                "and W fixed"
            )
        return (int(shape[1]), int(shape[2]), int(shape[3]))

    def _inferred_shapes(self) -> dict[str, list[int | None]]:
        try:
            inferred = self.onnx.shape_inference.infer_shapes(self.proto)
        except Exception:  # noqa: BLE001 - shapes are a help for Reshape only
            return {}
        shapes = {}
        for value in (*inferred.graph.value_info, *inferred.graph.input):
            dims = value.type.tensor_type.shape.dim
            shapes[value.name] = [d.dim_value if d.HasField("dim_value") else None for d in dims]
        return shapes

    # -- reading nodes ------------------------------------------------------------------

    def constant(self, node, index: int, what: str, required: bool = True) -> np.ndarray | None:
        """Input ``index`` of ``node``, a constant (an initializer or a Constant's value)."""
        if index >= len(node.input) or not node.input[index]:
            if required:
                raise _Refused(f"{_label(node)}: has no {what}")
            return None
        name = node.input[index]
        if name not in self.constants:
            raise _Refused(f"{_label(node)}: its {what} {name!r} is computed, not a constant")
        return self.constants[name]

    def source(self, node, index: int = 0) -> str:
        """The tensor name of input ``index``, which a layer (or the network's input) gives."""
        name = node.input[index]
        if name not in self.layer_of:
            what = "a constant" if name in self.constants else "no layer's output"
            raise _Refused(f"{_label(node)}: its input {name!r} is {what}")
        return name

    def attributes(self, node) -> dict:
        helper = self.onnx.helper
        return {a.name: helper.get_attribute_value(a) for a in node.attribute}

    def alias(self, node, tensor: str) -> None:
        """``node`` computes nothing: its output is ``tensor`` under another name."""
        self.layer_of[node.output[0]] = self.layer_of[tensor]

    def unused_outputs(self, node, used: set[str], first: int = 1) -> None:
        for extra in node.output[first:]:
            if extra and extra in used:
                raise _Refused(
                    f"{_label(node)}: its output {extra!r} is read, and only its first output "
                    "can be"
                )

    def layer(
        self, node, entry: dict, reads: Sequence[str], params: Mapping[str, np.ndarray] = {}
    ) -> str:
        """Add ``entry`` as a layer reading the tensors ``reads``, with its parameters; its
        name."""
        base = self._base_name(node, params)
        name, n = base, 1
        while name in self.names:
            n += 1
            name = f"{base}_{n}"
        self.names.add(name)
        sources = [self.layer_of[t] for t in reads]
        previous = self.spec[-1]["name"] if self.spec else None
        if len(sources) == 1 and sources[0] == previous:
            inputs = None  # the layer before it (the first layer: the network's input)
        elif None in sources:
            raise _Refused(
                f"{_label(node)}: reads the network's input, which only the first layer can"
            )
        else:
            inputs = list(sources)
        out = {
            "type": entry["type"],
            "name": name,
            **{k: v for k, v in entry.items() if k != "type"},
        }
        if inputs is not None:
            out["inputs"] = inputs
        self.spec.append(out)
        for key, value in params.items():
            self.weights[f"{name}.{key}"] = np.ascontiguousarray(value, np.float32)
        self.layer_of[node.output[0]] = name
        return name

    def _base_name(self, node, params: Mapping[str, np.ndarray]) -> str:
        """The initializer's module (``layer1.0.conv1.weight`` -> ``layer1_0_conv1``), else
        the node's name."""
        for index in range(1, len(node.input)):
            tensor = node.input[index]
            if tensor in self.constants and "." in tensor:
                module, _, last = tensor.rpartition(".")
                if last in ("weight", "bias") and not module.startswith("onnx::"):
                    return _layer_name(module)
        text = node.name or node.output[0]
        parts = [p for p in text.split("/") if p]
        if len(parts) > 1 and parts[-1].split("_")[0] == node.op_type:
            parts = parts[:-1]  # torch's /module/Op: the module names the layer
        return _layer_name("_".join(parts) if parts else node.op_type.lower())

    def flat_size(self, tensor: str) -> int | None:
        shape = self.shapes.get(tensor)
        if not shape or any(d is None for d in shape[1:]):
            return None
        return int(math.prod(shape[1:]))

    # -- the walk -----------------------------------------------------------------------

    def run(self) -> Network:
        live = self._live_nodes()
        used = {name for node in live for name in node.input} | {self.output}
        for node in live:
            if node.domain not in ("", "ai.onnx"):
                raise _Refused(f"{_label(node)}: operator of domain {node.domain!r} is not ONNX's")
            handler = _NODES.get(node.op_type)
            if handler is None:
                raise _Refused(
                    f"{_label(node)}: operator {node.op_type} is not one hetconv imports "
                    f"(it imports {', '.join(sorted(_NODES))})"
                )
            handler(self, node, self.attributes(node), used)
        if self.output not in self.layer_of or self.layer_of[self.output] is None:
            raise _Refused(f"the graph's output {self.output!r} is computed by no layer")
        if self.layer_of[self.output] != self.spec[-1]["name"]:
            raise _Refused(f"the graph's output {self.output!r} is not its last layer's")
        return Network(self.spec, self.weights, self.input_shape)

    def _live_nodes(self) -> list:
        """The nodes the output depends on, in the graph's order."""
        nodes = list(self.proto.graph.node)
        needed, live = {self.output}, []
        for node in reversed(nodes):
            if any(out in needed for out in node.output):
                live.append(node)
                needed.update(node.input)
        return live[::-1]


def _pair(node, attrs: dict, key: str, default: int) -> tuple[int, int]:
    value = list(attrs.get(key, [default, default]))
    if len(value) != 2:
        raise _Refused(f"{_label(node)}: {key} {value}: a 2-d layer has two")
    return int(value[0]), int(value[1])


def _one(pair: tuple[int, int]) -> int | list[int]:
    return pair[0] if pair[0] == pair[1] else list(pair)


def _refuse_attribute(node, attrs: dict, key: str, allowed, why: str) -> None:
    if key in attrs and attrs[key] not in allowed:
        value = attrs[key]
        value = value.decode() if isinstance(value, bytes) else value
        raise _Refused(f"{_label(node)}: attribute {key} = {value!r}: {why}")


def _no_dilation(node, attrs: dict) -> None:
    dilations = list(attrs.get("dilations", [1, 1]))
    if any(d != 1 for d in dilations):
        raise _Refused(
            f"{_label(node)}: attribute dilations = {dilations}: hetconv has no dilation"
        )


def _auto_pad(node, attrs: dict) -> None:
    _refuse_attribute(
        node, attrs, "auto_pad", (b"NOTSET", b"VALID", "NOTSET", "VALID"),
        "give explicit pads (torch.onnx.export does)",
    )  # fmt: skip


def _conv(imp: _Importer, node, attrs: dict, used: set[str]) -> None:
    x = imp.source(node)
    weight = imp.constant(node, 1, "weight")
    bias = imp.constant(node, 2, "bias", required=False)
    if weight.ndim != 4:
        raise _Refused(f"{_label(node)}: weight of shape {weight.shape}: only 2-d convolutions")
    _no_dilation(node, attrs)
    _auto_pad(node, attrs)
    if attrs.get("group", 1) != 1:
        raise _Refused(
            f"{_label(node)}: attribute group = {attrs['group']}: hetconv has no grouped or "
            "depthwise convolutions"
        )
    kernel = _pair(node, attrs, "kernel_shape", 0)
    if kernel != tuple(weight.shape[2:]) and "kernel_shape" in attrs:
        raise _Refused(f"{_label(node)}: kernel_shape {kernel} is not its weight's")
    kernel = (int(weight.shape[2]), int(weight.shape[3]))
    pads = list(attrs.get("pads", [0, 0, 0, 0]))  # top, left, bottom, right
    if attrs.get("auto_pad") in (b"VALID", "VALID"):
        pads = [0, 0, 0, 0]
    top, left, bottom, right = (int(p) for p in pads)
    if top == bottom and left == right:
        padding: object = _one((top, left))
    else:
        padding = [top, bottom, left, right]
    entry = {
        "type": "conv",
        "out": int(weight.shape[0]),
        "kernel": _one(kernel),
        "padding": padding,
        "stride": _one(_pair(node, attrs, "strides", 1)),
    }
    params = {"weight": weight}
    if bias is None:
        entry["bias"] = False
    else:
        params["bias"] = bias.reshape(-1)
    imp.layer(node, entry, [x], params)


def _batchnorm(imp: _Importer, node, attrs: dict, used: set[str]) -> None:
    x = imp.source(node)
    keys = ("weight", "bias", "running_mean", "running_var")
    params = {key: imp.constant(node, i + 1, key.replace("_", " ")) for i, key in enumerate(keys)}
    imp.unused_outputs(node, used)
    momentum = round(1.0 - float(attrs.get("momentum", 0.9)), 6)
    eps = float(np.float32(attrs.get("epsilon", 1e-5)))
    eps = float(f"{eps:.6g}")  # float32's 1e-5 is 9.99999974738e-06: PyTorch's was 1e-5
    entry = {"type": "batchnorm", "eps": eps, "momentum": momentum}
    name = imp.layer(node, entry, [x], params)
    imp.weights[f"{name}.num_batches_tracked"] = np.zeros((), np.int64)  # not in ONNX


def _pool(imp: _Importer, node, attrs: dict, used: set[str]) -> None:
    x = imp.source(node)
    imp.unused_outputs(node, used)
    _no_dilation(node, attrs)
    _auto_pad(node, attrs)
    _refuse_attribute(node, attrs, "ceil_mode", (0,), "hetconv pools in floor mode")
    _refuse_attribute(node, attrs, "storage_order", (0,), "hetconv stores row-major")
    pads = list(attrs.get("pads", [0, 0, 0, 0]))
    if any(p != 0 for p in pads):
        raise _Refused(f"{_label(node)}: attribute pads = {pads}: hetconv pools without padding")
    kernel, stride = _pair(node, attrs, "kernel_shape", 0), _pair(node, attrs, "strides", 1)
    for key, pair in (("kernel_shape", kernel), ("strides", stride)):
        if pair[0] != pair[1]:
            raise _Refused(f"{_label(node)}: attribute {key} = {list(pair)}: hetconv pools square")
    kind = "maxpool" if node.op_type == "MaxPool" else "avgpool"
    imp.layer(node, {"type": kind, "kernel": kernel[0], "stride": stride[0]}, [x])


def _simple(kind: str):
    def handler(imp: _Importer, node, attrs: dict, used: set[str]) -> None:
        imp.layer(node, {"type": kind}, [imp.source(node)])

    return handler


def _merge(kind: str):
    def handler(imp: _Importer, node, attrs: dict, used: set[str]) -> None:
        if kind == "concat" and all(name in imp.constants for name in node.input):
            values = [imp.constants[name] for name in node.input]  # a shape being built
            imp.constants[node.output[0]] = np.concatenate(values, attrs.get("axis", 0))
            return
        if kind == "concat" and attrs.get("axis") not in (1, -3):
            raise _Refused(
                f"{_label(node)}: attribute axis = {attrs.get('axis')}: hetconv concatenates "
                "channels (axis 1)"
            )
        reads = [imp.source(node, i) for i in range(len(node.input))]
        if len(reads) == 1:
            imp.alias(node, reads[0])
            return
        imp.layer(node, {"type": kind}, reads)

    return handler


def _gemm(imp: _Importer, node, attrs: dict, used: set[str]) -> None:
    x = imp.source(node)
    weight = imp.constant(node, 1, "weight")
    bias = imp.constant(node, 2, "bias", required=False)
    for key in ("alpha", "beta"):
        if key in attrs and attrs[key] != 1.0:
            raise _Refused(f"{_label(node)}: attribute {key} = {attrs[key]}: expected 1")
    _refuse_attribute(node, attrs, "transA", (0,), "the batch is the first axis")
    if weight.ndim != 2:
        raise _Refused(f"{_label(node)}: weight of shape {weight.shape}: expected a matrix")
    if attrs.get("transB", 0) == 0:
        weight = weight.T
    out = int(weight.shape[0])
    if bias is None:
        bias = np.zeros(out, np.float32)
    if bias.size != out:
        raise _Refused(f"{_label(node)}: bias of shape {bias.shape} for {out} outputs")
    imp.layer(node, {"type": "fc", "out": out}, [x], {"weight": weight, "bias": bias.reshape(-1)})


def _dropout(imp: _Importer, node, attrs: dict, used: set[str]) -> None:
    x = imp.source(node)
    imp.unused_outputs(node, used)
    ratio = imp.constant(node, 1, "ratio", required=False)
    p = float(ratio) if ratio is not None else float(attrs.get("ratio", 0.5))
    imp.layer(node, {"type": "dropout", "p": float(f"{np.float32(p):.6g}")}, [x])


def _lrn(imp: _Importer, node, attrs: dict, used: set[str]) -> None:
    size = int(attrs["size"])
    if size % 2 == 0:
        raise _Refused(
            f"{_label(node)}: attribute size = {size}: ONNX centres an even window otherwise "
            "than hetconv (PyTorch)"
        )
    entry = {"type": "lrn", "size": size}
    for key, ours in (("alpha", "alpha"), ("beta", "beta"), ("bias", "k")):
        if key in attrs:
            entry[ours] = float(f"{np.float32(attrs[key]):.6g}")
    imp.layer(node, entry, [imp.source(node)])


def _flatten(imp: _Importer, node, attrs: dict, used: set[str]) -> None:
    x = imp.source(node)
    if attrs.get("axis", 1) != 1:
        raise _Refused(
            f"{_label(node)}: attribute axis = {attrs['axis']}: only the batch stays (axis 1)"
        )
    imp.alias(node, x)


def _reshape(imp: _Importer, node, attrs: dict, used: set[str]) -> None:
    x = imp.source(node)
    shape = [int(d) for d in imp.constant(node, 1, "shape").reshape(-1)]
    size = imp.flat_size(x)
    if imp.layer_of[x] is None:
        raise _Refused(f"{_label(node)}: reshapes the network's input")
    flat = len(shape) == 2 and (shape[1] == -1 or (size is not None and shape[1] == size))
    if not flat or shape[0] < -1:
        raise _Refused(
            f"{_label(node)}: reshape to {shape}: only a flattening to batch x the rest is imported"
        )
    imp.alias(node, x)


def _identity(imp: _Importer, node, attrs: dict, used: set[str]) -> None:
    name = node.input[0]
    if name in imp.constants:
        imp.constants[node.output[0]] = imp.constants[name]
        return
    imp.alias(node, imp.source(node))


def _constant(imp: _Importer, node, attrs: dict, used: set[str]) -> None:
    if "value" not in attrs:
        raise _Refused(f"{_label(node)}: only a tensor value is imported")
    imp.constants[node.output[0]] = imp.onnx.numpy_helper.to_array(attrs["value"])


def _shape(imp: _Importer, node, attrs: dict, used: set[str]) -> None:
    """The shape of a feature map, as a constant whose batch is 0: Reshape's "as the input's"
    (torch writes ``x.view(x.size(0), -1)`` with a dynamic batch as Shape, Gather, Unsqueeze,
    Concat, Reshape)."""
    x = imp.source(node)
    shape = imp.shapes.get(x)
    if not shape or any(d is None for d in shape[1:]):
        raise _Refused(f"{_label(node)}: the shape of {x!r} is not known")
    value = np.array([0, *shape[1:]], np.int64)
    imp.constants[node.output[0]] = value[attrs.get("start", 0) : attrs.get("end", len(value))]


def _on_constants(compute):
    """An operator imported on constants only (shape arithmetic), never on feature maps."""

    def handler(imp: _Importer, node, attrs: dict, used: set[str]) -> None:
        values = []
        for index, name in enumerate(node.input):
            values.append(imp.constant(node, index, f"input {index}") if name else None)
        imp.constants[node.output[0]] = np.asarray(compute(values, attrs))

    return handler


def _unsqueeze(values: list, attrs: dict) -> np.ndarray:
    axes = attrs["axes"] if "axes" in attrs else values[1].reshape(-1)
    out = values[0]
    for axis in sorted(int(a) for a in axes):
        out = np.expand_dims(out, axis if axis >= 0 else axis + out.ndim + 1)
    return out


_NODES = {
    "Conv": _conv,
    "BatchNormalization": _batchnorm,
    "Relu": _simple("relu"),
    "MaxPool": _pool,
    "AveragePool": _pool,
    "GlobalAveragePool": _simple("gap"),
    "Add": _merge("add"),
    "Concat": _merge("concat"),
    "Gemm": _gemm,
    "Dropout": _dropout,
    "LRN": _lrn,
    "Flatten": _flatten,
    "Reshape": _reshape,
    "Identity": _identity,
    "Constant": _constant,
    "Shape": _shape,
    "Gather": _on_constants(lambda v, a: np.take(v[0], v[1], axis=a.get("axis", 0))),
    "Unsqueeze": _on_constants(_unsqueeze),
}
#: The ONNX operators imported.
OPERATORS = tuple(_NODES)


def import_onnx(source) -> Network:
    """The network of an ONNX graph, checked: its spec fits its input and its weights fit
    the spec.

    Args:
        source: the ``.onnx`` file's path, its bytes, or an ``onnx.ModelProto``.

    Raises:
        ValueError: a graph that cannot be read, or one with an operator or attribute the spec
            cannot express, naming the node and its operator; the ``onnx`` package missing.
    """
    onnx = _onnx()
    where = "the graph" if isinstance(source, (bytes, onnx.ModelProto)) else f"ONNX graph {source}"
    try:
        if isinstance(source, onnx.ModelProto):
            proto = source
        else:
            read = onnx.load_from_string if isinstance(source, bytes) else onnx.load
            proto = read(source if isinstance(source, bytes) else str(source))
    except Exception as e:  # noqa: BLE001 - onnx raises DecodeError, OSError, ...
        raise ValueError(f"cannot read {where}: {e}") from None
    try:
        imported = _Importer(onnx, proto).run()
    except _Refused as e:
        raise ValueError(f"{where}: {e}") from None
    try:
        list(walk_spec(imported.spec, imported.input_shape))
        Model(imported.spec, imported.input_shape).load_state(imported.weights)
    except ValueError as e:
        raise ValueError(f"{where} imports to a network hetconv refuses: {e}") from None
    return imported


__all__ = ["OPERATORS", "Network", "import_onnx", "is_onnx", "load_network"]
