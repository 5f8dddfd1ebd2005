"""Tokenization off the event loop: encode, chat templates and decode on one worker thread.

One thread: requests tokenize in arrival order and the tokenizer is never used concurrently, while the
event loop that feeds every other stream keeps running (a long prompt takes a while to encode).
"""

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any


class TokenizerPool:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")

    async def _run(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self._run(lambda: list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens)))

    async def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> tuple[str, list[int]]:
        def run() -> tuple[str, list[int]]:
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False, tools=tools
            )
            # The template already carries any BOS; adding special tokens again would double it.
            return text, list(self.tokenizer.encode(text, add_special_tokens=False))

        return await self._run(run)

    async def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return await self._run(lambda: self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
