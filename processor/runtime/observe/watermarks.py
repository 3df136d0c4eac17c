"""The job's watermarks, as its user sees them: per stage and per source partition, the
current watermark, its lag behind the wall clock and behind the newest record read, and which
partition holds it back (docs/observability.md, "Watermarks").

Pure functions over the tasks' ``stats`` messages (``watermark``, ``wm_parts``, ``align_wm``;
:meth:`processor.runtime.task.core.Task.stats`) and a time given as an argument:
:func:`summarize` builds the summary that ``status.json``, ``/api/job`` and the job page hold;
:func:`progress_text` and :func:`status_lines` say it on the console; :func:`families` exports
it to Prometheus (:data:`WATERMARK_METRICS`).

A stage's watermark is the lowest of its tasks'. A source task's is the lowest of its
partitions' (an idle partition included: it holds the task back until it reads again, unless
it is a quiet table); a channel task's the lowest of its channel partitions'. "Held by" names
the input partition with the lowest watermark of the stage's slowest task; the job's is the
source partition with the lowest watermark among those not finished, the one that holds every
window of the job back.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric

from processor.compiler import Plan

__all__ = [
    "PARTITION_STATES",
    "WATERMARK_METRICS",
    "families",
    "format_span",
    "format_time",
    "progress_text",
    "status_lines",
    "summarize",
]

#: A task's watermark before it has one (operators' ``MIN_WATERMARK``) and from which on it is
#: the end of its input (``MAX_WATERMARK - 1`` for caught-up quiet tables, ``MAX_WATERMARK``
#: for a drained bounded run). The observe room does not import the operators: the values are
#: the wire's, ``-(2**63)`` and ``2**63 - 1``.
_NONE = -(2**63)
_END = 2**63 - 2

#: A source partition's states (``wm_parts``): reading, paused by watermark alignment for
#: running ahead, caught up with nothing to read, a bounded run's end reached.
PARTITION_STATES = ("reading", "ahead", "idle", "done")

#: The metrics of :func:`families`: name -> (type, help, labels besides ``eosflow_job``), as
#: :data:`processor.runtime.observe.metrics.METRICS` (which includes them).
WATERMARK_METRICS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "eosflow_watermark_timestamp_seconds": (
        "gauge",
        "A stage's watermark (event time, epoch seconds; +Inf at the end of a bounded input).",
        ("stage",),
    ),
    "eosflow_watermark_lag_seconds": (
        "gauge",
        "Wall-clock time minus a stage's watermark.",
        ("stage",),
    ),
    "eosflow_watermark_behind_newest_seconds": (
        "gauge",
        "The newest event time read by the job's sources minus a stage's watermark.",
        ("stage",),
    ),
    "eosflow_watermark_held_by": (
        "gauge",
        "1 for the input partition that holds a stage's watermark back.",
        ("stage", "topic", "partition"),
    ),
    "eosflow_source_partition_watermark_timestamp_seconds": (
        "gauge",
        "A source partition's watermark (event time, epoch seconds).",
        ("topic", "partition"),
    ),
    "eosflow_source_partition_newest_event_timestamp_seconds": (
        "gauge",
        "The newest event time read from a source partition (epoch seconds).",
        ("topic", "partition"),
    ),
    "eosflow_source_partition_state": (
        "gauge",
        "1 for a source partition's state: reading, ahead (paused by watermark alignment), "
        "idle or done.",
        ("topic", "partition", "state"),
    ),
}


def _wm(value: Any) -> tuple[int | None, bool]:
    """A task's watermark as ``(ms or None, at the end)``."""
    if value is None:
        return None, False
    v = int(value)
    if v <= _NONE:
        return None, False
    if v >= _END:
        return None, True
    return v, False


def _secs(a: int | None, b: int | None) -> float | None:
    return None if a is None or b is None else round((a - b) / 1000, 3)


def _low(parts: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The partition with the lowest watermark (none read yet: lowest of all), finished ones
    left out (they hold nothing back)."""
    live = [p for p in parts if p["state"] != "done"]
    if not live:
        return None
    return min(
        live,
        key=lambda p: (
            -math.inf if p["watermark_ms"] is None else p["watermark_ms"],
            p["topic"],
            p["partition"],
        ),
    )


def _holder(part: dict[str, Any] | None) -> dict[str, Any] | None:
    if part is None:
        return None
    return {k: part[k] for k in ("topic", "partition", "state", "task")}


def summarize(
    plan: Plan, tasks: Mapping[str, Mapping[str, Any]], now_ms: int | None = None
) -> dict[str, Any]:
    """The job's watermarks from its tasks' last ``stats`` (task name -> stats) at ``now_ms``
    (default: now). See docs/observability.md for the fields."""
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    sources_of = {s.name for s in plan.stages if s.sources}
    by_stage: dict[str, list[tuple[str, Mapping[str, Any]]]] = {s.name: [] for s in plan.stages}
    for task, st in sorted(tasks.items()):
        by_stage.setdefault(task.rsplit(".", 1)[0], []).append((task, st))
    sources: list[dict[str, Any]] = []
    inputs: dict[str, list[dict[str, Any]]] = {}
    for task, st in sorted(tasks.items()):
        for topic, partition, wm, newest, state in st.get("wm_parts") or ():
            part = {
                "topic": str(topic),
                "partition": int(partition),
                "task": task,
                "watermark_ms": None if wm is None else int(wm),
                "newest_ms": None if newest is None else int(newest),
                "state": str(state),
            }
            inputs.setdefault(task, []).append(part)
            if task.rsplit(".", 1)[0] in sources_of:
                sources.append(part)
    newest_ms = max((p["newest_ms"] for p in sources if p["newest_ms"] is not None), default=None)
    held = _low(sources)
    for p in sources:
        p["lag_s"] = _secs(now_ms, p["watermark_ms"])
        p["behind_newest_s"] = _secs(newest_ms, p["watermark_ms"])
        p["holding"] = p is held
    sources.sort(key=lambda p: (p["topic"], p["partition"]))
    stages: list[dict[str, Any]] = []
    for stage, members in by_stage.items():
        if not members:
            continue
        marks = [(_wm(st.get("watermark")), task) for task, st in members]
        running = [(v, t) for (v, e), t in marks if not e]
        unset = [t for v, t in running if v is None]
        end = not running
        stage_wm: int | None = None
        slowest: str | None = None
        if unset:  # a task without a watermark yet holds the stage back
            slowest = unset[0]
        elif running:
            stage_wm, slowest = min((v, t) for v, t in running if v is not None)
        stages.append(
            {
                "stage": stage,
                "source": stage in sources_of,
                "watermark_ms": stage_wm,
                "end": end,
                "lag_s": 0.0 if end else _secs(now_ms, stage_wm),
                "behind_newest_s": 0.0 if end else _secs(newest_ms, stage_wm),
                "held_by": None if slowest is None else _holder(_low(inputs.get(slowest, []))),
                "tasks": len(members),
            }
        )
    live = [s for s in stages if not s["end"]]
    job_wm: int | None = None
    if live and all(s["watermark_ms"] is not None for s in live):
        job_wm = min(s["watermark_ms"] for s in live)
    aligns = [int(st["align_wm"]) for st in tasks.values() if st.get("align_wm") is not None]
    return {
        "now_ms": now_ms,
        "watermark_ms": job_wm,
        "end": bool(stages) and not live,
        "lag_s": _secs(now_ms, job_wm),
        "behind_newest_s": _secs(newest_ms, job_wm),
        "newest_ms": newest_ms,
        "held_by": _holder(held) if live else None,
        "paused_ahead": sum(1 for p in sources if p["state"] == "ahead"),
        "alignment_ms": min(aligns) if aligns else None,
        "stages": stages,
        "sources": sources,
    }


# -- words ---------------------------------------------------------------------------------------


def format_time(ms: int | None, now_ms: int | None = None) -> str:
    """An event time in UTC: ``12:03:40Z`` on the day of ``now_ms``, else with its date."""
    if ms is None:
        return "none"
    stamp = time.gmtime(ms / 1000)
    now = time.gmtime((now_ms if now_ms is not None else time.time() * 1000) / 1000)
    if stamp[:3] == now[:3]:
        return time.strftime("%H:%M:%SZ", stamp)
    return time.strftime("%Y-%m-%d %H:%M:%SZ", stamp)


def format_span(seconds: float | None) -> str:
    """``850ms``, ``12s``, ``2m10s``, ``3h05m``, ``2d04h`` (negative: ``-`` first)."""
    if seconds is None:
        return "?"
    sign, s = ("-" if seconds < 0 else ""), abs(seconds)
    if s < 1:
        return f"{sign}{s * 1000:.0f}ms"
    whole = int(s)
    d, rest = divmod(whole, 86400)
    h, rest = divmod(rest, 3600)
    m, sec = divmod(rest, 60)
    if d:
        return f"{sign}{d}d{h:02d}h"
    if h:
        return f"{sign}{h}h{m:02d}m"
    if m:
        return f"{sign}{m}m{sec:02d}s"
    return f"{sign}{sec}s"


def _where(held: Mapping[str, Any] | None) -> str:
    if not held:
        return ""
    state = held.get("state")
    extra = f" {state}" if state not in (None, "reading") else ""
    return f"{held['topic']}[{held['partition']}]{extra}"


def progress_text(summary: Mapping[str, Any] | None) -> str:
    """The progress line's part: ``wm=12:03:40Z (2m10s behind newest, held by clicks[3])``."""
    if not summary or not summary.get("stages"):
        return ""
    if summary.get("end"):
        return " wm=end"
    wm, now = summary.get("watermark_ms"), summary.get("now_ms")
    notes = []
    if wm is not None and summary.get("behind_newest_s") is not None:
        notes.append(f"{format_span(summary['behind_newest_s'])} behind newest")
    held = _where(summary.get("held_by"))
    if held:
        notes.append(f"held by {held}")
    if summary.get("paused_ahead"):
        notes.append(f"{summary['paused_ahead']} ahead paused")
    return f" wm={format_time(wm, now)}" + (f" ({', '.join(notes)})" if notes else "")


#: A watermark this far behind now is historical event time (a backfill): ``eosflow status``
#: and the job page say so instead of "behind now", which would dominate with a constant.
_HISTORICAL_S = 86_400


def status_lines(summary: Mapping[str, Any] | None, limit: int = 8) -> list[str]:
    """``eosflow status``'s lines: the job's watermark, each stage's, the source partitions'
    (the first ``limit``, the holding one always among them)."""
    if not summary or not summary.get("stages"):
        return []
    now = summary.get("now_ms")

    def wm_of(item: Mapping[str, Any]) -> str:
        if item.get("end"):
            return "end of input"
        text = format_time(item.get("watermark_ms"), now)
        if item.get("watermark_ms") is None:
            return text
        newest = f"{format_span(item.get('behind_newest_s'))} behind newest"
        lag = item.get("lag_s")
        if lag is not None and lag >= _HISTORICAL_S:  # a backfill of old events: not news
            return f"{text}  ({newest}; historical event time)"
        return f"{text}  ({newest}, {format_span(lag)} behind now)"

    held = _where(summary.get("held_by"))
    lines = [f"watermark  {wm_of(summary)}" + (f"  held by {held}" if held else "")]
    for s in summary["stages"]:
        by = _where(s.get("held_by"))
        lines.append(f"  stage    {s['stage']}  {wm_of(s)}" + (f"  held by {by}" if by else ""))
    parts = list(summary.get("sources", ()))
    shown = parts[:limit]
    shown += [p for p in parts[limit:] if p.get("holding")]
    for p in shown:
        mark = "  <- holds the job back" if p.get("holding") else ""
        lines.append(
            f"  source   {p['topic']}[{p['partition']}]  {format_time(p['watermark_ms'], now)}  "
            f"newest {format_time(p['newest_ms'], now)}  {p['state']}{mark}"
        )
    if len(parts) > len(shown):
        lines.append(f"  source   +{len(parts) - len(shown)} more partitions (--json: all)")
    return lines


# -- Prometheus ----------------------------------------------------------------------------------


def families(summary: Mapping[str, Any] | None, job: str, label: str) -> Iterator[Metric]:
    """:data:`WATERMARK_METRICS` from a summary (``label``: the job's label name)."""

    def family(name: str) -> GaugeMetricFamily:
        _kind, text, labels = WATERMARK_METRICS[name]
        return GaugeMetricFamily(name, text, labels=[label, *labels])

    names = list(WATERMARK_METRICS)
    out = {n: family(n) for n in names}
    summary = summary or {}
    for s in summary.get("stages", ()):
        stage, wm = s["stage"], s.get("watermark_ms")
        if s.get("end"):
            out["eosflow_watermark_timestamp_seconds"].add_metric([job, stage], math.inf)
        elif wm is not None:
            out["eosflow_watermark_timestamp_seconds"].add_metric([job, stage], wm / 1000)
        for name, key in (
            ("eosflow_watermark_lag_seconds", "lag_s"),
            ("eosflow_watermark_behind_newest_seconds", "behind_newest_s"),
        ):
            if s.get(key) is not None:
                out[name].add_metric([job, stage], float(s[key]))
        held = s.get("held_by")
        if held:
            where = [job, stage, held["topic"], str(held["partition"])]
            out["eosflow_watermark_held_by"].add_metric(where, 1)
    for p in summary.get("sources", ()):
        where = [job, p["topic"], str(p["partition"])]
        if p.get("watermark_ms") is not None:
            wm_family = out["eosflow_source_partition_watermark_timestamp_seconds"]
            wm_family.add_metric(where, p["watermark_ms"] / 1000)
        if p.get("newest_ms") is not None:
            newest = out["eosflow_source_partition_newest_event_timestamp_seconds"]
            newest.add_metric(where, p["newest_ms"] / 1000)
        for state in PARTITION_STATES:
            value = 1 if p.get("state") == state else 0
            out["eosflow_source_partition_state"].add_metric([*where, state], value)
    yield from out.values()
