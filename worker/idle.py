"""Close calls whose client stopped sending or reading, so a stalled stream frees its thread.

A streaming call's handler thread waits on the client twice: for each request message, and for
each answer chunk to be taken off its hands (HTTP/2 flow control blocks the send once the client
stops reading). A client that sends a header and then nothing, or never reads its answer, would
hold the thread, and the call's memory, for ever. :class:`IdleWatch` times only those waits --
never the worker's own work (waiting for the device, computing) -- and ends a call that has
waited ``timeout`` seconds on its client with DEADLINE_EXCEEDED, naming the idle time and
``--idle-timeout``. The handler's wait then fails, its thread returns to the pool and its
memory reservation is released.

Seen with grpcio 1.85 here: when several calls of one connection are ended while their client
still holds its request side open (it stalled mid-request), that connection's later calls are
often refused by the server (REFUSED_STREAM, UNAVAILABLE at the client) until the client opens a
new connection. Only the connection that stalled is affected; other clients' calls are not.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import grpc

from hetconv.errors import WireError


class CallEnded(WireError):
    """A call that is over already (its caller went, or the idle watch ended it): nothing is
    left to answer."""

    status = grpc.StatusCode.CANCELLED


class IdleTimeout(CallEnded):
    """A call whose client sent or read nothing for the idle timeout."""

    status = grpc.StatusCode.DEADLINE_EXCEEDED


def _end_call(context, details: str) -> None:
    """End the call of ``context`` now, from any thread, with DEADLINE_EXCEEDED and ``details``.

    The public ``context.cancel()`` gives the client a bare CANCELLED; the server call object
    underneath (grpcio's ``cygrpc`` call) takes a status and details, which the client then
    sees. Where that object is not there (another grpcio), the public cancel still ends it.
    """
    try:
        from grpc._cython import cygrpc

        context._rpc_event.call.cancel(cygrpc.StatusCode.deadline_exceeded, details)
    except Exception:  # noqa: BLE001 - any failure: the public API still frees the thread
        context.cancel()


class Watched:
    """One call under watch: the time it has been waiting on its client, if it is."""

    def __init__(self, watch: IdleWatch, context, name: str):
        self.watch, self.context, self.name = watch, context, name
        self.waiting_since: float | None = None
        self.expired: str | None = None  # the details it was ended with

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """The ``with`` body waits on the client: it counts towards the idle timeout."""
        self.waiting_since = time.monotonic()
        try:
            yield
        finally:
            self.waiting_since = None

    def messages(self, messages: Iterator) -> Iterator:
        """``messages``, each wait for the next one watched.

        Raises:
            IdleTimeout: the watch ended the call while it waited.
        """
        iterator = iter(messages)
        while True:
            try:
                with self.waiting():
                    message = next(iterator)
            except StopIteration:
                return
            except grpc.RpcError:
                if self.expired is not None:
                    raise IdleTimeout(self.expired) from None
                raise
            yield message


class IdleWatch:
    """A thread that ends calls idle on their client for ``timeout`` seconds.

    Args:
        timeout: seconds a call may wait on its client (``hetconv worker --idle-timeout``);
            None: never ended for that.
    """

    def __init__(self, timeout: float | None):
        if timeout is not None and timeout <= 0:
            raise ValueError(f"idle timeout must be positive, got {timeout}")
        self.timeout = timeout
        self.ended = 0  # calls ended for idling
        self._calls: set[Watched] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @contextmanager
    def call(self, context, name: str) -> Iterator[Watched]:
        """Watch the call of ``context`` for the duration of the ``with``."""
        watched = Watched(self, context, name)
        if self.timeout is None:
            yield watched
            return
        with self._lock:
            self._calls.add(watched)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="hetconv-idle-watch", daemon=True
                )
                self._thread.start()
        try:
            yield watched
        finally:
            with self._lock:
                self._calls.discard(watched)

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        assert self.timeout is not None
        tick = min(0.5, self.timeout / 4)
        while not self._stop.wait(tick):
            now = time.monotonic()
            with self._lock:
                idle = [
                    w
                    for w in self._calls
                    if w.expired is None
                    and w.waiting_since is not None
                    and now - w.waiting_since >= self.timeout
                ]
            for watched in idle:
                waited = now - (watched.waiting_since or now)
                watched.expired = (
                    f"{watched.name}: no message from the client and none taken from it for "
                    f"{waited:.1f} s (this worker's --idle-timeout is {self.timeout:g} s): "
                    "call ended"
                )
                self.ended += 1
                _end_call(watched.context, watched.expired)


__all__ = ["CallEnded", "IdleTimeout", "IdleWatch", "Watched"]
