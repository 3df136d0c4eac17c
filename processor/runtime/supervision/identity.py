"""One job, one identity, in the broker: a second runner anywhere fences the first, and a start
without the job's state never reprocesses silently.

The lease (:mod:`processor.snapshot.lease`) sees one snapshot store. Two runners of one job with
two state directories (two hosts, a container restarted on a fresh volume) would both run over
the job's channel topics and transactional ids, and a runner whose state was lost would read
every source again and commit its output again. So the job's identity also lives where every
runner of it must go, the broker, as Kafka Streams keeps it (the transport's
:class:`~processor.contracts.JobClaim`, ``connectors.claim`` on Kafka):

* **At start** (:meth:`JobIdentity.take`): the job's consumer group (``eosflow-<job>``) holds
  the source offsets of the job's last committed checkpoint, wherever it ran. A start whose
  store has no checkpoint while the group holds offsets, or whose checkpoint is behind them
  (a stale copy of the state), is refused with :class:`~processor.errors.JobHistoryError`,
  naming the ways on, unless ``--start-over``. Then the runner initializes the job's runner
  transactional id (``eosflow.<job>.runner``), which fences every earlier runner of the job,
  and looks at the group once more, with or without a checkpoint: a runner that committed in
  between is fenced now, and its offsets refuse this start too (before issue 48 only a start
  without a checkpoint looked again: one with a stale copy restored it and rewound the group).
* **On every completed checkpoint** (:meth:`completed`, :meth:`ready`): the source tasks'
  checkpointed positions are committed to the group, then the claim's transaction commits (the
  fencing check), in the background; the checkpoint's completion notice (on which the sinks
  commit) goes out only once both succeeded. The order makes the release safe: a runner that
  releases a checkpoint held the job after its offsets were in the group, so a newcomer that
  fenced it later sees them (:mod:`connectors.claim`, "The order of a commit"). So no runner
  commits output the group does not account for, and a fenced runner learns it at its next
  checkpoint: :class:`~processor.errors.JobFencedError` ("another runner took job ..."), never
  a success.
* **Before every restart** (:meth:`verify`): the same commit, synchronously, so a runner whose
  workers failed because another runner fenced their transactional ids stops with that message
  instead of restarting into the other runner's way.
* **Generations** (:meth:`announce`, :attr:`prior_generation`): every claim record carries the
  highest generation any runner of the job used (the channel writers' incarnation), and a
  runner records each new generation in the claim, synchronously, before its workers start. A
  start reads the newest claim record after fencing and begins above it. Two runners with two
  stores both allocated generation 1 before (issue 48): the one fenced later went on writing
  channel records until its next checkpoint, and the other's readers took them as their own.
  Now the later runner's generation is higher, so its readers drop the fenced one's records
  (:mod:`processor.wire`, "Fencing"): if the fenced runner announced its generation, the
  newcomer read it after fencing; if not, the announcement failed and it never started workers.

The group is a visibility tool and a history marker, never the source of truth: a job with a
checkpoint restores its source positions from the checkpoint (docs/engine.md, "One runner per
job, and the job's history, in Kafka").
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from processor.contracts import JobClaim
from processor.errors import EosflowError, JobFencedError, JobHistoryError, KafkaClientError
from processor.snapshot.store import Manifest

__all__ = ["JobIdentity", "describe_offsets"]

log = logging.getLogger(__name__)

TP = tuple[str, int]
_RETRY_S = 1.0


def describe_offsets(offsets: Mapping[TP, int], limit: int = 6) -> str:
    """``clicks[0]=812, clicks[1]=790`` (at most ``limit``, then ``+N more``)."""
    items = [f"{t}[{p}]={o}" for (t, p), o in sorted(offsets.items())]
    more = f", +{len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


#: A holder is taken for running if its newest claim record is younger than this many of its
#: checkpoint intervals (every completed checkpoint writes one), and at least _LIVE_MIN_S.
_LIVE_INTERVALS = 5
_LIVE_MIN_S = 60.0


def holder_text(
    job: str, record: Mapping[str, Any] | None, now_s: float, *, leased: str = ""
) -> str:
    """ "job J is running now: runner on host H, pid P, checkpoint N at T (Xs ago)" when the
    claim's newest record (:meth:`JobClaim.last`) is recent enough for its runner to be
    running, else ``""``.

    ``leased``: the snapshot store whose lease the caller holds. A record of a runner on that
    store (on this host, for a ``file://`` store: another host's path is another directory) is
    of a runner that is gone, however recent (killed: its lease went with it), so ``""``.
    """
    if not record or record.get("stopped") or not isinstance(record.get("at_ms"), int):
        return ""
    if leased and record.get("store") == leased:
        here = socket.gethostname()
        if not leased.startswith("file:") or record.get("host") == here:
            return ""
    age = now_s - record["at_ms"] / 1000
    interval = float(record.get("interval_ms") or 0) / 1000
    if age > max(_LIVE_MIN_S, _LIVE_INTERVALS * interval):
        return ""
    at = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record["at_ms"] / 1000))
    return (
        f"job {job!r} is running now: runner on host {record.get('host', '?')}, pid "
        f"{record.get('pid', '?')}, checkpoint {record.get('checkpoint', '?')} at {at} "
        f"({max(age, 0):.0f}s ago; snapshot store {record.get('store') or '?'})"
    )


def _generation_of(record: Mapping[str, Any] | None) -> int:
    """The generation a claim record names (0: none, or a release before issue 48)."""
    try:
        return int((record or {}).get("generation", 0))
    except (TypeError, ValueError):
        return 0


def _positions(sources: Any) -> dict[TP, int]:
    return {(str(t), int(p)): int(o) for t, p, o in sources or ()}


class JobIdentity:
    """The job's claim while a runner holds it (see the module docstring).

    Without a claim (a transport that offers none) every method is a pass-through: completed
    checkpoints are ready at once.
    """

    def __init__(
        self,
        job: str,
        claim: JobClaim | None,
        *,
        store_url: str = "",
        say: Callable[[str], None] = lambda _text: None,
        interval_s: float = 0.0,
    ) -> None:
        self.job = job
        self.claim = claim
        self._store_url = store_url
        self._interval_ms = int(interval_s * 1000)
        self._say = say
        self._since_ms = int(time.time() * 1000)
        self._lock = threading.Lock()  # one transaction at a time on the claim's producer
        self._wake = threading.Condition()
        self._queued: tuple[int, dict[TP, int]] | None = None
        self._latest: tuple[int, dict[TP, int]] | None = None  # newest completed checkpoint
        self._done: list[int] = []
        self._failure: EosflowError | None = None
        self._closed = False
        self._thread: threading.Thread | None = None
        self._last_warning = 0.0
        #: the highest generation a runner of the job used before this one took it
        self.prior_generation = 0
        self._generation = 0  # the highest known: every claim record carries it
        #: called from the background commit when :meth:`ready` has news (a checkpoint whose
        #: notice is due, or the fencing): the runner's loop waits on its inbox, not on a timer
        #: (a 50 ms poll added 25 ms to every checkpoint's commit on average, bench "Latency")
        self.wake: Callable[[], None] = lambda: None

    # -- at start --------------------------------------------------------------------------------

    @classmethod
    def take(
        cls,
        job: str,
        transport: Any,
        latest: Manifest | None,
        *,
        start_over: bool = False,
        force: bool = False,
        rewind: bool = False,
        store_url: str = "",
        say: Callable[[str], None] = lambda _text: None,
        interval_s: float = 0.0,
    ) -> JobIdentity:
        """Checks the job's history against its state, then takes the job (fencing every
        earlier runner of it). ``rewind``: the start restores a savepoint on purpose, so a
        group ahead of it is expected. ``start_over`` is refused while another runner holds
        the job (it checkpointed lately: :func:`holder_text`) unless ``force``.

        Raises:
            JobHistoryError: the group holds offsets that the state does not account for, or
                ``start_over`` without ``force`` while another runner holds the job.
        """
        make = getattr(transport, "job_claim", None)
        if make is None:
            return cls(job, None, store_url=store_url, say=say)
        claim: JobClaim = make(job)
        identity = cls(job, claim, store_url=store_url, say=say, interval_s=interval_s)
        mine = _positions(latest.metadata.get("sources")) if latest is not None else {}
        try:
            # The claim's topic, producer and connection, meanwhile: they fence nobody. (On an
            # error the pool's exit waits for it first.)
            with ThreadPoolExecutor(1, thread_name_prefix="claim-prepare") as pool:
                prepared = pool.submit(getattr(claim, "prepare", lambda: None))
                if not start_over:  # refused before fencing: the holder of the job goes on
                    identity._check_history(claim.committed(), latest, mine, rewind=rewind)
                elif not force:
                    running = holder_text(job, claim.last(), time.time(), leased=store_url)
                    if running:
                        raise JobHistoryError(
                            f"{running}. --start-over now would fence it mid-run (it "
                            "stops at its next checkpoint) and read the sources again from "
                            "this start's state. To move it here, run with --takeover instead; "
                            "or stop it first (Ctrl-C or SIGTERM where it runs, or 'eosflow "
                            f"savepoint {job} --stop' on its snapshot store), or add --force"
                        )
                prepared.result()
        except BaseException:
            claim.close()
            raise
        claim.open()
        try:
            with ThreadPoolExecutor(1, thread_name_prefix="claim-last") as pool:
                last = pool.submit(claim.last)  # independent of the group: read alongside
                history = claim.committed()
                if not start_over:  # one that committed meanwhile is fenced now: it shows
                    identity._check_history(history, latest, mine, rewind=rewind, fenced=True)
                previous = last.result()
            identity.prior_generation = identity._generation = _generation_of(previous)
            if start_over and history:
                claim.forget()
                say(
                    f"--start-over: deleted the offsets of consumer group {claim.group!r} "
                    f"({describe_offsets(history)}); they are committed anew from this run's "
                    "checkpoints"
                )
            if latest is not None and mine:  # the group shows the state this run restores
                identity._latest = (latest.checkpoint_id, mine)
                try:
                    identity._commit(latest.checkpoint_id, mine)
                except JobFencedError:
                    raise
                except EosflowError as exc:  # the broker in trouble: the first checkpoint's
                    # commit (retried until it succeeds, before any sink commits) catches up
                    log.warning("job=%s: committing the restored offsets failed: %s", job, exc)
        except BaseException:
            claim.close()
            raise
        log.info(
            "job=%s took transactional_id=%s group=%s", job, claim.transactional_id, claim.group
        )
        return identity

    def _check_history(
        self,
        history: Mapping[TP, int],
        latest: Manifest | None,
        mine: Mapping[TP, int],
        *,
        rewind: bool,
        fenced: bool = False,
    ) -> None:
        assert self.claim is not None
        group = self.claim.group
        ahead = {tp: o for tp, o in history.items() if tp in mine and o > mine[tp]}
        refused = (latest is None and history) or (latest is not None and not rewind and ahead)
        if refused and not fenced:  # the claim's newest record says who holds the job
            running = holder_text(self.job, self.claim.last(), time.time(), leased=self._store_url)
            if running:
                self._refuse_running(running, history if latest is None else ahead, latest)
        ways = (
            f"Ways on: (1) run with the job's state: the state directory it ran with "
            f"(EOSFLOW_STATE_DIR) or its snapshot store (--snapshot-url), or --from-savepoint "
            f"PATH; (2) 'eosflow reset {self.job}' deletes its checkpoints, internal topics "
            f"and consumer group, and the next run starts afresh; (3) 'eosflow run ... "
            f"--start-over' starts from the state it has anyway (the output since is "
            f"committed again: duplicates downstream) and replaces the group's offsets"
        )
        also = (
            " (this start had fenced the job's transactional id already: a runner holding "
            "the job committed while this one started, and stops now)"
            if fenced
            else ""
        )
        if latest is None and history:
            raise JobHistoryError(
                f"job {self.job!r} has history in Kafka but no checkpoint in "
                f"{self._store_url or 'its snapshot store'}: its consumer group {group!r} holds "
                f"the source offsets of a run that committed output ({describe_offsets(history)}"
                f"), and starting without that run's state would read the sources again and "
                f"commit their output again{also}. {ways}"
            )
        if latest is None or rewind:
            return
        if ahead:
            behind = {tp: mine[tp] for tp in ahead}
            raise JobHistoryError(
                f"job {self.job!r}: its consumer group {group!r} shows the job read further "
                f"({describe_offsets(ahead)}) than checkpoint {latest.checkpoint_id} in "
                f"{self._store_url or 'its snapshot store'} ({describe_offsets(behind)}): "
                "another run of the job went on from newer state (a stale copy of the state "
                "directory, another snapshot store), and restoring this one would commit that "
                f"output again. {ways}"
            )

    def _refuse_running(
        self, running: str, ahead: Mapping[TP, int], latest: Manifest | None
    ) -> None:
        """A start refused while another runner holds the job (issue 48: the refusal offered
        ``--start-over``, which fenced the running job mid-run): said as it is, with the ways
        that do not break the running job."""
        state = (
            f"checkpoint {latest.checkpoint_id} in {self._store_url or 'its snapshot store'}"
            if latest is not None
            else f"no checkpoint in {self._store_url or 'its snapshot store'}"
        )
        group = self.claim.group if self.claim is not None else ""
        raise JobHistoryError(
            f"{running}; this start has {state}, behind it ({describe_offsets(ahead)} in "
            f"consumer group {group!r}), so it was refused and the running job was left "
            "alone. Ways on: (1) leave it running; (2) move it here: run this one with "
            "--takeover (the running one stops at a savepoint, this one starts from it; its "
            "snapshot store must be reachable from here), or by hand: 'eosflow savepoint "
            f"{self.job} --stop --path URL' where both runners reach URL, then run this one "
            "with --from-savepoint URL; (3) give this runner the same snapshot store "
            "(--snapshot-url) and stop the other first. 'eosflow run "
            "--start-over' would fence the running job and commit its output again: it is "
            "refused while the job runs unless --force"
        )

    # -- checkpoints -----------------------------------------------------------------------------

    def completed(self, checkpoint_id: int, sources: Any) -> None:
        """Checkpoint ``checkpoint_id`` completed with these source positions
        (``[[topic, partition, offset]]``): committed to the group in the background; its
        completion notice is due once :meth:`ready` returns it."""
        positions = _positions(sources)
        with self._wake:
            self._latest = (checkpoint_id, positions)
            if self.claim is None:
                self._done.append(checkpoint_id)
                return
            self._queued = (checkpoint_id, positions)  # a newer one covers an older one
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="job-identity", daemon=True)
                self._thread.start()
            self._wake.notify()

    def ready(self) -> list[int]:
        """The completed checkpoints whose offsets are committed: send their completion
        notices now.

        Raises:
            JobFencedError: another runner took the job (this one must stop).
        """
        with self._wake:
            if self._failure is not None:
                raise self._failure
            done, self._done = self._done, []
        return done

    def verify(self, cause: str = "") -> None:
        """Before a restart: commit the newest completed checkpoint's offsets now (or the claim
        alone), which fails if another runner took the job.

        Raises:
            JobFencedError: another runner took the job; ``cause`` (the worker failure that
                led here, often the fencing of its sinks' transactional ids) is named.
        """
        if self.claim is None:
            return
        latest = self._latest_unless_fenced(drop_queued=True)
        chk, positions = latest if latest is not None else (0, {})
        try:
            self._commit(chk, positions)
        except JobFencedError as exc:
            if cause:
                raise JobFencedError(f"{exc}; the workers failed meanwhile: {cause}") from None
            raise
        except EosflowError as exc:  # the broker in trouble: the restart goes on, and retries
            log.warning("job=%s: committing the claim before a restart failed: %s", self.job, exc)
            return
        if latest is not None:
            with self._wake:
                self._done.append(chk)

    def _latest_unless_fenced(
        self, *, drop_queued: bool = False
    ) -> tuple[int, dict[TP, int]] | None:
        """The newest completed checkpoint and its positions; raises the background commit's
        fencing if there was one. ``drop_queued``: the caller commits now, in its place."""
        with self._wake:
            if self._failure is not None:
                raise self._failure
            if drop_queued:
                self._queued = None
            return self._latest

    def announce(self, generation: int) -> None:
        """Before generation ``generation``'s workers start (or a worker restarted alone with
        that incarnation): record it in the claim, synchronously, so that a later runner of the
        job starts above it.

        Raises:
            JobFencedError: another runner took the job: no worker may start.
        """
        self._generation = max(self._generation, generation)
        if self.claim is None:
            return
        latest = self._latest_unless_fenced()
        try:
            self._commit(latest[0] if latest is not None else 0, {})
        except JobFencedError:
            raise
        except EosflowError as exc:  # the broker in trouble: its channels are as unreachable
            log.warning(
                "job=%s: recording generation %d in the claim failed: %s", self.job, generation, exc
            )

    def close(self) -> None:
        """The runner stops: its last claim record says so (:func:`holder_text` then takes
        the job for not running: a runner that finished a moment ago is not "running now"),
        unless it was fenced; waited for at most 5 s."""
        with self._wake:
            self._closed = True
            self._wake.notify()
            fenced = self._failure is not None
            latest = self._latest
        if self._thread is not None:
            self._thread.join(35.0)
        if self.claim is None:
            return
        if not fenced:
            chk = latest[0] if latest is not None else 0
            final = threading.Thread(
                target=self._stopped, args=(chk,), name="job-identity-stop", daemon=True
            )
            final.start()
            final.join(5.0)
        # Every claim call has a deadline, but a client library call that overstays it must
        # not hold the runner's exit: the claim is dropped with the process then.
        if not self._lock.acquire(timeout=5.0):
            log.warning("job=%s: a claim commit is still running at close; not waiting", self.job)
            return
        try:
            self.claim.close()
        finally:
            self._lock.release()

    # -- the commit ------------------------------------------------------------------------------

    def _stopped(self, checkpoint_id: int) -> None:
        try:
            self._commit(checkpoint_id, {}, stopped=True)
        except EosflowError as exc:  # fenced meanwhile, or the broker in trouble: said once
            log.info("job=%s: the claim's last record (stopped) not written: %s", self.job, exc)

    def _commit(
        self, checkpoint_id: int, positions: Mapping[TP, int], *, stopped: bool = False
    ) -> None:
        assert self.claim is not None
        record = {
            "job": self.job,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "since_ms": self._since_ms,
            "at_ms": int(time.time() * 1000),
            "checkpoint": checkpoint_id,
            "generation": self._generation,
            "store": self._store_url,
            "interval_ms": self._interval_ms,
            "stopped": stopped,
        }
        with self._lock:
            try:
                try:
                    self.claim.commit(positions, record)
                except KafkaClientError as exc:
                    if not exc.fatal:
                        raise
                    self._reopen(exc)
                    self.claim.commit(positions, record)
            except JobFencedError as exc:
                raise JobFencedError(self._fenced_message(str(exc))) from None

    def _reopen(self, cause: KafkaClientError) -> None:
        """The claim's producer failed fatally (librdkafka: the client is unusable; before
        issue 48 every later commit failed and the sinks waited for ever, a message every
        10 s): a new one initializes the job's transactional id again.

        That would fence a runner that took the job meanwhile, so the claim's newest record
        must still be this runner's: a runner that takes the job records itself (its
        generation) before any of its workers starts, and one whose record this
        initialization aborted stops before starting any. Otherwise this runner stops, fenced
        (and the other one, fenced by the initialization, at its next checkpoint: both stop,
        neither commits, a restart goes on exactly once).

        Raises:
            JobFencedError: the claim's newest record is another runner's.
            KafkaClientError: the new producer could not be initialized (retried by the caller).
        """
        assert self.claim is not None
        self._say(f"the job's claim producer failed fatally ({cause}); opening a new one")
        log.warning("job=%s: claim producer fatal error, reopening: %s", self.job, cause)
        self.claim.close()
        try:
            self.claim.open()
        except KafkaClientError as exc:  # the broker in trouble: the next commit tries again
            self.claim.close()
            raise KafkaClientError(
                f"reopening the job's claim failed: {exc}", code=exc.code, fatal=True
            ) from exc
        newest = self.claim.last()
        mine = newest is not None and (
            newest.get("host") == socket.gethostname()
            and newest.get("pid") == os.getpid()
            and newest.get("since_ms") == self._since_ms
        )
        if not mine:
            who = holder_text(self.job, newest, time.time()) or f"its newest record: {newest}"
            raise JobFencedError(f"a newer runner recorded itself in the claim ({who})")

    def _fenced_message(self, detail: str) -> str:
        assert self.claim is not None
        return (
            f"another runner took job {self.job!r} (fenced: {detail}). Another 'eosflow run' "
            "of this job (on another host, or with another state directory or snapshot store) "
            f"started after this one and took its transactional id "
            f"{self.claim.transactional_id!r}; two runners would write the same channels and "
            "transactions, so this runner stopped its workers and commits nothing more. The "
            "other runner goes on with the job; stop it first if this one should run it"
        )

    def _run(self) -> None:
        while True:
            with self._wake:
                while self._queued is None and not self._closed:
                    self._wake.wait()
                if self._queued is None:
                    return
                chk, positions = self._queued
                self._queued = None
            try:
                self._commit(chk, positions)
            except JobFencedError as exc:
                with self._wake:
                    self._failure = exc
                self.wake()
                return
            except EosflowError as exc:  # broker trouble: retried, with the newest offsets
                now = time.monotonic()
                if now - self._last_warning > 10.0:
                    self._last_warning = now
                    self._say(
                        f"committing checkpoint {chk}'s source offsets to consumer group "
                        f"{self.claim.group if self.claim else ''!r} failed ({exc}); retrying: "
                        "the sinks commit once it succeeds"
                    )
                time.sleep(_RETRY_S)
                with self._wake:
                    if self._queued is None and not self._closed:
                        self._queued = (chk, positions)
                continue
            with self._wake:
                self._done.append(chk)
            self.wake()
