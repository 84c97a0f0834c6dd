"""HTTP plumbing of generation responses: server-sent events, a streaming response that frees
its admission slot however it ends, and cancelling work when the client disconnects."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from pagedserve.server.state import Slot

DONE = "data: [DONE]\n\n"


def sse(model: BaseModel) -> str:
    return f"data: {model.model_dump_json()}\n\n"


class SlotStreamingResponse(StreamingResponse):
    """A streaming response that frees its slot and closes its stream however it ends."""

    def __init__(self, content: AsyncIterator[str], slot: Slot):
        super().__init__(content, media_type="text/event-stream")
        self.headers["Cache-Control"] = "no-cache"
        self._slot = slot

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self.body_iterator.aclose()
            finally:
                self._slot.release()


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class ClientGone(Exception):
    pass


async def unless_disconnected(request: Request, coro):
    """Run `coro`; if the client disconnects first, cancel it (aborting its engine requests)."""
    work = asyncio.ensure_future(coro)
    watch = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not work.done():
            work.cancel()
        watch.cancel()
    if work.cancelled() or not work.done():
        await asyncio.gather(work, return_exceptions=True)
        raise ClientGone()
    return work.result()
