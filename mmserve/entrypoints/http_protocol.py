"""uvicorn's h11 HTTP protocol with a deadline for request headers.

uvicorn closes idle keep-alive connections, but a connection that sends nothing, or sends
half a request line and then drips or stalls, is held open for ever: enough of them exhaust
file descriptors. This protocol gives every request ``header_timeout`` seconds from its first
byte (or from the connection's start) to complete its headers, then closes the connection.
The body has its own deadline, enforced where the app reads it.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol


class HeaderTimeoutH11Protocol(H11Protocol):
    """Set ``header_timeout`` on a subclass (``with_header_timeout``): uvicorn builds the
    protocol itself and passes no extra arguments."""

    header_timeout: float = 10.0
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        if self._header_timer is None and not self._in_request():
            self._arm_header_timer()  # the first bytes of the next request on this connection
        super().data_received(data)
        if self._in_request():
            self._cancel_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _in_request(self) -> bool:
        """Headers complete, response not yet finished."""
        return self.cycle is not None and not self.cycle.response_complete

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout, self._headers_too_slow)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if not self._in_request() and not self.transport.is_closing():
            self.logger.info("closing a connection whose request headers took over %g s",
                             self.header_timeout)
            self.transport.close()


def with_header_timeout(seconds: float) -> type[HeaderTimeoutH11Protocol]:
    """The protocol class to hand uvicorn (``uvicorn.Config(http=...)``)."""
    return type("HeaderTimeoutH11Protocol", (HeaderTimeoutH11Protocol,),
                {"header_timeout": seconds})
