"""A worker call running on a thread of its own, which the master waits on (or watches)."""

from __future__ import annotations

import threading


class Call:
    """One worker call running on its own daemon thread.

    Not a thread pool: after Ctrl-C interrupts the main thread while it waits, a pool's
    non-daemon threads can be left blocked on a lock the interrupted wait still holds, and the
    interpreter joins them at exit forever (seen here). Daemon threads never keep it alive; a
    call costs a thread start (~0.1 ms) next to calls of milliseconds.
    """

    def __init__(self, fn, *args, **kwargs):
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._watchers: list[threading.Event] = []
        self._value = self._error = None
        self._thread = threading.Thread(
            target=self._run, args=(fn, args, kwargs), name="hetconv-call", daemon=True
        )
        self._thread.start()

    def _run(self, fn, args, kwargs) -> None:
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
