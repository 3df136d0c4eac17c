"""Broker answers rewritten on the wire: a :class:`FaultProxy` that speaks enough Kafka protocol
to make the broker answer a request with an error it would answer on a real cluster.

Some broker behaviours cannot be provoked on a single embedded broker: a topic created a moment
ago on KRaft answers ListOffsets with ``NOT_LEADER_OR_FOLLOWER`` until its leader has applied the
new metadata, although the metadata already names that leader (issue 41). The proxy frames each
connection (a Kafka frame is an int32 size and the message), remembers the requests whose
responses a rule wants to change (by correlation id), and rewrites the error code of those
responses in place: same size, same order, nothing else touched.

Only ListOffsets (api key 2, versions 1-10) is understood today; a rule for it rewrites the
partitions of the topics whose name starts with the rule's prefix.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

__all__ = ["LIST_OFFSETS", "NOT_LEADER_OR_FOLLOWER", "ErrorRule", "KafkaTap"]

#: Kafka's api key of ListOffsets.
LIST_OFFSETS = 2
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
    """

    def __init__(self, rules: list[ErrorRule]) -> None:
        self._rules = rules
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
        if api_key == LIST_OFFSETS and 1 <= version <= 10 and self._live(api_key):
            self._asked[correlation] = (api_key, version)
        return False

    def _live(self, api_key: int) -> bool:
        return any(r.api_key == api_key and not r.spent for r in self._rules)

    def _response(self, head: bytes) -> bool:
        return _INT32.unpack_from(head, 4)[0] in self._asked

    def _rewrite(self, frame: bytes) -> bytes:
        correlation = _INT32.unpack_from(frame, 4)[0]
        _api_key, version = self._asked.pop(correlation)
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


def _list_offsets_error_codes(frame: bytes, version: int) -> list[tuple[str, int]]:
    """``(topic, position of a partition's error code)`` in a ListOffsets response frame."""
    flexible = version >= 6
    pos = 8  # size, correlation id
    found: list[tuple[str, int]] = []

    def uvarint() -> int:
        nonlocal pos
        shift = value = 0
        while True:
            byte = frame[pos]
            pos += 1
            value |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return value
            shift += 7

    def tagged() -> None:
        nonlocal pos
        for _ in range(uvarint()):
            uvarint()
            pos += uvarint()

    def count() -> int:
        nonlocal pos
        if flexible:
            return uvarint() - 1
        pos += 4
        return int(_INT32.unpack_from(frame, pos - 4)[0])

    def string() -> str:
        nonlocal pos
        if flexible:
            n = uvarint() - 1
        else:
            n = _INT16.unpack_from(frame, pos)[0]
            pos += 2
        text = frame[pos : pos + max(n, 0)].decode()
        pos += max(n, 0)
        return text

    if flexible:
        tagged()  # response header v1
    if version >= 2:
        pos += 4  # throttle_time_ms
    for _ in range(count()):
        topic = string()
        for _ in range(count()):
            pos += 4  # partition index
            found.append((topic, pos))
            pos += 2 + 8 + 8  # error code, timestamp, offset
            if version >= 4:
                pos += 4  # leader epoch
            if flexible:
                tagged()
        if flexible:
            tagged()
    return found
