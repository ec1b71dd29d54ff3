"""The training trace: one JSON object per line, which the simulator calibrates from.

Most records are a step's (they have ``step``). A run whose executor has a plan (see
:meth:`hetconv.conv.ConvExecutor.plan_record`) first writes ``{"event": "plan", "start_step":
..., ...}``, which has no ``step``; a resumed run writes its own after those of earlier runs.
Readers take the records with a ``step`` as the steps and tolerate any others. The plan record
says what was trained, :func:`model_record`, so that the trace alone is enough to simulate the
run again (``hetconv simulate --from-trace``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TextIO


def model_record(
    name: str, spec: Sequence[Mapping], input_shape: Sequence[int], batch: int
) -> dict:
    """The plan record's ``"model"``: the network as ``--model`` named it (a preset, or a
    file's path as given), its spec (the layers, JSON as a ``.json`` spec holds them), the
    (C, H, W) of one image and the batch."""
    return {
        "name": str(name),
        "spec": json.loads(json.dumps(list(spec), default=_plain)),
        "input_shape": [int(v) for v in input_shape],
        "batch": int(batch),
    }


def _plain(value: object) -> object:
    """A numpy scalar or array in a spec (an imported graph's) as plain JSON."""
    tolist = getattr(value, "tolist", None)
    if tolist is None:
        raise TypeError(f"{type(value).__name__} {value!r} in a model spec is not JSON")
    return tolist()


class Trace:
    """Appends records to a JSON-lines file.

    Args:
        path: the JSON-lines file, or None for no trace.
        resume_step: continue an existing trace at this step: the records of earlier steps
            (and the plan records of the runs that wrote them) are kept, those of this step on
            (written after the checkpoint being resumed) and any torn last line are cut off,
            and new records are appended. None starts a new file.
    """

    def __init__(self, path: str | None, resume_step: int | None = None):
        self.kept = self.dropped = 0
        self._record_start = 0
        self._file: TextIO | None = None
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        if path and resume_step is not None:
            self.kept, self.dropped = _cut_trace(Path(path), resume_step)
            self._file = open(path, "a", encoding="utf-8")
        elif path:
            self._file = open(path, "w", encoding="utf-8")

    def write(self, record: dict) -> None:
        if self._file is not None:
            self._record_start = self._file.tell()
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def replace_last(self, record: dict) -> None:
        """Rewrite the record written last (the file ends with it)."""
        if self._file is not None:
            self._file.seek(self._record_start)
            self._file.truncate()
            self.write(record)

    def sync(self) -> None:
        """Make what is written durable, so a checkpoint never gets ahead of its trace."""
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def _first_step(line: bytes) -> int | None:
    """The first step a complete trace line covers: its ``step``, or a plan record's
    ``start_step``; -1 for another record without a step (kept wherever it is); None for a torn
    or unreadable line."""
    if not line.endswith(b"\n"):
        return None
    try:
        record = json.loads(line)
    except ValueError:
        return None
    if not isinstance(record, dict):
        return None
    if "step" in record:
        step = record["step"]
    elif record.get("event") == "plan":
        step = record.get("start_step", -1)
    else:
        return -1
    return step if isinstance(step, int) else None


def _cut_trace(path: Path, resume_step: int) -> tuple[int, int]:
    """Truncate a trace before its first record of step >= ``resume_step`` (a plan record
    counts as its ``start_step``: a run that started there is being redone) or its first torn
    line; returns (records kept, lines cut off)."""
    if not path.is_file():
        return 0, 0
    kept = 0
    with open(path, "r+b") as f:
        lines = f.read().splitlines(keepends=True)
        offset = 0
        for line in lines:
            step = _first_step(line)
            if step is None or step >= resume_step:
                break
            offset += len(line)
            kept += 1
        f.truncate(offset)
    return kept, len(lines) - kept
