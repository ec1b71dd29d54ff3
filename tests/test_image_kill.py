"""The whole network split by images with a worker SIGKILLed while its call is in flight
(:func:`kill_mid_call`: once it has spent CPU time on its range; with batch norm the ring sums
the statistics throughout the pass, so it dies mid-ring): networks with batch norm and
residual blocks under the ring, and paper-150-800 under both exchanges; and the master telling
the ring at once when a worker dies (a survivor does not wait its wait out).

How resnet20's 20 steps are compared with local training. Free-running they cannot be: local
training and the ring, unkilled, were 6e-8 apart after step 1, 3e-5 after step 2, 1e-3 after
step 4 and 0.14 after step 20 (resnet20 at batch 8 on the synthetic set), with no fault
anywhere. Its 1.5 million ReLU inputs a step hold, on about one step in three, one within
float32 round-off of zero; a split by images (each weight gradient's terms summed by ranges of
images, batch norm's statistics in float64 per node, a range's convolutions rounding otherwise
than the whole batch's) sends it down the other branch, its gradient passes or not, batch
norm's sums carry that to every weight before it (up to 3.5e-5 in that step), and the run
amplifies it step by step: a chaotic run, not a wrong one. So :func:`assert_every_step_local`
holds each step of the distributed run, from the weights, momentum and running statistics the
run had before it, to two things: the same step computed in this process by the split's rules
(:func:`split_step`), bit for bit (the killed step: the whole batch, as the master computed
it); and that, to local training's step from the same state (:func:`local_step`): every ReLU's
inputs within round-off (1e-5 of the layer's largest), the loss to 1e-5, the weights and
running statistics to 2e-6 (measured 1.2e-7), or to 1e-4 on a step where a ReLU input within
that round-off of zero took the other branch (counted, not guessed: both forwards are here).
The small networks, whose free runs do not amplify round-off, are also held to free-running
local training (:func:`exactness.same_as_local`).
"""

from __future__ import annotations

import io
import json
import os
import signal
import threading
import time
from contextlib import nullcontext

import numpy as np
import pytest
from exactness import FAST, RUN, same_as_local
from test_image_ring import Recording as RingRecording
from test_image_split import Recording as MasterRecording
from test_image_syncbn import ThreadSum
from threadpoolctl import threadpool_limits

from hetconv.conv import LocalConv
from hetconv.imagesplit import batch_loss, images_gradients
from hetconv.layers import ReLU, softmax_cross_entropy
from hetconv.master.imagesplit import _sum_in_order
from hetconv.master.launch import LocalWorkers
from hetconv.master.ring import WAIT_FLOOR_S
from hetconv.model import Model
from hetconv.optim import SGD
from hetconv.ring import MASTER, RING
from hetconv.spec import resnet_spec
from hetconv.training import TrainConfig, train
from hetconv.worker.ring import RingCalls, RingFailed

#: Two residual blocks (the second with a strided 1x1 shortcut), batch norm after every
#: convolution: resnet20's structure at a size a default-run test trains in a second.
TINY_RESNET = resnet_spec([(4, 1), (8, 1)], stem=4)
#: One step's weights may be this far from local training's step from the same state
#: (float32 round-off; measured: 1.2e-7 where no ReLU took the other branch) ...
STEP_ATOL = 2e-6
#: ... and this far where a ReLU input within round-off of zero may have taken the other
#: branch (resnet20 at batch 8, measured: one such input moved its step's weights by up to
#: 3.5e-5, through batch norm's sums every weight before it).
KNIFE_ATOL = 1e-4
#: BLAS threads of each worker :class:`~hetconv.master.launch.LocalWorkers` starts.
WORKER_BLAS_THREADS = 1


class Steps:
    """What a split's master saw of each step: the batch, and its copy of the weights,
    running statistics and momentum before and after (for :func:`assert_every_step_local`)."""

    def _init_steps(self) -> None:
        self.seen: list[dict] = []

    def train_batch(self, model, x, labels, step):
        before = _state(model)
        momentum = {k: np.array(v) for k, v in getattr(self, "_momentum", {}).items()}
        loss, hits = super().train_batch(model, x, labels, step)
        model_is = dict(spec=model.spec, shape=model.input_shape, seed=model.seed)
        self.seen.append(dict(step=step, x=np.array(x), labels=np.array(labels), loss=loss,
                              before=before, momentum=momentum, after=_state(model),
                              **model_is))  # fmt: skip
        return loss, hits


class RingSteps(Steps, RingRecording):
    """The ring split (:class:`test_image_ring.Recording`) with :class:`Steps`; its
    ``in_flight`` actions run once the calls are out also for a network with batch norm
    (the master computes no range of it)."""

    def __init__(self, addresses, **config):
        super().__init__(addresses, **config)
        self._init_steps()

    def _ring_calls(self, *args, **kwargs):
        calls = super()._ring_calls(*args, **kwargs)
        if self._batchnorm and self.step in self.in_flight:
            self.in_flight.pop(self.step)()
        return calls


def _state(model) -> dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in {**model.parameters(), **model.buffers()}.items()}


def assert_every_step_local(cluster, sgd) -> list[int]:
    """Every step ``cluster`` (a :class:`RingSteps`) ran is, bit for bit, the split computed
    here from the same weights, momentum and running statistics (:func:`split_step`: the
    ranges with the workers' one BLAS thread; a step whose ring failed, the whole batch as
    the master computed it); and that equals local training's step from the same state
    (:func:`local_step`): its loss to 1e-5 (relative), every ReLU's inputs to round-off
    (:func:`other_branches`), every weight and statistic to :data:`STEP_ATOL`, or to
    :data:`KNIFE_ATOL` on a step where a ReLU input within that round-off of zero took the
    other branch. Each step starts where the one before ended. Returns those steps."""
    knives = []
    for i, (seen, record) in enumerate(zip(cluster.seen, cluster.steps, strict=True)):
        step = seen["step"]
        if i:
            before, previous = seen["before"], cluster.seen[i - 1]["after"]
            assert all((before[k] == previous[k]).all() for k in before)
        whole = record["exchange"] == MASTER  # the master computed the batch, as local
        counts = [len(seen["x"])] if whole else list(record["images"].values())
        with nullcontext() if whole else threadpool_limits(WORKER_BLAS_THREADS):
            loss, after, inputs = split_step(seen, sgd, counts, synced=not whole)
        assert seen["loss"] == loss, step
        for name, value in after.items():
            np.testing.assert_array_equal(seen["after"][name], value, f"step {step}: {name}")
        local_loss, local_after, local_inputs = local_step(seen, sgd)
        np.testing.assert_allclose(loss, local_loss, rtol=1e-5, err_msg=f"step {step}")
        flipped = other_branches(local_inputs, inputs)
        knives += [step] if flipped else []
        for name, want in local_after.items():
            np.testing.assert_allclose(after[name], want, rtol=0,
                                       atol=KNIFE_ATOL if flipped else STEP_ATOL,
                                       err_msg=f"step {step}: {name}")  # fmt: skip
    return knives


def other_branches(local: dict[str, np.ndarray], split: dict[str, np.ndarray]) -> int:
    """How many ReLU inputs took the other branch in the split than in local training's
    forward of the same step, asserting that each ReLU's inputs differ by round-off alone (at
    most 1e-5 of the largest): an input that changes sides is then within round-off of zero."""
    flipped = 0
    for name, x in local.items():
        off = float(np.abs(split[name] - x).max())
        assert off <= 1e-5 * float(np.abs(x).max()), (name, off)
        flipped += int(((split[name] > 0) != (x > 0)).sum())
    return flipped


def local_step(seen: dict, sgd) -> tuple[float, dict[str, np.ndarray], dict]:
    """Local training's step (the training loop's passes and optimizer) from the state a
    split's step started from: (its loss, the weights and running statistics after it, every
    ReLU's input by layer)."""
    model = _model(seen)
    with _ReluInputs() as inputs:
        logits = model.forward(seen["x"], step=seen["step"])
    loss, grad, _ = softmax_cross_entropy(logits, seen["labels"])
    model.backward(grad)
    return (
        loss,
        _updated(model, seen, sgd, model.gradients()),
        inputs.joined([threading.current_thread().name]),
    )


def split_step(
    seen: dict, sgd, counts: list[int], synced: bool = True
) -> tuple[float, dict[str, np.ndarray], dict]:
    """The split's step from the same state computed here, as the cluster computes it: one
    model per range of ``counts`` images (in threads, batch norm's sums through
    :class:`test_image_syncbn.ThreadSum`), the gradients summed in node order and the first
    range's running statistics; not ``synced``: the whole batch with plain batch norm, as
    the master computes a step whose ring failed. (loss, weights and statistics after, every
    ReLU's input by layer, in batch order.)"""
    x, labels, batch, step = seen["x"], seen["labels"], len(seen["x"]), seen["step"]
    models = [_model(seen) for _ in counts]
    ranges = list(zip(np.cumsum([0, *counts[:-1]]), counts, strict=True))
    sums = ThreadSum(len(counts)) if len(counts) > 1 else None
    out: list = [None] * len(counts)

    def run(rank: int) -> None:
        first, count = ranges[rank]
        rows = slice(first, first + count)
        reduce = sums.for_rank(rank) if sums else (lambda v: v) if synced else None
        out[rank] = images_gradients(models[rank], x[rows], labels[rows], first, batch, step,
                                     reduce)  # fmt: skip

    with _ReluInputs() as inputs:
        threads = [threading.Thread(target=run, args=(r,), name=f"range {r}")
                   for r in range(len(counts))]  # fmt: skip
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    grads = {k: _sum_in_order([o[0][k] for o in out]) for k in out[0][0]}
    after = _updated(models[0], seen, sgd, grads)
    return batch_loss([o[1] for o in out], batch), after, inputs.joined([t.name for t in threads])


def _model(seen: dict) -> Model:
    model = Model(seen["spec"], input_shape=seen["shape"], seed=seen["seed"])
    model.load_state(seen["before"])
    return model.train()


def _updated(model, seen: dict, sgd, grads: dict) -> dict[str, np.ndarray]:
    """``model``'s running statistics, and the weights it started from after the optimizer's
    step with ``grads`` (the momentum it started from)."""
    params = {k: np.array(seen["before"][k]) for k in model.parameters()}
    optimizer = SGD(params, sgd)
    optimizer.load_state(seen["momentum"])
    optimizer.step(grads)
    return {**_state(model), **params}


class _ReluInputs:
    """While entered, every ReLU's forward keeps its input, by thread and layer name (a
    chunked run's copies of a layer too, chunk by chunk): :meth:`joined` gives them by layer
    name, the named threads' in turn (one thread per range of images)."""

    def __enter__(self):
        self.kept: dict[tuple[str, str], list] = {}
        self._forward, kept = ReLU.forward, self.kept

        def forward(layer, x):
            key = (threading.current_thread().name, layer.name)
            kept.setdefault(key, []).append(np.array(x))
            return self._forward(layer, x)

        ReLU.forward = forward
        return self

    def __exit__(self, *exc) -> None:
        ReLU.forward = self._forward

    def joined(self, threads: list[str]) -> dict[str, np.ndarray]:
        out: dict[str, list] = {}
        for thread in threads:
            for (where, name), parts in self.kept.items():
                if where == thread:
                    out.setdefault(name, []).extend(parts)
        return {name: np.concatenate(parts) for name, parts in out.items()}


def kill_mid_call(cluster, victim, at: int) -> None:
    """SIGKILL ``victim`` (a worker process) in step ``at`` while its call is in flight and
    it computes: stopped once the step's ranges are cut (its call then waits for it), let go
    once every call is out, killed as soon as it has spent CPU time on the step (10 ms: the
    kernel's tick; at most 0.3 s after it was let go). ``cluster``: a recording split (its
    ``actions`` run once the ranges are cut, its ``in_flight`` ones once the calls are out)."""
    calls_out = threading.Event()

    def kill() -> None:
        if not calls_out.wait(120):
            return
        time.sleep(0.05)  # the call reaches it
        start, clock = _cpu_ticks(victim.pid), time.monotonic()
        os.kill(victim.pid, signal.SIGCONT)
        while _cpu_ticks(victim.pid) == start and time.monotonic() - clock < 0.3:
            time.sleep(0.001)
        cluster.killed_after = time.monotonic() - clock  # seconds it ran, let go
        victim.kill()
        victim.wait()

    cluster.actions[at] = lambda: os.kill(victim.pid, signal.SIGSTOP)
    cluster.in_flight[at] = calls_out.set
    threading.Thread(target=kill, daemon=True).start()


def _cpu_ticks(pid: int) -> int:
    """User and system clock ticks a process has spent (from /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def _train(tmp_path, name, executor, spec, **overrides):
    """``spec`` (a preset's name or a spec) trained through ``executor`` with
    :data:`exactness.RUN` and ``overrides``: (losses, saved weights and statistics), and the
    run's optimizer settings."""
    if isinstance(spec, list):
        path = tmp_path / "spec.json"
        path.write_text(json.dumps(spec))
        spec = str(path)
    weights = tmp_path / f"{name}.npz"
    config = TrainConfig(**{**RUN, "preset": spec, "save": str(weights), **overrides})
    with executor:
        losses = train(config, executor, log=io.StringIO()).losses
    return (losses, dict(np.load(weights))), config.sgd


def _killed_ring(tmp_path, spec, at: int, **run):
    """``spec`` trained by the ring on two local workers, the second SIGKILLed mid-call in
    step ``at``: (losses and weights, the cluster, the addresses, the optimizer's settings)."""
    with LocalWorkers(2, blas_threads=WORKER_BLAS_THREADS) as started:
        cluster = RingSteps(started.addresses, deterministic=True, **FAST)
        kill_mid_call(cluster, started.processes[1], at)
        got, sgd = _train(tmp_path, "killed", cluster, spec, **run)
    return got, cluster, started.addresses, sgd


def _assert_killed_in(cluster, addresses, at: int) -> None:
    """Step ``at`` went through the master (the killed worker's images covered there), the
    steps before and after by the ring, the survivor alone from the next."""
    victim, survivor = addresses[1], addresses[0]
    records = cluster.steps
    assert records[at]["exchange"] == MASTER
    assert records[at]["nodes"][victim]["covered_by"] == "master"
    assert all(r["exchange"] == RING for i, r in enumerate(records) if i != at)
    assert all(r["images"].keys() == {survivor} for r in records[at + 1 :])
    assert records[at + 1]["nodes"][survivor]["placed"]  # the master's copy placed again


def test_a_small_resnet_with_a_worker_killed_mid_pass_trains_as_local_training(tmp_path):
    """Two residual blocks with batch norm under the ring, a worker SIGKILLed mid-pass in
    step 1 of 3: step 1's whole batch computed by the master, step 2 by the survivor alone
    (its running statistics the master's, placed again); every step bit for bit the split
    computed here and, no ReLU taking the other branch, local training's step to 2e-6; the
    free run as local training's."""
    run = dict(steps=3, eval_size=0, batch=32, train_size=96)
    local, _ = _train(tmp_path, "local", LocalConv(), TINY_RESNET, **run)
    got, cluster, addresses, sgd = _killed_ring(tmp_path, TINY_RESNET, 1, **run)
    _assert_killed_in(cluster, addresses, 1)
    assert assert_every_step_local(cluster, sgd) == []  # no step on a knife edge: 2e-6
    same_as_local(got, local)


@pytest.mark.slow
def test_resnet20_with_a_worker_killed_mid_pass_trains_as_local_training(tmp_path):
    """resnet20 (batch norm, nine residual blocks) under the ring for 20 steps at batch 8, a
    worker SIGKILLed mid-pass in step 11: every step, the killed one included, is bit for bit
    the split computed here from the same weights, momentum and running statistics, and that
    is local training's step (2e-6, or 1e-4 where a ReLU input within round-off of zero took
    the other branch; see the module's docstring for why not a free-running run); the first
    step's loss also free-running. About 10 s."""
    local, _ = _train(tmp_path, "local", LocalConv(), "resnet20", steps=1, eval_size=0)
    got, cluster, addresses, sgd = _killed_ring(tmp_path, "resnet20", 11, eval_size=0)
    _assert_killed_in(cluster, addresses, 11)
    assert cluster.killed_after < 0.3  # killed once it had spent CPU time on the step
    assert len(cluster.seen) == 20
    knives = assert_every_step_local(cluster, sgd)
    assert 11 not in knives  # the master's whole batch: local training's own computation
    assert len(knives) <= 10  # most steps held to 2e-6 (measured: 6 of 20 not)
    np.testing.assert_allclose(got[0][0], local[0][0], rtol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("exchange", [MASTER, RING])
def test_paper_150_800_with_a_worker_killed_mid_pass_trains_as_local_training(tmp_path, exchange):
    """paper-150-800 for 20 steps on two workers, the second SIGKILLed in step 11 while it
    computes its range (the slow tests of test_image_split and test_image_ring kill it while
    stopped, before it took its call): through the master, the master computes that range;
    with the ring, the step goes through the master. No batch norm: nothing amplifies the
    round-off, and the free run equals local training's (about 25 s each)."""
    local, _ = _train(tmp_path, "local", LocalConv(), "paper-150-800", eval_size=0)
    with LocalWorkers(2, blas_threads=WORKER_BLAS_THREADS) as started:
        kind = RingSteps if exchange == RING else MasterRecording
        cluster = kind(started.addresses, deterministic=True, **FAST)
        kill_mid_call(cluster, started.processes[1], 11)
        got, _ = _train(tmp_path, "killed", cluster, "paper-150-800", eval_size=0)
    same_as_local(got, local)
    assert cluster.killed_after < 0.3  # killed once it had spent CPU time on its range
    assert cluster.steps[11]["nodes"][started.addresses[1]]["covered_by"] == "master"
    assert all(r["images"].keys() == {"master", started.addresses[0]} for r in cluster.steps[12:])
    if exchange == RING:
        assert [i for i, r in enumerate(cluster.steps) if r["exchange"] != RING] == [11]


class KillingOnPart(RingCalls):
    """A worker's ring (run in the test's process) that, when the first part of step ``at``
    comes from ``victim`` (the other rank's worker process), SIGKILLs it and drops the part:
    its sender is gone, so this rank waits for a part that never comes (as where the other
    died before putting it). ``why`` keeps what ended that wait, ``waited`` its seconds."""

    def __init__(self, context, victim, at: int):
        super().__init__(context)
        self.victim, self.at, self.why, self.waited = victim, at, None, None
        self.dropped = False
        self._parts = _Dropping(self)

    def _receive(self, session, step, round_, wait):
        start = time.monotonic()
        try:
            return super()._receive(session, step, round_, wait)
        except RingFailed as e:
            if step == self.at:
                self.why, self.waited = str(e), time.monotonic() - start
            raise


class _Dropping(dict):
    """A ring's parts, but for the first of its step ``at``: its sender killed, it is lost."""

    def __init__(self, ring: KillingOnPart):
        super().__init__()
        self.ring = ring

    def setdefault(self, key, value):
        if key[1] == self.ring.at and not self.ring.dropped:
            # killed a moment later: this rank's own put of the round reaches it first (a put
            # that failed would end this rank's ring by itself, not by the master's word)
            self.ring.dropped = True
            threading.Timer(0.3, self._kill).start()
            return value
        return super().setdefault(key, value)

    def _kill(self):
        self.ring.victim.kill()
        self.ring.victim.wait()


def test_the_master_tells_the_ring_at_once_when_a_worker_dies_mid_pass(tmp_path):
    """The other rank's worker process SIGKILLed while this one waits for its batch norm
    sums: the master sees that worker's call fail and tells this one the step's ring failed
    at once (it does not wait its wait out for a part that cannot come); the step goes
    through the master and equals local training's step."""
    from hetconv.backends import get_backend
    from hetconv.worker import service as service_module

    run = dict(steps=4, eval_size=0)
    local, _ = _train(tmp_path, "local", LocalConv(), TINY_RESNET, **run)
    with LocalWorkers(1, blas_threads=WORKER_BLAS_THREADS) as started:
        survivor = service_module.ConvWorkerService(get_backend("cpu"))
        ring = KillingOnPart(survivor.context, started.processes[0], 2)
        survivor.context.ring = ring  # before its server takes the ring's calls
        server, address = service_module.start_server(survivor, "127.0.0.1:0")
        try:
            cluster = RingSteps([address, *started.addresses], deterministic=True, **FAST)
            got, _ = _train(tmp_path, "killed", cluster, TINY_RESNET, **run)
        finally:
            server.stop(0)
            survivor.close()
    assert ring.why == "another rank said the ring failed"
    assert cluster.steps[2]["exchange"] == MASTER
    assert ring.waited < WAIT_FLOOR_S  # not the ring's wait for the part (121 s here)
    assert [r["exchange"] for r in cluster.steps[3:]] == [RING]
    same_as_local(got, local)
