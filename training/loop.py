"""The training loop: data order, SGD steps, progress, held-out evaluation, checkpoints and the
trace.

The loop does not know where convolutions run: it trains a :class:`~hetconv.model.Model`
whose executor is local (:class:`hetconv.conv.LocalConv`) or the master's cluster when workers
are named; it imports nothing of the cluster.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import numpy as np
from threadpoolctl import threadpool_info, threadpool_limits
from tqdm import tqdm

from hetconv.conv import ConvExecutor, LocalConv
from hetconv.data import epoch_order
from hetconv.description import Description
from hetconv.layers import softmax_cross_entropy
from hetconv.model import Model
from hetconv.onnx_import import load_network
from hetconv.optim import SGD

from .checkpoint import CheckpointDir, TrainingState, read_weights, resume_point
from .config import TrainConfig, TrainResult, total_steps
from .console import announce, summarize
from .datasets import check_classes, evaluate, load_datasets
from .fingerprint import compute_environment, order_digest, run_fingerprint
from .masterwork import other_work
from .rundir import MetricsLog
from .stopping import StopAtStepBoundary, TrainingInterrupted
from .trace import RunFileError, Trace, model_record, written

# "checkpoint written" lines on the console at most this often (the trace records every one).
_CHECKPOINT_MESSAGE_SECONDS = 5.0
# Evaluation lines on the console: at most one per this fraction of the run's steps (the trace
# and the metrics get every evaluation).
_EVAL_LINES = 10
#: The verdict times the master alone for at least ALONE_STEPS steps (after one more, left out:
#: warming up), and for more, up to ALONE_MAX_STEPS, while they add up to under ALONE_SECONDS.
ALONE_STEPS, ALONE_MAX_STEPS, ALONE_SECONDS = 3, 10, 0.5


def train(
    config: TrainConfig,
    executor: ConvExecutor | None = None,
    log: TextIO | None = None,
) -> TrainResult:
    """Train ``config.preset`` and evaluate it on held-out data.

    With ``config.checkpoint_dir`` the state is checkpointed every ``checkpoint_interval``
    steps and after the last one (see :mod:`hetconv.training.checkpoint`); with
    ``config.resume`` the run continues from the latest checkpoint there, and with the same
    executor computes exactly what the uninterrupted run would have: the same losses and
    weights, bit for bit, on one machine with a fixed BLAS thread count.

    Args:
        config: the run.
        executor: where convolutions run (default: the cpu backend in this process).
        log: where progress and the summary go (default: standard error).
    """
    run = _Run(config, executor, log if log is not None else sys.stderr)
    run.announce()
    try:
        return run.summary(run.run_steps())
    except RunFileError as e:  # a full disk: save what it allows, say how to continue
        raise e.stop(len(run.totals.losses), run._save_model, run.checkpoints, run._state) from None


@dataclass
class _Totals:
    """What the loop adds up over the steps; a checkpoint saves it, a resume restores it."""

    losses: list[float] = field(default_factory=list)
    recent_hits: list[float] = field(default_factory=list)  # the progress bar's accuracies
    conv_seconds: float = 0.0
    # Communication, convolution, other computation, summed over the steps after the first.
    breakdown: np.ndarray = field(default_factory=lambda: np.zeros(3))
    earlier_seconds: float = 0.0  # training time before the checkpoint resumed from

    @classmethod
    def restored(cls, state: TrainingState) -> _Totals:
        return cls(
            losses=state.losses.tolist(),
            recent_hits=state.recent_hits.tolist(),
            conv_seconds=state.conv_seconds,
            breakdown=state.breakdown.copy(),
            earlier_seconds=state.train_seconds,
        )


def _resident_names(executor: ConvExecutor) -> set[str]:
    """Parameter names of the layers whose kernels the executor keeps and updates itself
    (with a split head, the final fc's weight too: :mod:`hetconv.head`)."""
    return set(executor.resident_parameters())


def _plan_record(
    executor: ConvExecutor, start_step: int, prediction: dict | None = None
) -> dict | None:
    """The trace's first record for a run from ``start_step``: the executor's plan, if any."""
    plan_record = getattr(executor, "plan_record", None)  # executors older than the method
    plan = plan_record() if plan_record is not None else None
    if plan is None:
        return None
    if prediction is not None:
        plan = {**plan, "prediction": prediction}
    if "step" in plan:
        raise ValueError(f"an executor's plan must not hold 'step' (it holds {sorted(plan)})")
    return {"event": "plan", "start_step": start_step, **plan}


def time_master_alone(spec: list[dict], data, config: TrainConfig, backend="cpu") -> list[float]:
    """Seconds of each SGD step of ``spec`` trained in this process as ``--local`` trains it
    (:class:`LocalConv`), on ``data``'s first batches of ``config.batch``, one left out
    (warming up): :data:`ALONE_STEPS` of them, more while they add up to under
    :data:`ALONE_SECONDS` (a small network's steps scatter on a busy machine), at most
    :data:`ALONE_MAX_STEPS`. A fresh model: nothing of a run's weights or optimizer is
    touched. ``backend``: the master's own (``hetconv train --engine``)."""
    batch, per_epoch = config.batch, max(len(data) // config.batch, 1)
    executor = LocalConv(backend)
    model = Model(spec, seed=config.seed, executor=executor, input_shape=data.image_shape)
    optimizer = SGD(model.parameters(), config.sgd)
    order = epoch_order(len(data), config.seed, 0)
    seconds: list[float] = []
    step = 0
    while len(seconds) <= ALONE_STEPS or (
        len(seconds) <= ALONE_MAX_STEPS and sum(seconds[1:]) < ALONE_SECONDS
    ):
        position = step % per_epoch
        indices = order[position * batch : (position + 1) * batch]
        start = time.perf_counter()
        x, labels = data.batch(indices)
        _, grad, _ = softmax_cross_entropy(model.forward(x, step=step), labels)
        model.backward(grad)
        optimizer.step(model.gradients())
        seconds.append(time.perf_counter() - start)
        step += 1
    return seconds[1:]


def _master_alone(run: _Run) -> tuple[float, int]:
    """The master alone's seconds per step and the steps timed: the median step of
    :func:`time_master_alone` (one slowed by another process does not decide), with the BLAS
    threads the process had before the run's executor took any; traced (event
    ``master_alone``). What the verdict compares ``run``'s cluster with."""
    tqdm.write("timing the master alone (a few steps as --local trains them) to compare",
               file=run.log)  # fmt: skip
    with threadpool_limits(limits=run.blas_threads, user_api="blas"):
        backend = getattr(run.executor, "backend", "cpu")  # the master's engine (--engine)
        steps = time_master_alone(run.spec, run.train_set, run.config, backend)
    seconds = float(np.median(steps))
    # No "step" key: trace readers take the records that have one as the steps.
    run.trace.write({
        "event": "master_alone", "seconds_per_step": seconds, "steps_seconds": steps,
        "batch": run.config.batch,
    })  # fmt: skip
    return seconds, len(steps)


def take_split(run: _Run, momentum: dict) -> None:
    """``run``'s executor changed its split after a step (``--split auto``'s checks: the
    workers released, or another split opened), the old split's resident parameters in the
    model and their ``momentum`` given: every parameter the new split keeps resident
    (none where the master trains alone) to it with its momentum, the rest to the run's
    optimizer."""
    state = {**run.optimizer.state(), **momentum}
    run.resident = _resident_names(run.executor)
    if run.resident:
        run.executor.attach_optimizer(run.config.sgd)
        run.executor.load_resident_momentum({k: v for k, v in state.items() if k in run.resident})
    own = {k: v for k, v in run.model.parameters().items() if k not in run.resident}
    run.optimizer = SGD(own, run.config.sgd)
    run.optimizer.load_state({k: v for k, v in state.items() if k in own})


def eval_due(run: _Run, done: int) -> bool:
    """Whether ``run`` evaluates after ``done`` steps, before the last: at every epoch's end
    and every ``eval_every`` steps."""
    every = run.config.eval_every
    return (
        len(run.test_set) > 0
        and done < run.steps
        and (done % run.steps_per_epoch == 0 or (every is not None and done % every == 0))
    )


class _Run:
    """One call of :func:`train`: the constructor sets it up (data, model, the checkpoint to
    continue from, the executor, the optimizer), then :meth:`announce`, :meth:`run_steps` and
    :meth:`summary`."""

    def __init__(self, config: TrainConfig, executor: ConvExecutor | None, log: TextIO):
        self.config, self.log = config, log
        self.data = load_datasets(config)
        self.train_set, self.test_set = self.data.train, self.data.held_out
        network = load_network(config.preset, classes=self.train_set.num_classes)
        self.spec = network.spec
        if len(self.train_set) < config.batch:
            raise ValueError(
                f"batch {config.batch} is larger than the training set ({len(self.train_set)})"
            )
        check_classes(self.spec, self.train_set, config.preset)
        self.description = Description.of(config.preset, self.spec, self.data)
        self.executor = executor if executor is not None else LocalConv()
        self.model = Model(
            self.spec,
            seed=config.seed,
            executor=self.executor,
            input_shape=self.train_set.image_shape,
        )
        self.loaded_from = None
        if config.load:
            weights, self.loaded_from = read_weights(config.load)
            try:
                self.model.load_state(weights)
            except ValueError as e:
                raise ValueError(f"cannot load {self.loaded_from}: {e}") from None
        elif network.weights is not None:  # an .onnx graph's: its initial weights
            self.model.load_state(network.weights)
        self.steps = total_steps(config, len(self.train_set))
        self.steps_per_epoch = len(self.train_set) // config.batch
        self.environment = compute_environment()
        self.checkpoints: CheckpointDir | None = None
        self.fingerprint: dict = {}
        self.resumed: tuple[TrainingState, Path] | None = None
        if config.checkpoint_dir:
            self._find_checkpoint()
        # What the plan counts for a replicated block's images: palette8 when they fit it.
        fit = self.train_set.palette_fit()
        specs = [dataclasses.replace(spec, images_fit=fit) for spec in self.model.conv_specs()]
        # BLAS as this process has it (an embedded cluster's master gives cores to its workers
        # at prepare): the master alone is timed with it, as --local would train.
        blas = [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]
        self.blas_threads = max(blas, default=None)
        self.executor.prepare(specs, config.batch, log)
        self.prediction = self._predict(config.batch)
        # Resident kernels (the cluster's, hetconv.master.resident): the executor updates them.
        self.resident = _resident_names(self.executor)
        if self.resident:
            self.executor.attach_optimizer(config.sgd)
        own = {k: v for k, v in self.model.parameters().items() if k not in self.resident}
        self.optimizer = SGD(own, config.sgd)
        self.start_step, self.totals = 0, _Totals()
        if self.resumed is not None:
            state = self.resumed[0]
            self.model.load_state(state.model)
            momentum = state.momentum
            self.optimizer.load_state({k: v for k, v in momentum.items() if k in own})
            if self.resident:
                self.executor.load_resident_momentum(
                    {k: v for k, v in momentum.items() if k in self.resident}
                )
            self.start_step, self.totals = state.step, _Totals.restored(state)
        # The trace's first record (None: a local run); the console reads the cluster there.
        self.plan = _plan_record(self.executor, self.start_step, self.prediction)
        if self.plan is not None:  # what was trained: the trace alone can be simulated again
            shape = self.train_set.image_shape
            self.plan["model"] = model_record(config.preset, self.spec, shape, config.batch)
        self.steps_run = self.worker_steps = 0  # steps of this call; those a worker computed in
        self.alone_seconds, self.alone_steps = 0.0, 0  # the master alone, timed after the run
        self.trace = Trace(None)
        self.metrics = MetricsLog(None, None)
        self._order = np.empty(0, np.int64)  # the data order of the current epoch
        self._stop: StopAtStepBoundary | None = None
        self._start = 0.0  # perf_counter when this run's first step began
        self._eval_seconds = 0.0  # evaluations since then: not training time
        self._eval_printed = self.start_step  # the last evaluation printed on the console
        self.final_eval: tuple[float, float] | None = None  # (loss, accuracy) after the last step
        self._last_message = -math.inf

    def _predict(self, batch: int) -> dict | None:
        """The executor's predicted step against the master alone's, when it can say
        (``predict_step``): the master's other work timed here, once."""
        if not self.executor.distributed:
            return None
        # Fused stages (the last one with the fc, where the head is split) run their layers
        # on the nodes, a replicated block's inside the next layer's calls: not between calls.
        alone, between, chains = other_work(self.model, batch)
        return self.executor.predict_step(alone, between, self.spec, chains_s=chains)

    def _find_checkpoint(self) -> None:
        config = self.config
        self.checkpoints = CheckpointDir(config.checkpoint_dir, keep=config.checkpoint_keep)
        # Before anything is computed: a folder that cannot take a checkpoint is refused now,
        # not reported at every checkpoint of a run that then ends with none.
        self.checkpoints.prepare()
        self.fingerprint = run_fingerprint(
            preset=config.preset,
            spec=self.spec,
            dataset=self.data.kind,
            train_set=self.train_set,
            batch=config.batch,
            seed=config.seed,
            sgd=config.sgd,
            initial_weights=self.model.parameters(),
            wire_format=self.executor.wire_format,
        )
        self.resumed = resume_point(
            self.checkpoints,
            self.fingerprint,
            resume=config.resume,
            steps=self.steps,
            train_size=len(self.train_set),
            batch=config.batch,
            seed=config.seed,
            log=self.log,
        )
        self.checkpoints.remove_temporaries()

    def announce(self) -> None:
        """Say what is about to run and, on a resume, from where."""
        announce(self)

    def run_steps(self) -> float:
        """Open the trace, write the plan, run the steps; returns the training seconds, those
        before the checkpoint resumed from included."""
        config = self.config
        resume_step = self.start_step if self.resumed is not None else None
        self.trace = Trace(config.trace, resume_step=resume_step)
        if self.trace.dropped:
            print(
                f"trace {config.trace}: kept {self.trace.kept} records, cut "
                f"{self.trace.dropped} written after the checkpoint",
                file=self.log,
            )
        try:
            self.metrics = MetricsLog(config.metrics, config.tensorboard, resume_step)
            if self.plan is not None:
                self.trace.write(self.plan)
            self._loop()
            self.executor.complete()  # a check deferred past the last step
            if len(self.test_set):
                self.final_eval = self._evaluate(self.steps, final=True)
            if self.executor.distributed and self.worker_steps:
                self.alone_seconds, self.alone_steps = _master_alone(self)
        finally:
            self.trace.close()
            self.metrics.close()
        return self._elapsed()

    def _elapsed(self) -> float:
        return self.totals.earlier_seconds + time.perf_counter() - self._start - self._eval_seconds

    def _evaluate(self, done: int, final: bool) -> tuple[float, float]:
        """Evaluate on the held-out set after ``done`` steps, trace it and, except the final
        evaluation (the summary reports it), print it; returns (loss, accuracy)."""
        self.executor.complete()  # the weights checked before they are evaluated
        start = time.perf_counter()
        loss, accuracy = evaluate(self.model, self.test_set, self.config.eval_batch)
        seconds = time.perf_counter() - start
        self._eval_seconds += seconds
        epoch = done / self.steps_per_epoch
        # No "step" key: trace readers take the records that have one as the steps.
        record = {
            "event": "eval",
            "trained_steps": done,
            "epoch": epoch,
            "loss": loss,
            "accuracy": accuracy,
            "images": len(self.test_set),
            "seconds": seconds,
            "final": final,
        }
        self.trace.write(record)
        self.metrics.evaluation(record)
        # About _EVAL_LINES lines a run: one when the evaluation is a tenth of the run's steps
        # past the last one printed (hundreds of epochs' lines would flood the console).
        if not final and done - self._eval_printed >= self.steps / _EVAL_LINES:
            self._eval_printed = done
            tqdm.write(
                f"eval after step {done} (epoch {epoch:.2f}): held-out loss {loss:.3f}, "
                f"accuracy {100 * accuracy:.1f}% on {len(self.test_set)} images",
                file=self.log,
            )
        return loss, accuracy

    def _loop(self) -> None:
        self._start = time.perf_counter()
        bar = tqdm(
            total=self.steps,
            initial=self.start_step,
            disable=not self.config.progress,
            file=self.log,
            unit="step",
            leave=True,
        )
        # With checkpoints, Ctrl-C or SIGTERM (a laptop shutting down) finishes the step first
        # and checkpoints it, so nothing computed is lost.
        self._stop = StopAtStepBoundary(self.log) if self.checkpoints is not None else None
        try:
            with self._stop if self._stop is not None else contextlib.nullcontext():
                for step in range(self.start_step, self.steps):
                    record, images_per_second = self._step(step)
                    stopping = self._stop is not None and self._stop.signum is not None
                    target = self._write(step + 1, record, stopping)
                    bar.update(1)
                    bar.set_postfix(
                        loss=f"{self.totals.losses[-1]:.3f}",
                        acc=f"{np.mean(self.totals.recent_hits):.2f}",
                        img_s=f"{images_per_second:.0f}",
                        refresh=False,
                    )
                    if stopping and step + 1 < self.steps:  # at the last step the run is done
                        try:
                            model = self._save_model()
                        except OSError as e:  # the checkpoint holds the weights too
                            tqdm.write(f"saving the weights failed: {e}", file=self.log)
                            model = None
                        raise TrainingInterrupted(self._stop.signum, step + 1, target, model)
                    if eval_due(self, step + 1):
                        self._evaluate(step + 1, final=False)
        finally:
            bar.close()

    def _step(self, step: int) -> tuple[dict, float]:
        """One SGD step; returns its trace record and its images per second."""
        config, totals = self.config, self.totals
        epoch, position = divmod(step, self.steps_per_epoch)
        if position == 0 or step == self.start_step:
            self._order = epoch_order(len(self.train_set), config.seed, epoch)
        indices = self._order[position * config.batch : (position + 1) * config.batch]
        self.executor.begin_step(step)
        step_start = time.perf_counter()
        x, labels = self.train_set.batch(indices)
        loss, hits = self._forward_backward(x, labels, step)
        # A worker caught answering wrong values (a spot check) is out; what it answered
        # earlier in this step passed its checks but may be wrong where not sampled: again.
        while self.executor.redo_step():
            loss, hits = self._forward_backward(x, labels, step)
        if not math.isfinite(loss):
            raise FloatingPointError(
                f"loss became {loss} at step {step}; lower the learning rate (now {config.sgd.lr})"
            )
        self.optimizer.step(self.model.gradients())
        seconds = time.perf_counter() - step_start
        cluster = self.executor.end_step()
        handover = getattr(self.executor, "take_handover", lambda: None)()
        if handover is not None:  # the workers released or another split opened mid-run
            take_split(self, handover)
        comm, conv = cluster.pop("comm_seconds"), cluster.pop("conv_seconds")
        # The paper's terms: communication + convolution (slowest node) + the rest.
        comp = max(seconds - comm - conv, 0.0)
        totals.conv_seconds += conv
        self.steps_run += 1
        self.worker_steps += bool(cluster.get("workers_computed"))
        if step > 0 or self.steps == 1:
            totals.breakdown += (comm, conv, comp)
        totals.losses.append(loss)
        accuracy = float(hits.mean())
        totals.recent_hits = (totals.recent_hits + [accuracy])[-min(50, self.steps_per_epoch) :]
        record = {
            "step": step,
            "epoch": epoch,
            "loss": loss,
            "accuracy": accuracy,
            "batch": int(len(indices)),
            "seconds": seconds,
            "comm_seconds": comm,
            "conv_seconds": conv,
            "comp_seconds": comp,
            **cluster,
        }
        return record, len(indices) / seconds

    def _forward_backward(self, x, labels, step: int) -> tuple[float, np.ndarray]:
        """The loss and hits of the batch; the model's gradients are left in its layers
        (dropout masks follow ``step``, so a step computed again draws the same)."""
        done = self.executor.train_batch(self.model, x, labels, step)
        if done is not None:  # the executor ran the passes (split by images)
            return done
        loss, grad, hits = softmax_cross_entropy(self.model.forward(x, step=step), labels)
        self.model.backward(grad)
        return loss, hits

    def _write(self, done: int, record: dict, stopping: bool) -> Path | None:
        """Trace ``record``, the last of ``done`` steps, and write a checkpoint when one is due;
        returns its file (None for none, or when writing it failed)."""
        due = self.checkpoints is not None and (
            done % self.config.checkpoint_interval == 0 or done == self.steps or stopping
        )
        self.metrics.step(record)
        if not due:
            self.trace.write(record)
            return None
        # The trace record goes first: a crash before the checkpoint commits leaves records
        # past the latest checkpoint, which a resume cuts off; never a gap.
        target = self.checkpoints.file_for(done)
        record.update(event="checkpoint", checkpoint=os.fspath(target))
        self.trace.write(record)
        self.trace.sync()
        try:
            self.checkpoints.write(self._state(done))
        except OSError as e:
            # A full disk must not end the run: the previous checkpoint stays latest.
            record.update(event="checkpoint_failed", checkpoint_error=str(e))
            self.trace.replace_last(record)
            tqdm.write(f"checkpoint at step {done} failed: {e}", file=self.log)
            return None
        now = time.monotonic()
        if (
            done == self.steps
            or stopping
            or now - self._last_message >= _CHECKPOINT_MESSAGE_SECONDS
        ):
            tqdm.write(f"checkpoint written: {target}", file=self.log)
            self._last_message = now
        return target

    def _momentum(self) -> dict[str, np.ndarray]:
        """Every parameter's momentum buffer; resident slices gathered into the model first
        (so its weights are the whole truth too)."""
        self.executor.complete()  # the weights checked before they are kept
        momentum = self.optimizer.state()
        if self.resident:
            momentum.update(self.executor.gather_resident())
        return momentum

    def _state(self, done: int) -> TrainingState:
        """The state after ``done`` steps (the last of them just run)."""
        config, totals = self.config, self.totals
        momentum = self._momentum()
        epoch = (done - 1) // self.steps_per_epoch
        next_epoch, next_position = divmod(done, self.steps_per_epoch)
        next_order = (
            self._order
            if next_epoch == epoch
            else epoch_order(len(self.train_set), config.seed, next_epoch)
        )
        return TrainingState(
            step=done,
            epoch=next_epoch,
            position=next_position,
            seed=config.seed,
            steps_per_epoch=self.steps_per_epoch,
            order_sha256=order_digest(next_order),
            model=self.model.state(),
            momentum=momentum,
            losses=np.asarray(totals.losses, np.float64),
            recent_hits=np.asarray(totals.recent_hits, np.float64),
            breakdown=totals.breakdown,
            conv_seconds=totals.conv_seconds,
            train_seconds=self._elapsed(),
            fingerprint=self.fingerprint,
            environment=self.environment,
            description=self.description,
        )

    def _save_model(self) -> Path | None:
        """Write the weights to ``config.save``, if set; returns the file."""
        if not self.config.save:
            return None
        if self.resident:  # the workers' kernel slices into the model first
            self.executor.gather_resident()
        path = Path(self.config.save)
        path.parent.mkdir(parents=True, exist_ok=True)
        return written(path, lambda: self.model.save(path, self.description))

    def summary(self, seconds: float) -> TrainResult:
        """Save the weights if asked, and report (with the final evaluation's figures)."""
        config, totals, steps = self.config, self.totals, self.steps
        eval_loss = eval_accuracy = None
        if self.final_eval is not None:
            eval_loss, eval_accuracy = self.final_eval
        self._save_model()
        result = TrainResult(
            steps=steps,
            losses=totals.losses,
            train_accuracy=float(np.mean(totals.recent_hits)) if totals.recent_hits else 0.0,
            eval_accuracy=eval_accuracy,
            eval_loss=eval_loss,
            seconds=seconds,
            conv_seconds=totals.conv_seconds,
            images_per_second=steps * config.batch / seconds,
        )
        summarize(self, result)
        return result
