"""Broker outages logged once per period, not once per librdkafka retry.

With the broker unreachable, every client retries its connection every few hundred milliseconds
and librdkafka logs each attempt (``FAIL``, ``REQTMOUT``) and reports it to ``error_cb``: a
worker with five clients printed about ten lines a second, which buried the one line that said
what was wrong. Every client built by :mod:`connectors.config` logs through :data:`OUTAGES`
instead (``logger`` and ``error_cb``, unless the caller set its own): the first connection error
of an outage is logged at once, then one line per period with the count and the last error.
An outage ends after a whole period without a connection error; the next one is logged anew.

Fatal and other non-transient errors are not rate-limited: they are logged as they come.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from confluent_kafka import KafkaError

__all__ = ["OUTAGES", "OutageLog", "report_client_error"]

#: librdkafka log facilities that mean "cannot talk to a broker right now".
_OUTAGE_FACILITIES = frozenset({"FAIL", "REQTMOUT", "ERROR", "BROKERFAIL", "TIMEOUT"})
#: eosflow sets this on purpose on channel producers (connectors.transport): not news.
_EXPECTED_WARNING = "enable.gapless.guarantee is experimental"


class OutageLog:
    """Counts a client's transient connection errors and logs them once per ``period_s``.

    Thread-safe: librdkafka callbacks run on whichever thread polls the client.

    Args:
        logger: where the lines go.
        period_s: at most one summary line per period during an outage.
        clock: monotonic seconds (tests pass a manual clock).
    """

    def __init__(
        self,
        logger: logging.Logger,
        *,
        period_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.period_s = period_s
        self.clock = clock
        self._lock = threading.Lock()
        self._since: float | None = None  # start of the outage being counted
        self._last_at = 0.0
        self._next_at = 0.0
        self._count = 0
        self._last = ""
        self.logged = 0  # lines written (for tests and the curious)

    def outage(self, what: str) -> None:
        """One transient connection error of any client of this process."""
        now = self.clock()
        with self._lock:
            if self._since is None or now - self._last_at > self.period_s:
                self._since, self._count, self._next_at = now, 0, now + self.period_s
                self._last_at = now
                self.logged += 1
                self.logger.warning(
                    "Kafka broker unreachable: %s (retrying; further connection errors are "
                    "summarized every %.0fs)",
                    what, self.period_s,
                )  # fmt: skip
                return
            self._count += 1
            self._last, self._last_at = what, now
            if now < self._next_at:
                return
            count, self._count, self._next_at = self._count, 0, now + self.period_s
            self.logged += 1
            self.logger.warning(
                "Kafka broker still unreachable after %.0fs: %d connection errors in the last "
                "%.0fs (last: %s)",
                now - self._since, count, self.period_s, self._last,
            )  # fmt: skip

    # -- librdkafka's interfaces -------------------------------------------------------------

    def log(self, level: int, fmt: str, *args: Any) -> None:
        """The ``logger`` interface confluent-kafka calls: ``log(level, "%s [%s] %s", facility,
        client name, message)``."""
        facility = str(args[0]) if args else ""
        message = str(args[-1]) if args else fmt
        if level >= logging.WARNING and facility in _OUTAGE_FACILITIES:
            self.outage(message)
        elif _EXPECTED_WARNING in message:
            self.logger.debug(fmt, *args)
        else:
            self.logger.log(level, fmt, *args)

    def error(self, err: KafkaError) -> None:
        """The ``error_cb`` interface: transient errors are counted, others logged."""
        if not err.fatal() and (err.retriable() or err.code() in _TRANSIENT_CODES):
            self.outage(err.str())
        else:
            self.logger.error("Kafka client error: %s (code=%s)", err.str(), err.name())


_TRANSIENT_CODES = frozenset(
    {
        KafkaError._TRANSPORT,
        KafkaError._ALL_BROKERS_DOWN,
        KafkaError._TIMED_OUT,
        KafkaError._RESOLVE,
        KafkaError.REQUEST_TIMED_OUT,
        KafkaError.NETWORK_EXCEPTION,
    }
)

#: The process's one outage log: every client of a worker counts into it.
OUTAGES = OutageLog(logging.getLogger("connectors.kafka"))


def report_client_error(err: KafkaError) -> None:
    """``error_cb`` for clients built by :mod:`connectors.config`."""
    OUTAGES.error(err)
