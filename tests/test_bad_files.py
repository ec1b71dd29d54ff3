"""Bad files end in one line naming the file and what is wrong, read with bounded memory: weights,
checkpoints, datasets (declared sizes checked before anything is decompressed), and a full disk
mid-run (the model and a checkpoint saved where the disk allows, the resume command printed)."""

from __future__ import annotations

import errno
import json
import re
import shlex
import struct
import zipfile
import zlib
from pathlib import Path

import numpy as np
import pytest

from hetconv import npz
from hetconv.dataset import DatasetError
from hetconv.npz import load_npz
from hetconv.training.checkpoint import read_model

WEIGHTS = {"conv1.weight": np.ones((4, 3, 3, 3), np.float32), "fc.bias": np.zeros(10, np.float32)}


def _npy_declaring(shape: tuple[int, ...], data: bytes = b"\0" * 64) -> bytes:
    """An .npy header declaring float32 ``shape``, followed by only ``data``."""
    header = f"{{'descr': '<f4', 'fortran_order': False, 'shape': {shape}, }}"
    header += " " * (117 - len(header)) + "\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode() + data


def _bomb(path: Path, mib: int) -> None:
    """An honest .npz whose one member is ``mib`` MiB of zeros, deflated to a few KiB."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        with archive.open("x.npy", "w", force_zip64=True) as f:
            f.write(_npy_declaring((mib << 18,), b""))
            for _ in range(mib):
                f.write(bytes(1 << 20))
        archive.writestr("y.npy", _npy_declaring((1,), b"\0" * 4))


@pytest.mark.parametrize(
    "value, message",
    [
        (np.array(["a"] * 108).reshape(4, 3, 3, 3), "conv1.weight is <U1; weights must be real"),
        (np.ones((4, 3, 3, 3), np.int32), "conv1.weight is int32; weights must be real"),
        (np.ones((4, 3, 3, 3), np.complex64), "conv1.weight is complex64; weights must be real"),
    ],
    ids=["strings", "integers", "complex"],
)
def test_weights_that_are_not_real_floats_are_refused_naming_the_key(tmp_path, value, message):
    path = tmp_path / "model.npz"
    np.savez(path, **{**WEIGHTS, "conv1.weight": value})
    with pytest.raises(ValueError, match=message) as info:
        read_model(path)
    assert str(path) in str(info.value)


def test_float64_weights_are_read_as_float32(tmp_path):
    path = tmp_path / "model.npz"
    np.savez(path, **{k: v.astype(np.float64) for k, v in WEIGHTS.items()})
    weights, _, _ = read_model(path)
    assert {v.dtype for v in weights.values()} == {np.dtype(np.float32)}


def test_a_checkpoint_whose_meta_is_a_list_is_refused_naming_it(tmp_path):
    path = tmp_path / "ckpt-00000002.npz"
    meta = np.frombuffer(json.dumps([1, 2]).encode(), np.uint8)
    np.savez(path, meta=meta, **{f"model/{k}": v for k, v in WEIGHTS.items()})
    with pytest.raises(ValueError, match="meta is a JSON list, not an object") as info:
        read_model(path)
    assert str(path) in str(info.value)


def test_an_npy_declaring_16_gib_is_refused_before_reading(tmp_path):
    path = tmp_path / "model.npz"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("conv1.weight.npy", _npy_declaring((1 << 32,)))
    with pytest.raises(ValueError, match=r"declares float32 \(4294967296,\) \(16.0 GiB\)") as info:
        read_model(path)
    assert str(path) in str(info.value)


def test_a_truncated_weights_file_is_refused_naming_it(tmp_path):
    whole = tmp_path / "whole.npz"
    np.savez(whole, **WEIGHTS)
    path = tmp_path / "model.npz"
    path.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    with pytest.raises(ValueError, match="not an .npz archive") as info:
        read_model(path)
    assert str(path) in str(info.value)


def test_a_zip_bomb_dataset_is_refused_before_decompressing(tmp_path, monkeypatch):
    path = tmp_path / "bomb.npz"
    _bomb(path, 32)
    assert path.stat().st_size < 1 << 20
    monkeypatch.setattr(npz, "memory_budget", lambda: 8 << 20)
    with pytest.raises(DatasetError, match=r"declare 32.0 MiB .*more than the 8.0 MiB") as info:
        load_npz(path)
    assert str(path) in str(info.value)


def test_a_zip_bomb_is_refused_whatever_the_memory(tmp_path, monkeypatch):
    path = tmp_path / "bomb.npz"
    _bomb(path, 32)
    monkeypatch.setattr(npz, "BOMB_MIN_BYTES", 16 << 20)  # 6.4 GB in the wild; 32 MiB here
    with pytest.raises(DatasetError, match=r"x declares 32.0 MiB compressed \d+ to 1: a zip bomb"):
        load_npz(path)


@pytest.mark.parametrize(
    "labels, message",
    [
        (np.array([0, 1, 10**6, 2], np.int64), "holds label 1000000 \\(at index 2\\)"),
        (np.array([0, 1, 2**64 - 1, 2], np.uint64), "holds label 18446744073709551615"),
    ],
    ids=["a-million", "uint64-max"],
)
def test_huge_labels_are_refused_naming_the_label(tmp_path, labels, message):
    path = tmp_path / "data.npz"
    np.savez(path, x=np.zeros((4, 3, 8, 8), np.uint8), y=labels)
    with pytest.raises(DatasetError, match=message) as info:
        load_npz(path)
    assert str(path) in str(info.value) and "at most 100000 classes" in str(info.value)


def _png_folder(root: Path, size: tuple[int, int], count: int) -> None:
    from PIL import Image

    for c in ("a", "b"):
        (root / c).mkdir(parents=True)
        for i in range(count):
            Image.new("RGB", size).save(root / c / f"{i}.png")


def test_images_too_large_for_memory_are_refused_before_decoding(tmp_path, monkeypatch):
    from hetconv import imagefolder
    from hetconv.imagefolder import load_image_folder

    _png_folder(tmp_path / "images", (300, 200), 3)
    monkeypatch.setattr(imagefolder, "memory_budget", lambda: 1 << 20)
    decoded = []
    monkeypatch.setattr(np, "asarray", lambda *a, **k: decoded.append(a) or None)
    with pytest.raises(DatasetError, match=r"is 300x200: 6 images of that size take 1.0 MiB") as e:
        load_image_folder(tmp_path / "images")
    assert str(tmp_path / "images" / "a" / "0.png") in str(e.value) and not decoded


def test_an_image_of_another_size_is_refused_before_decoding_it(tmp_path, monkeypatch):
    from hetconv.imagefolder import load_image_folder

    _png_folder(tmp_path / "images", (8, 8), 2)
    # A PNG whose header declares 9000x9000 and holds no pixels: refused on its header alone.
    ihdr = struct.pack(">IIBBBBB", 9000, 9000, 8, 2, 0, 0, 0)
    chunks = b"".join(
        struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        for kind, data in ((b"IHDR", ihdr), (b"IDAT", zlib.compress(b"\0" * 64)))
    )
    (tmp_path / "images" / "b" / "9.png").write_bytes(b"\x89PNG\r\n\x1a\n" + chunks)
    with pytest.raises(DatasetError, match=r"images differ in size: .* is 9000x9000"):
        load_image_folder(tmp_path / "images")


SMALL = ["--local", "--steps", "4", "--batch", "8", "--train-size", "32", "--eval-size", "8"]
SMALL += ["--eval-every", "2", "--no-progress"]


def _error_line(capsys) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(lines) == 1, lines
    return lines[0]


def test_a_full_disk_at_the_metrics_rewrite_saves_the_model_and_a_checkpoint(
    tmp_path, monkeypatch, capsys
):
    from hetconv.cli import main
    from hetconv.training import rundir

    runs = tmp_path / "runs"
    assert main(["train", *SMALL, "--run-dir", str(runs), "--name", "whole"]) == 0

    def full_disk(path, *args, **kwargs):  # the rewrite at the evaluation after step 2 fails
        path = Path(path)
        rows = path.with_name("metrics.csv")
        rewrite = path.name.startswith("metrics.csv.tmp") and rows.is_file()
        if rewrite and len(rows.read_text().splitlines()) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return open(path, *args, **kwargs)

    monkeypatch.setattr(rundir, "open", full_disk, raising=False)
    capsys.readouterr()
    assert main(["train", *SMALL, "--run-dir", str(runs), "--name", "full"]) == 2
    line = _error_line(capsys)
    run = runs / "full"
    checkpoint = run / "checkpoints" / "ckpt-00000002.npz"
    assert line.startswith(f"hetconv train: error: cannot write {run / 'metrics.csv'}: No space")
    assert f"stopped after step 2: saved model {run / 'model.npz'}, checkpoint {checkpoint}" in line
    assert (run / "model.npz").is_file() and checkpoint.is_file()
    assert not list(run.glob("*.tmp*"))  # nothing half-written left behind
    command = line.split(f"to continue from {checkpoint}: ")[1]
    monkeypatch.undo()
    assert main(shlex.split(command)[1:]) == 0  # the printed command finishes the run
    with np.load(run / "model.npz") as resumed, np.load(runs / "whole" / "model.npz") as whole:
        assert all(np.array_equal(resumed[k], whole[k]) for k in whole.files)
    with open(run / "metrics.csv") as f:
        assert [row.split(",")[0] for row in f.read().splitlines()[1:]] == ["0", "1", "2", "3"]


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_trace_on_a_full_device_ends_in_one_line_naming_it(tmp_path, capsys):
    from hetconv.cli import main

    runs = tmp_path / "runs"
    argv = ["train", *SMALL, "--run-dir", str(runs), "--name", "r", "--trace", "/dev/full"]
    assert main(argv) == 2
    line = _error_line(capsys)
    assert "error: cannot write /dev/full: No space left on device; stopped after step 1" in line
    assert f"saved model {runs / 'r' / 'model.npz'}" in line and line.endswith("--resume")


def test_a_scenario_asking_for_a_hundred_million_nodes_is_refused(tmp_path):
    from hetconv.simulations.scenario import MAX_NODES, SCENARIO_DIR, load_scenario

    text = (SCENARIO_DIR / "cpu-cluster.toml").read_text()
    path = tmp_path / "huge.toml"
    path.write_text(re.sub(r"(?m)^nodes = .*$", "nodes = [100000000]", text))
    message = f"nodes asks for 100000000 nodes; at most {MAX_NODES} can be simulated"
    with pytest.raises(ValueError, match=message) as info:
        load_scenario(str(path))
    assert str(path) in str(info.value)


def test_a_full_disk_that_takes_the_checkpoint_too_names_the_latest_one(
    tmp_path, monkeypatch, capsys
):
    from hetconv.cli import main
    from hetconv.training import checkpoint, rundir

    real_write = checkpoint._write_npz

    def full_from_step_2(file, arrays):
        if json.loads(arrays["meta"].tobytes())["step"] >= 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(file, arrays)

    def full_at_rewrite(path, *args, **kwargs):
        if (
            Path(path).name.startswith("metrics.csv.tmp")
            and Path(path).with_name("metrics.csv").is_file()
        ):
            raise OSError(errno.ENOSPC, "No space left on device")
        return open(path, *args, **kwargs)

    monkeypatch.setattr(checkpoint, "_write_npz", full_from_step_2)
    monkeypatch.setattr(rundir, "open", full_at_rewrite, raising=False)
    runs = tmp_path / "runs"
    argv = ["train", *SMALL, "--checkpoint-every", "1", "--run-dir", str(runs), "--name", "r"]
    assert main(argv) == 2
    line = _error_line(capsys)
    folder = runs / "r" / "checkpoints"
    assert "stopped after step 2: saved model" in line
    assert "no checkpoint at step 2 (No space left on device)" in line
    assert f"to continue from {folder / 'ckpt-00000001.npz'}: hetconv train" in line
    assert sorted(p.name for p in folder.iterdir()) == ["ckpt-00000001.npz", "latest"]
