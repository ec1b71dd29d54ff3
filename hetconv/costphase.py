"""The time of one distributed call of a layer in the cost model (:mod:`hetconv.costmodel`).

All worker calls start together while the master computes its own share. Each call pays a fixed
cost (software per call, plus the link's round trip), moves its request, computes, moves its
answer. Transfers are fluid flows that share capacity max-min fairly: on a switched network
(full duplex, one port per node) requests share the master's upstream and answers its
downstream; on Wi-Fi every transfer, both directions, shares one medium. Each flow is also
capped by its worker's own link. While the master computes its own share, streamed transfers
lose :attr:`~hetconv.costcluster.WireCosts.compute_stall` of their rate.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hetconv.costcluster import WIFI


@dataclass(frozen=True)
class WorkerCall:
    """One worker's call in a distributed layer phase, as times and bytes.

    ``before_s`` passes before the request moves (fixed call cost, half the round trip);
    ``after_s`` after the answer has moved (the other half). ``streamed``: the call goes in
    chunks (its transfers slow down while the master computes, see
    :attr:`~hetconv.costcluster.WireCosts.compute_stall`).

    Overlap (:mod:`hetconv.overlap`): ``pipelined_s`` of ``compute_s`` runs in ``groups``
    image groups; ``overlap`` ``"answer"``: each group's answer bytes go once it is computed
    (the rest of the compute comes first); ``"request"``: each group starts once its request
    bytes are in (the rest of the compute comes after the last).
    """

    request_bytes: float
    answer_bytes: float
    compute_s: float
    before_s: float
    after_s: float
    link_bytes_per_s: float
    streamed: bool = False
    groups: int = 1
    pipelined_s: float = 0.0
    overlap: str = ""


def _waterfill(capacity: float, caps: np.ndarray) -> np.ndarray:
    """Max-min fair rates of flows sharing ``capacity``, each at most its own cap."""
    if caps.size == 0 or not math.isfinite(capacity):
        return caps.copy()
    order = np.argsort(caps)
    ordered = caps[order]
    before = np.concatenate(([0.0], np.cumsum(ordered)[:-1]))
    fair = (capacity - before) / (caps.size - np.arange(caps.size))
    above = ordered > fair
    if not above.any():
        return caps.copy()
    return np.minimum(caps, fair[int(np.argmax(above))])


# Stages of a worker call in simulate_phase.
_BEFORE, _REQUEST, _COMPUTE, _ANSWER, _AFTER, _DONE = range(6)


class _Calls:
    """The worker calls of one phase as arrays, and where each is at time ``t``."""

    def __init__(self, calls: Sequence[WorkerCall]):
        n = self.n = len(calls)
        self.request = np.array([c.request_bytes for c in calls], float)
        self.answer = np.array([c.answer_bytes for c in calls], float)
        compute = np.array([c.compute_s for c in calls], float)
        self.after = np.array([c.after_s for c in calls], float)
        self.caps = np.array([c.link_bytes_per_s for c in calls], float)
        self.streamed = np.array([c.streamed for c in calls], bool)
        self.groups = np.array([max(c.groups, 1) for c in calls], float)
        self.piped = np.array([min(c.pipelined_s, c.compute_s) for c in calls], float)
        self.out_piped = np.array([c.overlap == "answer" and c.groups > 1 for c in calls], bool)
        self.in_piped = np.array([c.overlap == "request" and c.groups > 1 for c in calls], bool)
        # Answer overlap: the compute stage ends with the first group; the answer then moves no
        # faster than the groups are made, until the last is (``made``).
        piped, groups = self.piped, self.groups
        self.compute = np.where(self.out_piped, compute - piped + piped / groups, compute)
        self.made = np.full(n, -math.inf)
        # Request overlap: the groups start once the first group's bytes are in (``first_in``).
        self.first_in = np.full(n, math.nan)
        self.rest = self.request * (groups - 1) / groups  # request bytes left then
        self.stage = np.full(n, _BEFORE)
        self.timer = np.array([c.before_s for c in calls], float)  # end of a timed stage
        self.left = np.zeros(n)  # bytes still to move in a transfer stage
        self.end = np.zeros(n)

    def advance(self, t: float, tol: float) -> None:
        """Every stage that is over moves on, in stage order so zero-length stages chain."""
        stage, timer, left = self.stage, self.timer, self.left
        piped, groups = self.piped, self.groups
        due = (stage == _BEFORE) & (timer <= t + tol)
        stage[due], left[due] = _REQUEST, self.request[due]
        came = (
            (stage == _REQUEST)
            & self.in_piped
            & np.isnan(self.first_in)
            & (left <= self.rest * (1 + 1e-12))
        )
        self.first_in[came] = t
        due = (stage == _REQUEST) & (left <= 0)
        timer[due] = t + self.compute[due]
        grouped = due & self.in_piped  # the last group after the last byte, or all after the first
        timer[grouped] = (
            np.maximum(
                t + piped[grouped] / groups[grouped], self.first_in[grouped] + piped[grouped]
            )
            + self.compute[grouped]
            - piped[grouped]
        )
        stage[due] = _COMPUTE
        due = (stage == _COMPUTE) & (timer <= t + tol)
        stage[due], left[due] = _ANSWER, self.answer[due]
        out = due & self.out_piped
        self.made[out] = t + piped[out] * (groups[out] - 1) / groups[out]
        due = (stage == _ANSWER) & (left <= 0)
        stage[due], timer[due] = _AFTER, t + self.after[due]
        due = (stage == _AFTER) & (timer <= t + tol)
        stage[due], self.end[due] = _DONE, t

    def rates(self, fabric: str, up: float, down: float, t: float, tol: float, stall: float):
        """Each moving transfer's rate now (0 for the others), and which answers are still
        paced by their groups being made."""
        rates = np.zeros(self.n)
        requests, answers = self.stage == _REQUEST, self.stage == _ANSWER
        if fabric == WIFI:
            moving = requests | answers
            rates[moving] = _waterfill(up, self.caps[moving])
        else:
            rates[requests] = _waterfill(up, self.caps[requests])
            rates[answers] = _waterfill(down, self.caps[answers])
        moving = requests | answers
        making = answers & self.out_piped & (self.made > t + tol)  # groups still being made
        if making.any():
            with np.errstate(divide="ignore", invalid="ignore"):
                pace = np.where(
                    self.piped > 0, self.answer / np.maximum(self.piped, 1e-300), math.inf
                )
            rates[making] = np.minimum(rates[making], pace[making])
        if stall:  # (a full stall stops even an unlimited flow)
            slowed = moving & self.streamed
            rates[slowed] = rates[slowed] * (1.0 - stall) if stall < 1 else 0.0
        return rates, moving, making

    def wake(self, t: float, rates: np.ndarray, moving, making) -> tuple[np.ndarray, np.ndarray]:
        """When each moving transfer would finish, and the soonest other event, from ``t``."""
        left = self.left
        with np.errstate(divide="ignore"):
            finish = np.where(moving, left / np.where(moving, rates, 1.0), math.inf)
        timed = (self.stage == _BEFORE) | (self.stage == _COMPUTE) | (self.stage == _AFTER)
        wake = np.where(timed, self.timer - t, math.inf)
        wake = np.minimum(wake, np.where(making, self.made - t, math.inf))
        waiting = (self.stage == _REQUEST) & self.in_piped & np.isnan(self.first_in)
        with np.errstate(divide="ignore", invalid="ignore"):
            first = np.where(waiting, (left - self.rest) / np.where(waiting, rates, 1.0), math.inf)
        return finish, np.minimum(wake, np.where(first >= 0, first, math.inf))


def simulate_phase(
    calls: Sequence[WorkerCall],
    fabric: str,
    upstream_bytes_per_s: float,
    downstream_bytes_per_s: float,
    master_busy_s: float = 0.0,
    compute_stall: float = 0.0,
) -> np.ndarray:
    """When each worker call of one distributed phase ends, in seconds from its start.

    A fluid simulation: between events every moving transfer gets its max-min fair share of
    the capacity it competes for (see :class:`~hetconv.costcluster.Cluster`), at most its
    worker's link.

    Args:
        calls: the worker calls, all started at time 0.
        fabric: ``"switched"``: requests share ``upstream_bytes_per_s``, answers
            ``downstream_bytes_per_s``; ``"wifi"``: all transfers share ``upstream_bytes_per_s``.
        master_busy_s: how long the master computes its own share, from time 0.
        compute_stall: the fraction of their rate streamed transfers lose meanwhile.
    """
    n = len(calls)
    if n == 0:
        return np.zeros(0)
    state = _Calls(calls)
    t = 0.0
    for _ in range(10 * n + 7):
        tol = 1e-12 * max(t, 1e-9)
        state.advance(t, tol)
        if (state.stage == _DONE).all():
            return state.end
        stalling = compute_stall > 0 and t < master_busy_s
        rates, moving, making = state.rates(
            fabric, upstream_bytes_per_s, downstream_bytes_per_s, t, tol,
            compute_stall if stalling else 0.0,
        )  # fmt: skip
        finish, wake = state.wake(t, rates, moving, making)
        busy_left = master_busy_s - t if stalling else math.inf
        dt = max(min(float(finish.min()), float(wake.min()), busy_left), 0.0)
        if not math.isfinite(dt):
            raise ValueError("a transfer cannot move: some link has no capacity")
        t = master_busy_s if dt == busy_left else t + dt
        done = moving & (finish <= dt * (1 + 1e-12))
        with np.errstate(invalid="ignore"):  # an unlimited rate over dt = 0
            state.left[moving] -= rates[moving] * dt
        state.left[done] = 0.0
    raise RuntimeError("phase simulation did not converge")  # pragma: no cover


__all__ = ["WorkerCall", "simulate_phase"]
