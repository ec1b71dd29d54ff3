"""CIFAR-10 and CIFAR-100's official "python version" batch files, read safely: from the
tarball (one pass, nothing extracted) or the folder it extracts to, each batch file unpickled by
an unpickler that admits only the globals genuine files name.

This module imports nothing of the package (only the standard library and numpy): it is the one
module that unpickles, and it has no way to the network. So the error every dataset reader
raises, :class:`DatasetError`, is defined here; :mod:`hetconv.data` re-exports it.
"""

from __future__ import annotations

import pickle
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

IMAGE_SHAPE = (3, 32, 32)  # CIFAR's, and the synthetic set's
_PIXELS = 3 * 32 * 32  # 3072 values per CIFAR image


class DatasetError(ValueError):
    """A dataset file is missing or malformed; the message names the file and the problem."""


def _describe(value: object) -> str:
    if isinstance(value, np.ndarray):
        return f"ndarray of dtype {value.dtype} and shape {value.shape}"
    return type(value).__name__


@dataclass(frozen=True)
class _CifarLayout:
    """What the official python-version files of one CIFAR dataset are called and hold."""

    kind: str
    title: str
    tarball: str
    folder: str  # what the tarball extracts to
    splits: dict[str, tuple[str, ...]]
    label_key: bytes
    classes: int


_CIFAR10 = _CifarLayout(
    "cifar10",
    "CIFAR-10",
    "cifar-10-python.tar.gz",
    "cifar-10-batches-py",
    {"train": tuple(f"data_batch_{i}" for i in range(1, 6)), "test": ("test_batch",)},
    b"labels",
    10,
)
_CIFAR100 = _CifarLayout(
    "cifar100",
    "CIFAR-100",
    "cifar-100-python.tar.gz",
    "cifar-100-python",
    {"train": ("train",), "test": ("test",)},
    b"fine_labels",  # the 100 classes; b"coarse_labels" holds the 20 superclasses
    100,
)


def _read_cifar_files(layout: _CifarLayout, path: Path, wanted: Sequence[str]) -> dict:
    """{file: (images, labels)} of the ``wanted`` batch files, read from a tarball (one pass
    over it) or a folder."""
    if path.is_file():
        return _read_cifar_tar(layout, path, wanted)
    if path.is_dir():
        folder = _resolve_cifar_dir(layout, path, tuple(wanted))
        missing = [f for f in wanted if not (folder / f).is_file()]
        if missing:
            raise DatasetError(
                f"{layout.title} files missing from {folder}: {', '.join(missing)} "
                f"(expected the official python-version files)"
            )
        batches = {}
        for f in wanted:
            with (folder / f).open("rb") as file:
                batches[f] = _read_cifar_batch(file, folder / f, layout)
        return batches
    raise DatasetError(
        f"{layout.title} data {path} does not exist (expected the official tarball "
        f"{layout.tarball}, the {layout.folder} folder it extracts to, or that folder's "
        "parent)"
    )


def _resolve_cifar_dir(layout: _CifarLayout, data_dir: Path, files: tuple[str, ...]) -> Path:
    """Return the folder holding the batch files: ``data_dir`` or its extracted folder."""
    nested = data_dir / layout.folder
    if not any((data_dir / f).is_file() for f in files) and nested.is_dir():
        return nested
    return data_dir


def _read_cifar_tar(layout: _CifarLayout, path: Path, wanted: Sequence[str]) -> dict:
    """{file: (images, labels)} of ``layout.folder/<file>`` members, read straight from the
    tarball in one pass (nothing is extracted to disk)."""
    try:
        tar = tarfile.open(path, "r:*")
    except (tarfile.TarError, OSError, EOFError) as e:
        raise DatasetError(
            f"{path}: not a readable tar archive ({e}); expected the official {layout.tarball}"
        ) from e
    found: dict = {}
    seen: list[str] = []
    try:
        with tar:
            for member in tar:
                name = member.name.removeprefix("./")
                seen.append(name)
                folder, _, base = name.rpartition("/")
                if folder != layout.folder or base not in wanted or base in found:
                    continue
                where = f"{path} (member {name})"
                if not member.isfile():
                    raise DatasetError(f"{where}: not a regular file")
                with tar.extractfile(member) as file:
                    found[base] = _read_cifar_batch(file, where, layout)
                if len(found) == len(wanted):
                    break
    except (tarfile.TarError, OSError, EOFError) as e:
        raise DatasetError(f"{path}: the tar archive is damaged ({e})") from e
    missing = [f"{layout.folder}/{f}" for f in wanted if f not in found]
    if missing:
        shown = ", ".join(seen[:6]) + (" ..." if len(seen) > 6 else "")
        raise DatasetError(
            f"{path}: no member {', '.join(missing)} (it holds {shown or 'nothing'}); expected "
            f"the official {layout.tarball}"
        )
    return found


def _read_cifar_batch(
    file: BinaryIO, where: object, layout: _CifarLayout
) -> tuple[np.ndarray, np.ndarray]:
    """Read one batch file: uint8 images (n, 3, 32, 32) and int64 labels (n,)."""
    label_key = layout.label_key
    try:
        # Security: a pickle can name any callable and have it run. _CifarUnpickler admits
        # only the few globals genuine CIFAR files name, and builds arrays itself.
        batch = _CifarUnpickler(file, where, layout.title).load()
    except DatasetError:
        raise
    except Exception as exc:
        raise DatasetError(f"{where}: cannot unpickle {layout.title} batch ({exc!r})") from exc
    if not isinstance(batch, dict):
        raise DatasetError(f"{where}: expected a pickled dict, got {type(batch).__name__}")
    absent = [k for k in (b"data", label_key) if k not in batch]
    if absent:
        raise DatasetError(
            f"{where}: missing key(s) {absent} (has {sorted(map(repr, batch))}), "
            f"expected b'data' and {label_key!r}"
        )
    data, raw_labels = batch[b"data"], batch[label_key]
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8:
        raise DatasetError(f"{where}: b'data' must be a uint8 ndarray, got {_describe(data)}")
    if data.ndim != 2 or data.shape[1] != _PIXELS:
        raise DatasetError(f"{where}: b'data' must have shape (N, {_PIXELS}), got {data.shape}")
    try:
        labels = np.asarray(raw_labels)
    except Exception as exc:
        raise DatasetError(f"{where}: {label_key!r} is not a list of ints ({exc!r})") from exc
    if labels.ndim != 1 or (labels.size and labels.dtype.kind not in "iu"):
        raise DatasetError(
            f"{where}: {label_key!r} must be a flat list of ints, "
            f"got dtype {labels.dtype} shape {labels.shape}"
        )
    if labels.shape[0] != data.shape[0]:
        raise DatasetError(
            f"{where}: {labels.shape[0]} labels for {data.shape[0]} images, expected equal counts"
        )
    labels = labels.astype(np.int64)
    if labels.size and (labels.min() < 0 or labels.max() >= layout.classes):
        raise DatasetError(
            f"{where}: labels must lie in 0..{layout.classes - 1}, "
            f"got range {labels.min()}..{labels.max()}"
        )
    # Each row is 1024 R, 1024 G, 1024 B values, each plane 32x32 row-major: a plain reshape.
    images = np.ascontiguousarray(data.reshape(-1, *IMAGE_SHAPE))
    return images, labels


# -- reading the pickles safely -----------------------------------------------------------
#
# The official files are pickles, and unpickling can run any callable a file names. What a
# genuine file names (found by recording find_class while loading files made as the official
# ones were: Python 2's cPickle at protocol 2 with numpy 1.x, and Python 3 with numpy 2 at
# protocols 2 to 5) is: numpy's array reconstructor (``numpy.core.multiarray._reconstruct``,
# ``numpy._core.multiarray._reconstruct`` since numpy 2, or ``_frombuffer`` in ``numeric`` at
# protocol 5), ``numpy.ndarray``, ``numpy.dtype``, and ``_codecs.encode`` (Python 3 writes bytes
# that way at protocol 2). Everything else is refused when it is named, before it can run.
#
# Even the admitted names never reach numpy's own __setstate__ (which trusts its input: a
# doctored dtype state can flag a uint8 dtype as holding object pointers): they map to the
# stand-ins below, which check the state and build plain numeric arrays with np.frombuffer.

_PLAIN_DTYPE_KINDS = "biuf"  # bool, signed and unsigned ints, floats: no pointers, no fields


class _DtypeStandIn:
    """What ``numpy.dtype(code, align, copy)`` plus its pickled state describe, checked."""

    def __init__(self, code: object, align: object = False, copy: object = True):
        if isinstance(code, bytes):
            code = code.decode("ascii", "replace")
        if not isinstance(code, str) or len(code) > 8:
            raise ValueError(f"dtype code {code!r} is not a plain numeric type")
        try:
            dtype = np.dtype(code)
        except TypeError as exc:
            raise ValueError(f"dtype code {code!r} is not a numpy type") from exc
        if dtype.kind not in _PLAIN_DTYPE_KINDS or dtype.fields is not None or dtype.subdtype:
            raise ValueError(f"dtype {code!r} is not a plain numeric type")
        self.dtype = dtype

    def __setstate__(self, state: object) -> None:
        # (version, byteorder, subarray, names, fields, elsize, alignment, flags[, metadata])
        if not isinstance(state, tuple) or len(state) not in (8, 9) or state[0] not in (3, 4):
            raise ValueError(f"dtype state {state!r} is not a plain numeric dtype's")
        byteorder = state[1].decode("ascii") if isinstance(state[1], bytes) else state[1]
        if byteorder not in ("<", ">", "|", "=") or state[2:5] != (None, None, None):
            raise ValueError("dtype state has a byte order, subarray or fields of its own")
        if state[7] != 0 or (len(state) == 9 and state[8] is not None):
            raise ValueError(f"dtype state has flags {state[7]!r} (a plain dtype has none)")
        if byteorder in "<>":
            self.dtype = self.dtype.newbyteorder(byteorder)


class _ArrayStandIn:
    """What ``_reconstruct(ndarray, (0,), b'b')`` plus its pickled state describe."""

    array: np.ndarray | None = None

    def __setstate__(self, state: object) -> None:
        # (version, shape, dtype, is_fortran, raw bytes)
        if not isinstance(state, tuple) or len(state) != 5:
            raise ValueError("array state is not (version, shape, dtype, order, data)")
        _, shape, dtype, fortran, raw = state
        self.array = _plain_array(raw, dtype, shape, "F" if fortran else "C")


def _plain_array(raw: object, dtype: object, shape: object, order: object) -> np.ndarray:
    if not isinstance(dtype, _DtypeStandIn):
        raise ValueError(f"array dtype is {type(dtype).__name__}, not a pickled numpy dtype")
    if not isinstance(raw, bytes | bytearray):
        raise ValueError(f"array data is {type(raw).__name__}, not bytes")
    if not isinstance(shape, tuple) or not all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape
    ):
        raise ValueError(f"array shape {shape!r} is not a tuple of sizes")
    if int(np.prod(shape, dtype=object)) * dtype.dtype.itemsize != len(raw):
        raise ValueError(f"array of shape {shape} {dtype.dtype} does not fit {len(raw)} bytes")
    if order not in ("C", "F"):
        raise ValueError(f"array order {order!r} is not 'C' or 'F'")
    return np.frombuffer(raw, dtype.dtype).reshape(shape, order=order).copy()


def _reconstruct(subtype: object, shape: object, typecode: object) -> _ArrayStandIn:
    if subtype is not _NDARRAY or shape != (0,) or typecode not in (b"b", "b"):
        raise ValueError("array reconstruction is not numpy's ndarray pickle")
    return _ArrayStandIn()


def _frombuffer(buffer: object, dtype: object, shape: object, order: object) -> np.ndarray:
    return _plain_array(buffer, dtype, shape, order)


def _latin1(text: object, encoding: object = "utf-8") -> bytes:
    # Python 3 pickles bytes at protocol 2 as _codecs.encode('\x..', 'latin1').
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise ValueError(f"_codecs.encode is admitted for latin1 text only, not {encoding!r}")
    return text.encode("latin1")


_NDARRAY = object()  # numpy.ndarray: only ever passed to _reconstruct, never called

_ADMITTED: dict[tuple[str, str], object] = {
    ("numpy.core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy._core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy.core.numeric", "_frombuffer"): _frombuffer,
    ("numpy._core.numeric", "_frombuffer"): _frombuffer,
    ("numpy", "ndarray"): _NDARRAY,
    ("numpy", "dtype"): _DtypeStandIn,
    ("_codecs", "encode"): _latin1,
}


class _CifarUnpickler(pickle.Unpickler):
    """Unpickles a CIFAR batch file: dicts, lists, tuples, ints, strings, bytes and plain
    numeric arrays. Any other global a file names is refused (DatasetError) before it runs."""

    def __init__(self, file: BinaryIO, where: object, title: str = "CIFAR-10"):
        super().__init__(file, encoding="bytes")
        self._path, self._title = where, title

    def find_class(self, module: str, name: str) -> object:
        admitted = _ADMITTED.get((module, name))
        if admitted is None:
            raise DatasetError(
                f"{self._path}: refusing to load {f'{module}.{name}'!r} "
                f"({self._title} files hold only arrays, lists and strings)"
            )
        return admitted

    def persistent_load(self, pid: object) -> object:
        raise DatasetError(f"{self._path}: refusing a persistent reference {pid!r}")

    def load(self) -> object:
        loaded = super().load()
        # An array pickled as _reconstruct + state is one of our stand-ins until here.
        if isinstance(loaded, dict):
            for key, value in loaded.items():
                if isinstance(value, _ArrayStandIn):
                    if value.array is None:
                        raise ValueError(f"array {key!r} has no state")
                    loaded[key] = value.array
        return loaded
