"""What a training run says on its console: what is about to run (:func:`announce`) and,
at the end, what it did against what was predicted (:func:`summarize`)."""

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
        p = run.prediction
        print(
            f"predicted: {_seconds(p['step_s'])} per step, {p['speedup']:.2f}x the master "
            f"alone ({_seconds(p['alone_s'])}: its own probe of every layer and the rest of "
            "its step)" + _peer(p),
            file=log,
        )
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
    if run.prediction is not None and totals.breakdown.sum() > 0:
        step = totals.breakdown.sum() / timed  # the mean step after the first
        alone = run.prediction["alone_s"]
        print(
            f"measured: {_seconds(step)} per step, {alone / step:.2f}x the master alone "
            f"({_seconds(alone)}, from its own measured speed; predicted "
            f"{run.prediction['speedup']:.2f}x)",
            file=log,
        )
    if config.save:
        print(f"weights saved to {os.fspath(config.save)}", file=log)


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
