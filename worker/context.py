"""What a worker's call handlers use of the worker: one public :class:`WorkerContext`.

The service (:mod:`.service`) owns the gRPC side of every call: the handler threads, the calls
in flight, the refusals and how an answer goes back. The handlers of each feature -- fused
stages (:mod:`.stages`), resident kernels (:mod:`.resident`), the replicated block
(:mod:`.replica`), the block split by images (:mod:`.split`), image groups (:mod:`.overlap`) --
are built on one context and use nothing else of the worker:

* :meth:`WorkerContext.receive`: read a call's request and check it (the tensors the call
  carries, the worker's limits, the memory it will hold);
* :meth:`WorkerContext.run` and :meth:`WorkerContext.submit`: work on the device thread, one
  job at a time, in order (the backend's scratch buffers exist once);
* :meth:`WorkerContext.keep` and :meth:`WorkerContext.kept_for_step`: what a forward leaves
  for its backward, in the worker's memory budget, per session;
* ``config`` (the worker's limits), ``backend``, ``budget``;
* ``replicas`` and ``split``: the replicated block's store and the split block's, which the
  stage calls that name a block take their input from and send their gradients through.

A handler's core returns its answer as :func:`answer` builds it; the service sends it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import threading
from collections.abc import Callable, Hashable, Iterable, Iterator
from concurrent import futures
from typing import TYPE_CHECKING

import numpy as np

from hetconv.backends import Backend
from hetconv.errors import MissingForward
from hetconv.formats import TensorFormat
from hetconv.proto import worker_pb2 as pb
from hetconv.worker.budget import Dropped, MemoryBudget
from hetconv.worker.config import WorkerConfig
from hetconv.worker.idle import CallEnded

if TYPE_CHECKING:
    from hetconv.calls import ConvCall

#: An answer's tensors: name, array, format on the wire.
Answer = list[tuple[str, np.ndarray, TensorFormat]]
#: What reading a request gives: the header, the arrays in the call's order, receive seconds.
Received = tuple[pb.ConvRequest, list[np.ndarray], float]


def answer(formats: dict[str, TensorFormat], arrays: Iterable[np.ndarray]) -> Answer:
    """The answer's tensors: ``arrays`` in the order of ``formats`` (a call's answer formats)."""
    return [(name, a, fmt) for (name, fmt), a in zip(formats.items(), arrays, strict=True)]


def release_free_memory() -> None:
    """Give the C allocator's free pages back to the system (glibc ``malloc_trim``; elsewhere
    nothing): after a call that grew the scratch, its freed medium-sized blocks would otherwise
    stay in the process's resident memory."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        pass


#: Seconds between looks at whether a call waiting for the device still has its caller.
CALLER_LOOK = 0.25


def caller_alive(budget: MemoryBudget) -> Callable[[], bool] | None:
    """Whether the caller of the call this thread serves is still there (its gRPC context is
    active); None when this thread serves no watched call (a core called directly)."""
    watched = getattr(budget.current(), "watched", None)
    return watched.context.is_active if watched is not None else None


class DeviceThread:
    """The one thread every convolution runs on, a job at a time, in order: per-thread scratch
    exists once. After each job the backend's scratch is trimmed to ``keep`` bytes (a job that
    grew it beyond gives the rest back). A job whose caller goes while it is still queued is
    dropped, never run (:meth:`run`).

    Args:
        backend: the device.
        keep: scratch bytes kept between jobs.
    """

    def __init__(self, backend: Backend, keep: int):
        self.backend = backend
        self.keep = keep
        self.trimmed = 0  # times the scratch was trimmed after a job
        self.dropped = 0  # queued jobs dropped, their caller gone
        self._pool = futures.ThreadPoolExecutor(1, thread_name_prefix="hetconv-device")
        # Held by every job: code that runs the backend on its own thread under it still runs
        # one call at a time (but keeps scratch of its own; prefer run).
        self._lock = threading.Lock()

    def submit(self, work: Callable[[], object]) -> futures.Future:
        """``work()`` queued on the device thread (after any job before it)."""

        def job():
            try:
                with self._lock:
                    return work()
            finally:
                trim = getattr(self.backend, "trim_scratch", None)
                if trim is not None and trim(self.keep):
                    self.trimmed += 1
                    release_free_memory()

        return self._pool.submit(job)

    def run(self, work: Callable[[], object], alive: Callable[[], bool] | None = None):
        """``work()`` on the device thread (after any job before it); its result. ``alive``:
        whether the caller is still there, looked at while the job waits its turn.

        Raises:
            CallEnded: the caller went before the job started (it never runs).
        """
        future = self.submit(work)
        if alive is None:
            return future.result()
        while True:
            try:
                return future.result(timeout=CALLER_LOOK)
            except futures.TimeoutError:
                if not alive() and future.cancel():
                    self.dropped += 1
                    gone = "the caller went while the call waited for the device"
                    raise CallEnded(gone) from None

    def close(self) -> None:
        self._pool.shutdown(wait=False)


class WorkerContext:
    """What a call handler may use of the worker it serves in (see the module's docstring).

    Args:
        backend: the device the convolutions run on.
        config: the worker's limits.
        budget: the memory budget calls and kept forward states share.
        device: the device thread.
        receive: reads and checks a call's request: ``receive(messages, call)``, or with a
            third argument, the receive loop's progress hook.
    """

    def __init__(
        self,
        backend: Backend,
        config: WorkerConfig,
        budget: MemoryBudget,
        device: DeviceThread,
        receive: Callable[..., Received],
    ):
        self.backend = backend
        self.config = config
        self.budget = budget
        self._device = device
        self._receive = receive
        # The block stores a stage call may name (its input, its gradients), built on this
        # context and set once by the service: the replicated block's
        # (hetconv.worker.replica.ReplicaCalls) and the split block's
        # (hetconv.worker.split.SplitCalls).
        self.replicas = None
        self.split = None

    def receive(self, messages: Iterator, call: ConvCall, progress=None) -> Received:
        """Read and check ``call``'s request from ``messages``: (header, arrays in the call's
        order, seconds spent receiving). ``progress(header, receiver)`` runs as data arrives
        (:func:`~hetconv.wire.receive_stream`'s hook).

        Raises:
            WireError: the request is malformed, not the call's, or beyond a limit.
            OverBudget: what it would hold does not fit the memory budget.
        """
        if progress is None:
            return self._receive(messages, call)
        return self._receive(messages, call, progress)

    def run(self, work: Callable[[], object]):
        """``work()`` on the device thread, after any job before it; its result.

        Raises:
            CallEnded: the call's caller went before the job started (it never runs).
        """
        return self._device.run(work, caller_alive(self.budget))

    def submit(self, work: Callable[[], object]) -> futures.Future:
        """``work()`` queued on the device thread, after any job before it."""
        return self._device.submit(work)

    def keep(
        self,
        request: pb.ConvRequest,
        key: Hashable,
        kept,
        replaces: Callable[[Hashable, object], bool] | None = None,
    ) -> None:
        """Keep ``kept`` (it has ``step`` and ``held_bytes``) for the request's session under
        ``key`` in the memory budget, replacing what that key held and every state of the
        session for which ``replaces(key, state)`` is true
        (:meth:`~hetconv.worker.budget.MemoryBudget.save`)."""
        self.budget.save(request.session, key, kept, replaces=replaces)

    def kept_for_step(self, request: pb.ConvRequest, key, missing: Callable[[str], str]):
        """What the request's session keeps under ``key`` for the request's step; else
        MissingForward naming why: the memory budget dropped it, or ``missing(have)`` (``have``:
        "nothing", or the step it holds)."""
        kept = self.budget.saved(request.session, key)
        if kept is None or kept.step != request.step:
            if kept is None and (dropped := self.budget.dropped(request.session, key)) is not None:
                raise MissingForward(self.dropped_message(request, dropped))
            raise MissingForward(missing("nothing" if kept is None else f"step {kept.step}"))
        return kept

    def dropped_message(self, request: pb.ConvRequest, dropped: Dropped) -> str:
        """Why the request's forward state is gone (the memory budget dropped it), and what to
        start the worker with instead."""
        head = f"no forward pass of layer {request.layer!r} at step {request.step} for this session"
        mib = self.config.memory_bytes >> 20
        if dropped.cause == "share":
            share = self.budget.session_share >> 20
            return (
                f"{head}: this worker dropped its saved inputs to keep the session within its "
                f"share of the memory budget (--memory-mib {mib} MiB, less the device "
                f"scratch, / {self.config.sessions} sessions = {share} MiB); start it with a "
                "larger --memory-mib or a smaller --sessions"
            )
        n = self.config.sessions
        return (
            f"{head}: this worker dropped the session's saved inputs to make room for "
            f"another master's (it keeps {n} session{'s' if n != 1 else ''} at once in a "
            f"memory budget of {mib} MiB, and more masters use it); start it with a larger "
            "--sessions or --memory-mib"
        )


__all__ = [
    "Answer",
    "DeviceThread",
    "Received",
    "WorkerContext",
    "answer",
    "caller_alive",
    "release_free_memory",
]
