"""Runs a job (local or Spark runner) while killing its workers, and checks the committed output.

The expectation is computed from the click generator alone (``examples/clicks.py``), never by
the engine; :func:`assert_exactly_once` compares the committed output with it as a multiset.
"""

from __future__ import annotations

import os
import random
import re
import sys
import threading
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from processor.runtime.supervision.local import Fault, LocalRunner, RunOptions, RunResult
from processor.runtime.supervision.runner import Runner
from processor.testing.chaos import Killer
from sinks import read_jsonl

if TYPE_CHECKING:
    from processor.runtime.supervision.spark import SparkOptions

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

from clicks import (  # noqa: E402
    canonical,
    click_events,
    compare_outputs,
    expected_running_totals,
    expected_two_level_counts,
    expected_window_counts,
    produce_clicks,
    produce_json,
    read_two_level_output,
    with_duplicates,
)
from users import RowsAt, produce_users, user_versions  # noqa: E402

__all__ = [
    "BURST_FAULTS",
    "ENGINE_FAULTS",
    "RUNNERS",
    "RowsAt",
    "assert_faults_fired",
    "canonical",
    "chaos_seed",
    "click_events",
    "expected_running_totals",
    "expected_two_level_counts",
    "expected_window_counts",
    "explain_running_totals",
    "killed_run",
    "produce_clicks",
    "produce_json",
    "produce_users",
    "read_two_level_output",
    "user_versions",
    "with_duplicates",
]

#: The marks of a Spark repeat in CI's crash tier. One xdist group (with ``--dist loadgroup``):
#: the repeats run one after another in one pytest worker, whose JVM they share (PySpark keeps
#: it after a session stops), instead of up to four JVMs and their tasks on two cores at once.
SPARK_REPEAT = [pytest.mark.spark, pytest.mark.crash, pytest.mark.xdist_group("spark")]

# Parametrize a test over runners: the local runner in README command 2, its Spark repeat in
# CI's crash tier (marker ``crash``; README command 2 runs Spark under SIGKILLs once, in
# tests/e2e/test_spark.py, and the README's Spark example in tests/integration/test_examples.py).
RUNNERS = [
    pytest.param("local"),
    pytest.param("spark", marks=SPARK_REPEAT),
]

PIPELINES = Path(__file__).resolve().parent / "pipelines"

#: One SIGKILL at every protocol point of the engine (no sink points), one per job start.
ENGINE_FAULTS = [
    Fault(0, 1, "mid-alignment", 3),
    Fault(1, 0, "after-snapshot-before-ack", 2),
    Fault(2, 1, "after-completion-before-commit", 2),
    Fault(3, 0, "during-recovery", 1),
]
#: For outputs fired by the watermark (windows, sessions, timers, temporal and table joins):
#: they reach the sinks in bursts. A restored generation's watermark waits until each of a
#: task's partitions delivered again (a task may read one partition far ahead of another), so a
#: subtask may commit output at only one checkpoint of that generation. The engine's fault at
#: the commit point fires at the first such commit, not the second (with nth=2 the fault
#: sometimes never fired and the job waited for it: sessions once in three runs, the table
#: join with seed 936096).
BURST_FAULTS = [
    replace(f, nth=1) if f.point == "after-completion-before-commit" else f for f in ENGINE_FAULTS
]
FAULT_LINE = re.compile(r"fault injection: SIGKILL worker=(\d+) point=([\w-]+)")


@dataclass
class ChaosRun:
    result: RunResult
    output: Counter[bytes]
    random_kills: list[tuple[float, int]]
    faults_fired: list[tuple[int, str]]
    logs: dict[str, str] = field(default_factory=dict)


def chaos_seed() -> int:
    """The seed of a chaos test: ``EOSFLOW_CHAOS_SEED`` to rerun one, else random (printed)."""
    seed = int(os.environ.get("EOSFLOW_CHAOS_SEED") or random.SystemRandom().randrange(10**6))
    print(f"chaos seed={seed}")
    return seed


class Attempts:
    """``(seed, directory)`` for up to ``tries`` chaos runs of a test whose precondition is
    timing (a kill landing while something specific happens): each run is checked in full,
    the test returns once the precondition held, and fails naming :attr:`seeds` if it never
    did (so the case it is for is always exercised)."""

    def __init__(self, tmp_path: Path, tries: int = 3) -> None:
        self.tmp_path, self.tries = tmp_path, tries
        self.seeds: list[int] = []

    def __iter__(self) -> Iterator[tuple[int, Path]]:
        base = chaos_seed()
        for attempt in range(self.tries):
            (tmp := self.tmp_path / f"attempt-{attempt}").mkdir()
            self.seeds.append(base + attempt)
            yield base + attempt, tmp


def assert_exactly_once(want: Counter[bytes], got: Counter[bytes], *, seed: int) -> None:
    missing, extra = compare_outputs(want, got)
    if missing or extra:
        lost = list((want - got).elements())[:5]
        dup = list((got - want).elements())[:5]
        raise AssertionError(
            f"seed={seed}: {missing} expected records missing (e.g. {lost}), {extra} duplicated "
            f"or unexpected (e.g. {dup}); {sum(got.values())} committed, "
            f"{sum(want.values())} expected"
        )


def assert_faults_fired(
    run: ChaosRun, faults: list[Fault], random_kills: int, *, seed: int
) -> None:
    """Every named fault fired, every random kill landed, and each one cost a restart: a run
    that ended early proves less. A pipeline's own kills are not counted in that bound: one
    can land in the same generation as a random kill (the killer checks that the generation
    is whole just before it kills), and one restart answers both (seen once in CI: 8
    restarts for 5 named faults, 2 random kills and 2 self-kills)."""
    fired = {point for _worker, point in run.faults_fired}
    assert fired == {f.point for f in faults}, f"seed={seed}: named faults fired: {fired}"
    assert len(run.random_kills) == random_kills, (
        f"seed={seed}: the job ended after {len(run.random_kills)} of {random_kills} random kills"
    )
    assert run.result.restarts >= len(faults) + random_kills, (
        f"seed={seed}: {run.result.restarts} restarts: {run.result.restart_causes}"
    )


def run_chaos(
    pipeline: str,
    *,
    brokers: str,
    tmp: Path,
    records: int,
    seed: int,
    mode: str,
    interval: float = 0.5,
    faults: list[Fault] | None = None,
    random_kills: int = 0,
    workers: int = 2,
    env: dict[str, str] | None = None,
    runner: str = "local",
    read_output: Callable[[dict[str, str]], Iterable[Any]] | None = None,
    duplicates: float = 0.0,
    recovery: str = "global",
    victims: list[int] | None = None,
    produce: Callable[[str, str], object] | None = None,
    kill_plan: list[tuple[float, int]] | None = None,
    run_options: dict[str, Any] | None = None,
    during: Callable[[Runner], None] | None = None,
    spark: SparkOptions | None = None,
    kill_target: Callable[[int], int | None] | None = None,
) -> ChaosRun:
    """Produce ``records`` clicks, run ``pipeline`` (a file in ``tests/e2e/pipelines``) until
    idle while SIGKILLing workers, and read what it committed. ``runner``: ``local`` or
    ``spark`` (``local[workers]``; a random kill SIGKILLs the task's Python process).

    The pipeline sees ``JOB_NAME``, ``CLICKS_TOPIC``, ``OUTPUT_DIR``, ``EOSFLOW_KAFKA_BROKERS``
    and ``env``. ``duplicates``: the share of clicks written twice (same ``event_id``, a later
    offset). ``read_output(job_env)`` returns the committed output items (default: the JSON
    lines of the file sink in ``OUTPUT_DIR``); they are compared as :func:`canonical` bytes.
    ``recovery``: ``global`` or ``local``; ``victims``: the workers random kills choose from.
    ``produce(brokers, topic)``: writes the input instead of the clicks (to ``CLICKS_TOPIC``).
    ``kill_plan``: ``(share of the input read, checkpoints the generation completed)`` before
    each random kill (default: random, see :class:`_Killer`). ``run_options``: more
    :class:`RunOptions` fields. ``during(runner)``: runs in a thread while the job runs (a
    fault of the test's own, e.g. SIGSTOP). ``spark``: the Spark runner's options (a cluster's
    master, ``--conf``). ``kill_target(pid)``: what a random kill SIGKILLs, from the victim
    worker's PID (default: that process; e.g. the executor JVM running it).
    """
    run_id = uuid.uuid4().hex[:8]
    job_env = {
        "JOB_NAME": f"chaos-{mode}-{run_id}",
        "CLICKS_TOPIC": f"chaos-clicks-{run_id}",
        "OUTPUT_DIR": str(tmp / "output"),
        "EOSFLOW_KAFKA_BROKERS": brokers,
        **(env or {}),
    }
    if produce is not None:
        produce(brokers, job_env["CLICKS_TOPIC"])
    else:
        produce_clicks(brokers, job_env["CLICKS_TOPIC"], records, seed=seed, duplicates=duplicates)
    faults = faults or []
    options = RunOptions(
        workers=workers,
        checkpoint_interval=interval,
        mode=mode,
        until_idle=True,
        environ=job_env,
        state_dir=str(tmp / "state"),
        faults=faults,
        max_restarts=len(faults) + random_kills + 5,
        recovery=recovery,
        restart_backoff=0.1,
        max_backoff=0.5,
        **{"progress": sys.stderr, "progress_every": 1.0, **(run_options or {})},
    )
    job: Runner
    if runner == "spark":
        from processor.runtime.supervision.spark import SparkRunner

        job = SparkRunner(str(PIPELINES / pipeline), options, spark)
    else:
        job = LocalRunner(str(PIPELINES / pipeline), options)
    killer = Killer(
        job,
        kills=random_kills,
        start_after=len(faults),
        rng=random.Random(seed),
        records=records,
        victims=victims,
        plan=kill_plan,
        target=kill_target,
        # Random kills start after the named faults, each a restart: on the Spark runner under
        # CI's load, 5 named faults and their restarts took past the kit's 120 s, the hold
        # ended, and the job drained before its last random kill (the Postgres sink's [spark]
        # case, "the job ended after 1 of 2 random kills"). The hold only lasts while kills
        # are pending, so a longer one costs nothing when they land.
        hold_s=300.0,
    )
    killer.hold_final()
    killer.start()
    side = threading.Thread(target=during, args=(job,), daemon=True) if during else None
    if side is not None:
        side.start()
    try:
        result = job.run()
    finally:
        killer.stop.set()
        killer.join(5)
        if side is not None:
            side.join(5)
    logs = {p.name: p.read_text(errors="replace") for p in job.dir.glob("worker-*.log")}
    fired = [
        (int(m.group(1)), m.group(2)) for text in logs.values() for m in FAULT_LINE.finditer(text)
    ]
    items = read_output(job_env) if read_output else read_jsonl(job_env["OUTPUT_DIR"])
    output = Counter(canonical(item) for item in items)
    return ChaosRun(result, output, killer.done, fired, logs)


def killed_run(
    pipeline: str,
    brokers: str,
    tmp: Path,
    *,
    records: int,
    seed: int | None = None,
    faults: list[Fault] = ENGINE_FAULTS,
    random_kills: int = 2,
    mode: str = "aligned",
    **kw: Any,
) -> tuple[ChaosRun, int]:
    """``pipeline`` over ``records`` clicks (or what ``produce=`` writes), each spun 100 µs,
    SIGKILLed at ``faults`` (protocol points) and ``random_kills`` times at random, every kill
    checked to have landed. ``seed``: default :func:`chaos_seed`. Returns the run and its seed.
    ``kw``: more :func:`run_chaos` arguments."""
    seed = chaos_seed() if seed is None else seed
    run = run_chaos(
        pipeline,
        brokers=brokers,
        tmp=tmp,
        records=records,
        seed=seed,
        mode=mode,
        interval=0.5,
        faults=faults,
        random_kills=random_kills,
        env={"WORK_US": "100", **kw.pop("env", {})},
        **kw,
    )
    print(f"seed={seed} restarts={run.result.restarts} random kills={run.random_kills}")
    assert_faults_fired(run, faults, random_kills, seed=seed)
    return run, seed


def expected(
    fn: Callable[[Iterator[dict[str, Any]]], Counter[bytes]], records: int, seed: int
) -> Counter[bytes]:
    return fn(click_events(records, seed=seed))


def explain_running_totals(
    events: Iterable[dict[str, Any]],
    outputs: Iterable[tuple[str, tuple[int, int]]],
    positions: dict[str, list[tuple[int, int]]],
    *,
    parts: int = 1,
    limit: int = 8,
) -> str:
    """Why committed running totals differ from the answer, for a failure message: per user,
    which input clicks the totals show were skipped (each total's step from the one before
    names the click it counted), where those clicks are in the input (``positions``:
    event ID -> ``(partition, offset)`` of each copy) and in which of ``parts`` equal parts
    of the input they came. A skipped run of consecutive offsets in one partition points at
    the source; scattered clicks at dedup; clicks not in the input, at the test's producer;
    matching totals with some missing, at the sink."""
    mine: dict[str, list[tuple[str, int]]] = {}
    order: dict[str, int] = {}
    for i, event in enumerate(events):
        click = (str(event["event_id"]), int(event["amount"]))
        mine.setdefault(str(event["user"]), []).append(click)
        order[str(event["event_id"])] = i
    got: dict[str, dict[int, int]] = {}
    for user, (count, total) in outputs:
        got.setdefault(user, {}).setdefault(count, total)
    skipped: list[str] = []
    extra, gaps, diverged = 0, 0, 0
    for user, clicks in mine.items():
        totals = got.get(user, {})
        sums, acc = [], 0
        for _eid, amount in clicks:
            acc += amount
            sums.append(acc)
        if all(totals.get(n + 1) == s for n, s in enumerate(sums) if n + 1 in totals):
            gaps += len(sums) - len(totals)  # right values, some missing: the output lost them
            continue
        diverged += 1
        p, prev = 0, 0
        for count in sorted(totals):
            step = totals[count] - prev
            prev = totals[count]
            ahead = [j for j in range(p, min(p + 50, len(clicks))) if clicks[j][1] == step]
            if not ahead:
                extra += 1  # counted something that is not the next click: a copy, or another's
                continue
            skipped += [eid for eid, _a in clicks[p : ahead[0]]]
            p = ahead[0] + 1
    lines = [
        f"users with wrong totals: {diverged}; clicks their totals skipped: {len(skipped)}; "
        f"steps matching no next click: {extra}; right totals missing from the output: {gaps}"
    ]
    n = len(order)
    by_part = Counter(min(parts - 1, order[e] * parts // max(n, 1)) for e in skipped)
    lines.append(f"skipped clicks by part of the input (of {parts}): {sorted(by_part.items())}")
    unwritten = sum(1 for e in skipped if e not in positions)
    lines.append(f"skipped clicks that are not in the input topic at all: {unwritten}")
    per_partition: dict[int, list[int]] = {}
    for eid in skipped:
        for partition, offset in positions.get(eid, [])[:1]:
            per_partition.setdefault(partition, []).append(offset)
    for partition, offsets in sorted(per_partition.items()):
        offsets.sort()
        runs, start = [], offsets[0]
        for a, b in zip(offsets, [*offsets[1:], None], strict=True):
            if b is None or b - a > 3:
                runs.append(f"{start}-{a}")
                if b is not None:
                    start = b
        lines.append(
            f"partition {partition}: {len(offsets)} skipped, first-copy offsets in runs "
            f"(gaps > 3 split them): {', '.join(runs[:limit])}{' ...' if len(runs) > limit else ''}"
        )
    lines.append(f"e.g. skipped: {skipped[:limit]}")
    return "\n".join(lines)
