"""Tests for hetconv.data: CIFAR-10 loading, synthetic data, batching and epoch order."""

from __future__ import annotations

import io
import os
import pickle
import struct
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

from hetconv.data import (
    CIFAR_MEAN,
    CIFAR_STD,
    DatasetError,
    ImageDataset,
    epoch_order,
    infer_dataset,
    load_cifar10,
    load_cifar100,
    load_dataset,
    synthetic_cifar,
)

TRAIN_FILES = [f"data_batch_{i}" for i in range(1, 6)]


def _official_batch(n: int, seed: int, label: bytes = b"training batch") -> dict:
    """A batch dict in the official CIFAR-10 python-version layout."""
    rng = np.random.default_rng(seed)
    return {
        b"batch_label": label,
        b"labels": [int(v) for v in rng.integers(0, 10, size=n)],
        b"data": rng.integers(0, 256, size=(n, 3072), dtype=np.uint8),
        b"filenames": [f"img_{seed}_{i}.png".encode() for i in range(n)],
    }


def _write(path: Path, obj: object) -> None:
    with path.open("wb") as f:
        pickle.dump(obj, f, protocol=2)


def _write_cifar(folder: Path, n_per_batch: int = 4) -> dict[str, dict]:
    folder.mkdir(parents=True, exist_ok=True)
    batches = {name: _official_batch(n_per_batch, i) for i, name in enumerate(TRAIN_FILES)}
    batches["test_batch"] = _official_batch(3, 99, b"testing batch 1 of 1")
    for name, batch in batches.items():
        _write(folder / name, batch)
    return batches


# ---------------------------------------------------------------------------- CIFAR-10 loading


def test_load_train_round_trip(tmp_path: Path) -> None:
    batches = _write_cifar(tmp_path)
    ds = load_cifar10(tmp_path, "train")
    assert len(ds) == 20 and ds.num_classes == 10
    assert ds.images.dtype == np.uint8 and ds.images.shape == (20, 3, 32, 32)
    assert ds.images.flags.c_contiguous
    assert ds.labels.dtype == np.int64 and ds.labels.shape == (20,)
    expected_labels = sum((batches[f][b"labels"] for f in TRAIN_FILES), [])
    np.testing.assert_array_equal(ds.labels, expected_labels)

    # Pixel ordering: row = 1024 R, 1024 G, 1024 B, each 32x32 row-major.
    data = batches["data_batch_3"][b"data"]
    i, y, x = 1, 7, 19
    row = data[i]
    j = 2 * 4 + i  # batches 1 and 2 come first, 4 images each
    for c in range(3):
        assert ds.images[j, c, y, x] == row[c * 1024 + y * 32 + x]
    all_data = np.concatenate([batches[f][b"data"] for f in TRAIN_FILES])
    np.testing.assert_array_equal(ds.images.reshape(20, -1), all_data)


def test_load_test_split_and_parent_folder(tmp_path: Path) -> None:
    batches = _write_cifar(tmp_path / "cifar-10-batches-py")
    ds = load_cifar10(str(tmp_path), split="test")
    assert len(ds) == 3
    np.testing.assert_array_equal(ds.labels, batches["test_batch"][b"labels"])
    np.testing.assert_array_equal(ds.images.reshape(3, -1), batches["test_batch"][b"data"])
    assert len(load_cifar10(tmp_path)) == 20
    names = "airplane automobile bird cat deer dog frog horse ship truck".split()
    assert load_dataset("cifar10", tmp_path).class_names == tuple(names)  # the published ones


def test_missing_dir_and_files(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="does not exist"):
        load_cifar10(tmp_path / "nope")
    _write_cifar(tmp_path)
    (tmp_path / "data_batch_2").unlink()
    (tmp_path / "data_batch_5").unlink()
    with pytest.raises(DatasetError, match="data_batch_2, data_batch_5"):
        load_cifar10(tmp_path)
    with pytest.raises(DatasetError, match="test_batch"):
        (tmp_path / "test_batch").unlink()
        load_cifar10(tmp_path, "test")


def test_bad_split(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'validation'"):
        load_cifar10(tmp_path, "validation")


def _corrupt(tmp_path: Path, obj: object) -> None:
    _write_cifar(tmp_path)
    _write(tmp_path / "data_batch_4", obj)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda b: b.pop(b"labels"), "missing key"),
        (lambda b: b.pop(b"data"), "missing key"),
        (lambda b: b.__setitem__(b"data", b[b"data"].astype(np.int32)), "uint8"),
        (lambda b: b.__setitem__(b"data", b[b"data"][:, :3000]), r"\(N, 3072\)"),
        (lambda b: b.__setitem__(b"data", b[b"data"].reshape(4, 3, 32, 32)), r"\(N, 3072\)"),
        (lambda b: b.__setitem__(b"labels", b[b"labels"][:-1]), "3 labels for 4 images"),
        (lambda b: b.__setitem__(b"labels", [0, 1, 10, 2]), r"0\.\.9"),
        (lambda b: b.__setitem__(b"labels", [0, -1, 3, 2]), r"0\.\.9"),
        (lambda b: b.__setitem__(b"labels", ["a", "b", "c", "d"]), "list of ints"),
    ],
)
def test_malformed_batch(tmp_path: Path, mutate, message: str) -> None:
    batch = _official_batch(4, 3)
    mutate(batch)
    _corrupt(tmp_path, batch)
    with pytest.raises(DatasetError, match=message) as info:
        load_cifar10(tmp_path)
    assert "data_batch_4" in str(info.value)


def test_not_a_dict(tmp_path: Path) -> None:
    _corrupt(tmp_path, [1, 2, 3])
    with pytest.raises(DatasetError, match="data_batch_4.*dict"):
        load_cifar10(tmp_path)


@pytest.mark.parametrize("content", [b"this is not a pickle", b"", b"\x80\x02}q\x00(X"])
def test_garbage_bytes(tmp_path: Path, content: bytes) -> None:
    _write_cifar(tmp_path)
    (tmp_path / "data_batch_1").write_bytes(content)
    with pytest.raises(DatasetError, match="data_batch_1.*unpickle"):
        load_cifar10(tmp_path)


# -------------------------------------------------------------- CIFAR-10 files are only data

# Which globals a genuine file names (found by generating files as the official ones were made
# and recording every find_class call): Python 2's cPickle (protocol 2, numpy 1.x, as the
# official tarball holds) names numpy.core.multiarray._reconstruct, numpy.ndarray, numpy.dtype;
# Python 3 with numpy 2 names numpy._core.multiarray._reconstruct instead, plus _codecs.encode for
# bytes at protocol 2, and numpy._core.numeric._frombuffer at protocol 5. The loader admits
# exactly these; anything else is refused before it can run.


def _short(value: bytes) -> bytes:
    """A Python 2 str (here: bytes) as cPickle wrote it: SHORT_BINSTRING or BINSTRING."""
    if len(value) < 256:
        return b"U" + bytes([len(value)]) + value
    return b"T" + struct.pack("<i", len(value)) + value


def _int(value: int) -> bytes:
    if 0 <= value < 256:
        return b"K" + bytes([value])
    if 0 <= value < 65536:
        return b"M" + struct.pack("<H", value)
    return b"J" + struct.pack("<i", value)


def _python2_pickle(batch: dict) -> bytes:
    """``batch`` opcode for opcode as Python 2's ``cPickle.dump(batch, f, 2)`` with numpy 1.x
    wrote the official CIFAR-10 python-version files (Python 2 is not installed here)."""
    data = batch[b"data"]
    array = (
        b"cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\nK\x00\x85"
        + _short(b"b")
        + b"\x87R("  # _reconstruct(ndarray, (0,), 'b'), then its state:
        + _int(1)
        + _int(data.shape[0])
        + _int(data.shape[1])
        + b"\x86cnumpy\ndtype\n"
        + _short(b"u1")
        + b"K\x00K\x01\x87R(K\x03"
        + _short(b"|")
        + b"NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00tb\x89"
        + _short(data.tobytes())
        + b"tb"
    )
    labels = b"](" + b"".join(_int(v) for v in batch[b"labels"]) + b"e"
    names = b"](" + b"".join(_short(v) for v in batch[b"filenames"]) + b"e"
    return (
        b"\x80\x02}("
        + _short(b"data")
        + array
        + _short(b"labels")
        + labels
        + _short(b"batch_label")
        + _short(batch[b"batch_label"])
        + _short(b"filenames")
        + names
        + b"u."
    )


def test_python2_file_is_what_pickle_reads_as_the_batch() -> None:
    batch = _official_batch(4, 7)
    loaded = pickle.loads(_python2_pickle(batch), encoding="bytes")  # trusted: our own bytes
    assert loaded.keys() == batch.keys()
    np.testing.assert_array_equal(loaded[b"data"], batch[b"data"])
    assert loaded[b"labels"] == batch[b"labels"]
    assert loaded[b"filenames"] == batch[b"filenames"]


@pytest.mark.parametrize("protocol", ["python2", 2, 3, 4, 5])
def test_genuine_files_load(tmp_path: Path, protocol) -> None:
    batches = _write_cifar(tmp_path)
    for name, batch in batches.items():
        if protocol == "python2":
            (tmp_path / name).write_bytes(_python2_pickle(batch))
        else:
            (tmp_path / name).write_bytes(pickle.dumps(batch, protocol=protocol))
    for split, files in (("train", TRAIN_FILES), ("test", ["test_batch"])):
        ds = load_cifar10(tmp_path, split)
        data = np.concatenate([batches[f][b"data"] for f in files])
        np.testing.assert_array_equal(ds.images.reshape(len(ds), -1), data)
        np.testing.assert_array_equal(ds.labels, sum((batches[f][b"labels"] for f in files), []))


class _Payload:
    """Unpickling this runs ``os.system`` (pickled as ``posix.system``): it creates ``marker``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


class _EvalPayload:
    """Unpickling this runs ``eval`` (protocol 2 names it as Python 2 did: ``__builtin__``)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return eval, (f"open({str(self.marker)!r}, 'w').close()",)


def _planted(tmp_path: Path, payload, where: str) -> Path:
    """CIFAR files whose data_batch_1 carries ``payload``; returns the marker it would create."""
    marker = tmp_path / "pwned"
    folder = tmp_path / "cifar"
    _write_cifar(folder)
    batch = _official_batch(4, 0)
    if where == "top":
        obj: object = payload(marker)
    elif where == "filenames":
        batch[b"filenames"][2] = payload(marker)
        obj = batch
    else:
        batch[b"data"] = payload(marker)
        obj = batch
    _write(folder / "data_batch_1", obj)
    return marker


@pytest.mark.parametrize("where", ["top", "filenames", "data"])
@pytest.mark.parametrize(
    ("payload", "global_name"), [(_Payload, "posix.system"), (_EvalPayload, "__builtin__.eval")]
)
def test_a_planted_payload_is_refused_and_never_runs(
    tmp_path: Path, payload, global_name: str, where: str
) -> None:
    marker = _planted(tmp_path, payload, where)
    original = (tmp_path / "cifar" / "data_batch_1").read_bytes()
    with pytest.raises(DatasetError) as info:
        load_cifar10(tmp_path / "cifar")
    assert not marker.exists()
    message = str(info.value)
    assert "data_batch_1" in message and f"refusing to load '{global_name}'" in message
    assert "CIFAR-10 files hold only arrays, lists and strings" in message
    assert (tmp_path / "cifar" / "data_batch_1").read_bytes() == original  # left intact


def test_hetconv_train_refuses_a_planted_payload(tmp_path: Path) -> None:
    marker = _planted(tmp_path, _Payload, "filenames")
    done = subprocess.run(
        [sys.executable, "-m", "hetconv", "train", "--local", "--no-progress", "--steps", "1"]
        + ["--dataset", "cifar10", "--data-dir", str(tmp_path / "cifar")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert not marker.exists()
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert "data_batch_1: refusing to load 'posix.system'" in done.stderr
    assert "training" not in done.stdout + done.stderr.replace("hetconv train: error:", "")


@pytest.mark.parametrize(
    ("module", "name"),
    [("numpy", "load"), ("numpy.core.multiarray", "scalar"), ("builtins", "getattr")],
)
def test_other_numpy_and_builtin_globals_are_refused(tmp_path: Path, module, name) -> None:
    _write_cifar(tmp_path)
    # A GLOBAL opcode naming module.name, then STOP: refused at the name, nothing called.
    (tmp_path / "data_batch_2").write_bytes(b"\x80\x02c" + f"{module}\n{name}\n.".encode())
    with pytest.raises(DatasetError, match=f"data_batch_2: refusing to load '{module}.{name}'"):
        load_cifar10(tmp_path)


@pytest.mark.parametrize(
    "state",
    [
        # An object dtype (its array would hold pointers) and a structured one.
        "(K\x03U\x01|NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK?tb",
        "(K\x03U\x01|N(U\x01aU\x01btNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00tb",
    ],
    ids=["object-flags", "fields"],
)
def test_a_doctored_dtype_is_refused(tmp_path: Path, state: str) -> None:
    batch = _official_batch(4, 0)
    genuine = _python2_pickle(batch)
    good = b"(K\x03U\x01|NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00tb"
    assert genuine.count(good) == 1
    _write_cifar(tmp_path)
    (tmp_path / "data_batch_3").write_bytes(genuine.replace(good, state.encode("latin1")))
    with pytest.raises(DatasetError, match="data_batch_3.*dtype"):
        load_cifar10(tmp_path)


# ---------------------------------------------------------------------------- CIFAR tarballs


def _tar(folder: Path, tarball: Path, extra: dict[str, bytes] | None = None) -> Path:
    """``tarball`` (gzip) holding ``folder`` under its own name, as the official files are."""
    with tarfile.open(tarball, "w:gz") as tar:
        tar.add(folder, arcname=folder.name)
        for name, content in (extra or {}).items():
            info = tarfile.TarInfo(name)
            info.size = len(content)
            tar.addfile(info, io.BytesIO(content))
    return tarball


def test_cifar10_tarball_is_read_without_extracting(tmp_path: Path) -> None:
    folder = tmp_path / "src" / "cifar-10-batches-py"
    _write_cifar(folder)
    _write(folder / "batches.meta", {b"label_names": [b"airplane"] * 10, b"num_vis": 3072})
    tarball = _tar(folder, tmp_path / "cifar-10-python.tar.gz", {"readme.html": b"<html>"})
    before = sorted(p.name for p in tmp_path.iterdir())
    assert infer_dataset(tarball) == "cifar10"
    for split in ("train", "test"):
        from_tar, from_folder = load_cifar10(tarball, split), load_cifar10(folder, split)
        np.testing.assert_array_equal(from_tar.images, from_folder.images)
        np.testing.assert_array_equal(from_tar.labels, from_folder.labels)
    loaded = load_dataset("auto", tarball)
    assert (loaded.kind, len(loaded.train), len(loaded.held_out)) == ("cifar10", 20, 3)
    assert loaded.train.image_shape == (3, 32, 32) and loaded.train.num_classes == 10
    assert loaded.train.mean == CIFAR_MEAN and loaded.held_out.std == CIFAR_STD
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing extracted


def test_a_tarball_missing_a_batch_is_refused_naming_it(tmp_path: Path) -> None:
    folder = tmp_path / "src" / "cifar-10-batches-py"
    _write_cifar(folder)
    (folder / "data_batch_3").unlink()
    tarball = _tar(folder, tmp_path / "cifar-10-python.tar.gz")
    with pytest.raises(DatasetError, match="no member cifar-10-batches-py/data_batch_3"):
        load_cifar10(tarball)
    assert len(load_cifar10(tarball, "test")) == 3


def test_a_planted_payload_inside_a_tarball_is_refused_and_never_runs(tmp_path: Path) -> None:
    marker = _planted(tmp_path, _Payload, "filenames")
    (tmp_path / "cifar").rename(tmp_path / "cifar-10-batches-py")
    tarball = _tar(tmp_path / "cifar-10-batches-py", tmp_path / "cifar-10-python.tar.gz")
    with pytest.raises(DatasetError) as info:
        load_dataset("auto", tarball)
    assert not marker.exists()
    assert (
        f"{tarball} (member cifar-10-batches-py/data_batch_1): refusing to load 'posix.system'"
        in str(info.value)
    )


def test_a_tarball_member_that_is_not_a_file_or_a_tar_that_is_not_one(tmp_path: Path) -> None:
    folder = tmp_path / "src" / "cifar-10-batches-py"
    _write_cifar(folder)
    (folder / "data_batch_2").unlink()
    (folder / "data_batch_2").symlink_to("/etc/passwd")
    tarball = _tar(folder, tmp_path / "cifar-10-python.tar.gz")
    with pytest.raises(
        DatasetError, match="member cifar-10-batches-py/data_batch_2.: not a regular"
    ):
        load_cifar10(tarball)
    fake = tmp_path / "fake" / "cifar-10-python.tar.gz"
    fake.parent.mkdir()
    fake.write_bytes(b"\x1f\x8b not really gzip")
    with pytest.raises(DatasetError, match="cifar-10-python.tar.gz: not a readable tar archive"):
        load_cifar10(fake)
    with pytest.raises(DatasetError, match="neither a CIFAR python-version tarball"):
        infer_dataset(fake)


def _cifar100_batch(n: int, seed: int) -> dict:
    """A batch dict in the official CIFAR-100 python-version layout."""
    rng = np.random.default_rng(seed)
    fine = rng.integers(0, 100, size=n)
    return {
        b"filenames": [f"img_{seed}_{i}.png".encode() for i in range(n)],
        b"batch_label": b"training batch 1 of 1",
        b"fine_labels": [int(v) for v in fine],
        b"coarse_labels": [int(v) // 5 for v in fine],
        b"data": rng.integers(0, 256, size=(n, 3072), dtype=np.uint8),
    }


def _write_cifar100(folder: Path) -> dict[str, dict]:
    folder.mkdir(parents=True)
    batches = {"train": _cifar100_batch(6, 1), "test": _cifar100_batch(4, 2)}
    for name, batch in batches.items():
        _write(folder / name, batch)
    _write(folder / "meta", {b"fine_label_names": [b"apple"] * 100})
    return batches


@pytest.mark.parametrize("where", ["folder", "parent", "tarball"])
def test_cifar100_uses_the_fine_labels(tmp_path: Path, where: str) -> None:
    folder = tmp_path / "cifar-100-python"
    batches = _write_cifar100(folder)
    path = {
        "folder": folder,
        "parent": tmp_path,
        "tarball": _tar(folder, tmp_path / "cifar-100-python.tar.gz"),
    }[where]
    assert infer_dataset(path) == "cifar100"
    loaded = load_dataset("auto", path)
    assert loaded.kind == "cifar100" and loaded.train.num_classes == 100
    np.testing.assert_array_equal(loaded.train.labels, batches["train"][b"fine_labels"])
    np.testing.assert_array_equal(loaded.held_out.labels, batches["test"][b"fine_labels"])
    np.testing.assert_array_equal(loaded.held_out.images.reshape(4, -1), batches["test"][b"data"])
    assert len(load_cifar100(path, "test")) == 4
    # The published names, in label order (what the official meta file lists).
    names = loaded.class_names
    assert len(names) == 100 and names[:3] == ("apple", "aquarium_fish", "baby")
    assert names[-1] == "worm" and list(names) == sorted(names)


def test_cifar100_labels_out_of_range_and_missing_fine_labels(tmp_path: Path) -> None:
    folder = tmp_path / "cifar-100-python"
    _write_cifar100(folder)
    bad = _cifar100_batch(6, 1)
    bad[b"fine_labels"][3] = 100
    _write(folder / "train", bad)
    with pytest.raises(DatasetError, match=r"train: labels must lie in 0\.\.99, got range"):
        load_cifar100(folder)
    del bad[b"fine_labels"]
    _write(folder / "train", bad)
    with pytest.raises(DatasetError, match="expected b'data' and b'fine_labels'"):
        load_cifar100(folder)


# ---------------------------------------------------------------------------- ImageDataset


def test_batch_normalisation() -> None:
    images = np.zeros((3, 3, 32, 32), dtype=np.uint8)
    images[0] = 255
    images[1, 0, 0, 0], images[1, 1, 5, 6], images[1, 2, 31, 31] = 10, 128, 200
    ds = ImageDataset(images, np.array([2, 0, 1], dtype=np.int64))
    x, y = ds.batch(np.array([1, 0]))
    assert x.dtype == np.float32 and x.shape == (2, 3, 32, 32) and x.flags.c_contiguous
    assert y.dtype == np.int64
    np.testing.assert_array_equal(y, [0, 2])
    mean, std = np.float32(CIFAR_MEAN), np.float32(CIFAR_STD)
    for c in range(3):
        expected_white = (np.float32(1.0) - mean[c]) / std[c]
        assert np.all(x[1, c] == expected_white)
    expected = (np.float32(128) / np.float32(255) - mean[1]) / std[1]
    assert x[0, 1, 5, 6] == expected
    assert x[0, 0, 0, 0] == (np.float32(10) / np.float32(255) - mean[0]) / std[0]
    assert x[0, 2, 0, 0] == -mean[2] / std[2]
    assert np.isclose(x[0, 2, 31, 31], (200 / 255 - CIFAR_MEAN[2]) / CIFAR_STD[2], atol=1e-6)

    empty_x, empty_y = ds.batch(np.array([], dtype=np.int64))
    assert empty_x.shape == (0, 3, 32, 32) and empty_y.shape == (0,)
    with pytest.raises(IndexError, match="3"):
        ds.batch(np.array([3]))
    with pytest.raises(ValueError, match="integer"):
        ds.batch(np.array([0.0, 1.0]))


def test_split_and_validation() -> None:
    ds = synthetic_cifar(10, seed=3)
    a, b = ds.split(7)
    assert (len(a), len(b)) == (7, 3)
    np.testing.assert_array_equal(np.concatenate([a.images, b.images]), ds.images)
    np.testing.assert_array_equal(np.concatenate([a.labels, b.labels]), ds.labels)
    assert len(ds.split(0)[0]) == 0 and len(ds.split(10)[1]) == 0
    with pytest.raises(ValueError, match="11"):
        ds.split(11)
    with pytest.raises(ValueError, match="uint8 or float32"):
        ImageDataset(np.zeros((1, 3, 32, 32), np.float64), np.zeros(1, np.int64))
    with pytest.raises(ValueError, match=r"\(N, C, H, W\), got \(1, 32, 32\)"):
        ImageDataset(np.zeros((1, 32, 32), np.uint8), np.zeros(1, np.int64))
    with pytest.raises(ValueError, match="32 channels need their own mean and std"):
        ImageDataset(np.zeros((1, 32, 32, 3), np.uint8), np.zeros(1, np.int64))
    with pytest.raises(ValueError, match=r"one value per channel \(1\), got 3 and 3"):
        ImageDataset(
            np.zeros((1, 1, 8, 8), np.uint8), np.zeros(1, np.int64), 2, "", (0,) * 3, (1,) * 3
        )
    with pytest.raises(ValueError, match="std finite and > 0"):
        ImageDataset(np.zeros((1, 1, 8, 8), np.uint8), np.zeros(1, np.int64), 2, "", (0,), (0,))
    with pytest.raises(ValueError, match="finite"):
        ImageDataset(
            np.full((1, 1, 8, 8), np.nan, np.float32), np.zeros(1, np.int64), 2, "", (0,), (1,)
        )
    with pytest.raises(ValueError, match=r"0\.\.9"):
        ImageDataset(np.zeros((1, 3, 32, 32), np.uint8), np.array([10], np.int64))


# ---------------------------------------------------------------------------- synthetic data


def test_synthetic_shapes_determinism_balance() -> None:
    a = synthetic_cifar(105, seed=5)
    b = synthetic_cifar(105, seed=5)
    c = synthetic_cifar(105, seed=6)
    assert a.images.dtype == np.uint8 and a.images.shape == (105, 3, 32, 32)
    assert a.images.flags.c_contiguous
    assert a.labels.dtype == np.int64 and a.labels.shape == (105,)
    np.testing.assert_array_equal(a.images, b.images)
    np.testing.assert_array_equal(a.labels, b.labels)
    assert not np.array_equal(a.images, c.images)
    assert not np.array_equal(a.labels, c.labels)
    counts = np.bincount(a.labels, minlength=10)
    assert counts.min() == 10 and counts.max() == 11
    assert not np.array_equal(a.labels[:10], np.arange(10))  # shuffled, not round-robin
    assert 20 < a.images.std() < 120  # neither flat nor saturated
    three = synthetic_cifar(30, num_classes=3)
    np.testing.assert_array_equal(np.bincount(three.labels), [10, 10, 10])


@pytest.mark.parametrize("n", [0, -5])
def test_synthetic_bad_n(n: int) -> None:
    with pytest.raises(ValueError, match=str(n)):
        synthetic_cifar(n)


def _pixels(ds: ImageDataset) -> np.ndarray:
    return ds.images.reshape(len(ds), -1).astype(np.float32) / np.float32(255)


def test_synthetic_is_learnable_but_not_trivial() -> None:
    train, test = synthetic_cifar(2000, seed=1), synthetic_cifar(1000, seed=2)
    x, xt = _pixels(train), _pixels(test)

    # Nearest class mean on raw pixels: far above chance (0.1) but far from perfect.
    means = np.stack([x[train.labels == k].mean(axis=0) for k in range(10)])
    scores = 2 * xt @ means.T - (means * means).sum(axis=1)
    nm_acc = float((scores.argmax(axis=1) == test.labels).mean())
    print(f"nearest-class-mean held-out accuracy: {nm_acc:.3f}")
    assert 0.4 < nm_acc < 0.85

    # Ridge least-squares linear classifier (dual form, 2000x2000 system).
    mu = x.mean(axis=0)
    xc = x - mu
    targets = np.eye(10, dtype=np.float32)[train.labels]
    gram = xc @ xc.T + 10.0 * np.eye(len(xc), dtype=np.float32)
    weights = xc.T @ np.linalg.solve(gram, targets - targets.mean(axis=0))
    ridge_acc = float((((xt - mu) @ weights).argmax(axis=1) == test.labels).mean())
    print(f"ridge linear held-out accuracy: {ridge_acc:.3f}")
    assert ridge_acc > 0.6


# ---------------------------------------------------------------------------- epoch order


def test_epoch_order() -> None:
    p = epoch_order(50, seed=3, epoch=0)
    assert p.dtype == np.int64 and p.shape == (50,)
    np.testing.assert_array_equal(np.sort(p), np.arange(50))
    np.testing.assert_array_equal(p, epoch_order(50, seed=3, epoch=0))
    assert not np.array_equal(p, epoch_order(50, seed=3, epoch=1))
    assert not np.array_equal(p, epoch_order(50, seed=4, epoch=0))
    assert epoch_order(0, 0, 0).shape == (0,)
    with pytest.raises(ValueError, match="epoch"):
        epoch_order(5, 0, -1)
