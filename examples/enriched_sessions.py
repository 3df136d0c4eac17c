"""Enrich clicks with a user table from a compacted topic, then sessionise them, exactly once.

The pipeline (what ``eosflow run`` executes)::

    users (compacted topic, JSON rows; null = deleted)  --> table "users"
    clicks (Kafka, JSON) -> key by user -> join the user's row *as of the click's time*
        -> sessions per user (30 s of event time without a click ends one): clicks, amount,
           and the plans the user had during the session -> part files

Each output line is ``["user-00042", {"start_ms": ..., "end_ms": ..., "value": {"clicks": 12,
"amount": 604, "plans": ["free", "pro"]}}]``: the session's first click to its last plus the
gap, and the plans its clicks were made under (``"none"`` for a click without a user row:
before the user signed up, or after the account was deleted).

The join is an event-time *temporal* join: a click waits until the watermark passes its time,
so every profile change up to then has been read, whatever order the two topics are read in.
A replay after a crash gives the same answer, and the answer is the one computed from the
inputs alone (docs/engine.md, "Tables and joins").

Run it end to end (embedded Kafka unless configured; writes both topics, runs until idle, checks
every session against the answer computed without the engine)::

    python examples/enriched_sessions.py [--records 200000] [--workers 2]

Or on its own, on topics of your own::

    USERS_TOPIC=users CLICKS_TOPIC=clicks OUTPUT_DIR=out/sessions \\
        eosflow run examples/enriched_sessions.py --until-idle
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

from connectors import JsonSerde
from processor import Dataflow, Session
from sinks import FileSink

GAP = timedelta(seconds=30)


def enrich(click: dict[str, Any], user: dict[str, Any] | None) -> dict[str, Any]:
    return {"amount": click["amount"], "plan": "none" if user is None else user["plan"]}


def new_session() -> dict[str, Any]:
    return {"clicks": 0, "amount": 0, "plans": []}


def add_click(session: dict[str, Any], click: dict[str, Any]) -> dict[str, Any]:
    plans = (
        session["plans"]
        if click["plan"] in session["plans"]
        else [*session["plans"], click["plan"]]
    )
    return {
        "clicks": session["clicks"] + 1,
        "amount": session["amount"] + click["amount"],
        "plans": sorted(plans),
    }


def merge_sessions(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    return {
        "clicks": a["clicks"] + b["clicks"],
        "amount": a["amount"] + b["amount"],
        "plans": sorted(set(a["plans"]) | set(b["plans"])),
    }


OUTPUT_DIR = os.environ.get("OUTPUT_DIR", "out/enriched-sessions")
# Rows that fail to decode, or clicks an enrich or session function raises on, go here with
# their cause, exactly once like the sessions.
flow = Dataflow(
    os.environ.get("JOB_NAME", "enriched-sessions"),
    dead_letters=FileSink(OUTPUT_DIR + "-dead-letters"),
)
users = flow.table(
    "users",
    os.environ.get("USERS_TOPIC", "users"),
    serde=JsonSerde(),
    timestamp=lambda user: user["ts_ms"],
)
(
    flow.source(
        "clicks",
        os.environ.get("CLICKS_TOPIC", "clicks"),
        serde=JsonSerde(),
        timestamp=lambda click: click["ts_ms"],
        max_out_of_orderness=timedelta(seconds=1),
    )
    .key_by("by-user", lambda click: click["user"])
    .join("with-profile", users, enrich, how="left")
    .aggregate(
        "sessions", init=new_session, add=add_click, merge=merge_sessions, window=Session(GAP)
    )
    .sink("out", FileSink(OUTPUT_DIR))
)


def expected_sessions(events: Any, versions: Any) -> Any:
    """Every output line, from the generated clicks and user rows alone: each user's clicks in
    time order, a new session at every gap of ``GAP`` or more, each click's plan the user's row
    at the click's time."""
    from collections import Counter

    from clicks import canonical
    from users import RowsAt

    rows = RowsAt(versions)
    gap = int(GAP.total_seconds() * 1000)
    by_user: dict[str, list[tuple[int, int, str]]] = {}
    for e in events:
        user, ts = str(e["user"]), int(e["ts_ms"])
        row = rows.at(user, ts)
        by_user.setdefault(user, []).append(
            (ts, int(e["amount"]), "none" if row is None else row["plan"])
        )
    out: Counter[bytes] = Counter()

    def emit(user: str, session: list[tuple[int, int, str]]) -> None:
        value = {
            "clicks": len(session),
            "amount": sum(a for _t, a, _p in session),
            "plans": sorted({p for _t, _a, p in session}),
        }
        window = {"start_ms": session[0][0], "end_ms": session[-1][0] + gap, "value": value}
        out[canonical([user, window])] += 1

    for user, clicks in by_user.items():
        clicks.sort()
        session = [clicks[0]]
        for click in clicks[1:]:
            if click[0] - session[-1][0] >= gap:
                emit(user, session)
                session = []
            session.append(click)
        emit(user, session)
    return out


if __name__ == "__main__":
    from collections import Counter

    from clicks import (
        canonical,
        click_events,
        compare_outputs,
        example_parser,
        finish,
        produce_clicks,
        run_until_idle,
    )
    from users import produce_users, user_versions

    from sinks import read_jsonl

    parser = example_parser("enriched sessions")
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--users", type=int, default=1000)
    args = parser.parse_args()
    versions = user_versions(args.records, users=args.users)

    def produce(brokers: str, run_id: str) -> str:
        clicks = os.environ["CLICKS_TOPIC"] = f"clicks-{run_id}"
        users_topic = os.environ["USERS_TOPIC"] = f"users-{run_id}"
        took = produce_users(brokers, users_topic, versions)
        took += produce_clicks(brokers, clicks, args.records, users=args.users)
        return (
            f"wrote {len(versions):,} user rows to {users_topic} and {args.records:,} clicks "
            f"to {clicks} in {took:.1f}s"
        )

    result = run_until_idle(__file__, args, "enriched sessions", produce)
    got = Counter(canonical(line) for line in read_jsonl(os.environ["OUTPUT_DIR"]))
    want = expected_sessions(click_events(args.records, users=args.users), versions)
    missing, extra = compare_outputs(want, got)
    rate = result.records_in / result.seconds if result.seconds else 0.0
    print(
        f"enriched sessions: {result.records_in:,} records in {result.seconds:.1f}s "
        f"({rate:,.0f}/s), {sum(got.values()):,} sessions in {os.environ['OUTPUT_DIR']}, "
        f"{result.checkpoints} checkpoints"
    )
    problems = []
    if missing or extra:
        problems.append(f"{missing} expected sessions missing, {extra} duplicated or unexpected")
    finish(args, problems, f"OK: every session exactly once ({sum(want.values()):,} expected)")
