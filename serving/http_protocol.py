"""uvicorn's httptools protocol, with one thing added: a request can be refused from the parser's
headers callback, before uvicorn starts a task for it.

Past capacity most /score requests are refused, and for each one uvicorn built a request cycle and
a task, and the refusal went through Starlette's error middleware, the gate's ASGI call, a Starlette
`Request` and a `JSONResponse` sent as two ASGI messages: an event-loop iteration more, and most of
the CPU a refusal costs. No setting of uvicorn or BentoML answers from the protocol (uvicorn's own
`limit_concurrency` still starts a task per refusal), so this subclass does it for the paths
registered with `screen_on_headers`. The screen decides only refusals; whatever it lets through
takes uvicorn's own path unchanged, as does any request on a connection that still has one in
flight (a pipelined request must be answered in order).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from serving.uvicorn_defaults import replace_auto

logger = logging.getLogger(__name__)

RawHeaders = list[tuple[bytes, bytes]]
# A request's raw headers (names lower-cased) -> (status, headers, body) to answer it with now, or
# None to leave it to the ASGI app.
HeaderScreen = Callable[[RawHeaders], tuple[int, RawHeaders, bytes] | None]

_screens: dict[bytes, HeaderScreen] = {}
_STOCK_AUTO = "uvicorn.protocols.http.auto:AutoHTTPProtocol"
_THIS = f"{__name__}:ScreeningProtocol"


def screen_on_headers(path: str, screen: HeaderScreen) -> None:
    """POSTs to `path` (exactly, no percent-encoding) are shown to `screen` first. One screen per
    path and process: the app built last wins."""
    _screens[path.encode("ascii")] = screen


def serve_screening() -> None:
    """uvicorn servers configured from now on in this process with the default `http="auto"` (as
    BentoML's worker configures them) use `ScreeningProtocol`. Idempotent. Raises RuntimeError
    where this uvicorn resolves its protocol some other way, so that an upgrade fails the start
    instead of quietly dropping the screen."""
    replace_auto("HTTP_PROTOCOLS", _STOCK_AUTO, _THIS, "serving/http_protocol.py")


class _Answered:
    """The cycle of a request answered from the headers callback: uvicorn's callbacks see its
    response complete, and drop the rest of its body as they do for any finished response."""

    response_complete = True

    class message_event:
        @staticmethod
        def set() -> None:
            return None


_ANSWERED = _Answered()


class ScreeningProtocol(HttpToolsProtocol):
    def on_headers_complete(self) -> None:
        answer = None
        if _screens:
            try:
                answer = self._screened()
            except Exception:  # the ASGI app answers instead, as it would have without the screen
                logger.exception("the headers screen failed; the request goes to the app")
        if answer is None:
            super().on_headers_complete()
        else:
            self._answer_now(*answer)

    def _screened(self) -> tuple[int, RawHeaders, bytes] | None:
        if self.pipeline or (self.cycle is not None and not self.cycle.response_complete):
            return None
        if self.parser.get_method() != b"POST" or self.parser.should_upgrade():
            return None
        screen = _screens.get(self.root_path.encode("ascii") + httptools.parse_url(self.url).path)
        return screen(self.headers) if screen is not None else None

    def _answer_now(self, status: int, headers: RawHeaders, body: bytes) -> None:
        # A client waiting for 100 Continue never sends the body that the parser would take for
        # the next request: close instead (RFC 9110, 10.1.1), where uvicorn would keep it open.
        keep_alive = (
            self.parser.get_http_version() != "1.0" and self.parser.should_keep_alive() and not self.expect_100_continue
        )
        content = [STATUS_LINE[status]]
        for name, value in (*self.server_state.default_headers, *headers):
            content.extend((name, b": ", value, b"\r\n"))
        if not keep_alive:
            content.append(b"connection: close\r\n")
        content.extend((b"\r\n", body))
        self.transport.write(b"".join(content))
        self.cycle = _ANSWERED  # type: ignore[assignment]
        if not keep_alive:
            self.transport.close()
        self.on_response_complete()
