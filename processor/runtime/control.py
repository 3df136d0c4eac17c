"""The control plane between the checkpoint coordinator and the workers.

One TCP connection per worker, carrying length-prefixed JSON objects (orjson). The same transport
serves the local runner and the Spark runner (the driver hosts the coordinator; executors connect
to it), so the protocol has one implementation. Messages are small and few (a trigger, an ack per
task, a completion notice per checkpoint, stats every second), so a thread per connection is
plenty.

Messages (``"t"`` is the type):

===================  ====================  ==============================================
type                 direction             fields
===================  ====================  ==============================================
``hello``            worker -> coordinator  worker, generation, pid, tasks
``ack``              worker -> coordinator  chk, task, handle {path, size, checksum}, info
``decline``          worker -> coordinator  chk, task, reason
``committed``        worker -> coordinator  chk, task
``stats``            worker -> coordinator  worker, per-task counters, drained
``trigger``          coordinator -> worker  chk
``complete``         coordinator -> worker  chk
``abort``            coordinator -> worker  chk, reason
``stop``             coordinator -> worker
===================  ====================  ==============================================

Nothing is unpickled: a frame is JSON or it is refused.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import socket
import struct
import threading
from typing import Any

import orjson

__all__ = ["Connection", "ControlClient", "ControlServer"]

log = logging.getLogger(__name__)

_LEN = struct.Struct(">I")
MAX_FRAME = 16 * 1024 * 1024


class Connection:
    """One framed, thread-safe connection."""

    def __init__(self, sock: socket.socket, peer: str) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.peer = peer
        self._lock = threading.Lock()
        self.closed = False
        self.worker: int | None = None

    def send(self, msg: dict[str, Any]) -> bool:
        """Send ``msg``; False if the connection is gone."""
        data = orjson.dumps(msg)
        try:
            with self._lock:
                self.sock.sendall(_LEN.pack(len(data)) + data)
            return True
        except OSError:
            self.closed = True
            return False

    def _recv_exact(self, n: int) -> bytes | None:
        buf = bytearray()
        while len(buf) < n:
            try:
                chunk = self.sock.recv(n - len(buf))
            except OSError:
                return None
            if not chunk:
                return None
            buf += chunk
        return bytes(buf)

    def recv(self) -> dict[str, Any] | None:
        """The next message, or None when the peer closed the connection."""
        head = self._recv_exact(_LEN.size)
        if head is None:
            return None
        (length,) = _LEN.unpack(head)
        if length > MAX_FRAME:
            log.error("control frame of %d bytes from %s refused", length, self.peer)
            return None
        body = self._recv_exact(length)
        if body is None:
            return None
        try:
            msg = orjson.loads(body)
        except orjson.JSONDecodeError:
            log.error("control frame from %s is not JSON; closing", self.peer)
            return None
        return msg if isinstance(msg, dict) else None

    def hangup(self) -> None:
        """Half-close: the peer reads end-of-stream (a worker exits on it) while this side
        still learns when the peer closes its end (:attr:`closed` turns true)."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


class ControlServer:
    """Accepts worker connections; every message lands in :attr:`inbox` as ``(conn, msg)``.

    A closed connection arrives as ``(conn, None)``; :meth:`wake` puts ``(None, None)``.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self._listener = socket.create_server((host, port))
        self.address = self._listener.getsockname()[:2]
        self.inbox: queue.Queue[tuple[Connection | None, dict[str, Any] | None]] = queue.Queue()
        self.connections: list[Connection] = []
        self._stopped = False
        threading.Thread(target=self._accept, name="control-accept", daemon=True).start()

    def _accept(self) -> None:
        while not self._stopped:
            try:
                sock, peer = self._listener.accept()
            except OSError:
                return
            conn = Connection(sock, f"{peer[0]}:{peer[1]}")
            if self._stopped:
                conn.close()
                return
            self.connections.append(conn)
            threading.Thread(
                target=self._read, args=(conn,), name=f"control-{conn.peer}", daemon=True
            ).start()

    def _read(self, conn: Connection) -> None:
        while True:
            msg = conn.recv()
            self.inbox.put((conn, msg))
            if msg is None:
                conn.closed = True
                return

    def wake(self) -> None:
        """Ends the wait of whoever waits on :attr:`inbox` (another thread has news for it)."""
        self.inbox.put((None, None))

    def broadcast(self, msg: dict[str, Any]) -> None:
        """Send ``msg`` to every worker the runner admitted (:attr:`Connection.worker` set on
        its hello): a connection that never said hello, or a zombie of an older generation,
        gets no trigger, completion or abort."""
        for conn in list(self.connections):
            if not conn.closed and conn.worker is not None:
                conn.send(msg)

    def drop(self, conn: Connection) -> None:
        """Close one worker's connection (it restarts alone)."""
        conn.close()
        if conn in self.connections:
            self.connections.remove(conn)

    def drop_all(self) -> None:
        """Close every worker connection (before a new generation starts)."""
        for conn in self.connections:
            conn.close()
        self.connections = []

    def close(self) -> None:
        self._stopped = True
        self.drop_all()
        self._listener.close()


class ControlClient:
    """The worker's end: connects, sends, and queues what the coordinator says in :attr:`inbox`."""

    def __init__(self, host: str, port: int, *, timeout: float = 30.0) -> None:
        sock = socket.create_connection((host, port), timeout=timeout)
        sock.settimeout(None)
        self.conn = Connection(sock, f"{host}:{port}")
        self.inbox: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=self._read, name="control-client", daemon=True).start()

    def _read(self) -> None:
        while True:
            msg = self.conn.recv()
            self.inbox.put(msg)
            if msg is None:
                return

    def send(self, msg: dict[str, Any]) -> bool:
        return self.conn.send(msg)

    def close(self) -> None:
        self.conn.close()
