"""The runner's HTTP server: the job page, ``/api/job`` and ``/metrics`` (docs/observability.md).

One :class:`http.server.ThreadingHTTPServer` in a daemon thread of the runner (the Spark
driver on Spark). It reads only :class:`~processor.runtime.observe.metrics.JobMetrics`' snapshot,
never the runner's state, so a slow or stuck client cannot hold up the job. The page's assets are
package data (``processor/runtime/observe/ui``): no CDN, no build step.

After the run, ``eosflow status --web JOB`` serves the same page from the document the runner
left (:mod:`.archive`): ``page`` instead of ``metrics``, no ``/metrics``.
"""

from __future__ import annotations

import errno
import json
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from processor.errors import ConfigError
from processor.runtime.job import parse_address
from processor.runtime.observe.metrics import JobMetrics

__all__ = ["WebServer"]

log = logging.getLogger(__name__)

#: How often the serving loop looks for a shutdown request (close() waits up to this long).
_POLL_S = 0.05
_ASSETS = {
    "app.js": "text/javascript",
    "panels.js": "text/javascript",
    "style.css": "text/css",
    "index.html": "text/html",
}


class WebServer:
    """Serves ``metrics`` on the first free port of ``address`` (see
    :func:`~processor.runtime.job.parse_address`).

    Attributes:
        url: ``http://HOST:PORT/`` once started.
    """

    def __init__(
        self, metrics: JobMetrics | None, address: str, *, page: dict[str, Any] | None = None
    ) -> None:
        parsed = parse_address(address)
        assert parsed is not None, "the caller checks for 'off'"
        host, ports = parsed
        self.metrics = metrics
        if metrics is not None:
            api: Callable[[], dict[str, Any]] = lambda: metrics.snapshot.api  # noqa: E731
        else:
            assert page is not None, "a page to serve: the runner's metrics or a saved page"
            api = lambda: page  # noqa: E731
        self._server = _bind(host, ports, _handler(api, metrics))
        bound_host, port = str(self._server.server_address[0]), self._server.server_address[1]
        shown = "127.0.0.1" if bound_host in ("0.0.0.0", "") else bound_host
        self.url = f"http://{shown}:{port}/"
        # close() waits for the serving loop to see the shutdown at its next poll: at the
        # default 0.5 s poll that was up to half a second on the exit path of every job.
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": _POLL_S},
            name="eosflow-web",
            daemon=True,
        )
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _bind(
    host: str, ports: list[int], handler: type[BaseHTTPRequestHandler]
) -> ThreadingHTTPServer:
    last: OSError | None = None
    for port in ports:
        try:
            server = ThreadingHTTPServer((host, port), handler)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise ConfigError(f"metrics address {host}:{port}: {exc}") from exc
            last = exc
            continue
        server.daemon_threads = True
        return server
    raise ConfigError(
        f"metrics address {host}:{ports[0]}-{ports[-1]}: every port is in use ({last}); give "
        "another range with --metrics HOST:FIRST-LAST, a single free port, HOST:0 (any free "
        "port; the URL is printed) or --metrics off"
    )


def _handler(
    api: Callable[[], dict[str, Any]], metrics: JobMetrics | None
) -> type[BaseHTTPRequestHandler]:
    ui = resources.files("processor.runtime.observe") / "ui"

    class Handler(BaseHTTPRequestHandler):
        server_version = "eosflow"

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics" and metrics is not None:
                self._send(200, CONTENT_TYPE_LATEST, generate_latest(metrics.registry))
            elif path == "/metrics":
                text = b"no metrics: this page is a finished run's, served from its saved state\n"
                self._send(404, "text/plain", text)
            elif path == "/api/job":
                body = json.dumps(api(), default=str).encode()
                self._send(200, "application/json", body)
            elif path in ("/", "/index.html"):
                self._asset("index.html")
            elif path.startswith("/ui/") and path[4:] in _ASSETS:
                self._asset(path[4:])
            else:
                self._send(404, "text/plain", b"not found: try /, /metrics or /api/job\n")

        def _asset(self, name: str) -> None:
            try:
                body = (ui / name).read_bytes()
            except OSError:
                self._send(404, "text/plain", f"asset {name} is not installed\n".encode())
                return
            self._send(200, _ASSETS[name] + "; charset=utf-8", body)

        def _send(self, code: int, ctype: str, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("web %s " + format, self.address_string(), *args)

    return Handler
