"""A trained network as an ONNX graph, so that it runs anywhere ONNX does.

The graph is built from the model spec with the ``onnx`` package's helper API (the ``onnx``
extra: ``pip install 'hetconv[onnx]'``) in evaluation mode: one node per layer, the weights as
initializers under their PyTorch names.

=============  ==========================================================================
spec           ONNX
=============  ==========================================================================
``conv``       Conv (pads top, left, bottom, right; strides; the bias where it has one)
``relu``       Relu
``lrn``        LRN (odd sizes; an even size's window is centred as PyTorch's, not ONNX's, so it
               is built from Mul, Pad, AveragePool, Pow)
``maxpool``    MaxPool (no padding, floor mode)
``avgpool``    AveragePool (no padding, floor mode)
``gap``        GlobalAveragePool
``batchnorm``  BatchNormalization with the running statistics (inference mode)
``dropout``    nothing: the identity in evaluation
``fc``         Flatten (when its input is not flat yet), then Gemm with ``transB = 1``
``add``        Add (two inputs), Sum (more)
``concat``     Concat along axis 1 (channels)
=============  ==========================================================================

A layer's node reads the outputs of the layers it names as its inputs (the one before it by
default). The graph takes float32 ``input`` (N, C, H, W), N free, normalised as in training,
and gives ``logits`` float32 (N, classes): :meth:`hetconv.model.Model.forward` in evaluation mode.

Given the weight file's :class:`~hetconv.description.Description`, the model's metadata
(``metadata_props``) states the normalisation (``normalisation``, its formula; ``mean``,
``std``, ``pixel_scale``, ``raw``), ``input_shape``, ``classes``, ``class_names`` and
``network``; with ``normalise`` the graph starts with the normalisation itself (Div by 255 for
uint8 pixels, Sub mean, Div std, per channel), so ``input`` takes the raw values as the data
held them (pixels 0..255 as float32), and ``input`` in the metadata says which one it takes.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from .backends import Padding
from .description import UINT8, Description
from .model import Model
from .spec import SpecLayer, walk_spec

#: The opset the graph declares: every operator above has had its present form since then,
#: and runtimes from 2022 on run it.
OPSET = 17
#: The IR version written (the lowest that opset 17 allows), for older runtimes' sake.
IR_VERSION = 8


def _onnx():
    try:
        import onnx
    except ImportError:
        raise ValueError(
            "exporting to ONNX needs the onnx package: pip install 'hetconv[onnx]'"
        ) from None
    return onnx


class _Graph:
    """The nodes and initializers of the graph being built, and the weights they read."""

    def __init__(self, onnx, state: Mapping[str, np.ndarray]):
        self.helper, self.numpy_helper = onnx.helper, onnx.numpy_helper
        self.state = state
        self.nodes: list = []
        self.initializers: list = []

    def weight(self, key: str) -> str:
        """``key``'s array as an initializer of its name."""
        array = np.asarray(self.state[key], np.float32)
        self.initializers.append(self.numpy_helper.from_array(array, key))
        return key

    def node(self, op: str, inputs: list[str], out: str, name: str, **attributes) -> str:
        self.nodes.append(self.helper.make_node(op, inputs, [out], name=name, **attributes))
        return out


def _conv(g: _Graph, item: SpecLayer, xs: list[str], out: str) -> str:
    x = xs[0]
    conv, layer = item.conv, item.name
    pads = Padding.resolve(conv.padding, conv.kernel_size)
    inputs = [x, g.weight(f"{layer}.weight")]
    if item.options["bias"]:
        inputs.append(g.weight(f"{layer}.bias"))
    return g.node(
        "Conv", inputs, out, layer,
        kernel_shape=list(conv.kernel_size), strides=list(conv.stride),
        pads=[pads.top, pads.left, pads.bottom, pads.right],
    )  # fmt: skip


def _lrn(g: _Graph, item: SpecLayer, xs: list[str], out: str) -> str:
    x = xs[0]
    o = item.options
    if o["size"] % 2 == 0:
        g.nodes.extend(_even_lrn(g.helper, g.numpy_helper, g.initializers, item.name, x, out, o))
        return out
    return g.node(
        "LRN", [x], out, item.name, size=o["size"], alpha=o["alpha"], beta=o["beta"], bias=o["k"]
    )


def _pool(g: _Graph, item: SpecLayer, xs: list[str], out: str) -> str:
    x = xs[0]
    o = item.options
    op = "MaxPool" if item.kind == "maxpool" else "AveragePool"
    return g.node(
        op, [x], out, item.name, kernel_shape=[o["kernel"]] * 2, strides=[o["stride"]] * 2
    )


def _batchnorm(g: _Graph, item: SpecLayer, xs: list[str], out: str) -> str:
    x = xs[0]
    keys = ("weight", "bias", "running_mean", "running_var")
    inputs = [x] + [g.weight(f"{item.name}.{key}") for key in keys]
    return g.node("BatchNormalization", inputs, out, item.name, epsilon=item.options["eps"])


def _fc(g: _Graph, item: SpecLayer, xs: list[str], out: str) -> str:
    x = xs[0]
    layer = item.name
    if len(item.input_shape) != 1:
        x = g.node("Flatten", [x], f"{layer}.flatten", f"{layer}.flatten", axis=1)
    inputs = [x, g.weight(f"{layer}.weight"), g.weight(f"{layer}.bias")]
    return g.node("Gemm", inputs, out, layer, transB=1)


#: Per layer type, what adds its nodes: (graph, layer, its input tensors, output name) -> the
#: tensor that holds its output.
NODES: dict[str, Callable[[_Graph, SpecLayer, list[str], str], str]] = {
    "conv": _conv,
    "relu": lambda g, item, xs, out: g.node("Relu", xs, out, item.name),
    "lrn": _lrn,
    "maxpool": _pool,
    "avgpool": _pool,
    "gap": lambda g, item, xs, out: g.node("GlobalAveragePool", xs, out, item.name),
    "batchnorm": _batchnorm,
    "dropout": lambda g, item, xs, out: xs[0],  # the identity in evaluation
    "fc": _fc,
    "add": lambda g, item, xs, out: g.node("Add" if len(xs) == 2 else "Sum", xs, out, item.name),
    "concat": lambda g, item, xs, out: g.node("Concat", xs, out, item.name, axis=1),
}


def build_onnx(
    spec: Sequence[Mapping],
    weights: Mapping[str, np.ndarray],
    input_shape: tuple[int, int, int],
    name: str = "hetconv",
    description: Description | None = None,
    normalise: bool = False,
):
    """The network ``spec`` with ``weights`` as a checked ``onnx.ModelProto``: a node per
    layer (:data:`NODES`), each reading the outputs of the layers it names as inputs.

    Args:
        spec: the model spec (:mod:`hetconv.model`).
        weights: name -> array, as :meth:`Model.state` gives them or a weight file holds
            (parameters and batch norm's running statistics; checked against the spec).
        input_shape: per-sample (C, H, W).
        name: the graph's name.
        description: what the metadata states (the input's normalisation, classes...).
        normalise: start the graph with ``description``'s normalisation (raw values in).

    Raises:
        ValueError: a spec or weights that do not fit each other, ``normalise`` without a
            description, or the ``onnx`` package missing.
    """
    onnx = _onnx()
    model = Model(spec, input_shape)
    model.load_state(dict(weights))
    g = _Graph(onnx, model.state())
    tensors: dict[str, str] = {}  # layer -> the tensor of its output
    first = current = "input"
    if normalise:
        if description is None:
            raise ValueError("the graph cannot normalise its input: the normalisation is unknown")
        first = _normalising_nodes(g, description)
    for item in walk_spec(spec, input_shape):
        xs = [tensors[name] for name in item.inputs] or [first]
        out = f"{item.name}/output" if item.index < len(spec) - 1 else "logits"
        current = tensors[item.name] = NODES[item.kind](g, item, xs, out)
    if current != "logits":  # the spec ends in dropout (or is empty): name the output
        g.node("Identity", [current], "logits", "logits")
    helper, float32 = onnx.helper, onnx.TensorProto.FLOAT
    graph = helper.make_graph(
        g.nodes,
        name,
        [helper.make_tensor_value_info("input", float32, ["N", *input_shape])],
        [helper.make_tensor_value_info("logits", float32, ["N", *model.output_shape])],
        initializer=g.initializers,
    )
    proto = helper.make_model(
        graph, producer_name="hetconv", opset_imports=[helper.make_opsetid("", OPSET)]
    )
    proto.ir_version = IR_VERSION
    if description is not None:
        helper.set_model_props(proto, _metadata(description, normalise))
    onnx.checker.check_model(proto, full_check=True)
    return proto


def _normalising_nodes(g: _Graph, description: Description) -> str:
    """``input``'s raw values as training normalised them, in the order and precision of
    :meth:`hetconv.dataset.ImageDataset.batch` (float32); returns the normalised tensor."""

    def constant(key: str, values) -> str:
        array = np.asarray(values, np.float32)
        g.initializers.append(g.numpy_helper.from_array(array.reshape(1, -1, 1, 1), key))
        return key

    x = "input"
    if description.raw == UINT8:
        x = g.node("Div", [x, constant("normalise.255", [255.0])], "input/scaled", "scale")
    elif description.scale != 1.0:
        x = g.node("Mul", [x, constant("normalise.scale", [description.scale])], "input/scaled",
                   "scale")  # fmt: skip
    x = g.node("Sub", [x, constant("normalise.mean", description.mean)], "input/centred", "centre")
    return g.node("Div", [x, constant("normalise.std", description.std)], "input/normalised",
                  "normalise")  # fmt: skip


def _metadata(description: Description, normalise: bool) -> dict[str, str]:
    """The model's ``metadata_props``: strings, lists as JSON."""
    raw = "pixels 0..255 as float32" if description.raw == UINT8 else "values as the data held"
    props = {
        "network": description.network,
        "input": f"raw: {raw} (the graph normalises)" if normalise else "normalised",
        "normalisation": f"input = {description.formula()} per channel c",
        "mean": json.dumps(list(description.mean)),
        "std": json.dumps(list(description.std)),
        "pixel_scale": repr(description.scale),
        "raw": description.raw,
        "input_shape": json.dumps(list(description.input_shape)),
        "classes": str(description.classes),
    }
    if description.class_names:
        props["class_names"] = json.dumps(list(description.class_names))
    return props


def _even_lrn(helper, numpy_helper, initializers, layer, x, out, o) -> list:
    """PyTorch's LRN of even size as elementary nodes: ONNX's LRN centres an even window one
    channel off (``floor((size - 1) / 2)`` channels before, PyTorch ``size // 2``). The squares
    get ``size // 2`` zero channels before and ``(size - 1) // 2`` after, a size x 1 x 1 average
    pool over a channel axis sums each window (over ``size``), and then
    ``y = x * (k + alpha * mean) ** -beta``, as ``torch.nn.functional.local_response_norm``."""
    size = o["size"]
    before, after = size // 2, (size - 1) // 2

    def constant(suffix: str, value: np.ndarray) -> str:
        name = f"{layer}.{suffix}"
        initializers.append(numpy_helper.from_array(value, name))
        return name

    axis = constant("axis", np.array([1], np.int64))
    pads = constant("pads", np.array([0, 0, before, 0, 0, 0, 0, after, 0, 0], np.int64))
    alpha = constant("alpha", np.array(o["alpha"], np.float32))
    k = constant("k", np.array(o["k"], np.float32))
    power = constant("power", np.array(-o["beta"], np.float32))
    t = f"{layer}/"
    return [
        helper.make_node("Mul", [x, x], [t + "square"], name=t + "square"),
        helper.make_node("Unsqueeze", [t + "square", axis], [t + "5d"], name=t + "5d"),
        helper.make_node("Pad", [t + "5d", pads], [t + "padded"], name=t + "padded"),
        helper.make_node(
            "AveragePool",
            [t + "padded"],
            [t + "mean5d"],
            name=t + "mean5d",
            kernel_shape=[size, 1, 1],
        ),  # fmt: skip
        helper.make_node("Squeeze", [t + "mean5d", axis], [t + "mean"], name=t + "mean"),
        helper.make_node("Mul", [t + "mean", alpha], [t + "scaled"], name=t + "scaled"),
        helper.make_node("Add", [t + "scaled", k], [t + "scale"], name=t + "scale"),
        helper.make_node("Pow", [t + "scale", power], [t + "inverse"], name=t + "inverse"),
        helper.make_node("Mul", [x, t + "inverse"], [out], name=layer),
    ]


def export_onnx(
    spec: Sequence[Mapping],
    weights: Mapping[str, np.ndarray],
    input_shape: tuple[int, int, int],
    path,
    description: Description | None = None,
    normalise: bool = False,
) -> None:
    """Write :func:`build_onnx`'s graph to ``path``."""
    proto = build_onnx(spec, weights, input_shape, description=description, normalise=normalise)
    _onnx().save_model(proto, str(path))


__all__ = ["IR_VERSION", "NODES", "OPSET", "build_onnx", "export_onnx"]
