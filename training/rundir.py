"""A run directory: where one ``hetconv train`` keeps everything it produced.

::

    runs/NAME/
      config.toml     the run's resolved flags: `hetconv train --config runs/NAME/config.toml`
                      runs it again
      metrics.csv     one row per step (hetconv.training.metrics)
      trace.jsonl     the trace (hetconv.training.trace)
      checkpoints/    checkpoints (hetconv.training.checkpoint); --resume continues from them
      model.npz       the weights after the last step (or where Ctrl-C stopped it)
      tensorboard/    TensorBoard event files (--tensorboard)
      figures/        `hetconv report runs/NAME`

This module knows the layout, writes the step tables (:class:`MetricsLog`: the CSV, and the
TensorBoard scalars through ``tensorboardX``, an extra) and reads and writes ``config.toml``
(sections of flat ``key = value`` lines; the keys are the flags' names).
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .config import require_tensorboard
from .metrics import (
    FIXED_COLUMNS,
    columns_for,
    format_cell,
    node_column,
    row_nodes,
    step_row,
)
from .trace import RunFileError, close_and_cut

CONFIG_NAME = "config.toml"
METRICS_NAME = "metrics.csv"
TRACE_NAME = "trace.jsonl"
CHECKPOINTS_NAME = "checkpoints"
MODEL_NAME = "model.npz"
TENSORBOARD_NAME = "tensorboard"
FIGURES_NAME = "figures"
_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")


class RunDir:
    """The folder of one run, ``ROOT/NAME``.

    Args:
        root: the folder that holds runs (``--run-dir``).
        name: the run's name (``--name``); a letter or digit, then letters, digits, ``._+-``.
    """

    def __init__(self, root: str | os.PathLike, name: str):
        if not _RUN_NAME.match(name):
            raise ValueError(
                f"run name {name!r} is not a plain folder name: use letters, digits and ._+- "
                "(starting with a letter or digit)"
            )
        self.root, self.name = Path(root), name
        self.path = self.root / name
        self.resume = False

    @classmethod
    def choose(
        cls, root: str | os.PathLike, name: str | None = None, *, resume: bool = False
    ) -> RunDir:
        """The folder of a new run (or the one ``resume`` continues); :meth:`make` creates it.

        Without ``name`` the run is named by the local time, ``YYYYMMDD-HHMMSS`` (with ``-2``,
        ``-3``... when a run of that second exists).

        Raises:
            ValueError: ``name`` exists and ``resume`` is not set, ``resume`` without a name,
                or the path is a file.
        """
        if name is None:
            if resume:
                raise ValueError("--resume needs --name: the run to continue")
            stamp = time.strftime("%Y%m%d-%H%M%S")
            run, number = cls(root, stamp), 1
            while run.path.exists():
                number += 1
                run = cls(root, f"{stamp}-{number}")
        else:
            run = cls(root, name)
            if run.path.exists() and not run.path.is_dir():
                raise ValueError(f"run folder {run.path} is a file")
            if run.path.exists() and not resume:
                raise ValueError(
                    f"run {run.path} already exists: choose another --name, or add --resume "
                    "to continue it"
                )
        run.resume = resume
        return run

    def make(self) -> bool:
        """Create the folder; returns whether this call created it.

        Raises:
            ValueError: a new run's folder appeared since :meth:`choose`, or cannot be created.
        """
        existed = self.path.is_dir()
        try:
            self.path.mkdir(parents=True, exist_ok=self.resume)
        except FileExistsError:  # another run took the name since choose()
            raise ValueError(f"run {self.path} already exists: choose another --name") from None
        except OSError as e:
            raise ValueError(f"cannot create run folder {self.path}: {e.strerror or e}") from None
        return not existed

    def discard_if_empty(self) -> None:
        """Remove the folder of a run that failed before its first step: nothing in it but
        its config, a trace of no step (its plan record at most), a metrics header, empty
        checkpoints/ and tensorboard/ (so the same ``--name`` can be tried again)."""
        try:
            lines = self.metrics.read_text(encoding="utf-8").count("\n")
        except OSError:
            lines = 0
        if lines > 1 or self.model.exists() or _trace_has_a_step(self.trace):
            return
        if self.checkpoints.is_dir() and any(self.checkpoints.iterdir()):
            return
        for file in (self.config, self.metrics, self.trace):
            file.unlink(missing_ok=True)
        for folder in (self.checkpoints, self.tensorboard):
            if folder.is_dir():
                for entry in folder.iterdir():
                    entry.unlink()
                folder.rmdir()
        try:
            self.path.rmdir()  # only if nothing else is in it
        except OSError:
            pass

    @property
    def config(self) -> Path:
        return self.path / CONFIG_NAME

    @property
    def metrics(self) -> Path:
        return self.path / METRICS_NAME

    @property
    def trace(self) -> Path:
        return self.path / TRACE_NAME

    @property
    def checkpoints(self) -> Path:
        return self.path / CHECKPOINTS_NAME

    @property
    def model(self) -> Path:
        return self.path / MODEL_NAME

    @property
    def tensorboard(self) -> Path:
        return self.path / TENSORBOARD_NAME

    @property
    def figures(self) -> Path:
        return self.path / FIGURES_NAME


@dataclass(frozen=True)
class RunFolderConfig:
    """Whether and where a run keeps its folder (``hetconv train``'s ``--run-dir``, ``--name``,
    ``--no-run-dir``, ``--resume``, ``--tensorboard``); the checks refuse what the command line
    refuses.

    Args:
        root: the folder that holds runs.
        name: the run's folder name (None: the local time).
        enabled: False: no run folder, only the outputs named on their own.
        resume: continue a run: the one ``name`` names, or the checkpoints in
            ``checkpoint_dir`` in a new folder.
        checkpoint_dir: checkpoints named on their own (then ``resume`` needs no name).
        tensorboard: also write TensorBoard event files into the folder.
    """

    root: str = "runs"
    name: str | None = None
    enabled: bool = True
    resume: bool = False
    checkpoint_dir: str | None = None
    tensorboard: bool = False

    def __post_init__(self) -> None:
        if self.tensorboard:
            require_tensorboard()
        if not self.enabled:
            for flag, given in (("--name", self.name), ("--tensorboard", self.tensorboard)):
                if given:
                    raise ValueError(f"{flag} needs a run folder: drop --no-run-dir")
        elif self.resume and not self.name and not self.checkpoint_dir:
            raise ValueError("--resume needs --checkpoint-dir or --name: the run to continue")

    def choose(self) -> RunDir | None:
        """The run's folder (:meth:`RunDir.choose`; not yet made), or None without one."""
        if not self.enabled:
            return None
        # resume with checkpoint_dir alone continues those checkpoints in a new run folder.
        return RunDir.choose(self.root, self.name, resume=self.resume and bool(self.name))


def _trace_has_a_step(path: Path) -> bool:
    """Whether the trace at ``path`` holds a step's record (one with ``step``), or anything
    that cannot be read as records (kept: it is not known to be empty)."""
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    continue
                record = json.loads(line)
                if not isinstance(record, dict) or "step" in record:
                    return True
    except FileNotFoundError:
        return False
    except (OSError, ValueError):
        return True
    return False


def find_run(path: str | os.PathLike) -> Path | None:
    """The run folder ``path`` lies in (itself, its model, a checkpoint or the checkpoints
    folder in it): the nearest of it and two parents that holds ``config.toml``; else None."""
    path = Path(path).resolve()
    for folder in [path, *path.parents][:3]:
        if (folder / CONFIG_NAME).is_file():
            return folder
    return None


# -- metrics.csv and TensorBoard -----------------------------------------------------------


def _replace_text(path: Path, text: str) -> None:
    temporary = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        with open(temporary, "w", newline="", encoding="utf-8") as f:
            f.write(text)
        os.replace(temporary, path)
    except BaseException as e:
        temporary.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise RunFileError(path, e) from None
        raise


class MetricsCsv:
    """Writes ``metrics.csv`` as steps and evaluations come (:mod:`hetconv.training.metrics`).

    A step's row is appended and flushed at once, so an interrupted run keeps every step it
    traced. A node seen for the first time adds columns and an evaluation fills cells of an
    earlier row: both rewrite the file (to a temporary name, then renamed over it).

    Args:
        path: the CSV file.
        resume_step: continue a run at this step: the rows of earlier steps are kept, later
            ones (written after the checkpoint being resumed) dropped. None starts a new file.
    """

    def __init__(self, path: str | os.PathLike, resume_step: int | None = None):
        self.path = Path(path)
        self.rows: list[dict] = []
        self.nodes: list[str] = []
        if resume_step is not None and self.path.is_file():
            self._keep_rows_before(resume_step)
        self._file: io.TextIOBase | None = None
        self._rewrite()

    def _keep_rows_before(self, resume_step: int) -> None:
        with open(self.path, newline="", encoding="utf-8") as f:
            for row in csv.DictReader(f):
                if not row.get("step", "").isdigit() or int(row["step"]) >= resume_step:
                    break
                kept = {}
                for key, cell in row.items():
                    if key is None or cell in ("", None):
                        continue
                    kept[key] = int(cell) if cell.lstrip("-").isdigit() else float(cell)
                self._add_nodes(row_nodes(kept))
                self.rows.append(kept)

    def _add_nodes(self, nodes: list[str]) -> bool:
        new = [node for node in nodes if node not in self.nodes]
        self.nodes += new
        return bool(new)

    def _line(self, row: dict) -> str:
        out = io.StringIO()
        csv.writer(out, lineterminator="\n").writerow(
            format_cell(row.get(column)) for column in columns_for(self.nodes)
        )
        return out.getvalue()

    def _rewrite(self) -> None:
        if self._file is not None:
            self._file.close()
        header = io.StringIO()
        csv.writer(header, lineterminator="\n").writerow(columns_for(self.nodes))
        _replace_text(self.path, header.getvalue() + "".join(map(self._line, self.rows)))
        self._file = open(self.path, "a", newline="", encoding="utf-8")

    def step(self, record: dict) -> dict:
        """Add a trace step record's row; returns the row."""
        row = step_row(record)
        self.rows.append(row)
        if self._add_nodes(row_nodes(row)):
            self._rewrite()
        else:
            end = self._file.tell()
            try:
                self._file.write(self._line(row))
                self._file.flush()
            except OSError as e:  # no torn row: the file is cut back to the rows before
                close_and_cut(self._file, self.path, end)
                self._file = None
                raise RunFileError(self.path, e) from None
        return row

    def evaluation(self, trained_steps: int, loss: float, accuracy: float) -> None:
        """Fill the held-out cells of the row of the step after which the evaluation ran."""
        for row in reversed(self.rows):
            if row["step"] == trained_steps - 1:
                row.update(held_out_loss=loss, held_out_accuracy=accuracy)
                self._rewrite()
                return

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


#: TensorBoard tag of each metrics.csv column (per-node columns: ``PREFIX/NODE``, with the
#: ``:`` of ``HOST:PORT`` written ``_``).
TENSORBOARD_TAGS = {
    "loss": "train/loss",
    "accuracy": "train/accuracy",
    "images_per_second": "train/images_per_second",
    "seconds": "time/step_seconds",
    "comm_seconds": "time/comm_seconds",
    "conv_seconds": "time/conv_seconds",
    "other_seconds": "time/other_seconds",
    "bytes": "link/bytes",
    "held_out_loss": "held_out/loss",
    "held_out_accuracy": "held_out/accuracy",
}


def tensorboard_tag(column: str) -> str:
    if column in TENSORBOARD_TAGS:
        return TENSORBOARD_TAGS[column]
    prefix, _, node = column.partition(":")
    return f"{prefix}/{node.replace(':', '_')}"  # TensorBoard tags hold no ':'


class TensorBoardLog:
    """The same figures as TensorBoard scalars, at global step = steps trained (a step's
    row at its ``step + 1``; an evaluation at the steps before it).

    Args:
        folder: where the event files go.
        resume_step: continue a run at this step: TensorBoard drops what earlier writers put
            at later steps (tensorboardX's ``purge_step``).
    """

    def __init__(self, folder: str | os.PathLike, resume_step: int | None = None):
        try:
            from tensorboardX import SummaryWriter
        except ModuleNotFoundError:
            raise ValueError(
                "--tensorboard needs tensorboardX: pip install 'hetconv[tensorboard]'"
            ) from None
        purge = None if resume_step is None else resume_step + 1
        self._writer = SummaryWriter(logdir=os.fspath(folder), purge_step=purge, flush_secs=10)

    def step(self, row: dict) -> None:
        trained = row["step"] + 1
        for column, value in row.items():
            if column not in ("step", "epoch") and not (
                isinstance(value, float) and math.isnan(value)
            ):
                self._writer.add_scalar(tensorboard_tag(column), value, trained)

    def evaluation(self, trained_steps: int, loss: float, accuracy: float) -> None:
        self._writer.add_scalar(TENSORBOARD_TAGS["held_out_loss"], loss, trained_steps)
        self._writer.add_scalar(TENSORBOARD_TAGS["held_out_accuracy"], accuracy, trained_steps)

    def close(self) -> None:
        self._writer.close()


class MetricsLog:
    """What the training loop feeds its step and evaluation records to besides the trace: the
    CSV and TensorBoard, each when configured.

    Args:
        csv_path: ``metrics.csv``, or None.
        tensorboard: the TensorBoard folder, or None.
        resume_step: see :class:`MetricsCsv`.
    """

    def __init__(
        self,
        csv_path: str | os.PathLike | None,
        tensorboard: str | os.PathLike | None,
        resume_step: int | None = None,
    ):
        self.csv = MetricsCsv(csv_path, resume_step) if csv_path else None
        try:
            self.board = TensorBoardLog(tensorboard, resume_step) if tensorboard else None
        except BaseException:
            self.close()
            raise

    def step(self, record: dict) -> None:
        if self.csv is None and self.board is None:
            return
        row = self.csv.step(record) if self.csv is not None else step_row(record)
        if self.board is not None:
            self.board.step(row)

    def evaluation(self, record: dict) -> None:
        args = (record["trained_steps"], record["loss"], record["accuracy"])
        if self.csv is not None:
            self.csv.evaluation(*args)
        if self.board is not None:
            self.board.evaluation(*args)

    def close(self) -> None:
        for sink in (getattr(self, "csv", None), getattr(self, "board", None)):
            if sink is not None:
                sink.close()


# -- config.toml ----------------------------------------------------------------------------

_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def _toml_string(text: str) -> str:
    escapes = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f"}
    escapes["\r"] = "\\r"
    out = []
    for char in text:
        if char in escapes:
            out.append(escapes[char])
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            out.append(f"\\u{ord(char):04x}")
        else:
            out.append(char)
    return '"' + "".join(out) + '"'


def toml_value(value: object) -> str:
    """One TOML value: a bool, int, finite float, string, or list of those."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{value} has no place in a config file")
        return repr(value)
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} {value!r} to TOML")


def write_config(
    path: str | os.PathLike, sections: dict[str, dict[str, object]], comment: str = ""
) -> None:
    """Write ``sections`` (table name -> key -> value; None values left out) as TOML."""
    lines = [f"# {line}".rstrip() for line in comment.splitlines()]
    for section, values in sections.items():
        kept = {k: v for k, v in values.items() if v is not None}
        if not kept:
            continue
        lines += ["", f"[{section}]"]
        for key, value in kept.items():
            if not _BARE_KEY.match(key):
                raise ValueError(f"config key {key!r} is not a bare TOML key")
            lines.append(f"{key} = {toml_value(value)}")
    _replace_text(Path(path), "\n".join(lines).lstrip("\n") + "\n")


def _toml():
    if sys.version_info >= (3, 11):
        import tomllib

        return tomllib
    import tomli

    return tomli


def read_config(path: str | os.PathLike) -> dict[str, object]:
    """The keys of a config file, from every table, as one flat mapping.

    Raises:
        ValueError: unreadable, not TOML, a value outside a table, or a key in two tables (the
            message names the file and key).
    """
    flat: dict[str, object] = {}
    for _, key, value in read_config_tables(path):
        if key in flat:
            raise ValueError(f"config {path}: {key} is given twice")
        flat[key] = value
    return flat


def read_config_tables(path: str | os.PathLike) -> list[tuple[str, str, object]]:
    """(table, key, value) of every key of a config file, in the file's order.

    Raises:
        ValueError: unreadable, not TOML, or a value outside a table (naming the file and key).
    """
    toml = _toml()
    try:
        with open(path, "rb") as f:
            document = toml.load(f)
    except OSError as e:
        raise ValueError(f"cannot read config {path}: {e.strerror or e}") from None
    except toml.TOMLDecodeError as e:
        raise ValueError(f"config {path} is not TOML: {e}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"config {path} is not UTF-8 text ({e.reason})") from None
    found = []
    for section, table in document.items():
        if not isinstance(table, dict):
            raise ValueError(
                f"config {path}: {section} = {table!r} stands outside a table ([data], "
                "[training], ...)"
            )
        found += [(section, key, value) for key, value in table.items()]
    return found


__all__ = [
    "FIXED_COLUMNS",
    "MetricsCsv",
    "MetricsLog",
    "RunDir",
    "TensorBoardLog",
    "find_run",
    "node_column",
    "read_config",
    "read_config_tables",
    "tensorboard_tag",
    "toml_value",
    "write_config",
]
