"""The coordinator <-> worker control plane over loopback TCP."""

from __future__ import annotations

import queue

import pytest

from processor.runtime.control import ControlClient, ControlServer


def test_messages_flow_both_ways_and_close_is_reported() -> None:
    server = ControlServer()
    try:
        client = ControlClient(*server.address)
        client.send({"t": "hello", "worker": 0, "big": "x" * 100_000})
        conn, msg = server.inbox.get(timeout=5)
        assert msg == {"t": "hello", "worker": 0, "big": "x" * 100_000}
        conn.worker = 0  # the runner admits it
        server.broadcast({"t": "trigger", "chk": 7})
        assert client.inbox.get(timeout=5) == {"t": "trigger", "chk": 7}
        client.close()
        _conn, gone = server.inbox.get(timeout=5)
        assert gone is None and conn.closed
    finally:
        server.close()


def test_broadcast_skips_connections_the_runner_did_not_admit() -> None:
    """Regression (issue 19, zombies): triggers, completions and aborts went to every
    connection with the token, also to a worker of an older generation."""
    server = ControlServer()
    try:
        zombie, live = ControlClient(*server.address), ControlClient(*server.address)
        zombie.send({"t": "hello", "worker": 0, "generation": 1})
        live.send({"t": "hello", "worker": 0, "generation": 2})
        hellos = [server.inbox.get(timeout=5) for _ in range(2)]
        for conn, msg in hellos:
            if msg["generation"] == 2:
                conn.worker = 0
        server.broadcast({"t": "complete", "chk": 3})
        assert live.inbox.get(timeout=5) == {"t": "complete", "chk": 3}
        with pytest.raises(queue.Empty):
            zombie.inbox.get(timeout=0.5)
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
