"""What each node is and how fast: its device, its link, and a probe of every layer.

The probe does what training does: a forward and a backward pass of the layer's real shape on
random data (no input gradient for a network's first layer), best of a few runs. The link is
measured with echoes: the round trip of a tiny message (latency) and of 1 MiB each way.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hetconv.backends import Backend
from hetconv.conv import ConvSpec

from .membership import Node
from .planning import PlannedLayer

LINK_PROBE_BYTES = 1 << 20
PROBE_TIMEOUT_S = 300.0  # a slow device's probe of a large layer may take minutes


def planned_layers(layers: Sequence[ConvSpec], batch: int) -> list[PlannedLayer]:
    """The shapes the cluster plans for: one :class:`PlannedLayer` per conv layer of the model
    at ``batch`` images per step."""
    return [PlannedLayer(spec.name, spec.shape(batch), spec.need_input_grad) for spec in layers]


def describe_master(node: Node, backend: Backend) -> None:
    node.description = f"{backend.describe().name} ({backend.name})"


def connect(node: Node, connect_timeout: float, deadline: float, timeout: float | None = None):
    """Ask a worker what it runs on and measure its link; raises WorkerError if it cannot.

    Args:
        node: a worker (``node.client`` set).
        connect_timeout: how long the client waits for a worker from now on.
        deadline: seconds each echo may take.
        timeout: how long to wait for this first answer (default: ``connect_timeout``).
    """
    if timeout is not None:
        node.client.connect_timeout = timeout
    d = node.client.describe()
    node.client.connect_timeout = connect_timeout
    node.description = f"{d.name} ({d.backend}, {d.cores} cores)"
    node.instance_id = d.instance_id  # the same on every address of one worker process
    tiny = np.zeros(1, np.float32)
    link_probe = np.zeros(LINK_PROBE_BYTES // 4, np.float32)
    node.link_latency = min(
        node.client.echo([("t", tiny)], timeout=deadline)[1].wall_seconds for _ in range(3)
    )
    seconds = min(
        node.client.echo([("l", link_probe)], timeout=deadline)[1].wall_seconds for _ in range(3)
    )
    node.link_bytes_per_second = 2 * link_probe.nbytes / max(seconds - node.link_latency, 1e-9)


def probe(node: Node, layer: PlannedLayer, backend: Backend, repeats: int) -> float:
    """Seconds a forward + backward pass of the whole layer takes ``node`` (best of
    ``repeats``): on the master's own ``backend``, or by the worker."""
    if node.client is None:
        return backend.time_step(layer.shape, repeats, layer.need_input_grad)
    return node.client.probe(layer.shape, repeats, layer.need_input_grad, timeout=PROBE_TIMEOUT_S)


def probe_all(node: Node, layers: list[PlannedLayer], backend: Backend, repeats: int):
    """``{layer name: probe seconds}`` of ``node`` for every layer."""
    return {layer.name: probe(node, layer, backend, repeats) for layer in layers}
