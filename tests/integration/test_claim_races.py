"""Two runners of one job racing on the claim (issue 48 item 1), with real broker calls: hooks
only hold one runner at a named point of its claim's commit or start while the other acts.

* ``released-and-taken``: runner A commits checkpoint 1 while runner B starts without state.
  On main (the claim's transaction, then the group) B could start between A's two steps: it saw
  an empty group, took the job and would read every source again, while A's group commit
  succeeded and A released checkpoint 1 to its sinks: both went on, every record twice. Now the
  group goes first: whatever the point, A releases nothing or B is refused.
* ``stale-state``: B starts with a copy of A's state at checkpoint 1 and is held between its
  history check and its fencing while A completes checkpoint 2. On main B did not look at the
  group again after fencing: it restored checkpoint 1 (replaying what A committed for 2) and
  rewound the group to checkpoint 1. Now B is refused, naming its checkpoint, and the group
  keeps checkpoint 2.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

import connectors.claim as claim_module
from connectors import KafkaSettings
from connectors.claim import KafkaJobClaim, job_group_offsets
from processor.errors import JobFencedError, JobHistoryError
from processor.runtime.supervision.identity import JobIdentity
from processor.snapshot.fileformat import Manifest
from processor.testing import create_topic, unique_name

pytestmark = pytest.mark.integration


class _Gate:
    """Holds the thread that reaches it until the test lets it go."""

    def __init__(self) -> None:
        self.reached = threading.Event()
        self.go = threading.Event()

    def hold(self) -> None:
        self.reached.set()
        assert self.go.wait(60), "the test never let the held runner go"


class _HeldProducer:
    """A's real transactional producer, held before ``commit_transaction``."""

    def __init__(self, producer: Any, gate: _Gate) -> None:
        self._producer = producer
        self._gate = gate

    def commit_transaction(self, *args: Any) -> Any:
        self._gate.hold()
        return self._producer.commit_transaction(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._producer, name)


class _Transport:
    """What ``JobIdentity.take`` asks of a transport: the job's claim (a real one)."""

    def __init__(self, claim: KafkaJobClaim) -> None:
        self.claim = claim

    def job_claim(self, job: str) -> KafkaJobClaim:
        assert job == self.claim.job
        return self.claim


@pytest.fixture
def job(request: pytest.FixtureRequest) -> str:
    return unique_name(request.node.name, limit=60)


@pytest.fixture
def source(kafka_endpoint: tuple[str, str], job: str) -> str:
    """The job's source topic (the group's offsets must name a topic that exists)."""
    return create_topic(kafka_endpoint[0], f"{job}-clicks", 1)


@pytest.fixture
def runners(kafka_endpoint: tuple[str, str], job: str) -> Iterator[list[JobIdentity]]:
    made: list[JobIdentity] = []
    yield made
    for identity in made:
        identity.close()


def _claim(brokers: str, job: str) -> KafkaJobClaim:
    # A settings object of its own per runner: the group-commit hook tells A's calls by it.
    return KafkaJobClaim(KafkaSettings.from_env(brokers=brokers), job, timeout=20.0)


def _outcome(identity: JobIdentity, checkpoint: int, timeout: float = 60.0) -> bool:
    """True once ``checkpoint``'s completion notice is due, False if the runner was fenced."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if checkpoint in identity.ready():
                return True
        except JobFencedError:
            return False
        time.sleep(0.05)
    raise AssertionError(f"checkpoint {checkpoint} neither released nor fenced in {timeout}s")


def _manifest(job: str, source: str, checkpoint: int, offset: int) -> Manifest:
    return Manifest(job, checkpoint, 0, {}, {"sources": [[source, 0, offset]]})


@pytest.mark.parametrize("point", ["before-group-commit", "before-claim-commit"])
def test_a_runner_releases_nothing_or_the_newcomer_is_refused_when_both_race_at_a_checkpoint(
    kafka_endpoint: tuple[str, str],
    job: str,
    source: str,
    runners: list[JobIdentity],
    monkeypatch: pytest.MonkeyPatch,
    point: str,
) -> None:
    """``released-and-taken`` (module docstring): failed on main at ``before-group-commit``
    (A released checkpoint 1 and B took the job with an empty group)."""
    brokers = kafka_endpoint[0]
    gate = _Gate()
    a_claim = _claim(brokers, job)
    a = JobIdentity.take(job, _Transport(a_claim), None)
    runners.append(a)
    if point == "before-group-commit":
        commit_group = claim_module.commit_job_group

        def held(settings: KafkaSettings, *args: Any, **kwargs: Any) -> None:
            if settings is a_claim.settings:
                gate.hold()
            return commit_group(settings, *args, **kwargs)

        monkeypatch.setattr(claim_module, "commit_job_group", held)
    else:
        a_claim._producer = _HeldProducer(a_claim._producer, gate)

    a.completed(1, [[source, 0, 100]])
    assert gate.reached.wait(60), "runner A never reached its commit"
    try:
        b = JobIdentity.take(job, _Transport(_claim(brokers, job)), None)
        runners.append(b)
        b_took = True
    except JobHistoryError as exc:
        b_took = False
        assert "has history in Kafka" in str(exc)
    gate.go.set()
    a_released = _outcome(a, 1)

    print(f"point={point}: A released checkpoint 1: {a_released}; B took the job: {b_took}")
    assert not (a_released and b_took), (
        "A released checkpoint 1 to its sinks and B took the job without state: B reads every "
        "source again, every record twice"
    )
    assert a_released or b_took, "nobody holds the job"
    if not b_took:  # A goes on, and its offsets are the group's
        assert job_group_offsets(KafkaSettings.from_env(brokers=brokers), job) == {(source, 0): 100}


def test_a_start_from_a_stale_copy_is_refused_when_the_holder_checkpoints_while_it_starts(
    kafka_endpoint: tuple[str, str], job: str, source: str, runners: list[JobIdentity]
) -> None:
    """``stale-state`` (module docstring): on main B took the job from checkpoint 1 and the
    group went back from 200 to 100."""
    brokers = kafka_endpoint[0]
    settings = KafkaSettings.from_env(brokers=brokers)
    a = JobIdentity.take(job, _Transport(_claim(brokers, job)), None)
    runners.append(a)
    a.completed(1, [[source, 0, 100]])
    assert _outcome(a, 1)

    gate = _Gate()
    b_claim = _claim(brokers, job)
    open_claim = b_claim.open

    def held_open() -> None:
        gate.hold()  # B checked the group (100, its own checkpoint): not fenced A yet
        open_claim()

    b_claim.open = held_open  # type: ignore[method-assign]
    refused: list[BaseException] = []

    def start_b() -> None:
        try:
            stale = _manifest(job, source, 1, 100)
            runners.append(JobIdentity.take(job, _Transport(b_claim), stale))
        except JobHistoryError as exc:
            refused.append(exc)

    thread = threading.Thread(target=start_b, name="runner-b")
    thread.start()
    assert gate.reached.wait(60), "runner B never reached its fencing"
    a.completed(2, [[source, 0, 200]])
    assert _outcome(a, 2)
    gate.go.set()
    thread.join(60)

    assert refused, "B took the job from checkpoint 1 after A committed checkpoint 2"
    message = str(refused[0])
    assert "checkpoint 1" in message and f"{source}[0]=200" in message, message
    assert job_group_offsets(settings, job) == {(source, 0): 200}, "the group was rewound"


class _FatalOnce:
    """A claim producer whose next ``commit_transaction`` fails as librdkafka's fatal errors
    do (the client is unusable from then on: every later call fails too)."""

    def __init__(self, producer: Any) -> None:
        self._producer = producer
        self.failed = False

    def commit_transaction(self, *args: Any) -> Any:
        from confluent_kafka import KafkaError, KafkaException

        self.failed = True
        raise KafkaException(KafkaError(KafkaError._FATAL, "injected fatal error", fatal=True))

    def __getattr__(self, name: str) -> Any:
        if self.failed:
            from confluent_kafka import KafkaError, KafkaException

            raise KafkaException(KafkaError(KafkaError._FATAL, "unusable", fatal=True))
        return getattr(self._producer, name)


def test_a_fatal_claim_producer_error_is_survived_by_a_new_producer(
    kafka_endpoint: tuple[str, str], job: str, source: str, runners: list[JobIdentity]
) -> None:
    """Issue 48 item 5: after a fatal librdkafka error the claim's producer was never rebuilt:
    no checkpoint was released again (the sinks waited for ever). Now the runner opens a new
    producer (checking that no other runner recorded itself meanwhile) and releases the
    checkpoint, its offsets in the group."""
    brokers = kafka_endpoint[0]
    a_claim = _claim(brokers, job)
    a = JobIdentity.take(job, _Transport(a_claim), None)
    runners.append(a)
    a.announce(1)
    a_claim._producer = _FatalOnce(a_claim._producer)
    a.completed(1, [[source, 0, 100]])
    assert _outcome(a, 1), "runner A was taken for fenced"
    assert not isinstance(a_claim._producer, _FatalOnce), "the producer was not replaced"
    assert job_group_offsets(KafkaSettings.from_env(brokers=brokers), job) == {(source, 0): 100}
    a.completed(2, [[source, 0, 150]])
    assert _outcome(a, 2)


def test_a_runner_whose_claim_producer_failed_stops_when_another_took_the_job_meanwhile(
    kafka_endpoint: tuple[str, str], job: str, source: str, runners: list[JobIdentity]
) -> None:
    """The reopening must not take the job back: runner B took it (and recorded itself)
    between A's fatal error and A's new producer. A stops, fenced, releasing nothing."""
    brokers = kafka_endpoint[0]
    a_claim = _claim(brokers, job)
    a = JobIdentity.take(job, _Transport(a_claim), None)
    runners.append(a)
    a.announce(1)
    b = JobIdentity.take(job, _Transport(_claim(brokers, job)), None)
    runners.append(b)
    b.announce(2)
    a_claim._producer = _FatalOnce(a_claim._producer)  # as if it failed before B fenced it
    a.completed(1, [[source, 0, 100]])
    assert not _outcome(a, 1), "A released a checkpoint after B took the job"


def test_a_takeovers_copy_behind_the_group_is_refused_and_a_savepoint_rewinds_on_purpose(
    kafka_endpoint: tuple[str, str], job: str, source: str, runners: list[JobIdentity]
) -> None:
    """A takeover starts from the holder's copied state (``--takeover`` sets the savepoint
    itself): a group ahead of it means another runner went on meanwhile, so it is refused as
    stale state is. Only ``--from-savepoint`` rewinds on purpose (its output is committed
    again, as asked). Before, both passed the check: a takeover that raced a runner starting
    on the stopped holder's store replayed that runner's committed output."""
    from processor.runtime.job import RunOptions

    brokers = kafka_endpoint[0]
    a = JobIdentity.take(job, _Transport(_claim(brokers, job)), None)
    runners.append(a)
    a.completed(2, [[source, 0, 200]])
    assert _outcome(a, 2)
    copy = _manifest(job, source, 1, 100)
    takeover = RunOptions(from_savepoint="file:///copied/sp-1", takeover=True)
    with pytest.raises(JobHistoryError, match="checkpoint 1"):
        JobIdentity.take(job, _Transport(_claim(brokers, job)), copy, rewind=takeover.rewinds())
    savepoint = RunOptions(from_savepoint="file:///kept/sp-1")
    b = JobIdentity.take(job, _Transport(_claim(brokers, job)), copy, rewind=savepoint.rewinds())
    runners.append(b)
