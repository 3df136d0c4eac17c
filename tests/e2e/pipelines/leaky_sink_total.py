"""Certify-test pipeline with a sink of its own that writes outside the two-phase commit: its
writer appends each value to a file as it arrives (``write``), instead of staging it until the
checkpoint commits. It implements ``eosflow certify``'s two hooks (``certify_redirect`` and
``read_output``), so certify can compare it, and must find the copies a replay leaves."""

from __future__ import annotations

import copy
import os
from typing import Any

import orjson

from connectors import JsonSerde
from processor import Dataflow


class _AppendWriter:
    def __init__(self, path: str) -> None:
        self.path = path

    def write(self, values: Any) -> None:
        with open(self.path, "ab") as f:
            f.write(b"".join(orjson.dumps(v) + b"\n" for v in values))

    def prepare(self, checkpoint_id: int) -> None:
        return None

    def commit(self, checkpoint_id: int, committable: Any) -> None:
        pass

    def recover(self, pending: Any) -> None:
        pass

    def close(self) -> None:
        pass


class AppendSink:
    """Appends every value to ``<directory>/part-<subtask>.jsonl`` as it is written."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def open(self, ctx: Any) -> _AppendWriter:
        os.makedirs(self.directory, exist_ok=True)
        return _AppendWriter(os.path.join(self.directory, f"part-{ctx.subtask}.jsonl"))

    def certify_redirect(self, rewrite: Any, step: str) -> AppendSink:
        out = copy.copy(self)
        out.directory = os.path.join(rewrite.outputs, step)
        return out

    def read_output(self) -> list[Any]:
        values: list[Any] = []
        if os.path.isdir(self.directory):
            for name in sorted(os.listdir(self.directory)):
                with open(os.path.join(self.directory, name), "rb") as f:
                    values.extend(orjson.loads(line) for line in f.read().splitlines())
        return values


flow = Dataflow(os.environ.get("JOB_NAME", "leaky-sink-total"))
(
    flow.source("clicks", os.environ.get("CLICKS_TOPIC", "clicks"), serde=JsonSerde())
    .key_by("by-user", lambda c: c["user"])
    .aggregate("totals", init=lambda: (0, 0), add=lambda a, c: (a[0] + 1, a[1] + c["amount"]))
    .sink("out", AppendSink(os.environ.get("OUTPUT_DIR", "out/leaky-sink-total")))
)
