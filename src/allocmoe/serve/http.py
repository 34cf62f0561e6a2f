"""What stands between a socket and the routes: limits no single client can get around.

- `Guard`, an ASGI middleware: the API key on /v1 routes (401), a body larger than
  `max_request_bytes` refused with 413 before it is read (by Content-Length, or as soon as a chunked
  body passes the cap), and a body that does not arrive within `request_timeout` answered 408.
  The body is read here, whole, and replayed to the app; after it, `receive` is the server's own,
  so a route still hears `http.disconnect` (Starlette's BaseHTTPMiddleware hid it: issue 39).
- `TimedH11Protocol`, uvicorn's h11 protocol plus a deadline on the request *headers* (uvicorn has
  none: a client that sends half a header held its connection forever), a cap on open
  connections (the one over the cap is answered 503 and closed), and the error JSON (not
  uvicorn's text/plain) for a request h11 cannot parse.
- `uvicorn_config`: both, with uvicorn's keep-alive timeout and `limit_concurrency`, in one place
  that `allocmoe serve` and the tests share; and `ShortAccessLog` on uvicorn's access log, so a
  client's 100 KB path is not logged whole.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from dataclasses import dataclass
from typing import Callable

from uvicorn.protocols.http.h11_impl import H11Protocol

from .protocol import error_body

MiB = 1 << 20
log = logging.getLogger("allocmoe.serve")


@dataclass(frozen=True)
class HTTPLimits:
    max_request_bytes: int = 4 * MiB     # a larger body gets 413, unread
    request_timeout: float = 30.0        # seconds for a request's headers, and again for its body
    timeout_keep_alive: float = 5.0      # an idle kept-alive connection closes after this
    max_connections: int = 256           # open connections (and running requests) at most; more get 503
    shutdown_timeout: float = 10.0       # on SIGTERM, running generations get this long, then an error


class _Refused(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


class Guard:
    """ASGI middleware: API key, body size and body time, before the app sees the request."""

    def __init__(self, app, limits: HTTPLimits, api_key: Callable[[], str | None],
                 on_refuse: Callable[[int], None] = lambda status: None):
        self.app, self.limits, self.api_key, self.on_refuse = app, limits, api_key, on_refuse

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        with_body = scope["method"] in ("POST", "PUT", "PATCH")
        try:
            self._check_key(scope)
            if with_body:
                receive = await self._read_body(scope, receive)
        except _Refused as refused:
            self.on_refuse(refused.status)
            # a body left unread must not be taken for the next request: close the connection
            return await _send_error(send, refused.status, refused.message, close=with_body)
        started = False

        async def send_started(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_started)
        except Exception as exc:
            if started:
                raise
            # answered here, logged once, the connection kept: Starlette's own 500 handler re-raises,
            # so uvicorn logged the error a second time and reset the connection
            log.exception("internal error")
            self.on_refuse(500)
            await _send_error(send, 500, f"internal error ({type(exc).__name__}); see the server log", close=False)

    def _check_key(self, scope) -> None:
        key = self.api_key()
        if key and scope["path"].startswith("/v1"):
            scheme, _, given = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
            # the scheme is case-insensitive (RFC 9110: "bearer" is "Bearer"); the key is compared in constant time
            if scheme.lower() != b"bearer" or not secrets.compare_digest(given, key.encode()):
                raise _Refused(401, "missing or wrong API key: send 'Authorization: Bearer KEY'")

    async def _read_body(self, scope, receive):
        cap = self.limits.max_request_bytes
        too_big = _Refused(413, f"the request body is larger than the server's limit of {cap} bytes "
                                "(--max-request-bytes); send a shorter prompt")
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > cap):
            if not length.isdigit():
                raise _Refused(400, "the Content-Length header is not a number; send the body's size in bytes")
            raise too_big
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.limits.request_timeout):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        raise _Refused(499, "the client went away while sending the body")
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > cap:
                        raise too_big
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            raise _Refused(408, f"the request body did not arrive within {self.limits.request_timeout:g} s "
                                "(--request-timeout); send it whole") from None
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()      # after the body: the server's own, which reports a disconnect

        return replay


async def _send_error(send, status: int, message: str, close: bool) -> None:
    body = json.dumps(error_body(status, message)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:               # the unread rest of the body must not be taken for the next request
        headers.append((b"connection", b"close"))
    try:
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
    except OSError:         # the client is gone already (499)
        pass


class TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on request headers and a cap on open connections.

    The deadline runs from the connection's opening (or the first byte after a kept-alive idle
    spell) until the headers are complete; it does not restart on each byte, so a client that
    drips a header a byte at a time is cut off like one that sends nothing."""

    header_timeout: float = 30.0        # set by `uvicorn_config` on a subclass
    max_connections: int | None = None

    def connection_made(self, transport) -> None:       # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        if self.max_connections is not None and len(self.connections) > self.max_connections:
            body = json.dumps(error_body(503, f"the server holds {self.max_connections} connections already "
                                              "(--max-connections); retry later")).encode()
            transport.write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
                            b"retry-after: 1\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s"
                            % (len(body), body))
            transport.close()
            return
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._awaiting_headers():
            if self._header_timer is None:
                self._arm()
        else:
            self._disarm()

    def send_400_response(self, msg: str) -> None:
        """What h11 cannot parse (no Host, two Content-Lengths, a bad chunk size, a TLS hello...): uvicorn
        answered it as text/plain; here it is the OpenAI error JSON every other refusal carries."""
        import h11

        body = json.dumps(error_body(400, "the request is not valid HTTP/1.1 (uvicorn: " + msg.rstrip(".") +
                                     "); check the request line, the Host header and the body's framing")).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        try:
            self.transport.write(self.conn.send(h11.Response(status_code=400, headers=headers, reason=b"Bad Request")))
            self.transport.write(self.conn.send(h11.Data(data=body)))
            self.transport.write(self.conn.send(h11.EndOfMessage()))
        except h11.LocalProtocolError:      # a response was under way already: nothing more can be said
            pass
        self.transport.close()

    def on_response_complete(self) -> None:
        self._disarm()              # idle now: uvicorn's keep-alive timeout takes over
        super().on_response_complete()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _awaiting_headers(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm(self) -> None:
        self._header_timer = self.loop.call_later(self.header_timeout, self._headers_late)

    def _disarm(self) -> None:
        if getattr(self, "_header_timer", None) is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self._awaiting_headers() and not self.transport.is_closing():
            self.transport.close()


class ShortAccessLog(logging.Filter):
    """Shortens what a client chose in an access-log line (its path, above all): a 100 KB request
    line was logged whole, so one request could write a 100 KB line. One request, one short line."""

    MAX_CHARS = 200

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(_shorten(a, self.MAX_CHARS) if isinstance(a, str) else a for a in record.args)
        return True


def _shorten(text: str, most: int) -> str:
    return text if len(text) <= most else f"{text[:most]}...({len(text) - most} more characters)"


def uvicorn_config(app, host: str, port: int, limits: HTTPLimits, log_level: str = "info"):
    """uvicorn's Config for `app` under `limits` (h11, with the header deadline and connection cap)."""
    import uvicorn

    protocol = type("TimedH11", (TimedH11Protocol,), {"header_timeout": limits.request_timeout,
                                                      "max_connections": limits.max_connections})
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, http=protocol,
                            timeout_keep_alive=limits.timeout_keep_alive,
                            limit_concurrency=limits.max_connections + 1,   # uvicorn refuses at >=
                            timeout_graceful_shutdown=limits.shutdown_timeout + 5)
    access = logging.getLogger("uvicorn.access")       # configured by uvicorn.Config, just above
    if not any(isinstance(f, ShortAccessLog) for f in access.filters):
        access.addFilter(ShortAccessLog())
    return config


def run(app, host: str, port: int, limits: HTTPLimits, log_level: str = "info") -> None:
    """Serve `app` until SIGINT/SIGTERM. On the signal uvicorn stops accepting and waits for open
    requests; the app's server refuses new ones and, after `limits.shutdown_timeout`, fails the
    generations still running, so their streams end with an error event and the process exits."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            app.state.server.begin_shutdown()
            super().handle_exit(sig, frame)

    Server(uvicorn_config(app, host, port, limits, log_level)).run()
