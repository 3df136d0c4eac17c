"""Kafka client configuration: exactly-once-safe defaults and the refusal of unsafe overrides."""

from __future__ import annotations

from pathlib import Path

import pytest

from connectors.config import (
    KafkaSettings,
    consumer_config,
    create_producer,
    producer_config,
    read_properties,
)
from processor.errors import ConfigError, UnsafeKafkaConfigError

SETTINGS = KafkaSettings("127.0.0.1:1")


def test_producer_defaults_are_idempotent_with_acks_all_when_no_overrides() -> None:
    config = producer_config(SETTINGS)
    assert config["enable.idempotence"] is True
    assert config["acks"] == "all"
    assert config["bootstrap.servers"] == "127.0.0.1:1"
    assert "transactional.id" not in config


def test_consumer_defaults_keep_offsets_out_of_the_group_when_no_overrides() -> None:
    config = consumer_config(SETTINGS, group_id="g")
    assert config["enable.auto.commit"] is False
    assert config["enable.auto.offset.store"] is False
    assert config["isolation.level"] == "read_committed"
    assert config["group.id"] == "g"


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("enable.idempotence", False),
        ("enable.idempotence", "false"),
        ("acks", 1),
        ("acks", "1"),
        ("acks", 0),
        ("max.in.flight.requests.per.connection", 6),
        ("retries", 0),
    ],
)
def test_producer_override_is_refused_when_it_breaks_exactly_once(key: str, value: object) -> None:
    with pytest.raises(UnsafeKafkaConfigError) as info:
        producer_config(SETTINGS, overrides={key: value})
    assert info.value.key == key
    assert key in str(info.value) and "Fix:" in str(info.value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("enable.auto.commit", True),
        ("enable.auto.commit", "true"),
        ("enable.auto.offset.store", True),
        ("isolation.level", "read_uncommitted"),
    ],
)
def test_consumer_override_is_refused_when_it_breaks_exactly_once(key: str, value: object) -> None:
    with pytest.raises(UnsafeKafkaConfigError, match=key.replace(".", r"\.")):
        consumer_config(SETTINGS, group_id="g", overrides={key: value})


def test_read_uncommitted_is_allowed_when_asked_for_explicitly() -> None:
    config = consumer_config(
        SETTINGS,
        group_id="g",
        overrides={"isolation.level": "read_uncommitted"},
        allow_read_uncommitted=True,
    )
    assert config["isolation.level"] == "read_uncommitted"


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"isolation.level": "serializable"}, "isolation.level"),
        ({"auto.offset.reset": "oldest"}, "auto.offset.reset"),
    ],
)
def test_consumer_override_is_refused_when_value_is_invalid(
    overrides: dict[str, str], fragment: str
) -> None:
    with pytest.raises(ConfigError, match=fragment):
        consumer_config(SETTINGS, group_id="g", overrides=overrides)


def test_snake_case_key_is_refused_with_a_dotted_suggestion_when_misspelled() -> None:
    with pytest.raises(ConfigError, match=r"did you mean 'linger\.ms'"):
        producer_config(SETTINGS, overrides={"linger_ms": 5})


@pytest.mark.parametrize("key", ["transactional.id", "bootstrap.servers"])
def test_managed_key_is_refused_when_overridden(key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        producer_config(SETTINGS, overrides={key: "x"})
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        KafkaSettings("127.0.0.1:1", {key: "x"})


def test_settings_are_refused_when_brokers_are_empty() -> None:
    with pytest.raises(ConfigError, match="EOSFLOW_KAFKA_BROKERS"):
        KafkaSettings("")


def test_from_env_says_how_to_fix_when_no_broker_is_configured() -> None:
    with pytest.raises(ConfigError, match="eosflow dev up"):
        KafkaSettings.from_env(environ={})


def test_from_env_merges_the_properties_file_when_eosflow_kafka_config_is_set(
    tmp_path: Path,
) -> None:
    props = tmp_path / "client.properties"
    props.write_text(
        "# comment\nsecurity.protocol = SASL_SSL\n! other comment\nsasl.mechanism:PLAIN\n\n"
    )
    settings = KafkaSettings.from_env(
        environ={"EOSFLOW_KAFKA_BROKERS": "k:9092", "EOSFLOW_KAFKA_CONFIG": str(props)}
    )
    assert settings.brokers == "k:9092"
    assert settings.client_config == {"security.protocol": "SASL_SSL", "sasl.mechanism": "PLAIN"}
    assert producer_config(settings)["security.protocol"] == "SASL_SSL"


def test_properties_file_is_refused_with_line_number_when_a_line_is_malformed(
    tmp_path: Path,
) -> None:
    props = tmp_path / "bad.properties"
    props.write_text("security.protocol=SSL\njust-a-word\n")
    with pytest.raises(ConfigError, match=r"bad\.properties:2"):
        read_properties(props)


def test_properties_file_is_refused_when_missing(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot be read"):
        KafkaSettings.from_env(
            environ={
                "EOSFLOW_KAFKA_BROKERS": "k:9092",
                "EOSFLOW_KAFKA_CONFIG": str(tmp_path / "nope"),
            }
        )


def test_unknown_librdkafka_key_is_a_config_error_when_the_client_is_created() -> None:
    config = producer_config(SETTINGS, overrides={"linger.msec": 5})
    with pytest.raises(ConfigError, match=r"linger\.msec"):
        create_producer(config)
