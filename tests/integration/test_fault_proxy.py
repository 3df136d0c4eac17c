"""The fault-injection proxy (processor.testing) with real sockets: an echo server, Redis, and
the embedded broker advertised through the proxy.

Every fault is checked from the client's side: what a partition, a delay and a reset look like to
a program that only sees its socket."""

from __future__ import annotations

import socket
import socketserver
import threading
import time
from collections.abc import Iterator
from urllib.parse import urlparse

import pytest

from processor.testing import FaultProxy


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        try:
            while data := self.request.recv(65536):
                self.request.sendall(data)
        except ConnectionError:
            pass  # the proxy reset the connection: that is the test


@pytest.fixture
def echo_port() -> Iterator[int]:
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield int(server.server_address[1])
    server.shutdown()
    server.server_close()


def _roundtrip(sock: socket.socket, payload: bytes) -> bytes:
    sock.sendall(payload)
    got = b""
    while len(got) < len(payload):
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed")
        got += chunk
    return got


def test_the_proxy_forwards_bytes_in_order_both_ways_when_healthy(echo_port: int) -> None:
    payload = bytes(range(256)) * 4096  # 1 MiB: many chunks, in order
    with FaultProxy("127.0.0.1", echo_port) as proxy:
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
            assert _roundtrip(sock, payload) == payload
        assert proxy.stats.bytes_up == len(payload) == proxy.stats.bytes_down


def test_a_black_hole_holds_bytes_until_it_heals_when_timed(echo_port: int) -> None:
    proxy = FaultProxy("127.0.0.1", echo_port).start()
    try:
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
            assert _roundtrip(sock, b"before") == b"before"
            proxy.black_hole(seconds=1.0)
            assert proxy.fault == "black-hole"
            start = time.monotonic()
            sock.settimeout(0.5)
            sock.sendall(b"during")
            with pytest.raises(TimeoutError):  # nothing comes back while partitioned
                sock.recv(10)
            sock.settimeout(5)
            assert _roundtrip(sock, b"") == b"" and sock.recv(6) == b"during"
            assert time.monotonic() - start >= 0.9
            assert proxy.wait_healed(1) and proxy.fault == "none"
            assert _roundtrip(sock, b"after") == b"after"
    finally:
        proxy.stop()


def test_a_new_connection_reaches_the_server_only_after_a_black_hole_heals(
    echo_port: int,
) -> None:
    with FaultProxy("127.0.0.1", echo_port) as proxy:
        proxy.black_hole()
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
            sock.sendall(b"x")
            sock.settimeout(0.5)
            with pytest.raises(TimeoutError):
                sock.recv(1)
            proxy.heal()
            sock.settimeout(5)
            assert sock.recv(1) == b"x"


def test_a_delay_adds_latency_each_way_until_healed(echo_port: int) -> None:
    proxy = FaultProxy("127.0.0.1", echo_port).start()
    try:
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
            proxy.delay(0.2)
            start = time.monotonic()
            assert _roundtrip(sock, b"slow") == b"slow"
            took = time.monotonic() - start
            assert 0.4 <= took < 2.0, took  # 0.2 s up and 0.2 s down
            proxy.heal()
            start = time.monotonic()
            assert _roundtrip(sock, b"fast") == b"fast"
            assert time.monotonic() - start < 0.2
    finally:
        proxy.stop()


def test_a_reset_aborts_connections_and_refuses_new_ones_until_healed(echo_port: int) -> None:
    with FaultProxy("127.0.0.1", echo_port) as proxy:
        sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
        assert _roundtrip(sock, b"hi") == b"hi"
        proxy.reset()
        with pytest.raises(ConnectionResetError):
            sock.sendall(b"x")
            sock.recv(1)
        sock.close()
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", proxy.port), timeout=2)
        assert proxy.stats.reset == 1
        proxy.heal()
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as again:
            assert _roundtrip(again, b"back") == b"back"


def test_stop_closes_the_listener_and_every_connection(echo_port: int) -> None:
    proxy = FaultProxy("127.0.0.1", echo_port).start()
    sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
    assert _roundtrip(sock, b"x") == b"x"
    proxy.stop()
    sock.settimeout(2)
    with pytest.raises((ConnectionResetError, ConnectionError)):
        sock.sendall(b"y")
        if not sock.recv(1):
            raise ConnectionError("closed")
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", proxy.port), timeout=2)
    proxy.stop()  # idempotent


@pytest.mark.integration
def test_a_redis_client_times_out_during_a_partition_and_works_after_it(redis_url: str) -> None:
    redis = pytest.importorskip("redis")
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    url = urlparse(redis_url)
    with FaultProxy(url.hostname or "127.0.0.1", url.port or 6379) as proxy:
        client = redis.Redis(port=proxy.port, socket_timeout=0.5, retry=Retry(NoBackoff(), 0))
        assert client.ping()
        proxy.black_hole(seconds=1.5)
        with pytest.raises(redis.exceptions.TimeoutError):
            client.ping()
        proxy.wait_healed(5)
        client.connection_pool.disconnect()  # the timed-out connection is out of sync
        assert client.ping()
        proxy.reset(seconds=0.5)
        with pytest.raises(redis.exceptions.ConnectionError):
            client.ping()
        proxy.wait_healed(5)
        assert client.ping()


@pytest.mark.integration
def test_every_kafka_connection_goes_through_the_proxy_when_it_fronts_the_sessions_broker(
    kafka_endpoint: tuple[str, str], topic_name: str
) -> None:
    """The proxy in front of the session's broker (Tansu, or the Apache Kafka named by
    EOSFLOW_KAFKA_BROKERS, which advertises itself) writes its own address over the broker's in
    Metadata, FindCoordinator and DescribeCluster: a client sees only the proxy, a group commit
    finds its coordinator through it, and a black hole stops every connection at once. Before,
    the partition tests skipped on a named broker: its clients went around the proxy."""
    from confluent_kafka import Consumer, Producer, TopicPartition
    from confluent_kafka.admin import AdminClient

    from processor.testing import kafka_behind_proxy

    with kafka_behind_proxy(brokers=kafka_endpoint[0]) as broker:
        admin = AdminClient({"bootstrap.servers": broker.brokers})
        described = admin.describe_cluster().result(30)
        assert [f"{n.host}:{n.port}" for n in described.nodes] == [broker.brokers]
        brokers = admin.list_topics(timeout=30).brokers.values()
        assert [f"{b.host}:{b.port}" for b in brokers] == [broker.brokers]

        producer = Producer({"bootstrap.servers": broker.brokers, "linger.ms": 0})
        producer.produce(topic_name, b"before")
        assert producer.flush(30) == 0
        consumer = Consumer(
            {"bootstrap.servers": broker.brokers, "group.id": topic_name, "log_level": 0}
        )
        consumer.commit(offsets=[TopicPartition(topic_name, 0, 1)], asynchronous=False)
        committed = consumer.committed([TopicPartition(topic_name, 0)], timeout=30)
        assert committed[0].offset == 1
        accepted = broker.proxy.stats.accepted

        broker.proxy.black_hole()
        producer.produce(topic_name, b"during")
        assert producer.flush(3) == 1, "a record got past a black hole: a connection went around"
        broker.proxy.heal()
        assert producer.flush(30) == 0
        consumer.close()
        assert broker.proxy.stats.accepted >= accepted >= 2
