"""Prometheus metrics and the job page's data of a running job (docs/observability.md).

Workers count; the runner tells. Every second each worker sends its tasks' counters on the
control plane (``stats``); :class:`JobMetrics` keeps the last message of every worker process
the run had (a restarted worker's final counts stay in the totals), and the runner's loop calls
:meth:`JobMetrics.update` to build an immutable snapshot that the HTTP threads read: a scrape
never touches the runner's own state, and costs the job nothing but that snapshot (at most
twice a second). Histograms (checkpoints, sink commits) and the restart counter are
``prometheus_client`` objects fed as events happen; the rest is a custom collector over the
snapshot. The exposition format is ``prometheus_client``'s.

Counters never go down while the runner lives. Within one run without restarts,
``eosflow_records_in_total`` and ``eosflow_records_out_total`` equal the
:class:`~processor.runtime.job.RunResult`'s ``records_in`` and ``records_out``.
"""

from __future__ import annotations

import re
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from processor.compiler import Plan
from processor.runtime.checkpoints.coordinator import CheckpointEvent
from processor.runtime.observe.tally import Tally
from processor.runtime.observe.watermarks import WATERMARK_METRICS, families

if TYPE_CHECKING:
    from processor.runtime.job import WorkerHandle

__all__ = ["LABEL", "METRICS", "JobMetrics", "restart_kind"]

#: The job's label. Not ``job``: Prometheus sets that to the scrape job's name.
LABEL = "eosflow_job"

#: Every metric: name -> (type, help, labels besides ``eosflow_job``). docs/observability.md
#: lists the same; the Grafana dashboard (docker/grafana) uses only these.
METRICS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "eosflow_job_info": ("gauge", "What runs (always 1).", ("runner", "mode", "recovery")),
    "eosflow_generation": ("gauge", "The current generation.", ()),
    "eosflow_workers": ("gauge", "Workers of this generation.", ("state",)),
    "eosflow_uptime_seconds": ("gauge", "Seconds since the runner started.", ()),
    "eosflow_records_in_total": (
        "counter",
        "Records read by the source tasks (re-reads after restarts included).",
        (),
    ),
    "eosflow_records_out_total": (
        "counter",
        "Records handed to sinks (re-writes after restarts included).",
        (),
    ),
    "eosflow_records_committed_total": (
        "counter",
        "Records the sinks committed in this run (each epoch once, when its checkpoint completed).",
        (),
    ),
    "eosflow_step_records_in_total": ("counter", "Records that entered a step.", ("step",)),
    "eosflow_step_records_out_total": ("counter", "Records a step emitted.", ("step",)),
    "eosflow_sink_records_total": ("counter", "Records a sink step wrote.", ("sink",)),
    "eosflow_source_lag_records": (
        "gauge",
        "Records between a source partition's read position and its end offset.",
        ("topic", "partition"),
    ),
    "eosflow_channel_queued_records": (
        "gauge",
        "Records written to a channel partition and not yet read.",
        ("topic", "partition"),
    ),
    "eosflow_dead_letters_total": ("counter", "Records routed to dead letters.", ()),
    "eosflow_bad_records_skipped_total": ("counter", "Bad records skipped.", ()),
    "eosflow_late_records_dropped_total": (
        "counter",
        "Records behind the watermark dropped by windows.",
        (),
    ),
    "eosflow_dedup_lookups_total": ("counter", "IDs dedup steps looked up in the store.", ()),
    "eosflow_dedup_duplicates_total": ("counter", "Records dedup steps dropped.", ()),
    "eosflow_dedup_redis_round_trips_total": ("counter", "Round trips to the ID store.", ()),
    "eosflow_replay_copies_dropped_total": (
        "counter",
        "Copies of channel records a restarted worker re-emitted that local recovery's replay "
        "check dropped.",
        (),
    ),
    "eosflow_checkpoints_completed_total": ("counter", "Completed checkpoints.", ()),
    "eosflow_checkpoints_failed_total": ("counter", "Aborted checkpoints.", ("reason",)),
    "eosflow_checkpoint_duration_seconds": ("histogram", "Checkpoint trigger to completion.", ()),
    "eosflow_checkpoint_alignment_seconds": (
        "histogram",
        "The longest alignment of a checkpoint's tasks.",
        (),
    ),
    "eosflow_checkpoint_size_bytes": ("histogram", "Bytes of a checkpoint's snapshots.", ()),
    "eosflow_last_checkpoint": ("gauge", "Id of the last completed checkpoint.", ()),
    "eosflow_restarts_total": ("counter", "Restarts, by kind of cause.", ("cause",)),
    "eosflow_sink_commit_seconds": ("histogram", "A sink's commit of one checkpoint.", ("sink",)),
    "eosflow_waiting_seconds": (
        "gauge",
        "How long a worker has been waiting on something outside the job (a dedup store, a "
        "sink's commit, a broker); absent when nothing waits.",
        ("worker", "on"),
    ),
    "eosflow_transaction_timeout_headroom_seconds": (
        "gauge",
        "Seconds until the broker would abort a transactional sink's oldest open transaction.",
        ("sink",),
    ),
}
METRICS.update(WATERMARK_METRICS)  # the watermarks' gauges (observe.watermarks)

_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_BYTES = tuple(float(4**i * 1024) for i in range(11))  # 1 KiB .. 1 GiB
_COUNTERS = {  # task stats key -> counter metric
    "in": "eosflow_records_in_total",  # source tasks only
    "sunk": "eosflow_records_out_total",
    "dead": "eosflow_dead_letters_total",
    "bad": "eosflow_bad_records_skipped_total",
    "late": "eosflow_late_records_dropped_total",
    "lookups": "eosflow_dedup_lookups_total",
    "dups": "eosflow_dedup_duplicates_total",
    "round_trips": "eosflow_dedup_redis_round_trips_total",
    "replayed": "eosflow_replay_copies_dropped_total",
}
_RATE_WINDOW_S = 5.0
_ERROR_TYPE = re.compile(r"\b([A-Z]\w*(?:Error|Exception|Timeout))\b")


def restart_kind(cause: str) -> str:
    """A restart cause's kind, the ``cause`` label: a small fixed set plus error type names."""
    if "killed by signal" in cause or "Python process died" in cause:
        return "killed"
    if "sent nothing for" in cause:
        return "heartbeat"
    if "checkpoints in a row timed out" in cause:
        return "checkpoint_timeouts"
    found = _ERROR_TYPE.search(cause)
    if found:
        return found.group(1)
    if "exit code" in cause or "exited" in cause:
        return "exited"
    if "lost its coordinator connection" in cause or "executor was lost" in cause:
        return "connection_lost"
    return "other"


def _name(metric: str) -> str:
    """The name ``prometheus_client`` wants: without ``_total`` (it adds it to counters)."""
    return metric.removesuffix("_total")


@dataclass
class _Snapshot:
    """What a scrape and the job page read: built by the runner's thread, then only read."""

    at: float = 0.0
    status: dict[str, Any] = field(default_factory=dict)
    totals: dict[str, int] = field(default_factory=dict)  # counter metric -> value
    steps: dict[str, list[int]] = field(default_factory=dict)  # step -> [in, out]
    sinks: dict[str, int] = field(default_factory=dict)
    parts: list[tuple[str, int, int]] = field(default_factory=list)
    headroom: dict[str, float] = field(default_factory=dict)
    api: dict[str, Any] = field(default_factory=dict)


class JobMetrics:
    """The metrics of one run of a job. See the module docstring.

    Args:
        plan: the compiled job (step names, channel topics, the graph).
        runner, mode, recovery: for ``eosflow_job_info``.
    """

    def __init__(
        self, plan: Plan, *, runner: str, mode: str, recovery: str, tally: Tally | None = None
    ) -> None:
        self.plan = plan
        self.job = plan.job
        self.info = {"runner": runner, "mode": mode, "recovery": recovery}
        self.channels = {e.topic for e in plan.edges}
        self._sinks = {n for n, s in plan.flow.steps.items() if s.kind == "sink"}
        self._graph = _graph(plan)  # the plan does not change while the runner lives
        self.registry = CollectorRegistry(auto_describe=True)
        # The histograms and counters fed by events, exported without prometheus_client's
        # ``*_created`` series: every eosflow_ series is a documented one (docs/observability.md).
        self._events = CollectorRegistry(auto_describe=True)
        # Events and snapshots come from the runner's thread only; the HTTP threads read
        # ``snapshot`` (replaced whole) and the prometheus_client objects (thread-safe).
        #: The run's counters (shared with the progress line and status.json).
        self.tally = tally if tally is not None else Tally(plan)
        self._history: deque[dict[str, Any]] = deque(maxlen=200)
        self._restarts: deque[dict[str, Any]] = deque(maxlen=50)
        self._rates: deque[tuple[float, int, int, dict[str, list[int]]]] = deque()
        self.snapshot = _Snapshot()
        self.duration = self._histogram("eosflow_checkpoint_duration_seconds", _SECONDS)
        self.alignment = self._histogram("eosflow_checkpoint_alignment_seconds", _SECONDS)
        self.size = self._histogram("eosflow_checkpoint_size_bytes", _BYTES)
        self.commit = self._histogram("eosflow_sink_commit_seconds", _SECONDS)
        self.completed = self._counter("eosflow_checkpoints_completed_total").labels(self.job)
        self.failed = self._counter("eosflow_checkpoints_failed_total")
        self.restarts = self._counter("eosflow_restarts_total")
        for kind in ("timeout", "declined", "restart"):
            self.failed.labels(self.job, kind)  # exported at 0 from the start
        self.registry.register(_Collector(self))
        self.registry.register(_WithoutCreated(self._events))

    def _histogram(self, name: str, buckets: tuple[float, ...]) -> Histogram:
        _kind, text, labels = METRICS[name]
        return Histogram(
            name, text, (LABEL, *labels), buckets=buckets, registry=self._events
        )  # fmt: skip

    def _counter(self, name: str) -> Counter:
        _kind, text, labels = METRICS[name]
        return Counter(_name(name), text, (LABEL, *labels), registry=self._events)

    # -- events (the runner's thread) ------------------------------------------------------------

    def on_stats(self, worker: WorkerHandle, generation: int, tasks: dict[str, Any]) -> None:
        """A worker's ``stats`` message: its tasks' counters (cumulative for the process) and
        the sink commits since its previous message."""
        for st in tasks.values():
            for sink, seconds in st.get("commits", ()):
                self.commit.labels(self.job, sink).observe(float(seconds))
        self.tally.on_stats(generation, worker.index, worker.pid, tasks)

    def on_checkpoint(self, event: CheckpointEvent) -> None:
        """The coordinator's observer."""
        if event.completed:
            self.completed.inc()
            self.duration.labels(self.job).observe(event.duration_s)
            self.alignment.labels(self.job).observe(event.alignment_s)
            self.size.labels(self.job).observe(event.size_bytes)
        else:
            self.failed.labels(self.job, event.kind or "other").inc()
        entry = {
            "id": event.checkpoint_id,
            "status": "completed" if event.completed else "failed",
            "reason": event.reason,
            "kind": event.kind,
            "at_ms": event.at_ms,
            "duration_s": round(event.duration_s, 6),
            "alignment_s": round(event.alignment_s, 6),
            "size_bytes": event.size_bytes,
        }
        self._history.append(entry)

    def on_restart(self, cause: str) -> None:
        kind = restart_kind(cause)
        self.restarts.labels(self.job, kind).inc()
        self._restarts.append({"at_ms": int(time.time() * 1000), "cause": cause, "kind": kind})

    # -- the snapshot ----------------------------------------------------------------------------

    def update(self, status: dict[str, Any], workers: list[WorkerHandle], state: str) -> None:
        """Builds the snapshot scrapes and the job page read. ``status``: what ``status.json``
        holds (job, generation, checkpoint...); ``workers``: this generation's; ``state``:
        ``starting``, ``running``, ``finished`` or ``stopped``."""
        snap = _Snapshot(at=time.monotonic(), status=status)
        counted = self.tally.totals()
        totals = {metric: counted[key] for key, metric in _COUNTERS.items()}
        steps: dict[str, list[int]] = {}
        for tasks in self.tally.incarnations():
            for st in tasks.values():
                for step, (n_in, n_out) in st.get("steps", {}).items():
                    acc = steps.setdefault(step, [0, 0])
                    acc[0] += int(n_in)
                    acc[1] += int(n_out)
                for sink, n in st.get("sinks", {}).items():
                    snap.sinks[sink] = snap.sinks.get(sink, 0) + int(n)
        for step in self._sinks:
            snap.sinks.setdefault(step, 0)
        dead: list[dict[str, Any]] = []
        snap.parts = self.tally.parts(workers)
        for w in workers:  # gauges: this generation's workers only
            for st in w.stats.values():
                for sink, left in st.get("headroom", {}).items():
                    snap.headroom[sink] = min(float(left), snap.headroom.get(sink, float("inf")))
                dead += st.get("dead_recent", ())
        snap.totals, snap.steps = totals, steps
        history, restarts = list(self._history), list(self._restarts)
        snap.api = self._api(snap, steps, history, restarts, dead[-20:], state)
        self.snapshot = snap  # one assignment: readers see the old or the new one, whole

    def _api(
        self,
        snap: _Snapshot,
        steps: dict[str, list[int]],
        history: list[dict[str, Any]],
        restarts: list[dict[str, Any]],
        dead: list[dict[str, Any]],
        state: str,
    ) -> dict[str, Any]:
        now, rin, rout = (
            snap.at,
            snap.totals["eosflow_records_in_total"],
            snap.totals["eosflow_records_out_total"],
        )
        rates = self._rates
        rates.append((now, rin, rout, steps))
        while len(rates) > 2 and now - rates[1][0] >= _RATE_WINDOW_S:
            rates.popleft()
        then, rin0, rout0, steps0 = rates[0]
        dt = now - then

        def per_s(a: int, b: int) -> float:
            return round(max(0, a - b) / dt, 1) if dt > 0 else 0.0

        status = snap.status
        return {
            **{k: status.get(k) for k in ("job", "generation", "restarts", "uptime_s", "mode")},
            "state": state,
            "runner": self.info["runner"],
            "recovery": self.info["recovery"],
            "updated_ms": int(time.time() * 1000),
            "workers": status.get("workers", []),
            "graph": self._graph,
            "steps": {
                s: {
                    "in": n[0],
                    "out": n[1],
                    "in_per_s": per_s(n[0], steps0.get(s, [0, 0])[0]),
                    "out_per_s": per_s(n[1], steps0.get(s, [0, 0])[1]),
                }
                for s, n in steps.items()
            },
            "records": {
                "in": rin,
                "out": rout,
                "committed": status.get("records_committed"),
                "in_per_s": per_s(rin, rin0),
                "out_per_s": per_s(rout, rout0),
            },
            "checkpoints": {**status.get("checkpoint", {}), "history": history},
            "restarts_list": restarts,
            "watermarks": status.get("watermarks"),  # observe.watermarks.summarize
            "lag": {
                "sources": [
                    {"topic": t, "partition": p, "records": n}
                    for t, p, n in sorted(snap.parts)
                    if t not in self.channels
                ],
                "channels": [
                    {"topic": t, "partition": p, "records": n}
                    for t, p, n in sorted(snap.parts)
                    if t in self.channels
                ],
            },
            "dead_letters": {"total": snap.totals["eosflow_dead_letters_total"], "recent": dead},
            # what the workers wait on (processor.runtime.waits), as status.json says it
            "waiting": status.get("waiting", []),
        }


def _graph(plan: Plan) -> dict[str, Any]:
    """The job page's stage graph."""
    steps = plan.flow.steps
    return {
        "stages": [
            {
                "name": s.name,
                "parallelism": plan.parallelism,
                "steps": list(s.steps),
                "sources": [steps[n].params["topic"] for n in s.sources],
                "sinks": [n for n in s.steps if steps[n].kind == "sink"],
            }
            for s in plan.stages
        ],
        "edges": [
            {
                "src": e.src_stage,
                "dst": e.dst_stage,
                "topic": e.topic,
                "shuffle": e.shuffle,
                "back": e.back,
            }
            for e in plan.edges
        ],
        "kinds": {n: s.kind for n, s in steps.items()},
    }


#: Numbers in a wait's text that change from one wait to the next: a checkpoint's id, a count of
#: records. Kept in the label, each would start a new time series at every slow checkpoint.
_CHANGING = re.compile(r"\b(checkpoint|has) [\d,]+")


def wait_label(on: str) -> str:
    """The ``on`` label of ``eosflow_waiting_seconds`` for a wait's text: its changing numbers
    as ``N`` (``sink 'out' (its commit of checkpoint N)``), so that the series stay few."""
    return _CHANGING.sub(lambda m: f"{m.group(1)} N", on)


class _WithoutCreated(Collector):
    """``registry``'s metrics without their ``*_created`` samples."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        for metric in self.registry.collect():
            metric.samples = [s for s in metric.samples if not s.name.endswith("_created")]
            yield metric


class _Collector(Collector):
    """The snapshot's metrics, at scrape time."""

    def __init__(self, metrics: JobMetrics) -> None:
        self.m = metrics

    def collect(self) -> Iterator[Metric]:
        m, snap = self.m, self.m.snapshot
        job = m.job
        status = snap.status

        def family(name: str) -> CounterMetricFamily | GaugeMetricFamily:
            kind, text, labels = METRICS[name]
            cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            return cls(_name(name), text, labels=[LABEL, *labels])

        info = family("eosflow_job_info")
        info.add_metric([job, *m.info.values()], 1)
        yield info
        yield from families(status.get("watermarks"), job, LABEL)  # observe.watermarks
        for name, value in (
            ("eosflow_generation", status.get("generation", 0)),
            ("eosflow_uptime_seconds", status.get("uptime_s", 0.0)),
            ("eosflow_last_checkpoint", status.get("checkpoint", {}).get("last_completed", 0)),
            ("eosflow_records_committed_total", status.get("records_committed", 0)),
        ):
            g = family(name)
            g.add_metric([job], float(value or 0))
            yield g
        workers = family("eosflow_workers")
        connected = sum(1 for w in status.get("workers", []) if w.get("connected"))
        workers.add_metric([job, "connected"], connected)
        workers.add_metric([job, "expected"], len(status.get("workers", [])))
        yield workers
        for name in _COUNTERS.values():
            c = family(name)
            c.add_metric([job], snap.totals.get(name, 0))
            yield c
        step_in, step_out = (
            family("eosflow_step_records_in_total"),
            family("eosflow_step_records_out_total"),
        )
        for step, (n_in, n_out) in sorted(snap.steps.items()):
            step_in.add_metric([job, step], n_in)
            step_out.add_metric([job, step], n_out)
        yield step_in
        yield step_out
        sinks = family("eosflow_sink_records_total")
        for sink, n in sorted(snap.sinks.items()):
            sinks.add_metric([job, sink], n)
        yield sinks
        lag, queued = family("eosflow_source_lag_records"), family("eosflow_channel_queued_records")
        for topic, partition, n in sorted(snap.parts):
            (queued if topic in m.channels else lag).add_metric([job, topic, str(partition)], n)
        yield lag
        yield queued
        headroom = family("eosflow_transaction_timeout_headroom_seconds")
        for sink, left in sorted(snap.headroom.items()):
            headroom.add_metric([job, sink], left)
        yield headroom
        waiting = family("eosflow_waiting_seconds")
        longest: dict[tuple[str, str], float] = {}
        for w in status.get("waiting", ()):
            key = (str(w["worker"]), wait_label(str(w["on"])))
            longest[key] = max(longest.get(key, 0.0), float(w["for_s"]))
        for (worker, on), seconds in sorted(longest.items()):
            waiting.add_metric([job, worker, on], seconds)
        yield waiting
