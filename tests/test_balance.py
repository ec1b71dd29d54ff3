"""Tests for hetconv.balance: largest-remainder kernel shares and their offsets."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from hetconv.balance import kernel_shares, offsets

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
