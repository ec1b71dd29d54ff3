"""Model specs: the declarative list of layers, the presets, and the walk over a spec's graph.

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
    {"type": "add", "inputs": ["bn2", "relu1"]}      # the elementwise sum, same shapes
    {"type": "concat", "inputs": ["relu3", "relu5"]} # along channels, same H and W

The spec is strict: :data:`LAYER_OPTIONS` lists, per layer type, every key it accepts with its
type, range and default; an unknown type, an unknown key, a value of the wrong type or out of
range and a missing required key are errors naming the layer, the key and what is accepted.

Layers as a graph. Every layer may name what it reads, ``"inputs": ["conv2"]``: the names of
earlier layers, as many as its type takes (:data:`LAYER_ARITY`: one, or for ``add`` and
``concat`` two or more, which they must name).
Without ``inputs`` a layer reads the layer before it (the first, the network's input), so a
list without any is the sequential network it always was. The last layer's output is the
network's output. Refused, naming the layer and the input: a name that is no layer's, the
layer's own or a later layer's (the spec's order is the graph's order, so there are no
cycles), more or fewer inputs than the type takes, and a layer from which no path reaches
the output (its work would be wasted, and its parameters would never train).
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .conv import ConvSpec, kernel_pair
from .graph import NETWORK_INPUT, LayerGraph
from .layers import pool_output_shape
from .stageops import CHANNEL_LOCAL, StageSpec

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


def _bool(value: object) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError
    return bool(value)


def _name(value: object) -> str:
    if not isinstance(value, str) or not value or "." in value:
        raise ValueError
    return value


_POOL = {
    "kernel": Option("int >= 1", _int(1), 2),
    "stride": Option("int >= 1; the kernel when absent", _int(1), None),
}
#: Per layer type, every key it accepts besides ``type``, ``name`` (a non-empty string
#: without dots, unique in the model; default: the type numbered among its kind, ``relu2``)
#: and ``inputs`` (the names of the earlier layers it reads; default: the layer before it).
LAYER_OPTIONS: dict[str, dict[str, Option]] = {
    "conv": {
        "out": Option("int >= 1: output channels", _int(1)),
        "kernel": Option("int >= 1 or [kh, kw]", _int_or_pair(1), 3),
        "padding": Option(
            '"same", "valid", int >= 0, [ph, pw] or [top, bottom, left, right]', _padding, 0
        ),
        "stride": Option("int >= 1 or [sh, sw]", _int_or_pair(1), 1),
        "bias": Option("true or false: whether it has a bias", _bool, True),
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
    "add": {},
    "concat": {},
}
LAYER_TYPES = tuple(LAYER_OPTIONS)
#: How many tensors each layer type reads (named by ``inputs``): (fewest, most; None: no
#: limit). One for every type but ``add`` and ``concat``, which read two or more.
LAYER_ARITY: dict[str, tuple[int, int | None]] = {
    kind: (2, None) if kind in ("add", "concat") else (1, 1) for kind in LAYER_TYPES
}
#: Layer types that need a C x H x W input (every one but relu, dropout, fc and add).
_NEEDS_MAPS = ("conv", "lrn", "maxpool", "avgpool", "gap", "batchnorm", "concat")


#: The keys every layer type accepts besides its options.
_EVERY_TYPE = ("type", "name", "inputs")


def accepted_keys(kind: str) -> str:
    """What a layer type accepts, for messages: ``"name (string), out (int >= 1, ...), ..."``."""
    keys = ["type", "name (string)", "inputs (list of earlier layers' names)"]
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
    unknown = [key for key in entry if key not in schema and key not in _EVERY_TYPE]
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
    """Check every entry (:func:`check_entry`), that names are unique and what each layer
    reads (:func:`spec_graph`): all of a spec that does not depend on the input's shape
    (:func:`walk_spec` checks the shapes too).

    Raises:
        ValueError: naming the layer's index, and its type, name, key or input.
    """
    spec_graph(spec)


def _checked_entries(spec: Sequence[Mapping]) -> list[tuple[str, str, dict]]:
    """(type, name, options) of each entry, checked, names defaulted and unique."""
    if isinstance(spec, (str, bytes, Mapping)) or not isinstance(spec, Sequence):
        raise ValueError(f"a model spec is a list of layer objects, got {type(spec).__name__}")
    counts: dict[str, int] = {}
    names: dict[str, int] = {}
    out = []
    for index, entry in enumerate(spec):
        kind, given, options = check_entry(index, entry)
        counts[kind] = counts.get(kind, 0) + 1
        name = given if given is not None else f"{kind}{counts[kind]}"
        if name in names:
            raise ValueError(
                f"layer {index} ({kind}) is named {name!r}, as layer {names[name]} is: "
                "names must be unique"
            )
        names[name] = index
        out.append((kind, name, options))
    return out


def _inputs_of(
    index: int, entry: Mapping, kind: str, name: str, names: Mapping[str, int]
) -> tuple[int, ...]:
    """The positions of the layers entry ``index`` reads (:data:`NETWORK_INPUT`: the
    network's input), checked against the model's layer names (``names``: name -> index)."""
    label = f"layer {index} ({kind} {name!r})"
    fewest, most = LAYER_ARITY[kind]
    takes = str(fewest) if fewest == most else f"{fewest} or more"
    if "inputs" not in entry:
        if fewest != 1:
            raise ValueError(f"{label}: {kind} reads {takes} layers: name them in inputs")
        return (index - 1,) if index > 0 else (NETWORK_INPUT,)
    given = entry["inputs"]
    if (
        not isinstance(given, (list, tuple))
        or not given
        or not all(isinstance(source, str) for source in given)
    ):
        raise ValueError(
            f"{label}: inputs is {given!r}; expected a list of the names of earlier layers"
        )
    if len(given) < fewest or (most is not None and len(given) > most):
        raise ValueError(
            f"{label} reads {len(given)} input{'s' if len(given) > 1 else ''} "
            f"({', '.join(map(repr, given))}); {kind} takes {takes}"
        )
    out = []
    for source in given:
        at = names.get(source)
        if at is None:
            raise ValueError(f"{label}: input {source!r} names no layer of the model")
        if at == index:
            raise ValueError(f"{label}: input {source!r} is the layer itself: a cycle")
        if at > index:
            raise ValueError(
                f"{label}: input {source!r} is layer {at}, after it: a layer reads earlier "
                "layers only (a later one would make a cycle)"
            )
        out.append(at)
    return tuple(out)


def spec_graph(spec: Sequence[Mapping]) -> LayerGraph:
    """Who reads whom in a checked spec (:func:`check_entry` for every entry, unique names,
    the inputs as the module docstring says).

    Raises:
        ValueError: naming the layer's index, and its type, name, key or input.
    """
    checked = _checked_entries(spec)
    names = {name: i for i, (_, name, _) in enumerate(checked)}
    inputs = tuple(
        _inputs_of(i, entry, kind, name, names)
        for i, (entry, (kind, name, _)) in enumerate(zip(spec, checked, strict=True))
    )
    graph = LayerGraph(tuple(names), inputs)
    reach = set(range(len(checked) - 1, len(checked)))  # the output and what feeds it
    for i in reversed(range(len(checked))):
        if i in reach:
            reach.update(j for j in inputs[i] if j != NETWORK_INPUT)
    for i, (kind, name, _) in enumerate(checked):
        if i not in reach:
            raise ValueError(
                f"layer {i} ({kind} {name!r}) feeds nothing: no path from it reaches the "
                f"output, the last layer ({checked[-1][1]!r}); name it in the inputs of a "
                "layer after it, or leave it out"
            )
    return graph


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


def _conv_bn(name: str, bn: str, out: int, kernel: int = 3, stride: int = 1, **extra) -> list:
    """A convolution without bias (batch norm follows, as in torchvision) and its batch norm."""
    padding = kernel // 2
    conv = {"type": "conv", "name": name, "out": out, "kernel": kernel, "padding": padding}
    conv.update(stride=stride, bias=False, **extra)
    return [conv, {"type": "batchnorm", "name": bn}]


def resnet_spec(stages: Sequence[tuple[int, int]], stem: int, classes: int = 10) -> list[dict]:
    """A CIFAR ResNet of basic blocks (He et al. 2016): a 3x3 stem of ``stem`` channels with
    batch norm and ReLU, then per stage ``(channels, blocks)`` basic blocks (conv3x3-BN-ReLU-
    conv3x3-BN, plus the shortcut, then ReLU); the first block of every stage after the first
    strides 2, and where the shape changes the shortcut is a 1x1 convolution with batch norm
    (option B). Global average pooling and ``fc`` close it. Block ``b`` of stage ``s`` names
    its layers ``s{s}b{b}_conv1``, ``_bn1``, ``_relu1``, ``_conv2``, ``_bn2``, ``_sc``,
    ``_scbn``, ``_add``, ``_out``."""
    spec = [*_conv_bn("conv1", "bn1", stem), {"type": "relu", "name": "relu1"}]
    last, channels = "relu1", stem
    for s, (out, blocks) in enumerate(stages, start=1):
        for b in range(blocks):
            p, stride = f"s{s}b{b}_", 2 if s > 1 and b == 0 else 1
            spec += _conv_bn(p + "conv1", p + "bn1", out, stride=stride, inputs=[last])
            spec += [{"type": "relu", "name": p + "relu1"}, *_conv_bn(p + "conv2", p + "bn2", out)]
            shortcut = last
            if stride != 1 or out != channels:
                spec += _conv_bn(p + "sc", p + "scbn", out, 1, stride, inputs=[last])
                shortcut = p + "scbn"
            spec += [
                {"type": "add", "name": p + "add", "inputs": [p + "bn2", shortcut]},
                {"type": "relu", "name": p + "out"},
            ]
            last, channels = p + "out", out
    return spec + [{"type": "gap", "name": "gap"}, {"type": "fc", "name": "fc", "out": classes}]


def vgg_spec(plan: Sequence[int | str], classes: int = 10) -> list[dict]:
    """VGG with batch norm for CIFAR: per number in ``plan`` a 3x3 convolution (padding 1, no
    bias), batch norm and ReLU, per ``"M"`` a 2x2 max-pool; then one ``fc``."""
    spec: list[dict] = []
    for item in plan:
        if item == "M":
            spec.append({"type": "maxpool", "kernel": 2, "stride": 2})
        else:
            n = sum(entry["type"] == "conv" for entry in spec) + 1
            spec += [*_conv_bn(f"conv{n}", f"bn{n}", int(item)), {"type": "relu"}]
    return spec + [{"type": "fc", "name": "fc", "out": classes}]


PRESETS: dict[str, list[dict]] = {
    "tiny": reference_spec(8, 16),
    "paper-50-500": reference_spec(50, 500),
    "paper-150-800": reference_spec(150, 800),
    "paper-300-1000": reference_spec(300, 1000),
    "paper-500-1500": reference_spec(500, 1500),
    "resnet20": resnet_spec([(16, 3), (32, 3), (64, 3)], stem=16),
    "resnet18": resnet_spec([(64, 2), (128, 2), (256, 2), (512, 2)], stem=64),
    "vgg11": vgg_spec([64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"]),
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
        input_shape, output_shape: what flows in (its first input) and out.
        conv: the convolution's geometry, for a ``conv`` entry; None otherwise.
        options: every key of the type (:data:`LAYER_OPTIONS`), checked, defaults filled in.
        inputs: the names of the layers it reads, in order; empty: the network's input.
        input_shapes: the shape of each of its inputs, in order.
    """

    index: int
    kind: str
    name: str
    entry: Mapping
    input_shape: tuple[int, ...]
    output_shape: tuple[int, ...]
    conv: ConvSpec | None = None
    options: Mapping = field(default_factory=dict)
    inputs: tuple[str, ...] = ()
    input_shapes: tuple[tuple[int, ...], ...] = ()


def stage_chain(graph: LayerGraph, kinds: Sequence[str], index: int) -> list[int]:
    """The positions of the layers of the fused stage of the conv at ``index``: the
    channel-local layers (:data:`~hetconv.stages.CHANNEL_LOCAL`) that follow it along a chain
    (each the only consumer of the one before, reading nothing else)."""
    return graph.chain(index, lambda j: kinds[j] in CHANNEL_LOCAL)


def _conv_spec(
    spec: Sequence[Mapping], graph: LayerGraph, kinds: Sequence[str], index: int, shape
) -> ConvSpec:
    """The convolution at ``index`` as executors see it, with its stage, the convolution its
    stage feeds and the final fc its stage feeds, all found on the graph."""
    options, names = spec_options(spec[index]), graph.names
    chain = stage_chain(graph, kinds, index)
    stage = StageSpec.from_entries([spec[j] for j in chain]) if chain else None
    after = graph.follower(chain[-1] if chain else index)
    feeds = names[after] if after is not None and kinds[after] == "conv" else None
    head = None
    last = len(kinds) - 1
    if stage is not None and after == last and kinds[last] == "fc":
        head = (names[last], int(spec[last]["out"]))
    return ConvSpec(
        names[index], shape, options["out"], kernel_pair(options["kernel"]),
        options["padding"], graph.inputs[index] != (NETWORK_INPUT,),
        stage, kernel_pair(options["stride"]), feeds=feeds, head=head, bias=options["bias"],
    )  # fmt: skip


def spec_options(entry: Mapping) -> dict:
    """The options of a checked entry, defaults filled in (:func:`check_entry`)."""
    return check_entry(0, entry)[2]


def _output_shape(kind: str, options: Mapping, shapes: Sequence[tuple[int, ...]], conv):
    """A layer's output shape from its inputs' (``conv``: its ConvSpec, for a ``conv``)."""
    shape = shapes[0]
    if kind in _NEEDS_MAPS and any(len(s) != 3 for s in shapes):
        raise ValueError(f"needs a C x H x W input, gets {', '.join(map(str, shapes))}")
    if kind == "add" and len(set(shapes)) != 1:
        raise ValueError(f"add sums inputs of one shape, gets {', '.join(map(str, shapes))}")
    if kind == "concat":
        if len({s[1:] for s in shapes}) != 1:
            raise ValueError(
                f"concat joins inputs of one height and width, gets {', '.join(map(str, shapes))}"
            )
        return (sum(s[0] for s in shapes), *shape[1:])
    if kind == "conv":
        return conv.output_shape
    if kind in ("maxpool", "avgpool"):
        return pool_output_shape(shape, options["kernel"], options["stride"])
    if kind == "gap":
        return (shape[0], 1, 1)
    if kind == "fc":
        return (options["out"],)
    return shape


def walk_spec(
    spec: Sequence[Mapping], input_shape: tuple[int, ...] = CIFAR_INPUT
) -> Iterator[SpecLayer]:
    """Each layer of a model spec with its input and output shapes, in order, allocating no
    weights: the one set of shape rules that :class:`~hetconv.model.Model` builds with and
    the cost model reads convolutions from. A convolution that reads the network's input
    needs no input gradient.

    Checks the spec (:func:`check_spec`: every entry against :data:`LAYER_OPTIONS`, unique
    names, the inputs), then that each layer fits the shapes that reach it.

    Raises:
        ValueError: naming the layer's index, and its type, name, key or input.
    """
    graph = spec_graph(spec)
    kinds = [entry["type"] for entry in spec]
    shapes: dict[int, tuple[int, ...]] = {NETWORK_INPUT: tuple(input_shape)}
    for index, entry in enumerate(spec):
        kind, name, options = kinds[index], graph.names[index], spec_options(entry)
        sources = graph.inputs[index]
        ins = tuple(shapes[i] for i in sources)
        conv = None
        try:
            if kind == "conv" and len(ins[0]) == 3:
                conv = _conv_spec(spec, graph, kinds, index, ins[0])
            out = _output_shape(kind, options, ins, conv)
        except ValueError as e:
            raise ValueError(f"layer {index} ({name}): {e}") from None
        inputs = tuple(graph.names[i] for i in sources if i != NETWORK_INPUT)
        yield SpecLayer(index, kind, name, entry, ins[0], out, conv, options, inputs, ins)
        shapes[index] = out
