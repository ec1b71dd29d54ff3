"""A network cut in two: its first part split by images among the workers, the rest on the
master (``hetconv train --split LAYER=images``).

The first part, the layers up to a convolution and the channel-local layers after it (batch
norm, ReLU, LRN, pooling), runs as the whole network does when split by images with the ring
(:mod:`hetconv.master.ring`): every worker keeps its weights and momentum, runs it on its own
range of the batch (batch norm's statistics summed among the workers mid-pass), and the
workers sum its gradient by the ring and each apply the same update. The rest, whose
activations are small and whose weights are most of the model's (vgg11's last convolutions
and its fc), runs on the master, on the whole batch. Per step, two calls to each worker:
FORWARD answers the first part's output on its images, the master runs the rest, the loss and
the rest's backward on the whole batch, and BACKWARD brings each worker the gradient of its
images' output, which it back-propagates through the first part before the ring's sum.

Where the first part's gradient is small beside the whole network's and its activations at
the cut are small beside those before it, this moves far fewer bytes than the whole network
split by images (the ring carries the first part's gradient only) and leaves no layer with
large activations to split by kernels. The step is the batch's, the same as one machine's to
float32 round-off: each worker's part of the first part's gradient is that of its images'
rows of the batch's mean-loss gradient, and the parts are summed.

Here: where to cut (:func:`cut_after`), the two parts' specs (:func:`cut_spec`) and what
``--split`` says (:func:`cut_layer`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .graph import NETWORK_INPUT
from .spec import spec_graph
from .stageops import CHANNEL_LOCAL

#: ImagesStep.cut_phase: a whole step, the first part's forward, its backward.
WHOLE, FORWARD, BACKWARD = 0, 1, 2
#: What ``--split LAYER=...`` may say of a layer (today: that it and the layers before it are
#: split by images).
CUT_SPLITS = ("images",)


def cut_layer(value: str) -> str | None:
    """The layer of ``--split LAYER=images`` (None for ``auto``, ``kernels``, ``images``).

    Raises:
        ValueError: a form ``--split`` does not take, naming it.
    """
    if "=" not in value:
        return None
    layer, _, how = value.partition("=")
    if not layer or how not in CUT_SPLITS:
        raise ValueError(
            f"--split {value!r}: expected auto, kernels, images or LAYER=images (the network's "
            "layers up to LAYER's block split by images, the rest on the master)"
        )
    return layer


def cut_after(spec: Sequence[Mapping], layer: str) -> int:
    """The position of the last layer of the first part when ``spec`` is cut after ``layer``:
    the layer with the channel-local layers that follow it in a chain (a convolution's block:
    its batch norm, ReLU, LRN and pooling).

    Raises:
        ValueError: no such layer, a cut no single tensor crosses (a layer after it reads a
            layer before it: inside a residual block), or nothing after it but the fc.
    """
    graph = spec_graph(spec)
    kinds = [entry["type"] for entry in spec]
    if layer not in graph.names:
        raise ValueError(f"--split {layer}=images: the network has no layer {layer!r} "
                         f"(its convolutions: {_convs(graph, kinds)})")  # fmt: skip
    at = graph.names.index(layer)
    if kinds[at] in ("fc", "dropout"):
        convs = _convs(graph, kinds)
        raise ValueError(f"--split {layer}=images: {layer!r} is a {kinds[at]}: cut after a "
                         f"convolution's block (the network's: {convs})")  # fmt: skip
    chain = graph.chain(at, lambda j: kinds[j] in CHANNEL_LOCAL and kinds[j] != "gap")
    last = chain[-1] if chain else at
    for j in range(last + 1, len(spec)):
        for source in graph.inputs[j]:
            if source == NETWORK_INPUT or (source < last):
                read = "the network's input" if source == NETWORK_INPUT else graph.names[source]
                raise ValueError(
                    f"--split {layer}=images: layer {graph.names[j]!r}, after the cut, reads "
                    f"{read}, before it: cut where one tensor alone crosses (not inside a "
                    "residual block; after a block's last layer, its ReLU)"
                )
    if kinds[-1] != "fc" or all(kind in ("fc", "dropout") for kind in kinds[last + 1 :]):
        raise ValueError(f"--split {layer}=images: nothing after the cut but the fc")
    return last


def cut_spec(spec: Sequence[Mapping], last: int) -> tuple[list[dict], list[dict]]:
    """(the first part's spec, the rest's) of ``spec`` cut after position ``last``
    (:func:`cut_after`), every layer named as in the whole network (so each part's parameters
    and buffers have the whole network's names). The rest reads its input where the layers
    after the cut read the cut's layer; where more than one does (a residual block's
    convolution and its sum), through an identity first (a 1x1 max pool of stride 1, named
    after the cut's layer), which the rest's layers name instead."""
    graph = spec_graph(spec)
    named = [dict(entry, name=name) for entry, name in zip(spec, graph.names, strict=True)]
    first, rest = named[: last + 1], named[last + 1 :]
    readers = graph.consumers[last]
    cut = graph.names[last]
    if len(readers) == 1 and readers[0] == last + 1:
        rest[0].pop("inputs", None)  # it read the cut's layer: now the rest's input
        return first, rest
    identity = {"type": "maxpool", "name": f"{cut}_cut", "kernel": 1, "stride": 1}
    for entry in rest:
        if "inputs" in entry:
            entry["inputs"] = [identity["name"] if n == cut else n for n in entry["inputs"]]
    return first, [identity, *rest]


def _convs(graph, kinds) -> str:
    names = [n for n, kind in zip(graph.names, kinds, strict=True) if kind == "conv"]
    return ", ".join(names) if names else "none"


__all__ = [
    "BACKWARD", "CUT_SPLITS", "FORWARD", "WHOLE",
    "cut_after", "cut_layer", "cut_spec",
]  # fmt: skip
