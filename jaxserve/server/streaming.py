"""Server-sent events: `data: {json}\\n\\n` per chunk, `data: [DONE]` at the end."""

from __future__ import annotations

import json
import logging

from aiohttp import web

from jaxserve.server.errors import APIError

_DISCONNECTS = (ConnectionResetError, ConnectionAbortedError, BrokenPipeError)


def _dumps(o) -> str:
    return json.dumps(o, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


class SSEWriter:
    def __init__(self, request: web.Request):
        self.request = request
        self.resp = web.StreamResponse(status=200, headers={
            "Content-Type": "text/event-stream; charset=utf-8",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",  # proxies must not buffer the stream
        })
        self.closed = False

    async def start(self) -> None:
        await self.resp.prepare(self.request)

    async def send(self, objs: list[dict]) -> None:
        """Write several events in one go (one engine step's deltas)."""
        if objs and not self.closed:
            await self.resp.write("".join(f"data: {_dumps(o)}\n\n" for o in objs).encode("utf-8"))

    async def send_events(self, objs: list[dict]) -> None:
        """Named events (`event: <type>` then its data), as OpenAI's Responses API streams them."""
        if objs and not self.closed:
            await self.resp.write("".join(f"event: {o['type']}\ndata: {_dumps(o)}\n\n" for o in objs).encode("utf-8"))

    async def error(self, e: APIError) -> None:
        await self.send([e.body()])

    async def finish(self, done: bool = True) -> web.StreamResponse:
        """End the stream (done: with `data: [DONE]`, as chat and completions streams end)."""
        if not self.closed:
            self.closed = True
            if done:
                await self.resp.write(b"data: [DONE]\n\n")
            await self.resp.write_eof()
        return self.resp


def is_disconnect(e: BaseException) -> bool:
    return isinstance(e, _DISCONNECTS)


def failed(w: SSEWriter, e: Exception, what: str) -> web.StreamResponse:
    """A stream's handler raised e (call inside its except block): the client left (its request was already
    aborted), or the headers are out (logged; the stream just ends); before the headers, e is re-raised
    for the error middleware."""
    if is_disconnect(e):
        return w.resp
    if not w.resp.prepared:
        raise e
    logging.getLogger("jaxserve.server").exception("%s failed", what)
    return w.resp
