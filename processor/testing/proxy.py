"""A loopback TCP proxy that injects network faults: partitions, latency, resets.

Put a :class:`FaultProxy` between a client and a server (a Kafka broker whose advertised listener
is the proxy, a Redis, anything speaking TCP) and break the network on purpose::

    with FaultProxy("127.0.0.1", redis_port) as proxy:
        client = redis.Redis(port=proxy.port)
        proxy.black_hole(seconds=5)    # a partition: connections stay open, nothing moves
        proxy.delay(0.2)               # 200 ms more latency each way, until healed
        proxy.reset()                  # RST every connection, refuse new ones
        proxy.heal()                   # back to a plain forwarder

The faults, and what a client sees:

* **black hole** (a network partition): connections stay established and new ones are accepted,
  but no byte moves in either direction. Bytes already read are held, not dropped, and flow when
  the partition heals: what TCP retransmission does when a partition ends before the kernel gives
  up. A client that timed out in between closes its connection, and the proxy closes the other
  side. New connections reach the server only after the partition heals.
* **delay**: every chunk is forwarded ``seconds`` after it arrived, in order, in both directions
  (latency, not a bandwidth limit).
* **reset** (a crashed server, a firewall that rejects): every open connection is aborted with a
  TCP RST on both sides, and the listening socket is closed, so new connections are refused
  (``ECONNREFUSED``) until :meth:`FaultProxy.heal` opens it again on the same port.

With ``kafka=True`` the proxy also frames each connection as Kafka protocol: it writes its own
address over the broker addresses the broker answers with, so that every client connection
stays on the proxy (any single-broker cluster, without touching its ``advertised.listeners``),
and it can make the broker answer with an error it would give on a real cluster
(:meth:`FaultProxy.fail_list_offsets`, :mod:`processor.testing.kafka_wire`).

Each fault lasts ``seconds`` (healed by a timer) or until :meth:`FaultProxy.heal`. Calling a
fault while another is on replaces it; ``delay`` combines with the others.

The proxy runs an asyncio event loop on one daemon thread of its own; its methods are
thread-safe and return once the fault is in effect. :meth:`FaultProxy.stop` closes everything.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
import threading
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from processor.testing.kafka_wire import (
    LIST_OFFSETS,
    NOT_LEADER_OR_FOLLOWER,
    ErrorRule,
    KafkaTap,
)

__all__ = ["FaultProxy", "ProxyStats"]

log = logging.getLogger(__name__)

_CHUNK = 65536
_T = TypeVar("_T")


@dataclass
class ProxyStats:
    """Counters since the proxy started (read them for a test's report)."""

    accepted: int = 0
    active: int = 0
    reset: int = 0
    bytes_up: int = 0  # client -> server
    bytes_down: int = 0  # server -> client


class _Conn:
    """One proxied connection: the two sides and the tasks that pump between them."""

    def __init__(self, client: asyncio.StreamWriter, tap: KafkaTap | None = None) -> None:
        self.client = client
        self.server: asyncio.StreamWriter | None = None
        self.tasks: list[asyncio.Task[None]] = []
        self.tap = tap

    def abort(self) -> None:
        """Close both sides with a TCP RST (SO_LINGER 0), not a FIN."""
        for writer in (self.client, self.server):
            if writer is None:
                continue
            sock = writer.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
        for task in self.tasks:
            task.cancel()


class FaultProxy:
    """A TCP proxy from ``127.0.0.1:port`` to ``target_host:target_port`` that injects faults.

    Args:
        target_host: where to forward to.
        target_port: its port.
        port: the port to listen on (0: a free one, see :attr:`port` once started).
        listen_host: the address to listen on (loopback by default).
        kafka: the server is a single Kafka broker: frame every connection, advertise the
            proxy's address in its answers, and let :meth:`fail_list_offsets` rewrite them.

    Invariants:
        Bytes are forwarded in order and never dropped or duplicated while the proxy forwards;
        a fault stops or aborts a connection, it never corrupts one.
    """

    def __init__(
        self,
        target_host: str,
        target_port: int,
        *,
        port: int = 0,
        listen_host: str = "127.0.0.1",
        kafka: bool = False,
    ) -> None:
        self.target = (target_host, int(target_port))
        self.kafka = kafka
        self._rules: list[ErrorRule] = []
        self.listen_host = listen_host
        self.port = port
        self.stats = ProxyStats()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None
        self._conns: set[_Conn] = set()
        self._flowing: asyncio.Event | None = None  # set unless black-holed
        self._refusing = False
        self._latency = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._latency_timer: asyncio.TimerHandle | None = None
        self._fault = "none"

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> FaultProxy:
        """Listen and forward; returns once the port is bound (see :attr:`port`)."""
        if self._thread is not None:
            raise RuntimeError("the proxy is already started")
        loop = asyncio.new_event_loop()
        self._loop = loop
        ready = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(loop, ready), name=f"fault-proxy-{self.target[1]}", daemon=True
        )
        self._thread.start()
        ready.wait()
        self._call(self._listen())
        log.info("fault proxy listening port=%d target=%s:%d", self.port, *self.target)
        return self

    def _run(self, loop: asyncio.AbstractEventLoop, ready: threading.Event) -> None:
        asyncio.set_event_loop(loop)
        self._flowing = asyncio.Event()
        self._flowing.set()
        loop.call_soon(ready.set)
        loop.run_forever()
        loop.close()

    def stop(self) -> None:
        """Close the listener and every connection; stop the loop thread. Idempotent."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None or not thread.is_alive():
            return
        with contextlib.suppress(RuntimeError):
            self._call(self._shutdown())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        self._thread = None

    def __enter__(self) -> FaultProxy:
        return self.start() if self._thread is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def address(self) -> str:
        """``host:port`` clients connect to."""
        return f"{self.listen_host}:{self.port}"

    @property
    def fault(self) -> str:
        """``none``, ``black-hole`` or ``reset`` (latency is :attr:`latency`)."""
        return self._fault

    @property
    def latency(self) -> float:
        return self._latency

    # -- faults ------------------------------------------------------------------------------

    def black_hole(self, seconds: float | None = None) -> None:
        """Forward nothing (a partition) for ``seconds``, or until :meth:`heal`."""
        self._call(self._set_fault("black-hole", seconds))

    def reset(self, seconds: float | None = None) -> None:
        """RST every open connection and refuse new ones for ``seconds``, or until healed."""
        self._call(self._set_fault("reset", seconds))

    def delay(self, seconds: float, *, for_seconds: float | None = None) -> None:
        """Add ``seconds`` of latency each way, for ``for_seconds`` or until :meth:`heal`."""
        if seconds < 0:
            raise ValueError(f"delay must be 0 or more seconds, got {seconds}")
        self._call(self._set_latency(seconds, for_seconds))

    def heal(self) -> None:
        """End every fault: forward again, accept again, no added latency, no rewritten
        answers."""
        self._call(self._heal())

    def fail_list_offsets(
        self,
        topic_prefix: str = "",
        *,
        times: int | None = None,
        error_code: int = NOT_LEADER_OR_FOLLOWER,
    ) -> ErrorRule:
        """Answer the next ``times`` ListOffsets requests (None: every one, until healed) for
        topics starting with ``topic_prefix`` with ``error_code`` on each such partition, as a
        KRaft broker answers for a topic created a moment ago. Needs ``kafka=True``.

        Returns:
            The rule; its ``applied`` counts the answers rewritten so far.
        """
        if not self.kafka:
            raise RuntimeError("fail_list_offsets needs a FaultProxy(..., kafka=True)")
        rule = ErrorRule(LIST_OFFSETS, error_code, topic_prefix, times)
        self._rules.append(rule)
        log.info(
            "fault proxy port=%d answers ListOffsets topic_prefix=%r with error=%d times=%s",
            self.port, topic_prefix, error_code, times,
        )  # fmt: skip
        return rule

    def wait_healed(self, timeout: float | None = None) -> bool:
        """Block until no fault is on (a timed one ended); False after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._fault != "none" or self._latency:
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        return True

    # -- the loop's side ---------------------------------------------------------------------

    def _call(self, coro: Coroutine[Any, Any, _T]) -> _T:
        loop = self._loop
        if loop is None or self._thread is None:
            coro.close()
            raise RuntimeError("the proxy is not started")
        return asyncio.run_coroutine_threadsafe(coro, loop).result(10)

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(
            self._accept, self.listen_host, self.port, reuse_address=True
        )
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def _shutdown(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._server is not None:
            self._server.close()
            self._server = None
        for conn in list(self._conns):
            conn.abort()
        self._conns.clear()

    def _arm(self, seconds: float | None, heal: Any) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if seconds is not None:
            assert self._loop is not None
            self._timer = self._loop.call_later(seconds, lambda: asyncio.ensure_future(heal()))

    async def _set_fault(self, fault: str, seconds: float | None) -> None:
        assert self._flowing is not None
        if fault == "black-hole":
            await self._open_listener()
            self._flowing.clear()
        else:  # reset
            self._flowing.set()
            if self._server is not None:
                self._server.close()
                self._server = None
            self._refusing = True
            for conn in list(self._conns):
                conn.abort()
                self.stats.reset += 1
            self._conns.clear()
        self._fault = fault
        self._arm(seconds, self._heal)
        log.info("fault proxy port=%d fault=%s seconds=%s", self.port, fault, seconds)

    async def _set_latency(self, seconds: float, for_seconds: float | None) -> None:
        self._latency = seconds
        if self._latency_timer is not None:
            self._latency_timer.cancel()
            self._latency_timer = None
        if for_seconds is not None:
            assert self._loop is not None
            self._latency_timer = self._loop.call_later(for_seconds, self._no_latency)
        log.info("fault proxy port=%d latency=%.3fs seconds=%s", self.port, seconds, for_seconds)

    def _no_latency(self) -> None:
        self._latency = 0.0
        self._latency_timer = None

    async def _heal(self) -> None:
        assert self._flowing is not None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        await self._open_listener()
        self._flowing.set()
        if self._latency_timer is not None:
            self._latency_timer.cancel()
        self._no_latency()
        self._rules.clear()
        if self._fault != "none":
            log.info("fault proxy port=%d healed (was %s)", self.port, self._fault)
        self._fault = "none"

    async def _open_listener(self) -> None:
        if self._refusing:
            self._refusing = False
            await self._listen()

    def _tap(self) -> KafkaTap:
        return KafkaTap(self._rules, advertise=(self.listen_host, self.port))

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.stats.accepted += 1
        conn = _Conn(writer, self._tap() if self.kafka else None)
        self._conns.add(conn)
        self.stats.active += 1
        try:
            assert self._flowing is not None
            await self._flowing.wait()  # a partition: the server is not reached until it heals
            try:
                up_reader, up_writer = await asyncio.open_connection(*self.target)
            except OSError as exc:
                log.info("fault proxy port=%d cannot reach target: %s", self.port, exc)
                conn.abort()
                return
            conn.server = up_writer
            conn.tasks = [
                asyncio.ensure_future(self._pump(conn, reader, up_writer, up=True)),
                asyncio.ensure_future(self._pump(conn, up_reader, writer, up=False)),
            ]
            # Both directions end (a half-closed side may still receive its answer).
            await asyncio.wait(conn.tasks)
        except asyncio.CancelledError:
            pass
        finally:
            self._conns.discard(conn)
            self.stats.active -= 1
            for side in (conn.client, conn.server):
                if side is not None:
                    side.close()

    async def _pump(
        self, conn: _Conn, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, up: bool
    ) -> None:
        """Copies one direction. Chunks wait in a queue for their due time (latency), and
        nothing is read or written while the proxy is black-holed. An error on either side
        aborts the whole connection, as a router would pass the RST on."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(maxsize=256)
        sender = asyncio.ensure_future(self._send(queue, writer, up=up))
        sender.add_done_callback(lambda task: self._sent(conn, task))
        flowing = self._flowing
        assert flowing is not None
        try:
            while True:
                await flowing.wait()
                data = await reader.read(_CHUNK)
                if not data:
                    break
                if conn.tap is not None:
                    data = conn.tap.up(data) if up else conn.tap.down(data)
                    if not data:
                        continue  # part of a frame held to be rewritten
                await queue.put((time.monotonic() + self._latency, data))
            await queue.put((0.0, b""))
            await sender
        except (ConnectionError, OSError):
            conn.abort()
        finally:
            sender.cancel()

    @staticmethod
    def _sent(conn: _Conn, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            conn.abort()  # the peer is gone: the reading side must not wait on a full queue

    async def _send(
        self, queue: asyncio.Queue[tuple[float, bytes]], writer: asyncio.StreamWriter, *, up: bool
    ) -> None:
        flowing = self._flowing
        assert flowing is not None
        while True:
            due, data = await queue.get()
            if not data:
                with contextlib.suppress(OSError):
                    if writer.can_write_eof():
                        writer.write_eof()
                return
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            await flowing.wait()  # held, not dropped, during a partition
            # Counted before the write: a client that has read its bytes finds them counted.
            if up:
                self.stats.bytes_up += len(data)
            else:
                self.stats.bytes_down += len(data)
            writer.write(data)
            await writer.drain()
