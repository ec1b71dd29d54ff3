"""``metrics.csv``: one row per training step, the table a run directory keeps for people,
spreadsheets and ``hetconv report``.

Columns, in order (times in seconds, bytes on the master's link both ways)::

    step                 the step's number, from 0 (as in the trace)
    epoch                the epoch it belongs to, from 0
    loss, accuracy       of the step's training batch
    images_per_second    the batch over the step's seconds
    seconds              the step's wall-clock time
    comm_seconds         communication: distributed calls' wall time beyond the slowest compute
    conv_seconds         convolution on the slowest node
    other_seconds        the rest (the master's non-convolutional work)
    bytes                what every worker call of the step moved (0 with no workers)
    held_out_loss        held-out loss and accuracy of the evaluation run after this step
    held_out_accuracy    (empty when none ran)
    share:NODE           per node: the fraction of the step's kernels it computed (all layers)
    compute_seconds:NODE per node: its compute time over the step's layers, forward + backward
    bytes:NODE           per node: bytes its calls moved

A run with workers has the three per-node columns for every node it ever used, master first
(the master's cover for a lost worker counts as its own share); a ``--local`` run has none.
Cells a row has no value for are empty. A worker that answers but had no kernel in a step
(*idle*: the trace's ``idle``) has 0 in its three cells; a lost worker's, or one not yet
joined, are empty: the figures tell the two apart (:mod:`.report`).
"""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

STEP_COLUMNS = (
    "step",
    "epoch",
    "loss",
    "accuracy",
    "images_per_second",
    "seconds",
    "comm_seconds",
    "conv_seconds",
    "other_seconds",
    "bytes",
)
HELD_OUT_COLUMNS = ("held_out_loss", "held_out_accuracy")
FIXED_COLUMNS = STEP_COLUMNS + HELD_OUT_COLUMNS
#: Per-node columns are named ``PREFIX:NODE``, in this order for each node.
NODE_PREFIXES = ("share", "compute_seconds", "bytes")


def node_column(prefix: str, node: str) -> str:
    return f"{prefix}:{node}"


def _phase_bytes(figures: dict) -> int:
    return sum(
        figures[phase]["bytes_sent"] + figures[phase]["bytes_received"]
        for phase in ("forward", "backward")
        if phase in figures
    )


def step_row(record: dict) -> dict[str, float | int]:
    """The ``metrics.csv`` row of a trace's step record (see :mod:`hetconv.training.trace`)."""
    row: dict[str, float | int] = {
        "step": int(record["step"]),
        "epoch": int(record["epoch"]),
        "loss": float(record["loss"]),
        "accuracy": float(record["accuracy"]),
        "images_per_second": record["batch"] / record["seconds"],
        "seconds": float(record["seconds"]),
        "comm_seconds": float(record["comm_seconds"]),
        "conv_seconds": float(record["conv_seconds"]),
        "other_seconds": float(record["comp_seconds"]),
    }
    if record.get("split") == "images":
        return _images_row(row, record)
    nodes: dict[str, dict] = record.get("nodes") or {}
    total_kernels = sum(f["kernels"] for layers in nodes.values() for f in layers.values())
    total_bytes = 0
    for node, layers in nodes.items():
        kernels = sum(f["kernels"] for f in layers.values())
        node_bytes = sum(_phase_bytes(f) for f in layers.values())
        compute = sum(
            f[phase]["compute_seconds"]
            for f in layers.values()
            for phase in ("forward", "backward")
            if phase in f
        )
        total_bytes += node_bytes
        row[node_column("share", node)] = kernels / total_kernels if total_kernels else 0.0
        row[node_column("compute_seconds", node)] = compute
        row[node_column("bytes", node)] = node_bytes
    for node in record.get("idle") or ():  # it answers, but computed nothing
        if node not in nodes:
            for prefix in NODE_PREFIXES:
                row[node_column(prefix, node)] = 0.0 if prefix != "bytes" else 0
    # Resident kernels' placements and syncs (the record's ``resident``) cross the link too.
    kept = sum(
        figures.get("placed_bytes", 0) + figures.get("fetched_bytes", 0)
        for figures in (record.get("resident") or {}).values()
    )
    row["bytes"] = total_bytes + kept
    return row


def _images_row(row: dict, record: dict) -> dict[str, float | int]:
    """:func:`step_row` of a step split by images (``split: images``): a node's share is its
    images over the batch, its bytes what its one call moved."""
    nodes: dict[str, dict] = record.get("nodes") or {}
    total = sum(int(figures["images"]) for figures in nodes.values())
    for node, figures in nodes.items():
        moved = int(figures.get("bytes_sent", 0)) + int(figures.get("bytes_received", 0))
        row[node_column("share", node)] = int(figures["images"]) / total if total else 0.0
        row[node_column("compute_seconds", node)] = float(figures.get("seconds", 0.0))
        row[node_column("bytes", node)] = moved
    row["bytes"] = int(record.get("bytes_sent", 0)) + int(record.get("bytes_received", 0))
    return row


def columns_for(nodes: Iterable[str]) -> list[str]:
    """The header of a table with these nodes, in this order."""
    return list(FIXED_COLUMNS) + [node_column(p, n) for n in nodes for p in NODE_PREFIXES]


def row_nodes(row: dict) -> list[str]:
    """The nodes a row has columns for, in its order."""
    prefix = "share:"
    return [key[len(prefix) :] for key in row if key.startswith(prefix)]


@dataclass
class Metrics:
    """A ``metrics.csv`` read back: every column as a float64 array (NaN where a cell is empty).

    Attributes:
        path: the file.
        columns: column name -> values, one per row.
        nodes: the nodes with per-node columns, master first.
    """

    path: Path
    columns: dict[str, np.ndarray]
    nodes: list[str]

    def __len__(self) -> int:
        return len(self.columns["step"])

    def __getitem__(self, column: str) -> np.ndarray:
        return self.columns[column]

    def node(self, prefix: str, node: str) -> np.ndarray:
        return self.columns[node_column(prefix, node)]

    def held_out(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(steps trained, loss, accuracy) of the evaluations: the rows that have one."""
        ran = ~np.isnan(self.columns["held_out_loss"])
        return (
            self.columns["step"][ran] + 1,
            self.columns["held_out_loss"][ran],
            self.columns["held_out_accuracy"][ran],
        )


def read_metrics(path: str | os.PathLike) -> Metrics:
    """Read a ``metrics.csv``.

    Raises:
        ValueError: the file cannot be read, lacks a column of :data:`FIXED_COLUMNS`, has a
            row of another length or a cell that is not a number (the message names the file,
            line and column).
    """
    path = Path(path)
    try:
        with open(path, newline="", encoding="utf-8") as f:
            rows = list(csv.reader(f))
    except (OSError, UnicodeDecodeError) as e:
        why = getattr(e, "strerror", None) or e
        raise ValueError(f"cannot read metrics {path}: {why}") from None
    if not rows:
        raise ValueError(f"metrics {path} is empty (no header)")
    header = rows[0]
    missing = [c for c in FIXED_COLUMNS if c not in header]
    if missing:
        raise ValueError(f"metrics {path} lacks the columns {', '.join(missing)}")
    values = np.full((len(rows) - 1, len(header)), np.nan)
    for number, row in enumerate(rows[1:], start=2):
        if len(row) != len(header):
            raise ValueError(
                f"{path}:{number}: {len(row)} cells, the header names {len(header)} columns"
            )
        for index, cell in enumerate(row):
            if cell == "":
                continue
            try:
                values[number - 2, index] = float(cell)
            except ValueError:
                raise ValueError(
                    f"{path}:{number}: {header[index]} is {cell!r}, not a number"
                ) from None
    columns = {name: values[:, i] for i, name in enumerate(header)}
    nodes = [name.split(":", 1)[1] for name in header if name.startswith("share:")]
    return Metrics(path, columns, nodes)


def format_cell(value: float | int | None) -> str:
    """A cell as written: empty for none, integers as integers, floats exactly (repr)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return repr(value) if isinstance(value, float) else str(int(value))


__all__ = [
    "FIXED_COLUMNS",
    "HELD_OUT_COLUMNS",
    "Metrics",
    "NODE_PREFIXES",
    "STEP_COLUMNS",
    "columns_for",
    "format_cell",
    "node_column",
    "read_metrics",
    "row_nodes",
    "step_row",
]
