"""Broker answers rewritten on the wire: a :class:`FaultProxy` that speaks enough Kafka protocol
to keep every client connection on the proxy, and to make the broker answer a request with an
error it would answer on a real cluster.

**Addresses.** A Kafka client connects to the bootstrap address, then to the addresses the
broker advertises (Metadata, FindCoordinator, DescribeCluster). To keep a client behind the
proxy without reconfiguring the broker (a real Apache Kafka named by ``EOSFLOW_KAFKA_BROKERS``
advertises itself), the tap rewrites every broker address in those responses to the proxy's own
(``advertise``): a single-broker cluster then reaches the client only through the proxy, and a
black hole partitions it from every connection at once. Entries without a node (a coordinator
lookup that failed: node -1) are left alone. Not rewritten: the ``NodeEndpoints`` tagged fields
of Produce/Fetch responses (KIP-951), which a broker sends only when a partition's leader moved,
which never happens on one node.

Some broker behaviours cannot be provoked on a single embedded broker: a topic created a moment
ago on KRaft answers ListOffsets with ``NOT_LEADER_OR_FOLLOWER`` until its leader has applied the
new metadata, although the metadata already names that leader (issue 41). The proxy frames each
connection (a Kafka frame is an int32 size and the message), remembers the requests whose
responses a rule wants to change (by correlation id), and rewrites the error code of those
responses in place: same size, same order, nothing else touched.

**Errors.** Only ListOffsets (api key 2, versions 1-10) is understood; a rule for it rewrites
the partitions of the topics whose name starts with the rule's prefix.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

__all__ = ["LIST_OFFSETS", "NOT_LEADER_OR_FOLLOWER", "ErrorRule", "KafkaTap"]

#: Kafka's api key of ListOffsets.
LIST_OFFSETS = 2
_METADATA = 3
_FIND_COORDINATOR = 10
_DESCRIBE_CLUSTER = 60
# The first flexible version (compact strings, tagged fields) of each response rewritten here.
_FLEXIBLE_FROM = {LIST_OFFSETS: 6, _METADATA: 9, _FIND_COORDINATOR: 3, _DESCRIBE_CLUSTER: 0}
#: Kafka's error code NOT_LEADER_OR_FOLLOWER (NOT_LEADER_FOR_PARTITION before 2.7).
NOT_LEADER_OR_FOLLOWER = 6

_INT16 = struct.Struct(">h")
_INT32 = struct.Struct(">i")
_HEADS = struct.Struct(">ihhi")  # size, api key, api version, correlation id


@dataclass
class ErrorRule:
    """Answer ``times`` responses (None: every one) to ``api_key`` requests touching a topic
    that starts with ``topic_prefix`` with ``error_code`` on each such partition."""

    api_key: int
    error_code: int
    topic_prefix: str = ""
    times: int | None = None
    applied: int = 0

    @property
    def spent(self) -> bool:
        return self.times is not None and self.applied >= self.times


class _Framer:
    """Splits one direction of a connection into frames without copying their bodies: the
    first ``head`` bytes of every frame go to ``inspect``, which says whether to hold the whole
    frame (then ``rewrite`` gets it) or pass it through as it streams."""

    def __init__(self, head: int) -> None:
        self._head_len = head
        self._head = bytearray()
        self._left = 0  # bytes of the current frame still to come
        self._hold: bytearray | None = None

    def feed(self, data: bytes) -> bytes:
        out: list[bytes] = []
        view = memoryview(data)
        i = 0
        while i < len(view):
            if self._left:
                n = min(self._left, len(view) - i)
                if self._hold is not None:
                    self._hold += view[i : i + n]
                else:
                    out.append(bytes(view[i : i + n]))
                self._left -= n
                i += n
                if not self._left and self._hold is not None:
                    out.append(self.rewrite(bytes(self._hold)))
                    self._hold = None
                continue
            n = min(self._head_len - len(self._head), len(view) - i)
            self._head += view[i : i + n]
            i += n
            if len(self._head) < self._head_len:
                break
            head, self._head = bytes(self._head), bytearray()
            total = 4 + _INT32.unpack_from(head)[0]
            self._left = max(0, total - len(head))
            if self.inspect(head):
                self._hold = bytearray(head)
                if not self._left:
                    out.append(self.rewrite(bytes(self._hold)))
                    self._hold = None
            else:
                out.append(head)
        return b"".join(out)

    def inspect(self, head: bytes) -> bool:
        return False

    def rewrite(self, frame: bytes) -> bytes:
        return frame


class KafkaTap:
    """One proxied Kafka connection: :meth:`up` sees the client's requests, :meth:`down`
    returns the broker's responses with the ``rules``' errors written in.

    Args:
        rules: the proxy's list of rules, shared by every connection (read at each response).
        advertise: ``(host, port)`` written over every broker address the broker answers with,
            or None to leave addresses as they are.
    """

    def __init__(self, rules: list[ErrorRule], advertise: tuple[str, int] | None = None) -> None:
        self._rules = rules
        self._advertise = advertise
        self._asked: dict[int, tuple[int, int]] = {}  # correlation id -> (api key, version)
        self._up = _Framer(_HEADS.size)
        self._up.inspect = self._request  # type: ignore[method-assign]
        self._down = _Framer(8)
        self._down.inspect = self._response  # type: ignore[method-assign]
        self._down.rewrite = self._rewrite  # type: ignore[method-assign]

    def up(self, data: bytes) -> bytes:
        return self._up.feed(data)

    def down(self, data: bytes) -> bytes:
        return self._down.feed(data)

    def _request(self, head: bytes) -> bool:
        _, api_key, version, correlation = _HEADS.unpack(head)
        errors = api_key == LIST_OFFSETS and 1 <= version <= 10 and self._live(api_key)
        if errors or (api_key in _ADDRESSES and self._advertise is not None):
            self._asked[correlation] = (api_key, version)
        return False

    def _live(self, api_key: int) -> bool:
        return any(r.api_key == api_key and not r.spent for r in self._rules)

    def _response(self, head: bytes) -> bool:
        return _INT32.unpack_from(head, 4)[0] in self._asked

    def _rewrite(self, frame: bytes) -> bytes:
        correlation = _INT32.unpack_from(frame, 4)[0]
        api_key, version = self._asked.pop(correlation)
        if api_key in _ADDRESSES:
            assert self._advertise is not None
            return _readdress(frame, api_key, version, self._advertise)
        rules = [r for r in self._rules if r.api_key == LIST_OFFSETS and not r.spent]
        if not rules:
            return frame
        out = bytearray(frame)
        hit: set[int] = set()
        for topic, at in _list_offsets_error_codes(frame, version):
            for n, rule in enumerate(rules):
                if topic.startswith(rule.topic_prefix):
                    _INT16.pack_into(out, at, rule.error_code)
                    hit.add(n)
                    break
        for n in hit:
            rules[n].applied += 1
        return bytes(out)


class _Reader:
    """A position in a response frame and the protocol's primitive types, in the response's
    flexible (compact strings and arrays, tagged fields) or classic encoding."""

    def __init__(self, frame: bytes, api_key: int, version: int) -> None:
        self.frame = frame
        self.flexible = version >= _FLEXIBLE_FROM[api_key]
        self.pos = 8  # size, correlation id
        if self.flexible:
            self.tagged()  # response header v1

    def skip(self, n: int) -> None:
        self.pos += n

    def int32(self) -> int:
        self.pos += 4
        return int(_INT32.unpack_from(self.frame, self.pos - 4)[0])

    def uvarint(self) -> int:
        shift = value = 0
        while True:
            byte = self.frame[self.pos]
            self.pos += 1
            value |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return value
            shift += 7

    def tagged(self) -> None:
        for _ in range(self.uvarint()):
            self.uvarint()
            self.pos += self.uvarint()

    def count(self) -> int:
        return self.uvarint() - 1 if self.flexible else self.int32()

    def string(self) -> str:
        """A string or a nullable string (null reads as empty)."""
        if self.flexible:
            n = self.uvarint() - 1
        else:
            n = _INT16.unpack_from(self.frame, self.pos)[0]
            self.pos += 2
        text = self.frame[self.pos : self.pos + max(n, 0)].decode()
        self.pos += max(n, 0)
        return text

    def encode_string(self, text: str) -> bytes:
        data = text.encode()
        if not self.flexible:
            return _INT16.pack(len(data)) + data
        n, head = len(data) + 1, bytearray()
        while n >= 0x80:
            head.append((n & 0x7F) | 0x80)
            n >>= 7
        head.append(n)
        return bytes(head) + data


def _list_offsets_error_codes(frame: bytes, version: int) -> list[tuple[str, int]]:
    """``(topic, position of a partition's error code)`` in a ListOffsets response frame."""
    r = _Reader(frame, LIST_OFFSETS, version)
    found: list[tuple[str, int]] = []
    if version >= 2:
        r.skip(4)  # throttle_time_ms
    for _ in range(r.count()):
        topic = r.string()
        for _ in range(r.count()):
            r.skip(4)  # partition index
            found.append((topic, r.pos))
            r.skip(2 + 8 + 8)  # error code, timestamp, offset
            if version >= 4:
                r.skip(4)  # leader epoch
            if r.flexible:
                r.tagged()
        if r.flexible:
            r.tagged()
    return found


def _metadata_nodes(r: _Reader, version: int) -> list[int]:
    if version >= 3:
        r.skip(4)  # throttle_time_ms
    found = []
    for _ in range(r.count()):
        node = r.int32()
        found.append(r.pos if node >= 0 else -1)
        r.string()  # host
        r.skip(4)  # port
        if version >= 1:
            r.string()  # rack
        if r.flexible:
            r.tagged()
    return found


def _coordinator_nodes(r: _Reader, version: int) -> list[int]:
    if version >= 1:
        r.skip(4)  # throttle_time_ms
    if version <= 3:
        r.skip(2)  # error code
        if version >= 1:
            r.string()  # error message
        node = r.int32()
        return [r.pos if node >= 0 else -1]
    found = []
    for _ in range(r.count()):
        r.string()  # key
        node = r.int32()
        found.append(r.pos if node >= 0 else -1)
        r.string()  # host
        r.skip(4 + 2)  # port, error code
        r.string()  # error message
        r.tagged()
    return found


def _cluster_nodes(r: _Reader, version: int) -> list[int]:
    r.skip(4 + 2)  # throttle_time_ms, error code
    r.string()  # error message
    if version >= 1:
        r.skip(1)  # endpoint type
    r.string()  # cluster id
    r.skip(4)  # controller id
    found = []
    for _ in range(r.count()):
        node = r.int32()
        found.append(r.pos if node >= 0 else -1)
        r.string()  # host
        r.skip(4)  # port
        r.string()  # rack
        if version >= 2:
            r.skip(1)  # is fenced
        r.tagged()
    return found


# The responses that carry broker addresses, and where in each the (host, port) pairs begin.
_ADDRESSES = {
    _METADATA: _metadata_nodes,
    _FIND_COORDINATOR: _coordinator_nodes,
    _DESCRIBE_CLUSTER: _cluster_nodes,
}


def _readdress(frame: bytes, api_key: int, version: int, to: tuple[str, int]) -> bytes:
    """The response frame with every broker's (host, port) replaced by ``to`` (the size prefix
    follows the new length)."""
    r = _Reader(frame, api_key, version)
    host = r.encode_string(to[0])
    port = _INT32.pack(to[1])
    parts: list[bytes] = []
    done = 4  # the size prefix is written anew
    for at in _ADDRESSES[api_key](r, version):
        if at < 0:
            continue
        r.pos = at
        r.string()
        parts += [frame[done:at], host, port]
        done = r.pos + 4
    if not parts:
        return frame
    parts.append(frame[done:])
    body = b"".join(parts)
    return _INT32.pack(len(body)) + body
