"""A checkpoint directory that cannot be written: refused before training, and a final
checkpoint that cannot be written fails the run (real `hetconv train` processes).

Tests run as root here, and root writes through permission bits, so "a directory without write
permission" is made with ``chattr +i`` (immutable: not even root may add files; the test skips
where the file system or the container refuses the attribute) when root, with ``chmod`` when
not; "the disk fills" with RLIMIT_FSIZE on the training process (its writes past the limit fail
with EFBIG, as on a full disk with ENOSPC, without filling a real disk).
"""

from __future__ import annotations

import io
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hetconv.cli import main
from hetconv.training import TrainConfig, train
from hetconv.training import checkpoint as checkpoint_module
from hetconv.training.checkpoint import CheckpointDir, CheckpointError

TRAIN = [sys.executable, "-m", "hetconv", "train", "--local", "--no-progress", "--batch", "8"]
TRAIN += ["--train-size", "48", "--eval-size", "8", "--steps", "3"]


def hetconv_train(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*TRAIN, *args], capture_output=True, text=True, timeout=120, check=False, **kwargs
    )


def assert_refused_before_training(done: subprocess.CompletedProcess, trace: Path) -> None:
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert "training tiny" not in done.stderr  # nothing was announced, let alone trained
    assert not trace.exists()


# -- refused before training -----------------------------------------------------------------


def test_a_file_where_the_directory_should_be_is_refused_and_left_intact(tmp_path):
    where = tmp_path / "ck"
    where.write_bytes(b"someone's data\n")
    trace = tmp_path / "t.jsonl"
    done = hetconv_train("--checkpoint-dir", str(where), "--trace", str(trace))
    assert_refused_before_training(done, trace)
    assert f"checkpoint directory {where} is not a directory" in done.stderr
    assert "File exists" not in done.stderr
    assert where.read_bytes() == b"someone's data\n"


def test_a_directory_under_a_regular_file_is_refused(tmp_path):
    # A path under a regular file cannot be created, by root or anyone.
    (tmp_path / "file").write_text("x")
    where = tmp_path / "file" / "ck"
    trace = tmp_path / "t.jsonl"
    done = hetconv_train("--checkpoint-dir", str(where), "--trace", str(trace))
    assert_refused_before_training(done, trace)
    assert f"checkpoint directory {where} is not writable" in done.stderr
    assert f"{tmp_path / 'file'} is not a directory" in done.stderr
    assert (tmp_path / "file").read_text() == "x"


def _make_unwritable(folder: Path) -> None:
    if os.geteuid() == 0:  # root ignores permission bits: make the folder immutable instead
        made = subprocess.run(["chattr", "+i", str(folder)], capture_output=True, check=False)
        if made.returncode != 0:
            pytest.skip(f"chattr +i is not available here: {made.stderr.decode().strip()}")
    else:
        folder.chmod(0o555)


def _make_writable(folder: Path) -> None:
    if os.geteuid() == 0:
        subprocess.run(["chattr", "-i", str(folder)], capture_output=True, check=False)
    else:
        folder.chmod(0o755)


@pytest.mark.skipif(shutil.which("chattr") is None and os.geteuid() == 0, reason="no chattr")
@pytest.mark.parametrize("resume", [False, True], ids=["fresh", "resume"])
def test_a_directory_without_write_permission_is_refused_and_left_intact(tmp_path, resume):
    where = tmp_path / "ck"
    if resume:  # a run's checkpoints, which a --resume would continue
        assert hetconv_train("--checkpoint-dir", str(where)).returncode == 0
    else:
        where.mkdir()
    before = {p.name: p.read_bytes() for p in where.iterdir()}
    trace = tmp_path / "t.jsonl"
    _make_unwritable(where)
    try:
        extra = ["--resume", "--steps", "5"] if resume else []
        done = hetconv_train("--checkpoint-dir", str(where), "--trace", str(trace), *extra)
    finally:
        _make_writable(where)
    assert_refused_before_training(done, trace)
    assert f"checkpoint directory {where} is not writable" in done.stderr
    assert {p.name: p.read_bytes() for p in where.iterdir()} == before


def test_a_missing_directory_is_created_and_the_probe_leaves_nothing(tmp_path):
    where = tmp_path / "a" / "b" / "ck"
    checkpoints = CheckpointDir(where)
    checkpoints.prepare()
    assert where.is_dir() and list(where.iterdir()) == []
    checkpoints.prepare()  # again, on the existing folder
    assert list(where.iterdir()) == []


def test_the_check_is_in_train_too(tmp_path):
    (tmp_path / "ck").write_text("x")
    config = TrainConfig(
        steps=2,
        batch=8,
        train_size=48,
        eval_size=8,
        progress=False,
        checkpoint_dir=str(tmp_path / "ck"),
    )
    with pytest.raises(CheckpointError, match="is not a directory"):
        train(config, log=io.StringIO())


# -- the final checkpoint ----------------------------------------------------------------------


def _small_disk() -> None:
    """In the child: files may grow to 4 KiB (the probe fits, a checkpoint does not)."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of being killed
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))


def test_a_final_checkpoint_the_disk_has_no_room_for_fails_the_run(tmp_path):
    where = tmp_path / "ck"
    # No run folder: its model.npz would not fit in 4 KiB either.
    done = hetconv_train("--checkpoint-dir", str(where), "--no-run-dir", preexec_fn=_small_disk)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert "checkpoint at step 3 failed" in done.stderr and "File too large" in done.stderr
    said = f"hetconv train: error: the final checkpoint (step 3) could not be written in {where}"
    assert said in done.stderr
    assert "no checkpoint there" in done.stderr
    assert CheckpointDir(where).files() == []


def test_a_final_checkpoint_failure_names_the_latest_that_was_written(
    tmp_path, monkeypatch, capsys
):
    real = checkpoint_module._write_npz
    calls = []

    def full_at_the_end(file, arrays):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real(file, arrays)

    monkeypatch.setattr(checkpoint_module, "_write_npz", full_at_the_end)
    where = tmp_path / "ck"
    argv = ["train", "--local", "--no-progress", "--batch", "8", "--train-size", "48"]
    argv += ["--eval-size", "8", "--steps", "4", "--checkpoint-every", "2"]
    assert main([*argv, "--checkpoint-dir", str(where)]) == 1
    err = capsys.readouterr().err
    assert "checkpoint at step 4 failed: [Errno 28] No space left on device" in err
    assert "the final checkpoint (step 4) could not be written" in err
    assert f"the latest checkpoint there is {where / 'ckpt-00000002.npz'}" in err


def test_a_directory_that_vanishes_mid_run_fails_the_run(tmp_path):
    where = tmp_path / "ck"
    trace = tmp_path / "t.jsonl"
    run = [*TRAIN[:-1], "200", "--checkpoint-dir", str(where), "--checkpoint-every", "1000"]
    process = subprocess.Popen([*run, "--trace", str(trace)], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (trace.exists() and trace.read_text().count('"step": ') >= 3):
            assert process.poll() is None, "the run ended before the folder could vanish"
            assert time.monotonic() < deadline, "no 3 steps within 60 s"
            time.sleep(0.01)
        where.rmdir()  # prepared (created) before training, empty until the final checkpoint
        assert process.poll() is None, "the run ended before the folder vanished"
        stderr = process.communicate(timeout=120)[1]
    finally:
        process.kill()
        process.wait(timeout=30)
    assert process.returncode == 1, stderr
    assert "Traceback" not in stderr
    assert "checkpoint at step 200 failed" in stderr
    assert "the final checkpoint (step 200) could not be written" in stderr
    assert not where.exists()  # not silently recreated
