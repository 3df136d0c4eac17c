"""Kafka errors are classified in one place, from librdkafka's own flags."""

from __future__ import annotations

import pytest
from confluent_kafka import KafkaError, KafkaException

from connectors.errors import ErrorClass, classify, error_class, raise_for
from processor.errors import KafkaClientError


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ({"fatal": True, "retriable": True}, ErrorClass.FATAL),
        ({"txn_requires_abort": True, "retriable": True}, ErrorClass.ABORT),
        ({"retriable": True}, ErrorClass.RETRIABLE),
        ({}, ErrorClass.ERROR),
    ],
)
def test_class_follows_librdkafka_flags_when_several_are_set(
    flags: dict[str, bool], expected: ErrorClass
) -> None:
    error = KafkaError(KafkaError._TIMED_OUT, "boom", **flags)
    assert error_class(error) is expected
    assert error_class(KafkaException(error)) is expected


def test_classified_error_names_the_context_and_code_when_raised() -> None:
    error = KafkaError(KafkaError._TIMED_OUT, "took too long", retriable=True)
    result = classify(error, context="committing epoch 7")
    assert isinstance(result, KafkaClientError)
    assert result.retriable and not result.fatal and not result.txn_requires_abort
    assert "committing epoch 7" in str(result) and "_TIMED_OUT" in str(result)
    with pytest.raises(KafkaClientError, match="committing epoch 7"):
        raise_for(KafkaException(error), context="committing epoch 7")


def test_raise_for_does_nothing_when_there_is_no_error() -> None:
    raise_for(None, context="nothing")
