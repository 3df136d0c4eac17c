"""Pointing a pipeline at certify's copies: its sources at the input snapshot, its sinks at
destinations of one run's own, its job name at one of its own.

``eosflow certify`` runs the user's pipeline file unchanged several times. Every process that
loads the file (the runner, each worker, on Spark too) applies the same :class:`Rewrite`, which
reaches them as JSON in the environment variable :data:`REWRITE_ENV` (the runner hands its
environment to the workers); :func:`processor.runtime.pipeline.load_flow` calls :func:`apply`.

What a sink becomes (:func:`redirected`):

- ``FileSink``: ``<outputs>/<step>`` (a directory of the run's own);
- ``KafkaSink``: topic ``<prefix>-<step>`` (created by certify with the original's partition
  count) and transactional ids ``<prefix>-<step>``;
- ``PostgresSink``: table ``<table>_<run>`` (created ``LIKE`` the original when it exists);
- ``RedisSink``: the same server, database ``redis_db`` (an empty one certify picked);
- any other sink: its own ``certify_redirect(rewrite, step) -> sink`` method, else certify
  refuses the pipeline at start-up and says so.
"""

from __future__ import annotations

import copy
import json
import os
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from processor.dataflow import DEAD_LETTERS, Dataflow
from processor.errors import ConfigError

__all__ = ["REWRITE_ENV", "Rewrite", "apply", "redirected", "sink_steps"]

#: The environment variable carrying a :class:`Rewrite` to every process of a certify run.
REWRITE_ENV = "EOSFLOW_CERTIFY_REWRITE"


@dataclass
class Rewrite:
    """How one certify run's processes change the loaded dataflow.

    Attributes:
        job: the run's job name (its own checkpoints, channel topics, dedup IDs, lease).
        prefix: names the run's Kafka topics and transactional ids (kebab-case).
        topics: source topic -> the snapshot topic it reads instead.
        outputs: the directory of the run's file outputs.
        redis_db: the database of the run's Redis sinks (``None``: no Redis sink).
    """

    job: str
    prefix: str
    topics: dict[str, str] = field(default_factory=dict)
    outputs: str = ""
    redis_db: int | None = None

    def to_env(self) -> dict[str, str]:
        return {REWRITE_ENV: json.dumps(asdict(self))}

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> Rewrite | None:
        text = (os.environ if environ is None else environ).get(REWRITE_ENV)
        return cls(**json.loads(text)) if text else None

    @property
    def table_suffix(self) -> str:
        return "_" + re.sub(r"[^a-z0-9]+", "_", self.prefix.lower()).strip("_")


def sink_steps(flow: Dataflow) -> dict[str, Any]:
    """Step name -> sink object, the dead-letter destination included."""
    sinks = {s.name: s.params["sink"] for s in flow.steps.values() if s.kind == "sink"}
    if flow.dead_letter_sink is not None:
        sinks[DEAD_LETTERS] = flow.dead_letter_sink
    return sinks


def redirected(sink: Any, step: str, rewrite: Rewrite) -> Any:
    """A copy of ``sink`` that writes to the run's own destination (see the module docstring).

    Raises:
        ConfigError: a sink certify cannot redirect.
    """
    own = getattr(sink, "certify_redirect", None)
    if callable(own):
        return own(rewrite, step)
    kind = type(sink).__name__
    out = copy.copy(sink)
    if kind == "FileSink":
        out.path = os.path.join(rewrite.outputs, step)
    elif kind == "KafkaSink":
        out.topic = f"{rewrite.prefix}-{step}"
        if out.prefix:
            out.prefix = f"{rewrite.prefix}-{step}"
    elif kind == "PostgresSink":
        *schema, table = sink.table  # identifier parts: ("table",) or ("schema", "table")
        out.table = (*schema, f"{table}{rewrite.table_suffix}")
    elif kind == "RedisSink":
        out.url = _with_db(sink.url or os.environ.get("EOSFLOW_REDIS_URL", ""), rewrite.redis_db)
    elif kind == "ConsoleSink":
        pass  # prints; nothing to compare
    else:
        raise ConfigError(
            f"sink step {step!r}: eosflow certify cannot give a {kind} a destination of each "
            "run's own, so it could not compare runs. Give the sink class a method "
            "certify_redirect(rewrite, step) returning a copy that writes elsewhere, and "
            "read_output() returning what that copy committed (docs/testing.md)"
        )
    return out


def _with_db(url: str, db: int | None) -> str | None:
    if db is None:
        return url or None
    if not url:
        raise ConfigError("a RedisSink needs its url or EOSFLOW_REDIS_URL for eosflow certify")
    base, _, query = url.partition("?")
    scheme, _, rest = base.partition("://")
    host, _, _old_db = rest.partition("/")
    return f"{scheme}://{host}/{db}" + (f"?{query}" if query else "")


def apply(flow: Dataflow, rewrite: Rewrite) -> Dataflow:
    """Changes ``flow`` in place as ``rewrite`` says; returns it."""
    flow.name = rewrite.job
    for step in flow.steps.values():
        if step.kind == "source":
            topic = step.params["topic"]
            if topic in rewrite.topics:  # a snapshot is read whole, whatever the job's start
                step.params["topic"] = rewrite.topics[topic]
                step.params["start"] = "earliest"
        elif step.kind == "sink":
            step.params["sink"] = redirected(step.params["sink"], step.name, rewrite)
    if flow.dead_letter_sink is not None:
        flow.dead_letter_sink = redirected(flow.dead_letter_sink, DEAD_LETTERS, rewrite)
    return flow
