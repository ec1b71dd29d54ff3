"""Spot checks of the ring (:mod:`hetconv.ringcheck`, :mod:`hetconv.master.ringcheck`): the
sketches' arithmetic; real worker processes summing by the ring with spot checks on, training
as local training; a worker whose own gradient is wrong caught by a drawn check and lost; a
worker that changes what it passes on caught by the sum's check, every such step computed by
the master, still as local training."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from exactness import FAST, same_as_local, train_strong_lrn
from test_image_ring import Recording
from test_image_syncbn import CONV_BN
from test_image_syncbn import _train as train_spec
from test_spot_checks import lying_worker

from hetconv.conv import LocalConv
from hetconv.master.launch import LocalWorkers
from hetconv.master.spotcheck import SpotCheckConfig
from hetconv.ring import MASTER, RING
from hetconv.ringcheck import (
    SKETCH_BLOCK,
    SKETCHES,
    answered_seed,
    block_sums,
    sketch_answer,
    sketch_comparison,
    sketch_seed,
    sketches,
    sum_differs,
)

EVERY_STEP = SpotCheckConfig(every=1, ranges=2)  # every step, both workers' ranges

# -- the arithmetic -----------------------------------------------------------------------------


def _parts(rng, count=3, size=10_000):
    """Gradients of mixed scale and sign, and their float32 sum in order (as the ring's)."""
    parts = [(rng.standard_normal(size) * 10.0 ** rng.uniform(-3, 1, size)).astype(np.float32)
             for _ in range(count)]  # fmt: skip
    summed = parts[0].copy()
    for p in parts[1:]:
        summed += p
    return parts, summed


def test_block_sums_cover_every_value_the_last_block_short():
    v = np.arange(1000, dtype=np.float32)
    sums = block_sums(v)
    assert sums.dtype == np.float64 and sums.size == -(-1000 // SKETCH_BLOCK)
    assert sums.sum() == v.sum(dtype=np.float64)
    assert sums[-1] == v[3 * SKETCH_BLOCK :].sum(dtype=np.float64)


def test_the_seed_is_the_sums_and_the_sketches_are_linear():
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal(3000).astype(np.float32) for _ in range(2))
    assert sketch_seed(a) == sketch_seed(a.copy())
    changed = a.copy()
    changed[-1] = np.nextafter(changed[-1], np.float32(np.inf))
    assert sketch_seed(changed) != sketch_seed(a)  # one value, one unit in the last place
    seed = sketch_seed(a)
    assert sketches(a, seed).shape == (SKETCHES,)
    both = sketches(a + b, seed)  # float32's round-off: 3000 values of about 1
    np.testing.assert_allclose(sketches(a, seed) + sketches(b, seed), both, atol=3000 * 2e-7)


def test_sketches_of_every_contribution_add_up_to_the_sums_and_a_changed_one_does_not():
    rng = np.random.default_rng(1)
    parts, summed = _parts(rng)
    differs, worst, allowed = sum_differs(summed, [sketch_answer(p, summed) for p in parts])
    assert not differs and worst <= allowed
    # a part of the sum changed on its way (one block's values of one contribution x 1.5)
    passed = summed.copy()
    passed[:SKETCH_BLOCK] += np.float32(0.5) * parts[1][:SKETCH_BLOCK]
    assert sum_differs(passed, [sketch_answer(p, passed) for p in parts])[0]
    # a worker that sketches something else than what it put in
    other = [sketch_answer(p, summed) for p in parts]
    other[2] = sketch_answer(parts[2] * np.float32(1.01), summed)
    assert sum_differs(summed, other)[0]
    # the seed given (the master takes the sum's digest once) is the seed taken
    seed = sketch_seed(summed)
    for p in parts:
        np.testing.assert_array_equal(sketch_answer(p, summed, seed), sketch_answer(p, summed))
    assert sum_differs(summed, other, seed) == sum_differs(summed, other)
    assert sum_differs(passed, [sketch_answer(p, passed) for p in parts], sketch_seed(passed))[0]


def test_a_recomputation_agrees_within_round_off_and_a_wrong_gradient_does_not():
    rng = np.random.default_rng(2)
    parts, summed = _parts(rng, 2, 50_000)
    mine = parts[0]
    assert answered_seed(sketch_answer(mine, summed)) == sketch_seed(summed)
    recomputed = (mine * (1 + 1e-6 * rng.standard_normal(mine.size))).astype(np.float32)
    got, want, scale = sketch_comparison(sketch_answer(mine, summed), recomputed)
    assert np.linalg.norm(got - want) / scale < 1e-5
    for wrong in (mine * np.float32(1.5), np.roll(mine, 1), mine * np.float32(1.05)):
        got, want, scale = sketch_comparison(sketch_answer(wrong, summed), mine)
        assert _sketches_fail(got, want, scale), wrong
    # an honest worker on another engine: a percent or two across the gradient (batch norm
    # carries a ReLU round-off turned into every image's gradient), a little along it
    got, want, scale = sketch_comparison(sketch_answer(mine, summed), mine)
    across = rng.standard_normal(got.size)
    across -= (across @ want) / (want @ want) * want
    noisy = want * 1.005 + 0.02 * scale * across / np.linalg.norm(across)
    assert not _sketches_fail(noisy, want, scale)
    assert _sketches_fail(np.full_like(want, np.nan), want, scale)
    assert _sketches_fail(got, np.zeros_like(want), scale)
    assert not _sketches_fail(np.zeros_like(want), np.zeros_like(want), scale)


def _sketches_fail(got, want, scale) -> bool:
    """Whether the ring check's comparisons of sketches ``got`` against ``want`` fail."""
    from hetconv.master.ringcheck import sketch_comparisons
    from hetconv.master.spotcompare import relative_error

    return any(not relative_error(c)[0] <= c.rtol for c in sketch_comparisons(got, want, scale))


# -- real worker processes ----------------------------------------------------------------------


def _checked(addresses, **config):
    config = {**FAST, "spot_checks": EVERY_STEP, **config}
    return Recording(addresses, deterministic=True, **config)


def test_the_ring_with_spot_checks_every_step_trains_as_local_training(tmp_path):
    local = train_strong_lrn(tmp_path, "local", LocalConv())
    with LocalWorkers(2) as workers, _checked(workers.addresses) as cluster:
        got = train_strong_lrn(tmp_path, "ring", cluster)
        events = list(cluster.events)
    same_as_local(got, local)
    assert all(r["exchange"] == RING for r in cluster.steps)
    for record in cluster.steps:  # both workers drawn (ranges=2), each step
        assert set(record["spot_checks"]["workers"]) == set(workers.addresses)
        assert record["spot_checks"]["workers"][workers.addresses[0]]["worst"] < 1e-3
    assert not [e for e in events if e["event"] in ("worker_lost", "ring_sum_differs")]


def test_a_network_with_batch_norm_checked_every_step_trains_as_local_training(tmp_path):
    """The drawn workers' ranges recomputed with the whole batch's sums (from the answers),
    during the next step: their sketches agree, and the running statistics stay those of one
    pass (the weight file holds them)."""
    local = train_spec(tmp_path, "local", LocalConv(), CONV_BN)
    with LocalWorkers(2) as workers:
        cluster = _checked(workers.addresses)
        got = train_spec(tmp_path, "ring", cluster, CONV_BN)
    same_as_local(got, local)
    assert all(r["exchange"] == RING and "master" not in r["images"] for r in cluster.steps)
    # Each step's check runs during the next (in its record), or before an evaluation (at
    # each epoch's end, 6 steps here: in no step's record) and at the end.
    checked = [i for i, r in enumerate(cluster.steps) if "spot_checks" in r]
    assert checked == [i for i in range(1, len(cluster.steps)) if i % 6 != 0]
    assert all(len(cluster.steps[i]["spot_checks"]["workers"]) == 2 for i in checked)
    assert not [e for e in cluster.events if e["event"] in ("worker_lost", "ring_sum_differs")]


def test_a_worker_whose_own_gradient_is_wrong_is_caught_and_lost(tmp_path):
    """From step 3 the liar puts 1.5x its gradient into the ring, its sketches of that true to
    it: the sketches add up, and the drawn check (every step) recomputes its range and finds
    it off. The step's sum is refused: the master computes it (the same weights), the liar is
    lost for the run, and training equals local training."""
    local = train_strong_lrn(tmp_path, "local", LocalConv())
    with LocalWorkers(1) as workers, lying_worker("ring_own", 3) as liar:
        with _checked([*workers.addresses, liar]) as cluster:
            got = train_strong_lrn(tmp_path, "ring", cluster)
            events = list(cluster.events)
    same_as_local(got, local)
    lost = [e for e in events if e["event"] == "worker_lost"]
    assert [(e["worker"], e["step"]) for e in lost] == [(liar, 3)]
    assert "spot check failed: the scale of the sketches of its own gradient" in lost[0]["reason"]
    assert not [e for e in events if e["event"] == "ring_sum_differs"]
    assert [r["exchange"] for r in cluster.steps[:4]] == [RING, RING, RING, MASTER]
    assert all(liar not in r["nodes"] for r in cluster.steps[4:])


@pytest.mark.slow
@pytest.mark.parametrize("every", [1, 1000])
def test_a_worker_that_changes_what_it_passes_on_breaks_the_sum_every_step(tmp_path, every):
    """From step 2 the liar takes 1.5x every part its peer puts into it: its own gradient and
    sketches are right, but the sum is not theirs. Every such step (drawn for a check or not:
    ``every`` 1000 draws only step 0) the sum's check refuses it and the master computes the
    step; no worker's range differs from its recomputation, so none is lost, and the event
    says so. Training equals local training."""
    local = train_strong_lrn(tmp_path, "local", LocalConv())
    checks = SpotCheckConfig(every=every, ranges=2, unpredictable=False)
    with LocalWorkers(1) as workers, lying_worker("ring_pass", 2) as liar:
        with _checked([*workers.addresses, liar], spot_checks=checks) as cluster:
            got = train_strong_lrn(tmp_path, "ring", cluster)
            events = list(cluster.events)
    same_as_local(got, local)
    differs = [e["step"] for e in events if e["event"] == "ring_sum_differs"]
    assert differs == list(range(2, len(cluster.steps)))
    assert [r["exchange"] for r in cluster.steps] == [RING, RING] + [MASTER] * (
        len(cluster.steps) - 2
    )
    assert not [e for e in events if e["event"] == "worker_lost"]


@pytest.mark.parametrize("kind", ["ring_own", "ring_bn"])
def test_with_batch_norm_a_lying_worker_is_caught_and_lost(tmp_path, kind):
    """A network with batch norm, the liar lying from step 3.

    ``ring_bn`` normalises by wrong statistics (1.5x every part of batch norm's sums it
    takes): the totals it took are not the sums of the parts, so step 3's sum is refused at
    once, every range recomputed, and its sketches differ: lost at step 3, the master
    computing that step's whole batch.

    ``ring_own`` puts 1.5x its gradient in, and everything adds up: the drawn check (its
    range recomputed with the whole batch's sums) runs during step 4, while the workers
    compute. It is lost at step 4; the master's copy goes back to step 3's weights, computes
    step 3 and then step 4 itself (the workers' step 4 started from the refused sum's).

    Either way training equals local training."""
    local = train_spec(tmp_path, "local", LocalConv(), CONV_BN)
    with LocalWorkers(1) as workers, lying_worker(kind, 3) as liar:
        cluster = _checked([*workers.addresses, liar])
        got = train_spec(tmp_path, "ring", cluster, CONV_BN)
    same_as_local(got, local)
    at = 3 if kind == "ring_bn" else 4
    lost = [e for e in cluster.events if e["event"] == "worker_lost"]
    assert [(e["worker"], e["step"]) for e in lost] == [(liar, at)]
    differs = [e for e in cluster.events if e["event"] == "ring_sum_differs"]
    recomputed = [e for e in cluster.events if e["event"] == "step_recomputed"]
    if kind == "ring_bn":
        assert [e["step"] for e in differs] == [3] and not recomputed
        assert "batch norm sums that are not the sums" in differs[0]["why"]
    else:
        assert not differs and [(e["step"], e["recomputed"]) for e in recomputed] == [(4, 3)]
    assert [r["exchange"] for r in cluster.steps[: at + 1]] == [RING] * at + [MASTER]


@pytest.mark.slow
def test_an_honest_worker_on_another_engine_passes_every_check_with_batch_norm(tmp_path):
    """resnet20's batch norm carries a ReLU that round-off turned the other way into every
    image's gradient: a worker on numpy's engine, checked every step against the master's
    onednn, was off by 0.2-1.7 % of the sketches' scale and lost at its 9th check under a 1 %
    norm tolerance (an honest cuda worker on an H200 at its 3rd). Across the gradient, not
    along it: it passes the scaling-and-rest comparison; a 1.05x liar does not (above)."""
    import io

    from hetconv.backends import get_backend
    from hetconv.master.cluster import ClusterConfig
    from hetconv.master.ring import image_split_class
    from hetconv.training import TrainConfig, train

    try:
        get_backend("onednn")
    except Exception as e:  # noqa: BLE001 - where it does not load, both engines are numpy's
        pytest.skip(f"the onednn engine does not load here: {e}")
    config = ClusterConfig(**FAST, spot_checks=EVERY_STEP)
    trace = tmp_path / "trace.jsonl"
    run = TrainConfig(preset="resnet20", batch=64, steps=12, train_size=2560, eval_size=64,
                      progress=False, trace=str(trace))  # fmt: skip
    with LocalWorkers(1, backend="cpu") as workers:
        with image_split_class(RING)(workers.addresses, "onednn", config) as cluster:
            train(run, cluster, log=io.StringIO())
            lost = [e for e in cluster.events if e["event"] == "worker_lost"]
    assert lost == [], lost[0]["reason"]
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    checked = [r["spot_checks"] for r in records if r.get("spot_checks")]
    assert len(checked) >= 11, checked  # every step's range, each checked during the next


def test_what_the_checks_cost_a_step_is_what_passes_the_workers_step():
    from hetconv.master.ringcheck import check_seconds

    checks = SpotCheckConfig(ranges=2)  # every 4th step on average, 2 workers drawn
    # 2 ranges of a quarter of the batch: 0.2 s of the master's, hidden by a 0.3 s step
    assert check_seconds(checks, 0.4, 4, 0.3) == 0.0
    assert check_seconds(checks, 0.4, 4, 0.15) == pytest.approx((0.2 - 0.15) / 4)
    assert check_seconds(checks, 0.4, 1, 0.3) == pytest.approx((0.4 - 0.3) / 4)  # one to draw
    assert check_seconds(SpotCheckConfig(), 0.4, 4, 0.05) == pytest.approx((0.1 - 0.05) / 4)
    assert check_seconds(SpotCheckConfig(every=0), 0.4, 4, 0.0) == 0.0


def test_the_master_exchanges_checks_count_whole_in_the_image_split_prediction():
    # The master exchange recomputes a drawn range after the answers (nothing hides it): its
    # predicted step takes the whole check one step in `every`; the ring's only what passes
    # the workers' step (above).
    from hetconv.costmodel import SimCluster, SimNode
    from hetconv.imagecost import simulate_image_split
    from hetconv.master.records import image_split_steps
    from hetconv.model import reference_spec
    from hetconv.ringcheck import check_pass_seconds

    node = dict(gflops=20.0, bytes_per_s=125e6, rtt_s=1e-4)
    cluster = SimCluster(SimNode("master", **node), (SimNode("w0", **node),),
                         master_compute=False)  # fmt: skip
    spec = reference_spec(50, 500)
    plain = image_split_steps(cluster, spec, 16, 0.0)
    checked = image_split_steps(cluster, spec, 16, 0.0, SpotCheckConfig(), alone_s=2.0)
    assert checked["master"] == pytest.approx(plain["master"] + 2.0 / 4)
    # the ring's: every step the worker's sketch and the master's check of the sum (a pass
    # over the gradient each), and the drawn range's recomputation beyond the workers' step
    nbytes = simulate_image_split(cluster, spec, 16, 0.0, exchange="ring").gradient_bytes
    passes = 2 * check_pass_seconds(nbytes)
    assert passes > 0
    assert checked["ring"] == pytest.approx(
        plain["ring"] + passes + max(0.0, 2.0 - plain["ring"]) / 4
    )


def test_the_simulated_ring_weighs_the_checks_after_the_masters_range_as_the_master_does():
    """Where the master may compute a range, the simulator prices each way with the checks
    (:func:`hetconv.ring.master_range_pays`' ``check``): after its own range the drawn
    ranges' recomputation runs beside the ring past the passes, and its own part takes a
    pass more; a check that costs the master's range its gain leaves it out."""
    from hetconv.costmodel import SimCluster, SimNode
    from hetconv.imagecost import simulate_image_split
    from hetconv.model import reference_spec
    from hetconv.ringcheck import check_pass_seconds

    node = dict(gflops=20.0, bytes_per_s=1e9, rtt_s=1e-4)
    workers = tuple(SimNode(f"w{i}", **node) for i in range(4))
    cluster = SimCluster(SimNode("master", **node), workers)
    spec, batch = reference_spec(150, 800), 64
    plain = simulate_image_split(cluster, spec, batch, 0.0, exchange="ring")
    assert plain.batches[0] > 0  # fast links: the master's range pays unchecked
    pass_s = check_pass_seconds(plain.gradient_bytes)
    asked = []

    def free(images, beside_s):
        asked.append((images, beside_s))
        return 0.0

    got = simulate_image_split(cluster, spec, batch, 0.0, exchange="ring", check=free)
    assert got.batches == plain.batches and got.step_s == pytest.approx(plain.step_s + 3 * pass_s)
    assert (batch - plain.batches[0], plain.comm_s) in asked  # beside the ring past the passes

    def dear_after_its_range(images, beside_s):
        return 1.0 if images < batch else 0.0

    got = simulate_image_split(cluster, spec, batch, 0.0, exchange="ring",
                               check=dear_after_its_range)  # fmt: skip
    alone = simulate_image_split(replace(cluster, master_compute=False), spec, batch, 0.0,
                                 exchange="ring")  # fmt: skip
    assert got.batches[0] == 0 and got.step_s == pytest.approx(alone.step_s + 2 * pass_s)
