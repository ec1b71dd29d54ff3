"""Reading the trace of a run (``hetconv train --trace FILE``): one JSON object per line.

A trace holds two kinds of record:

* a **step record** for every training step, the only kind with a ``"step"`` key: the step's
  times and, for a run with workers, per node and layer the kernels, bytes and seconds of its
  calls, and the ``"wire_format"`` those bytes were counted in (``float32``, ``float16``,
  ``bfloat16``; absent in older traces: float32);
* a **plan record** where a run starts (a resumed run writes another), with no ``"step"`` key::

    {"event": "plan", "start_step": 0,
     "nodes": [{"name": "master" or "HOST:PORT", "description": ...,
                "probe_seconds": {"conv1": 0.0123, ...},
                "link_bytes_per_second": ... or null, "link_latency_seconds": ... or null}, ...],
     "shares": {"conv1": [kernels per node, in the order of "nodes"], ...},
     "wire_format": "float32",
     "model": {"name": "tiny" or "net.json", "spec": [...], "input_shape": [3, 32, 32],
               "batch": 32}}

  the nodes in order, master first (a master that computes nothing has no probe figures), with
  what the master measured before training and the shares it chose from that; and what was
  trained (:func:`hetconv.training.trace.model_record`; absent in older traces), which
  :func:`recorded_network` reads.

Readers of steps (:func:`read_steps`, :func:`read_trace`) skip every record without ``"step"``;
:func:`read_plan` reads the plan that a run's steps were trained under.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

#: The name the master's cluster gives itself in a trace (hetconv.master.cluster.MASTER).
MASTER = "master"


def _numbered_records(path: str) -> list[tuple[int, dict]]:
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise ValueError(f"cannot read trace {path}: {e.strerror or e}") from None
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{path}:{number}: not JSON: {e}") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{number}: expected a JSON object per line")
        records.append((number, record))
    return records


def read_records(path: str) -> list[dict]:
    """Every record of a trace file, in order.

    Raises:
        ValueError: the file cannot be read, or a line is not a JSON object (the message names
            the file and line).
    """
    return [record for _, record in _numbered_records(path)]


def is_step(record: dict) -> bool:
    """Whether ``record`` is a step record (plan and any other records have no ``"step"``)."""
    return "step" in record


def read_steps(path: str) -> list[dict]:
    """The step records of a trace file, of any run (with workers or ``--local``)."""
    return [record for record in read_records(path) if is_step(record)]


def step_bytes(record: dict) -> int:
    """Bytes a step record's calls moved on the master's link, both ways, every node and layer
    (resident kernels' placements and syncs included: the record's ``resident``; and a split
    block's parts the master put into or fetched from workers, its ``replica_split``: for lost
    workers, and as a peer itself). A step split by images (``split: images``): its calls'
    bytes, both ways."""
    if record.get("split") == "images":
        return int(record.get("bytes_sent", 0)) + int(record.get("bytes_received", 0))
    calls = sum(
        figures[phase]["bytes_sent"] + figures[phase]["bytes_received"]
        for layers in record.get("nodes", {}).values()
        for figures in layers.values()
        for phase in ("forward", "backward")
        if phase in figures
    )
    kept = sum(
        figures.get("placed_bytes", 0) + figures.get("fetched_bytes", 0)
        for figures in record.get("resident", {}).values()
    )
    parts = sum(
        split.get("covered_bytes", 0) + split.get("exchanged_bytes", 0)
        for split in record.get("replica_split", {}).values()
    )
    return calls + kept + parts


def read_trace(path: str) -> list[dict]:
    """The step records of the trace of a run with workers.

    Raises:
        ValueError: unreadable, no step records, or a local run's trace (no per-node records).
    """
    records = read_steps(path)
    if not records:
        raise ValueError(f"trace {path} holds no steps")
    if not records[0].get("nodes"):
        raise ValueError(
            f"trace {path} has no per-node records: it comes from local training (--local); "
            "calibrate from a run with workers"
        )
    if records[0].get("split") == "images":
        raise ValueError(
            f"trace {path} is of a run split by images (--split images): it has no per-layer "
            "kernel shares to calibrate from; calibrate from a run split by kernels"
        )
    return records


@dataclass(frozen=True)
class PlanNode:
    """One node of a plan record: what the master measured of it before training."""

    name: str  # "master" or the worker's HOST:PORT, as in the step records
    description: str
    probe_seconds: dict[str, float]  # per layer; empty for a master that computes nothing
    link_bytes_per_second: float | None
    link_latency_seconds: float | None


@dataclass(frozen=True)
class Plan:
    """A plan record: the nodes a run started with (master first) and the shares it chose."""

    start_step: int
    nodes: tuple[PlanNode, ...]
    shares: dict[str, tuple[int, ...]]  # per layer, kernels per node in the order of ``nodes``

    @property
    def node_names(self) -> list[str]:
        return [node.name for node in self.nodes]

    def probe_seconds(self) -> dict[str, dict[str, float]]:
        """Per node name, per layer the probe seconds."""
        return {node.name: dict(node.probe_seconds) for node in self.nodes}


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _optional_float(node: dict, key: str) -> float | None:
    value = node.get(key)
    if value is not None and not _is_number(value):
        raise ValueError(f"{key} {value!r} is not a number or null")
    return None if value is None else float(value)


def _plan_node(node: object) -> PlanNode:
    if not isinstance(node, dict) or not isinstance(node.get("name"), str):
        raise ValueError(f"node {node!r} has no name")
    probes = node.get("probe_seconds", {})
    if not isinstance(probes, dict) or not all(_is_number(v) for v in probes.values()):
        raise ValueError(f"{node['name']}: probe_seconds {probes!r} is not layer: seconds")
    return PlanNode(
        name=node["name"],
        description=str(node.get("description", "")),
        probe_seconds={str(k): float(v) for k, v in probes.items()},
        link_bytes_per_second=_optional_float(node, "link_bytes_per_second"),
        link_latency_seconds=_optional_float(node, "link_latency_seconds"),
    )


def parse_plan(record: dict) -> Plan:
    """The :class:`Plan` of a plan record.

    Raises:
        ValueError: a field is missing or of the wrong kind (the message says which).
    """
    start = record.get("start_step")
    if not isinstance(start, int) or isinstance(start, bool) or start < 0:
        raise ValueError(f"start_step {start!r} is not a step number")
    nodes = record.get("nodes")
    if not isinstance(nodes, list) or not nodes:
        raise ValueError("no nodes")
    parsed = tuple(_plan_node(node) for node in nodes)
    shares = record.get("shares", {})
    if not isinstance(shares, dict):
        raise ValueError(f"shares {shares!r} is not layer: kernels per node")
    for layer, kernels in shares.items():
        if (
            not isinstance(kernels, list)
            or len(kernels) != len(parsed)
            or not all(isinstance(k, int) and not isinstance(k, bool) and k >= 0 for k in kernels)
        ):
            raise ValueError(f"shares of {layer}: {kernels!r} is not kernels for each node")
    return Plan(start, parsed, {layer: tuple(kernels) for layer, kernels in shares.items()})


def is_plan(record: dict) -> bool:
    """Whether ``record`` is a plan record."""
    return record.get("event") == "plan" and not is_step(record)


def read_plan(path: str, step: int | None = None) -> Plan:
    """The plan that step ``step`` of the trace was trained under: the latest plan record at
    or before it (``start_step <= step``); without ``step``, the trace's latest.

    Raises:
        ValueError: unreadable, no plan record (a trace of an older hetconv) or none at or
            before ``step``, or a malformed one.
    """
    plans = []
    for number, record in _numbered_records(path):
        if is_plan(record):
            try:
                plans.append(parse_plan(record))
            except ValueError as e:
                raise ValueError(f"{path}:{number}: plan record: {e}") from None
    if not plans:
        raise ValueError(f"trace {path} has no plan record: written by an older hetconv?")
    if step is not None:
        plans = [plan for plan in plans if plan.start_step <= step]
        if not plans:
            raise ValueError(f"trace {path} has no plan record at or before step {step}")
    return plans[-1]


def recorded_model(path: str) -> dict | None:
    """The ``model`` of the trace's latest plan record that has one (None: none does, a trace
    of an older hetconv or of a local run)."""
    models = [r["model"] for r in read_records(path) if is_plan(r) and "model" in r]
    if models and not isinstance(models[-1], dict):
        raise ValueError(f"trace {path}: the plan record's model is not an object")
    return models[-1] if models else None


def recorded_network(path: str) -> str | None:
    """The network the trace's run trained, as ``--model`` names one: a preset by name; a
    spec's file where it still holds the spec the trace recorded, else that spec written to a
    temporary ``.json`` file of the same name (removed when the process ends); None where the
    trace records no model."""
    from hetconv.model import PRESETS

    model = recorded_model(path)
    if model is None:
        return None
    name, spec = str(model.get("name", "")), model.get("spec")
    if name in PRESETS or not isinstance(spec, list):
        return name or None
    try:
        if json.loads(Path(name).read_text(encoding="utf-8")) == spec:
            return name
    except (OSError, ValueError):
        pass  # moved, changed or an .onnx graph: the recorded spec is what was trained
    return spec_file(Path(name).stem or "model", spec)


def spec_file(stem: str, spec: list) -> str:
    """``spec`` as a temporary ``STEM.json`` file (removed when the process ends), for what
    takes a network as ``--model`` names one."""
    import atexit
    import shutil
    import tempfile

    folder = tempfile.mkdtemp(prefix="hetconv-trace-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    path = Path(folder) / f"{stem}.json"
    path.write_text(json.dumps(spec), encoding="utf-8")
    return str(path)


__all__ = [
    "MASTER",
    "Plan",
    "PlanNode",
    "is_plan",
    "is_step",
    "parse_plan",
    "read_plan",
    "recorded_model",
    "recorded_network",
    "spec_file",
    "read_records",
    "read_steps",
    "read_trace",
]
