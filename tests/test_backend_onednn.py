"""The onednn backend (oneDNN's convolutions through ctypes) against the cpu backend.

hetconv's dependencies install oneDNN (``onednn-cpu-gomp``) wherever its wheel exists (Linux
x86-64): there these tests run, never skipped; elsewhere they are skipped with that reason.

Tolerance: as in test_backends.py, ``2e-4`` of the magnitude of the summed terms (oneDNN's
kernels block and order their float32 sums otherwise than BLAS does). Against itself there is
no tolerance: a slice of a layer's kernels equals the same rows of the whole layer bitwise, and
every result is the same at one, two and three threads, where hetconv's exactness tests need it
(a worker's slice at its thread count against local training at another).
"""

from __future__ import annotations

import platform

import numpy as np
import pytest
from backend_cases import assert_close, assert_results_close, make_problem, run_all, term_scales
from threadpoolctl import threadpool_limits

from hetconv.backends import (
    BackendUnavailable,
    CpuBackend,
    backend_class,
    get_backend,
    onednn_library,
)
from hetconv.backends import onednn as onednn_module
from hetconv.backends.base import ConvShape, Padding
from hetconv.model import Model, load_spec, walk_spec

RTOL = 2e-4
WHEEL_HERE = platform.system() == "Linux" and platform.machine() == "x86_64"
pytestmark = pytest.mark.skipif(
    not WHEEL_HERE, reason="oneDNN's wheel (onednn-cpu-gomp) is built for Linux x86-64 only"
)
REFERENCE = CpuBackend()


@pytest.fixture(scope="module")
def onednn():
    """The backend, which must be available here (hetconv's dependencies install it)."""
    ok, why = onednn_module.OneDnnBackend.is_available()
    assert ok, why
    return get_backend("onednn")


# n, c, h, w, k, kh, kw, padding
SHAPES = [
    (2, 3, 32, 32, 16, 3, 3, 1),  # resnet20's first layer
    (2, 16, 32, 32, 16, 3, 3, 1),  # its first stage
    (2, 64, 17, 17, 32, 2, 2, 0),  # a stride-2 layer as the engine runs it (its phases)
    (2, 16, 16, 16, 32, 1, 1, 0),  # a 1x1 shortcut
    (1, 128, 9, 9, 64, 2, 2, 0),  # batch 1, odd size
    (1, 3, 32, 32, 150, 5, 5, 2),  # paper-150-800's C1 at batch 1
    (1, 150, 16, 16, 80, 5, 5, 2),  # a tenth of its C2's kernels
    (3, 5, 9, 7, 6, 3, 2, (0, 1, 2, 3)),  # odd sizes, even kernel width, asymmetric padding
    (2, 4, 6, 6, 3, 2, 2, "same"),  # even kernel: the extra row/column bottom/right
    (2, 8, 5, 5, 4, 3, 3, 4),  # padding wider than the kernel reaches
    (2, 3, 4, 4, 2, 4, 4, "valid"),  # kernel as large as the image
]


@pytest.mark.parametrize("case", SHAPES, ids=lambda c: "x".join(map(str, c[:7])) + f"-p{c[7]}")
@pytest.mark.parametrize("layout", onednn_module.LAYOUTS)
def test_three_operations_match_the_cpu_backend(onednn, case, layout):
    backend = (
        onednn if layout == onednn_module.DEFAULT_LAYOUT else get_backend("onednn", layout=layout)
    )
    problem = make_problem(np.random.default_rng(7), *case)
    scales = term_scales(REFERENCE, problem)
    assert_results_close(
        run_all(backend, problem), run_all(REFERENCE, problem), RTOL, scales=scales
    )
    y = backend.conv_forward(problem.x, problem.w, None, problem.padding)
    want = REFERENCE.conv_forward(problem.x, problem.w, None, problem.padding)
    assert_close(y, want, "forward without bias", RTOL, scale=scales[0])


def test_every_convolution_of_resnet20_matches_the_cpu_backend(onednn):
    """The shapes the model hands the backend (its stride-2 layers as phases), batch 2."""
    spec = load_spec("resnet20")
    model = Model(spec, seed=0)
    rng = np.random.default_rng(1)
    seen = set()
    for item, layer in zip(walk_spec(spec), model.layers, strict=True):
        if item.kind != "conv":
            continue
        x = rng.standard_normal((2, *item.input_shapes[0]), dtype=np.float32)
        xe, we, padding = layer.executed(x)
        if (xe.shape, we.shape, padding) in seen:
            continue
        seen.add((xe.shape, we.shape, padding))
        problem = make_problem(rng, *xe.shape, *we.shape[:1], *we.shape[2:], padding)
        got, want = run_all(onednn, problem), run_all(REFERENCE, problem)
        assert_results_close(got, want, RTOL, scales=term_scales(REFERENCE, problem))
    assert len(seen) >= 6


def _slices_against_whole(backend, case, bounds):
    """(forward, kernel gradient, bias gradient) of each kernel slice and the whole layer's
    same rows."""
    n, c, h, w, k, kh, kw, padding = case
    problem = make_problem(np.random.default_rng(3), *case)
    x, wt, b, dy = problem.x, problem.w, problem.b, problem.dy
    y = backend.conv_forward(x, wt, b, padding)
    dw, db = backend.conv_grad_kernels(x, dy, (kh, kw), padding)
    for k0, k1 in bounds:
        part_w, part_dy = np.ascontiguousarray(wt[k0:k1]), np.ascontiguousarray(dy[:, k0:k1])
        part_dw, part_db = backend.conv_grad_kernels(x, part_dy, (kh, kw), padding)
        yield (backend.conv_forward(x, part_w, b[k0:k1], padding), y[:, k0:k1])
        yield part_dw, dw[k0:k1]
        yield part_db, db[k0:k1]


SLICED = [  # layers and the kernel slices a split gives its nodes (uneven, odd bounds)
    ((4, 3, 32, 32, 16, 3, 3, 1), [(0, 5), (5, 11), (11, 16)]),
    ((4, 16, 32, 32, 16, 3, 3, 1), [(0, 7), (7, 16)]),
    ((2, 64, 17, 17, 32, 2, 2, 0), [(0, 1), (1, 20), (20, 32)]),
    ((2, 3, 32, 32, 150, 5, 5, 2), [(0, 37), (37, 100), (100, 150)]),
    ((2, 150, 16, 16, 40, 5, 5, 2), [(0, 13), (13, 40)]),
    ((3, 5, 9, 7, 12, 3, 2, (0, 1, 2, 3)), [(0, 4), (4, 12)]),
]


@pytest.mark.parametrize("case, bounds", SLICED, ids=lambda v: "x".join(map(str, v[:7])))
def test_a_kernel_slice_equals_the_whole_layer_bitwise_at_one_thread(case, bounds):
    backend = get_backend("onednn", threads=1)
    for got, want in _slices_against_whole(backend, case, bounds):
        np.testing.assert_array_equal(got, want)


def test_a_thread_count_set_behind_the_backend_is_set_again():
    """threadpoolctl's limits (an embedded cluster gives its workers the cores) set OpenMP's
    thread count and restore it on leaving, behind the backend: every call sets one thread
    again, and kernel slices still equal the whole layer bit for bit."""
    from threadpoolctl import threadpool_limits

    first = get_backend("onednn")
    with threadpool_limits(2, user_api="openmp"):  # the count the limits below restore
        with threadpool_limits(1):
            list(_slices_against_whole(first, *SLICED[0]))
        backend = get_backend("onednn", threads=1)
        for case, bounds in SLICED:
            for got, want in _slices_against_whole(backend, case, bounds):
                np.testing.assert_array_equal(got, want)


@pytest.mark.slow
def test_on_avx2_too_where_odd_padding_is_done_before_onednn(tmp_path):
    """oneDNN limited to AVX2 (``ONEDNN_MAX_CPU_ISA``, read when it loads: a child process)
    takes padding wider than the kernel reaches only in its GEMM-based convolutions, which
    sum by the number of kernels; the backend pads such inputs itself, so the slice tests
    above hold there too."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX2")
    probe = (
        "from hetconv.backends import get_backend, conv_shape\n"
        "b = get_backend('onednn', threads=1)\n"
        "s = conv_shape((3, 5, 9, 7), (12, 5, 3, 2), (0, 1, 2, 3))\n"
        "i = b.implementations(s)\n"
        "print(b.describe().name, b._convolution(s).shape != s, i['forward'], i['kernels'])\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "avx2)" in done.stdout, done.stdout  # the name: "<cpu> (oneDNN 3.2.0, avx2)"
    assert done.stdout.split()[-3:] == ["True", "jit:avx2", "jit:avx2"], done.stdout
    tests = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__]
    tests += ["-k", "bitwise_at_one_thread or three_operations", "--basetemp", str(tmp_path)]
    done = subprocess.run(tests, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:]


ODD = [  # batch 1 (its forward cut by kernels), padding done before oneDNN, odd sizes, and a
    # batch whose kernel gradient is summed from parts (IMAGES_PER_PART: 32 images or more each,
    # PIXELS_PER_PART: 2048 output pixels or more; 97 images of 8x8 make 3 parts, of 6x5 one)
    ((1, 16, 8, 8, 40, 3, 3, 1), [(0, 3), (3, 17), (17, 40)]),
    ((97, 4, 8, 8, 36, 3, 3, 1), [(0, 5), (5, 36)]),
    ((97, 4, 6, 5, 36, 3, 3, 1), [(0, 5), (5, 36)]),
    ((3, 8, 5, 5, 20, 3, 3, 4), [(0, 9), (9, 20)]),
    ((5, 4, 6, 6, 3, 2, 2, "same"), [(0, 1), (1, 3)]),
]


def _all_results(backend, problem, kernel_hw):
    p = problem
    y = backend.conv_forward(p.x, p.w, p.b, p.padding)
    dx = backend.conv_grad_input(p.dy, p.w, p.x.shape[2:], p.padding)
    return (y, dx, *backend.conv_grad_kernels(p.x, p.dy, kernel_hw, p.padding))


@pytest.mark.parametrize("case, bounds", SLICED + ODD, ids=lambda v: "x".join(map(str, v[:7])))
def test_every_result_is_the_same_at_one_two_and_three_threads(case, bounds, monkeypatch):
    """The whole layer's four results at 2 and 3 threads equal those at 1, and a slice of its
    kernels at any of them equals the whole layer's rows at another, bitwise (every call cut
    into parts however small: MIN_PART_FLOPS at 1)."""
    monkeypatch.setattr(onednn_module, "MIN_PART_FLOPS", 1)
    problem = make_problem(np.random.default_rng(5), *case)
    kernel_hw = case[5:7]
    want = _all_results(get_backend("onednn", threads=1), problem, kernel_hw)
    for threads in (1, 2, 3):
        backend = get_backend("onednn", threads=threads)
        for got, expected in zip(_all_results(backend, problem, kernel_hw), want, strict=True):
            np.testing.assert_array_equal(got, expected, err_msg=f"{threads} threads")
        for got, expected in _slices_against_whole(backend, case, bounds):
            np.testing.assert_array_equal(got, expected, err_msg=f"slice at {threads} threads")
    whole_at_3 = get_backend("onednn", threads=3)
    for got, expected in _slices_against_whole(whole_at_3, case, bounds):
        np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("network", ["resnet20", "paper-150-800"])
def test_a_networks_layers_are_the_same_at_every_thread_count(network, monkeypatch):
    """Every convolution a network hands the backend (batch 2, the paper's at a tenth of its
    kernels), sliced as a split would, at 2 and 3 threads against the whole at 1 (in parts
    however small)."""
    monkeypatch.setattr(onednn_module, "MIN_PART_FLOPS", 1)
    spec = load_spec(network)
    model = Model(spec, seed=0)
    rng = np.random.default_rng(2)
    seen = set()
    for item, layer in zip(walk_spec(spec), model.layers, strict=True):
        if item.kind != "conv":
            continue
        xe, we, padding = layer.executed(np.zeros((2, *item.input_shapes[0]), np.float32))
        k = we.shape[0] if network == "resnet20" else max(2, we.shape[0] // 10)
        case = (*xe.shape, k, *we.shape[2:], padding)
        if case in seen:
            continue
        seen.add(case)
        problem = make_problem(rng, *case)
        want = _all_results(get_backend("onednn", threads=1), problem, we.shape[2:])
        cut = [(0, k // 3), (k // 3, k)]
        for threads in (2, 3):
            backend = get_backend("onednn", threads=threads)
            got = _all_results(backend, problem, we.shape[2:])
            for a, b in zip(got, want, strict=True):
                np.testing.assert_array_equal(a, b, err_msg=f"{case} at {threads} threads")
            for a, b in _slices_against_whole(backend, case, cut):
                np.testing.assert_array_equal(a, b, err_msg=f"{case} sliced, {threads} threads")
    assert len(seen) >= 2


def test_a_call_is_cut_only_where_each_part_holds_min_part_flops(monkeypatch):
    """Small calls run whole at any thread count (a part's own cost outweighs a second
    core's help); large ones in parts; the results are the same bits either way."""
    worth = onednn_module._worth
    least = onednn_module.MIN_PART_FLOPS
    assert worth(least - 1, 4) == 1 and worth(2 * least, 4) == 2 and worth(100 * least, 3) == 3
    assert worth(0, 1) == 1
    counts = []
    real = onednn_module._in_parallel

    def counting(lib, tasks, threads, buffers):
        counts.append(len(tasks))
        return real(lib, tasks, threads, buffers)

    monkeypatch.setattr(onednn_module, "_in_parallel", counting)
    problem = make_problem(np.random.default_rng(3), 4, 8, 8, 8, 16, 3, 3, 1)
    backend = get_backend("onednn", threads=2)
    small = _all_results(backend, problem, (3, 3))
    assert counts == [1, 1, 1]  # 0.6 MFLOP a call: whole
    monkeypatch.setattr(onednn_module, "MIN_PART_FLOPS", 1)
    counts.clear()
    cut = _all_results(backend, problem, (3, 3))
    assert counts == [2, 2, 1]  # images in two ranges; 16 kernels are one block
    for a, b in zip(small, cut, strict=True):
        np.testing.assert_array_equal(a, b)


def test_ranges_cut_evenly_in_whole_blocks():
    ranges = onednn_module._ranges
    assert ranges(16, 2) == [(0, 8), (8, 16)]
    assert ranges(5, 3) == [(0, 1), (1, 3), (3, 5)]
    assert ranges(2, 4) == [(0, 1), (1, 2)]
    assert ranges(40, 2, 16) == [(0, 16), (16, 40)]
    assert ranges(16, 3, 16) == [(0, 16)]
    assert ranges(7, 1) == [(0, 7)]


def test_parts_run_on_their_own_threads_and_a_failure_reaches_the_caller():
    import threading

    lib = onednn_library.library()
    seen = set()
    barrier = threading.Barrier(3, timeout=30)

    def part(scratch):
        seen.add(threading.get_ident())
        barrier.wait()  # all three at once, or the barrier breaks

    onednn_module._in_parallel(lib, [part] * 3, 3, {})
    assert len(seen) == 3
    seen.clear()
    onednn_module._in_parallel(lib, [lambda _: seen.add(threading.get_ident())] * 5, 2, {})
    assert len(seen) <= 2  # five parts, two threads

    def bad(scratch):
        raise OneDnnFailure("part 2 failed")

    with pytest.raises(OneDnnFailure, match="part 2 failed"):
        onednn_module._in_parallel(lib, [lambda _: None, bad], 2, {})


def test_parts_buffers_are_the_calling_threads_so_a_workers_trim_frees_them(monkeypatch):
    """A worker trims its device thread's scratch after every job: the parts run on the pool
    keep theirs there too, under names of their own."""
    monkeypatch.setattr(onednn_module, "MIN_PART_FLOPS", 1)  # this small call in parts too
    backend = get_backend("onednn", threads=2)
    problem = make_problem(np.random.default_rng(4), 4, 16, 12, 12, 32, 3, 3, 1)
    run_all(backend, problem)
    names = set(backend._scratch.buffers)
    assert "onednn src" in names and "onednn src 1" in names, names
    assert backend.trim_scratch(0) > 0 and not backend._scratch.buffers


class OneDnnFailure(RuntimeError):
    pass


def test_threads_follow_the_blas_limit_unless_given(onednn):
    with threadpool_limits(limits=1, user_api="blas"):
        assert onednn._threads() == 1
    with threadpool_limits(limits=2, user_api="blas"):
        assert onednn._threads() == 2
        assert get_backend("onednn", threads=1)._threads() == 1


def test_primitives_are_kept_per_geometry():
    backend = get_backend("onednn", threads=1)
    x = np.ones((2, 4, 6, 6), np.float32)
    w = np.ones((3, 4, 3, 3), np.float32)
    for _ in range(3):
        backend.conv_forward(x, w, None, 1)
    backend.conv_forward(x[:1], w, None, 1)
    assert len(backend._convolutions) == 2
    backend.threads = 2  # two images: one each, the geometry of one image already kept
    backend.conv_forward(x, w, None, 1)
    assert len(backend._convolutions) == 2
    shape = next(iter(backend._convolutions))
    assert set(backend.implementations(shape)) == {"forward", "input", "kernels"}


def test_past_max_kept_geometries_the_kept_primitives_are_dropped(monkeypatch):
    monkeypatch.setattr(onednn_module, "MAX_KEPT", 2)
    backend = get_backend("onednn", threads=1)
    w = np.ones((3, 4, 3, 3), np.float32)
    for n in (1, 2, 3):
        x = np.ones((n, 4, 6, 6), np.float32)
        assert_close(backend.conv_forward(x, w, None, 1), REFERENCE.conv_forward(x, w, None, 1),
                     "forward", RTOL)  # fmt: skip
        assert len(backend._convolutions) <= 2


@pytest.mark.parametrize("layout, threads", [("plain", 1), ("auto", 1), ("auto", 2)])
def test_calls_from_many_threads_at_once_equal_calls_from_one(layout, threads):
    """A worker serves calls on a pool of threads, and a primitive runs on whichever thread
    asks (oneDNN's own shared scratchpad would forbid that: ours is per thread); the plain
    layout's GEMM-based primitives need a scratchpad, the blocked ones' reorders buffers; at
    two threads each call's parts share the module's pool with the other calls' parts."""
    from concurrent.futures import ThreadPoolExecutor

    backend = get_backend("onednn", layout=layout, threads=threads)
    problems = [
        make_problem(np.random.default_rng(s), 4, 16, 16, 16, 32, 3, 3, 1) for s in range(4)
    ]
    want = [run_all(backend, p) for p in problems]
    with ThreadPoolExecutor(4) as pool:
        for _ in range(3):
            got = list(pool.map(lambda p: run_all(backend, p), problems))
            for g, w in zip(got, want, strict=True):
                for a, b in zip(g, w, strict=True):
                    np.testing.assert_array_equal(a, b)


def test_describe_names_the_library_and_the_cpu_it_compiled_for(onednn):
    info = onednn.describe()
    assert info.backend == "onednn" and info.kind == "cpu"
    assert "oneDNN 3." in info.name


def test_bad_options_say_what_was_wrong():
    with pytest.raises(ValueError, match="onednn layout 'fast' is not one of auto, blocked, plain"):
        get_backend("onednn", layout="fast")
    with pytest.raises(ValueError, match="onednn threads must be a positive integer, got 0"):
        get_backend("onednn", threads=0)
    assert get_backend("onednn", 0).describe().backend == "onednn"  # `hetconv devices` asks
    with pytest.raises(ValueError, match="onednn device 1 does not exist"):
        get_backend("onednn", 1)


def test_without_the_library_the_backend_says_why_and_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv(onednn_module.ENV_LIBRARY, str(tmp_path / "libdnnl.so.3"))
    monkeypatch.setattr(onednn_library, "_library", None)
    monkeypatch.setattr(onednn_library, "_library_error", None)
    ok, why = onednn_module.OneDnnBackend.is_available()
    assert not ok and "libdnnl.so.3" in why and "hetconv installs it on Linux x86-64" in why
    with pytest.raises(BackendUnavailable, match=r"backend onednn is not available here: .*pip"):
        backend_class("onednn")


# -- hetconv train --engine ----------------------------------------------------------------------

TINY_RUN = ["--steps", "3", "--batch", "4", "--train-size", "8", "--eval-size", "0"]


def _trained(tmp_path, name: str, *flags: str) -> dict[str, np.ndarray]:
    from hetconv.cli import main

    argv = ["train", *TINY_RUN, "--no-progress", "--run-dir", str(tmp_path), "--name", name]
    assert main([*argv, *flags]) == 0
    return dict(np.load(tmp_path / name / "model.npz"))


def test_train_local_with_the_onednn_engine_trains_as_the_cpu_engine(tmp_path):
    cpu = _trained(tmp_path, "cpu", "--local")
    onednn = _trained(tmp_path, "onednn", "--local", "--engine", "onednn")
    assert cpu.keys() == onednn.keys()
    for name in cpu:
        np.testing.assert_allclose(onednn[name], cpu[name], rtol=0, atol=1e-5, err_msg=name)


def test_train_engine_reaches_the_master_and_its_local_worker_processes(tmp_path):
    import json
    import subprocess
    import sys

    trace = tmp_path / "t.jsonl"
    run = subprocess.run(
        [sys.executable, "-m", "hetconv", "train", *TINY_RUN, "--no-progress", "--engine",
         "onednn", "--local-workers", "1", "--trace", str(trace), "--run-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    plan = json.loads(trace.read_text().splitlines()[0])
    nodes = plan["nodes"]
    assert len(nodes) == 2 and all("(onednn" in node["description"] for node in nodes), nodes


def test_train_refuses_an_unknown_engine(capsys):
    from hetconv.cli import main

    with pytest.raises(SystemExit):
        main(["train", "--local", "--engine", "mkl"])
    assert "invalid choice: 'mkl'" in capsys.readouterr().err


def test_a_cluster_of_onednn_workers_trains_as_onednn_alone(tmp_path):
    """The exactness run (tests/exactness.py: 20 steps of the tiny network with a strong LRN)
    with every convolution on oneDNN: two real worker processes and the master, each a slice
    of every layer's kernels (uneven, smaller than the LRN's halo), against one process."""
    from exactness import FAST, same_as_local, train_strong_lrn

    from hetconv.conv import LocalConv
    from hetconv.master.cluster import Cluster, ClusterConfig
    from hetconv.master.launch import LocalWorkers

    alone = train_strong_lrn(tmp_path, "alone", LocalConv("onednn"))
    shares = {"conv1": (0, 1, 7), "conv2": (5, 9, 2)}
    with LocalWorkers(2, backend="onednn") as workers:
        config = ClusterConfig(**FAST, shares=shares)
        with Cluster(workers.addresses, backend="onednn", config=config) as cluster:
            got = train_strong_lrn(tmp_path, "cluster", cluster)
    same_as_local(got, alone)


def test_conv_vs_torch_rows_of_both_engines_side_by_side(tmp_path):
    """``benchmarks/conv_vs_torch.py --engine cpu onednn``: each row carries its engine, both
    engines time the same rows, and a last table puts their ratios side by side."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("torch")
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "conv_vs_torch.py"
    out = tmp_path / "rows.json"
    argv = ["--network", "tiny", "--batch", "2", "--threads", "1", "--repeats", "1"]
    argv += ["--kinds", "conv forward", "--engine", "cpu", "onednn", "--statistic", "min"]
    done = subprocess.run(
        [sys.executable, str(script), *argv, "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())
    layers = {e: {r["layer"] for r in rows if r["engine"] == e} for e in ("cpu", "onednn")}
    assert layers["cpu"] == layers["onednn"] == {"conv1", "conv2"}
    assert "ratio ours/torch by engine:" in done.stdout
    table = done.stdout.split("ratio ours/torch by engine:")[1]
    assert "cpu" in table and "onednn" in table


@pytest.mark.parametrize(
    "n, hw, k, parts",
    [(97, 8, 36, 3), (97, 6, 36, 1), (64, 16, 128, 2), (64, 4, 512, 1), (64, 2, 512, 1),
     (256, 4, 512, 2), (512, 2, 8, 1), (1024, 2, 8, 2), (31, 32, 16, 1), (500, 32, 16, 4)],
)  # fmt: skip
def test_a_kernel_gradients_image_parts_follow_the_images_and_their_pixels(n, hw, k, parts):
    """Parts of 32 images or more, each of at least 2048 output pixels (a 3x3 same layer),
    at most 4; the kernels never count, so a slice of them is summed as the whole layer."""
    padding = Padding(1, 1, 1, 1)
    for kernels in (k, 1):
        shape = ConvShape(n, 8, hw, hw, kernels, 3, 3, padding)
        assert onednn_module._image_parts(shape) == parts
