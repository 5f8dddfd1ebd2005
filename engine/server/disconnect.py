"""Watching for a client that goes away while a non-streamed request runs."""

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request

T = TypeVar("T")


class ClientDisconnected(Exception):
    pass


async def run_until_disconnect(request: Request, coro: Awaitable[T]) -> T:
    """Await `coro` unless the client goes away first; then cancel it (which aborts the request in the
    engine). Starlette does not cancel a non-streaming handler on disconnect, so this watches for it."""
    task = asyncio.ensure_future(coro)

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
    if task.cancelled() or not task.done():
        try:
            await task
        except asyncio.CancelledError:
            pass
        raise ClientDisconnected()
    return task.result()
