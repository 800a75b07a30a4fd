"""Server-sent events: `data: {json}\\n\\n` per chunk, `data: [DONE]` at the end."""

from __future__ import annotations

import json

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

    async def error(self, e: APIError) -> None:
        await self.send([e.body()])

    async def finish(self) -> web.StreamResponse:
        if not self.closed:
            self.closed = True
            await self.resp.write(b"data: [DONE]\n\n")
            await self.resp.write_eof()
        return self.resp


def is_disconnect(e: BaseException) -> bool:
    return isinstance(e, _DISCONNECTS)
