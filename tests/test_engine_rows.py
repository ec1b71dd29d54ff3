"""The onednn backend's bound calls (:class:`hetconv.backends.onednn_library._Bound`): each
thread makes an operation's oneDNN memories once and every later call only points them at its
own arrays and scratch buffers. These check that a call never computes on an earlier call's
arrays or on freed buffers, against the cpu backend on resnet20's and resnet18's layers (as the
engine runs them: strided layers by their phases, 3x3 stride-2 ones also by oneDNN's strides)
and on odd shapes, and that the engine takes that path: memories made once per thread and
operation, none made again on later calls.

Tolerance: ``2e-5`` of the magnitude of the summed terms (:func:`backend_cases.term_scales`):
float32 round-off of sums of up to 4608 terms in another order than BLAS's.
"""

from __future__ import annotations

import platform
import threading

import numpy as np
import pytest
from backend_cases import assert_results_close, make_problem, run_all, term_scales

from hetconv.backends import CpuBackend, Padding, get_backend
from hetconv.backends import onednn as onednn_module
from hetconv.conv import StridePhases
from hetconv.model import Model, load_spec, walk_spec

RTOL = 2e-5
NAMES = ("forward", "kernels", "bias")
pytestmark = pytest.mark.skipif(
    not (platform.system() == "Linux" and platform.machine() == "x86_64"),
    reason="oneDNN's wheel (onednn-cpu-gomp) is built for Linux x86-64 only",
)
REFERENCE = CpuBackend()

# n, c, h, w, k, kh, kw, padding
ODD = [
    (1, 3, 32, 32, 16, 3, 3, 1),  # a first layer at batch 1 (its forward cut by kernels)
    (3, 5, 9, 7, 6, 3, 2, (0, 1, 2, 3)),  # odd sizes, asymmetric padding
    (2, 8, 5, 5, 4, 3, 3, 4),  # padding wider than the kernel reaches (padded before oneDNN)
    (1, 16, 7, 7, 33, 1, 1, 0),  # 1x1, batch 1, odd size and kernel count
    (5, 32, 9, 9, 64, 1, 1, 0),  # a shortcut's phases at an odd size
]


def _network_cases(network: str, batch: int) -> list[tuple]:
    """(x, kernel shape, padding, stride) of every distinct convolution call the engine makes
    for ``network`` at ``batch`` on the onednn backend."""
    spec = load_spec(network)
    model = Model(spec, seed=0)
    cases, seen = [], set()
    for item, layer in zip(walk_spec(spec), model.layers, strict=True):
        if item.kind != "conv":
            continue
        x = np.zeros((batch, *item.input_shapes[0]), np.float32)
        calls = [layer.executed(x) + ((1, 1),)]
        if layer.runs_strided(x):
            calls.append((x, layer.params["weight"], layer.padding, layer.stride))
        for xe, we, padding, stride in calls:
            key = (xe.shape, we.shape, str(padding), stride)
            if key not in seen:
                seen.add(key)
                cases.append((xe.shape, we.shape, padding, stride))
    return cases


def _strided_results(backend, x, w, dy, padding, stride):
    y = backend.conv_forward(x, w, None, padding, stride)
    return (y, *backend.conv_grad_kernels(x, dy, w.shape[2:], padding, stride))


@pytest.mark.parametrize("network, batch", [("resnet20", 3), ("resnet18", 2)])
def test_every_call_of_a_network_matches_the_cpu_backend_twice_over(network, batch):
    """Each call twice, on fresh arrays the second time: a bound call reads and writes the
    arrays it is given, not the first call's."""
    onednn = get_backend("onednn", threads=1)
    rng = np.random.default_rng(4)
    strided = 0
    for x_shape, w_shape, padding, stride in _network_cases(network, batch):
        for _ in range(2):
            if stride == (1, 1):
                problem = make_problem(rng, *x_shape, w_shape[0], *w_shape[2:], padding)
                assert_results_close(
                    run_all(onednn, problem), run_all(REFERENCE, problem), RTOL,
                    scales=term_scales(REFERENCE, problem),
                )  # fmt: skip
                continue
            # oneDNN's own strides: against the cpu backend on the same layer's phases
            x = rng.standard_normal(x_shape, dtype=np.float32)
            w = rng.standard_normal(w_shape, dtype=np.float32)
            y = onednn.conv_forward(x, w, None, padding, stride)
            dy = rng.standard_normal(y.shape, dtype=np.float32)
            got = _strided_results(onednn, x, w, dy, padding, stride)
            phases = StridePhases(
                x_shape[1:], w_shape[2:], Padding.resolve(padding, w_shape[2:]), stride
            )
            xq, wq = phases.input(x), phases.kernels(w)
            want_y = REFERENCE.conv_forward(xq, wq, None, 0)
            dwq, db = REFERENCE.conv_grad_kernels(xq, dy, wq.shape[2:], 0)
            want = (want_y, phases.kernel_grad(dwq), db)
            xa, dya = np.abs(xq), np.abs(dy)  # the magnitudes of the summed terms
            scales = (
                REFERENCE.conv_forward(xa, np.abs(wq), None, 0).max(),
                REFERENCE.conv_grad_kernels(xa, dya, wq.shape[2:], 0)[0].max(),
                dya.sum(axis=(0, 2, 3)).max(),
            )
            for a, b, scale, name in zip(got, want, scales, NAMES, strict=True):
                np.testing.assert_allclose(a, b, rtol=0, atol=RTOL * scale, err_msg=name)
        strided += stride != (1, 1)
    assert strided >= 2  # the 3x3 stride-2 layers by oneDNN's strides


@pytest.mark.parametrize("case", ODD, ids=lambda c: "x".join(map(str, c[:7])) + f"-p{c[7]}")
def test_odd_shapes_match_the_cpu_backend_after_the_scratch_is_freed(case):
    """A worker's trim frees the thread's buffers between calls: the bound memories then
    point at the new ones."""
    onednn = get_backend("onednn", threads=1)
    rng = np.random.default_rng(6)
    for _ in range(2):
        problem = make_problem(rng, *case)
        scales = term_scales(REFERENCE, problem)
        assert_results_close(
            run_all(onednn, problem), run_all(REFERENCE, problem), RTOL, scales=scales
        )
        assert onednn.trim_scratch(0) > 0


def test_memories_are_made_once_per_thread_and_operation(monkeypatch):
    """The engine's path: the first call of each operation on a thread binds its memories;
    later calls on that thread, whatever their arrays, make none. (Which of the pool's
    threads takes a part varies from call to call, so a later call may bind on a thread the
    first did not use: the bindings are counted per thread.)"""
    import threading

    monkeypatch.setattr(onednn_module, "MIN_PART_FLOPS", 1)  # two threads: two parts
    bindings: list[tuple[int, int]] = []  # (thread, primitive)
    real = onednn_module._Bound

    def bound(lib, primitive, *args):
        bindings.append((threading.get_ident(), id(primitive)))
        return real(lib, primitive, *args)

    monkeypatch.setattr(onednn_module, "_Bound", bound)
    onednn = get_backend("onednn", threads=2)
    problem = make_problem(np.random.default_rng(8), 4, 16, 16, 16, 32, 3, 3, 1)
    run_all(onednn, problem)
    assert bindings and all(len(conv._memories) for conv in onednn._convolutions.values())
    for _ in range(3):
        again = make_problem(np.random.default_rng(9), 4, 16, 16, 16, 32, 3, 3, 1)
        assert_results_close(
            run_all(onednn, again), run_all(REFERENCE, again), RTOL,
            scales=term_scales(REFERENCE, again),
        )  # fmt: skip
    assert len(bindings) == len(set(bindings)), bindings  # once per thread and operation


def test_threads_calling_at_once_each_bind_their_own_memories():
    """Four threads call the same geometries at once: each binds its own memories (a
    memory object serves one thread at a time), and every result equals one thread's."""
    onednn = get_backend("onednn", threads=1)
    problems = [make_problem(np.random.default_rng(s), 2, 8, 12, 12, 16, 3, 3, 1) for s in range(4)]
    want = [run_all(onednn, p) for p in problems]
    conv = next(iter(onednn._convolutions.values()))
    one_thread = len(conv._memories)
    got: dict[int, tuple] = {}
    errors: list[BaseException] = []

    def call(i: int) -> None:
        try:
            for _ in range(5):
                got[i] = run_all(onednn, problems[i])
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i in range(4):
        for a, b in zip(got[i], want[i], strict=True):
            np.testing.assert_array_equal(a, b)
    assert len(conv._memories) == 5 * one_thread  # the main thread's and four others'
