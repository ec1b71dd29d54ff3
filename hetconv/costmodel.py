"""The cost of one training step on a simulated cluster: bytes, transfers, convolutions, the rest.

The model follows what :class:`hetconv.master.cluster.Cluster` does, call by call:

* **Shapes and bytes** (:mod:`hetconv.workload`): the network's convolution layers from its
  spec, and what each call moves on the wire, counted with the real messages.
* **Time of one distributed call** (:func:`simulate_phase`). All worker calls start together
  while the master computes its own share. Each call pays a fixed cost (software per call, plus
  the link's round trip), moves its request, computes, moves its answer. Transfers are fluid
  flows that share capacity max-min fairly: on a switched network (full duplex, one port per
  node) requests share the master's upstream and answers its downstream; on Wi-Fi every transfer,
  both directions, shares one medium. Each flow is also capped by its worker's own link. While the
  master computes its own share, streamed transfers lose :attr:`WireCosts.compute_stall` of their
  rate (0 by default: a master whose convolutions hold the GIL that every chunk needs would
  lose some). After the last answer the master
  sums the input-gradient parts (memory bound).
* **Fused stages** (:mod:`hetconv.stages`): a layer may run fused, each worker also running the
  channel-local layers after the convolution; its calls then move the stage's (pooled) maps
  instead of the feature maps (:func:`~hetconv.workload.stage_call_bytes`) and each node
  computes its kernels widened by the stage's halo. :func:`stage_mode` picks, per layer, the
  mode with fewer bytes on the master's link (``hetconv train --stages auto``).
* **A step** (:func:`simulate_step`): forward then backward of every conv layer, one after the
  other, plus the master's non-convolutional work ("comp"), each layer in the modes the mode
  table gives it (:mod:`hetconv.modetable`, the rules the master applies at prepare). As in
  the trace, a call's convolution time is its slowest node's compute and its communication the
  rest of its wall time.

Convolution time of a node is its kernels' FLOPs over its throughput: forward 2·N·Ho·Wo·k·C·kh·kw,
the kernel gradient as much again and the input gradient (when the layer needs it) as much again.

Its parts, by concern: the simulated cluster (:mod:`hetconv.costcluster`), what each mode moves
and the ``auto`` decisions made of it (:mod:`hetconv.costbytes`), one phase's calls in time
(:mod:`hetconv.costphase`), one layer's phase (:mod:`hetconv.costlayer`) and the step
(:mod:`hetconv.coststep`). Every name is importable from here.
"""

from __future__ import annotations

from hetconv.costbytes import (
    kernel_mode,
    layer_bytes,
    overlap_images,
    replica_bytes,
    replicate_gain,
    resident_layer_bytes,
    stage_mode,
)
from hetconv.costcluster import FABRICS, MBIT, SWITCHED, WIFI, SimCluster, SimNode, WireCosts
from hetconv.costlayer import PhaseResult, simulate_layer_phase
from hetconv.costphase import WorkerCall, simulate_phase
from hetconv.coststep import StepModes, StepResult, local_step_seconds, simulate_step, step_modes
from hetconv.replica import REPLICATED

__all__ = [
    "FABRICS",
    "MBIT",
    "REPLICATED",
    "SWITCHED",
    "WIFI",
    "SimCluster",
    "SimNode",
    "PhaseResult",
    "StepModes",
    "StepResult",
    "WireCosts",
    "WorkerCall",
    "kernel_mode",
    "layer_bytes",
    "local_step_seconds",
    "overlap_images",
    "replica_bytes",
    "replicate_gain",
    "resident_layer_bytes",
    "simulate_layer_phase",
    "simulate_phase",
    "simulate_step",
    "stage_mode",
    "step_modes",
]
