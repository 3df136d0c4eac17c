"""Loops (``stream.iterate``) are exactly once: workers are SIGKILLed at every named protocol
point and at random moments while records circulate, and the committed output is compared with
an answer computed without the engine.

* ``pipelines/loop_hops.py``: every click goes around a loop ``amount % 6`` times through a
  shuffle and a keyed pass counter; a back-edge record lost or processed twice changes the
  output. Clicks over ``max_iterations`` are dead letters, also compared exactly.
* ``examples/connected_components.py``: label propagation over a stream of graph edges; the
  final labels must equal union-find's, and no changelog line may be committed twice.

Each run records the back-edge log size of every completed checkpoint (printed, and kept in
``loop-logs.json`` of the test's directory) and asserts that checkpoints completed with records
in the loop, so the log really was part of what was restored.
"""

from __future__ import annotations

import json
import sys
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from processor.runtime.supervision.runner import RunResult
from sinks import read_jsonl
from tests.e2e.harness import (
    ENGINE_FAULTS,
    ROOT,
    RUNNERS,
    assert_exactly_once,
    assert_faults_fired,
    canonical,
    chaos_seed,
    run_chaos,
)

sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "tests" / "e2e" / "pipelines"))

from clicks import produce_json
from connected_components import check_labels, graph_edges, reference_labels
from loop_hops import expected_hops

pytestmark = [pytest.mark.integration, pytest.mark.chaos]


def record_loop_logs(result: RunResult, tmp: Path, seed: int) -> list[tuple[int, int, float]]:
    """Prints and saves (checkpoint, back-edge log records, seconds) per completed checkpoint;
    asserts that some checkpoint completed while records were on the back-edges."""
    logs = result.loop_logs
    (tmp / "loop-logs.json").write_text(json.dumps(logs))
    print(
        "back-edge log per checkpoint (id: records, ms): "
        + ", ".join(f"{c}: {n} ({s * 1000:.0f})" for c, n, s in logs)
    )
    assert any(n > 0 for _c, n, _s in logs), (
        f"seed={seed}: no checkpoint completed while records were in the loop: {logs}"
    )
    assert logs[-1][1] == 0, f"seed={seed}: the job ended with records in the loop: {logs[-1]}"
    return logs


@pytest.mark.parametrize("mode", ["aligned", "unaligned"])
def test_records_in_a_loop_are_exactly_once_when_workers_are_killed(
    kafka_endpoint: tuple[str, str], tmp_path: Path, mode: str
) -> None:
    seed = chaos_seed()
    records, random_kills = 40_000, 3
    dead_dir = tmp_path / "dead-letters"
    run = run_chaos(
        "loop_hops.py",
        brokers=kafka_endpoint[0],
        tmp=tmp_path,
        records=records,
        seed=seed,
        mode=mode,
        interval=0.3,
        faults=ENGINE_FAULTS,
        random_kills=random_kills,
        env={"DEAD_LETTER_DIR": str(dead_dir)},
    )
    want, want_dead = expected_hops(records, seed)
    assert_exactly_once(want, run.output, seed=seed)
    got_dead = Counter(
        canonical([d["step"], d["error_type"], d["value"]]) for d in read_jsonl(dead_dir)
    )
    assert_exactly_once(want_dead, got_dead, seed=seed)
    assert_faults_fired(run, ENGINE_FAULTS, random_kills, seed=seed)
    record_loop_logs(run.result, tmp_path, seed)


@pytest.mark.parametrize("runner", RUNNERS)
def test_connected_components_equal_union_find_when_workers_are_killed(
    kafka_endpoint: tuple[str, str], tmp_path: Path, runner: str
) -> None:
    seed = chaos_seed()
    edges, nodes = 6_000, 10_000
    random_kills = 3 if runner == "local" else 1
    topic = f"edges-{uuid.uuid4().hex[:8]}"

    def produce(brokers: str, _topic: str) -> Any:
        return produce_json(
            brokers, topic, graph_edges(edges, nodes=nodes, seed=seed), key=lambda e: str(e["u"])
        )

    run = run_chaos(
        str(ROOT / "examples" / "connected_components.py"),
        brokers=kafka_endpoint[0],
        tmp=tmp_path,
        records=edges,
        seed=seed,
        mode="aligned",
        interval=0.3,
        random_kills=random_kills,
        env={"EDGES_TOPIC": topic},
        runner=runner,
        produce=produce,
    )
    lines = read_jsonl(tmp_path / "output")
    want = reference_labels(graph_edges(edges, nodes=nodes, seed=seed))
    problems = check_labels(lines, want)
    assert not problems, f"seed={seed}: " + "; ".join(problems[:10])
    assert len(run.random_kills) == random_kills, f"seed={seed}: {run.random_kills}"
    assert run.result.restarts >= random_kills
    record_loop_logs(run.result, tmp_path, seed)
