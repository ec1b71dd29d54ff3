"""A worker's calls to and waits on its peers of a block split by images
(:mod:`hetconv.worker.split`): the senders that put parts into the other workers, each put with
a deadline and each session with threads of its own, and the call that waits for parts, which
ends with its caller.
"""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import numpy as np

from hetconv.argtypes import parse_address
from hetconv.calls import DESCRIBE, PUT_PART
from hetconv.errors import InvalidCall, WireError
from hetconv.formats import TensorFormat
from hetconv.proto import worker_pb2 as pb
from hetconv.security import bearer_metadata
from hetconv.wire import BUNDLE_BYTES, Bundle, channel_options, chunks, encode_tensors
from hetconv.worker.context import WorkerContext

#: Seconds a part put into a peer may take (a peer that takes it no faster is no matter here:
#: the master loses it in its own call).
PART_SEND = 60.0
#: Sender threads per session: a peer that never answers holds only its session's.
SENDERS = 4
#: Seconds a reach check (:func:`reach_peers`) gives each peer by default, and at most.
REACH_S = 2.0
REACH_MOST_S = 10.0
#: Peers one reach check tries at most (a cluster's workers).
REACH_PEERS = 256


class CallerGone(WireError):
    """The call that waited was cancelled by its caller, or ended by the idle watch."""

    status = grpc.StatusCode.CANCELLED


class PeerLinks:
    """One session's channels to the other workers, reused, and the threads that send them
    parts (each put with a deadline, :data:`PART_SEND`)."""

    #: The call its puts make (a subclass names another of the same shape).
    call = PUT_PART

    def __init__(self, token: str | None = None, threads: int = SENDERS):
        self._metadata = bearer_metadata(token) if token is not None else None
        self._channels: dict[str, tuple[grpc.Channel, object, object]] = {}
        self._lock = threading.Lock()
        self._pool = futures.ThreadPoolExecutor(threads, thread_name_prefix="hetconv-peer")

    def _stubs(self, address: str):
        with self._lock:
            got = self._channels.get(address)
            if got is None:
                channel = grpc.insecure_channel(address, options=channel_options())
                call = self.call
                got = (channel, call.stream.stub(channel), call.bundle.stub(channel))
                self._channels[address] = got
            return got

    def put(
        self, address: str, request: pb.ConvRequest, part: np.ndarray, fmt: TensorFormat, timeout
    ) -> None:
        """Send ``part`` to ``address`` as PutPart ``request`` (blocking)."""
        out = encode_tensors([("p", part)], [fmt])
        request.tensors.extend(out.headers)
        head = pb.ConvMessage(header=request)
        _, stream, bundle = self._stubs(address)
        if out.nbytes <= BUNDLE_BYTES:
            bundle(Bundle(head, out.segments), timeout=timeout, metadata=self._metadata)
        else:

            def messages():
                yield head
                yield from chunks(out.segments)

            for _ in stream(messages(), timeout=timeout, metadata=self._metadata):
                pass

    def put_later(self, address, request, part, fmt, timeout) -> futures.Future:
        """:meth:`put` on a sender thread."""
        return self._pool.submit(self.put, address, request, part, fmt, timeout)

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        with self._lock:
            for channel, *_ in self._channels.values():
                channel.close()
            self._channels.clear()


def reach_peers(
    addresses, token: str | None, timeout: float = 0.0, tls: bool = False
) -> dict[str, str]:
    """Address -> why it could not be reached, of the ``addresses`` (other workers, as the
    master reaches them) this worker cannot call: a Describe on each, all at once, each
    within ``timeout`` seconds (0: :data:`REACH_S`; at most :data:`REACH_MOST_S`), with
    ``token`` (this worker's own, as a split's parts are put). A worker serving TLS reaches
    none (a split needs plain channels). So the check ends in about ``timeout`` whatever
    the peers do.

    Raises:
        InvalidCall: an address that is not HOST:PORT, too many, or a bad timeout.
    """
    addresses = list(addresses)
    if len(addresses) > REACH_PEERS:
        raise InvalidCall(f"{len(addresses)} peers to reach: at most {REACH_PEERS}")
    if not 0 <= timeout <= REACH_MOST_S:  # NaN too
        raise InvalidCall(f"peer timeout {timeout} s: expected 0 to {REACH_MOST_S} s")
    for address in addresses:
        try:
            parse_address(address, "peer")
        except ValueError as e:
            raise InvalidCall(str(e)) from None
    if tls:
        why = "this worker serves TLS: a split's exchange runs on plain channels only"
        return dict.fromkeys(addresses, why)
    timeout = timeout or REACH_S
    metadata = bearer_metadata(token) if token is not None else None

    def reach(address: str) -> str | None:
        channel = grpc.insecure_channel(address, options=channel_options())
        try:
            DESCRIBE.method.stub(channel)(pb.DescribeRequest(), timeout=timeout, metadata=metadata)
            return None
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return f"no answer in {timeout:g} s"
            detail = (e.details() or "").splitlines()[0] if e.details() else ""
            return f"{e.code().name.lower()}: {detail}" if detail else e.code().name.lower()
        finally:
            channel.close()

    unique = list(dict.fromkeys(addresses))
    if not unique:
        return {}
    with futures.ThreadPoolExecutor(min(len(unique), 32), "hetconv-reach") as pool:
        answers = dict(zip(unique, pool.map(reach, unique), strict=True))
    return {address: why for address, why in answers.items() if why is not None}


class PreparedPeers:
    """Per session, the peer addresses its master prepared: a worker connects to no other.

    The session's first split fixes them, as does a later one that sets ``prepare`` (the master
    does when its split gains a worker); any other split naming an address they do not hold is
    refused, naming it, before anything is sent. Calls without the worker's token are refused
    before any handler runs (:mod:`hetconv.worker.auth`), and sessions are 64 random bits the
    master draws, so no caller in another session changes them. At most ``sessions`` are kept
    (the least recently prepared go: their next split fixes them again)."""

    def __init__(self, sessions: int):
        self.sessions = sessions
        self._held: dict[int, frozenset[str]] = {}
        self._lock = threading.Lock()

    def admit(self, session: int, addresses, prepare: bool) -> None:
        named = frozenset(addresses)
        with self._lock:
            fixed = self._held.get(session)
            if fixed is None or prepare:
                self._held.pop(session, None)
                self._held[session] = named  # the most recent last
                while len(self._held) > self.sessions:
                    del self._held[next(iter(self._held))]
                return
        strangers = sorted(named - fixed)
        if strangers:
            raise InvalidCall(
                f"split peer {', '.join(strangers)} is not one of session {session}'s prepared "
                f"peers ({', '.join(sorted(fixed))}): a split may name only those, or prepare "
                "the session's peers anew"
            )


class WaitingCall:
    """The gRPC call this thread serves, as a wait on other nodes sees it: whether its caller
    is still there, how long it may still take, and its idle clock (the service's watch of the
    call, :class:`~hetconv.worker.idle.Watched`; none when a core is called directly)."""

    def __init__(self, context: WorkerContext, changed: threading.Condition):
        memory = context.budget.current()
        self.watched = getattr(memory, "watched", None)
        self.call = self.watched.context if self.watched is not None else None
        self.start = time.monotonic()
        self.gone = False
        if self.call is not None:

            def ended() -> None:
                self.gone = True
                with changed:
                    changed.notify_all()

            if not self.call.add_callback(ended):
                self.gone = True

    def time_left(self, most: float) -> float:
        """Seconds the call may still take: its deadline's, at most ``most``."""
        left = self.call.time_remaining() if self.call is not None else None
        return most if left is None else max(0.0, min(most, left))

    def waited(self) -> float:
        return time.monotonic() - self.start

    def check(self, idle: bool, raising: bool = True) -> None:
        """Raise :class:`CallerGone` when the call has ended (its caller went, or the idle watch
        ended it); start (``idle``) or stop the call's idle clock."""
        if self.watched is not None:
            if not idle:
                self.watched.waiting_since = None
            elif self.watched.waiting_since is None:
                self.watched.waiting_since = time.monotonic()
        if raising and (self.gone or (self.call is not None and not self.call.is_active())):
            expired = self.watched.expired if self.watched is not None else None
            raise CallerGone(expired or "the caller cancelled the call while it waited on peers")


__all__ = [
    "PART_SEND",
    "REACH_S",
    "SENDERS",
    "CallerGone",
    "PeerLinks",
    "PreparedPeers",
    "WaitingCall",
    "reach_peers",
]
