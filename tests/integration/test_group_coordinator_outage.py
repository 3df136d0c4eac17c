"""The job group's admin requests through outages of its coordinator, with real broker calls.

librdkafka (2.16.0) freed the state of an admin request to a group coordinator twice when the
request timed out while the coordinator's connection was down and the connection came up again
while the client lived, and the process aborted (``rd_kafka_enq_once_del_source_return:
Assertion `eonce->refcnt > 0' failed``): the runner did, retrying its group commit through a
45 s partition (tests/e2e/test_partitions.py, about 4 runs in 10). The requests here are the
claim's group commit on its kept client, the offsets a start reads, and ``eosflow reset``'s
group deletion, each failing through a broker refusing connections and answering once it is
back. They run in a child process, so that an abort is a failed test, not a lost session; on
the code before the fix the first outage aborted it every time (3 runs of 3).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

from processor.testing import create_topic, unique_name

pytestmark = pytest.mark.integration

_CHILD = textwrap.dedent(
    """
    import sys, time
    from connectors import KafkaSettings
    from connectors.claim import KafkaJobClaim, delete_job_group, job_group_offsets
    from processor.errors import KafkaClientError
    from processor.testing import kafka_behind_proxy

    brokers, topic, job = sys.argv[1:4]
    with kafka_behind_proxy(brokers=brokers) as broker:
        settings = KafkaSettings.from_env(brokers=broker.brokers)
        claim = KafkaJobClaim(settings, job, timeout=30.0)  # a fresh broker's first
        claim.open()  # transaction and group take seconds
        claim.commit({(topic, 0): 1}, {"checkpoint": 1})
        for cycle in range(2, 4):
            claim._timeout = 1.0  # the outage's calls fail fast
            broker.proxy.reset()
            for call in (
                lambda: claim.commit({(topic, 0): cycle}, {"checkpoint": cycle}),
                lambda: job_group_offsets(settings, job, timeout=1.0),
                lambda: delete_job_group(settings, job, timeout=1.0),
            ):
                try:
                    call()
                except KafkaClientError:
                    pass  # no broker: the call fails in time; what follows is the test
                else:
                    raise AssertionError("a call succeeded with the broker unreachable")
            broker.proxy.heal()
            time.sleep(1.5)  # the coordinator's connection comes up with the clients alive
            claim._timeout = 30.0  # reconnecting may take a while on a loaded machine
            claim.commit({(topic, 0): cycle}, {"checkpoint": cycle})
            found = job_group_offsets(settings, job, timeout=30.0)
            assert found == {(topic, 0): cycle}, (cycle, found)
            print("cycle", cycle, "ok", flush=True)
        assert delete_job_group(settings, job, timeout=30.0)
        claim.close()
    print("survived", flush=True)
    """
)


def test_group_requests_that_time_out_in_a_coordinator_outage_do_not_crash_the_process(
    kafka_endpoint: tuple[str, str],
) -> None:
    brokers = kafka_endpoint[0]
    topic = unique_name("outage-src")
    create_topic(brokers, topic, 1)
    job = unique_name("outage-job")
    child = subprocess.run(
        [sys.executable, "-c", _CHILD, brokers, topic, job],
        capture_output=True,
        text=True,
        timeout=240,
    )
    said = f"stdout:\n{child.stdout[-2000:]}\nstderr:\n{child.stderr[-3000:]}"
    assert child.returncode != -signal.SIGABRT, f"the process aborted in librdkafka\n{said}"
    assert child.returncode == 0, said
    assert child.stdout.splitlines() == ["cycle 2 ok", "cycle 3 ok", "survived"], said
