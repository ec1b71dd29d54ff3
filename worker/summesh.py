"""Batch norm's small sums among a ring's workers over plain TCP: the sum mesh.

A step split by images with batch norm sums two small vectors per batch norm layer among the
workers, mid-pass (:func:`hetconv.imagesplit.sync_batchnorm`, :meth:`RingCalls.sum64
<hetconv.worker.ring.RingCalls.sum64>`): resnet20 takes 42 a step, each in
``ceil(log2(workers))`` rounds of one part out and one in. As ``RingPart`` calls, a part's
software (a gRPC call at both ends, a sender thread, the server's handler thread) took about
3.5 ms of a core per sum, most of a capped worker's step (resnet20 batch 64, 4 workers at 0.36
of a core: 0.55-0.59 s of a 0.74 s pass). Here a part is one frame written on a connection
kept open to the peer, from the thread that sums, and read by a thread per connection that
files it where the sum waits for it (the same place a ``RingPart`` files it, so the waits,
the aborts and the deadlines are the ring's own).

Every worker that may ring listens on a TCP port of its own, on its gRPC host
(:class:`SumListener`; its Describe answers the port as ``sum_port``); the master gives each
ring's ports with its peers (``ImagesRing.sum_ports``). A connection starts with a hello: the
magic bytes, then the worker's token (the one its gRPC calls carry; empty without one), which
the listening worker compares with its own and closes the connection on a mismatch; then
frames, each a header (session, step, round, segment, count of float32 values) and the values.
A frame the ring refuses (:meth:`RingCalls.file <hetconv.worker.ring.RingCalls.file>`: not
finite, too far ahead, over the memory budget) closes its connection, so the sender's next part
fails and its ring aborts. Like ``RingPart`` calls between workers, the mesh is plain TCP: a
worker serving TLS listens on none (the ring refuses TLS).
"""

from __future__ import annotations

import hmac
import socket
import struct
import sys
import threading

import numpy as np

#: A connection's first bytes, then the token's length (2 bytes) and the token.
MAGIC = b"HCSM1\n"
#: A frame's header: session, step, round, segment, count of float32 values.
FRAME = struct.Struct("<QQIII")
#: The most values one frame may carry (a sum's parts are batch norm's channels: a few
#: thousand; a frame past this closes its connection).
MAX_VALUES = 1 << 20
#: Seconds a connection to a peer may take to open, and a frame to be written.
CONNECT_S = 5.0
SEND_S = 30.0
#: Seconds a new connection has to say its hello; connections a listener keeps at most (a
#: ring's peers hold one each; one past it is closed at once).
HELLO_S = 10.0
MAX_CONNECTIONS = 256


class SumListener:
    """The port a worker's ring peers put batch norm's sums into: an accepting thread and a
    reading thread per connection, each frame given to ``file(session, step, round, segment,
    values)`` (an exception from it closes the connection)."""

    def __init__(self, host: str, file, token: str | None = None, port: int = 0):
        self._file = file
        self._token = (token or "").encode()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.socket(family, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))
        self._socket.listen(64)
        self.port = self._socket.getsockname()[1]
        self._closed = False
        self._connections: set[socket.socket] = set()
        self._lock = threading.Lock()
        self.frames = 0  # frames filed since start
        threading.Thread(target=self._accept, name="hetconv-summesh", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                connection, _ = self._socket.accept()
            except OSError:
                return  # closed
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                if self._closed:
                    connection.close()
                    return
                if len(self._connections) >= MAX_CONNECTIONS:
                    connection.close()
                    continue
                self._connections.add(connection)
            threading.Thread(
                target=self._read, args=(connection,), name="hetconv-summesh-in", daemon=True
            ).start()

    def _read(self, connection: socket.socket) -> None:
        try:
            connection.settimeout(HELLO_S)
            if _exactly(connection, len(MAGIC)) != MAGIC:
                return
            (length,) = struct.unpack("<H", _exactly(connection, 2))
            if not hmac.compare_digest(_exactly(connection, length), self._token):
                print("hetconv worker: a sum port connection with a wrong token, closed",
                      file=sys.stderr, flush=True)  # fmt: skip
                return
            connection.settimeout(None)  # a peer's parts come whenever its ring runs
            while True:
                session, step, round_, segment, count = FRAME.unpack(
                    _exactly(connection, FRAME.size)
                )
                if count > MAX_VALUES:
                    return
                values = np.empty(count, np.float32)
                _into(connection, memoryview(values).cast("B"))
                self._file(session, step, round_, segment, values)
                self.frames += 1
        except (OSError, EOFError):
            return
        except Exception as e:  # refused by the ring: the sender's next frame fails
            print(f"hetconv worker: a sum port frame refused: {e}", file=sys.stderr, flush=True)
            return
        finally:
            with self._lock:
                self._connections.discard(connection)
            connection.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            connections, self._connections = list(self._connections), set()
        try:  # wakes the accepting thread (a close alone leaves its accept listening)
            self._socket.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._socket.close()
        for connection in connections:
            try:
                connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            connection.close()


class SumLinks:
    """A worker's connections to its ring peers' sum ports, opened at the first part and kept
    (one per peer, whatever the session); a part that cannot be written drops its connection
    and raises OSError (the next part opens a new one)."""

    def __init__(self, token: str | None = None):
        token_bytes = (token or "").encode()
        self._hello = MAGIC + struct.pack("<H", len(token_bytes)) + token_bytes
        self._sockets: dict[tuple[str, int], tuple[socket.socket, threading.Lock]] = {}
        self._lock = threading.Lock()
        self._failed: set[tuple[str, int]] = set()  # sum ports a part could not be written to

    def _socket(self, host: str, port: int) -> tuple[socket.socket, threading.Lock]:
        key = (host, port)
        with self._lock:
            got = self._sockets.get(key)
        if got is not None:
            return got
        connection = socket.create_connection((host, port), timeout=CONNECT_S)
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        connection.settimeout(SEND_S)
        connection.sendall(self._hello)
        got = (connection, threading.Lock())
        with self._lock:
            old = self._sockets.setdefault(key, got)
        if old is not got:
            connection.close()
        return old

    def usable(self, address: str, port: int) -> bool:
        """Whether parts go to this sum port: no part written there failed (a peer that
        cannot be reached there, behind a firewall say, is put RingPart calls instead; one
        restarted answers another port, tried afresh)."""
        return (_host(address), port) not in self._failed

    def send(
        self, address: str, port: int, session: int, step: int, round_: int, segment: int,
        values: np.ndarray,
    ) -> None:  # fmt: skip
        """Write ``values`` (float32) as the part (session, step, round, segment) to the sum
        port ``port`` on ``address``'s host; OSError where it cannot (the port is then no
        longer :meth:`usable`)."""
        host = _host(address)
        try:
            self._write(host, port, session, step, round_, segment, values)
        except OSError as e:
            with self._lock:
                self._failed.add((host, port))
            print(f"hetconv worker: the sum port {host}:{port} failed ({type(e).__name__}); "
                  "its parts go as RingPart calls", file=sys.stderr, flush=True)  # fmt: skip
            raise

    def _write(self, host, port, session, step, round_, segment, values) -> None:
        values = np.ascontiguousarray(values, np.float32)
        header = FRAME.pack(session, step, round_, segment, values.size)
        connection, lock = self._socket(host, port)
        try:
            with lock:
                _send(connection, header, memoryview(values).cast("B"))
        except OSError:
            with self._lock:
                if self._sockets.get((host, port), (None,))[0] is connection:
                    del self._sockets[(host, port)]
            connection.close()
            raise

    def close(self) -> None:
        with self._lock:
            sockets, self._sockets = list(self._sockets.values()), {}
        for connection, _ in sockets:
            connection.close()


def _host(address: str) -> str:
    return address.rpartition(":")[0].strip("[]")


def _send(connection: socket.socket, header: bytes, body: memoryview) -> None:
    """``header`` then ``body`` in one write where the kernel takes them (no copy of
    ``body``), the rest after."""
    sent = connection.sendmsg([header, body])
    if sent < len(header):
        connection.sendall(header[sent:])
        sent = len(header)
    if sent - len(header) < len(body):
        connection.sendall(body[sent - len(header) :])


def _exactly(connection: socket.socket, size: int) -> bytes:
    data = connection.recv(size, socket.MSG_WAITALL)
    if len(data) != size:
        raise EOFError("the connection closed")
    return data


def _into(connection: socket.socket, view: memoryview) -> None:
    while view:
        got = connection.recv_into(view)
        if not got:
            raise EOFError("the connection closed")
        view = view[got:]


__all__ = ["MAGIC", "SumLinks", "SumListener"]
