"""benchmarks/gpu_layers.py: a cuda worker's layers against torch's, one at a time.

Its cuda path runs here on the strict fake CuPy (device arrays numpy refuses), torch on the
CPU: every layer of the tiny network gives its rows, each convolution with its bare GEMM.
"""

from __future__ import annotations

import json
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import fake_cupy
import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_layers.py"
TINY_ROWS = {
    ("conv1", "conv forward"), ("conv1", "conv kernel gradient"), ("relu1", "relu"),
    ("lrn1", "lrn"), ("maxpool1", "maxpool"), ("conv2", "conv forward"),
    ("conv2", "conv input gradient"), ("conv2", "conv kernel gradient"), ("fc", "fc"),
}  # fmt: skip


def _module():
    sys.path.insert(0, str(BENCH.parent))
    try:
        import gpu_layers
    finally:
        sys.path.remove(str(BENCH.parent))
    return gpu_layers


@pytest.fixture
def fake_cuda(monkeypatch):
    """The fake CuPy in place for one test; the backend's cached availability forgotten after
    it (else later tests would take the cuda backend for present)."""
    from hetconv.backends import cuda as cuda_module

    yield fake_cupy.install(monkeypatch)
    monkeypatch.undo()
    cuda_module._availability.cache_clear()


def _device_rows(network: str, batch: int):
    """gpu_layers.py's rows of ``network`` on the (fake) cuda backend, and the module."""
    from hetconv.backends.cuda import CudaBackend

    bench = _module()
    backend = CudaBackend(device=0)
    args = Namespace(repeats=1, device_name="fake")
    with backend.scope():
        timer = bench.Timer(lambda: None)
        return bench.network_rows(network, batch, args, backend, backend.xp, "cpu", timer), bench


def test_gpu_layers_runs_the_cuda_path_on_device_arrays(fake_cuda):
    rows, bench = _device_rows("tiny", 4)
    assert TINY_ROWS <= {(r["layer"], r["kind"]) for r in rows}
    for row in rows:
        assert row["ours_s"] > 0 and row["torch_s"] > 0, row
        assert (row["gemm_s"] is not None) == row["kind"].startswith("conv"), row
    assert bench.line_of(rows[0]).split()[:4] == ["tiny", "4", "conv1", "conv"]


def test_gpu_layers_times_batch_norm_on_device_arrays(fake_cuda, capsys):
    """resnet20's batch norm rows run with its running statistics on the device too (they
    failed on an H200 with the statistics left on the host)."""
    rows, _ = _device_rows("resnet20", 2)
    kinds = {r["kind"] for r in rows}
    assert {"batchnorm fwd+bwd", "add", "gap"} <= kinds, kinds
    assert "Error" not in capsys.readouterr().err


@pytest.mark.slow
def test_gpu_layers_dry_run_and_no_gpu(tmp_path):
    out = tmp_path / "rows.json"
    done = subprocess.run(
        [sys.executable, str(BENCH), "--dry-run", "--json", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert TINY_ROWS <= {(r["layer"], r["kind"]) for r in json.loads(out.read_text())}
    try:
        import cupy  # noqa: F401

        return  # a machine with CuPy may have a GPU: the one-line refusal is not for it
    except ImportError:
        pass
    refused = subprocess.run(
        [sys.executable, str(BENCH)], capture_output=True, text=True, timeout=120
    )
    assert refused.returncode == 2 and not refused.stdout
    assert len(refused.stderr.strip().splitlines()) == 1 and "no GPU" in refused.stderr


# ------------------------------------------------- benchmarks/gpu_vs_torch.py's worker modes


@pytest.mark.slow
def test_gpu_vs_torch_runs_each_worker_mode_against_a_real_worker(monkeypatch, tmp_path):
    """Each ``--modes`` run is a real ``hetconv train`` against a worker process with
    --no-master-compute (here a cpu worker in the cuda worker's place, the tiny network): its
    flags train, and the row carries them."""
    sys.path.insert(0, str(BENCH.parent))
    try:
        import gpu_vs_torch as bench
    finally:
        sys.path.remove(str(BENCH.parent))

    monkeypatch.setattr(bench, "WORKER_BACKEND", "cpu")
    args = bench.build_parser().parse_args(
        ["--network", "tiny", "--batch", "4", "--steps", "1", "--warmup", "0",
         "--trace-dir", str(tmp_path), "--modes", *bench.MODES]
    )  # fmt: skip
    rows = [bench.worker_row(args, "tiny", 4, mode, "cpu") for mode in args.modes]
    assert [r.engine for r in rows] == [
        "hetconv-cuda-worker", "hetconv-cuda-worker-replicate", "hetconv-cuda-worker-images",
        "hetconv-cuda-worker-images_ring",
    ]  # fmt: skip
    for row, mode in zip(rows, args.modes, strict=True):
        assert row.step_s is not None and row.step_s > 0, row.note
        assert row.note == " ".join(bench.MODES[mode])
        assert (tmp_path / f"worker-{mode}-tiny-b4.jsonl").exists()


def test_gpu_gradients_measures_the_gap_between_engines(tmp_path):
    """benchmarks/gpu_gradients.py's rows on the host (numpy's engine against the master's):
    the tiny network has no batch norm, so the gap is float32 round-off."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_gradients.py"
    spec = importlib.util.spec_from_file_location("gpu_gradients", path)
    bench = importlib.util.module_from_spec(spec)
    sys.modules["gpu_gradients"] = bench
    spec.loader.exec_module(bench)
    out = tmp_path / "rows.json"
    assert bench.main(["--engine", "cpu", "--network", "tiny", "--batch", "4", "--steps", "2",
                       "--json", str(out)]) == 0  # fmt: skip
    rows = json.loads(out.read_text())
    assert [r["step"] for r in rows] == [0, 1]
    for row in rows:
        assert 0 <= row["grad_rel"] < 1e-4 and 0 <= row["sketch_rel"] < 1e-4, row
        assert row["engine"] == "cpu" and row["master_engine"] in ("onednn", "cpu")


def test_gpu_gradients_runs_the_cuda_path_on_device_arrays(fake_cuda):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_gradients.py"
    spec = importlib.util.spec_from_file_location("gpu_gradients_cuda", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    (row,) = bench.rows("tiny", 4, 1, "cuda")
    assert row["engine"] == "cuda" and row["grad_rel"] < 1e-4 and row["sketch_rel"] < 1e-4, row
