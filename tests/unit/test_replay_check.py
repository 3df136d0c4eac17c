"""Local recovery's replay check (processor.runtime.operators.replay): an ID is forgotten only
when no copy of it can come, never by event time (issue 49).

The channel histories below are what a downstream task reads on one channel partition, whose one
writer is an upstream subtask's worker, started again as a new incarnation after each failure."""

from __future__ import annotations

import random

import pytest

from processor.runtime.operators.replay import ReplayBoundExceeded, ReplayCheck
from processor.snapshot.codec import dumps, loads

A = ("chan", 0)
B = ("chan", 1)


def _new(check: ReplayCheck, tp: tuple[str, int], inc: int, ids: list[int]) -> list[int]:
    """The IDs of ``ids`` that the check lets through."""
    return [i for i, ok in zip(ids, check.check(tp, inc, ids), strict=True) if ok]


def test_a_dead_incarnations_copy_is_dropped_after_a_later_checkpoint_completed() -> None:
    """The case an epoch-only rule gets wrong: incarnation 1 emits records 1-3 after barrier 4
    (checkpoint 4 completed), then dies before barrier 5. Incarnation 2 restores 4, starts after
    checkpoint 5 was triggered (5 is stale for it), emits barrier 6 while still re-emitting,
    and checkpoint 6 completes. Its copies of 1-3 come after barrier 6: they must be dropped."""
    check = ReplayCheck("s")
    assert _new(check, A, 1, [10, 11]) == [10, 11]
    check.barrier(A, 1, 4)
    check.commit(4)
    assert _new(check, A, 1, [1, 2, 3]) == [1, 2, 3]
    check.barrier(A, 1, 5)  # written, then the worker died; checkpoint 5 is aborted
    check.incarnation(A, 2)  # GenerationStart of the restarted worker
    assert _new(check, A, 2, [1]) == []  # a copy
    check.barrier(A, 2, 6)
    check.commit(6)  # completes while incarnation 2 is still catching up
    assert _new(check, A, 2, [2, 3, 4]) == [4]
    assert check.duplicates == 3


def test_ids_go_when_a_completed_checkpoint_includes_the_writer_past_them() -> None:
    check = ReplayCheck("s")
    _new(check, A, 1, [1, 2])
    check.barrier(A, 1, 1)
    _new(check, A, 1, [3])
    check.commit(1)
    assert check.held_ids() == {"open": 1, "covered": 0, "pinned": 0}
    assert check.size == 1
    # A channel whose barrier 2 was not read yet keeps what it read (unaligned: the task acks
    # at its first barrier).
    _new(check, B, 1, [7])
    check.barrier(A, 1, 2)
    check.commit(2)
    assert check.held_ids() == {"open": 1, "covered": 0, "pinned": 0}  # B's 7
    assert _new(check, B, 1, [7]) == []


def test_a_barrier_of_the_writer_that_later_died_does_not_release_its_ids() -> None:
    """Incarnation 1 wrote barrier 5 and died before checkpoint 5 completed (aborted). A later
    completion (7, by its successor) must not release what incarnation 1 wrote before 5."""
    check = ReplayCheck("s")
    _new(check, A, 1, [1, 2])
    check.barrier(A, 1, 5)
    check.commit(7)  # the task has not read the successor's GenerationStart yet (lagging)
    assert check.size == 2  # it read barrier 5, not 7, from incarnation 1: kept
    check.incarnation(A, 2)
    assert check.held_ids()["pinned"] == 2
    assert _new(check, A, 2, [2, 1, 3]) == [3]


def test_a_record_of_a_new_incarnation_without_its_marker_pins_the_old_ones_ids() -> None:
    check = ReplayCheck("s")
    _new(check, A, 1, [1])
    assert _new(check, A, 2, [5]) == [5]
    assert check.held_ids() == {"open": 1, "covered": 0, "pinned": 1}
    assert _new(check, A, 2, [1]) == []


def test_the_snapshot_keeps_pinned_ids_and_channels_the_checkpoint_does_not_release() -> None:
    check = ReplayCheck("s")
    _new(check, A, 1, [1, 2])
    check.incarnation(A, 2)  # 1, 2 pinned
    assert _new(check, A, 2, [1]) == []  # 2 still pinned
    _new(check, B, 3, [20])  # B's barrier 4 not read: in flight for checkpoint 4
    check.barrier(A, 2, 4)
    check.prepare(4)
    state = loads(dumps(check.snapshot()))
    restored = ReplayCheck("s")
    restored.restore(state)
    assert restored.held_ids() == {"open": 1, "covered": 0, "pinned": 1}
    assert _new(restored, A, 2, [2]) == []  # the dead incarnation's copy
    assert _new(restored, B, 3, [20]) == []
    assert _new(restored, A, 2, [1]) == [1]  # released by checkpoint 4: read again after it


def test_an_aligned_snapshot_holds_nothing_but_the_pinned_ids() -> None:
    check = ReplayCheck("s")
    for n in range(3):
        _new(check, A, 1, list(range(n * 100, n * 100 + 100)))
        _new(check, B, 1, list(range(10_000 + n * 100, 10_000 + n * 100 + 100)))
        check.barrier(A, 1, n + 1)
        check.barrier(B, 1, n + 1)
    check.prepare(3)
    assert check.snapshot()["channels"] == []


def test_the_bound_fails_the_task_naming_the_option_and_the_fix() -> None:
    check = ReplayCheck("s", max_ids=1000, task="s.0")
    _new(check, A, 1, list(range(1000)))
    with pytest.raises(ReplayBoundExceeded) as err:
        check.check(A, 1, [5000])
    text = str(err.value)
    assert "task s.0" in text and "--recovery-max-ids 1,000" in text
    assert "global" in text and "nothing passes unchecked" in text


def test_a_savepoint_keeps_a_dead_incarnations_ids_and_drops_the_channels() -> None:
    """A savepoint restored while a restarted upstream worker was still re-emitting: the new
    channels start empty, so the per-channel IDs go, the pinned ones stay (their copies still
    come from the restored successor)."""
    from processor.runtime.shape.savepoint_state import rebase

    check = ReplayCheck("s")
    _new(check, A, 1, [1, 2])
    check.incarnation(A, 2)  # 1, 2 pinned
    _new(check, B, 1, [7])  # B's barrier not read: kept per channel
    check.prepare(3)
    ops = {"~replay-s": loads(dumps(check.snapshot())), "~replay-t": {"version": 1}}
    from processor.wire import job_topic_prefix

    tp = (job_topic_prefix("j") + "edge", 0)
    states = {"s.0": {"positions": {tp: 5}, "barrier_seen": [tp], "operators": ops}}
    rebase("j", "sp", {"checkpoint_id": 3}, states, None, committed=False)
    assert "~replay-t" not in ops  # an older release's check
    restored = ReplayCheck("s")
    restored.restore(ops["~replay-s"])
    assert restored.held_ids() == {"open": 0, "covered": 0, "pinned": 2}


def test_an_older_releases_state_is_not_read_as_ids() -> None:
    check = ReplayCheck("s")
    check.restore({"version": 1, "lineage": {}, "filters": {}})
    assert check.size == 0


class _Upstream:
    """One upstream subtask's worker writing one channel: records ``base + 0, 1, 2, ...``,
    barriers, and a GenerationStart per incarnation."""

    def __init__(self, tp: tuple[str, int], base: int) -> None:
        self.tp, self.base = tp, base
        self.inc, self.pos, self.emitted = 1, 0, 0
        self.channel: list[tuple[str, int, int]] = [("start", 1, 0)]
        self.at: dict[int, int] = {0: 0}  # checkpoint -> position in its snapshot
        self.stale = 0  # checkpoints triggered before this incarnation started

    def emit(self, n: int) -> None:
        for _ in range(n):
            self.channel.append(("rec", self.inc, self.base + self.pos))
            self.pos += 1
        self.emitted = max(self.emitted, self.pos)

    def barrier(self, chk: int) -> None:
        if chk > self.stale:
            self.channel.append(("bar", self.inc, chk))
            self.at[chk] = self.pos

    def restart(self, latest: int, triggered: int) -> None:
        self.inc += 1
        self.stale = triggered
        self.pos = self.at[latest]
        self.channel.append(("start", self.inc, 0))


@pytest.mark.parametrize("aligned", [True, False])
def test_no_copy_passes_and_none_is_lost_in_random_histories(aligned: bool) -> None:
    """A model of local recovery: two upstream workers write one channel each to a downstream
    task that reads them at its own pace (it lags: a checkpoint may complete, and an upstream
    die and restart, before it reads their barriers and markers). Checkpoints are triggered,
    written by the live incarnations, acknowledged by the downstream task when it read the
    barrier on every channel (aligned) or on one (unaligned), and complete when every part
    did; a death aborts the pending ones, and the restarted upstream restores the latest
    completed checkpoint and re-emits from there. Every record must pass exactly once."""
    rng = random.Random(49 + aligned)
    for _ in range(300):
        check = ReplayCheck("s")
        ups = [_Upstream(A, 0), _Upstream(B, 1_000_000)]
        read = [0, 0]
        passed: list[int] = []
        triggered = 0
        completed = 0
        pending: dict[int, set[int]] = {}  # checkpoint -> upstreams that wrote its barrier
        acked: dict[int, set[int]] = {}  # checkpoint -> channels whose barrier the task read
        for _step in range(rng.randint(10, 120)):
            roll = rng.random()
            if roll < 0.35:
                rng.choice(ups).emit(rng.randint(1, 4))
            elif roll < 0.45:
                triggered += 1
                pending[triggered] = set()
                for u, up in enumerate(ups):
                    if triggered > up.stale:
                        up.barrier(triggered)
                        pending[triggered].add(u)
            elif roll < 0.5:  # a death: pending checkpoints abort, it restarts from the latest
                u = rng.randrange(2)
                pending.clear()
                ups[u].restart(completed, triggered)
            else:  # the downstream task reads a few events of one channel
                c = rng.randrange(2)
                for _ in range(rng.randint(1, 6)):
                    if read[c] == len(ups[c].channel):
                        break
                    kind, inc, value = ups[c].channel[read[c]]
                    read[c] += 1
                    tp = ups[c].tp
                    if kind == "rec":
                        passed += _new(check, tp, inc, [value])
                    elif kind == "start":
                        check.incarnation(tp, inc)
                    else:
                        check.barrier(tp, inc, value)
                        acked.setdefault(value, set()).add(c)
            for chk in sorted(pending):  # completions, in order
                need = {0, 1} if aligned else None
                got = acked.get(chk, set())
                done = pending[chk] == {0, 1} and (got == need if aligned else bool(got))
                if done:
                    completed = chk
                    check.commit(chk)
                    pending = {k: v for k, v in pending.items() if k > chk}
        for c in range(2):  # drain
            for kind, inc, value in ups[c].channel[read[c] :]:
                if kind == "rec":
                    passed += _new(check, ups[c].tp, inc, [value])
                elif kind == "start":
                    check.incarnation(ups[c].tp, inc)
                else:
                    check.barrier(ups[c].tp, inc, value)
        want = [*range(ups[0].emitted), *range(1_000_000, 1_000_000 + ups[1].emitted)]
        assert sorted(passed) == want


def test_the_removed_horizon_option_says_what_replaced_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from processor.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["run", "pipeline.py", "--recovery", "local", "--recovery-horizon", "10m"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--recovery-horizon was removed" in err and "--recovery-max-ids" in err
