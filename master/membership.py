"""Who is in the cluster: the nodes, their states, lost workers coming back, the workers file.

A worker is ``active`` (it gets a share), ``lost`` (a call failed; the monitor thread retries it
with exponential backoff) or ``ready`` (it answered and was probed again; it becomes active at
the next step boundary, so a step never changes membership half-way). An active worker the
planner gives no kernel of any layer is *idle* (:meth:`Membership.idle_workers`): it answers
but computes nothing, and :class:`~.rebalancing.IdleProbes` probes it again now and then so
that it can earn work back; the trace and the figures tell it apart from a lost one. Workers
named in the workers file join the same way, starting lost with no backoff; workers whose line
is removed leave at the next step boundary (workers named with ``--worker`` stay). A worker
that cannot be reached when training starts starts lost, and joins like one that came back.
Workers found on the LAN (``hetconv train --discover``, :mod:`.discovery`) are handled as lines
of the file: one that appears joins, one that stops being advertised leaves
(:meth:`Membership.follow`). Those never reached yet are tried concurrently, apart from the
monitor (:class:`~.discovery.Joiners`), so that a flood of advertisements nobody answers at
cannot hold up the others; each address keeps its backoff while it comes and goes.

One worker process reached under two addresses (``127.0.0.1:P`` and ``localhost:P``) would be
counted twice: a worker that answers with the instance id of another member (Describe's
``instance_id``, random per worker process) is an ``alias`` and is not admitted (event
``worker_alias``); a joiner from the file is dropped (and not tried again while its line stays).
"""

from __future__ import annotations

import enum
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hetconv.argtypes import parse_address

from .client import WorkerAuthError, WorkerClient, WorkerTLSError
from .events import EventLog, short_reason

MASTER = "master"
FROM_FILE, FROM_LAN = "workers file", "LAN"
#: LAN addresses whose backoff is remembered after their advertisement went (it may come back).
REMEMBERED_BACKOFFS = 4096
#: Seconds between two lines about advertised workers that do not answer (one line for all).
UNANSWERED_EVERY = 60.0
#: Why a worker leaves, by what named it.
LEAVE_REASONS = {
    FROM_FILE: "removed from the workers file",
    FROM_LAN: "no longer advertised on the LAN (the worker stopped or unregistered)",
}


class NodeState(str, enum.Enum):
    """A node's membership state (a ``str``, so traces and comparisons with text still work)."""

    ACTIVE = "active"
    LOST = "lost"
    READY = "ready"
    ALIAS = "alias"  # another address of a member's worker process: never admitted
    DISTRUSTED = "distrusted"  # answered finite but wrong values: never re-admitted this run

    def __str__(self) -> str:
        return self.value


ACTIVE, LOST, READY, ALIAS = NodeState.ACTIVE, NodeState.LOST, NodeState.READY, NodeState.ALIAS
DISTRUSTED = NodeState.DISTRUSTED


@dataclass
class Backoff:
    """When to try a lost worker again: doubling with every failed attempt and every loss."""

    failures: int = 0  # consecutive failed attempts to reach it since it was lost
    losses: int = 0  # times it was lost: a worker that keeps failing is retried less often
    retry_at: float = 0.0  # time.monotonic() of the next attempt

    def delay(self, least: float, most: float) -> float:
        exponent = self.failures + max(self.losses - 1, 0)
        return min(most, least * 2.0 ** min(exponent, 30))


@dataclass
class Node:
    """The master or one worker, as the cluster sees it: its connection, what it runs on, its
    link, its speed figures and its membership state."""

    name: str
    client: WorkerClient | None  # None for the master itself
    description: str = ""
    link_bytes_per_second: float = float("inf")  # measured round trip, both directions
    link_latency: float = 0.0
    # per layer: the seconds forward + backward of the whole layer would take it: the probe's
    # figure, scaled by how much its speed has changed in training since (rebalancing)
    probe_seconds: dict[str, float] = field(default_factory=dict)
    state: NodeState = ACTIVE
    backoff: Backoff = field(default_factory=Backoff)
    joined: bool = False  # came from the workers file or the LAN during training
    was_active: bool = True  # it computed once (False: unreachable since the start)
    instance_id: int = 0  # its worker process's, from Describe (0: not known)
    sum_port: int = 0  # where its ring peers put batch norm's sums, from Describe (0: none)
    backend: str = ""  # what it computes with, from Describe (cpu, onednn, cuda, opencl)
    leaving: bool = False  # its line left the workers file: it goes at the next step boundary
    source: str = ""  # FROM_FILE or FROM_LAN: what named it (and can make it leave); "": flags

    @property
    def is_master(self) -> bool:
        return self.client is None


def read_workers_file(path: str) -> list[str]:
    """Worker addresses from a file: one HOST:PORT per line, ``#`` comments, blank lines."""
    try:
        text = open(path, encoding="utf-8").read()
    except OSError as e:
        raise OSError(f"cannot read workers file {path}: {e.strerror}") from None
    addresses = []
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.split("#", 1)[0].strip()
        if line:
            addresses.append(parse_address(line, f"{path}:{number}"))
    if not addresses:
        raise ValueError(f"workers file {path} names no worker")
    return addresses


class WorkerAlias(Exception):
    """The worker reached is another address of ``twin``'s worker process."""

    def __init__(self, node: Node, twin: Node):
        super().__init__(
            f"the same worker process as {twin.name} (instance id {node.instance_id:016x}) "
            "under another address: not admitted"
        )
        self.twin = twin


@dataclass(frozen=True)
class Admission:
    """What changed at a step boundary."""

    leaving: list[Node]
    admitted: list[tuple[Node, str]]  # (node, "worker_rejoined" or "worker_joined")
    changed: bool  # membership changed since the shares were planned


class Membership:
    """The nodes (master first) and the workers being connected, with a monitor thread.

    Args:
        nodes: the master and the workers named at start.
        fixed: addresses named outside the workers file (they never leave through it).
        events: where membership events go.
        make_client: a new :class:`WorkerClient` for an address (a joiner).
        reconnect: connects and probes a lost or joining node, returning its probe seconds
            per layer; raises if it cannot (:class:`WorkerAlias` when the worker it reached is
            a member's, see :meth:`check_alias`).
        retry_min, retry_max: the backoff's first and longest delay, seconds.
        workers_file: re-read every second by the monitor, or None.
    """

    def __init__(
        self,
        nodes: list[Node],
        fixed: set[str],
        events: EventLog,
        make_client: Callable[[str], WorkerClient],
        reconnect: Callable[[Node], dict[str, float]],
        retry_min: float,
        retry_max: float,
        workers_file: str | None = None,
    ):
        self.nodes = nodes
        self.pending: list[Node] = []  # joiners being connected and probed
        self.lock = threading.Lock()  # node states, pending joiners
        self.failed: set[str] = set()  # workers that failed during the current step
        self.replan_needed = False
        self._events, self._make_client, self._reconnect = events, make_client, reconnect
        self._retry = (retry_min, retry_max)
        self._workers_file = workers_file
        self._file_mtime = 0.0
        self._listed: set[str] = set()  # what the workers file named when last read
        self._discovery = None  # a Discovery browsing the LAN (follow), or None
        self._discovered: set[str] = set()  # what it found advertised when last polled
        self._joiners = None  # a discovery.Joiners trying LAN joiners never reached (follow)
        self._lan_backoffs: dict[str, Backoff] = {}  # LAN joiners gone before they answered
        self._unanswered: dict[str, str] = {}  # LAN joiners that failed since the last line
        self._unanswered_said = -UNANSWERED_EVERY  # time.monotonic() of that line
        self._aliases: set[str] = set()  # file joiners refused as aliases (while listed)
        self._fixed = set(fixed)
        self._closed = threading.Event()
        self._monitor: threading.Thread | None = None

    # -- the workers file --------------------------------------------------------------

    def read_initial_workers_file(self) -> None:
        """Note what the workers file names now (it was read once at start to build the
        node list), so that later edits are seen as changes."""
        if not self._workers_file:
            return
        self._file_mtime = self._mtime()
        try:
            self._listed = set(read_workers_file(self._workers_file))
        except (OSError, ValueError):  # read fine at start; the monitor reports changes
            self._listed = {n.name for n in self.nodes[1:]} - self._discovered
        self._fixed -= self._listed
        for node in self.nodes[1:]:
            if node.name in self._listed:
                node.source = FROM_FILE

    def _mtime(self) -> float:
        try:
            return os.stat(self._workers_file).st_mtime
        except OSError:
            return 0.0

    def _reread_workers_file(self) -> None:
        mtime = self._mtime()
        if mtime == self._file_mtime:
            return
        self._file_mtime = mtime
        try:
            addresses = read_workers_file(self._workers_file)
        except (OSError, ValueError) as e:
            self._events.emit("workers_file_unreadable", reason=str(e))
            return
        self._listed = set(addresses)
        self._sync(addresses)

    def _sync(self, addresses: list[str]) -> None:
        """Joiners and leavers from what the workers file (``self._listed``) and the LAN
        (``self._discovered``) name now; ``addresses``: the new ones to add, in order."""
        listed = self._listed | self._discovered
        self._aliases &= listed  # a line removed and added again is tried again
        dropped = []
        with self.lock:
            for node in list(self.pending):  # joiners not admitted yet simply go
                if node.name not in listed:
                    self.pending.remove(node)
                    dropped.append(node)
                    if node.source == FROM_LAN:
                        self._remember_backoff(node)
            for node in self.nodes[1:]:
                # Only workers the file or the LAN named can leave through them: --worker ones
                # stay. A worker named again before its step boundary stays too.
                node.leaving = node.name not in listed and node.name not in self._fixed
            known = {n.name for n in self.nodes + self.pending} | self._aliases
            for address in addresses:
                if address not in known:
                    source = FROM_FILE if address in self._listed else FROM_LAN
                    client = self._make_client(address)
                    node = Node(address, client, state=LOST, joined=True, source=source)
                    if source == FROM_LAN and address in self._lan_backoffs:
                        node.backoff = self._lan_backoffs.pop(address)
                    self.pending.append(node)
                    known.add(address)
        for node in dropped:
            node.client.close()
            if node.source == FROM_LAN and node.state == LOST:  # never answered: quiet (a flood)
                continue
            reason = LEAVE_REASONS.get(node.source, LEAVE_REASONS[FROM_FILE])
            self._events.emit("worker_removed", node.name, reason=reason)

    def _remember_backoff(self, node: Node) -> None:
        """Under the lock: a LAN joiner's advertisement went before it answered; should it
        come back, it is tried when its backoff says, not at once."""
        if node.backoff.failures:
            self._lan_backoffs.pop(node.name, None)
            self._lan_backoffs[node.name] = node.backoff
            while len(self._lan_backoffs) > REMEMBERED_BACKOFFS:
                del self._lan_backoffs[next(iter(self._lan_backoffs))]

    # -- workers found on the LAN ------------------------------------------------------

    def follow(self, discovery, found: list[str]) -> None:
        """Admit and retire workers as ``discovery`` (a :class:`~.discovery.Discovery`) sees
        them advertised, like lines of the workers file; ``found``: the addresses it had found
        when the node list was built (they leave when they unregister, unless also named with
        ``--worker``). Call before the monitor starts."""
        from .discovery import Joiners

        self._discovery = discovery
        self._joiners = Joiners(self._try_rejoin, self._retry_later)
        self._discovered = set(found)
        self._fixed -= self._discovered
        for node in self.nodes[1:]:
            if node.name in self._discovered and not node.source:
                node.source = FROM_LAN

    def _poll_discovery(self) -> None:
        for refusal in self._discovery.take_refusals():
            self._events.emit("worker_refused", refusal.address, reason=refusal.reason)
        for notice in self._discovery.take_notices():
            self._events.emit("advertisements_dropped", reason=notice)
        self._say_unanswered()
        addresses = self._discovery.poll()
        if addresses is None:
            return
        self._discovered = set(addresses)
        self._sync(addresses)

    # -- losing and finding workers ----------------------------------------------------

    def lose(self, node: Node, error: Exception, at_start: bool = False) -> None:
        """A call to ``node`` failed: it is lost until the monitor reaches it again.

        ``at_start``: it could not be reached when training started (it joins when it can).
        An ``error`` with a true ``keep_out`` (a failed spot check) leaves it ``distrusted``:
        the monitor never tries it again; one already lost (a check of an earlier answer, run
        later: the ring's with batch norm) is distrusted then.
        """
        keep_out = getattr(error, "keep_out", False)
        with self.lock:
            late = node.state == LOST and keep_out  # caught by a check made after it was lost
            if late:
                node.state = DISTRUSTED
            elif node.state != ACTIVE:
                return
            else:
                node.state = DISTRUSTED if keep_out else LOST
                if at_start:
                    node.was_active = False
                node.backoff.failures = 0
                node.backoff.losses += 1
                node.backoff.retry_at = time.monotonic() + node.backoff.delay(*self._retry)
                self.failed.add(node.name)
                self.replan_needed = True
        self._events.emit("worker_distrusted" if late else "worker_lost", node.name,
                          reason=str(error))  # fmt: skip

    def start_monitor(self) -> None:
        self._monitor = threading.Thread(target=self._watch, name="hetconv-monitor", daemon=True)
        self._monitor.start()

    def close(self) -> None:
        """Stop the monitor and close every channel (cancelling calls in flight)."""
        self._closed.set()
        if self._joiners is not None:
            self._joiners.close()
        for node in self.nodes + self.pending:
            if node.client is not None:
                node.client.close()

    def _watch(self) -> None:
        """Monitor thread: retry lost workers with backoff, connect joiners, re-read the file."""
        next_file_check = 0.0
        while not self._closed.wait(0.2):
            now = time.monotonic()
            if now >= next_file_check:
                next_file_check = now + 1.0
                if self._workers_file:
                    self._reread_workers_file()
                if self._discovery is not None:
                    self._poll_discovery()
            with self.lock:
                due = [
                    n
                    for n in self.nodes[1:] + self.pending
                    if n.state == LOST and n.backoff.retry_at <= now
                ]
                joining = {id(n) for n in self.pending}
            if self._joiners is not None:  # LAN joiners never reached: concurrently, apart
                lan = [n for n in due if n.source == FROM_LAN and self._never_reached(n, joining)]
                self._joiners.submit(lan)
                taken = {id(n) for n in lan}
                due = [n for n in due if id(n) not in taken]
            for node in due:
                if self._closed.is_set():
                    return
                self._try_rejoin(node)

    @staticmethod
    def _never_reached(node: Node, joining: set[int]) -> bool:
        return id(node) in joining or not node.was_active

    def _try_rejoin(self, node: Node) -> None:
        try:
            probes = self._reconnect(node)
        except WorkerAlias as e:
            self._refuse_alias(node, e)
            return
        except (WorkerAuthError, WorkerTLSError) as e:
            if node.source == FROM_LAN and self._refuse_found(node, e):
                return
            self._retry_later(node, e)
            return
        except Exception as e:  # any failure: try again later, less often
            self._retry_later(node, e)
            return
        with self.lock:
            node.probe_seconds.update(probes)
            node.state = READY
        if node.source == FROM_LAN and self._discovery is not None:
            self._discovery.mark_reached(node.name)  # a flood of newcomers never displaces it

    def _refuse_found(self, node: Node, error: Exception) -> bool:
        """A joiner found on the LAN that refused this master's token or failed its TLS
        check: dropped, reported once, not tried again while it stays advertised (another
        user's worker); whether it was a joiner."""
        with self.lock:
            if node not in self.pending:
                return False
            self.pending.remove(node)
            self._aliases.add(node.name)
        node.client.close()
        self._events.emit("worker_refused", node.name, reason=short_reason(str(error)))
        return True

    def _say_unanswered(self) -> None:
        """One line for every advertised worker never reached that failed since the last
        (at most one a minute: a flood of advertisements is one line, not one per address)."""
        now = time.monotonic()
        with self.lock:
            if not self._unanswered or now - self._unanswered_said < UNANSWERED_EVERY:
                return
            unanswered, self._unanswered = self._unanswered, {}
            self._unanswered_said = now
        first, why = next(iter(unanswered.items()))
        count = len(unanswered)
        self._events.emit(
            "advertised_workers_unanswered",
            count=count,
            reason=f"{first}{f' and {count - 1} more' if count > 1 else ''}: {why}; each is "
            f"tried again on its own backoff (up to {self._retry[1]:g} s)",
        )

    def _retry_later(self, node: Node, e: Exception) -> None:
        """Reaching ``node`` failed: try again after a longer delay, saying so now and then
        (for workers advertised on the LAN and never reached, in one line for all)."""
        with self.lock:
            node.backoff.failures += 1
            delay = node.backoff.delay(*self._retry)
            node.backoff.retry_at = time.monotonic() + delay
            member = any(n is node for n in self.nodes)  # else a joiner, or one gone
            quiet = node.source == FROM_LAN and not (member and node.was_active)
            if quiet:
                self._unanswered[node.name] = short_reason(str(e))
        if quiet:
            return
        if node.backoff.failures == 1 or node.backoff.failures % 5 == 0:
            self._events.emit(
                "worker_unreachable", node.name, attempts=node.backoff.failures,
                retry_in=f"{delay:.1f} s", reason=short_reason(str(e)),
            )  # fmt: skip

    def check_alias(self, node: Node) -> None:
        """Raise :class:`WorkerAlias` if ``node`` (just described) reached the worker process
        of another member or joiner: the same ``instance_id``."""
        if not node.instance_id:  # a worker too old to say
            return
        with self.lock:
            for other in self.nodes[1:] + self.pending:
                same = other.instance_id == node.instance_id
                if same and other is not node and other.state != ALIAS:
                    raise WorkerAlias(node, other)

    def _refuse_alias(self, node: Node, alias: WorkerAlias) -> None:
        """A joiner from the file goes (not tried again while its line stays); a worker named
        at start stays out, never retried."""
        with self.lock:
            joiner = node in self.pending
            if joiner:
                self.pending.remove(node)
                self._aliases.add(node.name)
            else:
                node.state = ALIAS
        if joiner:
            node.client.close()
        self._events.emit("worker_alias", node.name, of=alias.twin.name, reason=str(alias))

    # -- step boundaries ---------------------------------------------------------------

    def admit(self) -> Admission:
        """At a step boundary: workers whose line left the file go, ready ones become active.
        Emits the events; says whether the shares must be planned again."""
        self.failed = set()
        admitted = []
        with self.lock:
            leaving = [n for n in self.nodes[1:] if n.leaving]
            for node in leaving:
                self.nodes.remove(node)
                node.client.close()
            for node in self.nodes[1:]:
                if node.state == READY:
                    node.state = ACTIVE
                    kind = "worker_rejoined" if node.was_active else "worker_joined"
                    admitted.append((node, kind))
                    node.was_active = True
            for node in list(self.pending):
                if node.state == READY:
                    node.state = ACTIVE
                    self.pending.remove(node)
                    self.nodes.append(node)
                    admitted.append((node, "worker_joined"))
            changed = self.replan_needed or bool(admitted) or bool(leaving)
            self.replan_needed = False
        for node in leaving:
            reason = LEAVE_REASONS.get(node.source, LEAVE_REASONS[FROM_FILE])
            self._events.emit("worker_removed", node.name, reason=reason)
        for node, kind in admitted:
            self._events.emit(kind, node.name, device=node.description)
        return Admission(leaving, admitted, changed)

    def idle_workers(self, plans: Mapping[str, Any]) -> list[Node]:
        """Active workers that hold no kernel of any layer in ``plans`` (layer -> its plan, with
        ``shares`` over the nodes, master first): they answer, but compute nothing (a
        worker the planner found not worth its share), unlike a lost one. None before the
        first plan, and none a plan has not split over yet (a worker admitted since)."""
        if not plans:
            return []
        with self.lock:
            return [
                node
                for i, node in enumerate(self.nodes)
                if i > 0
                and node.state == ACTIVE
                and all(i < len(plan.shares) and not plan.shares[i] for plan in plans.values())
            ]

    def everyone_started_is_active(self) -> bool:
        """No worker lost and none joined since the start (fixed shares still apply)."""
        return all(n.state == ACTIVE for n in self.nodes) and not any(n.joined for n in self.nodes)
