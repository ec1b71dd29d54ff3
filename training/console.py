"""What a training run says on its console: what is about to run (:func:`announce`) and,
at the end, what it did against what was predicted (:func:`summarize`).

The verdict compares a cluster's step with the master alone's as timed after the run (the same
network and batch, trained as ``--local`` trains them); the prediction before the run is the
master's probe, labelled so. A run in which no worker computed is the master alone: no ratio.
Workers on the master's machine compete with it for its cores, and the lines say so.
"""

from __future__ import annotations

import os

from .config import TrainResult


def announce(run) -> None:
    """Say what is about to run and, on a resume, from where (``run``: the loop's
    :class:`~hetconv.training.loop._Run`)."""
    config, log = run.config, run.log
    what = f"{len(run.train_set)} images, {len(run.test_set)} held out"
    if run.data.kind != "synthetic":
        train = run.train_set
        what = (
            f"{len(train)} images of {'x'.join(map(str, train.image_shape))}, "
            f"{train.num_classes} classes; {len(run.test_set)} held out: "
            f"{run.data.held_out_from}"
        )
        if run.data.kind != config.dataset:
            what += f"; {run.data.kind} inferred from the path"
    source = run.data.kind if run.data.kind == "synthetic" else config.data_dir
    print(
        f"training {config.preset} on {source} ({what}): {run.steps} steps of batch {config.batch}",
        file=log,
    )
    if config.run_dir is not None:
        print(f"run folder: {config.run_dir}", file=log)
    if run.loaded_from is not None:
        print(f"starting from the weights of {run.loaded_from}", file=log)
    if run.prediction is not None:
        print(_predicted(run.prediction), file=log)
    if note := _this_machine(run.plan, now=True):
        print(note, file=log)
    if run.resumed is None:
        return
    state, path = run.resumed
    print(f"resumed from step {run.start_step} (checkpoint {path})", file=log)
    changed = [
        f"{key} {state.environment.get(key)} there, {value} here"
        for key, value in run.environment.items()
        if state.environment.get(key) != value
    ]
    if changed:
        print(
            f"note: {'; '.join(changed)}: the result can differ from an uninterrupted "
            "run by float32 round-off",
            file=log,
        )


def summarize(run, result: TrainResult) -> None:
    """Report the run's ``result``: speed, loss, held-out accuracy, the step's breakdown and
    the measured speedup against the predicted one."""
    config, log, totals, steps = run.config, run.log, run.totals, run.steps
    seconds, eval_accuracy = result.seconds, result.eval_accuracy
    summary = (
        f"done: {steps} steps in {seconds:.1f} s ({result.images_per_second:.0f} images/s, "
        f"convolutions {100 * totals.conv_seconds / seconds:.0f}% of the time); "
        f"final loss {totals.losses[-1]:.3f}"
    )
    if eval_accuracy is not None:
        summary += (
            f"; held-out accuracy {100 * eval_accuracy:.1f}% on {len(run.test_set)} "
            f"images (chance {100 / run.train_set.num_classes:.0f}%)"
        )
    print(summary, file=log)
    timed = max(steps - 1, 1)
    comm, conv, comp = 1e3 * totals.breakdown / timed
    print(
        f"per step (mean of {timed}): communication {comm:.1f} ms, convolution "
        f"(slowest node) {conv:.1f} ms, other computation {comp:.1f} ms",
        file=log,
    )
    if run.executor.distributed and run.steps_run and totals.breakdown.sum() > 0:
        step = totals.breakdown.sum() / timed  # the mean step after the first
        print(verdict(run, step), file=log)
        if run.worker_steps and (note := _this_machine(run.plan, now=False)):
            print(note, file=log)
    if config.save:
        print(f"weights saved to {os.fspath(config.save)}", file=log)


def verdict(run, step: float) -> str:
    """The measured step (``step`` seconds) against the master alone's as timed after the run
    (``run.alone_seconds``), and against the prediction; a run in which no worker computed
    is said to be the master alone, with no ratio (it would compare the master with itself)."""
    if not run.worker_steps:
        return (
            f"measured: {_seconds(step)} per step, but no worker computed in any of the "
            f"{run.steps_run} steps run here (every worker lost, or given no kernels): the run "
            "was the master alone, so there is no speedup to report"
        )
    alone = run.alone_seconds
    ratio = alone / step
    way = "faster than" if ratio >= 1 else "slower than"
    line = (
        f"measured: {_seconds(step)} per step, {ratio:.2f}x the master alone: {way} it "
        f"({_seconds(alone)} per step, timed after the run: {run.alone_steps} steps of the same "
        f"network and batch trained as --local trains them"
    )
    p = run.prediction
    if p is not None and p.get("workers", 1):
        line += f"; predicted {p['speedup']:.2f}x, estimated from the master's probe"
    line += ")"
    if run.worker_steps < run.steps_run:
        line += f"; workers computed in {run.worker_steps} of the {run.steps_run} steps"
    return line


def _predicted(p: dict) -> str:
    """The start's line: the cost model's step against the master alone's, as estimated
    from its probe; none to compare when no worker was reached."""
    if not p.get("workers", 1):
        return (
            f"predicted: {_seconds(p['step_s'])} per step: no worker reached yet, so the "
            "master alone (nothing to compare it with until one joins)"
        )
    kept = f"shares: {p['kept']}\n" if p.get("kept") else ""
    return kept + (
        f"predicted: {_seconds(p['step_s'])} per step, {p['speedup']:.2f}x the master "
        f"alone (estimated from its probe: {_seconds(p['alone_s'])}, every layer and the "
        "rest of its step)" + _peer(p)
    )


def _this_machine(plan: dict | None, now: bool) -> str:
    """A note when workers run on the master's machine (the plan's ``this_machine``): they
    compete with it for its cores, so the figures are not what separate machines give."""
    here = (plan or {}).get("this_machine") or []
    if not here:
        return ""
    workers = len(plan.get("nodes", [])) - 1
    who = (
        f"every worker {'runs' if now else 'ran'} on this machine"
        if len(here) >= workers
        else f"{len(here)} of the {workers} workers {'run' if now else 'ran'} on this machine"
    )
    return (
        f"note: {who} ({', '.join(here)}), competing with the master for its cores: the "
        "speedup is not what separate machines would give (`hetconv plan` predicts them)"
    )


def _seconds(value: float) -> str:
    return f"{value:.2f} s" if value >= 1 else f"{1e3 * value:.0f} ms"


def _peer(prediction: dict) -> str:
    """The data-parallel peer's predicted step, when there is one, as a clause."""
    peer = prediction.get("data_parallel_s")
    if peer is None:
        return ""
    faster = "faster" if peer < prediction["step_s"] else "slower"
    return (
        f"; plain data parallelism on the same nodes: {_seconds(peer)}, "
        f"{prediction['alone_s'] / peer:.2f}x ({faster}; `hetconv plan` compares every way)"
    )
