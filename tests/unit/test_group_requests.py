"""The job group's admin requests (connectors/claim.py): librdkafka never times them out itself,
and a client that did not answer in time is never used again.

librdkafka 2.16.0 frees a coordinator request's state twice when the request timed out on its
own while the coordinator was down and the coordinator came back with the client alive
(tests/integration/test_group_coordinator_outage.py shows the abort with a broker). Fakes here
stand for the client, to pin the two rules without a broker."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import pytest

import connectors.claim as claim
from connectors import KafkaSettings
from connectors.admin import admin_client, sharing_admin_clients
from processor.errors import KafkaClientError


class _Partitions:
    topic_partitions: list[Any] = []


class _FakeAdmin:
    """Answers each request with a future that completes only if ``answers``."""

    def __init__(self, answers: bool) -> None:
        self.answers = answers
        self.timeouts: list[float] = []

    def alter_consumer_group_offsets(self, groups: list[Any], request_timeout: float) -> Any:
        self.timeouts.append(request_timeout)
        future: Future[Any] = Future()
        if self.answers:
            future.set_result(_Partitions())
        return {groups[0].group_id: future}


SETTINGS = KafkaSettings(brokers="127.0.0.1:1")


def test_a_group_commit_carries_the_longest_timeout_and_drops_a_client_that_did_not_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The claim's kept client does not answer: the commit goes on a new client, which the
    claim keeps; the silent one is asked once, never again."""
    silent, answering = _FakeAdmin(answers=False), _FakeAdmin(answers=True)
    monkeypatch.setattr(claim, "kept_admin_client", lambda _settings: answering)
    job_claim = claim.KafkaJobClaim(SETTINGS, "j", timeout=0.5)
    job_claim._admin = silent  # type: ignore[assignment]

    job_claim._commit_group({("t", 0): 5})
    job_claim._commit_group({("t", 0): 6})

    assert job_claim._admin is answering, "the client that did not answer was kept"
    assert silent.timeouts == [claim._UNTIMED_S], "the silent client was asked again"
    assert answering.timeouts == [claim._UNTIMED_S] * 2


def test_a_group_commit_that_never_gets_an_answer_fails_in_its_deadline_on_new_clients(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made: list[_FakeAdmin] = []

    def new_client(_settings: KafkaSettings) -> _FakeAdmin:
        made.append(_FakeAdmin(answers=False))
        return made[-1]

    monkeypatch.setattr(claim, "admin_client", new_client)
    with pytest.raises(KafkaClientError, match="no answer within") as failed:
        claim.commit_job_group(SETTINGS, "j", {("t", 0): 5}, timeout=0.5)
    assert failed.value.retriable
    assert made and all(c.timeouts == [claim._UNTIMED_S] for c in made), "a client asked twice"


def test_a_shared_client_that_did_not_answer_is_shared_no_longer() -> None:
    with sharing_admin_clients():
        first = admin_client(SETTINGS)
        assert admin_client(SETTINGS) is first
        claim.forget_admin_client(first)
        assert admin_client(SETTINGS) is not first


def test_every_admin_request_to_a_group_coordinator_in_the_product_goes_through_the_guard() -> None:
    """A coordinator request added elsewhere with a librdkafka timeout of its own brings the
    abort back: the product's calls of these admin methods are all in connectors/claim.py,
    each with :data:`connectors.claim._UNTIMED_S`."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    methods = re.compile(
        r"\.(alter_consumer_group_offsets|list_consumer_group_offsets|delete_consumer_groups"
        r"|describe_consumer_groups|delete_consumer_group_offsets)\("
    )
    calls: list[tuple[str, str]] = []
    for package in ("connectors", "processor", "sinks", "dedup"):
        for path in sorted((root / package).rglob("*.py")):
            text = path.read_text()
            for found in methods.finditer(text):  # the call and its arguments' first lines
                calls.append((str(path.relative_to(root)), text[found.start() : found.end() + 160]))
    assert {path for path, _call in calls} == {"connectors/claim.py"}, calls
    assert len(calls) == 3, calls
    assert all("request_timeout=_UNTIMED_S" in call for _path, call in calls), calls
