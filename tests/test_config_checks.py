"""The configuration objects refuse what the command line refuses, with the same words: a Python
caller of :class:`~hetconv.training.TrainConfig`, :class:`~hetconv.training.rundir.RunFolderConfig`
or :class:`~hetconv.master.config.ClusterConfig` is refused each combination ``hetconv train``
refuses, and the command line reports the configuration's message as its one error line."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from hetconv.cli import main
from hetconv.master.config import ClusterConfig
from hetconv.training import TrainConfig
from hetconv.training.rundir import RunFolderConfig

# (what the Python API is given, the same on the command line, the words of both refusals)
REFUSED = {
    "train size with data": (
        lambda tmp: TrainConfig(data_dir=str(tmp / "data.npz"), dataset="npz", train_size=64),
        ["--data-dir", "{tmp}/data.npz", "--train-size", "64"],
        "--train-size sizes the synthetic set",
    ),
    "name without a run folder": (
        lambda tmp: RunFolderConfig(root=str(tmp), name="a", enabled=False),
        ["--no-run-dir", "--name", "a"],
        "--name needs a run folder: drop --no-run-dir",
    ),
    "tensorboard without a run folder": (
        lambda tmp: RunFolderConfig(root=str(tmp), tensorboard=True, enabled=False),
        ["--no-run-dir", "--tensorboard"],
        "--tensorboard needs a run folder: drop --no-run-dir",
    ),
    "resume of nothing": (
        lambda tmp: RunFolderConfig(root=str(tmp), resume=True),
        ["--resume"],
        "--resume needs --checkpoint-dir or --name: the run to continue",
    ),
    "resume without checkpoints": (
        lambda tmp: TrainConfig(resume=True),
        ["--no-run-dir", "--resume"],
        "--resume needs --checkpoint-dir",
    ),
    "deterministic link shares": (
        lambda tmp: ClusterConfig(deterministic=True, share_policy="link"),
        ["--deterministic", "--shares", "link"],
        "--deterministic splits kernels equally, --shares link by measured links",
    ),
    "deterministic settling": (
        lambda tmp: ClusterConfig(deterministic=True, settle_steps=4),
        ["--deterministic", "--settle-steps", "4"],
        "--deterministic never settles",
    ),
    "split block over TLS": (
        lambda tmp: ClusterConfig(replicate="split", tls_ca="ca.pem"),
        None,  # the command line reads the PEM file first
        "replicate split: the workers exchange the block's parts over plain gRPC",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_the_python_api_refuses_what_the_command_line_refuses(case, tmp_path, capsys):
    make, argv, words = REFUSED[case]
    with pytest.raises(ValueError, match=words.replace("-", r"\-").replace(".", r"\.")):
        make(tmp_path)
    if argv is None:
        return
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main(["train", "--run-dir", str(tmp_path / "runs"), "--steps", "1", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("hetconv train: error: " + words), err
    assert not (tmp_path / "runs").exists()  # refused before any run folder is made


def test_tensorboard_without_tensorboardx_is_refused_by_both(tmp_path, monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "tensorboardX" else real(name)
    )
    words = "--tensorboard needs tensorboardX"
    with pytest.raises(ValueError, match=words):
        TrainConfig(tensorboard=str(tmp_path / "tb"))
    with pytest.raises(ValueError, match=words):
        RunFolderConfig(root=str(tmp_path), tensorboard=True)
    assert main(["train", "--run-dir", str(tmp_path), "--tensorboard", "--steps", "1"]) == 2
    assert words in capsys.readouterr().err


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(connect_timeout=0), "connect_timeout must be > 0"),
        (dict(probe_repeats=0), "probe_repeats must be > 0"),
        (dict(rebalance_every=-1), "rebalance_every must be >= 0"),
        (dict(settle_steps=-1), "settle_steps must be >= 0"),
        (dict(retry_min=2.0, retry_max=1.0), "retry_max"),
        (dict(share_policy="fastest"), "share policy 'fastest'"),
        (dict(network="ethernet"), "network 'ethernet'"),
        (dict(stages="sometimes"), "stages 'sometimes'"),
        (dict(resident_sync_every=-1), "resident sync interval must be >= 0"),
    ],
)
def test_cluster_config_refuses_what_the_flag_types_refuse(kwargs, words):
    with pytest.raises(ValueError, match=words):
        ClusterConfig(**kwargs)


def test_what_the_api_allows_stays_allowed():
    # A deterministic cluster ignores rebalancing (the command line refuses the flags together).
    assert ClusterConfig(deterministic=True, rebalance_every=2).rebalance_every == 2
    assert TrainConfig(data_dir="x.npz", dataset="npz").train_size == TrainConfig.train_size
    assert RunFolderConfig(root="runs", enabled=False).choose() is None


def test_local_training_imports_nothing_of_the_master(tmp_path):
    code = (
        "import sys\n"
        "from hetconv.cli import main\n"
        "status = main(['train', '--local', '--steps', '1', '--batch', '4', '--train-size', '8',"
        " '--eval-size', '0', '--no-run-dir', '--no-progress'])\n"
        "master = sorted(m for m in sys.modules if m.startswith('hetconv.master'))\n"
        "assert status == 0 and not master, (status, master)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr


def test_train_size_given_with_a_data_dir_is_refused_at_the_default_value_too(tmp_path, capsys):
    # The configuration cannot tell 10000 given from 10000 by default; the command line can.
    argv = ["train", "--run-dir", str(tmp_path), "--data-dir", str(tmp_path / "data.npz")]
    assert main([*argv, "--train-size", "10000", "--steps", "1"]) == 2
    assert "drop --train-size" in capsys.readouterr().err
