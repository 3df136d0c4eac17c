"""A real S3 API on loopback for tests: moto's S3 server, reached over HTTP by s3fs.

The snapshot store talks to it exactly as it talks to AWS S3 in production (s3fs, aiobotocore,
signed HTTP requests); nothing in eosflow is replaced. Two things are added in front of moto's
WSGI application, each for a stated reason:

* **One request at a time.** moto checks a conditional PUT's ``If-None-Match`` / ``If-Match``
  and stores the object in two steps without a lock, so two requests in moto's threads can both
  pass the check. AWS S3 applies the check and the write atomically ("if multiple conditional
  writes occur for the same object name, the first write operation to finish succeeds"), and so
  does this server: requests are handled one after the other once they have arrived.
* **Write latency**, optional: each write (PUT, POST, DELETE) waits a random 0 to
  ``write_latency`` seconds before it is handled, as uploads to a real bucket sometimes do. A
  check-then-write lease loses its race exactly when one runner's write is slow (the race test
  in ``test_lease_s3.py``).
* **ignore_conditions**, optional: drops ``If-None-Match`` and ``If-Match``, as an S3-compatible
  store without conditional writes does; eosflow must notice and refuse to lease on it.

Without moto, s3fs or boto3 the tests skip, except under ``CI`` (which installs the dev extra),
where they fail.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

ACCESS = {"key": "testing", "secret": "testing"}


def require_s3_test_kit() -> None:
    """Skips (fails under ``CI``) when moto's server, s3fs or boto3 is not installed."""
    missing = []
    for module in ("moto.server", "s3fs", "boto3", "werkzeug"):
        try:
            __import__(module)
        except ImportError:
            missing.append(module.split(".")[0])
    if missing:
        reason = (
            f"the S3 lease tests need {', '.join(missing)}: pip install -e '.[dev]' "
            "(moto[server], s3fs and boto3 are in the dev extra)"
        )
        # CI installs the dev extra: a missing package there is a broken CI, not a skip.
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)


@dataclass
class S3Server:
    """A running moto S3 server on ``127.0.0.1:port`` (see the module docstring)."""

    endpoint: str
    write_latency: float = 0.0
    ignore_conditions: bool = False
    seed: int = 0
    _random: random.Random = field(default_factory=random.Random)
    _random_lock: threading.Lock = field(default_factory=threading.Lock)

    def storage_options(self) -> dict[str, Any]:
        """What a :class:`~processor.snapshot.store.SnapshotStore` needs to reach this server.

        ``skip_instance_cache``: every store gets its own S3 client, as separate runners do."""
        return {
            **ACCESS,
            "client_kwargs": {"endpoint_url": self.endpoint, "region_name": "us-east-1"},
            "skip_instance_cache": True,
        }

    def environ(self) -> dict[str, str]:
        """The variables that point s3fs (botocore) at this server, for a process that gets
        no storage options (``eosflow run --snapshot-url s3://...`` and its workers)."""
        return {
            "AWS_ACCESS_KEY_ID": ACCESS["key"],
            "AWS_SECRET_ACCESS_KEY": ACCESS["secret"],
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def bucket(self) -> str:
        """A new empty bucket's name."""
        import boto3

        name = f"eosflow-{uuid.uuid4().hex[:12]}"
        client = boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id=ACCESS["key"],
            aws_secret_access_key=ACCESS["secret"],
        )
        client.create_bucket(Bucket=name)
        return name

    def _delay(self) -> float:
        with self._random_lock:
            return self._random.uniform(0, self.write_latency)

    def wrap(self, app: Callable[..., Iterable[bytes]]) -> Callable[..., Iterable[bytes]]:
        serial = threading.Lock()

        def handle(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
            if self.write_latency and environ.get("REQUEST_METHOD") in ("PUT", "POST", "DELETE"):
                time.sleep(self._delay())  # in flight: before the server sees the request
            if self.ignore_conditions:
                environ.pop("HTTP_IF_NONE_MATCH", None)
                environ.pop("HTTP_IF_MATCH", None)
            with serial:  # the whole request, body included, as one atomic step
                return list(app(environ, start_response))

        return handle


@contextlib.contextmanager
def running_s3_server(host: str = "127.0.0.1") -> Iterator[S3Server]:
    """A fresh moto S3 server on a random port of ``host`` (loopback, or the router address of
    :class:`processor.testing.hosts.Hosts`), stopped when the block ends."""
    require_s3_test_kit()
    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from werkzeug.serving import make_server

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per request otherwise
    seed = int(os.environ.get("EOSFLOW_TEST_SEED", random.randrange(2**32)))
    print(f"s3_server seed={seed}")
    server = S3Server(endpoint="", seed=seed, _random=random.Random(seed))
    app = DomainDispatcherApplication(create_backend_app)
    http = make_server(
        host,
        0,
        server.wrap(app),
        threaded=True,
        request_handler=MotoRequestHandler,
    )
    server.endpoint = f"http://{host}:{http.server_port}"
    thread = threading.Thread(target=http.serve_forever, name="moto-s3", daemon=True)
    thread.start()
    try:
        yield server
    finally:
        http.shutdown()
        http.server_close()
        thread.join(timeout=10)


@pytest.fixture
def s3_server() -> Iterator[S3Server]:
    """A fresh moto S3 server on a random loopback port, stopped at the end of the test."""
    with running_s3_server() as server:
        yield server
