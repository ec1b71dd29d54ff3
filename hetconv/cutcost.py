"""The cost of a network cut in two (``hetconv train --split LAYER=images``,
:mod:`hetconv.cutsplit`): each place the network may be cut, predicted, and the fastest. Asked
by ``hetconv plan`` (on a described cluster) and by ``--split auto`` (on the nodes as probed,
:func:`hetconv.master.records.image_split_steps`).

The first part is predicted as the whole network split by images with the ring would be
(:func:`hetconv.imagecost.simulate_image_split`, no spot checks: the cut has none) on that part
alone, with a 10-way fc after it for its loss (a few kB of gradient); the rest as one machine
(:func:`hetconv.coststep.local_step_seconds`) on the master; and between them the part's
output gathered from the workers into the master and its gradient scattered back, each over the
master's link (and each worker's own), in one streamed call per worker each way. The master's
other work of a step (``comp_s``) is shared between the parts by the values their layers other
than convolutions write (batch norm, ReLU, pooling, ...: memory-bound passes).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from hetconv.coststep import local_step_seconds
from hetconv.cutsplit import cut_after, cut_spec
from hetconv.imagecost import simulate_image_split
from hetconv.model import CIFAR_INPUT
from hetconv.onnx_import import load_network
from hetconv.spec import spec_graph, walk_spec
from hetconv.workload import conv_layers

#: The label of the plan's row; ``{layer}`` the cut.
CUT_LABEL = "cut after {layer}: first part split by images (ring), the rest on the master"


def cut_points(spec: Sequence[dict]) -> list[str]:
    """The layers ``spec`` may be cut after (:func:`hetconv.cutsplit.cut_after`), one for each
    place (the first layer that names it: a convolution for its block), in order."""
    out, seen = [], set()
    for name in spec_graph(spec).names:
        try:
            last = cut_after(spec, name)
        except ValueError:
            continue
        if last not in seen:
            seen.add(last)
            out.append(name)
    return out


def cut_step(cluster, network, batch: int, comp_s: float, shape, layer: str):
    """(the predicted step, the master's bytes a step) of ``network`` cut after ``layer``."""
    spec = load_network(network).spec if isinstance(network, str) else list(network)
    shape = CIFAR_INPUT if shape is None else tuple(shape)
    last = cut_after(spec, layer)
    first, rest = cut_spec(spec, last)
    walked = list(walk_spec(spec, tuple(shape)))
    out_shape = tuple(walked[last].output_shape)
    share = _other_share(walked, last)
    head = [*first, {"type": "fc", "name": "cut_head", "out": 10}]
    part = simulate_image_split(cluster, head, batch, comp_s * share, input_shape=tuple(shape),
                                exchange="ring", overlap=False, check=None)  # fmt: skip
    on_master = local_step_seconds(cluster.master, conv_layers(rest, batch, out_shape),
                                   comp_s * (1 - share))  # fmt: skip
    moved = 4 * batch * math.prod(out_shape)  # float32, each way
    return part.step_s + on_master + 2 * _gather_seconds(cluster, moved), \
        part.master_bytes + 2 * moved  # fmt: skip


def best_cut(cluster, network, batch: int, comp_s: float, shape):
    """(layer, step, master bytes) of the fastest cut of ``network``; None where it has none."""
    spec = load_network(network).spec if isinstance(network, str) else list(network)
    found = [(name, *cut_step(cluster, spec, batch, comp_s, shape, name))
             for name in cut_points(spec)]  # fmt: skip
    return min(found, key=lambda got: got[1]) if found else None


def _gather_seconds(cluster, nbytes: float) -> float:
    """The seconds ``nbytes``, an equal share from each worker, take to cross to the master
    (or back): the master's link shared, each worker's own, one streamed call's cost."""
    workers = cluster.workers
    if not workers:
        return math.inf
    shared = cluster.shared_bytes_per_s()[1]
    own = max(nbytes / len(workers) / w.bytes_per_s for w in workers)
    rtt = max(w.rtt_s for w in workers)
    return max(nbytes / shared, own) + cluster.wire.call_s(False) + rtt


def _other_share(walked, last: int) -> float:
    """The first part's share of the values the layers other than convolutions and fc write
    (what the master's other work of a step is shared by)."""
    values = [math.prod(ly.output_shape) if ly.kind not in ("conv", "fc") else 0
              for ly in walked]  # fmt: skip
    total = sum(values)
    return sum(values[: last + 1]) / total if total else 0.0


#: ``--split auto``'s name of a cut after ``layer`` among the ways of a split by images (an
#: "exchange" of :func:`hetconv.imagecost.choose_split`): ``cut:LAYER``.
CUT_WAY = "cut:"


def cut_ways(cluster, spec, batch: int, comp_s: float, shape) -> dict[str, float]:
    """Every cut's predicted step, by its way's name (:data:`CUT_WAY`)."""
    return {CUT_WAY + name: cut_step(cluster, spec, batch, comp_s, shape, name)[0]
            for name in cut_points(spec)}  # fmt: skip


__all__ = ["CUT_LABEL", "CUT_WAY", "best_cut", "cut_points", "cut_step", "cut_ways"]
