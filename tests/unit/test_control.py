"""The coordinator <-> worker control plane over loopback TCP."""

from __future__ import annotations

import queue

from processor.runtime.control import ControlClient, ControlServer


def test_messages_flow_both_ways_and_close_is_reported() -> None:
    server = ControlServer()
    try:
        client = ControlClient(*server.address)
        client.send({"t": "hello", "worker": 0, "big": "x" * 100_000})
        conn, msg = server.inbox.get(timeout=5)
        assert msg == {"t": "hello", "worker": 0, "big": "x" * 100_000}
        server.broadcast({"t": "trigger", "chk": 7})
        assert client.inbox.get(timeout=5) == {"t": "trigger", "chk": 7}
        client.close()
        _conn, gone = server.inbox.get(timeout=5)
        assert gone is None and conn.closed
    finally:
        server.close()


def test_worker_sees_none_when_the_coordinator_goes_away() -> None:
    server = ControlServer()
    client = ControlClient(*server.address)
    client.send({"t": "hello"})
    server.inbox.get(timeout=5)  # the connection is registered
    server.close()
    try:
        assert client.inbox.get(timeout=5) is None
    except queue.Empty:  # pragma: no cover - the assertion message is the point
        raise AssertionError("worker was not told the coordinator closed") from None


def test_hangup_tells_the_worker_and_still_reports_when_it_closes() -> None:
    """The Spark runner hangs up on a generation's workers, then waits for each to close."""
    server = ControlServer()
    try:
        client = ControlClient(*server.address)
        client.send({"t": "hello"})
        conn, _ = server.inbox.get(timeout=5)
        conn.hangup()
        assert client.inbox.get(timeout=5) is None  # the worker learns it must exit
        assert not conn.closed
        client.send({"t": "stats"})  # it may still say something on its way out
        assert server.inbox.get(timeout=5)[1] == {"t": "stats"}
        client.close()
        _conn, gone = server.inbox.get(timeout=5)
        assert gone is None and conn.closed
    finally:
        server.close()
