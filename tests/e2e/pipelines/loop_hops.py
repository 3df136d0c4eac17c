"""Crash-test pipeline for loops: every click goes around a loop ``amount % HOPS_MOD`` times.

Each pass goes through a shuffle and a keyed aggregation that counts the click's passes in its
state (``n``), so a back-edge record processed twice, or lost, changes the committed output: a
click leaves the loop once, with ``n = hops + 1``, exactly when every pass counted once. Clicks
with 5 hops exceed ``max_iterations=4`` and go to the dead-letter destination instead.

``HOPS_MOD`` (default 6; the benchmark ``bench/iterate.py`` varies it, 1 feeds nothing back).
:func:`expected_hops` is the answer, from the click generator alone.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

from connectors.serde import JsonSerde
from processor.dataflow import Dataflow, Stream
from sinks import FileSink

MAX_ITERATIONS = 4
HOPS_MOD = int(os.environ.get("HOPS_MOD", "6"))


def expected_hops(
    records: int, seed: int, hops_mod: int = HOPS_MOD
) -> tuple[Counter[bytes], Counter[bytes]]:
    """(output, dead letters as ``[step, error_type, value]``) for the clicks of ``seed``
    (``examples/`` must be on ``sys.path``: workers load this file without it)."""
    from clicks import canonical, click_events

    out: Counter[bytes] = Counter()
    dead: Counter[bytes] = Counter()
    for c in click_events(records, seed=seed):
        hops = int(str(c["amount"])) % hops_mod
        record = {"id": c["event_id"], "page": c["page"], "hops": hops}
        if hops <= MAX_ITERATIONS:
            out[canonical([c["event_id"], {**record, "n": hops + 1}])] += 1
        else:  # fed back once more than allowed, with every pass so far counted
            dead[
                canonical(["loop", "IterationLimitError", {**record, "n": MAX_ITERATIONS + 1}])
            ] += 1
    return out, dead


def count_pass(acc: dict[str, Any] | None, r: dict[str, Any]) -> dict[str, Any]:
    return {"id": r["id"], "page": r["page"], "hops": r["hops"], "n": (acc["n"] if acc else 0) + 1}


def body(loop: Stream) -> tuple[Stream, Stream]:
    passes = loop.key_by("by-click", lambda r: r["id"]).aggregate(
        "passes", init=lambda: None, add=count_pass
    )
    return (
        passes.filter("again", lambda s: s["n"] <= s["hops"]),
        passes.filter("done", lambda s: s["n"] > s["hops"]),
    )


flow = Dataflow(
    os.environ.get("JOB_NAME", "loop-hops"),
    dead_letters=FileSink(os.environ.get("DEAD_LETTER_DIR", "out/loop-hops-dead-letters")),
)
(
    flow.source(
        "clicks",
        os.environ.get("CLICKS_TOPIC", "clicks"),
        serde=JsonSerde(),
        timestamp=lambda c: c["ts_ms"],
    )
    .map(
        "to-record",
        lambda c: {"id": c["event_id"], "page": c["page"], "hops": c["amount"] % HOPS_MOD},
    )
    .iterate("loop", body, max_iterations=MAX_ITERATIONS)
    .sink("out", FileSink(os.environ.get("OUTPUT_DIR", "out/loop-hops")))
)
