"""The metrics port: /metrics (Prometheus), /healthz (alive), /ready (a broker is reachable) and
/connections (who is connected, connections.py).

Served on the event loop, not on a thread of its own: the quota state it reports is only ever
read by the loop that changes it, so a scrape never sees a half-updated bucket (prometheus-
client's threaded server read the engine's dicts while the loop grew them, and failed). The
slow parts stay off the request path: the quota buckets are read in slices that yield to other
connections, and the text is formatted on a worker thread from that finished snapshot.
Connections to this port are bounded and must send their request within a few seconds.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

log = logging.getLogger("kthrottle.http")

#: Scrape connections open at once; more are closed at once (Prometheus scrapes one at a time).
MAX_HTTP_CONNECTIONS = 16
#: A scrape must send its request line and headers within this time, in at most this many bytes.
HTTP_REQUEST_TIMEOUT_S = 5.0
MAX_HTTP_REQUEST_BYTES = 8192
_STATUS = {200: "200 OK", 400: "400 Bad Request"}


class HttpEndpoint:
    """A small HTTP/1.1 server for the metrics port (one request per connection)."""

    def __init__(self, registry: CollectorRegistry, refresh: Callable[[], Awaitable[None]],
                 ready: Callable[[], tuple[bool, str]],
                 connections: Callable[[str], Awaitable[tuple[int, bytes]]] | None = None) -> None:
        """`connections`: answers /connections from its query string with (status, JSON body)."""
        self.registry = registry
        self._connections = connections
        self._refresh = refresh
        self._ready = ready
        self._open = 0
        self._server: asyncio.AbstractServer | None = None
        self._scrape: asyncio.Future[bytes] | None = None

    async def start(self, host: str | None, port: int) -> None:
        self._server = await asyncio.start_server(self._serve, host, port, limit=MAX_HTTP_REQUEST_BYTES)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def metrics_text(self) -> bytes:
        """One scrape's text. Concurrent scrapes share one snapshot instead of each taking one."""
        if self._scrape is None or self._scrape.done():
            self._scrape = asyncio.ensure_future(self._take_scrape())
        return await asyncio.shield(self._scrape)

    async def _take_scrape(self) -> bytes:
        await self._refresh()
        return await asyncio.get_running_loop().run_in_executor(None, generate_latest, self.registry)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._open >= MAX_HTTP_CONNECTIONS:
            writer.close()
            log.warning("metrics port: refused a connection, %d already open", self._open)
            return
        self._open += 1
        try:
            await self._answer(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
            pass
        except TimeoutError:
            log.info("metrics port: a client sent no complete request within %.0f s", HTTP_REQUEST_TIMEOUT_S)
        except asyncio.CancelledError:
            # The proxy is stopping mid-request. Not raised on: asyncio's streams (Python 3.11.7,
            # StreamReaderProtocol.connection_made) ask a cancelled handler task for its exception,
            # which raises, and log that as an error with a traceback.
            pass
        finally:
            self._open -= 1
            writer.close()

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HTTP_REQUEST_TIMEOUT_S)
        method, _, rest = head.partition(b" ")
        target = rest.partition(b" ")[0].decode("latin-1")
        path, _, query = target.partition("?")
        if method not in (b"GET", b"HEAD"):
            status, body, kind = "405 Method Not Allowed", b"GET only\n", "text/plain"
        elif path == "/metrics" or path == "/":
            status, body, kind = "200 OK", await self.metrics_text(), CONTENT_TYPE_LATEST
        elif path == "/healthz":
            status, body, kind = "200 OK", b"ok\n", "text/plain"
        elif path == "/ready":
            ready, why = self._ready()
            status = "200 OK" if ready else "503 Service Unavailable"
            body, kind = f"{why}\n".encode(), "text/plain"
        elif path == "/connections" and self._connections is not None:
            code, body = await self._connections(query)
            status, kind = _STATUS[code], "application/json" if code == 200 else "text/plain"
        else:
            status, body, kind = ("404 Not Found", b"try /metrics, /healthz, /ready or /connections\n",
                                  "text/plain")
        writer.write(f"HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {len(body)}\r\n"
                     "Connection: close\r\n\r\n".encode())
        if method != b"HEAD":
            writer.write(body)
        await asyncio.wait_for(writer.drain(), HTTP_REQUEST_TIMEOUT_S)
