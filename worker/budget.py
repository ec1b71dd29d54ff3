"""One memory budget for a whole worker: calls in flight and the forward states it keeps.

Every convolution call reserves, from the header's declared sizes and before any tensor is
allocated, the bytes it will hold: its request tensors, any conversion buffers, and its answer.
The reservation is released when the call ends, however it ends (answered, refused, cancelled by
the client or by the idle watch). A Forward's inputs and kernels stay after the call for its
Backward: their bytes move from the call's reservation to the *saved states*, which are bounded
three ways:

* in total, by what the budget has left: a call that does not fit evicts whole sessions of other
  masters, least recently used first, and is refused (RESOURCE_EXHAUSTED, naming the budget and
  what it holds) only when even that cannot make room;
* per session, to ``budget / sessions``: a session that keeps saving under new layer names drops
  its own least recently saved layers, never another master's and never the state being saved;
* in sessions, to ``sessions`` (``hetconv worker --sessions N``): the least recently used goes.

What a worker keeps beyond a call that is no cache -- resident kernel slices with their momentum
and split-head columns, the parts other workers put for a split block -- is *held*
(:meth:`MemoryBudget.hold`): charged to the same budget before it is allocated, refused
(RESOURCE_EXHAUSTED, naming what and the budget) when it does not fit even with every other
session's saved states evicted, and never evicted itself: only its owner lets it go.

Whatever is dropped is remembered (bounded) with its cause, so a Backward that finds nothing
can say why. Calls in flight are bounded in number too (``max_calls``): one more is refused
with RESOURCE_EXHAUSTED at once instead of queueing behind the others. A call that only waits
(for another worker's part) gives its slot back while it waits (:meth:`MemoryBudget.waiting`):
waiting calls have a bound of their own, the same number, so they never starve the calls that
compute. Whoever watches the slots (the health service) hears when the last one is taken and
when one comes back.

The state of the call in progress is never evicted; a single state larger than a session's share
is refused before the call computes anything.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from hetconv.errors import RequestTooLarge

#: How many dropped sessions and layer states a worker remembers (to name the cause).
DROPPED_REMEMBERED = 1024

#: A saved state's key within its session: (layer name, kernel offset).
StateKey = tuple[str, int]


class OverBudget(RequestTooLarge):
    """A call the worker's memory budget (or its limit on calls in flight) cannot take now:
    RESOURCE_EXHAUSTED, like any request over a worker's limits."""


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


def state_bytes(state: Any) -> int:
    """Bytes of the arrays a saved state (a dataclass) holds: its ``held_bytes`` when it says,
    else every field that is an array."""
    held = getattr(state, "held_bytes", None)
    if held is not None:
        return int(held)
    if not dataclasses.is_dataclass(state):
        raise TypeError(f"a saved state must be a dataclass, got {type(state).__name__}")
    return sum(
        value.nbytes
        for value in (getattr(state, f.name) for f in dataclasses.fields(state))
        if isinstance(value, np.ndarray)
    )


@dataclass(frozen=True)
class Holding:
    """What a budget holds at one moment, in bytes (what Describe reports)."""

    budget: int
    reserved: int
    in_flight: int
    calls: int
    saved: int
    sessions: int
    states: int
    held: int = 0  # resident slices, parts put by peers (MemoryBudget.hold)
    waiting: int = 0  # calls that wait, their slots given back (MemoryBudget.waiting)

    def describe(self) -> str:
        def count(n: int, what: str) -> str:
            return f"{n} {what}{'s' if n != 1 else ''}"

        return (
            f"{_mib(self.reserved)} of device scratch, {_mib(self.in_flight)} for "
            f"{count(self.calls, 'call')} in flight, {_mib(self.held)} held (resident "
            f"slices, parts) and {_mib(self.saved)} of "
            f"{count(self.states, 'saved forward state')} of {count(self.sessions, 'session')}"
        )

    def as_metadata(self) -> str:
        """``key=value`` pairs, comma-separated (Describe's ``hetconv-memory`` metadata)."""
        return ",".join(f"{k}={v}" for k, v in dataclasses.asdict(self).items())


@dataclass(frozen=True)
class Dropped:
    """Why a saved state is gone: ``"session"`` (another master needed the room, or more
    sessions than ``--sessions`` came) or ``"share"`` (its session outgrew its share)."""

    cause: str


class CallMemory:
    """The bytes one call in flight holds (see :meth:`MemoryBudget.call`)."""

    def __init__(self, budget: MemoryBudget, name: str, session: int | None):
        self.budget, self.name, self.session = budget, name, session
        self.held = 0
        self.closed = False
        self.waiting = False  # its slot is given back while it waits (MemoryBudget.waiting)

    def reserve(self, nbytes: int, what: str, session: int | None = None) -> None:
        """Hold ``nbytes`` more for this call (see :meth:`MemoryBudget.reserve`)."""
        self.budget.reserve(self, nbytes, what, session)

    def cover(self, nbytes: int, what: str) -> None:
        """Hold at least ``nbytes`` in all for this call: reserve what is missing."""
        if nbytes > self.held:
            self.budget.reserve(self, nbytes - self.held, what, self.session)


class MemoryBudget:
    """The byte budget of a worker and the saved states it keeps (see the module docstring).

    Args:
        total_bytes: what calls in flight and saved states may hold together.
        sessions: sessions whose states are kept at once; each may keep ``total / sessions``.
        max_calls: calls in flight at once.
        reserved_bytes: held for good by something else counted in the budget (the device's
            scratch kept between calls).
    """

    def __init__(self, total_bytes: int, sessions: int, max_calls: int, reserved_bytes: int = 0):
        if total_bytes < 1 or sessions < 1 or max_calls < 1:
            raise ValueError(
                f"memory budget {total_bytes} bytes, {sessions} sessions, {max_calls} calls: "
                "each must be positive"
            )
        self.total = int(total_bytes)
        self.sessions = int(sessions)
        self.max_calls = int(max_calls)
        if not 0 <= reserved_bytes < total_bytes:
            raise ValueError(f"{reserved_bytes} bytes reserved of a budget of {total_bytes}")
        self.reserved = int(reserved_bytes)
        self._lock = threading.Lock()
        self._in_flight = 0
        self._calls = 0
        self._saved_bytes = 0
        # session -> key -> (state, bytes), least recently used session first; within a
        # session, least recently saved key first
        self._saved: OrderedDict[int, OrderedDict[StateKey, tuple[Any, int]]] = OrderedDict()
        self._dropped_sessions: OrderedDict[int, Dropped] = OrderedDict()
        self._dropped_states: OrderedDict[tuple[int, StateKey], Dropped] = OrderedDict()
        self._local = threading.local()
        self._held: dict[Hashable, int] = {}  # what hold() keeps, by its key
        self._held_bytes = 0
        self._waiting = 0
        self._full = False  # every call slot taken (what on_slots last heard)
        #: Told ``True`` when the last call slot is taken and ``False`` when one comes back
        #: (under the budget's lock: it must not call back into the budget).
        self.on_slots: Callable[[bool], None] | None = None

    @property
    def session_share(self) -> int:
        """The most one session's saved states may hold."""
        return (self.total - self.reserved) // self.sessions

    @property
    def _free_total(self) -> int:  # what calls, held bytes and saved states may hold together
        return self.total - self.reserved - self._held_bytes

    # -- calls in flight ----------------------------------------------------------------------

    @contextmanager
    def call(
        self, name: str, session: int | None = None, waits: bool = False
    ) -> Iterator[CallMemory]:
        """A call in flight for the duration of the ``with``: its reservations are released on
        exit, however it exits. The call is this thread's current one (:meth:`current`).
        ``waits``: a call that only waits (FetchPart), counted among the waiting calls from the
        start instead of taking a call slot.

        Raises:
            OverBudget: ``max_calls`` calls are in flight already (``waits``: waiting).
        """
        memory = CallMemory(self, name, session)
        with self._lock:
            if waits:
                self._start_waiting(memory)
            else:
                if self._calls >= self.max_calls:
                    raise OverBudget(
                        f"{self._calls} calls in flight, the most this worker takes at once "
                        f"(--max-calls {self.max_calls}); try again when one has ended"
                    )
                self._calls += 1
                self._slots_changed()
        previous = getattr(self._local, "current", None)
        self._local.current = memory
        try:
            yield memory
        finally:
            self._local.current = previous
            self.end(memory)

    def current(self) -> CallMemory | None:
        """The call this thread serves (None: none, e.g. a core called directly)."""
        return getattr(self._local, "current", None)

    def end(self, memory: CallMemory) -> None:
        """Release everything ``memory`` holds (once; later calls do nothing)."""
        with self._lock:
            if memory.closed:
                return
            memory.closed = True
            self._in_flight -= memory.held
            memory.held = 0
            if memory.waiting:
                self._waiting -= 1
            else:
                self._calls -= 1
                self._slots_changed()

    @contextmanager
    def waiting(self, memory: CallMemory | None = None) -> Iterator[None]:
        """The ``with`` body of call ``memory`` (default: this thread's) only waits (for another
        worker's part): its call slot is given back meanwhile and taken again after, even when
        every slot is taken by then (the call is finishing). Nothing happens for no call, or a
        call that waits already.

        Raises:
            OverBudget: ``max_calls`` calls wait already.
        """
        memory = memory if memory is not None else self.current()
        if memory is None or memory.waiting or memory.closed:
            yield
            return
        with self._lock:
            self._start_waiting(memory)
            self._calls -= 1
            self._slots_changed()
        try:
            yield
        finally:
            with self._lock:
                if memory.waiting and not memory.closed:
                    memory.waiting = False
                    self._waiting -= 1
                    self._calls += 1
                    self._slots_changed()

    def reserve(
        self, memory: CallMemory, nbytes: int, what: str, session: int | None = None
    ) -> None:
        """Hold ``nbytes`` more for the call ``memory``, before they are allocated.

        Saved states of sessions other than ``session`` (the caller's, whose states its own
        Backward needs) are evicted, least recently used first, when that makes room.

        Raises:
            OverBudget: the call does not fit even with every other session's states gone.
        """
        if nbytes <= 0:
            return
        with self._lock:
            if memory.closed:
                raise RuntimeError(f"{memory.name}: reserving for a call that has ended")
            self._make_room(nbytes, what, session)
            self._in_flight += nbytes
            memory.held += nbytes

    # -- held beyond a call -------------------------------------------------------------------

    def hold(self, key: Hashable, nbytes: int, what: str, session: int | None = None) -> None:
        """Hold ``nbytes`` under ``key`` beyond any call (a resident slice, the parts peers
        put), replacing what ``key`` held, before they are allocated. Saved states of sessions
        other than ``session`` are evicted, least recently used first, when that makes room;
        what is held is never evicted (:meth:`release` lets it go).

        Raises:
            OverBudget: it does not fit even with every other session's states gone (``key``
                keeps what it held).
        """
        nbytes = max(0, int(nbytes))
        with self._lock:
            had = self._held.get(key, 0)
            if nbytes > had:
                self._make_room(nbytes - had, what, session)
            self._held_bytes += nbytes - had
            if nbytes:
                self._held[key] = nbytes
            else:
                self._held.pop(key, None)

    def release(self, key: Hashable) -> None:
        """Let go of what :meth:`hold` keeps under ``key`` (nothing: nothing happens)."""
        with self._lock:
            self._held_bytes -= self._held.pop(key, 0)

    def held(self, key: Hashable) -> int:
        """The bytes held under ``key``."""
        with self._lock:
            return self._held.get(key, 0)

    # -- saved states -------------------------------------------------------------------------

    def check_state(self, nbytes: int, what: str) -> None:
        """Refuse, before any work, a state one session could never keep.

        Raises:
            OverBudget: ``nbytes`` exceed a session's share of the budget.
        """
        if nbytes > self.session_share:
            raise OverBudget(
                f"{what} would keep {_mib(nbytes)} for its backward pass, more than a "
                "session's share of this worker's memory budget "
                f"({_mib(self.total - self.reserved)} of "
                f"--memory-mib {_mib(self.total)} beside the device scratch, / {self.sessions} "
                f"sessions (--sessions) = {_mib(self.session_share)})"
            )

    def save(
        self,
        session: int,
        key: StateKey,
        state: Any,
        replaces: Callable[[StateKey, Any], bool] | None = None,
    ) -> None:
        """Keep ``state`` under (``session``, ``key``), replacing what that key held and every
        state of the session for which ``replaces(key, state)`` is true. Its bytes move from the
        current call's reservation when there is one (they are already held); otherwise they
        are reserved here.

        Raises:
            OverBudget: the state exceeds a session's share, or (with no call to move it from)
                does not fit.
        """
        nbytes = state_bytes(state)
        self.check_state(nbytes, f"the saved state of {key[0]!r}")
        memory = self.current()
        with self._lock:
            slices = self._saved.get(session)
            if slices is None:
                slices = self._saved[session] = OrderedDict()
            stale = [k for k, (kept, _) in slices.items() if replaces and replaces(k, kept)]
            for old in [key, *stale]:
                if old in slices:
                    _, size = slices.pop(old)
                    self._saved_bytes -= size
                self._dropped_states.pop((session, old), None)
            self._saved.move_to_end(session)
            self._dropped_sessions.pop(session, None)
            moved = 0
            if memory is not None and not memory.closed:
                moved = min(memory.held, nbytes)
                memory.held -= moved
                self._in_flight -= moved
            # within its share: this session's own least recently saved states go first
            own = sum(size for _, size in slices.values())
            while slices and own + nbytes > self.session_share:
                old, (_, size) = slices.popitem(last=False)
                own -= size
                self._saved_bytes -= size
                self._remember((session, old), Dropped("share"), self._dropped_states)
            # in total: other sessions, least recently used first
            others = [s for s in self._saved if s != session]
            while others and (
                len(self._saved) > self.sessions
                or self._in_flight + self._saved_bytes + nbytes > self._free_total
            ):
                self._drop_session(others.pop(0))
            if self._in_flight + self._saved_bytes + nbytes > self._free_total:
                self._in_flight += moved  # back to the call, which releases it when it ends
                if memory is not None:
                    memory.held += moved
                if not slices:
                    del self._saved[session]
                raise OverBudget(
                    f"the saved state of {key[0]!r} needs {_mib(nbytes)}, and this worker's "
                    f"memory budget of {_mib(self.total)} (--memory-mib) holds "
                    f"{self._holding().describe()}"
                )
            slices[key] = (state, nbytes)
            self._saved_bytes += nbytes

    def saved(self, session: int, key: StateKey) -> Any | None:
        """The state kept under (``session``, ``key``), or None."""
        with self._lock:
            entry = self._saved.get(session, {}).get(key)
            return None if entry is None else entry[0]

    def discard(self, session: int, key: StateKey) -> None:
        """Let go of the state kept under (``session``, ``key``), its backward done."""
        with self._lock:
            entry = self._saved.get(session, {}).pop(key, None)
            if entry is not None:
                self._saved_bytes -= entry[1]

    def keys(self, session: int) -> list[StateKey]:
        """The keys ``session`` keeps states under, least recently saved first."""
        with self._lock:
            return list(self._saved.get(session, {}))

    def dropped(self, session: int, key: StateKey) -> Dropped | None:
        """Why (``session``, ``key``) holds nothing, when the budget dropped it; else None."""
        with self._lock:
            return self._dropped_states.get((session, key)) or self._dropped_sessions.get(session)

    def holding(self) -> Holding:
        with self._lock:
            return self._holding()

    # -- internals (called with the lock held) ------------------------------------------------

    def _holding(self) -> Holding:
        return Holding(
            budget=self.total,
            reserved=self.reserved,
            in_flight=self._in_flight,
            calls=self._calls,
            saved=self._saved_bytes,
            sessions=len(self._saved),
            states=sum(len(s) for s in self._saved.values()),
            held=self._held_bytes,
            waiting=self._waiting,
        )

    def _make_room(self, nbytes: int, what: str, session: int | None) -> None:
        """Evict other sessions' saved states until ``nbytes`` more fit; OverBudget, evicting
        nothing, when they cannot."""
        own = sum(size for _, size in self._saved.get(session, {}).values())
        if self._in_flight + own + nbytes > self._free_total:
            raise OverBudget(
                f"{what} needs {_mib(nbytes)} more, and this worker's memory budget of "
                f"{_mib(self.total)} (--memory-mib) holds {self._holding().describe()}"
            )
        while self._in_flight + self._saved_bytes + nbytes > self._free_total:
            victim = next(s for s in self._saved if s != session)
            self._drop_session(victim)

    def _start_waiting(self, memory: CallMemory) -> None:
        if self._waiting >= self.max_calls:
            raise OverBudget(
                f"{self._waiting} calls waiting on other workers' parts, the most this worker "
                f"lets wait at once (--max-calls {self.max_calls}); try again when one has ended"
            )
        self._waiting += 1
        memory.waiting = True

    def _slots_changed(self) -> None:
        full = self._calls >= self.max_calls
        if full != self._full:
            self._full = full
            if self.on_slots is not None:
                self.on_slots(full)

    def _drop_session(self, session: int) -> None:
        slices = self._saved.pop(session)
        self._saved_bytes -= sum(size for _, size in slices.values())
        for key in slices:
            self._dropped_states.pop((session, key), None)
        self._remember(session, Dropped("session"), self._dropped_sessions)

    @staticmethod
    def _remember(key, why: Dropped, where: OrderedDict) -> None:
        where[key] = why
        where.move_to_end(key)
        while len(where) > DROPPED_REMEMBERED:
            where.popitem(last=False)


__all__ = ["CallMemory", "Dropped", "Holding", "MemoryBudget", "OverBudget", "state_bytes"]
