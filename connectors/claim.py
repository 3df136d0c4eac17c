"""A job's claim in the broker: one runner per job anywhere, and its sources' offsets in its
consumer group (implements :class:`processor.contracts.JobClaim`).

Kafka Streams keeps a job's identity in the broker, not on a disk: its consumer group, and
transactional ids that a newer instance initializes to fence the older one (KIP-98, KIP-447).
eosflow does the same with three names derived from the job's:

* transactional id ``eosflow.<job>.runner``: the runner initializes it at start
  (``init_transactions``), which fences every earlier runner of the job, on any host, with any
  state directory; the fenced one learns it at its next transaction;
* topic ``eosflow.<job>.claim`` (compacted, one partition): each commit is a transaction of
  that producer writing one small record saying who holds the job and at which checkpoint: a
  real round trip to the transaction coordinator, which fails for a fenced runner;
* consumer group ``eosflow-<job>`` (the group id the job's readers already report): the
  sources' checkpointed offsets are committed to it through the admin API
  (``AlterConsumerGroupOffsets``: the group has no members), so ``kafka-consumer-groups
  --describe``, Burrow and lag exporters see where the job is, and a start without state sees
  that the job has history.

**The order of a commit: the group first, then the claim's transaction.** A commit that returns
proves that the runner still held the job *after* its offsets were in the group. A newcomer
initializes the transactional id, then reads the group again (``JobIdentity.take``): if it
fenced the runner before the runner's transaction committed, the runner's commit fails and it
releases nothing; if after, the runner's offsets were in the group before the newcomer looked,
and the newcomer is refused. The other order (claim, then group: before issue 48) let a
newcomer without state in between the two steps: it saw an empty group, took the job and read
every source again, while the old runner's group commit (an admin call, which no fencing stops)
succeeded and its sinks committed the same checkpoint. What the order costs: a runner fenced
while its group commit is in flight leaves its offsets in the group once, until the new holder's
next commit replaces them (a restart of the new holder before that is refused as "behind").

Why not the offsets inside the transaction (``send_offsets_to_transaction``, as Kafka Streams
does)? librdkafka's call ignores its timeout when the group coordinator cannot be reached
(confluentinc/librdkafka#5456, open): a broker refusing connections for 5 s left a runner
blocked in it for good (tests/e2e/test_partitions.py). Every call here has a deadline. The
group is visibility and a history marker, not the source of truth (a checkpoint is), so
committing it just before the claim's transaction loses nothing: a crash between the two leaves
the group holding a checkpoint that completed in the runner's store (its sinks commit it when
that store is restored). The same calls run on every broker; nothing here is chosen by a
timeout or by the broker's name.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, NoReturn, TypeVar

from confluent_kafka import (
    ConsumerGroupTopicPartitions,
    KafkaError,
    KafkaException,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient

from connectors.admin import TopicAdmin, admin_client, forget_admin_client, kept_admin_client
from connectors.config import (
    KafkaSettings,
    connect_producer,
    consumer_config,
    create_consumer,
    create_producer,
    producer_config,
)
from connectors.errors import classify, is_fenced, retrying
from connectors.offsets import watermarks
from processor.errors import ConfigError, JobFencedError, KafkaClientError

__all__ = [
    "CLAIM_TOPIC_CONFIG",
    "KafkaJobClaim",
    "claim_topic",
    "commit_job_group",
    "delete_job_group",
    "job_group",
    "job_group_offsets",
    "runner_transactional_id",
]

log = logging.getLogger(__name__)
TP = tuple[str, int]

#: The claim topic keeps the newest record (one key): who holds the job, at which checkpoint.
CLAIM_TOPIC_CONFIG: Mapping[str, str] = {"cleanup.policy": "compact"}
_KEY = b"claim"
#: How long a group commit waits on the kept admin client before it tries a new one.
_KEPT_ADMIN_S = 3.0
#: The timeout librdkafka is given for an admin request to the group's coordinator: the
#: longest it accepts, so that librdkafka never times such a request out itself (see
#: :func:`_on_coordinator`); the caller's deadline is a wait on the request's future.
_UNTIMED_S = 3600.0
_T = TypeVar("_T")


def job_group(job: str) -> str:
    """The job's consumer group: where its sources' checkpointed offsets are committed."""
    return f"eosflow-{job}"


def runner_transactional_id(job: str) -> str:
    """The transactional id whose newest initializer holds the job."""
    return f"eosflow.{job}.runner"


def claim_topic(job: str) -> str:
    """The topic of the job's claim records (under the job's internal topic prefix, so that
    ``eosflow reset`` deletes it with the channels)."""
    return f"eosflow.{job}.claim"


def job_group_offsets(settings: KafkaSettings, job: str, *, timeout: float = 10.0) -> dict[TP, int]:
    """The committed offsets of the job's group, every topic (``kafka-consumer-groups
    --describe``; empty when the group has none or does not exist). Stable: offsets of a
    transaction still completing are waited for (``require_stable``, KIP-447)."""
    group = job_group(job)
    _wait_for_coordinator(settings, group, timeout)

    def fetch(admin: AdminClient, wait: float) -> dict[TP, int]:
        request = [ConsumerGroupTopicPartitions(group)]
        futures = admin.list_consumer_group_offsets(
            request, require_stable=True, request_timeout=_UNTIMED_S
        )
        try:
            found = futures[group].result(timeout=wait)
        except KafkaException as exc:
            if exc.args and exc.args[0].code() == KafkaError.GROUP_ID_NOT_FOUND:
                return {}
            raise
        return {
            (str(tp.topic), int(tp.partition)): int(tp.offset)
            for tp in found.topic_partitions or []
            if tp.error is None and tp.offset is not None and tp.offset >= 0
        }

    context = f"listing the offsets of consumer group {group!r}"
    return _on_coordinator(settings, fetch, context, deadline_s=timeout)[0]


def _wait_for_coordinator(settings: KafkaSettings, group: str, timeout: float) -> None:
    """Returns once the group's coordinator answers an offset fetch (a consumer's, which waits
    out ``COORDINATOR_LOAD_IN_PROGRESS`` itself). On a broker that just created
    ``__consumer_offsets`` (a fresh container, a fresh CI broker) the admin client's
    ListConsumerGroupOffsets met a loading coordinator and librdkafka 2.16.1 crashed the process
    with SIGSEGV in ``rd_kafka_cgrp_op`` (core dump; about every second try on a new Kafka 4.3.1)
    or answered the error as final. Offset fetches do not join or change the group. Once per
    process and group: a loaded coordinator stays loaded while its broker lives."""
    if (settings.brokers, group) in _coordinators_seen:
        return
    consumer = create_consumer(
        {**consumer_config(settings, group_id=group), "socket.timeout.ms": 10000}
    )
    try:
        retrying(
            lambda t: consumer.committed([TopicPartition(f"{group}-probe", 0)], timeout=t),
            f"waiting for the coordinator of consumer group {group!r}",
            deadline_s=timeout,
        )
    finally:
        consumer.close()
    _coordinators_seen.add((settings.brokers, group))


_coordinators_seen: set[tuple[str, str]] = set()


def commit_job_group(
    settings: KafkaSettings,
    job: str,
    offsets: Mapping[TP, int],
    *,
    timeout: float = 10.0,
    admin: AdminClient | None = None,
) -> AdminClient:
    """Commit ``offsets`` to the job's group (``AlterConsumerGroupOffsets``; the group has no
    members), retrying for at most ``timeout`` seconds (idempotent: a dropped connection too).
    ``admin``: a client the caller keeps (else a new one).

    Returns:
        The client that answered: ``admin``, or the new one that replaced it when it did not
        answer in time (:func:`_on_coordinator`); the caller keeps this one.

    Raises:
        KafkaClientError: the broker refused, or did not answer within the deadline.
    """
    group = job_group(job)
    tps = [TopicPartition(t, p, o) for (t, p), o in sorted(offsets.items())]
    context = f"committing the source offsets of job {job!r} to consumer group {group!r}"

    def commit(client: AdminClient, wait: float) -> None:
        futures = client.alter_consumer_group_offsets(
            [ConsumerGroupTopicPartitions(group, tps)], request_timeout=_UNTIMED_S
        )
        done = futures[group].result(timeout=wait)
        for tp in done.topic_partitions or []:
            if tp.error is not None:
                raise KafkaException(tp.error)

    return _on_coordinator(
        settings, commit, context, deadline_s=timeout, admin=admin, idempotent=True
    )[1]


def delete_job_group(settings: KafkaSettings, job: str, *, timeout: float = 10.0) -> bool:
    """Delete the job's group (its committed offsets): True if there was one.

    Raises:
        ConfigError: the group has active members (a consumer subscribed under its name).
    """
    group = job_group(job)

    def delete(admin: AdminClient, wait: float) -> None:
        admin.delete_consumer_groups([group], request_timeout=_UNTIMED_S)[group].result(wait)

    try:
        _on_coordinator(settings, delete, f"deleting consumer group {group!r}", deadline_s=timeout)
    except KafkaClientError as exc:
        if exc.code == "GROUP_ID_NOT_FOUND":
            return False
        if exc.code == "NON_EMPTY_GROUP":
            raise ConfigError(
                f"consumer group {group!r} of job {job!r} has active members (a consumer "
                "subscribed under the job's group id); stop them, then delete the group: "
                f"kafka-consumer-groups.sh --bootstrap-server {settings.brokers} --delete "
                f"--group {group}"
            ) from None
        raise
    return True


def _on_coordinator(
    settings: KafkaSettings,
    request: Callable[[AdminClient, float], _T],
    context: str,
    *,
    deadline_s: float,
    admin: AdminClient | None = None,
    idempotent: bool = False,
) -> tuple[_T, AdminClient]:
    """``request(client, wait)``: an admin request to the job group's coordinator, waited on
    for at most ``wait`` seconds; retried as :func:`~connectors.errors.retrying` does, for at
    most ``deadline_s`` seconds, on ``admin`` (else :func:`admin_client`'s). Returns its result
    and the client that answered.

    librdkafka must never time such a request out itself: its requests carry
    :data:`_UNTIMED_S`. librdkafka 2.16.0 (and its source to this day) frees the state of a
    request to a coordinator twice when the request timed out while the coordinator's
    connection was down and that connection came up again while the client lived: the lookup
    (``rd_kafka_coord_req``) outlives the request it serves, sends it once the coordinator is
    back, finds it gone, and hands the freed state to ``rd_kafka_admin_coord_response_parse``.
    The process aborted (``rd_kafka_enq_once_del_source_return: Assertion `eonce->refcnt > 0'
    failed``): the runner, retrying its group commit every ~11 s through a 45 s network
    partition (tests/e2e/test_partitions.py; every time in
    tests/integration/test_group_coordinator_outage.py). So the deadline is a wait on the
    request's future, and a client that did not answer in time is not used again: it is
    dropped (destroying a client ends its requests without that path; one still referenced
    somewhere is harmless, its request completing normally whenever the coordinator answers)
    and the next try has a new one.
    """
    held: list[AdminClient | None] = [admin]  # the client of the next try
    del admin  # this frame holds no other reference (a caller may still hold its own)

    def attempt(wait: float) -> _T:
        client = held[0]
        if client is None:
            client = held[0] = admin_client(settings)
        try:
            return request(client, wait)
        except TimeoutError:  # concurrent.futures: no answer within ``wait``
            pass
        # Raised outside the handler, so that no traceback keeps the dropped client alive.
        held[0] = None
        forget_admin_client(client)
        del client
        raise KafkaException(
            KafkaError(KafkaError._TIMED_OUT, f"no answer within {wait:.1f}s", retriable=True)
        )

    result = retrying(attempt, context, deadline_s=deadline_s, idempotent=idempotent)
    client = held[0]
    assert client is not None  # the attempt that returned had one
    return result, client


class KafkaJobClaim:
    """The claim of ``job`` on the cluster of ``settings`` (see the module docstring)."""

    def __init__(self, settings: KafkaSettings, job: str, *, timeout: float = 30.0) -> None:
        self.settings = settings
        self.job = job
        self.group = job_group(job)
        self.transactional_id = runner_transactional_id(job)
        self.topic = claim_topic(job)
        self._timeout = timeout
        self._producer: Any = None
        self._admin: AdminClient | None = None  # kept: the group is committed every checkpoint
        self._unfinished = False  # a commit_transaction that timed out: resumed next time

    def __repr__(self) -> str:
        return f"KafkaJobClaim({self.job!r}, {self.settings.brokers!r})"

    def committed(self) -> dict[TP, int]:
        return job_group_offsets(self.settings, self.job, timeout=self._timeout)

    def prepare(self) -> None:
        """What :meth:`open` does before it fences anybody: the claim topic, the producer and
        its broker connection. A start runs it while it checks the job's history (a refused
        start leaves only the topic, which is the job's anyway); :meth:`open` does it if not
        done."""
        if self._producer is not None:
            return
        producer = create_producer(
            producer_config(
                self.settings,
                transactional_id=self.transactional_id,
                overrides={"client.id": f"eosflow-{self.job}-runner"},
            )
        )  # it connects while the topic is made
        TopicAdmin(self.settings).ensure_topic(self.topic, 1, CLAIM_TOPIC_CONFIG, any_count=True)
        connect_producer(producer)  # else librdkafka's 500 ms PID timer, often
        self._producer = producer

    def open(self) -> None:
        self.prepare()
        retrying(
            self._producer.init_transactions,
            f"initializing transactional id {self.transactional_id!r} (taking job {self.job!r})",
            deadline_s=self._timeout,
        )
        log.info("job=%s claimed transactional_id=%s", self.job, self.transactional_id)

    def commit(self, offsets: Mapping[TP, int], claim: Mapping[str, Any]) -> None:
        producer = self._producer
        if producer is None:  # closed after a fatal error whose reopening failed: reopen
            raise KafkaClientError(
                f"job {self.job!r}'s claim has no producer (not open, or its reopening failed)",
                code="_STATE",
                fatal=True,
            )
        if offsets:  # first: see "The order of a commit" in the module docstring
            self._commit_group(offsets)
        try:
            if self._unfinished:
                # librdkafka: a commit that timed out is resumed by calling commit again (an
                # abort or a new transaction meanwhile fails with _CONFLICT / _STATE).
                producer.commit_transaction(self._timeout)
                self._unfinished = False
            producer.begin_transaction()
            producer.produce(self.topic, json.dumps(dict(claim)).encode(), _KEY, partition=0)
            self._unfinished = True
            producer.commit_transaction(self._timeout)
            self._unfinished = False
        except KafkaException as exc:
            self._failed(exc)

    def _commit_group(self, offsets: Mapping[TP, int]) -> None:
        """The group commit on the kept admin client (2 ms against a new client's 55), for at
        most :data:`_KEPT_ADMIN_S`; then, or when there is none, on a new client, which is
        kept once it answered. A kept client whose connection went bad in an outage (a broker
        refusing connections for 5 s, behind the partition tests' proxy) timed out every
        request after it, for minutes: a new client connects anew. A client that did not
        answer is dropped here (see :func:`_on_coordinator`)."""
        if self._admin is not None:
            try:
                self._admin = commit_job_group(
                    self.settings,
                    self.job,
                    offsets,
                    timeout=min(self._timeout, _KEPT_ADMIN_S),
                    admin=self._admin,
                )
                return
            except KafkaClientError as exc:
                log.info("job=%s: the kept admin client failed (%s); a new one", self.job, exc)
                self._admin = None
        self._admin = commit_job_group(
            self.settings,
            self.job,
            offsets,
            timeout=self._timeout,
            admin=kept_admin_client(self.settings),
        )

    def _failed(self, exc: KafkaException) -> NoReturn:
        if is_fenced(exc):
            raise JobFencedError(
                f"transactional id {self.transactional_id!r} was initialized by a newer "
                f"runner ({exc.args[0].str() if exc.args else exc})"
            ) from None
        error = classify(exc, context=f"committing job {self.job!r}'s claim")
        if error.txn_requires_abort or (not error.retriable and not error.fatal):
            self._unfinished = False
            try:
                self._producer.abort_transaction(self._timeout)
            except KafkaException as again:
                if is_fenced(again):
                    raise JobFencedError(
                        f"transactional id {self.transactional_id!r} was initialized by a "
                        "newer runner"
                    ) from None
                log.warning("job=%s: aborting the claim transaction failed: %s", self.job, again)
        raise error from exc

    def last(self) -> dict[str, Any] | None:
        """The newest committed claim record, read back from the end of the claim topic
        (``read_committed``: up to the last stable offset, so a newer runner's transaction
        still open is not waited for). Called after :meth:`open`: every earlier runner's claim
        transaction has committed or aborted by then; before it (who holds the job now), the
        newest committed record so far, ``None`` when the job never ran.

        Raises:
            KafkaClientError: the topic could not be read within the claim's timeout.
        """
        config = consumer_config(self.settings, group_id=f"eosflow-{self.job}-claim-reader")
        consumer = create_consumer({**config, "enable.partition.eof": True})
        try:
            # before open(), a job that never ran has no claim topic: no record
            # (``--takeover``, ``--start-over``)
            listed = consumer.list_topics(self.topic, timeout=self._timeout).topics.get(self.topic)
            if listed is None or (
                listed.error is not None and listed.error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART
            ):
                return None
            # measured by fetch (connectors.offsets: Tansu's ListOffsets answers a wrong end)
            low, high = watermarks(config, [(self.topic, 0)], timeout=self._timeout)[
                (self.topic, 0)
            ]
            window = 64
            deadline = time.monotonic() + self._timeout
            while high > low:
                start = max(low, high - window)
                found = self._newest(consumer, start, high, deadline)
                if found is not None or start == low:
                    return found
                window *= 16  # only aborted claims (or markers) near the end: look further
            return None
        except KafkaException as exc:
            raise classify(exc, context=f"reading job {self.job!r}'s claim") from exc
        finally:
            consumer.close()

    def _newest(
        self, consumer: Any, start: int, end: int, deadline: float
    ) -> dict[str, Any] | None:
        """The last claim record in ``[start, end)``: ``end`` was measured after :meth:`open`,
        so every earlier runner's committed claim is before it. Stops at the first record from
        ``end`` on (a running holder keeps committing: the end offset moves) or at the end."""
        consumer.assign([TopicPartition(self.topic, 0, start)])
        newest: dict[str, Any] | None = None
        while time.monotonic() < deadline:
            msg = consumer.poll(0.2)
            if msg is None:
                continue
            error = msg.error()
            if error is not None:
                if error.code() == KafkaError._PARTITION_EOF:
                    return newest
                raise KafkaException(error)
            if msg.offset() >= end:
                return newest
            try:
                record = json.loads(msg.value() or b"null")
            except ValueError:
                continue  # not a claim record: nothing of eosflow's
            if isinstance(record, dict):
                newest = record
        raise KafkaClientError(
            f"reading job {self.job!r}'s claim topic {self.topic!r}: no end within "
            f"{self._timeout:.0f}s",
            retriable=True,
        )

    def forget(self) -> None:
        if delete_job_group(self.settings, self.job, timeout=self._timeout):
            log.info("job=%s deleted consumer group=%s", self.job, self.group)

    def close(self) -> None:
        self._producer = None  # nothing is left to flush: every transaction ended
