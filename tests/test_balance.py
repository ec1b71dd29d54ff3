"""Tests for hetconv.balance: largest-remainder kernel shares and their offsets; and the rule
that moves shares with measured speed (hetconv.master.rebalancing) without starving a worker."""

from __future__ import annotations

import math
import threading
from fractions import Fraction

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from hetconv.backends import ConvShape, Padding
from hetconv.balance import kernel_shares, offsets
from hetconv.master.events import EventLog
from hetconv.master.membership import LOST, MASTER, Membership, Node
from hetconv.master.planning import PlannedLayer, Planner
from hetconv.master.rebalancing import MOST_DRIFT, DriftMonitor, IdleProbes, replan_reason
from hetconv.master.settling import SettleMonitor

# Probe times over a range far wider than any real device's (a nanosecond to decades); the
# extremes of the float range are covered by test_extreme_but_positive_finite_times.
_times = st.floats(min_value=1e-9, max_value=1e9, allow_nan=False, allow_infinity=False)
_kernels = st.integers(0, 5000)


def _exact_quotas(kernels: int, probe_seconds) -> list[Fraction]:
    """Each device's exact share ``kernels * (1/t_i) / sum_j (1/t_j)``, infinite t counting 0."""
    speeds = [Fraction(0) if math.isinf(t) else 1 / Fraction(t) for t in probe_seconds]
    total = sum(speeds)
    return [kernels * s / total for s in speeds]


@settings(max_examples=300, deadline=None)
@given(kernels=_kernels, times=st.lists(_times, min_size=1, max_size=40))
def test_shares_sum_to_kernels_and_are_non_negative(kernels, times):
    shares = kernel_shares(kernels, times)
    assert len(shares) == len(times)
    assert all(type(s) is int for s in shares)
    assert all(s >= 0 for s in shares)
    assert sum(shares) == kernels


@settings(max_examples=300, deadline=None)
@given(kernels=_kernels, times=st.lists(_times, min_size=1, max_size=40))
def test_shares_are_within_one_kernel_of_the_exact_quota(kernels, times):
    shares = kernel_shares(kernels, times)
    quotas = _exact_quotas(kernels, times)
    tolerance = 1e-9 * max(1, kernels)  # the float quotas versus these exact ones
    for share, quota in zip(shares, quotas, strict=True):
        assert abs(share - quota) < 1 + tolerance, (share, float(quota))


@settings(max_examples=300, deadline=None)
@given(kernels=_kernels, times=st.lists(_times, min_size=1, max_size=40))
def test_extra_kernels_go_to_the_largest_remainders(kernels, times):
    """Largest remainder: whoever was rounded up had a remainder >= anyone rounded down."""
    shares = kernel_shares(kernels, times)
    quotas = _exact_quotas(kernels, times)
    up = [q - math.floor(q) for s, q in zip(shares, quotas, strict=True) if s > q]
    down = [q - math.floor(q) for s, q in zip(shares, quotas, strict=True) if s <= q]
    if up and down:
        assert min(up) >= max(down) - Fraction(1, 10**9), (shares, [float(q) for q in quotas])


@pytest.mark.parametrize(
    ("kernels", "times", "expected"),
    [
        (64, [1.0, 1.0], [32, 32]),
        (64, [1.0, 3.0], [48, 16]),
        (64, [2.0, 1.0, 1.0], [13, 26, 25]),  # quotas 12.8, 25.6, 25.6: the earlier tie wins
        (10, [1.0, 2.0, 4.0], [6, 3, 1]),  # quotas 5.71, 2.86, 1.43
        (7, [1.0], [7]),
        (100, [0.001, 1000.0], [100, 0]),  # too slow to earn a single kernel
    ],
)
def test_known_shares(kernels, times, expected):
    assert kernel_shares(kernels, times) == expected


def test_more_devices_than_kernels():
    shares = kernel_shares(3, [1.0] * 8)
    assert shares == [1, 1, 1, 0, 0, 0, 0, 0]
    shares = kernel_shares(2, [5.0, 1.0, 2.0, 3.0, 4.0])
    assert shares == [0, 1, 1, 0, 0]  # the two fastest


def test_zero_kernels_give_every_device_zero():
    assert kernel_shares(0, [1.0, 0.5, math.inf]) == [0, 0, 0]


@settings(max_examples=200, deadline=None)
@given(kernels=_kernels, n=st.integers(1, 40), t=_times)
def test_equal_times_give_shares_differing_by_at_most_one(kernels, n, t):
    shares = kernel_shares(kernels, [t] * n)
    assert max(shares) - min(shares) <= 1
    assert sum(shares) == kernels
    # The remainder goes to the earliest devices.
    assert shares == sorted(shares, reverse=True)


@pytest.mark.parametrize(
    ("kernels", "times", "expected"),
    [
        (10, [1.0, math.inf, 1.0], [5, 0, 5]),
        (3, [math.inf, 1.0, 1.0], [0, 2, 1]),
        (1, [math.inf, 100.0], [0, 1]),
        (5, [math.inf, math.inf, 2.0], [0, 0, 5]),
    ],
)
def test_infinite_time_excludes_a_device(kernels, times, expected):
    assert kernel_shares(kernels, times) == expected


@settings(max_examples=200, deadline=None)
@given(
    kernels=_kernels,
    times=st.lists(st.one_of(_times, st.just(math.inf)), min_size=1, max_size=40),
)
def test_excluded_devices_never_get_kernels(kernels, times):
    assume(not all(math.isinf(t) for t in times))
    shares = kernel_shares(kernels, times)
    assert sum(shares) == kernels
    assert all(s == 0 for s, t in zip(shares, times, strict=True) if math.isinf(t))


@pytest.mark.parametrize(
    ("kernels", "times", "match"),
    [
        (4, [math.inf], "every device is excluded"),
        (4, [math.inf, math.inf], "every device is excluded"),
        (4, [1.0, 0.0], "device 1 is 0.0; it must be positive"),
        (4, [1.0, -0.0], "device 1 is -0.0"),
        (4, [-1.0, 1.0], "device 0 is -1.0; it must be positive"),
        (4, [1.0, 2.0, math.nan], "device 2 is nan"),
        (4, [-math.inf, 1.0], "device 0 is -inf"),
        (4, [], "no devices"),
        (-1, [1.0], "kernel count must be >= 0, got -1"),
        (0, [1.0, 0.0], "device 1 is 0.0"),  # checked even when there is nothing to share
    ],
)
def test_invalid_input_raises_value_error(kernels, times, match):
    with pytest.raises(ValueError, match=match):
        kernel_shares(kernels, times)


@pytest.mark.parametrize(
    ("kernels", "times", "expected"),
    [
        # Equal remainders (0.5 and 0.5), different speeds: the faster device wins, even later.
        # (Times exactly representable in binary: shares are computed exactly.)
        (2, [3.0, 1.0], [0, 2]),
        (2, [1.0, 3.0], [2, 0]),
        # Equal remainders and speeds: the earlier device wins.
        (1, [1.0, 1.0], [1, 0]),
        (3, [4.0, 4.0, 4.0, 4.0], [1, 1, 1, 0]),
        # Remainders 0.5, 0.5, 0 (speeds 1, 3, 4): the faster of the tied pair wins.
        (4, [1.0, 1.0 / 3.0, 0.25], [0, 2, 2]),
    ],
)
def test_tie_break_prefers_the_faster_then_the_earlier_device(kernels, times, expected):
    assert kernel_shares(kernels, times) == expected
    assert kernel_shares(kernels, list(times)) == expected  # deterministic


def test_shares_do_not_depend_on_the_sequence_type():
    times = (1.0, 2.5, 0.7, 3.0)
    assert kernel_shares(37, times) == kernel_shares(37, list(times))


@pytest.mark.parametrize(
    ("kernels", "times", "expected"),
    [
        (10, [5e-324], [10]),
        (5000, [1e-306], [5000]),
        (10, [1e-308, 1e-308], [5, 5]),
    ],
)
def test_extreme_but_positive_finite_times(kernels, times, expected):
    assert kernel_shares(kernels, times) == expected


# -- offsets ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shares", "expected"),
    [
        ([], []),
        ([5], [0]),
        ([3, 0, 2, 5], [0, 3, 3, 5]),
        ([0, 0, 4], [0, 0, 0]),
    ],
)
def test_offsets_known(shares, expected):
    assert offsets(shares) == expected


@settings(max_examples=100, deadline=None)
@given(kernels=_kernels, times=st.lists(_times, min_size=1, max_size=40))
def test_offsets_are_the_running_sum_of_shares(kernels, times):
    shares = kernel_shares(kernels, times)
    starts = offsets(shares)
    assert len(starts) == len(shares)
    assert starts == [sum(shares[:i]) for i in range(len(shares))]
    assert starts[-1] + shares[-1] == kernels
    # The slices tile range(kernels) exactly.
    covered = [k for first, n in zip(starts, shares, strict=True) for k in range(first, first + n)]
    assert covered == list(range(kernels))


# -- shares that follow measured speed: no worker starved for good ------------------------------


class _Answers:
    """A worker's client stand-in: the planner needs only that it is not the master."""

    def close(self) -> None:
        pass


def _cluster_nodes(worker_seconds: float = 0.01) -> list[Node]:
    return [
        Node(MASTER, None, probe_seconds={"conv1": 0.01}),
        Node("10.0.0.2:50051", _Answers(), probe_seconds={"conv1": worker_seconds}),
    ]


_LAYER = PlannedLayer("conv1", ConvShape(8, 3, 8, 8, 16, 3, 3, Padding(1, 1, 1, 1)), False)


def _plans(nodes: list[Node]) -> dict:
    return Planner(master_compute=True).plan(nodes, [_LAYER], everyone_active=True)


def _observe(monitor: DriftMonitor, node: Node, seconds: float) -> None:
    phases = {"forward": {"compute_seconds": seconds}, "backward": {"compute_seconds": 0.0}}
    monitor.observe({node.name: {"conv1": phases}}, any_failed=False)


def _baseline(monitor: DriftMonitor, node: Node, seconds: float = 0.01) -> None:
    for _ in range(1 + monitor.every):  # the first step warms up, then the baseline's period
        _observe(monitor, node, seconds)
    assert monitor.drifted([node]) == ""


def test_one_slow_step_neither_moves_a_figure_nor_zeroes_a_worker():
    nodes = _cluster_nodes()
    worker = nodes[1]
    monitor = DriftMonitor(every=4, change=0.3)
    _baseline(monitor, worker)
    for seconds in (0.01, 0.5, 0.01, 0.01):  # one step 50x slower (the machine was busy)
        _observe(monitor, worker, seconds)
    assert monitor.drifted(nodes) == ""
    assert worker.probe_seconds["conv1"] == 0.01
    assert _plans(nodes)["conv1"].shares == (8, 8)


def test_one_check_moves_a_figure_by_a_bounded_factor():
    nodes = _cluster_nodes()
    worker = nodes[1]
    monitor = DriftMonitor(every=4, change=0.3)
    _baseline(monitor, worker)
    for _ in range(4):  # 50x slower for a whole period
        _observe(monitor, worker, 0.5)
    said = monitor.drifted(nodes)
    assert said.startswith("10.0.0.2:50051 50.0x slower"), said
    assert f"moved {MOST_DRIFT:.0f}x, the most one check may" in said
    assert worker.probe_seconds["conv1"] == pytest.approx(0.01 * MOST_DRIFT)
    assert _plans(nodes)["conv1"].shares[1] > 0  # fewer kernels, but not none


def _idle_probes(nodes: list[Node], probe, every: int = 2):
    events = EventLog()
    membership = Membership(
        nodes, fixed={n.name for n in nodes[1:]}, events=events, make_client=None,
        reconnect=None, retry_min=1.0, retry_max=2.0,
    )  # fmt: skip
    return IdleProbes(every, probe, membership, events), events


def _step(idle: IdleProbes, drift: DriftMonitor, nodes, plans, step: int):
    """A step boundary as the cluster takes it: finished probes, a re-plan if one is due, then
    the step's end; returns (the plans, why they were made again or None, the record's idle)."""
    reason = replan_reason(False, drift, SettleMonitor(0), nodes, plans, step, idle)
    if reason is not None:
        plans = _plans(nodes)
    return plans, reason, idle.watch(step, plans)


def _settle(idle: IdleProbes) -> None:
    """Wait for the probes in flight (they run on threads of their own)."""
    for _, call in list(idle._calls.values()):
        call.notify(done := threading.Event())
        assert done.wait(10)


def test_a_worker_with_no_share_is_probed_again_and_earns_work_back():
    nodes = _cluster_nodes(worker_seconds=1e4)  # as if its figures had drifted far up
    worker = nodes[1]
    probed = []

    def probe(node):
        probed.append(node.name)
        return {"conv1": 0.01}  # it is as fast as the master again

    idle, events = _idle_probes(nodes, probe, every=2)
    drift = DriftMonitor(every=2, change=0.3)
    plans = _plans(nodes)
    assert plans["conv1"].shares == (16, 0)
    plans, reason, record = _step(idle, drift, nodes, plans, 0)
    assert (reason, record) == (None, {"idle": [worker.name]})
    assert [e["event"] for e in events.events] == ["worker_idle"]
    assert "no kernel of any layer; probed again after step 2" in events.events[0]["reason"]
    plans, reason, record = _step(idle, drift, nodes, plans, 1)
    assert not probed  # not yet: it fell idle at step 0
    plans, reason, record = _step(idle, drift, nodes, plans, 2)
    _settle(idle)
    assert probed == [worker.name]
    plans, reason, record = _step(idle, drift, nodes, plans, 3)
    assert reason == f"{worker.name} had no kernel and was probed again"
    assert worker.probe_seconds["conv1"] == 0.01
    assert plans["conv1"].shares == (8, 8) and record == {}
    assert [e["event"] for e in events.events] == ["worker_idle", "worker_reprobed"]


def test_a_probe_that_finds_a_worker_still_slow_waits_twice_as_long():
    nodes = _cluster_nodes(worker_seconds=1e4)
    probed = []

    def probe(node):
        probed.append(node.name)
        return {"conv1": 1e4}  # still far too slow to be worth a kernel

    idle, _ = _idle_probes(nodes, probe, every=2)
    drift, plans = DriftMonitor(every=2, change=0.3), _plans(nodes)
    starts = []
    for step in range(16):
        before = len(probed)
        plans, _, record = _step(idle, drift, nodes, plans, step)
        _settle(idle)
        if len(probed) > before:
            starts.append(step)
        assert record == {"idle": [nodes[1].name]}
    # idle after step 0: probed after step 2, then 4 steps after that probe ended (step 3)
    assert starts == [2, 7], starts


def test_a_worker_whose_probe_fails_is_lost_not_idle():
    nodes = _cluster_nodes(worker_seconds=1e4)

    def probe(node):
        raise ConnectionError("worker gone")

    idle, events = _idle_probes(nodes, probe, every=1)
    drift, plans = DriftMonitor(every=1, change=0.3), _plans(nodes)
    for step in range(3):
        plans, _, record = _step(idle, drift, nodes, plans, step)
        _settle(idle)
    assert nodes[1].state == LOST
    assert record == {}
    kinds = [e["event"] for e in events.events]
    assert kinds == ["worker_idle", "worker_lost"], kinds


def test_a_lost_worker_caught_by_a_later_check_is_distrusted_not_tried_again():
    from hetconv.master.membership import DISTRUSTED, LOST
    from hetconv.master.spotcheck import SpotCheckFailed

    nodes = _cluster_nodes()
    events = EventLog()
    membership = Membership(
        nodes, fixed={n.name for n in nodes[1:]}, events=events, make_client=None,
        reconnect=None, retry_min=1.0, retry_max=2.0,
    )  # fmt: skip
    worker = nodes[1]
    membership.lose(worker, RuntimeError("its call failed"))
    assert worker.state == LOST
    membership.lose(worker, SpotCheckFailed(worker.name, "a late check: its sketches differ"))
    assert worker.state == DISTRUSTED
    kinds = [e["event"] for e in events.events]
    assert kinds[-2:] == ["worker_lost", "worker_distrusted"]
    membership.lose(worker, RuntimeError("again"))  # nothing more
    assert worker.state == DISTRUSTED and len(events.events) == len(kinds)
