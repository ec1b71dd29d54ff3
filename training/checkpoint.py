"""Training checkpoints: everything the loop needs to continue a run as if it never stopped.

A checkpoint directory holds::

    ckpt-00000006.npz     the state after 6 completed steps
    ckpt-00000008.npz
    latest                one line naming the committed checkpoint: "ckpt-00000008.npz"

Each ``ckpt-*.npz`` is a plain ``np.savez`` archive, readable with ``allow_pickle=False``:

- ``model/<name>``: float32 parameters under PyTorch names (as :meth:`Model.save` writes them);
- ``momentum/<name>``: float32 SGD momentum buffers (absent before the first step);
- ``loop/losses``: float64 (step,), the loss of every completed step;
- ``loop/recent_hits``: float64, the per-step training accuracies the progress bar averages;
- ``loop/breakdown``: float64 (3,), communication, convolution and other seconds summed so far;
- ``meta``: uint8, UTF-8 JSON: format and version, ``step`` (steps completed, the next step to
  run), the data-order position (``seed``, ``epoch``, ``position`` = batches of that epoch
  already used, ``steps_per_epoch``, ``order_sha256`` of that epoch's order), the clocks
  (``conv_seconds``, ``train_seconds``), the run's ``fingerprint``, and the ``description``
  of the network (:mod:`hetconv.description`: its spec, input shape, classes and the input's
  normalisation; absent in checkpoints written before it was recorded).

**Data order and randomness.** The loop keeps no random generator between steps: the order of
epoch ``e`` is :func:`hetconv.data.epoch_order` ``(n, seed, e)``, a fresh
``default_rng([seed, e]).permutation(n)`` each time, so ``(seed, epoch, position)`` is the whole
data-order state. The synthetic set and the initial weights are functions of the seed too.
Resuming recomputes the epoch's order and refuses if its SHA-256 is not the one recorded (a
NumPy that permutes differently would otherwise change the run silently).

**Atomicity.** A checkpoint is written to a temporary name in the same directory, flushed and
fsynced, then renamed over its final name with :func:`os.replace` (atomic on POSIX and
Windows); the directory is fsynced where the platform allows. Only then is ``latest`` replaced
the same way: that rename is the commit. A crash at any point leaves ``latest`` naming a
complete, fsynced file, and files newer than ``latest`` (written but not committed) are
ignored and later overwritten. The zip format's CRC-32 catches a damaged file on load; the
loader then reports it by name and falls back to the next older checkpoint.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, TextIO

import numpy as np

from hetconv.data import epoch_order
from hetconv.description import Description, read_description
from hetconv.npz import read_arrays

from .fingerprint import fingerprint_differences, order_digest

__all__ = [
    "CheckpointDir",
    "CheckpointError",
    "TrainingState",
    "read_model",
    "read_weights",
    "resume_point",
]

FORMAT = "hetconv-checkpoint"
VERSION = 1
DEFAULT_KEEP = 3
POINTER_NAME = "latest"
_NAME = re.compile(r"^ckpt-(\d{8,})\.npz$")
_TEMPORARY_MARK = ".tmp-"


class CheckpointError(ValueError):
    """A checkpoint is unreadable, or belongs to a run this one cannot continue."""


@dataclass
class TrainingState:
    """The training loop's state after ``step`` completed steps.

    Attributes:
        step: steps completed; the next step to run.
        epoch, position: the next step reads batch ``position`` of epoch ``epoch``'s order.
        seed: the run's seed (with ``epoch`` it defines the order).
        steps_per_epoch: batches per epoch of the run that wrote it.
        order_sha256: SHA-256 of ``epoch_order(n, seed, epoch)``'s int64 bytes.
        model: parameter name -> float32 array.
        momentum: parameter name -> float32 momentum buffer (empty before the first step).
        losses: float64 (step,) loss of every completed step.
        recent_hits: float64 training accuracies of the last steps (at most 50).
        breakdown: float64 (3,) communication, convolution, other seconds summed so far.
        conv_seconds: convolution seconds so far.
        train_seconds: wall-clock training seconds so far.
        fingerprint: :func:`run_fingerprint` of the run.
        environment: :func:`compute_environment` of the process that wrote it.
        description: the network, its input and the input's normalisation (None: unknown).
    """

    step: int
    epoch: int
    position: int
    seed: int
    steps_per_epoch: int
    order_sha256: str
    model: dict[str, np.ndarray]
    momentum: dict[str, np.ndarray]
    losses: np.ndarray
    recent_hits: np.ndarray
    breakdown: np.ndarray
    conv_seconds: float
    train_seconds: float
    fingerprint: dict
    environment: dict = field(default_factory=dict)
    description: Description | None = None


# -- run identity ---------------------------------------------------------------------------


def _write_npz(file: BinaryIO, arrays: dict[str, np.ndarray]) -> None:
    """Write the archive; the one place the bytes go out (tests replace it to simulate crashes)."""
    np.savez(file, **arrays)


def _to_arrays(state: TrainingState) -> dict[str, np.ndarray]:
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "step": state.step,
        "epoch": state.epoch,
        "position": state.position,
        "seed": state.seed,
        "steps_per_epoch": state.steps_per_epoch,
        "order_sha256": state.order_sha256,
        "conv_seconds": state.conv_seconds,
        "train_seconds": state.train_seconds,
        "fingerprint": state.fingerprint,
        "environment": state.environment,
    }
    if state.description is not None:
        meta["description"] = state.description.as_json()
    arrays: dict[str, np.ndarray] = {
        "meta": np.frombuffer(json.dumps(meta, sort_keys=True).encode("utf-8"), np.uint8),
        "loop/losses": np.asarray(state.losses, np.float64),
        "loop/recent_hits": np.asarray(state.recent_hits, np.float64),
        "loop/breakdown": np.asarray(state.breakdown, np.float64),
    }
    arrays.update({f"model/{k}": np.asarray(v, np.float32) for k, v in state.model.items()})
    arrays.update({f"momentum/{k}": np.asarray(v, np.float32) for k, v in state.momentum.items()})
    return arrays


def read_checkpoint(path: str | os.PathLike) -> TrainingState:
    """Load one checkpoint file, checking every member (zip CRC) and the metadata.

    Raises:
        CheckpointError: naming the file and what is wrong with it.
    """
    try:
        arrays = read_arrays(path)  # reads all: checks CRCs (and declared sizes first)
        if "meta" not in arrays:
            raise ValueError("no meta member")
        meta = json.loads(arrays.pop("meta").tobytes().decode("utf-8"))
        if not isinstance(meta, dict):
            raise ValueError(f"its meta is a JSON {type(meta).__name__}, not an object")
        if meta.get("format") != FORMAT or meta.get("version") != VERSION:
            raise ValueError(
                f"format {meta.get('format')!r} version {meta.get('version')!r}, "
                f"expected {FORMAT!r} version {VERSION}"
            )
        losses = arrays.pop("loop/losses")
        if losses.shape != (meta["step"],):
            raise ValueError(f"{losses.shape[0]} losses for {meta['step']} steps")
        state = TrainingState(
            step=int(meta["step"]),
            epoch=int(meta["epoch"]),
            position=int(meta["position"]),
            seed=int(meta["seed"]),
            steps_per_epoch=int(meta["steps_per_epoch"]),
            order_sha256=str(meta["order_sha256"]),
            model={},
            momentum={},
            losses=losses,
            recent_hits=arrays.pop("loop/recent_hits"),
            breakdown=arrays.pop("loop/breakdown"),
            conv_seconds=float(meta["conv_seconds"]),
            train_seconds=float(meta["train_seconds"]),
            fingerprint=dict(meta["fingerprint"]),
            environment=dict(meta.get("environment") or {}),
        )
        if meta.get("description") is not None:
            state.description = Description.from_json(meta["description"])
        for name, value in arrays.items():
            group, _, key = name.partition("/")
            if group not in ("model", "momentum") or value.dtype != np.float32:
                raise ValueError(f"unexpected member {name} ({value.dtype}; expected float32)")
            getattr(state, group)[key] = value
        if not state.model:
            raise ValueError("no model parameters")
    except (OSError, EOFError, KeyError, TypeError, ValueError, zipfile.BadZipFile) as e:
        what = f"no {e}" if isinstance(e, KeyError) else e
        raise CheckpointError(f"checkpoint {os.fspath(path)} is unreadable: {what}") from None
    return state


def _fsync_directory(directory: Path) -> None:
    """Make a rename in ``directory`` durable; not possible (nor needed) on every platform."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # Windows cannot open a directory; its renames are journaled
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _replace_atomically(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Write via ``write`` to a temporary file beside ``path``, fsync it, rename it over ``path``.

    On any error the temporary file is removed and ``path`` is left as it was.
    """
    temporary = path.with_name(f"{path.name}{_TEMPORARY_MARK}{os.getpid()}")
    try:
        with open(temporary, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)


# -- the directory --------------------------------------------------------------------------


class CheckpointDir:
    """A folder of numbered checkpoints and the ``latest`` pointer that commits them.

    Args:
        path: the folder (created by :meth:`prepare`, or by the first write without it).
        keep: how many committed checkpoints to keep; older ones are deleted.
    """

    def __init__(self, path: str | os.PathLike, keep: int = DEFAULT_KEEP):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.path = Path(path)
        self.keep = keep
        self._prepared = False

    def prepare(self) -> None:
        """Make sure checkpoints can be written here, before a run computes anything.

        Creates the folder (and its parents) if missing, then writes, fsyncs and removes a
        probe file in it. After this, :meth:`write` no longer creates the folder: one that
        vanishes mid-run (a drive unmounted, the folder deleted) fails the write instead of
        being silently recreated elsewhere.

        Raises:
            CheckpointError: naming the path: it is not a directory, or it is not writable
                (cannot be created, or a file cannot be written in it), and why.
        """
        path = self.path
        if path.exists() and not path.is_dir():
            raise CheckpointError(
                f"checkpoint directory {path} is not a directory (a file of that name exists; "
                "choose another --checkpoint-dir)"
            )
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            blocker = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
            why = f"{blocker} is not a directory" if blocker is not None else e.strerror
            raise CheckpointError(
                f"checkpoint directory {path} is not writable: it cannot be created ({why})"
            ) from None
        probe = None
        try:
            # Named like a temporary checkpoint: remove_temporaries deletes it if we are killed.
            fd, probe = tempfile.mkstemp(prefix=f"ckpt-probe{_TEMPORARY_MARK}", dir=path)
            try:
                os.write(fd, b"hetconv checks this folder is writable\n")
                os.fsync(fd)
            finally:
                os.close(fd)
            os.unlink(probe)
        except OSError as e:
            if probe is not None:
                with contextlib.suppress(OSError):
                    os.unlink(probe)
            raise CheckpointError(
                f"checkpoint directory {path} is not writable ({e.strerror or e})"
            ) from None
        self._prepared = True

    def file_for(self, step: int) -> Path:
        return self.path / f"ckpt-{step:08d}.npz"

    def files(self) -> list[tuple[int, Path]]:
        """(step, path) of every checkpoint file present, newest first."""
        if not self.path.is_dir():
            return []
        found = []
        for entry in self.path.iterdir():
            match = _NAME.match(entry.name)
            if match and entry.is_file():
                found.append((int(match.group(1)), entry))
        return sorted(found, reverse=True)

    def pointer(self) -> Path | None:
        """The file ``latest`` names, or None when there is no usable pointer."""
        try:
            name = (self.path / POINTER_NAME).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError):
            return None
        return self.path / name if _NAME.match(name) else None

    def write(self, state: TrainingState) -> Path:
        """Write ``state`` as ``ckpt-<step>.npz``, commit it in ``latest``, drop old ones."""
        if not self._prepared:
            self.path.mkdir(parents=True, exist_ok=True)
        elif not self.path.is_dir():
            raise FileNotFoundError(errno.ENOENT, f"checkpoint directory {self.path} is gone")
        target = self.file_for(state.step)
        arrays = _to_arrays(state)
        _replace_atomically(target, lambda f: _write_npz(f, arrays))
        _replace_atomically(
            self.path / POINTER_NAME, lambda f: f.write(f"{target.name}\n".encode())
        )
        self._prune(state.step)
        return target

    def _prune(self, committed_step: int) -> None:
        # Files past the committed step are from an attempt this run resumed before, or
        # damaged: this run rewrites those steps. Beyond `keep`, older checkpoints go.
        kept = 0
        for step, path in self.files():
            if step > committed_step or kept >= self.keep:
                path.unlink(missing_ok=True)
            else:
                kept += 1

    def remove_temporaries(self) -> None:
        """Delete temporary files a killed writer left behind (call once, before writing)."""
        if self.path.is_dir():
            for entry in self.path.iterdir():
                name = entry.name
                if name.startswith(("ckpt-", POINTER_NAME)) and _TEMPORARY_MARK in name:
                    entry.unlink(missing_ok=True)

    def load_latest(
        self, report: Callable[[str], None] = lambda message: None
    ) -> tuple[TrainingState, Path] | None:
        """The newest usable checkpoint and its path, or None when the folder holds none.

        The file ``latest`` names comes first; if it is damaged, each older one in turn
        (``report`` is told about each file skipped). Files newer than ``latest`` were never
        committed and are ignored.

        Raises:
            CheckpointError: checkpoint files exist but none of them can be read.
        """
        files = self.files()
        committed = self.pointer()
        if committed is not None and committed.is_file():
            committed_step = int(_NAME.match(committed.name).group(1))
            candidates = [committed] + [p for s, p in files if s < committed_step]
        else:
            if files:
                report(
                    f"{self.path / POINTER_NAME} is missing or names no checkpoint file; "
                    "using the newest checkpoint file"
                )
            candidates = [p for _, p in files]
        failures = []
        for path in candidates:
            try:
                return read_checkpoint(path), path
            except CheckpointError as e:
                failures.append(str(e))
                report(f"{e}; trying the previous checkpoint")
        if failures:
            raise CheckpointError(f"no readable checkpoint in {self.path}: {failures[-1]}")
        return None


# -- resuming -------------------------------------------------------------------------------


def resume_point(
    checkpoints: CheckpointDir,
    fingerprint: dict,
    *,
    resume: bool,
    steps: int,
    train_size: int,
    batch: int,
    seed: int,
    log: TextIO,
) -> tuple[TrainingState, Path] | None:
    """The checkpoint a run of ``steps`` steps continues from, or None to start at step 0.

    Args:
        checkpoints: the run's folder.
        fingerprint: :func:`run_fingerprint` of the run.
        resume: whether the run was asked to continue (``--resume``).
        train_size, batch, seed: the run's training set size, batch and seed (they decide
            where in which epoch order a step is).
        log: where to say which checkpoint files were skipped, or that there are none.

    Raises:
        CheckpointError: the folder holds a run this one would overwrite (no ``resume``), or
            the checkpoint cannot be continued by this configuration (the message names why).
    """
    if not resume:
        existing = checkpoints.files()
        if existing:
            raise CheckpointError(
                f"{checkpoints.path} already holds checkpoints (newest at step "
                f"{existing[0][0]}); pass --resume to continue that run, or choose an empty "
                "--checkpoint-dir"
            )
        return None
    found = checkpoints.load_latest(report=lambda message: print(message, file=log))
    if found is None:
        print(f"no checkpoint in {checkpoints.path}: starting from scratch", file=log)
        return None
    state, path = found
    differences = fingerprint_differences(state.fingerprint, fingerprint)
    if differences:
        raise CheckpointError(
            f"cannot resume from {path}: it was written by a different run "
            f"({'; '.join(differences)})"
        )
    if state.step > steps:
        raise CheckpointError(
            f"cannot resume from {path}: it is at step {state.step}, past this run's {steps} steps"
        )
    steps_per_epoch = train_size // batch
    if (state.steps_per_epoch, state.epoch, state.position) != (
        steps_per_epoch,
        *divmod(state.step, steps_per_epoch),
    ):
        raise CheckpointError(
            f"cannot resume from {path}: epoch {state.epoch} batch {state.position} of "
            f"{state.steps_per_epoch} does not match step {state.step}"
        )
    if order_digest(epoch_order(train_size, seed, state.epoch)) != state.order_sha256:
        raise CheckpointError(
            f"cannot resume from {path}: the data order of epoch {state.epoch} is not the one it "
            "recorded (NumPy permutes differently?), so the run could not continue identically"
        )
    return state, path


# -- weights for --load and evaluation ------------------------------------------------------


def read_weights(path: str | os.PathLike) -> tuple[dict[str, np.ndarray], str]:
    """The model parameters a path holds, and what was read (:func:`read_model` without the
    description), for ``--load``."""
    weights, _, what = read_model(path)
    return weights, what


def read_model(
    path: str | os.PathLike,
) -> tuple[dict[str, np.ndarray], Description | None, str]:
    """The model parameters a path holds, their description (None for a file written before
    weight files described themselves, or by ``np.savez`` elsewhere) and what was read.

    ``path`` may be a model ``.npz`` (:meth:`hetconv.model.Model.save`, or ``np.savez`` of a
    PyTorch state dict), a checkpoint file, a checkpoint folder (its latest checkpoint), or a
    run folder (its ``model.npz``, else the latest of its ``checkpoints/``).

    Raises:
        ValueError: the path holds none of these, or is unreadable (the message names it).
    """
    path = Path(path)
    if path.is_dir():
        if (path / "model.npz").is_file():
            return read_model(path / "model.npz")
        folder = path / "checkpoints" if (path / "checkpoints").is_dir() else path
        found = CheckpointDir(folder).load_latest()
        if found is None:
            raise ValueError(
                f"{path} holds no model.npz and no checkpoint: give a model .npz, a checkpoint "
                "file or folder, or a run folder"
            )
        state, file = found
        return state.model, state.description, f"checkpoint {file} (step {state.step})"
    try:
        with zipfile.ZipFile(path) as archive:
            checkpoint = "meta.npy" in archive.namelist()
        weights = None if checkpoint else _floating(read_arrays(path), path)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        why = "not an .npz archive of named arrays" if isinstance(e, zipfile.BadZipFile) else e
        raise ValueError(f"cannot read weights from {path}: {why}") from None
    if weights is not None:
        return weights, read_description(path), f"model {path}"
    state = read_checkpoint(path)
    return state.model, state.description, f"checkpoint {path} (step {state.step})"


#: The one integer a weight file holds: batch norm's count of batches, an int64 scalar as in
#: PyTorch's state dicts.
_COUNTER = ".num_batches_tracked"


def _floating(weights: dict[str, np.ndarray], path: Path) -> dict[str, np.ndarray]:
    """``weights`` as float32 (batch norm's batch counts as int64 scalars), refusing any other
    that is not a real floating-point number."""
    if not weights:
        raise ValueError("it holds no arrays")
    out = {}
    for name, value in weights.items():
        if name.endswith(_COUNTER) and value.shape == () and value.dtype.kind in "iu":
            out[name] = value.astype(np.int64)
        elif value.dtype.kind != "f":
            raise ValueError(
                f"{name} is {value.dtype}; weights must be real floating-point numbers "
                "(float32, or float64 converted)"
            )
        else:
            out[name] = value.astype(np.float32, copy=False)
    return out
