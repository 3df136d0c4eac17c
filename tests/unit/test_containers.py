"""processor.testing.containers' choices that need no Docker engine: images and network."""

from __future__ import annotations

import pytest

from processor.errors import ConfigError
from processor.testing.containers import (
    KAFKA_IMAGE,
    POSTGRES_IMAGE,
    REDIS_IMAGE,
    container_image,
    docker_network,
)


def test_images_are_the_official_ones_when_no_variable_names_others() -> None:
    assert [container_image(s, {}) for s in ("kafka", "redis", "postgres")] == [
        KAFKA_IMAGE,
        REDIS_IMAGE,
        POSTGRES_IMAGE,
    ]
    assert KAFKA_IMAGE.startswith("apache/kafka:")


def test_the_variable_names_the_image_when_set() -> None:
    env = {"EOSFLOW_KAFKA_IMAGE": "eosflow/kafka:4.3.1", "EOSFLOW_REDIS_IMAGE": ""}
    assert container_image("kafka", env) == "eosflow/kafka:4.3.1"
    assert container_image("redis", env) == REDIS_IMAGE  # empty: not set


@pytest.mark.parametrize("network", ["host", "bridge"])
def test_the_network_is_the_variables_when_set(network: str) -> None:
    assert docker_network({"EOSFLOW_DOCKER_NETWORK": network}) == network


def test_an_unknown_network_is_refused_when_named() -> None:
    with pytest.raises(ConfigError, match="EOSFLOW_DOCKER_NETWORK='overlay': choose one of"):
        docker_network({"EOSFLOW_DOCKER_NETWORK": "overlay"})
