"""Redis operations of the Redis sink: what a stream value becomes, checked and encoded as the
MessagePack arrays that the commit script (:mod:`sinks.redis.server`) unpacks and runs; and what
the encoder and the writer read of the sink's configuration (:class:`RedisSinkConfig`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any, Protocol

import orjson

from processor.errors import SerializationError

__all__ = ["OPERATIONS", "RedisSinkConfig"]

#: Operations a ``command`` function may return: name -> (min, max args after the key, args in
#: pairs, positions of integer args). Every one is deterministic given the data it sees.
OPERATIONS: dict[str, tuple[int, int | None, bool, tuple[int, ...]]] = {
    "SET": (1, 1, False, ()),
    "DEL": (0, 0, False, ()),
    "HSET": (2, None, True, ()),
    "HDEL": (1, None, False, ()),
    "HINCRBY": (2, 2, False, (1,)),
    "INCRBY": (1, 1, False, (0,)),
    "RPUSH": (1, None, False, ()),
    "LPUSH": (1, None, False, ()),
    "SADD": (1, None, False, ()),
    "SREM": (1, None, False, ()),
    "ZADD": (2, None, True, ()),
    "ZREM": (1, None, False, ()),
    "XADD": (2, None, True, ()),
    "PEXPIRE": (1, 1, False, (0,)),
}
_MAX_ARGS = 1000  # Lua's unpack() fails past ~8000 values; a bigger op is surely a mistake

Encoder = Callable[[Sequence[Any]], list[Any]]


class RedisSinkConfig(Protocol):
    """What the encoder and the writer read of their :class:`~sinks.redis.sink.RedisSink`
    (which implements it; the attributes are documented there). The sink's module opens the
    writer, so they know it by this protocol rather than by importing that module."""

    mode: str
    key: str | bytes | Callable[[Any], Any] | None
    field: str | bytes | Callable[[Any], Any] | None
    value: Callable[[Any], Any] | None
    command: Callable[[Any], Any] | None
    namespace: str
    retry_for: timedelta
    chunk_ops: int

    @property
    def _reserved(self) -> bytes:
        """The prefix of the sink's own keys, which no operation may target."""


def _encoder(
    sink: RedisSinkConfig, unencodable: Callable[[Any, BaseException], SerializationError]
) -> tuple[Encoder, bool]:
    """``(encode(values) -> ops, upsert)``: ops are MessagePack arrays of strings, or for
    upsert modes ``(target, tail)`` pairs whose concatenation is the op (last write wins)."""
    mode, reserved = sink.mode, sink._reserved
    value_of = sink.value or _identity
    key_of = _part(sink.key, reserved, "key")
    field_of = _part(sink.field, None, "field") if sink.field is not None else None

    def one(value: Any) -> Any:
        key = key_of(value)
        if mode == "set":
            return _mp_array(3) + _SET + key, _mp_str(_arg(value_of(value)))
        if mode == "hash":
            assert field_of is not None
            return _mp_array(4) + _HSET + key + field_of(value), _mp_str(_arg(value_of(value)))
        if mode == "list":
            return _mp_array(3) + _RPUSH + key + _mp_str(_arg(value_of(value)))
        if mode == "incr":
            amount = _mp_str(_int(value_of(value), "amount"))
            if field_of is None:
                return _mp_array(3) + _INCRBY + key + amount
            return _mp_array(4) + _HINCRBY + key + field_of(value) + amount
        return _xadd(key, value_of(value))

    def command(value: Any) -> list[bytes]:
        result = sink.command(value)  # type: ignore[misc]
        if result is None:
            return []
        if isinstance(result, tuple):
            return [_command_op(result, reserved)]
        if isinstance(result, list):
            return [_command_op(op, reserved) for op in result]
        raise TypeError(f"command returned {type(result).__name__}, not a tuple or a list")

    def encode(values: Sequence[Any]) -> list[Any]:
        ops: list[Any] = []
        for value in values:
            try:
                if mode == "command":
                    ops.extend(command(value))
                else:
                    ops.append(one(value))
            except Exception as exc:
                raise unencodable(value, exc) from exc
        return ops

    return encode, mode in ("set", "hash")


def _part(part: Any, reserved: bytes | None, what: str) -> Callable[[Any], bytes]:
    """A function ``value -> encoded key or field`` from a constant or a function."""
    if isinstance(part, (str, bytes)):
        constant = _mp_str(_key_bytes(part))
        return lambda _value: constant

    def of(value: Any) -> bytes:
        data = _key_bytes(part(value), what)
        if reserved is not None:
            _check_target(data, reserved, what)
        return _mp_str(data)

    return of


def _command_op(op: Any, reserved: bytes) -> bytes:
    if not isinstance(op, tuple) or len(op) < 2 or not isinstance(op[0], str):
        raise TypeError(f"an operation is a tuple (op, key, *args), got {op!r}")
    name = op[0].upper()
    spec = OPERATIONS.get(name)
    if spec is None:
        raise ValueError(f"operation {op[0]!r} is not allowed; use one of {', '.join(OPERATIONS)}")
    minimum, maximum, pairs, ints = spec
    args = op[2:]
    if not minimum <= len(args) <= (_MAX_ARGS if maximum is None else maximum) or (
        pairs and len(args) % 2
    ):
        shape = f"exactly {maximum}" if maximum == minimum else f"at least {minimum}"
        raise ValueError(
            f"{name} takes {shape} argument(s) after the key{' in pairs' if pairs else ''} "
            f"(at most {_MAX_ARGS}), got {len(args)}"
        )
    key = _key_bytes(op[1])
    _check_target(key, reserved, "key")
    parts = [_mp_str(name.encode()), _mp_str(key)]
    if name == "XADD":
        parts.append(_mp_str(b"*"))
    for i, arg in enumerate(args):
        parts.append(_mp_str(_int(arg, f"{name} argument {i + 1}") if i in ints else _arg(arg)))
    return _mp_array(len(parts)) + b"".join(parts)


def _xadd(key: bytes, value: Any) -> bytes:
    if isinstance(value, Mapping):
        if not value:
            raise ValueError("a stream entry needs at least one field (got an empty mapping)")
        fields = [_mp_str(_key_bytes(f, "field")) + _mp_str(_arg(v)) for f, v in value.items()]
    else:
        fields = [_VALUE + _mp_str(_arg(value))]
    return _mp_array(3 + 2 * len(fields)) + _XADD + key + _STAR + b"".join(fields)


def _identity(value: Any) -> Any:
    return value


def _arg(value: Any) -> bytes:
    """``bytes`` and ``str`` as they are, anything else as JSON."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    return orjson.dumps(value)


def _key_bytes(part: Any, what: str = "key") -> bytes:
    if isinstance(part, bytes):
        return part
    if isinstance(part, str):
        return part.encode()
    if isinstance(part, int) and not isinstance(part, bool):
        return str(part).encode()
    raise TypeError(f"{what} must be str, bytes or int, got {type(part).__name__}")


def _int(amount: Any, what: str) -> bytes:
    if isinstance(amount, int) and not isinstance(amount, bool):
        return str(amount).encode()
    raise TypeError(f"{what} must be an int, got {type(amount).__name__}")


def _check_target(key: bytes, reserved: bytes, what: str) -> None:
    if key.startswith(reserved):
        raise ValueError(
            f"{what} {key!r} lies in the sink's namespace {reserved.decode()!r}, which holds its "
            "guards and staged epochs; choose another key or another namespace="
        )


# MessagePack, just what Redis's cmsgpack reads back as Lua strings and tables.
def _mp_str(data: bytes) -> bytes:
    n = len(data)
    if n < 32:
        return bytes((0xA0 | n,)) + data
    if n < 0x100:
        return b"\xd9" + bytes((n,)) + data
    if n < 0x10000:
        return b"\xda" + n.to_bytes(2, "big") + data
    return b"\xdb" + n.to_bytes(4, "big") + data


def _mp_array(n: int) -> bytes:
    if n < 16:
        return bytes((0x90 | n,))
    if n < 0x10000:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


_SET, _HSET, _RPUSH = _mp_str(b"SET"), _mp_str(b"HSET"), _mp_str(b"RPUSH")
_INCRBY, _HINCRBY = _mp_str(b"INCRBY"), _mp_str(b"HINCRBY")
_XADD, _STAR, _VALUE = _mp_str(b"XADD"), _mp_str(b"*"), _mp_str(b"value")
