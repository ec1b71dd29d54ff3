"""A worker call running on a thread of its own, which the master waits on (or watches)."""

from __future__ import annotations

import queue
import threading


class _Threads:
    """Daemon threads that run calls, kept between them: a call takes an idle one, or starts a
    new one when none is idle, so the threads number the most calls ever in flight at once.

    Not a thread pool of the standard library: after Ctrl-C interrupts the main thread while it
    waits, a pool's non-daemon threads can be left blocked on a lock the interrupted wait still
    holds, and the interpreter joins them at exit forever (seen here). Daemon threads never keep
    it alive. Kept, not one per call: starting a thread makes the starter wait until the new
    thread runs, which under a CPU cap (a laptop's share of a core, ``benchmarks/testbed.py``)
    cost the master tens of milliseconds a step in a profile (py-spy, 12-16 calls a step).
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0

    def run(self, call: Call) -> None:
        with self._lock:
            start = not self._idle
            if not start:
                self._idle -= 1
        self._jobs.put(call)
        if start:
            threading.Thread(target=self._serve, name="hetconv-call", daemon=True).start()

    def _serve(self) -> None:
        while True:
            self._jobs.get()._run()
            with self._lock:
                self._idle += 1


_THREADS = _Threads()


class Call:
    """One worker call running on a daemon thread (:class:`_Threads`)."""

    def __init__(self, fn, *args, **kwargs):
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._watchers: list[threading.Event] = []
        self._value = self._error = None
        self._work = (fn, args, kwargs)
        _THREADS.run(self)

    def _run(self) -> None:
        fn, args, kwargs = self._work
        self._work = None
        try:
            self._value = fn(*args, **kwargs)
        except BaseException as e:  # handed to the waiting thread
            self._error = e
        finally:
            with self._lock:
                self._done.set()
                for event in self._watchers:
                    event.set()

    def notify(self, event: threading.Event) -> None:
        """Set ``event`` when the call ends (now, if it has)."""
        with self._lock:
            self._watchers.append(event)
            if self._done.is_set():
                event.set()

    def done(self) -> bool:
        return self._done.is_set()

    def failed(self) -> bool:
        """Whether it ended with an error (an Exception; not a KeyboardInterrupt)."""
        return self._done.is_set() and isinstance(self._error, Exception)

    def error(self) -> BaseException | None:
        return self._error

    def result(self):
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._value


__all__ = ["Call"]
