"""Logprobs in OpenAI's shapes (chat and completions), with each token's text and exact bytes."""

from typing import Any

from tokenmill.engine.server.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbsContent,
    CompletionLogProbs,
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte <-> printable-character table that byte-level BPE vocabularies are written in."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


_UNICODE_TO_BYTE = {c: b for b, c in _bytes_to_unicode().items()}


class TokenTexts:
    """Token id -> (text as OpenAI shows it, exact bytes), cached. Byte-level BPE tokens can hold half a
    UTF-8 character: their text is U+FFFD but `bytes` still carries the real bytes."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self.byte_level = type(decoder).__name__ == "ByteLevel"
        self.cache: dict[int, tuple[str, list[int]]] = {}

    def get(self, token_id: int) -> tuple[str, list[int]]:
        hit = self.cache.get(token_id)
        if hit is not None:
            return hit
        text = self.tokenizer.decode([token_id])
        raw = text.encode("utf-8")
        if self.byte_level:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if piece is not None and all(ch in _UNICODE_TO_BYTE for ch in piece):
                raw = bytes(_UNICODE_TO_BYTE[ch] for ch in piece)
        self.cache[token_id] = hit = (text, list(raw))
        return hit


def chat_logprobs(
    texts: TokenTexts, token_ids: list[int], logprobs: list[dict[int, float]], top_k: int
) -> list[ChatCompletionLogProbsContent]:
    out = []
    for tid, entry in zip(token_ids, logprobs, strict=False):
        text, raw = texts.get(tid)
        top = sorted(entry.items(), key=lambda kv: kv[1], reverse=True)[:top_k]
        out.append(ChatCompletionLogProbsContent(
            token=text, logprob=_finite(entry[tid]), bytes=raw,
            top_logprobs=[ChatCompletionLogProb(token=texts.get(t)[0], logprob=_finite(lp), bytes=texts.get(t)[1])
                          for t, lp in top],
        ))  # fmt: skip
    return out


def completion_logprobs(
    texts: TokenTexts, token_ids: list[int], logprobs: list[dict[int, float]], text_offset: int
) -> CompletionLogProbs:
    out = CompletionLogProbs()
    for tid, entry in zip(token_ids, logprobs, strict=False):
        text, _ = texts.get(tid)
        out.tokens.append(text)
        out.token_logprobs.append(_finite(entry[tid]))
        out.top_logprobs.append({texts.get(t)[0]: _finite(lp) for t, lp in entry.items()})
        out.text_offset.append(text_offset)
        text_offset += len(text)
    return out


def _finite(x: float) -> float:
    # JSON has no -inf; OpenAI clients expect a number (vLLM clamps the same way).
    return max(float(x), -9999.0)
