"""Server-sent events: the `data:` framing, the [DONE] marker, and merging the streams of several
engine requests (one per prompt) into one."""

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, TypeVar

from pydantic import BaseModel

T = TypeVar("T")


async def merge_async_iterators(iterators: list[AsyncIterator[T]]) -> AsyncGenerator[tuple[int, T], None]:
    """Interleave several async iterators as their items arrive; cancelling the merge cancels them all."""
    if len(iterators) == 1:
        async for item in iterators[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done_marker = object()

    async def drain(i: int, it: AsyncIterator[T]) -> None:
        try:
            async for item in it:
                queue.put_nowait((i, item))
        except Exception as e:
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, done_marker))

    tasks = [asyncio.ensure_future(drain(i, it)) for i, it in enumerate(iterators)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done_marker:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


SSE_DONE = "data: [DONE]\n\n"


def sse(payload: BaseModel | dict[str, Any]) -> str:
    if isinstance(payload, BaseModel):
        body = payload.model_dump_json()
    else:
        body = json.dumps(payload, separators=(",", ":"))
    return f"data: {body}\n\n"
