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
from collections.abc import Callable, Mapping, Sequence
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
        self.path = path
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
            try:
                self._file.write(json.dumps(record) + "\n")
                self._file.flush()
            except OSError as e:
                self._failed(e)

    def replace_last(self, record: dict) -> None:
        """Rewrite the record written last (the file ends with it)."""
        if self._file is not None:
            try:
                self._file.seek(self._record_start)
                self._file.truncate()
            except OSError as e:
                self._failed(e)
            self.write(record)

    def sync(self) -> None:
        """Make what is written durable, so a checkpoint never gets ahead of its trace."""
        if self._file is not None:
            try:
                self._file.flush()
                os.fsync(self._file.fileno())
            except OSError as e:
                self._failed(e)

    def _failed(self, error: OSError) -> None:
        """A write failed (a full disk): no torn record is left, and the error names the file."""
        close_and_cut(self._file, Path(self.path), self._record_start)
        self._file = None
        raise RunFileError(self.path, error) from None

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


# -- a write that failed --------------------------------------------------------------------


class RunFileError(OSError):
    """Writing one of the run's files failed (a full disk, a folder gone): the message names
    the file; :meth:`stop` saves what the disk allows and adds it, and how to continue."""

    def __init__(self, path: str | os.PathLike, error: OSError):
        super().__init__(error.errno, error.strerror or str(error))
        self.path = Path(path)
        self.step: int | None = None
        self.saved: list[str] = []
        self.latest: Path | None = None
        self.resume_command = "the same command with --resume"

    def __str__(self) -> str:
        text = f"cannot write {self.path}: {self.strerror}"
        if self.step is None:
            return text
        text += f"; stopped after step {self.step}: " + (", ".join(self.saved) or "nothing saved")
        if self.latest is None:
            return text + "; there is no checkpoint to continue from"
        return f"{text}; to continue from {self.latest}: {self.resume_command}"

    def stop(
        self,
        step: int,
        save_model: Callable[[], Path | None],
        checkpoints,
        state: Callable[[int], object],
    ) -> RunFileError:
        """After ``step`` steps: write the model (``save_model``) and, into ``checkpoints``
        (a :class:`~.checkpoint.CheckpointDir` or None), ``state(step)``, each where the disk
        allows; returns this error, saying what was saved."""
        self.step = step
        try:
            model = save_model()
            self.saved += [f"saved model {model}"] if model is not None else []
        except OSError as e:
            self.saved.append(f"the model could not be saved ({e})")
        if checkpoints is None:
            return self
        target = checkpoints.file_for(step)
        try:
            if checkpoints.pointer() != target or not target.is_file():
                checkpoints.write(state(step))
            self.saved.append(f"checkpoint {target}")
        except OSError as e:
            self.saved.append(f"no checkpoint at step {step} ({e.strerror or e})")
        latest = checkpoints.pointer()
        self.latest = latest if latest is not None and latest.is_file() else None
        return self


def written(path: Path, write: Callable[[], None]) -> Path:
    """``path``, after ``write()`` wrote it (through ``path.tmp``, as :meth:`Model.save` does);
    a failure leaves no temporary file and raises :class:`RunFileError` naming ``path``."""
    try:
        write()
    except OSError as e:
        path.with_name(path.name + ".tmp").unlink(missing_ok=True)
        raise RunFileError(path, e) from None
    return path


def close_and_cut(file: TextIO, path: Path, end: int) -> None:
    """Close ``file`` after a failed write (what it still buffers is dropped) and cut ``path``
    back to ``end`` bytes."""
    for undo in (file.close, lambda: os.truncate(path, end)):
        try:
            undo()
        except OSError:
            pass
