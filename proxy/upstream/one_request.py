"""One request of the proxy's own to one upstream server, and the words for what went wrong.

The proxy asks the cluster a few things itself: ApiVersions (is a Kafka broker answering there:
health.py) and Metadata (the brokers, the cluster id, topic ids: discovery.py). Each is one
connection, one request and one answer under one deadline, over TLS when `[upstream_tls]` is set.
A failure raises `UpstreamError`, whose text names the address and what happened: asyncio's
TimeoutError has an empty text, and a log line "skipped (127.0.0.1:9092: )" helps nobody.
"""

from __future__ import annotations

import asyncio
import ssl

from protocol.apis import ApiKey
from protocol.frames import frame
from protocol.headers import encode_request_header

from ..tls import describe_upstream_error

#: An answer larger than this is not a Kafka answer to the proxy's small requests: a TLS record or
#: an HTTP reply read as a Kafka size prefix (0x15030300, "HTTP") gives hundreds of megabytes.
MAX_ANSWER_BYTES = 64 * 1024 * 1024

#: Names for the requests the proxy sends itself, as Kafka's documentation spells them.
_NAMES = {ApiKey.API_VERSIONS: "ApiVersions", ApiKey.METADATA: "Metadata"}

#: What an exception raised without a message means, for the types a socket raises that way.
_SILENT_MEANING: dict[type[BaseException], str] = {
    ConnectionResetError: "the connection was reset by the other side",
    ConnectionAbortedError: "the connection was aborted",
    BrokenPipeError: "the other side closed the connection while the request was sent",
    EOFError: "the connection closed before an answer came",
}


class UpstreamError(ConnectionError):
    """A request to an upstream server failed; the text names the address and what happened."""


def describe_error(exc: BaseException, timeout_s: float, waiting_for: str | None = None) -> str:
    """A reason that is never empty and names what happened.

    asyncio raises TimeoutError() and several ConnectionErrors without a message, so `str(exc)`
    alone can be ''. `waiting_for` names what did not come in time ("answer to ApiVersions").
    """
    text = str(exc)
    if isinstance(exc, UpstreamError):
        return text
    if isinstance(exc, TimeoutError) and not text:
        return f"no {waiting_for or 'answer'} within {timeout_s:g} s"
    if isinstance(exc, asyncio.IncompleteReadError):
        return f"the connection closed after {len(exc.partial)} of {exc.expected} expected bytes"
    if text:
        return f"{type(exc).__name__}: {text}"
    for kind, meaning in _SILENT_MEANING.items():
        if isinstance(exc, kind):
            return f"{type(exc).__name__}: {meaning}"
    return f"{type(exc).__name__} (raised without a message)"


async def request_once(host: str, port: int, api_key: ApiKey, version: int, body: bytes, *,
                       tls: ssl.SSLContext | None = None, timeout_s: float = 5.0,
                       client_id: str = "kthrottle") -> bytes:
    """Send one request on a new connection and return the answer's frame (correlation id first).

    Connecting, the TLS handshake (the broker's certificate checked against `host`, as for client
    connections), sending and the answer share one deadline of `timeout_s`.
    """
    name = _NAMES.get(api_key, api_key.name)
    request = frame(encode_request_header(api_key, version, 1, client_id) + body)
    writer: asyncio.StreamWriter | None = None
    try:
        async with asyncio.timeout(timeout_s):
            if tls is not None:
                reader, writer = await asyncio.open_connection(host, port, ssl=tls, server_hostname=host)
            else:
                reader, writer = await asyncio.open_connection(host, port)
            writer.write(request)
            size = int.from_bytes(await reader.readexactly(4), "big", signed=True)
            if not 4 <= size <= MAX_ANSWER_BYTES:
                hint = " (is that a TLS listener?)" if tls is None else ""
                raise UpstreamError(f"{host}:{port}: the answer to {name} is not Kafka: a frame of "
                                    f"{size} bytes{hint}")
            answer = await reader.readexactly(size)
    except TimeoutError as exc:
        step = (f"answer to {name}" if writer is not None
                else "TLS connection" if tls is not None else "connection")
        raise UpstreamError(f"{host}:{port}: {describe_error(exc, timeout_s, step)}") from exc
    except asyncio.IncompleteReadError as exc:
        raise UpstreamError(f"{host}:{port}: the connection closed before {name} was answered "
                            f"({len(exc.partial)} of {exc.expected} bytes came)") from exc
    except OSError as exc:
        if isinstance(exc, UpstreamError):
            raise
        reason = (describe_upstream_error(exc) if tls is not None else None) or describe_error(exc, timeout_s)
        raise UpstreamError(f"{host}:{port}: {reason}") from exc
    finally:
        if writer is not None:
            writer.close()
    if int.from_bytes(answer[:4], "big", signed=True) != 1:
        raise UpstreamError(f"{host}:{port}: the answer to {name} has another correlation id "
                            "than the request")
    return answer
