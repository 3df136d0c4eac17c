"""Comparing a pipeline's committed output with an expectation, as a user's test would.

Exactly-once is a statement about a multiset: every expected record is in the output once, and
nothing else is. :func:`diff` computes what differs, :func:`assert_exactly_once` fails with a
readable account of it::

    expected 200000 records, committed 200003: 2 missing, 3 duplicated, 0 unexpected
      missing (2 records, 2 distinct), e.g.:
        ["user-00042", [17, 803]]
      duplicated (3 extra copies of 3 records), e.g.:
        ["user-00007", [3, 122]] x2 at demo-out[1]@88, demo-out[1]@412

Records are compared by their canonical JSON (sorted keys), so a dict and the same dict decoded
again compare equal; ``bytes`` compare as themselves. Where a reader knows a record's key and
position (:class:`Output`), the account names them.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

__all__ = ["Diff", "Output", "assert_exactly_once", "canonical", "diff", "order_diff"]

#: Examples of each kind of difference shown by :class:`Diff`'s text.
EXAMPLES = 5


@dataclass(frozen=True)
class Output:
    """One committed output record, as the readers of :mod:`processor.testing.outputs` give it.

    Attributes:
        value: the record as the sink wrote it, decoded (a keyed stream's file output is the
            ``[key, value]`` pair).
        key: the record's key where the sink keeps one (a Kafka record's key, a table's primary
            key), else ``None``.
        where: where it was read, for messages: ``topic[partition]@offset``, ``file:line``,
            ``table(pk)``, ``redis key``.
    """

    value: Any
    key: Any = None
    where: str = ""


def canonical(item: Any) -> bytes:
    """A record as comparable bytes: ``bytes`` as they are, anything else as JSON with sorted
    keys (tuples as lists, so ``(1, 2)`` equals ``[1, 2]``)."""
    if isinstance(item, Output):
        item = item.value
    if isinstance(item, bytes):
        return item
    return orjson.dumps(item, option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS)


def _show(record: bytes, limit: int = 160) -> str:
    text = record.decode("utf-8", errors="backslashreplace")
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass
class Diff:
    """What differs between a committed output and its expectation (multisets).

    Attributes:
        expected, actual: record counts.
        missing: expected records not in the output, with how many copies are missing.
        duplicated: expected records the output holds more often than expected, with the number
            of extra copies.
        unexpected: records the expectation does not hold at all, with their copies.
        where: canonical record -> the positions it was read at (when the reader knew them).
    """

    expected: int
    actual: int
    missing: Counter[bytes]
    duplicated: Counter[bytes]
    unexpected: Counter[bytes]
    where: dict[bytes, list[str]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not (self.missing or self.duplicated or self.unexpected)

    def counts(self) -> dict[str, int]:
        """Records (copies) missing, duplicated and unexpected: the numbers of a report."""
        return {
            "expected": self.expected,
            "actual": self.actual,
            "missing": sum(self.missing.values()),
            "duplicated": sum(self.duplicated.values()),
            "unexpected": sum(self.unexpected.values()),
        }

    def summary(self) -> str:
        c = self.counts()
        return (
            f"expected {c['expected']} records, committed {c['actual']}: {c['missing']} missing, "
            f"{c['duplicated']} duplicated, {c['unexpected']} unexpected"
        )

    def __str__(self) -> str:
        lines = [self.summary()]
        for title, what in (
            ("missing", self.missing),
            ("duplicated", self.duplicated),
            ("unexpected", self.unexpected),
        ):
            if not what:
                continue
            copies = sum(what.values())
            extra = "extra copies of " if title == "duplicated" else ""
            lines.append(f"  {title} ({copies} {extra}records, {len(what)} distinct), e.g.:")
            for record, n in sorted(what.items())[:EXAMPLES]:
                times = f" x{n}" if n > 1 else ""
                at = self.where.get(record)
                place = f" at {', '.join(at[:4])}" if at and title != "missing" else ""
                lines.append(f"    {_show(record)}{times}{place}")
        return "\n".join(lines)


def _counted(
    records: Iterable[Any] | Mapping[Any, int],
) -> tuple[Counter[bytes], dict[bytes, list[str]]]:
    where: dict[bytes, list[str]] = defaultdict(list)
    if isinstance(records, Counter):
        return Counter({canonical(k): n for k, n in records.items()}), {}
    counts: Counter[bytes] = Counter()
    for record in records:
        c = canonical(record)
        counts[c] += 1
        if isinstance(record, Output) and record.where:
            where[c].append(record.where)
    return counts, dict(where)


def diff(actual: Iterable[Any], expected: Iterable[Any] | Mapping[Any, int]) -> Diff:
    """What differs between ``actual`` (records or :class:`Output`) and ``expected`` (records,
    or a :class:`~collections.Counter` of them), compared as multisets."""
    got, where = _counted(actual)
    want, _ = _counted(expected)
    missing = want - got
    extra = got - want
    duplicated = Counter({r: n for r, n in extra.items() if r in want})
    unexpected = Counter({r: n for r, n in extra.items() if r not in want})
    return Diff(sum(want.values()), sum(got.values()), missing, duplicated, unexpected, where)


def assert_exactly_once(
    actual: Iterable[Any], expected: Iterable[Any] | Mapping[Any, int], *, label: str = ""
) -> None:
    """Fails unless ``actual`` holds every record of ``expected`` exactly once and nothing else.

    Raises:
        AssertionError: with the counts and examples of what is missing, duplicated and
            unexpected (and where the duplicates were read, when the reader knew it).
    """
    found = diff(actual, expected)
    if not found.ok:
        raise AssertionError(f"{label + ': ' if label else ''}{found}")


def order_diff(actual: Iterable[Output], expected: Iterable[Output]) -> dict[str, Any]:
    """Per key, whether the records came in the same order (for sinks that keep a key's order:
    a Kafka partition, a subtask's part files).

    Returns ``{"keys": keys compared, "out_of_order": keys whose sequences differ, "example":
    (key, expected sequence head, actual sequence head) or None}``; keys that are only on one
    side are the multiset comparison's business, not this one's.
    """

    def by_key(records: Iterable[Output]) -> dict[bytes, list[bytes]]:
        seqs: dict[bytes, list[bytes]] = defaultdict(list)
        for r in records:
            seqs[canonical(r.key)].append(canonical(r.value))
        return seqs

    got, want = by_key(actual), by_key(expected)
    common = sorted(set(got) & set(want))
    bad = [k for k in common if got[k] != want[k]]
    example = None
    if bad:
        k = bad[0]
        i = next(
            (j for j, (a, b) in enumerate(zip(got[k], want[k], strict=False)) if a != b),
            min(len(got[k]), len(want[k])),
        )
        example = (
            _show(k),
            [_show(x) for x in want[k][i : i + 3]],
            [_show(x) for x in got[k][i : i + 3]],
        )
    return {"keys": len(common), "out_of_order": len(bad), "example": example}
