"""Crash-test pipeline: the running total of ``running_total_work.py``, sunk into Redis three ways.

- ``out`` (mode ``list``): RPUSH of every running total ``[user, [count, amount]]`` to
  ``<REDIS_PREFIX>:out``; a duplicated or lost epoch shows as a wrong multiset.
- ``latest`` (mode ``hash``): HSET ``<REDIS_PREFIX>:latest`` user -> latest ``[count, amount]``.
- ``amounts`` (mode ``incr``): HINCRBY ``<REDIS_PREFIX>:amount`` user amount, from the clicks
  before the shuffle; a replayed epoch would count its clicks twice.

Environment: ``JOB_NAME``, ``CLICKS_TOPIC``, ``EOSFLOW_REDIS_URL``, ``REDIS_PREFIX``,
``WORK_US`` (microseconds of work per click, default 100), and for kills in the middle of an
epoch ``SELF_KILLS`` / ``SELF_KILL_DIR`` / ``SELF_KILL_SEED``: a worker SIGKILLs itself after a
random number of clicks (1,000-12,000), at most ``SELF_KILLS`` times in the whole run (each kill
claims a file ``kill-<i>`` in ``SELF_KILL_DIR``), once ``SELF_KILL_AFTER_STARTS`` processes
imported this file. The harness's random kills tend to land while a
generation starts; these land while records flow, between a sink's writes.
"""

from __future__ import annotations

import os
import random
import signal
from typing import Any

from spin import spin

from connectors.serde import JsonSerde
from processor.dataflow import Dataflow
from sinks.redis import RedisSink

WORK_S = int(os.environ.get("WORK_US", "100")) / 1e6
PREFIX = os.environ["REDIS_PREFIX"]


SELF_KILLS = int(os.environ.get("SELF_KILLS", "0"))
_left = [10**12]  # clicks until this process kills itself
if SELF_KILLS:
    # Armed only in processes started after the first SELF_KILL_AFTER_STARTS imports of this
    # file (the runner's and the workers' of the generations that named faults end).
    _dir = os.environ["SELF_KILL_DIR"]
    open(os.path.join(_dir, f"start-{os.getpid()}"), "w").close()
    _starts = sum(1 for n in os.listdir(_dir) if n.startswith("start-"))
    if _starts > int(os.environ.get("SELF_KILL_AFTER_STARTS", "0")):
        _rng = random.Random(f"{os.environ.get('SELF_KILL_SEED', '0')}-{os.getpid()}")
        _left[0] = _rng.randrange(1_000, 12_000)


def _kill_self() -> None:
    _left[0] = 10**12  # at most one attempt per process
    for i in range(SELF_KILLS):
        try:
            fd = os.open(os.path.join(_dir, f"kill-{i}"), os.O_CREAT | os.O_EXCL)
        except FileExistsError:
            continue
        os.close(fd)
        os.kill(os.getpid(), signal.SIGKILL)


def work(click: Any) -> Any:
    spin(click, WORK_S)
    _left[0] -= 1
    if _left[0] <= 0:
        _kill_self()
    return click


flow = Dataflow(os.environ["JOB_NAME"])
clicks = flow.source(
    "clicks", os.environ["CLICKS_TOPIC"], serde=JsonSerde(), timestamp=lambda c: c["ts_ms"]
).map("work", work)
clicks.sink(
    "amounts",
    RedisSink(
        "incr", key=f"{PREFIX}:amount", field=lambda c: c["user"], value=lambda c: c["amount"]
    ),
)
totals = clicks.key_by("by-user", lambda c: c["user"]).aggregate(
    "totals", init=lambda: (0, 0), add=lambda a, c: (a[0] + 1, a[1] + c["amount"])
)
totals.sink("out", RedisSink("list", key=f"{PREFIX}:out"))
totals.sink(
    "latest",
    RedisSink("hash", key=f"{PREFIX}:latest", field=lambda kv: kv[0], value=lambda kv: kv[1]),
)
