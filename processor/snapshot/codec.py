"""A safe, type-preserving binary codec for operator state.

Snapshots may be read from shared storage (S3, HDFS), so decoding must never run code: this codec
knows a closed set of types and nothing else (no pickle, no marshal, no class lookup by name).

Supported, nested arbitrarily: ``None``, ``bool``, ``int`` (any size), ``float`` (bit-exact: NaN
payloads, infinities, ``-0.0``), ``str`` (any code point, lone surrogates included), ``bytes``,
``list``, ``tuple``, ``dict`` (keys of any supported hashable type), ``set``, ``frozenset``.
Subclasses (``bool`` aside) are refused rather than silently turned into their base type: a
``defaultdict`` or a named tuple would not come back as itself.

Format: one tag byte per value, then a fixed-width little-endian payload::

    N / T / F                       None / True / False
    i  int64                        int in [-2**63, 2**63)
    I  u32 n, n bytes               any other int, two's complement, little-endian
    d  float64                      float, IEEE 754 bits as is
    s  u32 n, n bytes               str, UTF-8 ("surrogatepass")
    b  u32 n, n bytes               bytes
    l t S f  u32 n, n values        list, tuple, set, frozenset
    D  u32 n, 2n values             dict: key, value, key, value... in insertion order

Invariants:
    ``loads(dumps(x))`` equals ``x`` and has the same type at every level. ``loads`` raises
    :class:`SnapshotError` (reason ``corrupt``) for any input that ``dumps`` did not produce,
    never another exception. The byte output of a set depends on its iteration order, so equal
    states may encode differently across processes (string hashing is randomized): compare
    decoded values, not bytes.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from itertools import chain
from typing import Any

from processor.errors import SerializationError, SnapshotError

__all__ = ["MAX_DEPTH", "dumps", "loads"]

_NONE, _TRUE, _FALSE = ord("N"), ord("T"), ord("F")
_INT, _BIGINT, _FLOAT = ord("i"), ord("I"), ord("d")
_STR, _BYTES = ord("s"), ord("b")
_LIST, _TUPLE, _SET, _FROZENSET, _DICT = ord("l"), ord("t"), ord("S"), ord("f"), ord("D")
_CONTAINERS = frozenset((_LIST, _TUPLE, _SET, _FROZENSET, _DICT))
_SIZED = frozenset((_STR, _BYTES, _BIGINT))

#: Deeper values are refused by both sides. Real state is a few levels deep; the limit turns a
#: reference cycle into an error instead of an endless loop, and bounds what a forged input costs.
MAX_DEPTH = 10_000

_TAG_LEN = struct.Struct("<BI")
_TAG_INT = struct.Struct("<Bq")
_TAG_FLOAT = struct.Struct("<Bd")
_U32 = struct.Struct("<I")
_I64 = struct.Struct("<q")
_F64 = struct.Struct("<d")
_INT_MIN, _INT_MAX = -(2**63), 2**63 - 1

_CONST = {None: bytes([_NONE]), True: bytes([_TRUE]), False: bytes([_FALSE])}
_CONTAINER_TAG: dict[type, int] = {list: _LIST, tuple: _TUPLE, set: _SET, frozenset: _FROZENSET}
_SCALARS = (str, int, float, bool, bytes, type(None))


class _Unsupported(Exception):
    """Raised by the encoder's fast path; :func:`dumps` then looks for the path (slow path)."""


class _TooDeep(Exception):
    pass


def dumps(obj: Any, *, root: str = "state") -> bytes:
    """Encodes ``obj`` (see the module docstring for the supported types).

    Args:
        obj: the value to encode.
        root: the name given to ``obj`` in error messages, e.g. ``state['count'][3]``.

    Raises:
        SerializationError: a value of an unsupported type (the message names the type and its
            path), a reference cycle or nesting deeper than :data:`MAX_DEPTH`, or a string,
            bytes or container of 2**32 entries or more.
    """
    try:
        return _encode(obj)
    except _Unsupported:
        path, bad = _find_unsupported(obj, root)
        raise SerializationError(
            f"cannot snapshot {path}: type {_type_name(bad)} is not supported; use None, bool, "
            "int, float, str, bytes, list, tuple, dict, set or frozenset (convert it in the "
            "operator's snapshot)"
        ) from None
    except _TooDeep:
        raise SerializationError(
            f"cannot snapshot {root}: it contains a reference cycle or is nested deeper than "
            f"{MAX_DEPTH} levels"
        ) from None
    except struct.error as exc:  # only a length of 2**32 or more fails to pack
        raise SerializationError(f"cannot snapshot {root}: a value is too large ({exc})") from None


def _encode(obj: Any) -> bytes:
    # Iterative, with an explicit stack of iterators: no recursion limit, and no function call
    # per value (the call would be most of the cost of a small value). A container pushes its
    # iterator and breaks out of the inner loop; the outer loop resumes the top iterator.
    out: list[bytes] = []
    append = out.append
    pack_len = _TAG_LEN.pack
    pack_int = _TAG_INT.pack
    stack: list[Iterator[Any]] = [iter((obj,))]
    while stack:
        for v in stack[-1]:
            t = type(v)
            if t is str:
                b = v.encode("utf-8", "surrogatepass")
                append(pack_len(_STR, len(b)))
                append(b)
            elif t is int:
                if _INT_MIN <= v <= _INT_MAX:
                    append(pack_int(_INT, v))
                else:
                    b = v.to_bytes((v.bit_length() + 8) // 8, "little", signed=True)
                    append(pack_len(_BIGINT, len(b)))
                    append(b)
            elif t is dict:
                append(pack_len(_DICT, len(v)))
                if v:
                    if len(stack) >= MAX_DEPTH:
                        raise _TooDeep
                    stack.append(chain.from_iterable(v.items()))
                    break
            elif t is tuple or t is list or t is set or t is frozenset:
                append(pack_len(_CONTAINER_TAG[t], len(v)))
                # Small scalars inline; at the first other element, push the rest.
                it = iter(v)
                for x in it:
                    tx = type(x)
                    if tx is int and _INT_MIN <= x <= _INT_MAX:
                        append(pack_int(_INT, x))
                    elif tx is str:
                        b = x.encode("utf-8", "surrogatepass")
                        append(pack_len(_STR, len(b)))
                        append(b)
                    else:
                        if len(stack) >= MAX_DEPTH:
                            raise _TooDeep
                        stack.append(chain((x,), it))
                        break
                else:
                    continue
                break
            elif t is float:
                append(_TAG_FLOAT.pack(_FLOAT, v))
            elif t is bool or v is None:
                append(_CONST[v])
            elif t is bytes:
                append(pack_len(_BYTES, len(v)))
                append(v)
            else:
                raise _Unsupported
        else:
            stack.pop()
    return b"".join(out)


def _type_name(obj: Any) -> str:
    t = type(obj)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _short(obj: Any) -> str:
    text = repr(obj)
    return text if len(text) <= 40 else text[:37] + "..."


def _find_unsupported(obj: Any, root: str) -> tuple[str, Any]:
    """Path and value of the first unsupported value, visited in the encoder's order."""
    todo: list[tuple[str, Any]] = [(root, obj)]
    while todo:
        path, v = todo.pop()
        t = type(v)
        if t in _SCALARS:
            continue
        if t is dict:
            children = []
            for k, x in v.items():
                children += [(f"{path} key {_short(k)}", k), (f"{path}[{_short(k)}]", x)]
        elif t is list or t is tuple:
            children = [(f"{path}[{i}]", x) for i, x in enumerate(v)]
        elif t is set or t is frozenset:
            children = [(f"{path} element {_short(x)}", x) for x in v]
        else:
            return path, v
        todo.extend(reversed(children))
    return root, obj  # unreachable when the encoder found one


def loads(data: bytes | bytearray | memoryview) -> Any:
    """Decodes what :func:`dumps` produced.

    Raises:
        SnapshotError: reason ``corrupt`` for anything else: truncated or trailing bytes, an
            unknown tag, invalid UTF-8, an unhashable or duplicate dict key or set element, or
            nesting deeper than :data:`MAX_DEPTH`.
    """
    buf = data if type(data) is bytes else bytes(data)
    try:
        return _decode(buf)
    except SnapshotError:
        raise
    except (IndexError, struct.error, ValueError, TypeError, OverflowError) as exc:
        # IndexError/struct.error: truncated; ValueError: bad UTF-8; TypeError: an unhashable
        # dict key or set element built from forged bytes.
        raise SnapshotError(
            f"corrupt snapshot data: {type(exc).__name__}: {exc}", reason="corrupt"
        ) from None


def _corrupt(what: str, pos: int) -> SnapshotError:
    return SnapshotError(f"corrupt snapshot data at byte {pos}: {what}", reason="corrupt")


def _decode(buf: bytes) -> Any:
    # Iterative: the values of the open container collect in ``items``; when its ``remaining``
    # count reaches zero it is built (in C: tuple(), dict(zip()), set()) and appended to its
    # parent's items. The root is a one-element pseudo-container.
    size = len(buf)
    u32 = _U32.unpack_from
    i64 = _I64.unpack_from
    stack: list[tuple[int, int, list[Any]]] = []
    items: list[Any] = []
    ctag, remaining = 0, 1
    pos = 0
    while True:
        while remaining:
            tag = buf[pos]  # IndexError past the end: "corrupt" in loads
            pos += 1
            if tag == _STR:
                (n,) = u32(buf, pos)
                pos += 4
                end = pos + n
                if end > size:
                    raise _corrupt(f"string of {n} bytes runs past the end ({size} bytes)", pos)
                items.append(buf[pos:end].decode("utf-8", "surrogatepass"))
                pos = end
            elif tag == _INT:
                items.append(i64(buf, pos)[0])
                pos += 8
            elif tag in _CONTAINERS:
                (n,) = u32(buf, pos)
                pos += 4
                count = 2 * n if tag == _DICT else n
                # Every value takes at least one byte: a larger count is forged or truncated.
                if count > size - pos:
                    raise _corrupt(f"container of {n} entries in {size - pos} bytes", pos)
                if len(stack) >= MAX_DEPTH:
                    raise _corrupt(f"nested deeper than {MAX_DEPTH} levels", pos)
                stack.append((ctag, remaining - 1, items))
                ctag, remaining, items = tag, count, []
                continue
            elif tag == _FLOAT:
                items.append(_F64.unpack_from(buf, pos)[0])
                pos += 8
            elif tag == _NONE:
                items.append(None)
            elif tag == _TRUE:
                items.append(True)
            elif tag == _FALSE:
                items.append(False)
            elif tag in _SIZED:
                (n,) = u32(buf, pos)
                pos += 4
                end = pos + n
                if end > size:
                    raise _corrupt(f"value of {n} bytes runs past the end ({size} bytes)", pos)
                chunk = buf[pos:end]
                items.append(
                    chunk if tag == _BYTES else int.from_bytes(chunk, "little", signed=True)
                )
                pos = end
            else:
                raise _corrupt(f"unknown tag {tag:#04x}", pos - 1)
            remaining -= 1
        if not stack:
            if pos != size:
                raise _corrupt(f"{size - pos} trailing bytes after the value", pos)
            return items[0]
        value: Any
        if ctag == _TUPLE:
            value = tuple(items)
        elif ctag == _LIST:
            value = items
        else:
            # dumps never writes a key or element twice: duplicates mean forged bytes.
            if ctag == _DICT:
                value = dict(zip(items[::2], items[1::2], strict=True))
                unique = 2 * len(value)
            else:
                value = set(items) if ctag == _SET else frozenset(items)
                unique = len(value)
            if unique != len(items):
                raise _corrupt("duplicate dict key or set element", pos)
        ctag, remaining, items = stack.pop()
        items.append(value)
